#!/usr/bin/env bash
# One tasks cell with two versions of memfit's source on one machine, in one call: `dynamic` of
# each and `none` beside them, repeats in ABBA order (a drift of the machine's speed falls on
# both alike), after an untimed none that primes the machine. For a result that moved between
# runs on different machines: is it the code or the machine?
# Usage (repository root, on the GPU machine; OLD_SRC a copy of the other commit's src/, e.g.
# `git worktree add /tmp/old <commit>` here and its src/ copied into an ignored carried folder):
#   bash benchmarks/ab_src.sh OLD_SRC TASK BUDGET_GB [REPEATS] [OUT_DIR]
#   bash benchmarks/ab_src.sh .check/old-src text-classification 3 3 /tmp/ab
# Each run's results.jsonl is under OUT_DIR/<new|old|none>-<repeat>/; needs .carry/minilm
# (benchmarks/carry.sh tokenizer). CONFIG (default bert-base-uncased) is the model's config;
# EXTRA adds training arguments (--use_cpu for a smoke run on a CPU).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: bash benchmarks/ab_src.sh OLD_SRC TASK BUDGET_GB [REPEATS] [OUT_DIR]" >&2; exit 2; }
[ -d "$1" ] || { echo "ab_src.sh: no folder $1; give a copy of another commit's src/" >&2; exit 2; }
old=$(cd "$1" && pwd); task=$2; budget=$3; repeats=${4:-3}; out=${5:-/tmp/ab}
here=$(pwd)
[ -d "$old/memfit" ] || { echo "ab_src.sh: $old has no memfit package; give a copy of another commit's src/" >&2; exit 2; }
[ -d .carry/minilm ] || { echo "ab_src.sh: no .carry/minilm; run bash benchmarks/carry.sh tokenizer" >&2; exit 2; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
run() {  # method src prime-flag folder
    PYTHONPATH=$2 python3 -m memfit.cli bench --tasks "$task" --uncapped_none_only --budgets "$budget" --steps 200 \
        --repeats 1 --gpu_warmup_s 2 $3 --methods "$1" --output_dir "$out/$4" -- --config_name "${CONFIG:-bert-base-uncased}" \
        --tokenizer_name "$here/.carry/minilm" ${EXTRA:-}
}
run none "$here/src" --prime prime
for ((rep = 0; rep < repeats; rep++)); do
    if ((rep % 2)); then order="old new"; else order="new old"; fi
    for v in $order; do
        src=$here/src; [ "$v" = old ] && src=$old
        run dynamic "$src" --no-prime "$v-$rep"
    done
    run none "$here/src" --no-prime "none-$rep"
done
