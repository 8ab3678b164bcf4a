"""tvmflash: FlashAttention forward and backward written with Apache TVM.

    import tvmflash
    kernels = tvmflash.compile("llvm", head_dim=64, dtype="float32", causal=False)
    kernels.forward(q, k, v, out, lse, softmax_scale)      # any DLPack tensors

    from tvmflash import flash_attn_func                    # PyTorch ops with autograd
    out = flash_attn_func(q, k, v, causal=True)             # (batch, seqlen, heads, head_dim)
    from tvmflash import flex_attention                     # torch's FlexAttention API, fused backward

Layers (imports point down; ``tests/test_architecture.py`` declares and checks them, README
draws them): tools (``tune``, ``bench``, ``memory``, ``analysis``, ``reference``, ``demo``) use
the PyTorch functions (``torch_op``, ``flex``, ``kvcache``, ``integrations``, ``distributed``),
which use ``flex_trace`` (user mods traced into TIR) and ``compiler`` (what to build, caches).
``compiler`` uses ``runtime`` (kernel objects, ``load``; TVM's runtime alone) and, on a cache miss
only, ``build`` (code generation: ``kernels`` (cpu, decode, cuda on one kernel context), ``schedules``, ``score_mods``, ``attention_te``).
Below them all: ``spec``, ``config``, ``plan`` (the launch plan the runtime fills and the kernels
read), ``checks``, ``target``, ``settings``. Nothing below the PyTorch functions imports torch.
"""

from . import settings as _settings

_settings.configure_tvm_threads()  # before anything starts TVM's thread pool

from .compiler import compile, compile_spec, prebuild  # noqa: E402
from .config import CPUKernelConfig, CUDAKernelConfig, RegisterTile  # noqa: E402
from .runtime import FlashKernels, load  # noqa: E402
from .settings import cache_dir  # noqa: E402
from .version import __version__  # noqa: E402

# The PyTorch functions are imported on first use: the compile API works without torch.
_TORCH_API = {
    "flash_attn_func": "torch_op", "flash_attn_qkvpacked_func": "torch_op", "flash_attn_kvpacked_func": "torch_op",
    "flash_attn_varlen_func": "torch_op", "flash_attn_varlen_qkvpacked_func": "torch_op",
    "flash_attn_varlen_kvpacked_func": "torch_op",
    "flex_attention": "flex", "create_block_mask": "flex",
}
_TORCH_API["flash_attn_with_kvcache"] = "kvcache"


def __getattr__(name):
    module = _TORCH_API.get(name)
    if module is None:
        raise AttributeError(f"module 'tvmflash' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = ["CPUKernelConfig", "CUDAKernelConfig", "FlashKernels", "RegisterTile", "cache_dir", "compile", "compile_spec",
           "load", "prebuild", "__version__", *_TORCH_API]
