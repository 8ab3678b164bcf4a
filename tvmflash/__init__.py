"""tvmflash: FlashAttention forward and backward written with Apache TVM.

    import tvmflash
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="float32", causal=False)
    kernels.forward(q, k, v, out, lse, softmax_scale)      # any DLPack tensors

    from tvmflash import flash_attn_func                    # PyTorch op with autograd
    out = flash_attn_func(q, k, v, causal=True)             # (batch, seqlen, heads, head_dim)
"""

import os as _os

__version__ = "0.1.0"


def _configure_tvm_threads() -> None:
    # TVM sizes its thread pool once, at first use, to hardware_concurrency / 2 on x86 ("ignore
    # hyper-threading"): one thread on a 2-vCPU machine. Use every CPU we may run on instead,
    # unless the user chose (TVM_NUM_THREADS, or OMP_NUM_THREADS which TVM also reads).
    if "TVM_NUM_THREADS" not in _os.environ and "OMP_NUM_THREADS" not in _os.environ:
        try:
            n = len(_os.sched_getaffinity(0))
        except AttributeError:
            n = _os.cpu_count() or 1
        _os.environ["TVM_NUM_THREADS"] = str(n)


_configure_tvm_threads()

from .compiler import FlashKernels, cache_dir, compile, load, prebuild  # noqa: E402
from .target import host_target  # noqa: E402


def __getattr__(name):
    # The PyTorch op is imported lazily: the compile API works without importing torch.
    if name == "flash_attn_func":
        from .torch_op import flash_attn_func

        return flash_attn_func
    raise AttributeError(name)


__all__ = ["FlashKernels", "cache_dir", "compile", "flash_attn_func", "host_target", "load", "prebuild", "__version__"]
