#!/usr/bin/env bash
# Produces the tuning records shipped in tune_logs/ for this machine's CPU:
# tune_logs/<target key>/d<head_dim>-<dtype>.json, the compact records compile() reads (per kernel:
# the tuned config, the shape and mask it was tuned at, and the same-run default-vs-tuned speedup
# that decides whether compile() uses it). Records are per target, head dim and dtype (masks are
# runtime arguments), so there is one benchmark shape per variant. MetaSchedule's databases are the
# tuner's working files: in $TUNE_WORK_DIR (default: the tuner's, $TVMFLASH_TUNE_LOGS or
# <cache dir>/tune_logs), never in the package; each run resumes its database.
#   bash benchmarks/tune_shipped.sh [trials per variant, default 48] [--verify-only]
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-48}
extra=${2:-}
run() {
    python -m tvmflash.tune --target llvm --trials "$trials" ${TUNE_WORK_DIR:+--log-dir "$TUNE_WORK_DIR"} \
        --records-dir tune_logs $extra "$@"
}
for dtype in float32 bfloat16; do
    run --dtype "$dtype" --head-dim 64 --seqlen 2048 --batch 1 --heads 8 --causal
    run --dtype "$dtype" --head-dim 128 --seqlen 4096 --batch 1 --heads 4 --causal
done
