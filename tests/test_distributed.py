"""Ring attention across processes: tvmflash.distributed on gloo, 127.0.0.1.

Each test starts ``world`` processes running this file as a script (``worker`` below). Every
rank draws the same full-sequence inputs from the test's seed, shards them, runs the ring
forward and backward, and all-gathers its out, lse, dq, dk, dv; rank 0 checks the full tensors
(1) against float64 dense attention by the flash-attn rule (error <= 2x plain PyTorch's in the
same dtype + 4 ulps) and (2) against single-process ``tvmflash.flash_attn_func`` with the same
arguments: the ring's partial results are float32 and rounded once, so it must be as accurate
as the single-process kernels (``_as_accurate``: its error vs float64 within the single-process
error + 1 ulp of the dtype (3 in fp32), and every element within a few roundings of the
single-process one). Run with ``-s`` to see the measured errors.

Cost: a process imports torch + TVM in ~5 s, so each spawned group runs many checks. All use
head_dim 64; the parent loads (or compiles, once, into the disk cache) every kernel the workers
use before spawning, so ranks never compile concurrently. Every process started here is killed
if it outlives its deadline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import DTYPES

HEAD_DIM = 64
DEADLINE_S = 240  # per spawned group; generous for 2 shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, scenario: str, seed: int, tmp_path: Path, pg_timeout_s: float = 60,
              deadline_s: float = DEADLINE_S, lingering: tuple = ()) -> list[dict]:
    """Run ``world`` worker processes; returns per rank {rc, out, err, result (last JSON line)}.

    Ranks in ``lingering`` are expected to stay alive: they are killed once the others exited."""
    port = _free_port()
    procs, files = [], []
    base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TVMFLASH_QUIET": "1",
                "TVMFLASH_TEST_SEED": str(seed), "RING_TEST_PG_TIMEOUT": str(pg_timeout_s)}
    try:
        for rank in range(world):
            out = open(tmp_path / f"{scenario}-{rank}.out", "w+")
            err = open(tmp_path / f"{scenario}-{rank}.err", "w+")
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, __file__, scenario], env={**base_env, "RANK": str(rank)},
                                          stdout=out, stderr=err, cwd=Path(__file__).parent))
        deadline = time.monotonic() + deadline_s
        for rank, p in enumerate(procs):
            if rank in lingering:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:  # stragglers: killed, never left behind
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        text_out, text_err = out.read(), err.read()
        out.close()
        err.close()
        lines = [line for line in text_out.splitlines() if line.startswith("{")]
        results.append({"rc": p.returncode, "out": text_out, "err": text_err,
                        "result": json.loads(lines[-1]) if lines else None})
    return results


def assert_all_passed(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["rc"] == 0, f"rank {rank} exited with {r['rc']}:\n{r['err'][-4000:]}"


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Load (or compile, once) the kernels the workers use before any worker starts: per (dtype,
    ALiBi or not) of the cases, the ring's (fp32 results) and the single-process op's; 8 builds
    (float32 results of float32 inputs are the plain kernels)."""
    from tvmflash.torch_op import kernels_for

    variants = {(case[2], case[8] is not None) for cases in CASES.values() for case in cases}
    for dtype, alibi in sorted(variants):
        for fp32_results in (False, True):
            kernels_for(torch.empty(1, 1, 1, HEAD_DIM, dtype=DTYPES[dtype]), alibi=alibi, fp32_results=fp32_results)


