"""The package version (a leaf module: everything may import it)."""

__version__ = "0.2.0"
