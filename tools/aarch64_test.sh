#!/usr/bin/env bash
# Core correctness checks of the CPU kernels on aarch64, under qemu-user on an x86 host (issue 20).
#   tools/aarch64_test.sh [neoverse-v1|neoverse-n1|generic] [float32] [bfloat16]
# (default neoverse-v1, both dtypes: ~5.5 min here, ~95 % of it TVM compiling under emulation;
# one dtype ~2 min)
# Builds (once, cached under ${ARM_ROOT:-/tmp/arm64-root}) an aarch64 Python root with TVM and numpy
# (/work/shared/tools/aarch64-root.sh, or tools/aarch64-root.sh beside this script), then runs
# tools/aarch64_check.py there: fp32 forward+backward (full, causal + GQA, varlen) and bf16 against
# float64 numpy. qemu-user shows the host's /proc/cpuinfo, so the root gets a /proc/cpuinfo of the
# chosen Arm CPU (qemu opens paths under its -L root first): LLVM names the CPU from its
# "CPU implementer/part" and tvmflash reads its "Features", as on that machine. qemu emulates every
# extension (its "max" CPU), BFDOT included. Emulated: correctness only, never speed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
CPU=${1:-neoverse-v1}
shift || true
ROOT_SCRIPT=/work/shared/tools/aarch64-root.sh
[ -x "$ROOT_SCRIPT" ] || [ -f "$ROOT_SCRIPT" ] || ROOT_SCRIPT=$HERE/tools/aarch64-root.sh
A=$(bash "$ROOT_SCRIPT")
mkdir -p "$A/root/proc"
case $CPU in
  # Graviton 3 (Neoverse V1): SVE 256-bit, BF16, I8MM
  neoverse-v1) PART=0xd40; FEATURES="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng" ;;
  # Graviton 2 / Ampere Altra (Neoverse N1): NEON, no BF16
  neoverse-n1) PART=0xd0c; FEATURES="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs" ;;
  generic) PART=0x000; FEATURES="fp asimd evtstrm cpuid" ;;
  *) echo "unknown CPU $CPU (neoverse-v1, neoverse-n1, generic)" >&2; exit 2 ;;
esac
printf 'processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: %s\nCPU revision\t: 1\n\n' \
  "$FEATURES" "$PART" > "$A/root/proc/cpuinfo"
# the package as pyproject.toml installs it (schedules/ and tune_logs/ inside tvmflash/)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$HERE/tvmflash" "$WORK/tvmflash"
cp -r "$HERE/schedules" "$WORK/tvmflash/schedules"
cp -r "$HERE/tune_logs" "$WORK/tvmflash/tune_logs"
export TVMFLASH_CACHE_DIR=$WORK/cache
START=$(date +%s)
PYTHONPATH="$A/site:$WORK" OMP_NUM_THREADS=2 qemu-aarch64-static -L "$A/root" "$A/root/usr/bin/python3.11" \
  "$HERE/tools/aarch64_check.py" "$@"
echo "aarch64 ($CPU) checks: $(( $(date +%s) - START )) s" >&2
