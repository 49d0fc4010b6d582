#!/usr/bin/env bash
# The twelfth session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/detection-2026-11-23o).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_o.sh CALL. Code: the probe's faster of two runs (NOTE [First run of
# a block], runtime.py) and the bool-mask collator, neither measured on a GPU before.
# Budgets: 0.5 x `none`'s largest peak (the last runs' budgets) and 0.7 x (where the largest
# scales still need checkpointing but the smallest need none: the "largest scales").
set -uo pipefail
case "${1:?call}" in
swinb07)  # Swin-B at batch 16, one shorter side per batch, 0.7 x none's peak (49.70 GB): none, dynamic, static, full, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-batch-07 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 49.70 --repeats 2 --steps 60 ;;
swinb05)  # the same at 0.5 x (35.49 GB), the twelfth run's cell, now with the new probe
    bash benchmarks/detection_run.sh swinb-b16-batch-05 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 60 ;;
swint)  # Swin-T at batch 16, one shorter side per batch, 0.5 and 0.7 x none's peak: none, dynamic, static, 2 repeats
    bash benchmarks/detection_run.sh swint-b16-batch-0507 480 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 17.78 24.92 --repeats 2 --steps 60 ;;
# After NOTE [Blocks alike only in name] (runtime.py): warm-up probes every block, and Swin's shifted
# and unshifted layers are planned apart (both dynamic processes of `swinb05` ran out of memory at step 6).
swinb05g)  # `swinb05` again on that code
    bash benchmarks/detection_run.sh swinb-b16-batch-05g 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 35.49 --repeats 2 --steps 60 ;;
swinb07g)  # `swinb07` again on that code
    bash benchmarks/detection_run.sh swinb-b16-batch-07g 480 --models base --methods dynamic static full \
        --multi_scale_per batch --budget_gb 49.70 --repeats 2 --steps 60 ;;
swintg)  # `swint` again on that code
    bash benchmarks/detection_run.sh swint-b16-batch-0507g 480 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 17.78 24.92 --repeats 2 --steps 60 ;;
swintg4)  # Swin-T at 0.7 x only, 4 more repeats of none, dynamic, static on that code (pooled with `swintg`'s 2)
    bash benchmarks/detection_run.sh swint-b16-batch-07g4 480 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 24.92 --repeats 4 --steps 60 ;;
esac
