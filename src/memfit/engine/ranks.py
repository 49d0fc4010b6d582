"""The process group as the engine sees it: how many ranks, whether a model is sharded over them,
and the one agreement a replay needs (did any rank run out of memory).

The engine reads the process group through these four functions only; the integrations
(:mod:`memfit.integrations.distributed`: DDP, FSDP2, the gradient sync) build on them, never the
other way round.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["any_rank", "is_fsdp", "sharded_over_ranks", "world_size"]

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


def any_rank(flag: bool) -> bool:
    """All-reduce of this rank's flag over the default group: whether it is true on any rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
