"""Ring attention across processes: tvmflash.distributed on gloo, 127.0.0.1.

Each test starts ``world`` processes running this file as a script (``worker`` below). Every
rank draws the same full-sequence inputs from the test's seed, shards them, runs the ring
forward and backward, and all-gathers its out, lse, dq, dk, dv; rank 0 checks the full tensors
(1) against float64 dense attention by the flash-attn rule (``assert_matches_reference``) and
(2) against single-process ``tvmflash.flash_attn_func``: the ring must be as accurate as the
single-process kernels (error vs float64 <= 2x theirs + a few ulps).

Cost: a process imports torch + TVM in ~5 s, so each spawned group runs many checks. All use
head_dim 64, whose kernels the rest of the suite compiles too (disk cache); the parent loads
them before spawning so that ranks never compile concurrently. Every process started here is
killed if it outlives its deadline.
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
    """Load (or compile, once) the kernels the workers use before any worker starts."""
    from tvmflash.torch_op import kernels_for

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for causal in (False, True):
            kernels_for(torch.empty(1, 1, 1, HEAD_DIM, dtype=dtype), causal)


# Cases: (layout, causal, dtype, batch, shard length, heads, kv heads). Shard lengths are no
# multiple of the 64-row tile; zigzag shards are even (two chunks).
CASES = {
    2: [("ring", True, "float32", 1, 37, 4, 2), ("zigzag", True, "float32", 2, 38, 2, 2),
        ("ring", False, "float32", 1, 64, 2, 1), ("zigzag", True, "bfloat16", 1, 50, 4, 2),
        ("ring", True, "float16", 1, 45, 2, 2), ("zigzag", False, "bfloat16", 1, 30, 2, 1)],
    3: [("ring", True, "float32", 1, 37, 4, 1), ("zigzag", True, "float32", 1, 38, 4, 2),
        ("ring", False, "float32", 2, 21, 2, 2), ("zigzag", True, "float16", 1, 26, 2, 2)],
    4: [("zigzag", True, "float32", 2, 22, 4, 2), ("ring", True, "float32", 1, 37, 2, 2),
        ("ring", False, "float32", 1, 16, 3, 1), ("zigzag", True, "bfloat16", 1, 34, 2, 1)],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process_and_float64(world, seed, tmp_path):
    results = run_ranks(world, f"check{world}", seed, tmp_path)
    assert_all_passed(results)
    assert results[0]["result"]["checked"] == len(CASES[world])


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
    merge_block(out, lse, block_out, block_lse)  # rows 2, 3: nothing seen yet, nothing in the block
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)
    second_out = torch.tensor([[5.0, 6.0], [0.0, 0.0], [7.0, 8.0], [0.0, 0.0]]).view(1, 4, 1, 2)
    second_lse = torch.tensor([[[0.5, inf, 2.0, inf]]])
    merge_block(out, lse, second_out, second_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([3.0, 4.0]))  # equal weights
    torch.testing.assert_close(out[0, 1, 0], torch.tensor([3.0, 4.0]))  # block saw nothing: unchanged
    torch.testing.assert_close(out[0, 2, 0], torch.tensor([7.0, 8.0]))  # first block saw nothing
    assert torch.equal(out[0, 3, 0], torch.zeros(2)) and lse[0, 0, 3] == inf
    torch.testing.assert_close(lse[0, 0, :3], torch.tensor([0.5 + 0.6931472, 1.0, 2.0]))


def test_block_plans_cover_the_causal_mask_exactly():
    """For every (rank, source) the plan's visible (query, key) pairs are exactly those of the
    global causal mask between the two shards, for both layouts."""
    from tvmflash.distributed.ring import CONTIGUOUS, ZIGZAG, block_plan
    from tvmflash.distributed.shard import zigzag_chunks

    for world in (1, 2, 3, 4):
        n = 6  # tokens per rank; zigzag chunks of 3
        for layout in (CONTIGUOUS, ZIGZAG):
            def positions(rank):
                if layout == CONTIGUOUS:
                    return torch.arange(rank * n, (rank + 1) * n)
                return torch.cat([torch.arange(c * n // 2, (c + 1) * n // 2) for c in zigzag_chunks(rank, world)])

            for rank in range(world):
                for source in range(world):
                    wanted = positions(source)[None, :] <= positions(rank)[:, None]
                    got = torch.zeros(n, n, dtype=torch.bool)
                    plan = block_plan(layout, True, rank, source, n)
                    if plan is not None:
                        rows, keys, causal = plan
                        block = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.bool)
                        if causal:
                            block = block.tril(keys.stop - keys.start - (rows.stop - rows.start))
                        got[rows, keys] = block
                    assert torch.equal(got, wanted), (layout, world, rank, source)


def test_unsupported_parameters_raise_clearly():
    from tvmflash.distributed.ring import check_unsupported

    with pytest.raises(ValueError, match="dropout"):
        check_unsupported(0.1, (-1, -1), None)
    with pytest.raises(NotImplementedError, match="window_size"):
        check_unsupported(0.0, (128, 0), None)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        check_unsupported(0.0, (-1, -1), torch.ones(4))
    check_unsupported(0.0, [-1, -1], None)


# ------------------------------------------------------------------------------------------
# The worker: `python tests/test_distributed.py <scenario>` with RANK, WORLD_SIZE, MASTER_*.


def _init():
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ["RING_TEST_PG_TIMEOUT"]))
    dist.init_process_group("gloo", timeout=timeout)
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def _check_case(index: int, case, seed: int, rank: int) -> None:
    from conftest import DTYPES, assert_flash_rule, assert_matches_reference, random_inputs, reference_attention

    from tvmflash import flash_attn_func
    from tvmflash import distributed as tdist

    layout, causal, dtype, batch, n, heads, heads_k = case
    world = torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(seed + index)
    full = random_inputs(gen, batch, n * world, n * world, heads, heads_k, HEAD_DIM, dtype)
    dout = torch.randn(full[0].shape, generator=gen).to(DTYPES[dtype])
    shard, unshard, attn = ((tdist.ring_shard, tdist.ring_unshard, tdist.ring_flash_attn_func) if layout == "ring"
                            else (tdist.zigzag_shard, tdist.zigzag_unshard, tdist.zigzag_ring_flash_attn_func))
    q, k, v = (shard(t, 1).clone().requires_grad_() for t in full)
    out, lse, _ = attn(q, k, v, causal=causal, return_attn_probs=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == q.shape
    out.backward(shard(dout, 1))
    _check_traffic(layout, causal, q, k, rank, world)
    got = [unshard(out, 1), unshard(lse, 2), unshard(q.grad, 1), unshard(k.grad, 1), unshard(v.grad, 1)]
    if rank != 0:
        return
    tag = f"{case} world {world}"
    assert_matches_reference(tag, (*full, dout), got, causal, seed)
    # As accurate as the single-process kernels on the full sequence:
    leaves = [t.clone().requires_grad_() for t in full]
    single_out, single_lse = flash_attn_func(*leaves, causal=causal, return_lse=True)
    single = [single_out, single_lse, *torch.autograd.grad(single_out, leaves, dout)]
    leaves64 = [t.double().requires_grad_() for t in full]
    ref_out, ref_lse = reference_attention(*leaves64, causal)
    ref = [ref_out, ref_lse, *torch.autograd.grad(ref_out, leaves64, dout.double())]
    for name, ours, theirs, truth in zip(("out", "lse", "dq", "dk", "dv"), got, single, ref):
        assert_flash_rule(f"{tag} {name} vs single-process", ours, truth.detach(), theirs.detach(),
                          torch.float32 if name == "lse" else q.dtype, seed)


def _check_traffic(layout: str, causal: bool, q, k, rank: int, world: int) -> None:
    """Bytes sent per call = the formula; causal skips exactly the fully masked blocks."""
    from tvmflash.distributed.ring import last_call_stats

    fwd, bwd = last_call_stats["forward"], last_call_stats["backward"]
    kv_bytes = 2 * k.numel() * k.element_size()  # one K/V block
    dkv_bytes = 2 * k.numel() * 4  # one fp32 dK/dV block
    assert fwd["bytes_sent"] == (world - 1) * kv_bytes, fwd
    assert bwd["bytes_sent"] == (world - 1) * kv_bytes + world * dkv_bytes, bwd
    blocks = rank + 1 if (causal and layout == "ring") else world
    assert fwd["blocks"] == bwd["blocks"] == blocks, (fwd, bwd)


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
    # Only rank 1 asks for a sliding window: it raises NotImplementedError, the others learn of it.
    if rank == 1:
        _expect_error(lambda: tdist.ring_flash_attn_func(*qkv(8), window_size=(4, 0)), NotImplementedError,
                      "window_size")
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
        for index, case in enumerate(CASES[world]):
            _check_case(index, case, seed, rank)
        print(json.dumps({"checked": len(CASES[world])}), flush=True)
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
