"""Per step, how long the GPU computed and how long it waited: loop_bench's ``--gpu_busy``.

A step's time from CUDA events counts the GPU's idle moments inside the step (a sync, Python
between launches) as the step's. This reads the steps under ``torch.profiler`` (CUDA activity):
each step's ``span`` runs from its first kernel to the next step's first kernel (so the gap after
a step's last kernel, where the host prepares the next one, is the step's), ``busy`` is the union
of its kernels, copies and memsets inside that span, and ``idle = span - busy``. The kernels'
summed times by name say where the busy time went.

The profiler costs the host a little per launch (and the GPU waits for it where the host is the
slower side): a line that carries ``gpu_busy`` is for anatomy, not for ratios.

Usage (in a training loop)::

    timeline = GpuBusy(enabled=device == "cuda")
    with timeline:
        for i, batch in enumerate(batches):
            with timeline.step(i):
                train_step(batch)
    fields = timeline.fields()  # {"gpu_busy": {...}} or {}
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterable

STEP = "loop_step_"
#: trace categories whose events occupy the GPU
BUSY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class GpuBusy:
    """Profiles the steps run inside it (``enabled`` and CUDA only) and summarises the trace."""

    def __init__(self, enabled: bool, top: int = 25):
        self.enabled, self.top, self._prof, self._summary = enabled, top, None, None

    def __enter__(self) -> "GpuBusy":
        if self.enabled:
            import torch.profiler

            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(*exc)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as fh:
                events = json.load(fh).get("traceEvents", [])
        finally:
            os.unlink(path)
        self._prof = None
        self._summary = summarise(events, self.top)

    def step(self, index: int) -> contextlib.AbstractContextManager:
        """A step's range (its kernels inherit the name on the GPU's timeline)."""
        if self._prof is None:
            return contextlib.nullcontext()
        import torch.profiler

        return torch.profiler.record_function(f"{STEP}{index}")

    def fields(self) -> dict:
        """``{"gpu_busy": summary}`` once the steps ran profiled, else ``{}``."""
        return {} if self._summary is None else {"gpu_busy": self._summary}


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds in, milliseconds out).

    Example:
        >>> _union_ms([(0, 1000), (500, 1500), (3000, 4000)])
        2.5
    """
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total / 1e3


def summarise(events: list[dict], top: int = 25) -> dict:
    """Per profiled step (``loop_step_<i>`` ranges on the GPU's timeline): ``steps``, ``span_ms``,
    ``busy_ms``, ``host_ms`` (the host's range: how long it took to issue the step), and the
    ``top`` kernels by summed time over those steps (``kernels``: name, ms per step, launches per
    step).

    Example (two steps, the second waiting 2 ms for the host):
        >>> ev = [{"cat": "gpu_user_annotation", "name": "loop_step_0", "ts": 0, "dur": 4000},
        ...       {"cat": "gpu_user_annotation", "name": "loop_step_1", "ts": 5000, "dur": 4000},
        ...       {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 4000},
        ...       {"cat": "kernel", "name": "gemm", "ts": 5000, "dur": 1000},
        ...       {"cat": "kernel", "name": "add", "ts": 8000, "dur": 1000}]
        >>> s = summarise(ev)
        >>> s["steps"], s["span_ms"], s["busy_ms"]
        ([0, 1], [5.0, 4.0], [4.0, 2.0])
        >>> s["kernels"][0]
        ['gemm', 2.5, 1.0]
    """
    gpu_ranges, host_ms = {}, {}
    for e in events:
        name = e.get("name", "")
        if not name.startswith(STEP) or "dur" not in e:
            continue
        index = int(name[len(STEP):])
        if e.get("cat") == "gpu_user_annotation":
            start, end = gpu_ranges.get(index, (float("inf"), float("-inf")))
            gpu_ranges[index] = (min(start, e["ts"]), max(end, e["ts"] + e["dur"]))
        elif e.get("cat") == "user_annotation":
            host_ms[index] = e["dur"] / 1e3
    steps = sorted(gpu_ranges)
    if not steps:
        return {"steps": [], "note": "no step ranges on the GPU's timeline (was CUDA profiled?)"}
    # a step's span ends where the next one starts (its own last range end for the last step)
    bounds = [(gpu_ranges[i][0], gpu_ranges[j][0] if j is not None else gpu_ranges[i][1])
              for i, j in zip(steps, steps[1:] + [None])]
    busy = [[] for _ in steps]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    starts = [b[0] for b in bounds]
    for e in events:
        if e.get("cat") not in BUSY_CATS or "dur" not in e:
            continue
        k = bisect.bisect_right(starts, e["ts"]) - 1
        if k < 0 or e["ts"] >= bounds[k][1]:
            continue
        s, t = e["ts"], min(e["ts"] + e["dur"], bounds[k][1])
        busy[k].append((s, t))
        by_name[e["name"]][0] += e["dur"] / 1e3
        by_name[e["name"]][1] += 1
    n = len(steps)
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "span_ms": [round((e - s) / 1e3, 3) for s, e in bounds],
        "busy_ms": [round(_union_ms(b), 3) for b in busy],
        "host_ms": [round(host_ms.get(i, 0.0), 3) for i in steps],
        "kernels": [[name[:120], round(ms / n, 3), round(count / n, 1)] for name, (ms, count) in kernels],
    }
