"""Prepare everything `benchmarks/gpu_check.py` needs on a GPU machine that has no TVM.

    python benchmarks/gpu_bundle.py [--out .gpu_bundle] [--arch sm_90]

The project's GPU machines carry PyTorch and CUDA but neither TVM nor network access, and TVM's
wheel (100 MB, mostly its LLVM-based compiler library) is larger than what may travel with the
working tree (64 MiB). The kernels do not need the compiler to run: this script

1. compiles and exports the CUDA kernels gpu_check's runs use (``BUNDLED_RUNS``: the whole check,
   fp16/bf16, head dim 64/128 (masks are runtime arguments); and ``--deterministic`` on the bf16
   non-causal speed cases and the long one), and those with softcap/ALiBi that the correctness
   stage's flash-attn variants call, with ``tvmflash.prebuild``. Without a GPU here the
   libraries hold CUDA source, which TVM's runtime alone cannot compile: prebuild also compiles
   each with nvcc (TVM's options) into a binary beside it (``tvmflash.cuda_binaries``);
2. packs TVM's Python package without ``libtvm_compiler.so`` (TVM then runs in its runtime-only
   mode) and downloads the tvm-ffi wheel for the GPU machine's Python (3.12);
3. writes ``setup.sh`` (sourced: unpacks both into /tmp, installs tvmflash beside them, points
   ``TVMFLASH_PREBUILT`` at the kernels) and ``run.sh``, which runs gpu_check after it:

    device run: bash .gpu_bundle/run.sh --out-dir $OUT        (carry: [".gpu_bundle"])
                bash .gpu_bundle/run.sh --deterministic --stages speed,long --cases dtype=bf16,causal=0 --out-dir $OUT
                bash benchmarks/gpu_session.sh $OUT             (all of the checks, in one call)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

import tvm
import tvm_ffi

import tvmflash
from gpucheck.cases import mod_variants_needed, variants_needed
from gpucheck.cli import parse_args

ROOT = Path(__file__).resolve().parents[1]
# The gpu_check runs the bundle has kernels for (run.sh passes its arguments on).
BUNDLED_RUNS = ([], ["--deterministic", "--stages", "speed,long", "--cases", "dtype=bf16,causal=0"])
SETUP_SH = """# Sourced (from the repo root) on a machine with a GPU, python3 + torch, and no TVM: installs TVM's
# runtime, tvm-ffi and tvmflash into /tmp and exports what running the bundled kernels needs.
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
site=/tmp/tvmflash_site
rm -rf "$site" && mkdir -p "$site"
tar -xJf "$bundle/tvm_runtime.tar.xz" -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$bundle"/wheels/*.whl
cp -r tvmflash "$site/" && cp -r schedules "$site/tvmflash/schedules" && cp -r tune_logs "$site/tvmflash/tune_logs"
chmod -R go-w "$bundle/kernels"  # tvmflash loads prebuilt code only from files no one else may write
export PYTHONPATH="$site" TVM_USE_RUNTIME_LIB=1 TVMFLASH_PREBUILT="$bundle/kernels" PYTHONUNBUFFERED=1
# The machine's torch (2.11 when last seen) is older than the oldest tvmflash is tested with, and
# cannot be replaced there (a CUDA wheel is far larger than what may travel).
export TVMFLASH_ALLOW_UNTESTED=1
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"  # nvcc 13 is what was seen working there
# TVM's CUDA runtime library links libcudart.so.13: the toolkit's, or the one PyTorch's wheels carry.
cuda_libs=$(python3 -c 'import glob, site; print(":".join(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib")))')
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${cuda_libs}:${LD_LIBRARY_PATH:-}"
python3 -c 'import tvm, tvm_ffi
assert tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True), "TVM CUDA runtime not loaded"
print("tvm", tvm.__version__, "runtime only:", tvm.base._RUNTIME_ONLY, "cuda device:", tvm.cuda(0).exist)'
"""
RUN_SH = """#!/usr/bin/env bash
# Runs benchmarks/gpu_check.py on a machine with a GPU, python3 + torch, and no TVM. From the repo root.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python3 benchmarks/gpu_check.py "$@"
"""


def bundled_variants() -> list[tuple[str, int, bool, bool]]:
    """(dtype, head_dim, causal, deterministic) of every CUDA kernel the bundled runs call."""
    found = []
    for argv in BUNDLED_RUNS:
        args = parse_args(argv)
        found += [(*variant, args.deterministic) for variant in variants_needed(args)]
    return list(dict.fromkeys(found))


def bundled_mod_variants() -> list[tuple[str, int, bool, bool]]:
    """(dtype, head_dim, softcap, alibi) of every CUDA kernel with score mods the bundled runs call."""
    return list(dict.fromkeys(v for argv in BUNDLED_RUNS for v in mod_variants_needed(parse_args(argv))))


def export_kernels(directory: Path, arch: str) -> list[Path]:
    """The libraries (and, with nvcc here, their compiled binaries) of every kernel the runs call."""
    target = {"kind": "cuda", "arch": arch}
    written = [path for dtype, head_dim, causal, deterministic in bundled_variants()
               for path in tvmflash.prebuild(directory, target, head_dims=(head_dim,), dtypes=(dtype,),
                                             deterministic=(deterministic,))]
    for dtype, head_dim, softcap, alibi in bundled_mod_variants():
        mods = "+".join(["softcap"] * softcap + ["alibi"] * alibi)
        written += tvmflash.prebuild(directory, target, head_dims=(head_dim,), dtypes=(dtype,), score_mods=(mods,))
    return written


def pack_tvm_runtime(path: Path) -> None:
    """TVM's Python package minus its compiler library (and bytecode caches)."""
    package = Path(tvm.__file__).parent

    def keep(info: tarfile.TarInfo):
        name = info.name
        return None if name.endswith("libtvm_compiler.so") or "__pycache__" in name else info

    with tarfile.open(path, "w:xz", preset=6) as tar:
        tar.add(package, arcname="tvm", filter=keep)


def download_tvm_ffi(directory: Path, python_version: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    f"--python-version={python_version}", "--implementation=cp", *platforms, "-d", str(directory),
                    f"apache-tvm-ffi=={tvm_ffi.__version__}"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu_bundle")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--python-version", default="3.12", help="of the GPU machine's python3")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"exporting the CUDA kernels for {args.arch} ...", flush=True)
    written = export_kernels(out / "kernels", args.arch)
    kernels = [p for p in written if p.suffix == ".so"]
    if len(kernels) == len(written):
        raise SystemExit("no nvcc here: the GPU machine's TVM runtime could not compile the kernels' CUDA source")
    print(f"packing TVM's runtime ({tvm.__version__}, without the compiler library) ...", flush=True)
    pack_tvm_runtime(out / "tvm_runtime.tar.xz")
    print(f"downloading apache-tvm-ffi {tvm_ffi.__version__} for Python {args.python_version} ...", flush=True)
    download_tvm_ffi(out / "wheels", args.python_version)
    (out / "setup.sh").write_text(SETUP_SH)
    (out / "run.sh").write_text(RUN_SH)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {len(kernels)} kernel libraries, {size / 2**20:.1f} MiB in all (the limit is 64 MiB)")
    print(f"on the GPU machine: bash {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}/run.sh --out-dir $OUT")


if __name__ == "__main__":
    main()
