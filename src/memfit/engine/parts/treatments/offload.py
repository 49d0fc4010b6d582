"""``offload``: saved tensors to pinned host memory in forward, prefetched back ``depth`` blocks ahead in backward.

# NOTE [Offload]
``offload`` runs the block under a saved-tensor hook pair of its own (the innermost pair, so
the runtime's counter sees only what the hooks keep on the device, which they count). Each
saved tensor of at least ``min_bytes`` but a parameter (a block's weights saved for its
backward; under FSDP2 the gathered ones, whose storage is made after ``fit`` read the
parameters' addresses) has its storage copied, once per storage, to a pinned
host buffer (NOTE [Pinned pool]) on a side stream after the compute stream's work so far; the
device storage is marked used by the side stream, so the allocator reuses it only once the copy
is done. At most two blocks' copies out are in flight: a block's first pack waits for the
copies of the block two before it, so a slow link costs forward time (which the price counts:
NOTE [Offload price], probe.py) instead of holding memory the plan assumed free. Every copy,
out and back, goes on the one side stream, so a host buffer is never written while read.

# NOTE [Prefetch depth]
In backward, the stashes (offloaded blocks, in forward order) come back ``depth`` blocks of
backward ahead: each stash is fetched on the output gradients of the blocks within ``depth``
above it (``block_done`` hooks every block's output as its forward ends; the one furthest above
fires first), and when backward reaches an offloaded block (a hook on its output's gradient, or
else its first unpack) its own stash and those below it within ``depth`` blocks are fetched if
not yet: ``ceil(depth / gap)`` of them, ``gap`` the fewest blocks between two of the step's
stashes (1 for a run of offloaded blocks; NOTE [Spread stashes], model.py). ``depth`` is the
step's (``depth_for(shape key)``, read at the step's first offloaded block): the memory model's,
so the plan counted the stashes that may be on the device at once (NOTE [Treated peaks],
model.py). A fetch lands in the compute stream's memory (what the blocks backward has passed
just freed), the side stream's copy ordered after the compute stream's work so far; in a side
stream's own pool it would stay apart from the step's memory, which the room keeps free (NOTE
[Other streams' pools], room.py). Each stash's first unpack makes the compute stream wait for
its copy, once. Its device copies are released once all of its tensors were unpacked (autograd
holds what it still needs). On a CPU device the same hooks copy to a second CPU tensor, with no
stream (the logic, and exactness, are what is exercised there).

# NOTE [Exposed copy time]
On CUDA each wait of the compute stream for a copy (forward: the bound of two blocks in
flight; backward: a stash not back yet) is bracketed by two timing events on the compute
stream; their distance is the time the copies were not hidden. They are read without a sync,
once done (:meth:`Offload.exposed`), for records and benchmarks.

# NOTE [Pinned pool]
Host buffers come in size classes, so a stash of a new length reuses a buffer of a near length
instead of pinning anew; they are kept across steps and reused (pinning costs far more than a
copy). Pinned buffers come from PyTorch's caching host allocator, which pins the power of two at
or above each request and keeps what is freed for reuse: their class is that power of two, so
that the pool counts what is pinned; unpinned ones (a CPU device) step by a quarter of a power
of two (at most 25% over what is asked). The pool is bounded by ``max_host_bytes``: when a new
buffer would pass it, the free buffers go first (and the host allocator's cache with them), and
only what is in use at once can fail, with :class:`HostMemoryError`.

# NOTE [Pinning on threads]
By default PyTorch's host allocator pins with ``cudaHostAlloc``, which pages the buffer in on one
thread: about 0.4 s a GiB on a GPU host (``benchmarks/pin_cost.py``; its results in docs/devlog.md), seconds
at the first steps of a run that streams an 8B model's weights. Its other way, ``malloc`` and
``cudaHostRegister`` with the pages touched on ``pinned_num_register_threads`` threads, pinned the
same buffers at 0.09 s a GiB on 16 threads (0.12 on 8; 0.49 on one, slower than the default), and
the buffers copy at the same speed. So before the pool's first pinned buffer memfit turns it on
(:func:`pin_on_threads`) with the largest power of two of threads up to 16 that this process's
share of the cores allows (the usable cores over ``LOCAL_WORLD_SIZE``), and not below 4, at run
time (NOTE [The allocator's settings at run time], budget.py); a process whose settings name either
option keeps them.

# NOTE [Host budget]
Pinned memory cannot be paged out: a pool that grew with the need would take the host down
(the kernel kills the process, or a neighbour). The run's one pool is bounded by the host budget
(``fit(host_budget=...)``, ``--memfit_host_budget``); by default half of what the host has
available when the run starts (the smaller of ``MemAvailable`` and the cgroup's limit less its
usage), shared out among the ranks of one host (``LOCAL_WORLD_SIZE``), since they share its
memory. The planner never plans more than it can hold: a plan that would pass it fails with
:class:`HostMemoryError` naming the flag.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from memfit.errors import UserError
from memfit.engine.budget import add_allocator_settings
from memfit.engine.shapes import first_tensor, input_key
from memfit.engine.parts.treatments.base import RunOptions, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["OFFLOAD", "Offload", "HostMemoryError", "OffloadStats"]

OFFLOAD = "offload"
#: saved storages under this many bytes stay on the device (the default of ``min_bytes``)
MIN_BYTES = 2**20
#: the smallest pinned buffer (NOTE [Pinned pool])
MIN_HOST_BYTES = 4096
#: steps whose depth and exposed time the stats keep
STEPS_KEPT = 4096


#: the share of the host's available memory the default host budget takes (NOTE [Host budget])
HOST_SHARE = 0.5


def _available_host_bytes() -> int | None:
    """What the host can still give this process: ``MemAvailable``, capped by the cgroup's limit less its usage."""
    out = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    out = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path, encoding="ascii") as fh:
                limit = fh.read().strip()
            with open(usage_path, encoding="ascii") as fh:
                usage = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            left = max(0, int(limit) - usage)
            out = left if out is None else min(out, left)
    return out


