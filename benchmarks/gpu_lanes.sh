#!/usr/bin/env bash
# One session on a 2-GPU machine: the 2-GPU DDP run, then two lanes of single-GPU benchmarks
# side by side (each lane on its own GPU: every ratio is taken within one lane, on one GPU).
# Usage (repository root, on the GPU machine):
#   bash benchmarks/gpu_lanes.sh OUT_DIR TOKENIZER_DIR ORACLE_SWEEPS_DIR
# TOKENIZER_DIR: an uncased BERT tokenizer (benchmarks/carry_tokenizer.sh);
# ORACLE_SWEEPS_DIR: sweep_<budget>GB.json files of an earlier engine run (the oracle's plans).
set -uo pipefail
out=${1:?output dir}; tok=${2:?tokenizer dir}; sweeps=${3:?oracle sweeps dir}
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$out/engine" "$out/soak"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$out/device.txt"
cp "$sweeps"/sweep_*GB.json "$out/engine/"
lane_a() {  # GPU 0: the engine matrix (oracle plans from the earlier sweeps), then the soak
    export CUDA_VISIBLE_DEVICES=0
    python3 benchmarks/engine_bench.py --output_dir "$out/engine" --phase runs --steps 200 --budgets 4 6 8 \
        --methods static dynamic oracle --gpu_warmup_s 2 > "$out/engine.log" 2>&1
    python3 benchmarks/engine_bench.py --output_dir "$out/engine" --phase runs --steps 200 --budgets 6 \
        --methods full --gpu_warmup_s 2 --skip_none >> "$out/engine.log" 2>&1
    python3 benchmarks/engine_bench.py --output_dir "$out/soak" --phase runs --schedule adversarial --jump_every 250 \
        --steps 2000 --batch_size 16 --budgets 5 --max_ooms 200 --methods dynamic dynamic-nobackstop reactive \
        --gpu_warmup_s 2 > "$out/soak.log" 2>&1
    echo done > "$out/LANE_A"
}
lane_b() {  # GPU 1: the four tasks, then what the other issues' scripts measure
    export CUDA_VISIBLE_DEVICES=1
    python3 -m memfit.cli bench --tasks multiple-choice question-answering text-classification token-classification \
        --methods none full dynamic --uncapped_none_only --budgets 6 8 --steps 300 --gpu_warmup_s 2 \
        --output_dir "$out/tasks" -- --config_name bert-base-uncased --tokenizer_name "$tok" > "$out/tasks.log" 2>&1
    python3 benchmarks/detection_bench.py --output_dir "$out/detection" --time_limit_s "${DETECTION_LIMIT_S:-240}" \
        > "$out/detection.log" 2>&1
    echo done > "$out/LANE_B"
}
DDP_STEPS=${DDP_STEPS:-60} timeout 400 bash benchmarks/ddp_bench.sh "$out/ddp" > "$out/ddp.log" 2>&1
echo done > "$out/DDP"
lane_a & lane_b & wait
echo finished > "$out/DONE"
