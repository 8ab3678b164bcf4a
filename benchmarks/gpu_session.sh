#!/usr/bin/env bash
# One device call's worth of GPU checks (about 9 minutes on an H200), from the repo root, after
# `python benchmarks/gpu_bundle.py` here:
#     device run: bash benchmarks/gpu_session.sh "$OUT"          (carry: [".gpu_bundle"])
# 1. gpu_check: correctness against float64, speed against SDPA, the 512K-token head (OUT/main/);
# 2. the bar case with deterministic=True; 3. Nsight Compute on the forward and backward kernels;
# 4. compute-sanitizer memcheck and racecheck on small shapes. Each step has its own time limit,
# so a hang in one still leaves the others' results; 2-4 are packed into OUT/extra.tar.gz.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR}
main_budget=${GPU_SESSION_MAIN_S:-290}
extra=/tmp/gpu_session_extra
rm -rf "$extra" && mkdir -p "$out" "$extra"
exec > >(tee "$out/session.log") 2>&1
source .gpu_bundle/setup.sh || exit 1
# the profilers, where the image keeps them off PATH
PATH="$PATH:/usr/local/cuda/bin:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -n 1)"
command -v ncu compute-sanitizer || echo "ncu or compute-sanitizer not found"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
step() {  # step NAME SECONDS COMMAND...: run with a limit, say how it ended
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}
step gpu_check $((main_budget + 40)) python3 benchmarks/gpu_check.py --budget-s "$main_budget" --out-dir "$out/main"
step deterministic 60 python3 benchmarks/gpu_check.py --deterministic --stages speed --budget-s 40 \
    --cases N=8192,D=128,dtype=bf16,causal=0 --out-dir "$extra/deterministic"
step ncu 70 ncu --clock-control none --kernel-name regex:"flash_(fwd|bwd)_kernel" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --log-file "$extra/ncu.txt" \
    python3 benchmarks/gpu_profile.py ncu
for tool in memcheck racecheck; do
    step "$tool" 50 compute-sanitizer --tool "$tool" --print-limit 30 --log-file "$extra/$tool.txt" \
        python3 benchmarks/gpu_profile.py sanitize
done
tar -czf "$out/extra.tar.gz" -C "$extra" .
echo "== done after $SECONDS s"
sleep 1  # let tee write the last lines
