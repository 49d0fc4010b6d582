#!/usr/bin/env bash
# The eleventh session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/*-2026-11-23n).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_n.sh CALL. Every call ran the code with NOTE [First run of a block]
# and NOTE [Reading the backward's start] (runtime.py), with `--prime` running an untimed `none` first.
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
esac
