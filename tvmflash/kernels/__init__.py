"""The fused kernels as TensorIR: ``cpu`` (forward and backward for CPUs), ``decode`` (decoding
against a KV cache on CPUs), ``cuda`` (tensor-core kernels for NVIDIA GPUs), all built on
``common`` (the kernel context: sequences, windows, tile ranges, block masks, score mods).
Code generation imports them on a cache miss only (``build.py``)."""
