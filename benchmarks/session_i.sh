#!/usr/bin/env bash
# The seventh session's second GPU call: the engine at 6 GB (dynamic, full, oracle from the
# committed sweep) and 4 GB (dynamic), then multiple choice at 3 GB with two repeats of
# none/dynamic/oracle. Usage: bash benchmarks/session_i.sh (writes $OUT/*.tar.gz)
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
r=/tmp/runs/engine; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/device.txt
cp benchmarks/results/nvidia-h200/engine-2026-11-22d/sweep_6GB.json $r/
python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 6 --methods dynamic full oracle --gpu_warmup_s 2 > $r/engine.log 2>&1
python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 4 --methods dynamic --skip_none --gpu_warmup_s 2 >> $r/engine.log 2>&1
tail -n 12 $r/engine.log
find $r -name '*.jsonl' -path '*steps*' -exec gzip -f {} \;
tar -C /tmp/runs -czf "$OUT/engine.tar.gz" engine
bash benchmarks/tasks_run.sh mc3r "multiple-choice" "none dynamic oracle" 3 200 2 > /dev/null
tail -n 7 /tmp/runs/mc3r/bench.log
