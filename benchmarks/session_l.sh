#!/usr/bin/env bash
# The ninth session's GPU calls (one H200 each; results in benchmarks/results/nvidia-h200/*-2026-11-23l).
# A record of what ran, not one call: each block below was one `run` of at most 10 minutes.
# Usage: bash benchmarks/session_l.sh CALL, with .carry/wheels and .carry/tok carried for the tasks.
# These calls ran when `memfit bench --prime` read the CUDA libraries into the page cache (1bc806a);
# run again today, --prime does an untimed `none` run first instead (NOTE [First process], bench.py).
set -uo pipefail
case "${1:?call}" in
1)  # Swin-B at batch 16, DETR's shorter side per image, at the eighth session's budget, with the
    # CUDA libraries read into the page cache first (since replaced by NOTE [First process]); none,
    # dynamic, static, reactive interleaved, 2 repeats
    bash benchmarks/detection_run.sh swinb-b16-image 560 --models base --methods dynamic static reactive \
        --multi_scale_per image --budget_gb 35.49 --repeats 2 --steps 60 ;;
2)  # Swin-S (0.5 x none's peak) and Swin-T (the eighth session's budget) at batch 16, one shorter side
    # per batch; none, dynamic and static interleaved, 2 repeats
    bash benchmarks/detection_run.sh swins-b16-batch 330 --models small --methods dynamic static \
        --multi_scale_per batch --budget_fractions 0.5 --repeats 2 --steps 60
    bash benchmarks/detection_run.sh swint-b16-batch 230 --models tiny --methods dynamic static \
        --multi_scale_per batch --budget_gb 17.78 --repeats 2 --steps 60 ;;
mc) bash benchmarks/tasks_matrix.sh mc multiple-choice 3 "" "4 5 6 7 8" 2 "ckptplan-0.75 hf-every-2" ;;
tc) bash benchmarks/tasks_matrix.sh tc text-classification 3 "" "4 5 6 7 8" 2 "ckptplan-0.75" ;;
qa) bash benchmarks/tasks_matrix.sh qa question-answering 4 "3 5" "6 7 8" 2 "" ;;
tok) CAPPED_METHODS="dynamic static" bash benchmarks/tasks_matrix.sh tok token-classification 5 "3 8" "" 2 "auto-batch" ;;
tok2) bash benchmarks/tasks_matrix.sh tok2 token-classification - "4 6" "" ;;
esac
