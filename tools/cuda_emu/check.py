"""Run tvmflash's generated CUDA kernels on the CPU and judge them against float64 PyTorch.

One fiber per CUDA thread (emu_rt.h): exact __syncthreads and warp collectives, ldmatrix and
mma.m16n8k16 per the PTX ISA, with race, uninitialised-shared-read, out-of-bounds, misalignment,
divergent-barrier and deadlock detection. Results are judged by the project's own rule
(tests/conftest.py). No GPU needed; g++ and the project's Python.

    python tools/cuda_emu/check.py --head-dim 64 --dtype float16 --mods none --window -1,0
    python tools/cuda_emu/check.py --head-dim 128 --dtype bfloat16 --mods softcap+alibi --window 40,7 \\
        --shape B=1,Nq=300,Nk=129,H=2,Hk=1
    python tools/cuda_emu/check.py --mods flex --deterministic

``--mods``: none; softcap+alibi (flash-attn's); flex (a traced relative-position bias reading a
captured table, a traced document mask, a block mask at the kernels' 64 x 64 tiles); flex+grad
(the same with a table that requires grad: its gradient is checked too). See
``benchmarks/cuda_resources.variant_spec``. Every line
says OK or the mismatch, and the detectors' counts.
"""
from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT)]
from conftest import assert_flash_rule, assert_matches_reference, random_inputs  # noqa: E402
from cuda_resources import LEARNED, learned_bias, relative_bias, same_document, variant_spec  # noqa: E402

import tvmflash  # noqa: E402
from tvmflash import flex_trace, plan, runtime  # noqa: E402
from tvmflash.flex import create_block_mask, query_ranges, tile_maps  # noqa: E402
from tvmflash.reference import reference_attention  # noqa: E402
from tvmflash.spec import UNLIMITED_WINDOW, AttentionSpec  # noqa: E402

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}
C_TYPES = {torch.float32: "float", torch.int64: "int64_t", torch.int32: "int", torch.int8: "signed char",
           torch.bool: "bool"}
SHAPES = [dict(B=1, Nq=70, Nk=133, H=4, Hk=2), dict(B=1, Nq=150, Nk=37, H=3, Hk=1),
          dict(B=1, Nq=1, Nk=65, H=2, Hk=2), dict(B=2, Nq=64, Nk=64, H=1, Hk=1)]
def extras_include(spec: AttentionSpec) -> str:
    """C++ declarations of the kernels' mod-input and block-mask arguments, read by name."""
    lines = ['auto seq_table_ptr = extra<int>("seq_table");', 'auto q_tile_seq_ptr = extra<int>("q_tile_seq");',
             'int64_t n_seq = extra_dim("seq_table", 0);', 'int64_t query_tiles = extra_dim("q_tile_seq", 0);']
    for i in spec.mod_inputs:
        ctype = C_TYPES[getattr(torch, i.dtype)]
        lines.append(f'auto {i.name}_ptr = extra<{ctype}>("{i.name}");')
        lines += [f'int64_t {i.name}_d{d} = extra_dim("{i.name}", {d});' for d, n in enumerate(i.shape) if n is None]
    lines += [f'auto {i.name}_grad_ptr = extra<float>("{i.name}_grad");' for i in spec.grad_inputs]
    if spec.block_sparse:
        lines += ['auto tile_state_ptr = extra<signed char>("tile_state");', 'auto kv_range_ptr = extra<int>("kv_range");',
                  'auto q_range_ptr = extra<int>("q_range");']
        lines += [f'int64_t {n} = extra_dim("tile_state", {d});'
                  for d, n in enumerate(("mask_batch", "mask_heads", "mask_q_tiles", "mask_k_tiles"))]
    return "\n".join(lines) + "\n"


def build(spec: AttentionSpec, deterministic: bool, work: Path) -> Path:
    kern = tvmflash.compile_spec({"kind": "cuda", "arch": "sm_90"}, spec, deterministic=deterministic)
    (work / "k.cu").write_text(kern.source())
    subprocess.run([sys.executable, str(HERE / "transform.py"), str(work / "k.cu"), str(work / "k.cpp")], check=True)
    (work / "extras.inc").write_text(extras_include(spec))
    elem = "nv_bfloat16" if spec.dtype == "bfloat16" else "half"
    exe = work / "emu"
    subprocess.run(["g++", "-O1", "-std=c++17", f"-I{HERE}", f'-DKERNELS_CPP="{work / "k.cpp"}"',
                    f'-DEXTRAS_INC="{work / "extras.inc"}"', f"-DELEM={elem}", str(HERE / "harness.cpp"),
                    str(HERE / "emu_rt.cpp"), "-o", str(exe)], check=True)
    return exe


