#!/usr/bin/env bash
# The thirteenth session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/detection-2026-11-23p).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_p.sh CALL. Code: an armed step teaches what its plan holds run
# plainly (NOTE [Backstop], runtime.py), which the twelfth session's runs did not: there `dynamic`
# over-predicted its unarmed steps by 0.8-2.0 GB. Budgets as session_o.sh: 0.5 and 0.7 x `none`'s
# largest peak. Repeats pool across calls (benchmarks/step_sums.py, `memfit report`).
set -uo pipefail
case "${1:?call}" in
swint07a)  # Swin-T at batch 16, one shorter side per batch, 0.7 x (24.92 GB): none, dynamic, static, full, 3 repeats
    bash benchmarks/detection_run.sh swint-b16-batch-07a 480 --models tiny --methods dynamic static full \
        --multi_scale_per batch --budget_gb 24.92 --repeats 3 --steps 60 ;;
swint07b)  # the same cell, 4 more repeats of none, dynamic, static
    bash benchmarks/detection_run.sh swint-b16-batch-07b 480 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 24.92 --repeats 4 --steps 60 ;;
swinb07a)  # Swin-B at batch 16, 0.7 x (49.70 GB): none, dynamic, static, full, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch-07a 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 49.70 --repeats 2 --steps 60 ;;
swinb07b)  # the same cell, 2 more repeats
    bash benchmarks/detection_run.sh swinb-b16-batch-07b 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 49.70 --repeats 2 --steps 60 ;;
swint05)  # Swin-T at 0.5 x (17.78 GB): none, dynamic, static, 4 repeats
    bash benchmarks/detection_run.sh swint-b16-batch-05 480 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 17.78 --repeats 4 --steps 60 ;;
swinb05)  # Swin-B at 0.5 x (35.49 GB): none, dynamic, static, full, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch-05 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 60 ;;
# After the planner's BLAS products into kept buffers (NOTE [Enumerating classes], planner.py): a plan
# of the 11-class Swin-B grid cost a median 8 ms in the `swinb05` processes, dynamic planning 34 of 57 steps.
swinb05p)  # Swin-B at 0.5 x again, none, dynamic, static, 2 repeats (the device time left: no `full`)
    bash benchmarks/detection_run.sh swinb-b16-batch-05p 300 --models base --methods dynamic static \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 60 ;;
esac
