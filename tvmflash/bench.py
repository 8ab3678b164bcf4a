"""Benchmark harness: tvmflash vs PyTorch's scaled_dot_product_attention, same process.

Methodology (machines are noisy; absolute times do not compare across runs):
* every candidate runs once per round, rounds interleave the candidates, and the reported time
  is the median over rounds; ratios are computed from those medians (``> 1``: tvmflash faster);
* a short pause precedes each timed call, so thread pools that spin after their last job (TVM's
  and PyTorch's OpenMP) have gone idle and do not steal the other candidate's cores;
* FLOPs are counted as FlashAttention does: forward 4 * B * H * Nq * Nk * D, backward 2.5x,
  halved when causal (so causal GFLOP/s are comparable with non-causal ones).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .analysis import model_flops
from .reference import geomean, interleaved_times, median_times  # noqa: F401 - the one timing helper, re-exported
from .torch_op import flash_attn_func, kernels_for


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False

    def label(self) -> str:
        mask = " causal" if self.causal else ""
        return f"B{self.batch} N{self.seqlen} H{self.heads} D{self.head_dim} {self.dtype}{mask}"

    def flops(self, phase: str) -> float:
        """Model FLOPs of "fwd", "bwd" or "fwd+bwd"."""
        kernel = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward"}[phase]
        return model_flops(kernel, self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)


# The shapes the core issue asks for.
STANDARD_CASES = [
    Case(1, 2048, 8, 64),
    Case(1, 2048, 8, 64, causal=True),
    Case(1, 4096, 4, 128, causal=True),
    Case(2, 1024, 8, 128),
    Case(1, 2048, 8, 64, "bfloat16", causal=True),
    Case(1, 8192, 1, 64),
]


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(4)]


def _sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return run


IMPLEMENTATIONS = {
    "tvmflash": lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal),
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_math": _sdpa(SDPBackend.MATH),
}


def _fwd_and_bwd_calls(impl, q, k, v, dout, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            impl(*leaves, causal)

    def fwd_bwd():
        out = impl(*leaves, causal)
        torch.autograd.grad(out, leaves, dout)

    state = {}

    def bwd():  # backward alone, from a forward graph built outside the timed region
        if "out" not in state:
            state["out"] = impl(*leaves, causal)
        torch.autograd.grad(state["out"], leaves, dout, retain_graph=True)

    return fwd, fwd_bwd, bwd


def run_case(case: Case, rounds: int = 7, implementations=("tvmflash", "sdpa_flash", "sdpa_math")) -> dict:
    """Time forward, backward and forward+backward of each implementation; returns medians."""
    q, k, v, dout = _inputs(case)
    kernels_for(q, causal=case.causal)  # compile (or load) outside the timed region
    calls = {}
    for name in implementations:
        fwd, fwd_bwd, bwd = _fwd_and_bwd_calls(IMPLEMENTATIONS[name], q, k, v, dout, case.causal)
        calls[f"{name}/fwd"], calls[f"{name}/bwd"], calls[f"{name}/fwd+bwd"] = fwd, bwd, fwd_bwd
    per_round = interleaved_times(calls, rounds)
    times = {name: statistics.median(t) for name, t in per_round.items()}
    result = {"case": case, "times": times, "per_round": per_round}
    result["gflops"] = {key: case.flops(key.split("/")[1]) / t / 1e9 for key, t in times.items()}
    return result


def ratio(result: dict, baseline: str, phase: str) -> float:
    """Speed of tvmflash relative to ``baseline`` for a phase (> 1: tvmflash faster)."""
    t = result["times"]
    return t[f"{baseline}/{phase}"] / t[f"tvmflash/{phase}"]
