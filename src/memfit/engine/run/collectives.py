"""The collective wait: how long a rank's step waited on FSDP2's all-gathers.

# NOTE [The collective wait]
Under FSDP2 a block's parameters are all-gathered before its forward and again before its backward, and
the rank's compute waits for each gather to finish (``FSDPParamGroup.unshard`` issues it,
``wait_for_unshard`` makes the compute wait on it and copies its result out). A collective finishes when
the last rank joins it, so a rank whose plan is cheaper than another's reaches each gather early and
waits there for the slower one: ranks with different plans wait on each other, and the step's time
says nothing of where it went. So memfit times those two calls on every parameter group of a sharded
model: on CUDA by two events on the current stream around each (the compute stream's stall behind the
gather and its copy-out; the gather's own stream is not timed), read when a record is made without
waiting for the device (a sync a step would stall the host's run-ahead): the calls whose events the
device has not reached yet go to the next record; on a CPU (gloo) by the host's clock, where the
gather blocks the host. The sum is the record's ``collective_wait_ms``: the gathers' exposed time,
communication not hidden behind compute plus the wait for the slowest rank. Reduce-scatters in
backward run on their own stream and are waited for once, at the end of backward: not counted. The
calls are private to torch; where a version has no such group (or the model is sharded by FSDP1) the
wait is not read (None) and ``fit`` says so once. A record holds the waits since the record before it
(the root's gather at the forward's start runs before memfit's hook marks the step's start); a step
replayed after an OOM, those since its replay began, not its failed attempts'. A step's timed calls are
bounded (:data:`MAX_EVENTS`): past that, a step's wait is a lower bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.engine.ranks import is_fsdp, world_size

__all__ = ["CollectiveWait", "MAX_EVENTS"]

logger = logging.getLogger("memfit")

#: the most timed calls a step keeps on CUDA (two events each): a step past it reads a lower bound
MAX_EVENTS = 4096
#: the parameter group's calls timed (NOTE [The collective wait])
TIMED = ("unshard", "wait_for_unshard")


def _param_groups(model: nn.Module) -> list[Any] | None:
    """FSDP2's parameter groups of ``model``'s sharded modules (None where this torch keeps them elsewhere)."""
    groups: list[Any] = []
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        state = state_of()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # torch before the plural list
            one = getattr(state, "_fsdp_param_group", None)
            found = [] if one is None else [one]
        groups += [group for group in found if all(callable(getattr(group, name, None)) for name in TIMED)]
    return groups or None


class CollectiveWait:
    """Times FSDP2's all-gather waits of a model sharded over several ranks (NOTE [The collective wait]).

    Args:
        model: the model; unsharded, or on one rank, nothing is timed and :meth:`take` gives None.
        device: the model's device (CUDA: events; else the host's clock).
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.groups = _param_groups(model) if world_size() > 1 and is_fsdp(model) else None
        if self.groups is None and world_size() > 1 and is_fsdp(model):
            logger.warning("memfit: the model's FSDP parameter groups are not FSDP2's as memfit reads them (FSDP1, or "
                           "another torch); the records' collective_wait_ms is left empty")
        self.cuda = torch.device(device).type == "cuda"
        #: per timed call since the last :meth:`take`: when it began (the host's clock), and its two events on CUDA or
        #: its ms on a CPU
        self._calls: list[tuple[float, Any, Any]] = []
        for group in self.groups or ():
            for name in TIMED:
                setattr(group, name, self._timed(getattr(group, name)))  # the instance's, over the class's method

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if len(self._calls) >= MAX_EVENTS:
                return call(*args, **kwargs)
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            try:
                return call(*args, **kwargs)
            finally:
                if self.cuda:
                    end.record()
                    self._calls.append((t0, start, end))
                else:
                    self._calls.append((t0, (time.perf_counter() - t0) * 1e3, None))
        return timed

    def take(self, since: float) -> float | None:
        """The wait of the calls begun at ``since`` (``time.perf_counter()``) or later and done on the device, in ms
        (None where nothing is timed); those done and those before ``since`` are dropped, those the device has not
        reached yet kept for the next (events on one stream complete in order)."""
        if self.groups is None:
            return None
        calls = [c for c in self._calls if c[0] >= since]
        done = next((i for i, c in enumerate(calls) if not c[2].query()), len(calls)) if self.cuda else len(calls)
        calls, self._calls = calls[:done], calls[done:]
        return float(sum(start.elapsed_time(end) if self.cuda else start for _, start, end in calls))

    def remove(self) -> None:
        """The groups' own calls back."""
        for group in self.groups or ():
            for name in TIMED:
                group.__dict__.pop(name, None)
        self.groups = None
