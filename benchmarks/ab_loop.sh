#!/usr/bin/env bash
# One loop_bench.py configuration with two versions of memfit (this tree and another commit's tree),
# on one machine, in one call: repeats in ABBA order (a drift of the machine's speed falls on both
# alike). For a change that must not move plans or times (a refactor): then
#   python benchmarks/ab_plans.py OUT_DIR
# prints, per method and budget, the steps whose plan differs between the versions and the paired
# per-step time ratio new/old.
# Usage (repository root, on the GPU machine; OLD_TREE holds another commit's src/ and benchmarks/,
# e.g. `git archive COMMIT src benchmarks | tar -x -C .check/old && rm -rf .check/old/benchmarks/results` here,
# carried: loop_bench.py imports its sibling scripts, so the whole folder):
#   bash benchmarks/ab_loop.sh OLD_TREE OUT_DIR REPEATS -- LOOP_BENCH_ARGS...
#   bash benchmarks/ab_loop.sh .check/old /tmp/ab 2 -- --model bert-base --dtype float32 \
#       --lengths uniform:32:512 --batch 32 --steps 100 --budgets --budget_gb 6 --methods none dynamic
set -euo pipefail
[ $# -ge 4 ] && [ "$4" = "--" ] || { echo "usage: bash benchmarks/ab_loop.sh OLD_TREE OUT_DIR REPEATS -- LOOP_BENCH_ARGS..." >&2; exit 2; }
old=$(cd "$1" && pwd); out=$2; repeats=$3; shift 4
here=$(pwd)
[ -f "$old/benchmarks/loop_bench.py" ] && [ -d "$old/src/memfit" ] || { echo "ab_loop.sh: $old needs src/memfit and benchmarks/loop_bench.py" >&2; exit 2; }
for sibling in $(sed -n 's/^ *from \([a-z_]*\) import .*/\1/p' "$old/benchmarks/loop_bench.py" | sort -u); do  # the scripts it imports
    [ ! -f "benchmarks/$sibling.py" ] || [ -f "$old/benchmarks/$sibling.py" ] || {
        echo "ab_loop.sh: $old/benchmarks lacks $sibling.py, which its loop_bench.py imports: archive the whole benchmarks/ folder" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
for ((rep = 0; rep < repeats; rep++)); do
    if ((rep % 2)); then order="old new"; else order="new old"; fi
    for v in $order; do
        tree=$here; [ "$v" = old ] && tree=$old
        PYTHONPATH=$tree/src python3 "$tree/benchmarks/loop_bench.py" "$@" --repeats 1 --first_repeat "$rep" \
            --output_dir "$out/$v-$rep"
    done
done