def default_host_budget_bytes() -> int:
    """The default host budget (NOTE [Host budget]): ``HOST_SHARE`` of the host's available memory over
    this host's ranks; 8 GiB where the available memory cannot be read."""
    available = _available_host_bytes()
    if available is None:
        return 8 * 2**30
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(available * HOST_SHARE) // ranks


class HostMemoryError(UserError, RuntimeError):
    """The pinned host memory ``offload`` needs cannot be had."""


def size_class(nbytes: int, pinned: bool = False) -> int:
    """The host buffer's size for ``nbytes`` (NOTE [Pinned pool]), at least ``MIN_HOST_BYTES``:
    pinned, the power of two at or above it (what the caching host allocator pins); else the next
    multiple of a quarter of the power of two below it.

    Example:
        >>> [size_class(n) for n in (1, 4097, 5000, 2**20, 2**20 + 1)]
        [4096, 5120, 5120, 1048576, 1310720]
        >>> [size_class(n, pinned=True) for n in (1, 4097, 2**20, 2**20 + 1)]
        [4096, 8192, 1048576, 2097152]
    """
    if nbytes <= MIN_HOST_BYTES:
        return MIN_HOST_BYTES
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    quarter = (1 << ((nbytes - 1).bit_length() - 1)) // 4
    return -(-nbytes // quarter) * quarter


#: the most threads memfit asks the host allocator to pin on, and the fewest worth asking (NOTE [Pinning on threads])
PIN_THREADS_MAX, PIN_THREADS_MIN = 16, 4
_PIN_KEYS = ("pinned_use_cuda_host_register", "pinned_num_register_threads")


def pin_on_threads() -> str | None:
    """Have the host allocator pin on threads (NOTE [Pinning on threads]); the settings added, or None where they stay
    as they were (the user's settings name either option, too few cores, or a torch without the run-time setting)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = min(PIN_THREADS_MAX, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
    if share < PIN_THREADS_MIN:
        return None
    extra = f"{_PIN_KEYS[0]}:True,{_PIN_KEYS[1]}:{1 << (share.bit_length() - 1)}"
    return extra if add_allocator_settings(extra, unless=(*_PIN_KEYS, "cudaMallocAsync")) else None


class _HostPool:
    """Pinned host buffers, reused across steps, bounded in total (NOTE [Pinned pool]); one per run,
    shared by every treatment that moves tensors to the host (``pin`` None: set by the first user's device)."""

    def __init__(self, max_bytes: int, pin: bool | None = None):
        self.max_bytes = max_bytes
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        #: bytes of every buffer held (in use or free)
        self.total = 0
        #: buffers pinned so far (each a costly host allocation)
        self.pins = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its size class)."""
        size = size_class(nbytes, self.pin)
        free = self.free.get(size)
        if free:
            return free.pop()
        if self.total + size > self.max_bytes:
            self._drop_free()
        if self.total + size > self.max_bytes:
            raise HostMemoryError(
                f"the treatments that move tensors to the host need {(self.total + size) / 2**30:.2f} GiB of pinned "
                f"host memory, over the host budget of {self.max_bytes / 2**30:.2f} GiB; raise the host budget "
                "(host_budget=, --memfit_host_budget), or lower the batch size"
            )
        if self.pin and self.pins == 0:
            pin_on_threads()
        try:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as err:
            raise HostMemoryError(f"offload could not allocate {size} bytes of pinned host memory ({err})") from None
        self.total += size
        self.pins += 1
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self.free.setdefault(buffer.numel(), []).append(buffer)

    def _drop_free(self) -> None:
        for buffers in self.free.values():
            self.total -= sum(b.numel() for b in buffers)
        self.free = {}
        empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if self.pin and empty_cache is not None:
            empty_cache()  # the host allocator would keep them pinned (NOTE [Pinned pool])


class _Storage:
    """One saved storage of an offloaded block: its host buffer, and its device copy in backward."""

    __slots__ = ("host", "nbytes", "device", "source")

    def __init__(self, host: torch.Tensor, nbytes: int, source: torch.Tensor):
        self.host = host
        self.nbytes = nbytes
        self.device: torch.UntypedStorage | None = None
        self.source: torch.Tensor | None = source  # held until the block's forward ends

    def host_bytes(self) -> torch.Tensor:
        return self.host[: self.nbytes]


class _Stash:
    """One offloaded block forward: its storages on the host, their device copies in backward."""

    def __init__(self, index: int, device: torch.device | None = None):
        self.index = index
        #: the block's device: a saved tensor elsewhere (a CPU scalar of a CUDA block) stays where it is
        self.device = device
        #: device address (in forward) -> the storage's copies
        self.storages: dict[int, _Storage] = {}
        self.handles = 0
        self.unpacked = 0
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.fetched = False
        self.waited = False

    @property
    def moved_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())


@dataclass
class OffloadStats:
    """What ``offload`` did, over the run (NOTE [Exposed copy time]).

    Attributes:
        steps: steps that offloaded a block.
        blocks: offloaded block forwards.
        moved_bytes: bytes copied out (each came back too).
        exposed_out_ms, exposed_back_ms: time the compute stream waited for copies out (forward)
            and back (backward), summed over the waits read so far (CUDA only).
        depth_by_step: the prefetch depth of each step that offloaded (the last ``STEPS_KEPT``).
        blocks_by_step, moved_bytes_by_step: per step that offloaded, the block forwards that ran
            offloaded and the bytes they copied out (the last ``STEPS_KEPT``; aligned with
            ``depth_by_step``): what ran, to set beside what the step records say the plans gave.
        exposed_ms_by_step: per step that offloaded, its waits' time (CUDA; read once done; the
            last ``STEPS_KEPT``).
    """

    steps: int = 0
    blocks: int = 0
    moved_bytes: int = 0
    exposed_out_ms: float = 0.0
    exposed_back_ms: float = 0.0
    depth_by_step: deque[int] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    blocks_by_step: deque[int] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    moved_bytes_by_step: deque[int] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    exposed_ms_by_step: deque[float] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))


class Offload(Treatment):
    """Saved tensors to pinned host memory, prefetched back ``depth`` blocks ahead in backward
    (NOTE [Offload], [Prefetch depth]).

    Args:
        counter: the run's counter, told the tensors kept on the device when the step counts.
        excluded_ptrs: storages that are never offloaded (parameters, buffers), by address.
        min_bytes: smaller saved tensors stay on the device.
        max_host_bytes: the pinned host pool's limit.
        depth_for: the prefetch depth at a shape key (the memory model's, so the plan counted
            it: ``MemoryModel.offload_depth``); 1 without it.
    """

    name = OFFLOAD
    help = "saved tensors to pinned host memory, prefetched back"
    moves_out = True
    priced_by_link = True
    order = 20  # above the re-run blocks, below the kept ones: their backward hides the first fetches

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
        depth_for: Callable[[tuple[int, int]], int] | None = None, pool: _HostPool | None = None,
    ):
        self.counter = counter
        self.excluded = excluded_ptrs
        self.min_bytes = min_bytes
        self.depth_for = depth_for
        #: this step's prefetch depth (NOTE [Prefetch depth])
        self.depth = 1
        self.stats = OffloadStats()
        self._pool: _HostPool | None = pool
        self._max_host_bytes = max_host_bytes
        self._side: torch.cuda.Stream | None = None
        self._stashes: list[_Stash] = []
        self._waiting: list[_Stash] = []  # stashes whose fetch is not yet hooked ``depth`` blocks above them
        #: per step not yet read: [(start, end, backward?)] of the compute stream's waits
        self._waits: list[list[tuple[torch.cuda.Event, torch.cuda.Event, bool]]] = []

    @property
    def pool(self) -> _HostPool | None:
        """The pinned pool (None before the first offloaded block, unless the run shares one)."""
        return self._pool

    def start_step(self) -> None:
        for stash in self._stashes:
            self._release(stash, host=True)
        self._stashes, self._waiting = [], []
        self.exposed()

    def block_done(self, block: "Block", output: Any) -> None:
        """A block above the step's stashes ended its forward: each stash within ``depth`` blocks below it is fetched
        when backward reaches it, if not yet (the hook of the one furthest above fires first); a stash ``depth``
        blocks below it is hooked no further (NOTE [Prefetch depth])."""
        waiting = [s for s in self._waiting if s.index < block.index]
        if not waiting:
            return
        for stash in waiting:
            self._hook_fetch(output, stash)
        self._waiting = [s for s in self._waiting if s.index + self.depth > block.index]

    def exposed(self) -> OffloadStats:
        """The stats, with the waits of finished steps read (no sync: NOTE [Exposed copy time])."""
        while self._waits and all(end.query() for _, end, _ in self._waits[0]):
            step_ms = 0.0
            for start, end, back in self._waits.pop(0):
                ms = start.elapsed_time(end)
                step_ms += ms
                if back:
                    self.stats.exposed_back_ms += ms
                else:
                    self.stats.exposed_out_ms += ms
            self.stats.exposed_ms_by_step.append(step_ms)
        return self.stats

    def _release(self, stash: _Stash, host: bool) -> None:
        for entry in stash.storages.values():
            entry.device = None
            if host and entry.host is not None:
                self._pool.give(entry.host)
                entry.host = None

    def _wait(self, event: torch.cuda.Event, device: torch.device, backward: bool) -> None:
        """The compute stream waits for ``event``, the wait timed (NOTE [Exposed copy time])."""
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        if not self._waits:
            self._waits.append([])
        self._waits[-1].append((start, end, backward))

    def _start_stash(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> _Stash:
        x = first_tensor(args, kwargs)
        cuda = x is not None and x.device.type == "cuda"
        if not self._stashes:  # the step's first offloaded block
            self.depth = max(1, int(self.depth_for(input_key(args, kwargs, block.channels_first)))) if self.depth_for and x is not None else 1
            self.stats.steps += 1
            self.stats.depth_by_step.append(self.depth)
            self.stats.blocks_by_step.append(0)
            self.stats.moved_bytes_by_step.append(0)
            if cuda:
                self._waits.append([])
        stash = _Stash(block.index, None if x is None else x.device)
        if cuda and len(self._stashes) >= 2 and self._stashes[-2].d2h_done is not None:
            self._wait(self._stashes[-2].d2h_done, x.device, backward=False)  # at most two blocks in flight
        self._stashes.append(stash)
        self._waiting.append(stash)
        self.stats.blocks += 1
        self.stats.blocks_by_step[-1] += 1
        return stash

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        stash = self._start_stash(block, args, kwargs)
        position = len(self._stashes) - 1
        counting = self.counter is not None and self.counter.active

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if (storage.nbytes() < self.min_bytes or ptr in self.excluded or _is_parameter(t)
                    or t.device != (stash.device or t.device) or t.device.type == "meta" or not self._moves(t)):
                if counting:
                    self.counter.count_tensor(block.index, t)
                return ("device", t.detach())
            entry = stash.storages.get(ptr)
            if entry is None:
                # the source is held until the block's forward ends: no later storage of this
                # forward can take its address, which keys the entry
                entry = stash.storages[ptr] = self._copy_out(storage, t.device)
            stash.handles += 1
            return (entry, t.dtype, t.size(), t.stride(), t.storage_offset(), t.device, position)

        def unpack(handle: Any) -> torch.Tensor:
            if handle[0] == "device":
                return handle[1]
            entry, dtype, size, stride, offset, device, at = handle
            self._prefetch(at, device)
            if device.type == "cuda" and not stash.waited:
                stash.waited = True
                self._wait(stash.h2d_done, device, backward=True)
            out = torch.empty(0, dtype=dtype, device=device).set_(entry.device, offset, size, stride)
            stash.unpacked += 1
            if stash.unpacked == stash.handles:
                self._release(stash, host=False)  # autograd holds what it still needs
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = self._forward(block, args, kwargs)
        if self._side is not None and stash.storages:
            stash.d2h_done = self._side.record_event()
        self.stats.moved_bytes += stash.moved_bytes
        self.stats.moved_bytes_by_step[-1] += stash.moved_bytes
        for entry in stash.storages.values():
            entry.source = None  # the device storage may go (on CUDA once the copy is done: record_stream)
        if stash.storages:
            self._hook_output(out, position)
        return out

    def _forward(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        """The block's forward under the stash's hooks: every tensor it saves is offered to them."""
        return block.run_body(*args, **kwargs)

    def _moves(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor of at least ``min_bytes`` goes to the host (every one, here)."""
        return True

    def _hook_output(self, out: Any, position: int) -> None:
        """Prefetch when backward reaches this block: a hook on its output's gradient (NOTE [Prefetch depth])."""
        _on_gradient(out, lambda device: self._prefetch(position, device))

    def _hook_fetch(self, out: Any, stash: _Stash) -> None:
        """Fetch ``stash`` when backward reaches the block whose output is ``out``, if not yet."""
        _on_gradient(out, lambda device: None if stash.fetched else self._fetch(stash, device))

    def _pool_for(self, device: torch.device) -> _HostPool:
        if self._pool is None:
            self._pool = _HostPool(self._max_host_bytes)
        if self._pool.pin is None:
            self._pool.pin = device.type == "cuda"
        return self._pool

    def _copy_out(self, storage: torch.UntypedStorage, device: torch.device) -> _Storage:
        """A host copy of ``storage`` (on CUDA: started on the side stream), the source held."""
        nbytes = storage.nbytes()
        entry = _Storage(self._pool_for(device).take(nbytes), nbytes, _bytes_view(storage, device))
        if device.type != "cuda":
            entry.host_bytes().copy_(entry.source)
            return entry
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            entry.host_bytes().copy_(entry.source, non_blocking=True)
        entry.source.record_stream(self._side)  # the allocator reuses it only after the copy
        return entry

    def _prefetch(self, position: int, device: torch.device) -> None:
        """Stash ``position`` and the stashes ``depth`` blocks of backward below it back, those not yet (NOTE [Prefetch
        depth]): ``ceil(depth / gap)`` stashes, ``gap`` the fewest blocks between two of the step's (NOTE [Spread
        stashes], plan/model.py)."""
        if position >= len(self._stashes):
            return
        lowest = self._stashes[position].index - self.depth
        for at in range(position, -1, -1):
            if self._stashes[at].index < lowest:
                break
            if not self._stashes[at].fetched:
                self._fetch(self._stashes[at], device)

    def _fetch(self, stash: _Stash, device: torch.device) -> None:
        stash.fetched = True
        if not stash.storages:
            return
        if device.type != "cuda":
            for entry in stash.storages.values():
                entry.device = entry.host_bytes().clone().untyped_storage()
            return
        # in the step's memory, written once the compute stream's work so far is done (NOTE [Prefetch depth])
        copies = [torch.empty(entry.nbytes, dtype=torch.uint8, device=device) for entry in stash.storages.values()]
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            for entry, copy in zip(stash.storages.values(), copies):
                copy.copy_(entry.host_bytes(), non_blocking=True)
                entry.device = copy.untyped_storage()
            stash.h2d_done = self._side.record_event()
        for copy in copies:
            copy.record_stream(self._side)  # freed unread (a replay), it waits for the copy before it is reused


def _on_gradient(out: Any, fn: Callable[[torch.device], None]) -> None:
    """``fn(device)`` once the gradient of ``out``'s first tensor that needs one is computed (the gradient untouched)."""
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            device = t.device
            t.register_hook(lambda grad: fn(device))  # returns None: the gradient is untouched
            return


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves its weight transposed)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
