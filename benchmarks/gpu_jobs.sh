#!/usr/bin/env bash
# Several benchmark jobs side by side on one multi-GPU machine, each on its own GPUs and under
# its own time limit; each job's folder comes back as one tarball (the device tool returns few,
# shallow files).
#
#   bash benchmarks/gpu_jobs.sh OUT 'NAME|GPUS|SECONDS|COMMAND' ...
#
# COMMAND runs with CUDA_VISIBLE_DEVICES=GPUS and JOB_OUT=OUT/NAME (write results there); its
# output goes to OUT/NAME/log. A job past SECONDS is stopped (SIGTERM, then SIGKILL 15 s later);
# the others go on. Jobs on disjoint GPUs share the host's CPUs and PCIe: a timing compared across
# jobs is not a side-by-side measurement, one within a job is.
set -u
out=$1
shift
mkdir -p "$out"
pids=()
names=()
for spec in "$@"; do
    IFS='|' read -r name gpus seconds command <<<"$spec"
    mkdir -p "$out/$name"
    (
        export CUDA_VISIBLE_DEVICES=$gpus JOB_OUT=$out/$name
        start=$(date +%s)
        timeout -k 15 "$seconds" bash -c "$command" >"$out/$name/log" 2>&1
        rc=$?
        echo "job $name: rc $rc after $(($(date +%s) - start)) s on GPUs $gpus" | tee -a "$out/$name/log"
    ) &
    pids+=($!)
    names+=("$name")
done
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
done
for name in "${names[@]}"; do
    tail -n 3 "$out/$name/log"
    tar -C "$out" -czf "$out/$name.tgz" "$name" && rm -rf "${out:?}/$name"
done
