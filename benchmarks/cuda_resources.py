"""Registers, spills, barriers and memory instructions of the CUDA kernels, compiled the way TVM
compiles them when a GPU machine loads the module (no GPU needed).

    python benchmarks/cuda_resources.py [--arch sm_90] [--no-fast-math] [--nvdisasm PATH]

Compiles every variant with ``tvmflash.compile_spec`` (fp16/bf16, head dim 64/128, score mods:
none, softcap + ALiBi, flex's traced mods with a block mask (``variant_spec``), atomic or
deterministic dQ; masks are runtime arguments) and hands its CUDA source to TVM's own ``compile_cuda`` (the nvcc
path of ``tvm_callback_cuda_compile``: ``--use_fast_math``, ``-O3``, ptxas
``--register-usage-level=10``, ``-gencode`` for the target's arch), then prints one markdown row
per variant and kernel from ptxas's report and the PTX.

A plain ``nvcc -ptx`` + ``ptxas -v`` is *not* what runs: without TVM's flags the D=128 backward
spilled 8-20 bytes, with them 72-216.

``--nvdisasm`` (a CUDA nvdisasm, e.g. from the ``nvidia-cuda-nvdisasm`` wheel; not needed
otherwise) adds where the spills are: local-memory instructions in all, and inside the
innermost loops that run mma (the forward's key-tile loop, the backward's query-tile loop).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

KERNELS = ("flash_fwd_kernel", "flash_bwd_kernel")
MODS = ("none", "softcap+alibi", "flex", "flex+grad")


BIAS = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
DOCS = (torch.arange(1024) // 45) % 3
LEARNED = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()


def relative_bias(score, b, h, q_idx, kv_idx):
    """A traced score_mod reading a captured table (up to 8 heads) by relative position."""
    return score + BIAS[h, (q_idx - kv_idx).clamp(-31, 32) + 31].to(score.dtype)


def learned_bias(score, b, h, q_idx, kv_idx):
    """``relative_bias`` with a table that requires grad: the backward scatter-adds its gradient."""
    return score + LEARNED[h, (q_idx - kv_idx).clamp(-31, 32) + 31].to(score.dtype)


def same_document(b, h, q_idx, kv_idx):
    """A traced mask_mod reading captured document ids (positions up to 1024)."""
    return DOCS[q_idx] == DOCS[kv_idx]


def variant_spec(head_dim: int, dtype: str, mods: str):
    """The AttentionSpec of a CUDA variant: "none"; flash-attn's "softcap+alibi"; "flex" (the
    traced ``relative_bias`` and ``same_document`` with a block mask); "flex+grad" (the same with
    ``learned_bias``, whose table gets its gradient)."""
    from tvmflash import flex_trace
    from tvmflash.spec import Alibi, AttentionSpec, Softcap

    if mods == "softcap+alibi":
        return AttentionSpec(head_dim, dtype, score_mods=(Softcap(), Alibi()))
    if mods in ("flex", "flex+grad"):
        score_mod = learned_bias if mods == "flex+grad" else relative_bias
        return AttentionSpec(head_dim, dtype, score_mods=(flex_trace.trace_score_mod(score_mod),),
                             mask_mod=flex_trace.trace_mask_mod(same_document), block_sparse=True)
    return AttentionSpec(head_dim, dtype)


class _RecordingSubprocess:
    """Stands in for the ``subprocess`` module inside ``tvm.support.nvcc``: runs the command TVM
    builds, unchanged, and keeps its output (ptxas's ``-v`` report), which TVM drops on success."""

    PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT

    def __init__(self):
        self.commands: list[list[str]] = []
        self.outputs: list[str] = []

    def Popen(self, command, **kwargs):  # noqa: N802 - the name TVM calls
        self.commands.append(list(command))
        process = subprocess.Popen(command, **kwargs)
        recorder = self

        class Finished:
            returncode = None

            def communicate(self):
                out, err = process.communicate()
                self.returncode = process.returncode
                recorder.outputs.append((out or b"").decode(errors="replace"))
                return out, err

        return Finished()


def compile_like_tvm(source: str, arch: str, fast_math: bool = True,
                     cubin: Path | None = None) -> tuple[dict[str, str], str, list[str]]:
    """CUDA C -> cubin through TVM's ``compile_cuda`` with TVM's flags (nvcc mode).

    Returns the PTX of each kernel entry (nvcc keeps its intermediates: ``--keep`` changes no
    code), ptxas's resource report, and the nvcc command; ``cubin``: also write the binary there. ``fast_math=False`` uses TVM's own
    switch ``TVM_CUDA_NVCC_NO_FAST_MATH``. TVM's default at load time is NVRTC (needs
    ``cuda-bindings`` and libnvrtc), which gets the same ``--use_fast_math`` and ptxas options.
    """
    import tvm
    from tvm.support import nvcc

    recorder = _RecordingSubprocess()
    switch = {} if fast_math else {"TVM_CUDA_NVCC_NO_FAST_MATH": "1"}
    with tempfile.TemporaryDirectory() as keep, mock.patch.object(nvcc, "subprocess", recorder), \
            mock.patch.dict(os.environ, switch), tvm.target.Target({"kind": "cuda", "arch": arch}):
        if fast_math:
            os.environ.pop("TVM_CUDA_NVCC_NO_FAST_MATH", None)
        nvcc.compile_cuda(source, target_format="cubin", compiler="nvcc",
                          options=["--keep", f"--keep-dir={keep}"], path_target=str(cubin) if cubin else None)
        ptx = (Path(keep) / "tvm_kernels.ptx").read_text()
    if not recorder.outputs or "Function properties" not in recorder.outputs[0]:
        raise RuntimeError("TVM's nvcc call did not report ptxas resources (did tvm.support.nvcc change?)")
    return _entries(ptx), recorder.outputs[0], recorder.commands[0]


def assemble(source: str, arch: str, nvcc: str = "nvcc", ptxas: str = "ptxas") -> tuple[dict[str, str], str]:
    """Plain CUDA C -> PTX (nvcc) -> cubin (ptxas -v), without TVM's flags (for comparison)."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, ptx = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        cu.write_text(source)
        report = ""
        for command in ([nvcc, f"-arch={arch}", "-ptx", "-o", str(ptx), str(cu)],
                        [ptxas, f"-arch={arch}", "-v", "-o", str(Path(tmp) / "k.cubin"), str(ptx)]):
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"{Path(command[0]).name} failed:\n{run.stderr[-4000:]}")
            report = run.stderr
        return _entries(ptx.read_text()), report


def _entries(ptx: str) -> dict[str, str]:
    return {c.split("(")[0].strip(): c for c in ptx.split(".entry ")[1:]}


def global_stores(ptx: str) -> Counter:
    """Bytes per global store instruction -> number of such instructions (``st.global.v4.b32``: 16)."""
    widths = Counter()
    for vector, bits in re.findall(r"\bst\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s", ptx):
        widths[int(vector or 1) * int(bits) // 8] += 1
    return widths


def kernel_resources(entries: dict[str, str], report: str, kernel: str) -> dict:
    """One kernel: registers and spill bytes (ptxas), and instruction counts from its PTX.

    ``barriers`` counts block-wide barrier instructions (``bar.sync`` / ``barrier.sync``) in the
    PTX: nvcc unrolls every loop but the key-tile loop (and the backward's query-tile loop), so
    in the forward that is 1 (after the Q tile) + the barriers per key tile.
    """
    block = report.split(f"Function properties for {kernel}\n")[1].split("Compile time")[0]
    ptx = entries[kernel]
    return {"registers": int(re.search(r"Used (\d+) registers", block).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", block).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", block).group(1)),
            "mma": ptx.count("mma.sync"), "ldmatrix": ptx.count("ldmatrix"),
            "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
            "shuffles": len(re.findall(r"\bshfl\.sync\b", ptx)),
            "stores": dict(sorted(global_stores(ptx).items()))}


def local_memory_in_mma_loops(cubin: Path, nvdisasm: str) -> dict[str, tuple[int, int]]:
    """kernel -> (local-memory instructions, of them inside an innermost loop that runs mma),
    from the SASS: a loop is a backward branch; an innermost mma loop contains HMMA and no
    other such loop."""
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = {}
    for function in re.split(r"\n//-+ \.text\.", sass)[1:]:
        labels, instructions = {}, []
        for line in function.splitlines():
            label = re.match(r"^(\.L_x_\d+):", line)
            if label:
                labels[label.group(1)] = len(instructions)
                continue
            instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
            if instruction:
                instructions.append(instruction.group(1))
        loops = []
        for end, text in enumerate(instructions):
            target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
            if target and labels.get(target.group(1), end + 1) <= end:
                loops.append((labels[target.group(1)], end))
        mma = [(a, b) for a, b in loops if any("HMMA" in instructions[i] for i in range(a, b + 1))]
        hot = [(a, b) for a, b in mma if not any((c, d) != (a, b) and a <= c and d <= b for c, d in mma)]
        local = [i for i, text in enumerate(instructions) if re.search(r"\b(LDL|STL)\b", text)]
        found[function.split()[0]] = (len(local), sum(any(a <= i <= b for a, b in hot) for i in local))
    return found


VARIANTS = [(dtype, head_dim, mods, deterministic) for dtype in ("float16", "bfloat16") for head_dim in (64, 128)
            for mods in MODS for deterministic in (False, True)
            if not (deterministic and mods == "flex+grad")]  # captured gradients: atomic adds only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--no-fast-math", action="store_true", help="TVM's flags without --use_fast_math")
    parser.add_argument("--nvdisasm", help="nvdisasm executable: also count local-memory instructions in mma loops")
    args = parser.parse_args()
    import tvmflash

    local_column = " local mem instr. (in mma loop) |" if args.nvdisasm else ""
    print("| dtype | D | mods | dQ | kernel | registers | spill bytes | barriers | shfl | mma.sync | ldmatrix | "
          f"global stores (bytes: count) |{local_column}")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.nvdisasm else ""))
    for dtype, head_dim, mods, deterministic in VARIANTS:
        with contextlib.redirect_stderr(io.StringIO()):
            kern = tvmflash.compile_spec({"kind": "cuda", "arch": args.arch}, variant_spec(head_dim, dtype, mods),
                                         deterministic=deterministic)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            entries, report, _ = compile_like_tvm(kern.source(), args.arch, fast_math=not args.no_fast_math,
                                                  cubin=cubin)
            local = local_memory_in_mma_loops(cubin, args.nvdisasm) if args.nvdisasm else {}
        for kernel in sorted(entries):
            if kernel == "flash_fwd_kernel" and deterministic:
                continue  # the same forward as the atomic variant
            r = kernel_resources(entries, report, kernel)
            stores = ", ".join(f"{width}: {n}" for width, n in r["stores"].items())
            print(f"| {dtype} | {head_dim} | {mods} | "
                  f"{'deterministic' if deterministic else 'atomic'} | {kernel} | {r['registers']} | "
                  f"{r['spill_bytes']} | {r['barriers']} | {r['shuffles']} | {r['mma']} | {r['ldmatrix']} | "
                  f"{stores} |" + (" {} ({}) |".format(*local[kernel]) if args.nvdisasm else ""), flush=True)


if __name__ == "__main__":
    main()
