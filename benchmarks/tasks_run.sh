#!/usr/bin/env bash
# One `memfit bench` invocation of the NLP tasks on the GPU machine, offline, into $OUT.
# Usage (repository root, with .carry/wheels and .carry/tok carried):
#   bash benchmarks/tasks_run.sh NAME "TASKS" "METHODS" "BUDGETS" STEPS [REPEATS]
# e.g. bash benchmarks/tasks_run.sh mc-tc3 "multiple-choice text-classification" "none dynamic oracle full static" 3 200
# Writes $OUT/NAME.tar.gz (results.jsonl, logs, gzipped step records, no weights).
set -uo pipefail
name=${1:?name} tasks=${2:?tasks} methods=${3:?methods} budgets=${4:?budgets} steps=${5:-200} repeats=${6:-1}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl 2>/dev/null
export PYTHONPATH=$PWD/src:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
r=/tmp/runs/$name
mkdir -p "$r"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$r/device.txt"
# shellcheck disable=SC2086
python3 -m memfit.cli bench --tasks $tasks --methods $methods --uncapped_none_only --budgets $budgets \
    --steps "$steps" --repeats "$repeats" --gpu_warmup_s 2 --output_dir "$r" \
    -- --config_name bert-base-uncased --tokenizer_name "$PWD/.carry/tok" 2>&1 | tee "$r/bench.log"
find "$r" -name '*.safetensors' -delete
find "$r" -name memfit_steps.jsonl -exec gzip -f {} \;
tar -C /tmp/runs -czf "${OUT:-/tmp}/$name.tar.gz" "$name"
