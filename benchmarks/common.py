"""Helpers shared by the experiment scripts in benchmarks/ (each script is run as a file)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def machine() -> str:
    from tvmflash import target

    return (f"{target.host_cpu()} ({os.cpu_count()} CPUs), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds (CI smoke test)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the report (.md) and plot (.png) go; default docs/ (quick: no files)")
    return p


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path | None, name: str, title: str, body: str, figure=None, data=None) -> None:
    """Print the report; with an output dir also write <name>.md, <name>.png and <name>.json
    (``data``: the measured numbers, for tests and for re-plotting) there."""
    command = "python " + " ".join(sys.argv)
    text = f"### {title}\n\ncommand: `{command}`\n\nmachine: {machine()}\n\n{body}\n"
    print(text)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if figure is not None:
        figure.savefig(out_dir / f"{name}.png", dpi=120, bbox_inches="tight")
        text += f"\n![{title}]({name}.png)\n"
    (out_dir / f"{name}.md").write_text(text)
    if data is not None:
        (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def out_dir(args) -> Path | None:
    if args.out_dir is not None:
        return args.out_dir
    return None if args.quick else DOCS


def reference_f64(q, k, v, dout, causal: bool, scale: float | None = None, chunk: int = 1024):
    """float64 attention forward and backward, query chunk by query chunk: O(N * chunk) memory.

    The textbook formulas (P = softmax(S), dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q), independent of the kernels; tests check them against
    autograd. Returns (out, lse, dq, dk, dv) as float64, layout (batch, seqlen, heads, dim).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    qd, kd, vd, dod = (t.detach().double().transpose(1, 2) for t in (q, k, v, dout))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    nq, nk = qd.shape[2], kd.shape[2]
    out, lse = torch.zeros_like(qd), torch.full(qd.shape[:3], -math.inf, dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for start in range(0, nq, chunk):
        rows = slice(start, min(start + chunk, nq))
        s = (qd[:, :, rows] @ kd.transpose(-1, -2)) * scale
        if causal:
            i = torch.arange(start, rows.stop)[:, None]
            s = s.masked_fill(torch.arange(nk)[None, :] > i + (nk - nq), -math.inf)
        m = s.amax(-1, keepdim=True).clamp_min(-1e300)  # rows that see no key: keep finite
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        p = torch.where(l > 0, p / l.clamp_min(1e-300), 0.0)
        lse[:, :, rows] = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0].clamp_min(1e-300)), -math.inf)
        o = p @ vd
        out[:, :, rows] = o
        do = dod[:, :, rows]
        dv += p.transpose(-1, -2) @ do
        dp = do @ vd.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[:, :, rows] = scale * (ds @ kd)
        dk += scale * (ds.transpose(-1, -2) @ qd[:, :, rows])
    b, hk = k.shape[0], k.shape[2]
    dk = dk.reshape(b, hk, group, nk, -1).sum(2)
    dv = dv.reshape(b, hk, group, nk, -1).sum(2)
    return tuple(t.transpose(1, 2) if t.dim() == 4 else t for t in (out, lse, dq, dk, dv))


def relative_error(ours, ref) -> float:
    """max |ours - ref| / max |ref| (ref in float64)."""
    return float((ours.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
