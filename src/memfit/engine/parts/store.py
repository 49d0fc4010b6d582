"""The saved-tensor store: blocks whose saved tensors can be evicted mid-step and recomputed in backward.

DTR (Kirisame et al., *Dynamic Tensor Rematerialization*, ICLR 2021) at block granularity. The
method ``reactive`` runs every block under it, and ``dynamic``'s backstop the blocks its plan
keeps (protection.py); the store itself needs no warm-up and no memory model:

* a block's training forward runs under a ``saved_tensors_hooks`` pair that puts each tensor
  autograd saves into a handle of the block's store (NOTE [Handles own the tensors]),
  together with what the block needs to run again: its inputs, RNG and autocast state;
* when the step needs room, :meth:`ReactiveStore.evict` empties the handles of already-run
  blocks chosen by :func:`choose_evictions` (NOTE [DTR score]);
* in backward, the first unpack of an emptied handle re-runs its block and refills every
  handle of it (NOTE [Recompute refills by position]).

# NOTE [Handles own the tensors]
Autograd keeps the handle that the pack hook returns, the handle keeps the (detached, NOTE
[Pack a detached tensor] in accounting.py) tensor, and the store only holds weak references
to its handles, as ``torch.utils.checkpoint`` does with its holders. A saved tensor therefore
dies when autograd releases it (after its node ran in backward, or with a graph that never
runs backward), exactly as without memfit; a block's store (its inputs, RNG state) lives as
long as one of its handles does, and :class:`ReactiveStore` holds stores weakly too.
Evicting a block empties its living handles.

# NOTE [Recompute refills by position]
Re-running a block on equal inputs, under the RNG and autocast state of its forward, runs
the same ops in the same order (the assumption of ``torch.utils.checkpoint``), so the k-th
tensor packed by the recompute is the value of the forward's k-th handle. Only values are
needed: gradients flow through the forward's graph, whose nodes unpack the refilled tensors;
the recompute's own graph is dropped. The recompute stops once the last handle is refilled
(checkpoint's early stop), and raises when the counts cannot match.

# NOTE [Counted bytes of the stores]
A storage (by address, parameters and buffers excluded) is counted once while any *holder*
keeps it: a block's inputs, kept for its recompute, or a block's saved tensors until that
block is evicted. Evicting a block frees the storages only its saved tensors hold, so block
j+1's input that block j also saved stays counted (at block j+1's entry, before j+1 holds
it, :meth:`ReactiveStore.evict` is told to keep it). A storage that the controller's counter
counts too (saved outside every block or by a checkpointed block, as BERT's attention mask
that a checkpointed block saves and the next stored block takes) is counted once:
:meth:`ReactiveStore.kept_bytes_beyond` leaves it to the counter. (Counted twice, it made a
CPU run's backstop evict for a mask no step held twice.)
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import get_device_states, set_device_states

from memfit.engine.parts.blocks import Block

__all__ = ["Candidate", "choose_evictions", "ReactiveStore", "RecomputeMismatchError"]


class RecomputeMismatchError(RuntimeError):
    """A block's recompute did not save the tensors its forward saved."""


@dataclass(frozen=True)
class Candidate:
    """An already-run block whose saved tensors may be evicted.

    Attributes:
        index: the caller's id for it.
        bytes: bytes evicting it frees.
        cost_ms: time to recompute it (its forward time).
        last_use: clock tick of its last use (for a block in forward: the tick it ran at).
    """

    index: int
    bytes: int
    cost_ms: float
    last_use: int


def choose_evictions(candidates: Sequence[Candidate], need_bytes: int, now: int) -> list[int]:
    """Which candidates to evict, in order, to free ``need_bytes``.

    # NOTE [DTR score]
    Each candidate scores ``cost_ms / (bytes * (now - last_use))``: recompute time per byte
    freed, divided by staleness (ticks since its last use), DTR's heuristic. Candidates are
    evicted lowest score first until the freed bytes reach ``need_bytes``; equal scores go
    staler first (smaller ``last_use``), then lower ``index``. Candidates freeing 0 bytes are
    never chosen. For identical transformer blocks cost per byte is equal, so staleness
    decides: the earliest blocks go first, which backward recomputes last, when the most
    memory has been released.

    Args:
        candidates: the evictable blocks, each with ``last_use < now``.
        need_bytes: bytes to free; ``<= 0`` evicts nothing.
        now: the current clock tick.

    Returns:
        Candidate indices in eviction order. When all of them together free less than
        ``need_bytes``, every candidate that frees anything (best effort: the caller sees the
        shortfall and decides what it means).

    Raises:
        ValueError: when a candidate's ``last_use`` is not before ``now``.

    Example:
        >>> old, new, big = Candidate(0, 100, 1.0, 0), Candidate(1, 100, 1.0, 1), Candidate(2, 400, 1.0, 1)
        >>> choose_evictions([old, new, big], need_bytes=450, now=2)
        [2, 0]
    """
    if need_bytes <= 0:
        return []
    if any(c.last_use >= now for c in candidates):
        raise ValueError(f"every candidate's last_use must be before now={now}: {list(candidates)}")
    ranked = sorted(
        (c for c in candidates if c.bytes > 0),
        key=lambda c: (c.cost_ms / (c.bytes * (now - c.last_use)), c.last_use, c.index),
    )
    chosen, freed = [], 0
    for c in ranked:
        if freed >= need_bytes:
            break
        chosen.append(c.index)
        freed += c.bytes
    return chosen


