#!/usr/bin/env bash
# Produces the tuning records shipped in tune_logs/ (MetaSchedule JSON databases + index.json +
# verified.json, the same-run default-vs-tuned check) for the core issue's benchmark shapes on
# this machine's CPU. Each run resumes its database.
#   bash benchmarks/tune_shipped.sh [trials per variant, default 48] [--verify-only]
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-48}
extra=${2:-}
run() { python -m tvmflash.tune --target llvm --trials "$trials" --log-dir "${TUNE_LOG_DIR:-tune_logs}" $extra "$@"; }
for dtype in float32 bfloat16; do
    run --dtype "$dtype" --head-dim 64 --seqlen 2048 --batch 1 --heads 8
    run --dtype "$dtype" --head-dim 64 --seqlen 2048 --batch 1 --heads 8 --causal
    run --dtype "$dtype" --head-dim 128 --seqlen 4096 --batch 1 --heads 4 --causal
    run --dtype "$dtype" --head-dim 128 --seqlen 1024 --batch 2 --heads 8
done
