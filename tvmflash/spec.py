"""What a fused kernel computes: ``AttentionSpec``, the part of every cache key that is math.

Pure Python (no TVM, no torch): the runtime, the planner and the caches read specs without
TVM's compiler. How a kernel is tiled and scheduled is the other half of a key, the config
(``config.py``).

A spec fixes everything that changes the kernel's code:

* head dim and dtypes (``dtype`` of q, k, v, dout; ``out_dtype`` of out, dq, dk, dv: the same,
  or float32 for callers that sum partial results themselves, such as ring attention);
* ``score_mods``: functions applied to each scaled score before the softmax, in order: the
  built-in ``Softcap`` and ``Alibi`` of flash-attn's API, or a score_mod traced from Python
  (``flex_trace``). Each brings the kernel inputs it reads (``inputs``: the softcap value, the
  slopes, captured tensors);
* ``mask_mod``: a traced mask function, evaluated only on tiles the block mask marks partial;
* ``block_sparse``: whether a block mask (per-tile states) says which tiles to skip.

Masks that are rectangles of the (query, key) plane, causal and sliding windows, are runtime
arguments of every kernel (``window_left``/``window_right``), and so are sequence lengths
(batched or packed "varlen" sequences), so none of them needs its own compile.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 256
# Window sizes are runtime arguments of the kernels; "no limit" is this many positions, far
# beyond any sequence (and far from int64 overflow in the kernels' index arithmetic).
UNLIMITED_WINDOW = 1 << 40

# The backward recomputes P = exp(S * scale - LSE) from the fp32 LSE the forward stored: its
# rounding (half an ulp) is the error of every recomputed exponent. Beyond this magnitude that is
# more than 0.4 % of P: far outside fp32 attention's accuracy, so it is an error, not a result.
MAX_RECOMPUTABLE_LSE = 2.0**16


def unrecomputable_lse_message(reached: str) -> str:
    """The error for an LSE at or past ``MAX_RECOMPUTABLE_LSE`` (``reached``: how large it was)."""
    return (f"the forward's log-sum-exp reached {reached}: the backward recomputes the probabilities from this "
            f"float32 value, whose rounding at that size exceeds 0.4 % of them (the backward supports |lse| < "
            f"{MAX_RECOMPUTABLE_LSE:.0f}, i.e. softmax_scale * |q . k| below that); use a smaller softmax_scale "
            "or normalize q and k")


@dataclass(frozen=True)
class ModInput:
    """A tensor a score/mask mod reads in the kernel. ``shape`` entries of None are sizes the
    kernel takes from the tensor it gets (e.g. the number of heads)."""

    name: str
    shape: tuple
    dtype: str = "float32"
    requires_grad: bool = False


@dataclass(frozen=True)
class Softcap:
    """flash-attn's ``softcap``: ``s -> c * tanh(s / c)``, with c a runtime value."""

    key = "softcap"
    inputs = (ModInput("softcap", (1,)),)


@dataclass(frozen=True)
class Alibi:
    """flash-attn's ``alibi_slopes``: ``s -> s - slope[b, h] * |q + seqlen_k - seqlen_q - k|``.

    Slopes are (heads,) or (batch, heads) float32; the kernel reads them as (1 or batch, heads).
    """

    key = "alibi"
    inputs = (ModInput("alibi_slopes", (None, None)),)


@dataclass(frozen=True)
class AttentionSpec:
    head_dim: int
    dtype: str
    out_dtype: str = ""  # "" = dtype
    score_mods: tuple = ()
    mask_mod: object = None
    block_sparse: bool = False

    def __post_init__(self):
        if not self.out_dtype:
            object.__setattr__(self, "out_dtype", self.dtype)

    @property
    def mod_inputs(self) -> tuple[ModInput, ...]:
        """Every input tensor of the mods, in kernel-argument order."""
        found: dict[str, ModInput] = {}
        for mod in (*self.score_mods, *((self.mask_mod,) if self.mask_mod is not None else ())):
            for i in _inputs_of(mod):
                # a score_mod and a mask_mod may read the same captured tensor: one input
                if i.name in found and found[i.name] != i:
                    raise ValueError(f"score/mask mods declare two different inputs named {i.name!r}")
                found[i.name] = i
        return tuple(found.values())

    @property
    def grad_inputs(self) -> tuple[ModInput, ...]:
        """Mod inputs whose gradient the backward computes (captured tensors that require it)."""
        return tuple(i for i in self.mod_inputs if i.requires_grad)

    def to_json(self) -> dict:
        return {
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "out_dtype": self.out_dtype,
            "score_mods": [mod.key for mod in self.score_mods],
            "mask_mod": None if self.mask_mod is None else self.mask_mod.key,
            "block_sparse": self.block_sparse,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        parts = [f"head_dim={self.head_dim}", self.dtype]
        if self.out_dtype != self.dtype:
            parts.append(f"{self.out_dtype} results")
        parts += [mod.key if len(mod.key) < 24 else "score_mod" for mod in self.score_mods]
        if self.mask_mod is not None:
            parts.append("mask_mod")
        if self.block_sparse:
            parts.append("block-sparse")
        return ", ".join(parts)


def _inputs_of(mod) -> tuple[ModInput, ...]:
    """Built-in mods declare ``inputs``; traced ones (flex_trace) list their captured tensors."""
    if hasattr(mod, "inputs"):
        return tuple(mod.inputs)
    return tuple(ModInput(c.name, tuple(c.shape), str(c.dtype).removeprefix("torch."), bool(c.requires_grad))
                 for c in mod.captured)
