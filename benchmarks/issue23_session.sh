#!/usr/bin/env bash
# Issue 23's measurements (speed inside real models) in one run, for a session on a machine whose
# figures BENCHMARKS.md lacks or has old (an Intel Xeon with AMX): from the repository root, with
# the README's environment installed,
#     bash benchmarks/issue23_session.sh OUT_DIR        (10 minutes on the Zen 4; the limits allow 68)
# Each step has a time limit and a log of its own (OUT_DIR/<step>.txt), so a slow or failing step
# leaves the others' results; the tables to paste are at the end of each log. The steps, in the
# order of the issue's bars:
#   machine  the CPU, its flags and the kernels' target (name it with every number);
#   peaks    register-only FMA / vdpbf16ps / AMX rates (benchmarks/bf16_peak.c), the limits;
#   fixed    the fixed cost per call and `linear` + call (bars: forward B1 N16 <= 30 us, decode at
#            a 128-token cache no slower than SDPA, `linear` + decode <= 1.5x `linear` + SDPA);
#   swap     generate() and training steps, one model per dtype, attention switched (bar: at
#            least as fast as SDPA), then autocast, then 4 left-padded rows;
#   in-model the attention function's own time per call inside the model;
#   gpt-oss  attention sinks against eager: one layer's calls, then the 8-layer model.
set -uo pipefail
out=${1:?usage: issue23_session.sh OUT_DIR}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
speed=(benchmarks/model_speed.py)

step() {  # step NAME SECONDS COMMAND...: run with a limit into OUT_DIR/NAME.txt, say how it ended
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s) $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout -k 5 "$limit" "$@" > "$out/$name.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}

peak_binary=$(mktemp /tmp/bf16_peak.XXXXXX)
trap 'rm -f "$peak_binary"' EXIT
step machine 60 bash -c "lscpu; grep -o -w -e 'amx_[a-z0-9]*' -e avx512_bf16 /proc/cpuinfo | sort -u;
    PYTHONPATH=benchmarks $python -c 'from tvmflash import target; from common import machine; print(machine());
print(target.key(target.host_target()))'"
step peaks 120 bash -c "gcc -O2 -fopenmp benchmarks/bf16_peak.c -o $peak_binary && $peak_binary 2 5"
step fixed 600 "$python" "${speed[@]}" fixed linear --rounds 2000
step swap 900 "$python" "${speed[@]}" swap --runs 8 --dtypes bfloat16 float32 autocast
step swap-padded 900 "$python" "${speed[@]}" swap --runs 6 --batch 4 --prompts 40 256 --train-lengths 40 256
step in-model 600 "$python" "${speed[@]}" in-model --runs 4 --prompts 32 1024 --train-lengths 16 512
step gpt-oss-layer 300 "$python" "${speed[@]}" sinks --rounds 20 --train-lengths 128 512 --prompts 128 1024
step gpt-oss 600 "$python" "${speed[@]}" swap --model gpt-oss --runs 4 --dtypes bfloat16 float32 \
    --prompts 32 1024 --train-lengths 128 512