def mod_tensors(mods: str, gen, B, Nq, Nk, H, spec) -> tuple[dict, list]:
    """(reference_attention's variant arguments, [(name, tensor)] in kernel-argument order)."""
    if mods == "softcap+alibi":
        softcap = float(torch.empty(1).uniform_(1, 10, generator=gen))
        slopes = torch.rand(B, H, generator=gen)
        return {"softcap": softcap, "alibi_slopes": slopes}, [("softcap", torch.tensor([softcap])),
                                                               ("alibi_slopes", slopes)]
    if mods in ("flex", "flex+grad"):
        captured = {c.name: c.tensor.detach() for m in (*spec.score_mods, spec.mask_mod) for c in m.captured}
        block_mask = create_block_mask(same_document, B, None, Nq, Nk, BLOCK_SIZE=64)
        tile_state, kv_range = tile_maps(block_mask, Nq, Nk, 64, 64)
        mask = flex_trace.dense_mask(same_document, B, H, Nq, Nk)
        tensors = [(i.name, captured[i.name]) for i in spec.mod_inputs]
        grads = [(f"{i.name}_grad", torch.zeros(captured[i.name].numel())) for i in spec.grad_inputs]
        score_mod = learned_bias if mods == "flex+grad" else relative_bias
        return {"score_mod": score_mod, "mask": mask, "diagonal": 0}, tensors + grads + [
            ("tile_state", tile_state), ("kv_range", kv_range), ("q_range", query_ranges(tile_state))]
    return {}, []


