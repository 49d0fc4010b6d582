#!/usr/bin/env bash
# The seventh session's last GPU call: the engine's planner at 4 and 6 GB after the transient
# and row changes (none uncapped, dynamic at 4 and 6 GB). Usage: bash benchmarks/session_j.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
r=/tmp/runs/engine; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/device.txt
python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 4 6 --methods dynamic --gpu_warmup_s 2 > $r/engine.log 2>&1
tail -n 8 $r/engine.log
find $r -name '*.jsonl' -path '*steps*' -exec gzip -f {} \;
tar -C /tmp/runs -czf "$OUT/engine.tar.gz" engine