# Cases: (layout, causal, dtype, batch, shard length, heads, kv heads, window_size, ALiBi slopes
# None / per "head" / per "batch"). Shard lengths are no multiple of the 64-row tile; zigzag shards
# are even (two chunks). Windows: both sides, causal + left, wider and narrower than a shard or a
# zigzag chunk (world 4's left 5 < chunk 11: each chunk meets only itself and the one before).
NONE = (-1, -1)
CASES = {
    2: [("ring", True, "float32", 1, 37, 4, 2, NONE, None), ("zigzag", True, "float32", 2, 38, 2, 2, NONE, None),
        ("ring", False, "float32", 1, 64, 2, 1, NONE, None), ("zigzag", True, "bfloat16", 1, 50, 4, 2, NONE, None),
        ("ring", True, "float16", 1, 45, 2, 2, NONE, None), ("zigzag", False, "bfloat16", 1, 30, 2, 1, NONE, None),
        ("zigzag", False, "float32", 1, 38, 4, 2, (7, 11), None),
        ("ring", True, "bfloat16", 1, 45, 2, 2, (20, -1), None),
        ("zigzag", True, "bfloat16", 1, 40, 2, 1, NONE, "head"), ("ring", False, "float32", 2, 33, 4, 2, NONE, "batch")],
    3: [("ring", True, "float32", 1, 37, 4, 1, NONE, None), ("zigzag", True, "float32", 1, 38, 4, 2, NONE, None),
        ("ring", False, "float32", 2, 21, 2, 2, NONE, None), ("zigzag", True, "float16", 1, 26, 2, 2, NONE, None),
        ("zigzag", True, "bfloat16", 2, 26, 4, 2, (9, -1), "batch"),
        ("ring", False, "float16", 1, 21, 2, 2, (30, 5), None),
        ("zigzag", False, "float32", 1, 30, 2, 1, (4, 40), "head")],
    4: [("zigzag", True, "float32", 2, 22, 4, 2, NONE, None), ("ring", True, "float32", 1, 37, 2, 2, NONE, None),
        ("ring", False, "float32", 1, 16, 3, 1, NONE, None), ("zigzag", True, "bfloat16", 1, 34, 2, 1, NONE, None),
        ("zigzag", True, "float32", 1, 22, 2, 2, (5, -1), None),
        ("ring", False, "bfloat16", 1, 16, 2, 1, (10, 10), "head"),
        ("zigzag", True, "float16", 2, 34, 4, 2, (30, -1), None)],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process_and_float64(world, seed, tmp_path):
    results = run_ranks(world, f"check{world}", seed, tmp_path)
    assert_all_passed(results)
    report = results[0]["result"]
    assert report["checked"] == len(CASES[world])
    print(f"world {world}: worst ring error vs float64 in ulps of the dtype x magnitude (ring / single process), "
          f"and max |ring - single| in the same units")
    for case, accuracy in report["accuracy"]:
        print(f"  {case}: " + ", ".join(f"{name} {a['ring']:.2f}/{a['single']:.2f} diff {a['diff']:.2f}"
                                      f" ({a['diff_fp32_ulps']:.1f} fp32 ulps, {a['worst']:.2f} roundings)"
                                      for name, a in accuracy.items()))


def test_rank_that_raises_and_lives_on_fails_the_others_within_the_timeout(seed, tmp_path):
    """Rank 1 raises inside the ring (second block) and then stays alive without calling the ring
    again; ranks 0 and 2 must fail with the ring's error once the process group's timeout passes."""
    pg_timeout = 4.0
    results = run_ranks(3, "fail_and_stay", seed, tmp_path, pg_timeout_s=pg_timeout, deadline_s=90, lingering=(1,))
    assert results[1]["result"] == {"raised": "injected failure"}, results[1]["err"][-3000:]
    for rank in (0, 2):
        r = results[rank]
        assert r["rc"] == 0 and r["result"] is not None, f"rank {rank}:\n{r['err'][-3000:]}"
        assert r["result"]["error"] == "RingError", r["result"]
        assert "a peer rank failed or is stuck" in r["result"]["message"]
        assert r["result"]["elapsed_s"] < pg_timeout + 20, r["result"]


def test_rank_that_raises_and_exits_fails_the_others_at_once(seed, tmp_path):
    results = run_ranks(2, "fail_and_exit", seed, tmp_path, pg_timeout_s=60, deadline_s=90)
    assert results[1]["rc"] != 0 and "injected failure" in results[1]["err"]
    r = results[0]
    assert r["rc"] == 0 and r["result"] is not None, r["err"][-3000:]
    assert r["result"]["error"] == "RingError", r["result"]
    assert r["result"]["elapsed_s"] < 30, r["result"]  # far below the 60 s timeout: the socket closed


def test_demo_checks_itself_in_a_world_of_one():
    """The torchrun demo's code path (without torchrun: one process; the ring tests above cover
    several ranks)."""
    env = {**os.environ, "TVMFLASH_QUIET": "1", "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "tvmflash.distributed.demo", "--seqlen", "192", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "peak added MB" in proc.stdout
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["check_ok"] and report["ranks"][0]["peak_added_mb"] > 0


def test_merge_block_handles_rows_that_see_no_key():
    from tvmflash.distributed.ring import merge_block

    inf = float("-inf")
    out = torch.zeros(1, 4, 1, 2)
    lse = torch.full((1, 1, 4), inf)
    block_out = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]).view(1, 4, 1, 2)
    block_lse = torch.tensor([[[0.5, 1.0, inf, inf]]])
    merge_block(out, lse, block_out.clone(), block_lse)  # rows 2, 3: nothing seen yet, nothing in the block
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)
    second_out = torch.tensor([[5.0, 6.0], [0.0, 0.0], [7.0, 8.0], [0.0, 0.0]]).view(1, 4, 1, 2)
    second_lse = torch.tensor([[[0.5, inf, 2.0, inf]]])
    merge_block(out, lse, second_out, second_lse)  # second_out is scratch now
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([3.0, 4.0]))  # equal weights
    torch.testing.assert_close(out[0, 1, 0], torch.tensor([3.0, 4.0]))  # block saw nothing: unchanged
    torch.testing.assert_close(out[0, 2, 0], torch.tensor([7.0, 8.0]))  # first block saw nothing
    assert torch.equal(out[0, 3, 0], torch.zeros(2)) and lse[0, 0, 3] == inf
    torch.testing.assert_close(lse[0, 0, :3], torch.tensor([0.5 + 0.6931472, 1.0, 2.0]))


