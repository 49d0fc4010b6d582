#!/usr/bin/env bash
# The eleventh session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/*-2026-11-23n).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_n.sh CALL. Every call ran with `--prime` (an untimed `none` first) and
# NOTE [Reading the backward's start] (runtime.py); all but the last with the tenth session's probe
# (one untimed run per block group in a process), the last (swinb2) with the probe's faster of two runs.
set -uo pipefail
case "${1:?call}" in
swinb)  # Swin-B at batch 16, DETR's shorter side per image, the tenth run's budget: none, dynamic, static, full, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-image 560 --models base --methods dynamic static full \
        --multi_scale_per image --budget_gb 35.49 --repeats 2 --steps 60 ;;
swint)  # Swin-T at batch 16, the budget of the last three runs: none, dynamic, static, full, reactive, 2 repeats
    bash benchmarks/detection_run.sh swint-b16-batch 560 --models tiny --methods dynamic static full reactive \
        --multi_scale_per batch --budget_gb 17.78 --repeats 2 --steps 60 ;;
swins)  # Swin-S at batch 16 (0.5 x none's peak): none, dynamic, static, full, reactive, 2 repeats
    bash benchmarks/detection_run.sh swins-b16-batch 560 --models small --methods dynamic static full reactive \
        --multi_scale_per batch --budget_gb 27.02 --repeats 2 --steps 60 ;;
swinbb)  # Swin-B at batch 16, one shorter side per batch (the ninth run's budget, 0.5 x none's peak): none, dynamic, static, full, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch 560 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 60 ;;
recompute)  # what a plan's recompute costs in a real backward against the probe's price (Swin-B, Swin-T; run twice)
    export PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
    python3 benchmarks/recompute_bench.py --probes 7 --json "$OUT/recompute-swinb.json"
    python3 benchmarks/recompute_bench.py --probes 7 --config_name conditional-detr-swin-tiny --json "$OUT/recompute-swint.json" \
        --plans none= stage1=0-1 stage2=2-3 stage3x4=4-7 stage3x6=4-9 stage4=10-11 encoder=12-17 decoder=18-23 full=0-23 ;;
swinb2)  # after the probe's faster-of-two-runs price (NOTE [First run of a block]): Swin-B per image again, none, dynamic, static, 3 repeats
    # (ran past the call's 600 s with the report and archive still to write: nothing came back)
    bash benchmarks/detection_run.sh swinb-b16-image-probe2 565 --models base --methods dynamic static \
        --multi_scale_per image --budget_gb 35.49 --repeats 3 --steps 60 ;;
swinb3)  # the same, once each (the device time left): the probe's prices and the plans they make
    bash benchmarks/detection_run.sh swinb-b16-image-probe2 240 --models base --methods dynamic static \
        --multi_scale_per image --budget_gb 35.49 --repeats 1 --steps 60 ;;
esac
