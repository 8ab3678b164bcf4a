"""The package version and the oldest torch and transformers it supports (a leaf module:
everything may import it; it imports neither library)."""

import os
import warnings

__version__ = "0.2.0"

# The oldest releases tvmflash is tested with (README, pyproject). Older ones are refused with a
# clear error rather than left to fail somewhere inside: besides public APIs of torch 2.4-2.5
# (torch.library.custom_op / register_fake / register_autograd, torch.get_autocast_dtype,
# torch.nn.attention.flex_attention), the PyTorch layer relies on private ones whose names and
# behaviour move between releases (torch._C._len_torch_function_stack,
# torch._C._functorch.maybe_current_level, torch._C._dispatch_key_for_device,
# torch._dynamo._trace_wrapped_higher_order_op, torch._guards.tracing, make_fx's decompositions).
MIN_TORCH = (2, 13)
MIN_TRANSFORMERS = (5, 23)
# Set to 1 to run with an older release anyway (a warning instead of the ImportError): for machines
# whose torch cannot be replaced, such as the GPU machines the CUDA check runs on (torch 2.11 there).
ALLOW_UNTESTED_ENV = "TVMFLASH_ALLOW_UNTESTED"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.13.0+cpu' or '2.14.0a0+git1234'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise ImportError(f"cannot read the version {version!r}") from None


def require(library: str, version: str, minimum: tuple[int, int]) -> None:
    """ImportError naming the installed and the required release when ``version`` is older."""
    if release(version) < minimum:
        need = ".".join(map(str, minimum))
        if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            warnings.warn(f"tvmflash runs with {library} {version}, older than {need}, the oldest release it is "
                          f"tested with (${ALLOW_UNTESTED_ENV}=1)", stacklevel=3)
            return
        raise ImportError(f"tvmflash needs {library} >= {need} (the oldest release it is tested with), found "
                          f"{library} {version}: upgrade it, e.g. pip install '{library}>={need}'")
