#!/usr/bin/env bash
# One session on a 2-GPU machine: the 2-GPU DDP run, then two lanes of single-GPU benchmarks
# side by side (each lane on its own GPU: every ratio is taken within one lane, on one GPU).
# Usage (repository root, on the GPU machine):
#   [LANE_A="engine soak"] [LANE_B="tasks detection estimate"] [DDP=1] \
#   bash benchmarks/gpu_lanes.sh OUT_DIR TOKENIZER_DIR ORACLE_SWEEPS_DIR
# TOKENIZER_DIR: an uncased BERT tokenizer (benchmarks/carry_tokenizer.sh);
# ORACLE_SWEEPS_DIR: sweep_<budget>GB.json files of an earlier engine run (the oracle's plans).
# Stages: engine, soak, tasks, token-classification (tasks' last one alone), detection,
# estimate (needs .carry from benchmarks/carry_data.sh). Lanes run their stages in order.
set -uo pipefail
out=${1:?output dir}; tok=${2:?tokenizer dir}; sweeps=${3:?oracle sweeps dir}
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$out/device.txt"
tasks=(multiple-choice question-answering text-classification token-classification)

stage() {  # one stage on the lane's GPU
    case $1 in
    engine)  # the engine matrix (oracle plans from the earlier sweeps)
        mkdir -p "$out/engine" && cp "$sweeps"/sweep_*GB.json "$out/engine/"
        python3 benchmarks/engine_bench.py --output_dir "$out/engine" --phase runs --steps 200 --budgets 4 6 8 \
            --methods static dynamic oracle --gpu_warmup_s 2 > "$out/engine.log" 2>&1
        python3 benchmarks/engine_bench.py --output_dir "$out/engine" --phase runs --steps 200 --budgets 6 \
            --methods full --gpu_warmup_s 2 --skip_none >> "$out/engine.log" 2>&1 ;;
    soak)  # the reactive issue's GPU soak: 2,000 adversarial steps at 5 GB
        python3 benchmarks/engine_bench.py --output_dir "$out/soak" --phase runs --schedule adversarial --jump_every 250 \
            --steps 2000 --batch_size 16 --budgets 5 --max_ooms 200 --methods dynamic dynamic-nobackstop reactive \
            --gpu_warmup_s 2 > "$out/soak.log" 2>&1 ;;
    tasks|token-classification)
        local which=("${tasks[@]}"); [ "$1" = token-classification ] && which=(token-classification)
        python3 -m memfit.cli bench --tasks "${which[@]}" --methods none full dynamic --uncapped_none_only \
            --budgets 6 8 --steps 300 --gpu_warmup_s 2 --output_dir "$out/$1" \
            -- --config_name bert-base-uncased --tokenizer_name "$tok" > "$out/$1.log" 2>&1 ;;
    detection)
        python3 benchmarks/detection_bench.py --output_dir "$out/detection" \
            --time_limit_s "${DETECTION_LIMIT_S:-330}" > "$out/detection.log" 2>&1 ;;
    estimate)
        python3 benchmarks/estimate_bench.py --output_dir "$out/estimate" > "$out/estimate.log" 2>&1 ;;
    *) echo "unknown stage $1" >> "$out/failures.txt" ;;
    esac
    echo "$1 done $(date +%T)" >> "$out/stages.txt"
}
lane() {  # GPU, then its stages
    export CUDA_VISIBLE_DEVICES=$1; shift
    for s in "$@"; do stage "$s"; done
}
if [ "${DDP:-1}" = 1 ]; then
    DDP_STEPS=${DDP_STEPS:-60} timeout 400 bash benchmarks/ddp_bench.sh "$out/ddp" > "$out/ddp.log" 2>&1
    echo "ddp done $(date +%T)" >> "$out/stages.txt"
fi
lane 0 ${LANE_A-engine soak} & lane 1 ${LANE_B-tasks detection} & wait
echo finished > "$out/DONE"
