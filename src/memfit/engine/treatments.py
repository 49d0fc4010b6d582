"""Treatments: what a block does with its saved activations in one step.

A plan gives every block one treatment; the block runs it at its next training forward
(NOTE [Switch is read at call time] in blocks.py):

| name        | forward                                   | kept on the device for backward         | backward                   |
| ----------- | ----------------------------------------- | --------------------------------------- | -------------------------- |
| `keep`      | plain                                     | everything it saves                     | plain                      |
| `recompute` | under ``torch.utils.checkpoint``          | its inputs                              | the block runs again       |
| `selective` | under a selective checkpoint policy       | its inputs, matmul and attention outputs| the cheap rest runs again  |
|             | (compiled: under an activation budget)    | (compiled: what the partitioner keeps)  |                            |
| `offload`   | saved tensors copied to pinned host memory| small saved tensors                     | copied back, prefetched    |

Gradients are those of ``keep`` under every treatment: ``torch.utils.checkpoint`` is
non-reentrant and restores the RNG state, so a recompute draws the same dropout masks, and an
offloaded tensor comes back bit for bit.

A :class:`Treatment` instance is made per run (a treatment may hold per-run state: streams,
the host pool) and shared by every block it treats.

# NOTE [Selective policy]
``selective`` keeps the outputs of the ops that cost most to recompute per byte they hold:
matrix products and fused attention kernels (their FLOPs per output element grow with the
inner dimension); every other op (norms, activations, elementwise, rotary embeddings, dropout)
is recomputed in backward from those. This is the policy torch's selective checkpointing
documents and torchtitan's op-level policy uses, and it applies to any transformer block, so it
is the default for blocks of unknown families. One exception keeps gradients exact: an op that
draws random numbers (fused attention with dropout draws its mask from the device's generator)
is recomputed, never kept. A kept op is not run again in backward, so it would not advance the
generator there, and every later dropout of the recompute would draw another mask than the
forward's. What it keeps and costs is measured per block
(engine/probe.py), and the planner picks it only where it is cheaper per byte freed than the
other treatments. The kept bytes are the block's inputs plus the selective cache (every output
of a saved op), which no saved-tensor hook sees: the treatment counts the cache itself.

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

# NOTE [Recompute always at hand]
Every run can give ``keep`` and ``recompute``, whatever treatments were named: warm-up,
``full``, OOM replays and plan files of schema 1 treat blocks with ``recompute``, and the
planner always makes a recompute-only plan beside any mix (NOTE [Treatments never lose],
planning.py). :func:`run_treatment_names` adds it, and every run goes through it (the
controller, for its planner and its instances, and :func:`make_treatments`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import UserError

if TYPE_CHECKING:
    from memfit.engine.accounting import SavedTensorCounter
    from memfit.engine.blocks import Block

__all__ = [
    "KEEP", "RECOMPUTE", "SELECTIVE", "OFFLOAD", "Treatment", "Keep", "Recompute", "Selective", "CompiledSelective",
    "Offload",
    "HostMemoryError", "TREATMENTS", "run_treatment_names", "make_treatments", "keep_matmul_and_attention",
    "selective_cache_tensors", "draws_random", "runs_random",
]

KEEP = "keep"
RECOMPUTE = "recompute"
SELECTIVE = "selective"
OFFLOAD = "offload"


class Treatment:
    """How a block runs one training forward; subclasses set ``name`` and :meth:`run`."""

    name: ClassVar[str] = ""
    #: the block keeps only its inputs, which no saved-tensor hook sees (NOTE [Who sees a
    #: checkpointed block's tensors] in accounting.py): the runtime counts them at block entry
    holds_inputs: ClassVar[bool] = False

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def start_step(self) -> None:
        """A training step starts (per-step state is dropped)."""


class Keep(Treatment):
    """The block runs plainly and keeps what it saves."""

    name = KEEP

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return block.run_body(*args, **kwargs)


class Recompute(Treatment):
    """Whole-block checkpoint: only the inputs are kept; backward runs the block again."""

    name = RECOMPUTE
    holds_inputs = True

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


@functools.cache
def _saved_ops() -> frozenset:
    """The aten ops whose outputs ``selective`` keeps (NOTE [Selective policy]); those this
    torch build lacks are left out."""
    names = (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    )
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


@functools.cache
def _dropout_index(op: Any) -> int | None:
    """Position of an op's ``dropout_p`` argument (fused attention), or None."""
    names = [a.name for a in op._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def _dropout_p(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A call's ``dropout_p`` (0.0 when left to its default), or None for an op without one."""
    at = _dropout_index(op) if hasattr(op, "_schema") else None
    return None if at is None else kwargs.get("dropout_p", args[at] if at < len(args) else 0.0)


def draws_random(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``op`` draws random numbers: a seeded op (a dropout, ``rand``), an
    attention only with a ``dropout_p`` that may be nonzero."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    p = _dropout_p(op, args, kwargs)
    return p is None or not (isinstance(p, (int, float)) and p == 0)


class _RandomDraws(TorchDispatchMode):
    """Notes whether any op run under it draws random numbers (:func:`draws_random`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.seen = self.seen or draws_random(func, args, kwargs)
        return func(*args, **kwargs)


def runs_random(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``fn(*args, **kwargs)`` draws random numbers; it runs once, without autograd
    (the caller forks the RNG if the draws must not move it)."""
    mode = _RandomDraws()
    with torch.no_grad(), mode:
        fn(*args, **kwargs)
    return mode.seen


def keep_matmul_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy (NOTE [Selective policy]): keep matmul and attention outputs, except
    an attention that draws a dropout mask (it must run again to keep the random stream)."""
    if op not in _saved_ops() or _dropout_p(op, args, kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_cache_tensors(caching_mode: Any) -> list[torch.Tensor]:
    """The tensors a selective checkpoint's caching mode holds (its ``storage``, whatever its
    layout in this torch version: dicts and lists of wrappers whose ``val`` is the output)."""
    out: list[torch.Tensor] = []
    stack = [getattr(caching_mode, "storage", {})]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "val"):
            stack.append(item.val)
    return out


class _Contexts:
    """``context_fn`` for one selective checkpoint, keeping its caching mode to read the cache."""

    def __init__(self, policy: Callable[..., CheckpointPolicy]):
        self.policy = policy
        self.caching: Any = None

    def __call__(self) -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(self.policy)
        self.caching = caching
        return caching, cached


class Selective(Treatment):
    """Selective checkpoint: inputs and matmul/attention outputs kept, the rest recomputed.

    Args:
        counter: the run's counter, told the cache's storages when the step counts.
        policy: the selective policy (default :func:`keep_matmul_and_attention`).
    """

    name = SELECTIVE
    holds_inputs = True

    def __init__(self, counter: "SavedTensorCounter | None" = None, policy: Callable[..., CheckpointPolicy] = keep_matmul_and_attention):
        self.counter = counter
        self.policy = policy

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        contexts = _Contexts(self.policy)
        out = checkpoint(
            block.run_body, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs
        )
        if self.counter is not None and self.counter.active and contexts.caching is not None:
            for t in selective_cache_tensors(contexts.caching):
                self.counter.count_tensor(block.index, t)
        return out


class CompiledSelective(Treatment):
    """``selective`` on a compiled block: its body compiled under the activation memory budget,
    whose graph saves (through the hooks) only what its partitioner keeps (NOTE [Compiled
    blocks] in blocks.py)."""

    name = SELECTIVE

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return block.run_lean(*args, **kwargs)


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

    def __init__(
        self, counter: "SavedTensorCounter | None" = None, excluded_ptrs: set[int] | frozenset = frozenset(),
        min_bytes: int = 2**20, max_host_bytes: int = 64 * 2**30,
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


#: every treatment, by name
TREATMENTS: dict[str, type[Treatment]] = {t.name: t for t in (Keep, Recompute, Selective, Offload)}


def run_treatment_names(names: Sequence[str]) -> tuple[str, ...]:
    """What a run may give a block besides ``keep``: ``recompute`` first, then ``names`` in
    order, without ``keep`` or repeats (NOTE [Recompute always at hand]).

    Example:
        >>> run_treatment_names(("keep", "selective"))
        ('recompute', 'selective')
    """
    return tuple(dict.fromkeys((RECOMPUTE, *(n for n in names if n != KEEP))))


def make_treatments(
    names: tuple[str, ...] = (KEEP, RECOMPUTE), counter: "SavedTensorCounter | None" = None, compiled: bool = False,
    **offload: Any,
) -> dict[str, Treatment]:
    """One instance per treatment name for a run (``keep`` and ``recompute`` always included,
    NOTE [Recompute always at hand]).

    Args:
        names: the treatments the planner may give.
        counter: the run's counter (``selective`` and ``offload`` count what the hooks cannot see).
        compiled: the blocks' bodies are compiled (``selective`` is then :class:`CompiledSelective`).
        **offload: ``min_bytes``, ``max_host_bytes`` and ``excluded_ptrs`` for ``offload``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    unknown = [n for n in names if n not in TREATMENTS]
    if unknown:
        raise ValueError(f"unknown treatment {unknown[0]!r}; choose from {', '.join(TREATMENTS)}")
    made: dict[str, Treatment] = {}
    for name in (KEEP, *run_treatment_names(names)):
        if name == SELECTIVE:
            made[name] = CompiledSelective() if compiled else Selective(counter)
        elif name == OFFLOAD:
            made[name] = Offload(counter, **offload)
        else:
            made[name] = TREATMENTS[name]()
    return made
