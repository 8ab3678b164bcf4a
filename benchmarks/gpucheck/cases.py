"""What the stages run: the correctness and speed grids, the kernels they need, inputs, FLOPs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# FlashAttention's FLOP model, as tvmflash.analysis.model_flops (which imports TVM's compiler, absent
# on the GPU machine; the tests check that the two agree): the forward's two matrix products,
# 4 * B * H * Nq * Nk * D, halved when causal; the backward 2.5x that (five products).
PHASE_FLOPS_RATIO = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def model_flops(phase: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                causal: bool) -> float:
    """Model FLOPs of "fwd", "bwd" or "fwd+bwd"."""
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return PHASE_FLOPS_RATIO[phase] * (forward / 2 if causal else forward)


@dataclass(frozen=True)
class CorrectnessCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: str
    causal: bool
    # flash-attn's variants: sliding window (left, right), softcap, ALiBi slopes (drawn per case)
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    # packed: ``batch`` sequences of random lengths up to seqlen_q / seqlen_k, flash_attn_varlen_func
    packed: bool = False

    def label(self) -> str:
        mask = " causal" if self.causal else ""
        variant = (f" window{self.window}" * (self.window != (-1, -1)) + f" softcap{self.softcap:g}" * bool(self.softcap)
                   + " alibi" * self.alibi + " varlen" * self.packed)
        return (f"B{self.batch} Nq{self.seqlen_q} Nk{self.seqlen_k} H{self.heads}/{self.heads_k} "
                f"D{self.head_dim} {SHORT[self.dtype]}{mask}{variant}")

    def variant(self) -> dict:
        """flash_attn_func's / reference_attention's arguments for the variant (slopes: a fixed draw)."""
        slopes = None
        if self.alibi:
            slopes = torch.rand(self.heads, generator=torch.Generator().manual_seed(self.heads))
        return {"window_size": self.window, "softcap": self.softcap, "alibi_slopes": slopes}


@dataclass(frozen=True)
class SpeedCase:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool

    def label(self) -> str:
        mask = " causal" if self.causal else ""
        return f"N{self.seqlen} D{self.head_dim} {SHORT[self.dtype]}{mask} (B{self.batch} H{self.heads})"

    def flops(self, phase: str) -> float:
        return model_flops(phase, self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)


# Shapes (batch, seqlen_q, seqlen_k, heads, heads_k): odd lengths, Nq != Nk both ways (with the
# causal mask, Nq > Nk leaves the first Nq - Nk rows without a visible key), GQA and MQA,
# single-token queries/keys, lengths just past a tile.
CUDA_SHAPES = [
    (2, 77, 77, 8, 2),
    (1, 333, 1000, 8, 2),
    (1, 1000, 333, 8, 8),
    (2, 1000, 1000, 8, 2),
    (1, 1, 1000, 8, 1),
    (3, 1, 1, 8, 2),
    (1, 129, 65, 8, 4),
]
CPU_SHAPES = [(2, 77, 50, 4, 2), (1, 1, 33, 4, 1), (1, 65, 129, 4, 4)]


def correctness_cases(device: str, quick: bool) -> list[CorrectnessCase]:
    if device == "cuda":
        variants = [(dt, d, c) for dt in ("bfloat16", "float16") for d in (64, 128) for c in (False, True)]
        shapes = CUDA_SHAPES
    else:
        variants = [("float32", 64, False), ("bfloat16", 64, True)]
        shapes = CPU_SHAPES
    cases = []
    for i, (dtype, head_dim, causal) in enumerate(variants):
        # quick: 2 shapes per variant, rotating, so every shape still meets both masks.
        chosen = [shapes[(2 * i + j) % len(shapes)] for j in range(2)] if quick else shapes
        cases += [CorrectnessCase(b, nq, nk, h, hk, head_dim, dtype, causal) for b, nq, nk, h, hk in chosen]
    if device == "cuda":  # flash-attn's variants, fused (runtime windows; softcap and ALiBi compiled in)
        cases += [CorrectnessCase(1, 1000, 777, 8, 2, 128, "bfloat16", False, window=(256, 0)),
                  CorrectnessCase(2, 333, 333, 4, 4, 64, "float16", True, softcap=30.0, alibi=True),
                  CorrectnessCase(1, 77, 1000, 4, 1, 64, "bfloat16", False, window=(100, 50), softcap=5.0),
                  CorrectnessCase(5, 1000, 777, 8, 2, 128, "bfloat16", True, packed=True),
                  CorrectnessCase(3, 333, 1000, 4, 4, 64, "float16", False, window=(64, 64), alibi=True, packed=True)]
    return cases


def speed_cases(device: str, quick: bool, case_filter: dict | None = None) -> list[SpeedCase]:
    """The grid, most important first: the issue's bar (N=8K, D=128, bf16) leads."""
    if device == "cuda":
        seqlens = [2048, 8192, 16384] if quick else [1024, 2048, 4096, 8192, 16384]
        dtypes = ["bfloat16"] if quick else ["bfloat16", "float16"]
        grid = [SpeedCase(max(1, 16384 // n), n, 2048 // d, d, dtype, causal)
                for dtype in dtypes for d in (128, 64) for causal in (False, True) for n in seqlens
                if not (quick and d == 64 and n != 8192)]
        if quick:
            grid.append(SpeedCase(2, 8192, 16, 128, "float16", False))
    else:
        grid = [SpeedCase(1, 256, 2, 64, "float32", False), SpeedCase(1, 256, 2, 64, "bfloat16", True)]
        if not quick:
            grid.append(SpeedCase(1, 512, 2, 64, "float32", False))
    bar = [c for c in grid if c.seqlen == 8192 and c.head_dim == 128 and c.dtype == "bfloat16"]
    grid = bar + [c for c in grid if c not in bar]
    if case_filter:
        grid = [c for c in grid if all(getattr(c, k) in v for k, v in case_filter.items())]
    return grid


def long_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def variants_needed(args) -> list[tuple[str, int, bool]]:
    """(dtype, head_dim, causal) of every kernel the selected stages will call. Kernels take the
    mask per call (one kernel per dtype and head dim): causal is always False."""
    found = []
    if "correctness" in args.stage_list:
        found += [(c.dtype, c.head_dim, c.causal) for c in correctness_cases(args.device, args.quick)]
    if "speed" in args.stage_list:
        found += [(c.dtype, c.head_dim, c.causal) for c in speed_cases(args.device, args.quick, args.case_filter)]
    if "long" in args.stage_list:
        found.append((long_dtype(args.device), args.long_head_dim, False))
    return list(dict.fromkeys((dtype, d, False) for dtype, d, _ in found))


def mod_variants_needed(args) -> list[tuple[str, int, bool, bool]]:
    """(dtype, head_dim, softcap, alibi) of the kernels with score mods the correctness stage
    calls (flash-attn's variants; windows need no kernel of their own)."""
    if "correctness" not in args.stage_list:
        return []
    found = [(c.dtype, c.head_dim, bool(c.softcap), c.alibi) for c in correctness_cases(args.device, args.quick)]
    return list(dict.fromkeys(v for v in found if v[2] or v[3]))


def format_variant(v) -> str:
    dtype, head_dim, causal = v
    return f"{dtype}:{head_dim}:{int(causal)}"


def parse_variant(text: str):
    dtype, head_dim, causal = text.split(":")
    return dtype, int(head_dim), causal == "1"


def draw(gen: torch.Generator, shape, dtype: str, device: str) -> torch.Tensor:
    """Standard normal values, drawn on the CPU (the same on every device), in ``dtype``."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=getattr(torch, dtype))


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def call_timed(fn, device: str):
    """(fn(), seconds) of one call, the device's work included: for what runs once (a warm-up, the
    long case); repeated measurements go through tvmflash.reference.median_times."""
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start
