"""What an OOM's failed attempt leaves allocated once the replay has cleaned it up (NOTE [What a failed
attempt leaves], engine/run/replay.py): loop_bench.py as given, with the CUDA meter's release wrapped.

After each clean-up it prints the allocated bytes (at once, after half a second, after a backward on the
device, after a synchronisation and after a backward that fails on the device: is the release only late, or
held until autograd's next failure?), the live tensors that have a graph
(``grad_fn``) and what refers to them, the live ``torch.utils.checkpoint`` frames and what refers to
them, and the largest live CUDA tensors beside the parameters. ``--no_check`` lets the replay go on
past the head's static check, to see whether the bytes left are freed later.

    python benchmarks/oom_leftover.py [--no_check] LOOP_BENCH_ARGS...
    python benchmarks/oom_leftover.py --model Llama-3.2-1B --lengths sft --batch 4 --steps 30 --steady_from 8 \\
        --budgets --budget_gb 11.81 --repeats 1 --no_cudnn_sdpa --methods none dynamic+auto --output_dir /tmp/left

Each line starts with ``LEFT``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def _say(text: str) -> None:
    print(f"LEFT {text}", flush=True)


def _describe(obj: object) -> str:
    words = type(obj).__name__
    if isinstance(obj, types.FrameType):
        words += f" {os.path.basename(obj.f_code.co_filename)}:{obj.f_lineno}:{obj.f_code.co_name}"
    elif isinstance(obj, types.FunctionType):
        words += f" {obj.__qualname__}"
    elif isinstance(obj, dict):
        words += f" keys={list(obj)[:6]}"
    return words[:200]


def _referrers(obj: object, skip: tuple) -> list[str]:
    return [_describe(r) for r in gc.get_referrers(obj) if not any(r is s for s in skip)][:6]


def _report(device: torch.device) -> None:
    gc.collect()
    _say(f"allocated after the clean-up {torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    time.sleep(0.5)
    gc.collect()
    _say(f"after 0.5 s {torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    x = torch.ones(1, device=device, requires_grad=True)
    (x * 2).sum().backward()
    del x
    gc.collect()
    _say(f"after a backward on the device {torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    torch.cuda.synchronize(device)
    gc.collect()
    _say(f"after a synchronisation {torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    # the bytes were freed when the next attempt failed (devlog, session 29): does any failing backward on the
    # device free them, that is, does autograd keep its last failure (pytorch/pytorch#82218)?
    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("oom_leftover: a backward that fails")

    y = torch.ones(1, device=device, requires_grad=True) * 2
    y.register_hook(fail)
    try:
        y.sum().backward()
    except RuntimeError:
        pass
    del y
    gc.collect()
    _say(f"after a backward that fails on the device {torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    live = gc.get_objects()
    tensors = [o for o in live if isinstance(o, torch.Tensor)]
    roots = [t for t in tensors if t.grad_fn is not None]
    frames = [o for o in live if type(o).__name__ == "_CheckpointFrame"]
    skip = (live, tensors, roots, frames)
    _say(f"tensors with a graph: {len(roots)}")
    for t in roots[:6]:
        _say(f"  {tuple(t.shape)} {t.grad_fn.name()} <- {_referrers(t, skip)}")
    _say(f"checkpoint frames: {len(frames)}")
    for f in frames[:4]:
        _say(f"  <- {_referrers(f, skip)}")
    params = {p.untyped_storage().data_ptr() for p in tensors if isinstance(p, torch.nn.Parameter)}
    seen: dict[int, tuple] = {}
    for t in tensors:
        if t.is_cuda and (ptr := t.untyped_storage().data_ptr()) not in params and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)
    _say(f"live CUDA tensors beside the parameters: {len(seen)}, {sum(v[0] for v in seen.values()) / GIB:.3f} GiB")
    for nbytes, shape, dtype in sorted(seen.values(), key=lambda v: -v[0])[:12]:
        _say(f"  {nbytes / 2**20:9.1f} MiB {shape} {dtype}")


def main(argv: list[str]) -> int:
    sys.path.insert(0, HERE)
    import loop_bench
    from memfit.engine.run import meter as meters

    release = meters.CudaMeter.release

    def reporting(self):
        out = release(self)
        _report(self.device)
        return out

    meters.CudaMeter.release = reporting
    if "--no_check" in argv:
        argv = [a for a in argv if a != "--no_check"]
        from memfit.engine.parts.treatments.chunked_head import HeadPart

        HeadPart.check_fits = lambda self, tokens, static, budget: _say(
            f"the head's check at {tokens} tokens: static {static / GIB:.2f} GiB, allocated "
            f"{torch.cuda.memory_allocated() / GIB:.2f} GiB (not enforced)")
    return loop_bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
