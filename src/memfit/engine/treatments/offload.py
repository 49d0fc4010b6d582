"""``offload``: saved tensors to pinned host memory in forward, back one block ahead in backward.

# NOTE [Offload]
``offload`` runs the block under a saved-tensor hook pair of its own (the innermost pair, so
the runtime's counter sees only what the hooks keep on the device, which they count). Each
saved tensor of at least ``min_bytes`` has its storage copied, once per storage, to a pinned
host buffer on a side stream after the compute stream's work so far; the device storage is
marked used by the side stream, so the allocator reuses it only once the copy is done. At most
two blocks' copies are in flight: a block's first pack waits for the copies of the block two
before it, so a slow link costs forward time (which the planner's price includes) instead of
holding memory the plan assumed free. In backward, the first unpack of a block starts copying
the next offloaded block below it back on the side stream (one block ahead), and waits for its
own copy's event; its device copies are released once all of its tensors were unpacked. Host
buffers come from a pool bounded by ``max_host_bytes``, reused step after step; a pool that
cannot grow raises :class:`HostMemoryError`. On a CPU device the same hooks copy to a second
CPU tensor, with no stream (the logic, and exactness, are what is exercised there).

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.errors import UserError
from memfit.engine.treatments.base import RunOptions, Treatment

if TYPE_CHECKING:
    from memfit.engine.accounting import SavedTensorCounter
    from memfit.engine.blocks import Block
    from memfit.engine.probe import ProbeKit

__all__ = ["OFFLOAD", "Offload", "HostMemoryError"]

OFFLOAD = "offload"
#: saved storages under this many bytes stay on the device (the default of ``min_bytes``)
MIN_BYTES = 2**20


class HostMemoryError(UserError, RuntimeError):
    """The pinned host memory ``offload`` needs cannot be had."""


class _HostPool:
    """Pinned host buffers (bytes), reused across steps, bounded in total (NOTE [Offload])."""

    def __init__(self, max_bytes: int, pin: bool):
        self.max_bytes = max_bytes
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.total = 0

    def take(self, nbytes: int) -> torch.Tensor:
        free = self.free.get(nbytes)
        if free:
            return free.pop()
        if self.total + nbytes > self.max_bytes:
            raise HostMemoryError(
                f"offload needs {(self.total + nbytes) / 2**30:.2f} GiB of pinned host memory, over its limit of "
                f"{self.max_bytes / 2**30:.2f} GiB; leave 'offload' out of the treatments, or lower the batch size"
            )
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as err:
            raise HostMemoryError(f"offload could not allocate {nbytes} bytes of pinned host memory ({err})") from None
        self.total += nbytes
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self.free.setdefault(buffer.numel(), []).append(buffer)


class _Stash:
    """One offloaded block forward: its storages on the host, their device copies in backward."""

    def __init__(self, index: int):
        self.index = index
        #: device address -> [host buffer, device copy (backward) or None, source (forward) or None]
        self.storages: dict[int, list[Any]] = {}
        self.handles = 0
        self.unpacked = 0
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.fetched = False


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class Offload(Treatment):
    """Saved tensors to pinned host memory in forward, back (one block ahead) in backward (NOTE [Offload]).

    Args:
        counter: the run's counter, told the tensors kept on the device when the step counts.
        excluded_ptrs: storages that are never offloaded (parameters, buffers), by address.
        min_bytes: smaller saved tensors stay on the device.
        max_host_bytes: the pinned host pool's limit.
    """

    name = OFFLOAD
    help = "saved tensors to pinned host memory, prefetched back"
    moves_out = True
    priced_by_link = True
    order = 20  # furthest from the backward's start, so the prefetch has time

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return cls(options.counter, **options.offload)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """The saved storages under ``MIN_BYTES`` (what stays on the device); its price comes from the link."""
        return kit.small_saved_bytes(MIN_BYTES), None

    def __init__(
        self, counter: "SavedTensorCounter | None" = None, excluded_ptrs: set[int] | frozenset = frozenset(),
        min_bytes: int = MIN_BYTES, max_host_bytes: int = 64 * 2**30,
    ):
        self.counter = counter
        self.excluded = excluded_ptrs
        self.min_bytes = min_bytes
        self._pool: _HostPool | None = None
        self._max_host_bytes = max_host_bytes
        self._side: torch.cuda.Stream | None = None
        self._stashes: list[_Stash] = []

    def start_step(self) -> None:
        for stash in self._stashes:
            self._release(stash, host=True)
        self._stashes = []

    def _release(self, stash: _Stash, host: bool) -> None:
        for entry in stash.storages.values():
            entry[1] = None
            if host and entry[0] is not None:
                self._pool.give(entry[0])
                entry[0] = None

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        stash = _Stash(block.index)
        if len(self._stashes) >= 2 and self._stashes[-2].d2h_done is not None:
            torch.cuda.current_stream().wait_event(self._stashes[-2].d2h_done)  # at most two blocks in flight
        self._stashes.append(stash)
        position = len(self._stashes) - 1
        counting = self.counter is not None and self.counter.active

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() < self.min_bytes or ptr in self.excluded or t.device.type == "meta":
                if counting:
                    self.counter.count_tensor(block.index, t)
                return ("device", t.detach())
            entry = stash.storages.get(ptr)
            if entry is None:
                # the source is held until the block's forward ends: no later storage of this
                # forward can take its address, which keys the entry
                host, source = self._copy_out(storage, t.device, stash)
                entry = stash.storages[ptr] = [host, None, source]
            stash.handles += 1
            return (entry, t.dtype, t.size(), t.stride(), t.storage_offset(), t.device, position)

        def unpack(handle: Any) -> torch.Tensor:
            if handle[0] == "device":
                return handle[1]
            entry, dtype, size, stride, offset, device, at = handle
            self._fetch(at, device)
            if device.type == "cuda" and stash.h2d_done is not None:
                torch.cuda.current_stream(device).wait_event(stash.h2d_done)
            out = torch.empty(0, dtype=dtype, device=device).set_(entry[1], offset, size, stride)
            stash.unpacked += 1
            if stash.unpacked == stash.handles:
                self._release(stash, host=False)  # autograd holds what it still needs
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = block.run_body(*args, **kwargs)
        if self._side is not None and stash.storages:
            stash.d2h_done = self._side.record_event()
        for entry in stash.storages.values():
            entry[2] = None  # the device storage may go (on CUDA once the copy is done: record_stream)
        return out

    def _pool_for(self, device: torch.device) -> _HostPool:
        if self._pool is None:
            self._pool = _HostPool(self._max_host_bytes, pin=device.type == "cuda")
        return self._pool

    def _copy_out(self, storage: torch.UntypedStorage, device: torch.device, stash: _Stash) -> tuple[torch.Tensor, torch.Tensor]:
        """A host copy of ``storage`` (on CUDA: started on the side stream), and the source."""
        host = self._pool_for(device).take(storage.nbytes())
        source = _bytes_view(storage, device)
        if device.type != "cuda":
            host.copy_(source)
            return host, source
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            host.copy_(source, non_blocking=True)
        source.record_stream(self._side)  # the allocator reuses it only after the copy
        return host, source

    def _fetch(self, position: int, device: torch.device) -> None:
        """Bring stash ``position`` back (if not yet) and start the next offloaded stash below it."""
        for at in (position, position - 1):
            if at < 0 or at >= len(self._stashes) or self._stashes[at].fetched:
                continue
            stash = self._stashes[at]
            stash.fetched = True
            if device.type != "cuda":
                for entry in stash.storages.values():
                    entry[1] = entry[0].clone().untyped_storage()
                continue
            self._side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side):
                for entry in stash.storages.values():
                    copy = torch.empty(entry[0].numel(), dtype=torch.uint8, device=device)
                    copy.copy_(entry[0], non_blocking=True)
                    entry[1] = copy.untyped_storage()
                stash.h2d_done = self._side.record_event()
            for entry in stash.storages.values():
                _bytes_view(entry[1], device).record_stream(torch.cuda.current_stream(device))
