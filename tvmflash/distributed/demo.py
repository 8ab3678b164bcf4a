"""Ring attention, end to end, checking itself: ``torchrun --nproc-per-node 4 -m tvmflash.distributed.demo``.

Every rank draws the same full-sequence q, k, v, dout (one seed), keeps its shard, runs the ring
forward and backward, and reports its peak memory: how much the ring call added to the process's
peak RSS (``VmHWM``, reset just before the call as in ``tvmflash/memory.py``) beyond what was
resident before it, and the process's absolute peak. Rank 0 then gathers the sharded results and
checks them against single-process ``tvmflash.flash_attn_func`` on the whole sequence and a float64
reference (per head, with autograd): the ring must be within 2x the single-process error + 4 ulps
(the flash-attn rule). Exit status 1 if the check fails.

    torchrun --nproc-per-node 4 -m tvmflash.distributed.demo                       # 4 CPU ranks, gloo
    torchrun --nproc-per-node 2 -m tvmflash.distributed.demo --seqlen 8192 --dtype bfloat16
    torchrun --nproc-per-node 8 -m tvmflash.distributed.demo --device cuda         # NCCL (untested here)

``--json`` prints one JSON line with every rank's numbers (used by benchmarks/ring_scaling.py);
``--impl single`` measures plain ``flash_attn_func`` on the whole sequence (one process) the
same way; ``--no-check`` skips the comparison (large sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> float:
    from tvmflash.memory import reset_high_water

    return reset_high_water()


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=4096, help="total tokens N (all ranks together)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA: key/value heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "ring"))
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--impl", default="ring", choices=("ring", "single"))
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--repeat", type=int, default=1, help="time this many forward+backward calls (median)")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line with every rank's numbers")
    p.add_argument("--timeout", type=float, default=600, help="process group timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _init(args):
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m`: a world of one
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        return torch.device("cuda", torch.cuda.current_device())
    threads = os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return torch.device("cpu")


def _full_inputs(args, device):
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    shape_k = (args.batch, args.seqlen, args.kv_heads, args.head_dim)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in (shape_q, shape_k, shape_k, shape_q)]


def _attention(args):
    from tvmflash import distributed as tdist
    from tvmflash.torch_op import flash_attn_func

    if args.impl == "single":
        return lambda q, k, v: flash_attn_func(q, k, v, causal=args.causal, return_lse=True)
    fn = tdist.zigzag_ring_flash_attn_func if args.layout == "zigzag" else tdist.ring_flash_attn_func
    return lambda q, k, v: fn(q, k, v, causal=args.causal, return_attn_probs=True)[:2]


def _shard_fns(args):
    from tvmflash import distributed as tdist

    if args.impl == "single":
        return (lambda x, dim: x), (lambda x, dim: x)
    if args.layout == "zigzag":
        return tdist.zigzag_shard, tdist.zigzag_unshard
    return tdist.ring_shard, tdist.ring_unshard


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> int:
    device = _init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.impl == "single" and world != 1:
        raise SystemExit("--impl single runs in one process")
    attention = _attention(args)
    shard, unshard = _shard_fns(args)
    from tvmflash.distributed.ring import last_call_stats

    # Warm-up on a small problem: loads the kernels, starts thread pools and the ring's transfers.
    small = argparse.Namespace(**{**vars(args), "seqlen": 16 * world * 2, "batch": 1})
    wq, wk, wv, wdo = (shard(t, 1).clone().requires_grad_(i < 3) for i, t in enumerate(_full_inputs(small, device)))
    wout, _ = attention(wq, wk, wv)
    wout.backward(wdo)
    del wq, wk, wv, wdo, wout

    full = _full_inputs(args, device)
    q, k, v, dout = (shard(t, 1).clone() for t in full)
    if not args.check:
        del full
    for t in (q, k, v):
        t.requires_grad_()

    times, fwd_times, peak_added, absolute_peak = [], [], None, None
    for i in range(max(1, args.repeat)):
        q.grad = k.grad = v.grad = None
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) / 2**20
        else:
            before = _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        out, lse = attention(q, k, v)
        _sync(device)
        mid = time.perf_counter()
        out.backward(dout)
        _sync(device)
        end = time.perf_counter()
        if i == 0:
            if device.type == "cuda":
                peak_added = torch.cuda.max_memory_allocated(device) / 2**20 - before
                absolute_peak = torch.cuda.max_memory_allocated(device) / 2**20
            else:
                peak_added, absolute_peak = _status_mb("VmHWM") - before, _status_mb("VmHWM")
        times.append(end - start)
        fwd_times.append(mid - start)
        if i + 1 < args.repeat:
            del out, lse
    mine = {"rank": rank, "local_tokens": q.shape[1], "peak_added_mb": peak_added, "peak_mb": absolute_peak,
            "fwd_bwd_s": sorted(times)[len(times) // 2], "fwd_s": sorted(fwd_times)[len(fwd_times) // 2],
            "stats": dict(last_call_stats) if args.impl == "ring" else {},
            "inputs_mb": sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / 2**20}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    ok = True
    if args.check:
        got = [unshard(out.detach(), 1), unshard(lse, 2), unshard(q.grad, 1), unshard(k.grad, 1), unshard(v.grad, 1)]
        if rank == 0:
            ok = _check(args, full, got)
    if rank == 0:
        _report(args, everyone, world)
        if args.json:
            print(json.dumps({"args": vars(args), "world": world, "ranks": everyone, "check_ok": ok}), flush=True)
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


def _reference64(q, k, v, dout, causal: bool, scale: float):
    """float64 attention with gradients, one kv head group at a time (bounded memory)."""
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    group = q.shape[2] // k.shape[2]
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    for h in range(k.shape[2]):
        qh = q[:, :, h * group:(h + 1) * group].double().transpose(1, 2).requires_grad_()
        kh = k[:, :, h:h + 1].double().transpose(1, 2).requires_grad_()
        vh = v[:, :, h:h + 1].double().transpose(1, 2).requires_grad_()
        s = (qh @ kh.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ vh
        dq, dk, dv = torch.autograd.grad(o, (qh, kh, vh), dout[:, :, h * group:(h + 1) * group].double().transpose(1, 2))
        outs.append(o.detach().transpose(1, 2))
        lses.append(lse.detach())
        dqs.append(dq.transpose(1, 2))
        dks.append(dk.transpose(1, 2))
        dvs.append(dv.transpose(1, 2))
    return [torch.cat(outs, 2), torch.cat(lses, 1), torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)]


def _check(args, full, got) -> bool:
    from tvmflash.torch_op import flash_attn_func

    q, k, v, dout = (t.cpu() for t in full)
    got = [t.cpu() for t in got]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out, single_lse = flash_attn_func(*leaves, causal=args.causal, return_lse=True)
    single = [single_out, single_lse, *torch.autograd.grad(single_out, leaves, dout)]
    ref = _reference64(q, k, v, dout, args.causal, 1 / math.sqrt(args.head_dim))
    eps = torch.finfo(getattr(torch, args.dtype)).eps
    ok = True
    print(f"check against single-process flash_attn_func and float64 ({args.dtype}, N={args.seqlen}, "
          f"causal={args.causal}, layout {args.layout}):")
    for name, ours, theirs, truth in zip(("out", "lse", "dq", "dk", "dv"), got, single, ref):
        ulp = torch.finfo(torch.float32).eps if name == "lse" else eps
        err = (ours.double() - truth).abs().max().item()
        err_single = (theirs.detach().double() - truth).abs().max().item()
        bound = 2 * err_single + 4 * ulp * max(1.0, truth.abs().max().item())
        diff = (ours.double() - theirs.detach().double()).abs().max().item()
        passed = err <= bound and not ours.isnan().any()
        ok &= passed
        print(f"  {name:4s} max|ring - f64| {err:.3g}  max|single - f64| {err_single:.3g}  "
              f"max|ring - single| {diff:.3g}  {'ok' if passed else 'FAIL'} (bound {bound:.3g})")
    print("PASS" if ok else "FAIL")
    return ok


def _report(args, everyone, world) -> None:
    what = "single process flash_attn_func" if args.impl == "single" else f"{args.layout} ring attention"
    print(f"{what}: B{args.batch} N{args.seqlen} H{args.heads}/{args.kv_heads} D{args.head_dim} {args.dtype} "
          f"causal={args.causal}, world {world}, one forward+backward")
    print("  rank  tokens  peak added MB  process peak MB  fwd+bwd s  blocks fwd/bwd  sent fwd/bwd MB  waited fwd/bwd s")
    for r in everyone:
        f, b = r["stats"].get("forward", {}), r["stats"].get("backward", {})
        print(f"  {r['rank']:4d}  {r['local_tokens']:6d}  {r['peak_added_mb']:13.1f}  {r['peak_mb']:15.1f}  "
              f"{r['fwd_bwd_s']:9.3f}  {f.get('blocks', '-')}/{b.get('blocks', '-'):<12}  "
              f"{f.get('bytes_sent', 0) / 2**20:.1f}/{b.get('bytes_sent', 0) / 2**20:<13.1f}  "
              f"{f.get('wait_s', 0):.3f}/{b.get('wait_s', 0):.3f}")
    sys.stdout.flush()


def main(argv=None) -> int:
    return run(_parse(argv))


if __name__ == "__main__":
    sys.exit(main())