class _Ledger:
    """Distinct storages kept by the stores, each with its holder count (NOTE [Counted bytes of the stores])."""

    def __init__(self) -> None:
        self.bytes = 0
        self.held: dict[int, list[int]] = {}  # storage address -> [nbytes, holders]

    def hold(self, ptr: int, nbytes: int) -> None:
        entry = self.held.get(ptr)
        if entry is None:
            self.held[ptr] = [nbytes, 1]
            self.bytes += nbytes
        else:
            entry[1] += 1

    def release(self, ptrs: dict[int, int]) -> None:
        for ptr in ptrs:
            entry = self.held[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                del self.held[ptr]
                self.bytes -= entry[0]

    def exclusive_bytes(self, ptrs: dict[int, int]) -> int:
        """Bytes that releasing ``ptrs`` (one holder) would free."""
        return sum(self.held[p][0] for p in ptrs if self.held[p][1] == 1)


class _StopRecompute(Exception):
    """Raised from the recompute's pack hook once every handle is refilled."""


class _Handle:
    """What autograd keeps for one saved tensor of a block: the tensor, or ``None`` once evicted."""

    __slots__ = ("store", "tensor", "__weakref__")

    def __init__(self, store: "_BlockStore", tensor: torch.Tensor):
        self.store = store
        self.tensor: torch.Tensor | None = tensor


def _unpack(handle: _Handle) -> torch.Tensor:
    if handle.tensor is None:
        handle.store.recompute()
    return handle.tensor


def _detach_like(x: Any) -> Any:
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


class _BlockStore:
    """One block forward: handles to its saved tensors, and its inputs and state for a recompute."""

    def __init__(self, block: Block, args: tuple, kwargs: dict[str, Any], tick: int):
        self.block = block
        self.tick = tick
        self.cost_ms = 0.0
        self.evicted = False
        self.inputs = tree_map(_detach_like, (args, kwargs))
        tensors = [t for t in tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
        self._versions = [t._version for t in tensors]
        # RNG and autocast state of the forward, restored for the recompute (as checkpoint's
        # preserve_rng_state): the same dropout masks, the same dtypes.
        on_device = {t.device: t for t in tensors if t.device.type not in ("cpu", "meta")}
        self._device_type = next(iter(on_device)).type if on_device else None
        self._cpu_rng = torch.get_rng_state()
        self._devices, self._device_rng = get_device_states(*on_device.values())
        self._autocast = [
            dict(device_type=d, enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                 cache_enabled=torch.is_autocast_cache_enabled())
            for d in ("cpu", self._device_type) if d is not None
        ]
        self.handles: list[weakref.ref[_Handle]] = []
        self.input_ptrs: dict[int, int] = {}
        self.saved_ptrs: dict[int, int] = {}

    def evict(self) -> None:
        for ref in self.handles:
            handle = ref()
            if handle is not None:
                handle.tensor = None
        self.evicted = True

    def recompute(self) -> None:
        """Re-run the block and refill its handles (NOTE [Recompute refills by position])."""
        tensors = [t for t in tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
        if any(t._version != v for t, v in zip(tensors, self._versions)):
            raise RecomputeMismatchError(
                f"an input of block {self.block.name} was modified in place after its forward; memfit "
                "cannot recompute it. Use another method, or avoid in-place ops on block outputs"
            )
        handles, packed = self.handles, 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal packed
            handle = handles[packed]()
            packed += 1
            if handle is not None:  # a dead handle was consumed by backward already
                handle.tensor = t.detach()
            if packed == len(handles):
                raise _StopRecompute
            return t.detach()

        args, kwargs = self.inputs
        rng = torch.random.fork_rng(devices=self._devices, device_type=self._device_type or "cuda")
        with rng, contextlib.ExitStack() as stack:
            torch.set_rng_state(self._cpu_rng)
            if self._devices:
                set_device_states(self._devices, self._device_rng, device_type=self._device_type)
            for state in self._autocast:
                stack.enter_context(torch.autocast(**state))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            try:
                self.block.run_body(*args, **kwargs)
            except _StopRecompute:
                pass
        if packed != len(handles):
            raise RecomputeMismatchError(
                f"block {self.block.name} saved {len(handles)} tensors in forward but {packed} when "
                "recomputed: its forward is not deterministic in the ops it runs"
            )
        self.evicted = False


class ReactiveStore:
    """Runs blocks under memfit's saved-tensor store and evicts them on request; one per run.

    Install :meth:`run` as each block's ``runner``; call :meth:`start_step` at each training
    forward's start and :meth:`evict` when the step needs room.

    Args:
        exclude_ptrs: storage addresses that are not activations (parameters, buffers).

    Attributes:
        evicted_blocks: block indices evicted this step, in eviction order.
        evicted_ms: forward time of the evicted blocks: what their recompute will cost.
    """

    def __init__(self, exclude_ptrs: set[int]):
        self._exclude = exclude_ptrs
        self.start_step()

    def start_step(self) -> None:
        self._stores: list[weakref.ref[_BlockStore]] = []
        self._ledger = _Ledger()
        self._tick = 0
        self.largest_block_bytes = 0
        self.evicted_blocks: list[int] = []
        self.evicted_ms = 0.0

    @property
    def kept_bytes(self) -> int:
        """Bytes the stores keep now (NOTE [Counted bytes of the stores])."""
        return self._ledger.bytes

    def kept_bytes_beyond(self, counted: Collection[int]) -> int:
        """Bytes the stores keep now that ``counted`` (addresses counted elsewhere) does not hold."""
        return self._ledger.bytes - sum(entry[0] for ptr, entry in self._ledger.held.items() if ptr in counted)

    def _hold(self, t: torch.Tensor, ptrs: dict[int, int]) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in ptrs:
            ptrs[ptr] = storage.nbytes()
            self._ledger.hold(ptr, ptrs[ptr])

    def run(self, block: Block, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run ``block``'s training forward with its saved tensors in a new store (its inputs are
        already without a KV cache: Block.__call__)."""
        store = _BlockStore(block, args, kwargs, self._tick)
        self._tick += 1
        before_bytes = self._ledger.bytes
        for t in tree_leaves(store.inputs):
            if isinstance(t, torch.Tensor):
                self._hold(t, store.input_ptrs)

        def pack(t: torch.Tensor) -> _Handle:
            self._hold(t, store.saved_ptrs)
            handle = _Handle(store, t.detach())
            store.handles.append(weakref.ref(handle))
            return handle

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = block.run_body(*args, **kwargs)
        # Host time: on CUDA without a sync this is launch time, a proxy for the cost.
        store.cost_ms = (time.perf_counter() - t0) * 1e3
        self.largest_block_bytes = max(self.largest_block_bytes, self._ledger.bytes - before_bytes)
        self._stores.append(weakref.ref(store))
        return out

    def input_only_by_block(self, n_blocks: int, also_saved: Collection[int] = ()) -> list[int]:
        """Bytes the stores keep only as block inputs, per block index: storages that no
        store's saved tensors, nor ``also_saved`` (addresses counted elsewhere), hold, each
        at the earliest block keeping it (it lives as long as that block's store). Under the
        backstop (NOTE [Backstop], protection.py) that is what arming adds to a step."""
        saved: set[int] = set()
        for store in (ref() for ref in self._stores):
            if store is not None:
                saved.update(store.saved_ptrs)
        out = [0] * n_blocks
        for store in (ref() for ref in self._stores):
            if store is None:
                continue
            for ptr, nbytes in store.input_ptrs.items():
                if ptr not in saved and ptr not in also_saved:
                    saved.add(ptr)  # counted once
                    out[store.block.index] += nbytes
        return out

    def evict(self, need_bytes: int, keep: Sequence[torch.Tensor] = ()) -> int:
        """Evict already-run blocks chosen by :func:`choose_evictions`; returns the bytes freed.

        Args:
            need_bytes: bytes to free; ``<= 0`` evicts nothing.
            keep: tensors that stay alive anyway (the next block's inputs): evicting a block
                frees none of their storages.
        """
        if need_bytes <= 0:
            return 0
        before_bytes = self._ledger.bytes
        kept: dict[int, int] = {}
        for t in keep:
            self._hold(t, kept)
        live = [s for s in (ref() for ref in self._stores) if s is not None and not s.evicted]
        candidates = [
            Candidate(i, self._ledger.exclusive_bytes(s.saved_ptrs), s.cost_ms, s.tick) for i, s in enumerate(live)
        ]
        for i in choose_evictions(candidates, need_bytes, now=self._tick):
            store = live[i]
            store.evict()
            self._ledger.release(store.saved_ptrs)
            self.evicted_blocks.append(store.block.index)
            self.evicted_ms += store.cost_ms
        self._ledger.release(kept)
        return before_bytes - self._ledger.bytes

    def kept_by_block(self, n_blocks: int, before_eviction: bool = False, inputs: bool = True) -> list[int]:
        """Kept bytes per block index, each storage counted once, at the earliest block keeping it.

        ``before_eviction``: count evicted blocks' saved tensors too (what they saved).
        ``inputs``: count the blocks' inputs too (else only their saved tensors).
        """
        out, seen = [0] * n_blocks, set()
        for store in (ref() for ref in self._stores):
            if store is None:
                continue
            saved = {} if store.evicted and not before_eviction else store.saved_ptrs
            held = {**store.input_ptrs, **saved} if inputs else saved
            for ptr, nbytes in held.items():
                if ptr not in seen:
                    seen.add(ptr)
                    out[store.block.index] += nbytes
        return out
