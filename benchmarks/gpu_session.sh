#!/usr/bin/env bash
# One GPU session: the engine benchmark, then the four tasks under 6 and 8 GB.
# Usage (on the GPU machine, repository root): bash benchmarks/gpu_session.sh OUT_DIR [TOKENIZER_DIR]
# TOKENIZER_DIR: an uncased BERT tokenizer folder for offline runs (benchmarks/carry_tokenizer.sh makes one).
set -uo pipefail
out=${1:?output dir}
tok=${2:-}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt"
extra=(--config_name bert-base-uncased)
[ -n "$tok" ] && extra+=(--tokenizer_name "$tok")
# Preflight: two steps of a task, so a broken setup fails in seconds, not after the matrix.
if ! python3 -m memfit.cli train text-classification --synthetic 64 --do_train --max_steps 2 \
        --per_device_train_batch_size 8 --save_strategy no --report_to none \
        --output_dir "$out/preflight" "${extra[@]}" > "$out/preflight.log" 2>&1; then
    tail -20 "$out/preflight.log"; echo "preflight failed: tasks skipped" > "$out/tasks.log"; skip_tasks=1
fi
python3 benchmarks/engine_bench.py --output_dir "$out/engine" --steps 200 --budgets 4 6 8 \
    --gpu_warmup_s 2 > "$out/engine.log" 2>&1
[ -z "${skip_tasks:-}" ] && python3 -m memfit.cli bench --tasks multiple-choice question-answering text-classification token-classification \
    --methods none full dynamic --uncapped_none_only --budgets 6 8 --steps 100 --gpu_warmup_s 2 --output_dir "$out/tasks" \
    -- "${extra[@]}" > "$out/tasks.log" 2>&1
echo finished > "$out/DONE"
