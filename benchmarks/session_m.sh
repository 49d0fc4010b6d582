#!/usr/bin/env bash
# The tenth session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/*-2026-11-23m).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_m.sh CALL, with .carry/wheels and .carry/tok carried for the tasks.
# Every call ran with the partial transient read at a step's first recompute (NOTE [Reading the
# backward's start], runtime.py) and with `--prime` running an untimed `none` first.
set -uo pipefail
case "${1:?call}" in
swint)  # Swin-T at batch 16, the budget of the last two runs: none, dynamic, static, full, 3 repeats
    bash benchmarks/detection_run.sh swint-b16-batch 540 --models tiny --methods dynamic static full \
        --multi_scale_per batch --budget_gb 17.78 --repeats 3 --steps 60 ;;
swins)  # Swin-S at batch 16 (0.5 x none's peak, as last run): none, dynamic, static, full, reactive, 2 repeats
    bash benchmarks/detection_run.sh swins-b16-batch 560 --models small --methods dynamic static full reactive \
        --multi_scale_per batch --budget_gb 27.02 --repeats 2 --steps 60 ;;
reactive)  # reactive beside dynamic at each task's half-layers budget (the untimed prime is none)
    bash benchmarks/tasks_run.sh mc-reactive multiple-choice "dynamic reactive" 3 200
    bash benchmarks/tasks_run.sh tc-reactive text-classification "dynamic reactive" 3 200
    bash benchmarks/tasks_run.sh qa-reactive question-answering "dynamic reactive" 4 200
    bash benchmarks/tasks_run.sh tok-reactive token-classification "dynamic reactive" 6 200 ;;
qahigh)  # QA at 6-8 GB, where none fits (cut short of the oracle to fit the machine's 30 minutes)
    timeout 350 bash benchmarks/tasks_run.sh qa-high question-answering "none dynamic static" "6 7 8" 200 ;;
oracle)  # none, dynamic and the oracle at each task's half-layers budget, on this session's code
    bash benchmarks/tasks_run.sh mc-oracle multiple-choice "none dynamic oracle" 3 200
    bash benchmarks/tasks_run.sh tc-oracle text-classification "none dynamic oracle" 3 200
    bash benchmarks/tasks_run.sh qa-oracle question-answering "none dynamic oracle" 4 200
    bash benchmarks/tasks_run.sh tok-oracle token-classification "none dynamic oracle" 6 200 ;;
    # (the call's 585 s ran out during TOK's oracle: TOK ran again in the next call)
tok)  # TOK: none, dynamic and the oracle at 6 GB; dynamic and the oracle at 3, 7 and 8 GB
    bash benchmarks/tasks_run.sh tok-oracle token-classification "none dynamic oracle" 6 200
    bash benchmarks/tasks_run.sh tok-edges token-classification "dynamic oracle" "3 7 8" 200 ;;
swinb)  # Swin-B at batch 16, DETR's shorter side per image, the tenth run's budget: every method, once
    bash benchmarks/detection_run.sh swinb-b16-image 450 --models base --methods dynamic static full reactive \
        --multi_scale_per image --budget_gb 35.49 --repeats 1 --steps 60 ;;
esac
