"""Warm-up probes: what a block saves when kept, and its forward time (the recompute's price).

# NOTE [Probe]
Under ``full`` the blocks' saved tensors are held by the checkpoint and invisible to the
counter (NOTE [Who sees a checkpointed block's tensors], accounting.py). The probe re-runs a
block on detached copies of its inputs, counts what it saves, and drops the result: it costs
one block's activations for a moment, as ``full``'s own recompute does in backward, so warm-up
is safe under any budget ``full`` fits. The RNG is forked, so the real forward draws the
dropout masks of a run without the probe (gradients stay exact).

# NOTE [First run of a block]
The probe's time decides *which* blocks a mixed stack treats. A block's first run at a new
size pays once for what later runs reuse (lazily loaded kernels, library and allocator set-up
for the new shapes), so a single timed run can price a block many times its worth, and the
plans follow the noise. So a timed probe runs the block twice with autograd, the second run
reusing what the first set up, and the price is the faster run. The first run's saved tensors
are the ones counted; the second's go to a counter of their own (the step's counter is outside:
it must see neither), and each run's are freed before the next: the probe's peak stays one
block's activations.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

from memfit.accounting import ProbeCounter, SavedTensorCounter
from memfit.blocks import Block, without_cache

__all__ = ["probe_block"]


def probe_block(
    block: Block, args: tuple, kwargs: dict[str, Any], counter: SavedTensorCounter, timed: bool, device: torch.device,
) -> tuple[int, float | None]:
    """What ``block`` saves kept, and its forward time in ms if ``timed`` (NOTE [Probe]).

    Untimed, the block runs once (its bytes are all that is asked: NOTE [Blocks alike only in
    name], learner.py) and the time is ``None``.

    Args:
        block: the block, about to run its real forward on ``args``/``kwargs``.
        args, kwargs: its inputs.
        counter: the step's counter (its excluded storages are excluded here too).
        timed: time the block (two runs, the faster: NOTE [First run of a block]).
        device: the model's device (CUDA is synchronised around a timed run).
    """
    detached = tree_map(
        lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, (args, kwargs)
    )
    probe = ProbeCounter(counter.excluded_ptrs, counter.parameter_storages)
    cuda = device.type == "cuda" and timed
    devices = [device] if device.type == "cuda" else []
    times_ms = []
    counters = (probe, ProbeCounter(counter.excluded_ptrs, counter.parameter_storages)) if timed else (probe,)
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for run_counter in counters:
            probe_args, probe_kwargs = without_cache(block.module, *detached)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with run_counter.hooks():
                out = block._body(*probe_args, **probe_kwargs)
            if cuda:
                torch.cuda.synchronize(device)
            times_ms.append((time.perf_counter() - t0) * 1e3)
            del out, probe_args, probe_kwargs
    return probe.bytes, (min(times_ms) if timed else None)
