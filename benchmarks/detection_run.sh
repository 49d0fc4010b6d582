#!/usr/bin/env bash
# One detection_bench.py invocation on the GPU machine, offline, into $OUT/NAME.tar.gz
# (results, logs, report, gzipped step records, no weights).
# Usage (repository root): bash benchmarks/detection_run.sh NAME TIME_LIMIT_S [detection_bench.py flags]
# e.g. bash benchmarks/detection_run.sh swinb-b16 540 --models base --repeats 2 --steps 40
set -uo pipefail
name=${1:?name} limit=${2:?seconds}
shift 2
export PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
r=/tmp/runs/$name
mkdir -p "$r"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$r/device.txt"
python3 benchmarks/detection_bench.py --output_dir "$r" --time_limit_s "$limit" --gpu_warmup_s 2 "$@" 2>&1 | tee "$r/detection.log"
find "$r" -name '*.safetensors' -delete
find "$r" -name memfit_steps.jsonl -exec gzip -f {} \;
tar -C /tmp/runs -czf "${OUT:-/tmp}/$name.tar.gz" "$name"
