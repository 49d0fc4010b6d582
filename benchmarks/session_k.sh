#!/usr/bin/env bash
# The eighth session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/*-2026-11-22k).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_k.sh CALL (1-10), with .carry/wheels and .carry/tok carried for 2-3.
set -uo pipefail
case "${1:?call 1-10}" in
1)  # Swin-B at batch 16, one shorter side per batch, 0.5 x none's peak, 40 steps, every method, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch 530 --models base --methods dynamic static full reactive \
        --multi_scale_per batch --budget_fractions 0.5 --repeats 2 --steps 40 ;;
2)  # multiple choice at 3 GB, 3 repeats, after plans per longest shape in a bucket (4451e7b)
    bash benchmarks/tasks_run.sh mc3k "multiple-choice" "none dynamic oracle" 3 200 3 ;;
3)  # text classification at 3 GB, 3 repeats; the engine at 4 and 6 GB (planner cost per step)
    bash benchmarks/tasks_run.sh tc3k "text-classification" "none dynamic oracle" 3 200 3
    export PYTHONPATH=$PWD/src:$PWD/benchmarks HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    r=/tmp/runs/engine; mkdir -p $r
    python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 4 6 --methods dynamic --gpu_warmup_s 2 > $r/engine.log 2>&1
    find $r -name '*.jsonl' -path '*steps*' -exec gzip -f {} \;
    tar -C /tmp/runs -czf "$OUT/engine.tar.gz" engine ;;
4)  # Swin-B as in 1, 90 steps, at call 1's budget (35.49 GB), dynamic/static/reactive, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch-90 545 --models base --methods dynamic static reactive \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 90 ;;
5)  # Swin-T at batch 16, one run of every method; the engine's planner after rows share a bucket's plan
    bash benchmarks/detection_run.sh swint-b16-batch 400 --models tiny --methods dynamic static full reactive \
        --multi_scale_per batch --budget_fractions 0.5 --steps 60
    export PYTHONPATH=$PWD/src:$PWD/benchmarks HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    r=/tmp/runs/engine; mkdir -p $r
    python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 4 6 --methods dynamic --skip_none --gpu_warmup_s 2 > $r/engine.log 2>&1
    find $r -name '*.jsonl' -path '*steps*' -exec gzip -f {} \;
    tar -C /tmp/runs -czf "$OUT/engine.tar.gz" engine ;;
6)  # Swin-B at batch 16 with DETR's shorter side per image (batches pad to near the largest), 2 repeats:
    # every memfit run failed (8 replays of the same empty plan), code of aa55f93's parent
    bash benchmarks/detection_run.sh swinb-b16-image 480 --models base --methods dynamic static \
        --multi_scale_per image --budget_gb 35.49 --repeats 2 --steps 60 ;;
7)  # the failure again, with each OOM logged
    bash benchmarks/detection_run.sh swinb-b16-image-diag2 300 --models base --methods dynamic \
        --multi_scale_per image --budget_gb 35.49 --steps 60 ;;
8|9)  # after the fixes: 8 with size curves flat below their samples and the replay rule, 9 with
    # both bounds of NOTE [Sizes outside the samples] (aa55f93)
    name=swinb-b16-image-fixed; [ "$1" = 9 ] && name=swinb-b16-image-fixed2
    bash benchmarks/detection_run.sh $name 420 --models base --methods dynamic static \
        --multi_scale_per image --budget_gb 35.49 --steps 60 ;;
10) # the final code: the engine at 4 and 6 GB, multiple choice at 3 GB
    export PYTHONPATH=$PWD/src:$PWD/benchmarks HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    r=/tmp/runs/engine; mkdir -p $r
    python3 benchmarks/engine_bench.py --output_dir $r --phase runs --steps 200 --budgets 4 6 --methods dynamic --skip_none --gpu_warmup_s 2 > $r/engine.log 2>&1
    find $r -name '*.jsonl' -path '*steps*' -exec gzip -f {} \;
    tar -C /tmp/runs -czf "$OUT/engine.tar.gz" engine
    bash benchmarks/tasks_run.sh mc3final "multiple-choice" "none dynamic oracle" 3 200 1 ;;
esac
