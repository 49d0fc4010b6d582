"""The process group as the engine sees it: how many ranks, whether a model is sharded over them,
and the one agreement a replay needs (did any rank run out of memory).

# NOTE [The ranks' agreement on the host]
After each micro-step of a sharded model the ranks agree whether any of them ran out of memory
(NOTE [Replay under FSDP], replay.py). The flag is the host's: an OOM is raised on the host as the
allocation is made, never found later on the device. An all-reduce of it on the device (NCCL)
would be read back with ``.item()``, a device sync after every backward: the host would wait for
the backward to finish before it launches the optimizer step, whose launch (FSDP2's sharded
parameters dispatch every foreach kernel through DTensor) otherwise overlaps the backward's tail,
and the GPU would idle for it every step. So the flag is reduced on the host: over the default group
where its backend reduces host tensors (gloo, or a backend per device that names gloo), else over
a gloo group of the same ranks, made at the first agreement (every rank reaches it at the same
micro-step, as ``new_group`` requires). The host still waits for the slowest rank's host to reach
the agreement, never for a device. On 2 H200s the step times of the two could not be told apart
beside the spread between launches (s41-1: docs/devlog.md): the sync was not what made FSDP steps
slow. So the gloo group is made only where it cannot fail: where this torch has gloo and every rank
is on one host (torchrun's ``LOCAL_WORLD_SIZE`` is the world's size). Across hosts gloo finds each
host's address from its hostname, which on many machines names the loopback, and a group that cannot
connect would hang the first step for the group's timeout: there the device all-reduce is kept.

The engine reads the process group through these functions and :class:`Agreement` only; the integrations
(:mod:`memfit.integrations.distributed`: DDP, FSDP2, the gradient sync) build on them, never the
other way round.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Agreement", "is_fsdp", "max_over_ranks", "sharded_over_ranks", "world_size"]

_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def world_size() -> int:
    """Ranks in the default process group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP (FSDP1 wrapper or FSDP2 ``fully_shard``)."""
    if not dist.is_available() or not any(m in sys.modules for m in _FSDP_MODULES):
        return False  # FSDP was never imported, so nothing is sharded (importing it costs seconds)
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def sharded_over_ranks(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP over several ranks: no rank can replay an OOM alone
    (NOTE [Replay under FSDP], engine/run/replay.py)."""
    return world_size() > 1 and is_fsdp(model)


def max_over_ranks(values: Sequence[int], group: Any = None) -> list[int]:
    """Each of ``values``' largest over the ranks of ``group`` (the default group when None), in one all-reduce: of
    a host tensor where the group's backend reduces them, else of a device tensor read back (a device sync)."""
    device = torch.device("cpu") if _reduces_host_tensors(group) else torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _reduces_host_tensors(group: Any = None) -> bool:
    """Whether ``group``'s backend (the default group's when None) all-reduces host tensors: gloo, or a backend per
    device that names gloo (``"cpu:gloo,cuda:nccl"``)."""
    return "gloo" in str(dist.get_backend(group))


def _one_host() -> bool:
    """Whether every rank of the default group runs on this host, as torchrun (and Accelerate's launcher) says:
    ``LOCAL_WORLD_SIZE`` equal to the world's size (unset: not known, so not taken to be)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return local.isdigit() and int(local) == world_size()


class Agreement:
    """Whether a host flag is true on any rank, reduced on the host (NOTE [The ranks' agreement on the host]), and
    with it the ranks' largest step shape (NOTE [A retry beside no clean step of its bucket], room.py).

    Made per run (the replay engine's); its gloo group, where one is needed and every rank is on one host, is made at
    the first :meth:`any`, which every rank of the default group must reach at the same point.

    Attributes:
        key: the ranks' largest rows and length at the last agreement that was given a shape (None: none given).
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._made = False
        self.key: tuple[int, int] | None = None

    def any(self, flag: bool, key: tuple[int, int] | None = None) -> bool:
        """Whether ``flag`` is true on any rank of the default group; :attr:`key` becomes the largest rows and length
        of the ranks' ``key`` (each rank's step shape; None on a rank counts as none)."""
        if not self._made:
            self._made = True
            if not _reduces_host_tensors() and dist.is_gloo_available() and _one_host():
                self._group = dist.new_group(backend="gloo")
        values = max_over_ranks([1 if flag else 0, *(key or (0, 0))], self._group)
        self.key = (values[1], values[2]) if values[1] > 0 else None
        return bool(values[0])
