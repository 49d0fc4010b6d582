"""Several ranks: gradient sync that keeps an OOM replay local to the rank that needs it.

Under DDP, gradients are all-reduced *during* backward (DDP's autograd hooks), and DDP may
broadcast buffers at the start of a forward. A rank that hits an OOM in the middle of a
micro-step and replays it (NOTE [OOM replay] in hf.py) would then issue those collectives
a second time, or never finish the ones it started, while the other ranks wait in theirs:
the job hangs, or collectives pair up wrongly and the ranks diverge.

# NOTE [Lockstep under DDP]
With memfit's replay on and several DDP ranks, the Trainer runs every micro-step's forward
and backward on the module *inside* the DDP wrapper, so no collective happens during a
micro-step, and :class:`GradientSync` averages the gradients once per accumulation window,
after its last backward has succeeded on this rank. An OOM replay therefore issues no
collective: the rank that hit it replays its window alone while the others wait at the
window's gradient all-reduce. Every rank issues the same collectives in the same order
(one sync per window: the same buckets, then the same buffer broadcasts), whatever each
rank replayed, so none can hang or pair up with another's, and each rank's local window
gradient is bitwise that of a run without the OOM, so the averaged gradient is too.

Two alternatives, rejected. Keeping DDP's overlapped sync and agreeing on an OOM flag before
the optimizer step: an OOM in the middle of a backward leaves DDP's reducer with some
buckets launched and the others never, which the other ranks wait on before any flag can
be read. All-reducing an OOM flag after every micro-step so that every rank replays: with
no collective inside the window there is nothing to agree on, and it would cost a collective
per micro-step and make the healthy ranks redo their work.

The sync mirrors DDP's arithmetic: each gradient is divided by the world size, then summed
(bitwise DDP's result with two ranks, where a sum of two numbers does not depend on order).
Its cost is the overlap: DDP all-reduces a bucket while backward still computes the
earlier layers; here the all-reduce starts after backward ends, so it adds its full time
to the step (about 2·(n-1)/n × gradient bytes ÷ bus bandwidth, plus a copy in and out of
the bucket buffer for gradients smaller than a bucket). A DDP communication hook (fp16
compression...) is not used on that path. A rank that cannot recover (even every block
checkpointed does not fit) raises; torchrun then stops the other ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientSync"]

# DDP's default bucket_cap_mb (25 MiB): the one buffer this sync keeps per gradient dtype.
_BUCKET_BYTES = 25 * 2**20


class GradientSync:
    """Averages gradients over the ranks with bucketed all-reduces, outside autograd.

    Gradients smaller than a bucket are packed into one preallocated flat buffer per dtype
    (made here, so the sync itself allocates nothing); larger ones are all-reduced in place.
    A parameter with no gradient on this rank contributes zeros and gets the average (so it
    ends with a gradient even if no rank used it, where DDP would leave ``None``).

    Args:
        params: parameters to sync, in the same order on every rank.
        buffers: tensors broadcast from rank 0 after each sync (DDP's ``broadcast_buffers``).
        group: process group (default: the world).
        bucket_bytes: size of the flat buffer per gradient dtype.

    Example (a window whose forward and backward may be replayed after an OOM):
        >>> sync = GradientSync(ddp.module.parameters(), ddp.module.buffers())  # doctest: +SKIP
        >>> ddp.module(**batch).loss.backward()  # the module, not DDP: no collective  # doctest: +SKIP
        >>> sync.sync()  # once per window, every rank  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        buffers: Iterable[torch.Tensor] = (),
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = _BUCKET_BYTES,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.buffers = list(buffers)
        self.group = group
        self.world = dist.get_world_size(group)
        self._buckets: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for p in self.params:
            key = (p.device, p.dtype)
            elements = bucket_bytes // p.element_size()
            if p.numel() < elements:
                current = self._buckets.get(key)
                size = min(elements, (0 if current is None else current.numel()) + p.numel())
                self._buckets[key] = torch.empty(size, device=p.device, dtype=p.dtype)

    def sync(self) -> None:
        """Average every gradient over the ranks, then broadcast the buffers from rank 0."""
        pending: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        filled: dict[tuple[torch.device, torch.dtype], int] = {}
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad
                key = (p.device, p.dtype)
                bucket = self._buckets.get(key)
                if bucket is None or grad.numel() >= bucket.numel() or not grad.is_contiguous():
                    self._all_reduce(grad)
                    continue
                if filled.get(key, 0) + grad.numel() > bucket.numel():
                    self._flush(bucket, pending.pop(key), filled.pop(key))
                offset = filled.get(key, 0)
                bucket[offset : offset + grad.numel()].copy_(grad.view(-1))
                pending.setdefault(key, []).append(grad)
                filled[key] = offset + grad.numel()
            for key, grads in pending.items():
                self._flush(self._buckets[key], grads, filled[key])
            for t in self.buffers:
                dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            flat = tensor.contiguous()
            self._all_reduce(flat)
            tensor.copy_(flat)
            return
        tensor.div_(self.world)
        dist.all_reduce(tensor, group=self.group)

    def _flush(self, bucket: torch.Tensor, grads: Sequence[torch.Tensor], used: int) -> None:
        self._all_reduce(bucket[:used])
        offset = 0
        for g in grads:
            g.view(-1).copy_(bucket[offset : offset + g.numel()])
            offset += g.numel()
