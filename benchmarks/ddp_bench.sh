#!/usr/bin/env bash
# Two GPUs, one budget per rank: bert-base under DDP with the memfit Trainer (issue #8).
# Each rank has its own cap and its own length distribution (rank 0: 32..256 tokens, rank 1:
# 256..512), batch 32 per rank, 100 steps, fp32, AdamW, random weights (no download).
# Configurations: none (uncapped, the reference), full and dynamic at 6 GB, dynamic at 8 GB,
# dynamic at 8 GB with DDP's own overlapped sync (--memfit_lockstep False: the lockstep's
# cost), and a 5-step check of `accelerate launch`. About 4 minutes on 2 H200s.
#
# Usage (2-GPU machine, repository root): bash benchmarks/ddp_bench.sh OUT_DIR
#        check the script on CPU (gloo, tiny BERT): bash benchmarks/ddp_bench.sh OUT_DIR --tiny
# Results: OUT_DIR/<config>/ (memfit_steps.rank{0,1}.jsonl, memfit_summary.json, run.json),
#          OUT_DIR/results.jsonl and OUT_DIR/summary.md (python benchmarks/ddp_bench.py summarize OUT_DIR).
set -uo pipefail
out=${1:?output dir}
mode=${2:-gpu}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$out"
if [ "$mode" = --tiny ]; then
    export OMP_NUM_THREADS=1
    common=(--tiny --steps 12 --batch_size 4 --lengths0 8:32 --lengths1 96:160 --gpu_warmup_s 0)
    low=10MB high=16MB limit=180  # logical budgets: rank 0 peaks near 7 MB, rank 1 near 23 MB
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt" 2>&1
    common=(--steps "${DDP_STEPS:-100}" --batch_size 32 --lengths0 32:256 --lengths1 256:512 --gpu_warmup_s 2)
    low=6GB high=8GB limit=100  # a configuration takes about 35 s
fi
port=29650

one() {  # one configuration: NAME, then ddp_bench.py run flags
    local name=$1; shift
    port=$((port + 1))
    timeout "$limit" python3 -m torch.distributed.run --nproc_per_node 2 --master_port "$port" \
        benchmarks/ddp_bench.py run --output_dir "$out/$name" "${common[@]}" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && rc="124: timed out after ${limit} s"
        echo "$name failed (exit $rc): see $name.log" | tee -a "$out/failures.txt"
        grep -m3 "Error" "$out/$name.log"
        return 1
    fi
}

# The reference first: if it cannot run, nothing else will.
one none --method none || { echo "reference run failed: matrix skipped"; exit 1; }
one "full-$low" --method full --budget "$low"
one "dynamic-$low" --method dynamic --budget "$low"
one "dynamic-$high" --method dynamic --budget "$high"
one "dynamic-$high-ddp-sync" --method dynamic --budget "$high" --ddp_sync

if [ "$mode" != --tiny ]; then  # accelerate launches multi-process CPU runs only through mpirun
    if ! timeout "$limit" accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
            --dynamo_backend no --main_process_port $((port + 1)) benchmarks/ddp_bench.py run \
            --output_dir "$out/accelerate-check" "${common[@]}" --steps 5 --method dynamic --budget "$low" \
            > "$out/accelerate-check.log" 2>&1; then
        echo "accelerate-check failed: see accelerate-check.log" | tee -a "$out/failures.txt"
    fi
fi

python3 benchmarks/ddp_bench.py summarize "$out" | tee "$out/summary.txt"
echo finished > "$out/DONE"