def global_positions(layout: int, rank: int, world: int, n: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s ``n`` tokens (written out, not from the planner)."""
    from tvmflash.distributed.ring import CONTIGUOUS
    from tvmflash.distributed.shard import zigzag_chunks

    if layout == CONTIGUOUS:
        return torch.arange(rank * n, (rank + 1) * n)
    return torch.cat([torch.arange(c * n // 2, (c + 1) * n // 2) for c in zigzag_chunks(rank, world)])


def global_mask(layout: int, rank: int, source: int, world: int, n: int, window) -> torch.Tensor:
    """(n, n) bool: which of ``source``'s keys each of ``rank``'s queries sees (flash-attn's
    window over the whole sequence; causal is right = 0)."""
    p = global_positions(layout, rank, world, n)[:, None]
    t = global_positions(layout, source, world, n)[None, :]
    left, right = window
    return ((t >= p - left) | (left < 0)) & ((t <= p + right) | (right < 0))


def _band(call) -> torch.Tensor:
    rows, keys = call.rows.stop - call.rows.start, call.keys.stop - call.keys.start
    d = torch.arange(keys)[None, :] - torch.arange(rows)[:, None]
    left, right = call.window
    return ((d >= call.diagonal - left) | (left < 0)) & ((d <= call.diagonal + right) | (right < 0))


PLAN_WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (2, 0), (3, 0), (5, 0), (7, 0), (20, 0), (0, 1), (2, 3), (4, 4),
                (1, 7), (9, 2), (-1, 3), (3, -1)]


def test_block_plans_cover_the_mask_exactly():
    """For every (layout, world, rank, source, window, ALiBi) the plan's kernel calls, painted
    cell by cell, cover exactly the global mask between the two shards, every visible pair once;
    no call computes an empty band; with ALiBi each call's distance |i + diagonal - j| is the
    global one. Without window and ALiBi the plans are the cheap ones (at most one call per step;
    causal zigzag: one diagonal + world - 1 half blocks per rank)."""
    from tvmflash.distributed.ring import CONTIGUOUS, ZIGZAG, block_plan

    for world in (1, 2, 3, 4):
        for n in (2, 6, 8):  # tokens per rank; zigzag chunks of 1, 3, 4
            for layout in (CONTIGUOUS, ZIGZAG):
                for window in PLAN_WINDOWS:
                    for alibi in (False, True):
                        for rank in range(world):
                            work = 0
                            for source in range(world):
                                tag = (layout, world, n, window, alibi, rank, source)
                                calls = block_plan(layout, rank, source, world, n, window, alibi)
                                wanted = global_mask(layout, rank, source, world, n, window)
                                count = torch.zeros(n, n, dtype=torch.int64)
                                for call in calls:
                                    band = _band(call)
                                    assert band.any(), tag  # no call for nothing
                                    count[call.rows, call.keys] += band
                                    if alibi:
                                        i = torch.arange(band.shape[0])[:, None]
                                        j = torch.arange(band.shape[1])[None, :]
                                        p = global_positions(layout, rank, world, n)[call.rows, None]
                                        t = global_positions(layout, source, world, n)[None, call.keys]
                                        distance = (i + call.diagonal - j).abs()
                                        assert torch.equal(distance[band], (p - t).abs()[band]), tag
                                    work += band.numel()
                                assert torch.equal(count, wanted.long()), (tag, calls)
                                if window in ((-1, -1), (-1, 0)) and not alibi:
                                    assert len(calls) <= 1, (tag, calls)
                            if layout == ZIGZAG and window == (-1, 0) and not alibi:  # balanced: the same area
                                assert work == n * n + (world - 1) * n * n // 2, (layout, world, n, rank, work)


def test_options_are_checked_as_the_single_process_op():
    from tvmflash.distributed.ring import check_options

    q = torch.empty(2, 8, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="dropout"):
        check_options(0.1, (-1, -1), False, None, q)
    with pytest.raises(ValueError, match="window_size"):
        check_options(0.0, (-2, 0), False, None, q)
    with pytest.raises(TypeError, match="window_size"):
        check_options(0.0, "wide", False, None, q)
    with pytest.raises(ValueError, match="alibi_slopes"):
        check_options(0.0, (-1, -1), False, torch.ones(3), q)
    with pytest.raises(TypeError, match="alibi_slopes"):
        check_options(0.0, (-1, -1), False, torch.ones(4, dtype=torch.float64), q)
    assert check_options(0.0, [-1, -1], False, None, q) == ((-1, -1), None)
    window, slopes = check_options(0.0, (3, 7), True, torch.arange(4.0), q)  # causal: right = 0
    assert window == (3, 0) and torch.equal(slopes, torch.arange(4.0).view(1, 4))
    assert check_options(0.0, (-1, -1), False, torch.ones(2, 4), q)[1].shape == (2, 4)


# ------------------------------------------------------------------------------------------
# The worker: `python tests/test_distributed.py <scenario>` with RANK, WORLD_SIZE, MASTER_*.


def _init():
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ["RING_TEST_PG_TIMEOUT"]))
    dist.init_process_group("gloo", timeout=timeout)
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def _references(full, dout, causal, window, slopes):
    """float64 and same-dtype plain attention (out, lse, dq, dk, dv) on the whole sequence."""
    from conftest import reference_attention

    refs = {}
    for name, dt in (("f64", torch.float64), ("same", full[0].dtype)):
        leaves = [t.to(dt, copy=True).requires_grad_() for t in full]
        o, lse = reference_attention(*leaves, causal, window_size=window, alibi_slopes=slopes, dtype=dt)
        refs[name] = [t.detach() for t in (o, lse, *torch.autograd.grad(o, leaves, dout.to(dt)))]
    return refs


def _check_case(index: int, case, seed: int, rank: int):
    from conftest import DTYPES, assert_flash_rule, random_inputs, reference_magnitudes

    from tvmflash import flash_attn_func
    from tvmflash import distributed as tdist

    layout, causal, dtype, batch, n, heads, heads_k, window, alibi = case
    world = torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(seed + index)
    full = random_inputs(gen, batch, n * world, n * world, heads, heads_k, HEAD_DIM, dtype)
    dout = torch.randn(full[0].shape, generator=gen).to(DTYPES[dtype])
    slopes = {None: None, "head": lambda: torch.rand(heads, generator=gen) * 0.3,
              "batch": lambda: torch.rand(batch, heads, generator=gen) * 0.3}[alibi]
    slopes = slopes() if slopes else None
    shard, unshard, attn = ((tdist.ring_shard, tdist.ring_unshard, tdist.ring_flash_attn_func) if layout == "ring"
                            else (tdist.zigzag_shard, tdist.zigzag_unshard, tdist.zigzag_ring_flash_attn_func))
    q, k, v = (shard(t, 1).clone().requires_grad_() for t in full)
    out, lse, _ = attn(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == q.shape
    out.backward(shard(dout, 1))
    _check_traffic(layout, causal, window, q, k, rank, world)
    got = [unshard(out, 1), unshard(lse, 2), unshard(q.grad, 1), unshard(k.grad, 1), unshard(v.grad, 1)]
    if rank != 0:
        return None
    tag = f"{case} world {world} (seed {seed})"
    leaves = [t.clone().requires_grad_() for t in full]
    single_out, single_lse, _ = flash_attn_func(*leaves, causal=causal, window_size=window, alibi_slopes=slopes,
                                                return_attn_probs=True)
    single = [single_out.detach(), single_lse, *torch.autograd.grad(single_out, leaves, dout)]
    refs = _references(full, dout, causal, window, slopes)
    magnitude = reference_magnitudes(*full, dout)
    accuracy = {}
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        ours, theirs, f64, same = got[i], single[i], refs["f64"][i], refs["same"][i]
        kind = torch.float32 if name == "lse" else q.dtype
        assert ours.dtype == kind and ours.shape == f64.shape, (tag, name)
        assert torch.isfinite(ours).all(), f"{tag} {name}: not finite"  # every token sees itself
        # (1) flash-attn's rule against float64, as for the single-process op
        assert_flash_rule(f"{tag} {name}", ours, f64, same, kind, seed, magnitude=magnitude[name])
        # (2) as accurate as the single-process kernels
        accuracy[name] = _as_accurate(f"{tag} {name}", ours, theirs, f64, kind, magnitude[name])
    return accuracy


# The ring against single-process flash_attn_func on the whole sequence. Both compute in fp32
# and round to the dtype once (the ring's partials are fp32). Measured over 8 seeds x all cases
# (error in ulps of the dtype x conftest's magnitude):
# (a) error vs float64 <= the single-process error + RING_EXCESS_ULPS: 16-bit out, dq, dk, dv
#     exceed it by 0.00 (two results rounded once differ by at most an ulp at the value, <= 1);
#     float32 tensors (and the fp32 lse) by <= 1.4, the ring's fp32 sums running in another order.
# (b) element by element, |ring - single| <= RING_ROUNDINGS x (one ulp of the dtype at the value
#     + RING_FP32_ULPS fp32 ulps x the magnitude): measured <= 2.7 (16-bit dq, dk: they inherit
#     the 1-ulp differences of the 16-bit out through Delta = rowsum(dO * O)), <= 0.5 in fp32.
#     Partials rounded to 16 bits before the merge (the ring before fp32 partials, emulated)
#     give 16 to 160 here, and exceed (a) by up to 0.56 ulp.
#     bf16 on CPUs with AVX512-BF16 or AMX multiplies P and dS rounded to bf16 (FlashAttention's GPU
#     recipe): each weight carries half a bf16 ulp of relative rounding, against the block's max
#     in the ring and the row's in one process, so (b) allows one bf16 ulp x the magnitude more
#     there (measured up to ~94 roundings without it); fp16 and fp32 keep the sharp check.
RING_EXCESS_ULPS = {torch.float32: 3.0, torch.float16: 1.0, torch.bfloat16: 1.0}
RING_ROUNDINGS = 4.0
RING_FP32_ULPS = 8.0


def _product_input_ulps(dtype) -> float:
    """Relative rounding of P and dS as product inputs, in ulps of ``dtype`` (0: fp32 products)."""
    if dtype != torch.bfloat16:
        return 0.0
    from tvmflash import product_rates, target
    from tvmflash.config import BF16_OPERANDS

    return 1.0 if product_rates.bf16_products(target.host_target()) in BF16_OPERANDS else 0.0


def ulp(dtype) -> float:
    return torch.finfo(dtype).eps  # conftest's


def ulp_at(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at |x| (float64; subnormals included)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double().abs())
    return torch.maximum(torch.ldexp(torch.full_like(x, info.eps, dtype=torch.float64), exponent - 1),
                         torch.tensor(info.smallest_normal * info.eps, dtype=torch.float64))


def _as_accurate(tag, ours, single, f64, dtype, magnitude) -> dict:
    scale = max(1.0, magnitude, f64.abs().max().item())
    unit = ulp(dtype) * scale
    err = (ours.double() - f64).abs().max().item()
    err_single = (single.double() - f64).abs().max().item()
    assert err <= err_single + RING_EXCESS_ULPS[dtype] * unit, (
        f"{tag}: ring error {err:.3g} > single-process {err_single:.3g} + {RING_EXCESS_ULPS[dtype]} ulp x {scale:.3g}")
    diff = (ours.double() - single.double()).abs()
    rounding = ulp_at(torch.maximum(ours.double().abs(), single.double().abs()), dtype) \
        + (RING_FP32_ULPS * ulp(torch.float32) + _product_input_ulps(dtype) * ulp(dtype)) * scale
    worst = (diff / rounding).max().item()
    assert worst <= RING_ROUNDINGS, f"{tag}: ring and single-process differ by {worst:.3g} roundings"
    return {"ring": err / unit, "single": err_single / unit, "diff": diff.max().item() / unit,
            "diff_fp32_ulps": diff.max().item() / (ulp(torch.float32) * scale), "worst": worst}


def _check_traffic(layout: str, causal: bool, window, q, k, rank: int, world: int) -> None:
    """Bytes sent per call = the formula; blocks computed = the blocks the global mask leaves
    something of (causal and windows skip the rest)."""
    from tvmflash.distributed.ring import CONTIGUOUS, ZIGZAG, last_call_stats

    fwd, bwd = last_call_stats["forward"], last_call_stats["backward"]
    kv_bytes = 2 * k.numel() * k.element_size()  # one K/V block
    dkv_bytes = 2 * k.numel() * 4  # one fp32 dK/dV block
    assert fwd["bytes_sent"] == (world - 1) * kv_bytes, fwd
    assert bwd["bytes_sent"] == (world - 1) * kv_bytes + world * dkv_bytes, bwd
    left, right = window[0], 0 if causal else window[1]
    code = CONTIGUOUS if layout == "ring" else ZIGZAG
    blocks = sum(bool(global_mask(code, rank, s, world, q.shape[1], (left, right)).any()) for s in range(world))
    if causal and window == NONE and layout == "ring":
        assert blocks == rank + 1
    assert fwd["blocks"] == bwd["blocks"] == blocks, (fwd, bwd, blocks)
    assert fwd["calls"] == bwd["calls"] >= blocks, (fwd, bwd)


def _expect_error(fn, kind, text: str):
    try:
        fn()
    except kind as err:
        assert text in str(err), f"expected {text!r} in: {err}"
        return
    raise AssertionError(f"no {kind.__name__} raised (expected one mentioning {text!r})")


def _check_errors(rank: int) -> None:
    """Bad calls raise on every rank at once (no rank is left waiting)."""
    from tvmflash import distributed as tdist

    def qkv(n):
        return tuple(torch.randn(1, n, 2, HEAD_DIM) for _ in range(3))

    # Shard lengths differ on rank 1: every rank raises, naming the field and the ranks.
    _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(20 + (rank == 1))), ValueError, "ranks disagree on seqlen")
    # Different causal flags.
    _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), causal=rank == 0), ValueError, "disagree on causal")
    # Different windows, or ALiBi slopes that differ in one value.
    _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), window_size=(4 + rank, 0)), ValueError,
                  "disagree on window_size left")
    _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), alibi_slopes=torch.tensor([0.5, 0.25 * (1 + rank)])),
                  ValueError, "disagree on alibi_slopes")
    # Only rank 1 passes slopes of a wrong shape: it raises, the others learn of it.
    if rank == 1:
        _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), alibi_slopes=torch.ones(3)), ValueError,
                      "alibi_slopes must have shape")
    else:
        _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8)), ValueError, "rank(s) [1] rejected their inputs")
    _expect_error(lambda: tdist.zigzag_ring_flash_attn_func(*qkv(7)), ValueError, "must be even")
    _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), dropout_p=0.1), ValueError, "dropout")


def _inject_failure(on_call: int):
    """Make this rank's block_forward raise on its ``on_call``-th call."""
    from tvmflash.distributed import _blocks

    real, calls = _blocks.block_forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    _blocks.block_forward = failing


def _run_ring_expecting_error(rank: int) -> None:
    from tvmflash import distributed as tdist

    q, k, v = (torch.randn(1, 40, 2, HEAD_DIM, requires_grad=True) for _ in range(3))
    start = time.monotonic()
    try:
        for _ in range(3):  # forward + backward, again and again: a healthy peer never finishes
            tdist.ring_flash_attn_func(q, k, v).sum().backward()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        print(json.dumps({"error": type(err).__name__, "message": str(err),
                          "elapsed_s": time.monotonic() - start}), flush=True)
        return
    print(json.dumps({"error": None}), flush=True)


def worker(scenario: str) -> None:
    rank, world = _init()
    seed = int(os.environ["TVMFLASH_TEST_SEED"])
    if scenario.startswith("check"):
        if world == 2:
            _check_errors(rank)
        accuracy = [(str(case), _check_case(index, case, seed, rank)) for index, case in enumerate(CASES[world])]
        print(json.dumps({"checked": len(CASES[world]), "accuracy": accuracy}), flush=True)
        torch.distributed.destroy_process_group()
        return
    if scenario in ("fail_and_stay", "fail_and_exit"):
        if rank != 1:
            _run_ring_expecting_error(rank)
            os._exit(0)  # the group is broken: skip its teardown
        from tvmflash import distributed as tdist

        _inject_failure(on_call=2)
        q, k, v = (torch.randn(1, 40, 2, HEAD_DIM, requires_grad=True) for _ in range(3))
        if scenario == "fail_and_exit":
            tdist.ring_flash_attn_func(q, k, v).sum().backward()  # raises: the process exits with it
        try:
            tdist.ring_flash_attn_func(q, k, v).sum().backward()
        except RuntimeError as err:
            print(json.dumps({"raised": str(err)}), flush=True)
        time.sleep(600)  # alive, never calls the ring again; the parent kills it
        return
    raise ValueError(f"unknown scenario {scenario}")


if __name__ == "__main__":
    worker(sys.argv[1])
