"""What pinning host memory costs under the allocator's settings (NOTE [Pinned pool], treatments/offload.py).

Each setting runs in a fresh process (torch's host allocator keeps what it pinned): ``N`` buffers of ``GIB`` GiB from
``torch.empty(..., pin_memory=True)``, each timed, then one copy to the device and back from the last (a buffer the
driver did not pin copies at pageable speed). Settings: the default (``cudaHostAlloc``), then ``malloc`` +
``cudaHostRegister`` with the pages touched on 1, 8 and 16 threads, from the environment and set at run time through
``torch._C._accelerator_setAllocatorSettings`` after CUDA started. One JSON line per setting.

    PYTHONPATH=src python benchmarks/pin_cost.py          # N=6 GIB=1 by default
"""
import json, os, subprocess, sys, time

SETTINGS = [("default", "", None),
            ("register-1", "pinned_use_cuda_host_register:True,pinned_num_register_threads:1", None),
            ("register-8", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8", None),
            ("register-16", "pinned_use_cuda_host_register:True,pinned_num_register_threads:16", None),
            ("runtime-16", "", "pinned_use_cuda_host_register:True,pinned_num_register_threads:16")]


def one(runtime: str | None) -> dict:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    if runtime:
        torch._C._accelerator_setAllocatorSettings(runtime)
    n, size = int(os.environ.get("N", "6")), int(float(os.environ.get("GIB", "1")) * 2**30)
    pin_s, keep = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        pin_s.append(time.perf_counter() - t0)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    copies = {}
    for name, dst, src in (("h2d", dev, keep[-1]), ("d2h", keep[-1], dev)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copies[name] = round(size / (time.perf_counter() - t0) / 1e9, 1)
    return {"pin_s": [round(t, 3) for t in pin_s], "s_per_gib": round(sum(pin_s) / (n * size / 2**30), 3),
            "copy_gb_s": copies, "is_pinned": bool(keep[-1].is_pinned())}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one(sys.argv[2] if len(sys.argv) > 2 else None)))
        sys.exit(0)
    for name, env, runtime in SETTINGS:
        conf = ",".join(x for x in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), env) if x)
        cmd = [sys.executable, __file__, "child"] + ([runtime] if runtime else [])
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}, capture_output=True, text=True)
        line = {"setting": name, "alloc_conf": conf, "runtime": runtime, "process_s": round(time.perf_counter() - t0, 2)}
        try:
            line.update(json.loads(res.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            line["error"] = (res.stderr or res.stdout).strip().splitlines()[-1:]
        print(json.dumps(line), flush=True)