def run(exe, mods, spec, dtype, B, Nq, Nk, H, Hk, D, window, deterministic=False, pad=0, seed=0, varlen=False):
    """One shape: batched (B, Nq, ...), or ``varlen``: B sequences of random lengths up to Nq / Nk
    packed in (1, total, heads, head_dim) tensors, each judged on its own rows."""
    gen = torch.Generator().manual_seed(seed)
    if varlen:
        lens = [torch.randint(1, n + 1, (B,), generator=gen) for n in (Nq, Nk)]
        cu_q, cu_k = ([0, *n.cumsum(0).tolist()] for n in lens)
        q, k, v = random_inputs(gen, 1, cu_q[-1], cu_k[-1], H, Hk, D, dtype)
        seqs = plan.varlen(cu_q, cu_k, block_q=64, block_k=64, heads_k=Hk)
    else:
        q, k, v = random_inputs(gen, B, Nq, Nk, H, Hk, D, dtype)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    scale = D**-0.5
    variant, extras = mod_tensors(mods, gen, B, Nq, Nk, H, spec)
    diagonal = variant.pop("diagonal", None)
    if not varlen:
        seqs = plan.batched(B, Nq, Nk, block_q=64, block_k=64, heads_k=Hk, diagonal=diagonal)
    extras += [("seq_table", torch.from_numpy(seqs.table)), ("q_tile_seq", torch.from_numpy(seqs.q_tile_seq))]
    n_split = (runtime.deterministic_splits(seqs.count, Hk, seqs.max_key_tiles) if deterministic
               else seqs.max_key_tiles)
    left, right = (UNLIMITED_WINDOW if w < 0 else w for w in window)
    hdr = struct.pack("<13qd", *q.shape[:2], k.shape[1], H, Hk, D, int(deterministic), n_split, pad, left, right,
                      runtime.cuda_stats_rows(q.shape[1], varlen), len(extras), scale)
    raw = lambda t: t.contiguous().view(torch.int16).numpy().tobytes()  # noqa: E731
    blob = b""
    for name, t in extras:
        data = t.contiguous().numpy().tobytes()
        dims = list(t.shape) + [1] * (4 - t.dim())
        blob += name.encode().ljust(64, b"\0") + struct.pack("<4qq", *dims, len(data)) + data
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    try:
        Path(path).write_bytes(hdr + raw(q) + raw(k) + raw(v) + raw(dout) + blob)
        t0 = time.time()
        r = subprocess.run([str(exe), path, path + ".out"], capture_output=True, text=True)
        elapsed = time.time() - t0
        buf = Path(path + ".out").read_bytes() if r.returncode == 0 else b""
    finally:
        for p in (path, path + ".out"):
            Path(p).unlink(missing_ok=True)
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith("emu stats")]
    issues = [ln for ln in r.stderr.splitlines() if ln.startswith("[emu:")]
    tag = (f"{dtype} D={D} mods={mods} window={window} det={deterministic} {'varlen ' * varlen}B={B} Nq={Nq} "
           f"Nk={Nk} H={H} Hk={Hk} pad={pad}")
    if not buf:
        print(f"{tag}: CRASHED (exit {r.returncode}) {r.stderr[-800:]}", flush=True)
        return False
    at = 0

    def take(n, dt, shape):
        nonlocal at
        width = 4 if dt == torch.float32 else 2
        arr = np.frombuffer(buf[at:at + n * width], dtype=np.float32 if dt == torch.float32 else np.int16).copy()
        at += n * width
        t = torch.from_numpy(arr)
        return (t if dt == torch.float32 else t.view(dt)).reshape(shape)

    nq, nk = q.numel(), k.numel()
    results = (take(nq, DT[dtype], q.shape), take(q.shape[0] * H * q.shape[1], torch.float32, (q.shape[0], H, q.shape[1])),
               take(nq, DT[dtype], q.shape), take(nk, DT[dtype], k.shape), take(nk, DT[dtype], k.shape))
    # the harness writes them after dv in name order
    grads = {name: take(t.numel(), torch.float32, (t.numel(),)) for name, t in sorted(extras, key=lambda e: e[0])
             if name.endswith("_grad")}
    status = "OK"
    try:
        if varlen:  # each sequence on its own rows (its ALiBi slopes: row b)
            for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
                rows, keys = slice(q0, q1), slice(k0, k1)
                ours = (results[0][:, rows], results[1][..., rows], results[2][:, rows], results[3][:, keys],
                        results[4][:, keys])
                mine = {**variant, **({"alibi_slopes": variant["alibi_slopes"][b]} if "alibi_slopes" in variant else {})}
                assert_matches_reference(f"{tag} sequence {b}", (q[:, rows], k[:, keys], v[:, keys], dout[:, rows]),
                                         ours, False, seed, scale, window_size=window, **mine)
        else:
            assert_matches_reference(tag, (q, k, v, dout), results, False, seed, scale, window_size=window,
                                     diagonal=diagonal, **variant)
        for name, ours in grads.items():  # captured tensors' gradients vs float64 autograd
            table = LEARNED  # the one captured tensor that requires grad (``learned_bias``)
            ref = {}
            for dt in (torch.float64, DT[dtype]):
                leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
                o, _ = reference_attention(*leaves, False, scale, window_size=window, diagonal=diagonal, dtype=dt,
                                           **variant)
                ref[dt] = torch.autograd.grad(o, table, dout.to(dt))[0].reshape(-1)
            f64 = ref[torch.float64]
            assert_flash_rule(f"{tag} {name}", ours, f64, ref[DT[dtype]], torch.float32, seed, ulps=16,
                              magnitude=float(f64.abs().max()) * 16 + 1)
    except AssertionError as e:
        status = f"MISMATCH: {e}"
    clean = bool(stats) and stats[0].endswith("races=0 uninit=0 oob=0 misaligned=0 deadlock=0 divergent=0")
    print(f"{tag}: {status} | {stats[0] if stats else r.stderr[-300:]} | {elapsed:.1f}s", flush=True)
    for ln in issues[:8]:
        print("   ", ln)
    return status == "OK" and clean


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DT), default="float16")
    ap.add_argument("--mods", choices=("none", "softcap+alibi", "flex", "flex+grad"), default="none")
    ap.add_argument("--window", default="-1,-1", help="flash-attn's window_size left,right (-1: no limit)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--pad", type=int, default=0, help="pad the q/k/v/dout strides by this many elements")
    ap.add_argument("--shape", action="append", help="B=..,Nq=..,Nk=..,H=..,Hk=.. (repeatable)")
    ap.add_argument("--varlen", action="store_true", help="B packed sequences of random lengths up to Nq, Nk")
    args = ap.parse_args(argv)
    if args.varlen and args.mods.startswith("flex"):
        ap.error("--varlen: flex_attention takes batched tensors (use --mods none or softcap+alibi)")
    window = tuple(int(w) for w in args.window.split(","))
    shapes = [dict(kv.split("=") for kv in s.split(",")) for s in args.shape] if args.shape else SHAPES
    spec = variant_spec(args.head_dim, args.dtype, args.mods)
    with tempfile.TemporaryDirectory() as work:
        exe = build(spec, args.deterministic, Path(work))
        ok = [run(exe, args.mods, spec, args.dtype, D=args.head_dim, window=window, deterministic=args.deterministic,
                  pad=args.pad, seed=100 + i, varlen=args.varlen, **{key: int(val) for key, val in s.items()})
              for i, s in enumerate(shapes)]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
