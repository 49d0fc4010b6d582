#!/usr/bin/env bash
# One task's row of the comparison matrix (issue #4) on the GPU machine, offline, into $OUT/NAME.tar.gz.
# Usage (repository root, with .carry/wheels and .carry/tok carried):
#   bash benchmarks/tasks_matrix.sh NAME TASK HALF "CAPPED" "FITS" REPEATS "PEERS" [STEPS]
#   HALF     the budget (GB) where the longest batches need about half the blocks: none (uncapped),
#            dynamic and the oracle REPEATS times, interleaved; then static, full and PEERS once
#   CAPPED   other budgets where none does not fit: dynamic, the oracle and static once each
#            (or $CAPPED_METHODS)
#   FITS     budgets where none fits (its plan is every method's but full's): dynamic once each
# e.g. bash benchmarks/tasks_matrix.sh mc "multiple-choice" 3 "" "4 5 6 7 8" 2 "ckptplan-0.75 hf-every-2"
# Every invocation writes into one folder: one results.jsonl, one report.
set -uo pipefail
name=${1:?name} task=${2:?task} half=${3:?half budget} capped=${4?capped budgets} fits=${5?fits budgets}
repeats=${6:-2} peers=${7-} steps=${8:-200}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl 2>/dev/null
export PYTHONPATH=$PWD/src:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
r=/tmp/runs/$name
mkdir -p "$r"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$r/device.txt"
bench() {  # bench METHODS BUDGETS [more flags]
    local methods=$1 budgets=$2; shift 2
    # shellcheck disable=SC2086
    python3 -m memfit.cli bench --tasks "$task" --methods $methods --uncapped_none_only --budgets $budgets \
        --steps "$steps" --gpu_warmup_s 2 --output_dir "$r" "$@" \
        -- --config_name bert-base-uncased --tokenizer_name "$PWD/.carry/tok" 2>&1 | tee -a "$r/bench.log"
    pack
}
pack() {  # after each invocation: a call cut at its limit still brings back what ran
    find "$r" -name '*.safetensors' -delete
    find "$r" -name memfit_steps.jsonl -exec gzip -kf {} \;
    tar -C /tmp/runs --exclude memfit_steps.jsonl -czf "${OUT:-/tmp}/$name.tar.gz" "$name"
}
if [ "$half" != - ]; then  # HALF "-": only CAPPED and FITS (a second call of one task)
    bench "none dynamic oracle" "$half" --repeats "$repeats"
    bench "static full $peers" "$half" --no-prime
fi
[ -n "$capped" ] && bench "${CAPPED_METHODS:-dynamic oracle static}" "$capped" --no-prime
[ -n "$fits" ] && bench "dynamic" "$fits" --no-prime
python3 -m memfit.cli report "$r" --output_dir "$r/report" > /dev/null 2>&1 || echo "report failed"
pack
