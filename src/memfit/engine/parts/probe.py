"""Warm-up probes: what a block saves when kept, and its forward time (the recompute's price).

# NOTE [Probe]
Under ``full`` the blocks' saved tensors are held by the checkpoint and invisible to the
counter (NOTE [Who sees a checkpointed block's tensors], accounting.py). The probe re-runs a
block on detached copies of its inputs, counts what it saves, and drops the result: it costs
one block's activations for a moment, as ``full``'s own recompute does in backward, so warm-up
is safe under any budget ``full`` fits. The RNG is forked, so the real forward draws the
dropout masks of a run without the probe (gradients stay exact).

# NOTE [Cold runs of a block]
The probe's time decides *which* blocks a mixed stack treats. A block's first run at a new
size pays once for what later runs reuse (lazily loaded kernels, library and allocator set-up
for the new shapes), so a single timed run can price a block many times its worth, and the
plans follow the noise. So a timed probe runs the block ``TIMED_RUNS`` times with autograd,
the later runs reusing what the first set up, and the price is the fastest run (a timing's
noise only adds: NOTE [Central prices], model.py); a treatment's price is timed as often, its
runs interleaved with the plain ones it is compared with: the first treatment's with plain runs of their
own, which every later treatment of the block's probe is compared with (timing the plain block again
for each treatment ran it a dozen more times a warm-up step for nothing). A treatment whose bit-for-bit check ran it
and the plain block at this size already (``elementwise``, ``lean``: ``runs_as_plain``) had its cold run there, so
its price takes one timed run fewer (:meth:`ProbeKit.runs_after_check`), and so do the plain runs beside it: the fastest of
the warm runs, as before, a few block passes fewer a probe. The saved tensors of the opening run are
the ones counted; the others' go to counters of their own (the step's counter is outside: it
must see none), and each run's are freed before the next: the probe's peak stays one block's
activations.

# NOTE [Probing on a cut]
At the tight end one block's activations are what the budget cannot spare: a long warm-up
step's probes (a kept forward, and the treatments' forwards and backwards) took the step over
its cap, and no replay could help (it runs the same probes). So a step whose probes might not
fit the room left runs them on a cut of its input: the first ``T'`` positions of the sequence,
``T'`` the longest whose estimated need (``PROBE_NEED`` times the block's input bytes, scaled
to ``T'``) fits half of what the budget leaves free at the first block once each block whose
treatment in the step's plan holds its input on the device holds one of that size (a step that
recomputes every block does by its last; one on the floor sends them to the host, and counting
them anyway would cut a long step to a few positions, where a block's time is its launches', not
its work); every tensor input is cut along its dimensions of the sequence's length (the hidden
states along the sequence only), each a copy of its own (a probe counts storages, and a view's is
the whole input's).
Bytes and times are scaled back by ``T / T'`` (linear in tokens, as fused attention and the MLP
are: with a quadratic part the keep bytes come out low, so plans treat more, never fewer);
a cut the block refuses falls back to the whole input. The probes' time falls with the cut too.

# NOTE [Probing a key once]
A block's probes at a shape key that every curve of its group has sampled already teach nothing the
curves keep: the bytes at one key are the same bytes, and a byte curve keeps each key's largest
(NOTE [Upper envelope], model.py); a time curve keeps each key's smallest, which more runs could only
lower by their noise. So a warm-up step does not probe a block there. A run of one length (packed
sequences, a long context) probes its first warm-up step and no other: its later warm-up steps cost
what counting costs, not a probe of every block and of each treatment ``TIMED_RUNS`` times. A new length
is probed as before.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from memfit.engine.parts.accounting import ProbeCounter, SavedTensorCounter
from memfit.engine.parts.buffers import restoring
from memfit.engine.parts.blocks import Block, without_cache
from memfit.engine.shapes import first_tensor
from memfit.engine.parts.treatments import Treatment, TreatmentSpec, resolve

__all__ = [
    "ProbeKit", "probe_block", "probe_treatments", "probe_warmup", "LinkPrice", "measure_link", "TIMED_RUNS", "MAX_DEPTH",
    "BACKWARD_PER_FORWARD", "PROBE_NEED",
]

#: runs of a timed probe, the fastest taken (NOTE [Cold runs of a block])
TIMED_RUNS = 3
#: a block's probes may hold up to this many times its input's bytes at once (NOTE [Probing on a cut]): a
#: kept forward and a treated forward and backward of a decoder layer whose MLP is 3.5 times its width
PROBE_NEED = 64
#: the shortest cut a probe runs on (NOTE [Probing on a cut])
MIN_CUT = 64


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
        timed: time the block (``TIMED_RUNS`` runs, the fastest: NOTE [Cold runs of a block]).
        device: the model's device (CUDA is synchronised around a timed run).
    """
    detached = _detached(args, kwargs)
    probe = ProbeCounter(counter.excluded_ptrs, counter.parameter_storages)
    devices = [device] if device.type == "cuda" else []
    times_ms = []
    others = [ProbeCounter(counter.excluded_ptrs, counter.parameter_storages) for _ in range(TIMED_RUNS - 1)]
    counters = (probe, *others) if timed else (probe,)
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for run_counter in counters:
            probe_args, probe_kwargs = without_cache(block.module, *detached)

            def run() -> None:
                with run_counter.hooks():
                    block.body(*probe_args, **probe_kwargs)

            times_ms.append(_elapsed_ms(device, run, sync=timed))
            del probe_args, probe_kwargs
    return probe.bytes, (min(times_ms) if timed else None)


def _detached(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A block's inputs cut from the step's graph, each asking for grad as the original does."""
    return tree_map(
        lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, (args, kwargs)
    )


def _elapsed_ms(device: torch.device, fn: Callable[[], Any], sync: bool = True) -> float:
    """``fn()``'s wall time in ms; with ``sync`` the device's queued work is awaited before and
    after, so the time is the work's, not its launch's."""
    cuda = sync and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _shield() -> torch.autograd.graph.saved_tensors_hooks:
    """An inner hook pair keeping a probe's saved tensors from the step's counter (outside it)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)


class _SizeCounter:
    """Saved storages of one block run: all of them, and those under ``min_bytes`` (what
    ``offload`` keeps on the device)."""

    def __init__(self, exclude_ptrs: set[int], parameter_storages: set[int], min_bytes: int):
        self._exclude, self._params, self.min_bytes = exclude_ptrs, parameter_storages, min_bytes
        self._seen: set[int] = set()
        self.small = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and key not in self._seen and storage._cdata not in self._params:
            self._seen.add(key)
            if storage.nbytes() < self.min_bytes:
                self.small += storage.nbytes()
        return t.detach()  # NOTE [Pack a detached tensor] (accounting.py)


def _distinct_bytes(tensors: list[torch.Tensor], counter: SavedTensorCounter) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in counter.excluded_ptrs and storage._cdata not in counter.parameter_storages:
            seen[ptr] = storage.nbytes()
    return sum(seen.values())


@dataclass
class ProbeKit:
    """What a treatment's probe (``Treatment.probe``, treatments/base.py) is handed: the block's
    inputs cut from the step's graph and the probe's tools, so that a treatment file measures
    itself without importing this module."""

    block: Block
    detached: tuple[tuple, dict[str, Any]]
    counter: SavedTensorCounter
    device: torch.device
    #: runs of a timed measurement, the fastest taken (NOTE [Cold runs of a block])
    timed_runs: int = TIMED_RUNS
    #: the plain block's timed runs so far, shared by the treatments probed (:meth:`plain_run_ms`)
    plain_runs_ms: list[float] = field(default_factory=list)
    #: what one treatment's probe found that another's reads (the tiled treatments' check that the MLP is token-wise)
    found: dict[str, Any] = field(default_factory=dict)

    def plain_run_ms(self, run: int) -> float:
        """The plain block's ``run``-th timed forward and backward (NOTE [Cold runs of a block]): run at the first
        treatment's ``run``-th run, beside it, and the same number for every treatment probed after."""
        while len(self.plain_runs_ms) <= run:
            self.plain_runs_ms.append(self.forward_backward_ms(self.block.body, self.shield()))
        return self.plain_runs_ms[run]

    def runs_after_check(self) -> int:
        """How many timed runs price a treatment whose bit-for-bit check (``runs_as_plain``) just ran it and the plain
        block at this size: one fewer than ``timed_runs``, the check's runs being their cold ones (NOTE [Cold runs of a
        block])."""
        return max(1, self.timed_runs - 1)

    def fresh(self) -> tuple[tuple, dict[str, Any]]:
        """The block's inputs for one run (its cache left out: NOTE [Probe])."""
        return without_cache(self.block.module, *self.detached)

    def inputs(self) -> list[torch.Tensor]:
        """The input tensors (what a checkpoint keeps)."""
        return [t for t in tree_leaves(self.detached) if isinstance(t, torch.Tensor)]

    def input_bytes(self) -> int:
        """Bytes of the block's hidden-state input (its first tensor): what a checkpoint keeps of the block's own (the
        masks and position tables every block is given the step counts outside the blocks: NOTE [Storages saved by
        several blocks], accounting.py)."""
        x = first_tensor(*self.detached)
        return self.distinct_bytes([x]) if x is not None else 0

    def elapsed_ms(self, fn: Callable[[], Any]) -> float:
        return _elapsed_ms(self.device, fn)

    def shield(self) -> torch.autograd.graph.saved_tensors_hooks:
        return _shield()

    def distinct_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors``, parameters and excluded storages aside."""
        return _distinct_bytes(tensors, self.counter)

    def forward_backward_ms(self, body: Callable[..., Any], *contexts: Any) -> float:
        """One forward of fresh inputs through ``body`` under ``contexts`` (context managers) and its
        backward, timed: gradients returned to the inputs that need one and the block's trainable
        parameters, as the step's backward asks them, never accumulated."""
        params = [p for p in self.block.module.parameters() if p.requires_grad]

        def forward_backward() -> None:
            probe_args, probe_kwargs = self.fresh()
            wrt = [t for t in tree_leaves((probe_args, probe_kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                result = body(*probe_args, **probe_kwargs)
            outs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and wrt + params:
                torch.autograd.grad(outs, wrt + params, [torch.ones_like(t) for t in outs], allow_unused=True)

        return self.elapsed_ms(forward_backward)

    def counter_of_run(self) -> ProbeCounter:
        """A counter of one run's saved tensors (the step's counter sees none of them)."""
        return ProbeCounter(self.counter.excluded_ptrs, self.counter.parameter_storages)

    def small_saved_bytes(self, min_bytes: int) -> int:
        """Bytes of the saved storages under ``min_bytes`` of one plain run."""
        sizes = _SizeCounter(self.counter.excluded_ptrs, self.counter.parameter_storages, min_bytes)
        probe_args, probe_kwargs = self.fresh()
        with torch.autograd.graph.saved_tensors_hooks(sizes._pack, lambda t: t):
            result = self.block.body(*probe_args, **probe_kwargs)
        del result, probe_args, probe_kwargs
        return sizes.small


def probe_treatments(
    block: Block, args: tuple, kwargs: dict[str, Any], counter: SavedTensorCounter, device: torch.device,
    treatments: Mapping[str, type[Treatment]] | Sequence[TreatmentSpec],
) -> dict[str, tuple[int, float | None]]:
    """What ``block`` keeps on the device under each of ``treatments`` (by name, or names and
    classes) that measures itself, and the time it adds (NOTE [Treatment prices], model.py):
    ``{name: (bytes, ms or None)}``, from each treatment's own probe (NOTE [A treatment is a
    plug-in], treatments/base.py)."""
    treatments = treatments if isinstance(treatments, Mapping) else resolve(treatments)
    kit = ProbeKit(block, _detached(args, kwargs), counter, device)
    devices = [device] if device.type == "cuda" else []
    out: dict[str, tuple[int, float | None]] = {}
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for name, treatment in treatments.items():
            measured = treatment.probe(block, kit)
            if measured is not None:
                out[name] = measured
    return out


#: a block's backward takes about this many of its forwards (what hides a copy back)
BACKWARD_PER_FORWARD = 2.0
#: the deepest prefetch (NOTE [Prefetch depth], treatments/offload.py): each level holds one more
#: block's moved bytes on the device at the backward's start
MAX_DEPTH = 4


class LinkPrice:
    """The price of offloading a block and its prefetch depth, from the host link's bandwidths.

    # NOTE [Offload price]
    A block's price is the time its copies add to a step beyond the compute that hides them,
    plus a fixed cost (hooks, events, launches): ``max(0, out - forward) + max(0, back -
    backward) + fixed``, where ``out``/``back`` are its moved bytes over the link's measured
    bandwidths and ``backward`` is ``BACKWARD_PER_FORWARD`` forwards. The link carries one copy
    at a time, each way: over a run of offloaded blocks a copy can hide only under one block's
    compute on average, however early it starts, so a deeper prefetch does not lower the price
    of a link slower than the compute (it moves the wait to the start of the run); it does make
    the price true where the link keeps up, by issuing each copy back ``depth`` blocks of
    backward before it is needed (:meth:`depth`), so that a late hook or an uneven block does
    not expose it. Short sequences are link-bound (the copy grows with tokens as fast as the
    compute does, and the fixed cost stays): recompute is cheaper there; long ones, whose
    attention grows the compute faster than the bytes, and wide models, hide the copies.

    Args:
        d2h_bytes_per_ms, h2d_bytes_per_ms: the link's measured bandwidths.
        fixed_ms: per offloaded block (hooks, events).
        max_depth: the deepest prefetch.
    """

    def __init__(self, d2h_bytes_per_ms: float, h2d_bytes_per_ms: float, fixed_ms: float = 0.05, max_depth: int = MAX_DEPTH):
        self.d2h, self.h2d, self.fixed_ms, self.max_depth = d2h_bytes_per_ms, h2d_bytes_per_ms, fixed_ms, max_depth

    def __call__(self, moved_bytes: float, forward_ms: float) -> float:
        """Exposed ms of offloading a block moving ``moved_bytes`` whose forward takes ``forward_ms``."""
        backward_ms = BACKWARD_PER_FORWARD * forward_ms
        return max(0.0, moved_bytes / self.d2h - forward_ms) + max(0.0, moved_bytes / self.h2d - backward_ms) + self.fixed_ms

    def depth(self, moved_bytes: float, forward_ms: float) -> int:
        """Blocks of backward a block's copy back needs to hide under: 1 to ``max_depth``
        (NOTE [Offload price]; NOTE [Prefetch depth], treatments/offload.py)."""
        backward_ms = max(BACKWARD_PER_FORWARD * forward_ms, 1e-6)
        return int(min(self.max_depth, max(1, math.ceil(moved_bytes / self.h2d / backward_ms))))


def measure_link(device: torch.device, nbytes: int = 16 * 2**20) -> LinkPrice:
    """Time copying ``nbytes`` to pinned host memory and back (best of three each way).

    On a CPU device the copy is a host memcpy: the price ``offload`` has there.
    """
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def best_ms(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(4):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return max(min(times[1:]), 1e-6)

    price = LinkPrice(nbytes / best_ms(host, on_device), nbytes / best_ms(on_device, host))
    del host, on_device
    if cuda:
        torch.cuda.empty_cache()
    return price


def probe_warmup(
    step: Any, block: Block, args: tuple, kwargs: dict[str, Any], counter: SavedTensorCounter, device: torch.device,
    planning: Any, aside: Callable[[Any], contextlib.AbstractContextManager] = lambda step: contextlib.nullcontext(),
    blocks: Sequence[Block] = (),
) -> None:
    """A warm-up step's probe of ``block``: every block's kept bytes, and the first of each group
    timed and, where the run may give them, its ``selective`` and ``offload`` bytes and prices
    (NOTE [Blocks alike only in name], learner.py), on a cut of the input where the whole might
    not fit (NOTE [Probing on a cut]). The results go to the step (``probes``, ``treated_probes``),
    learnt at the forward's end. The probe runs in ``aside(step)``, its peak not the step's (the meter's:
    NOTE [Work aside from the step], meter.py). What the timed probe found of the tiled MLP's order holds for the
    group's other ``blocks`` too (``Block.tiles_exactly``: NOTE [Tiled MLP]): a floor plan runs every block so."""
    if step.key is not None and sampled_at(planning, block.index, tuple(step.key)):
        return  # NOTE [Probing a key once]
    # nothing a probe saves reaches the step's counter, its backwards' re-runs included; nor do its runs move the block's
    # running statistics (NOTE [Running statistics], buffers.py)
    with _shield(), aside(step), restoring(block.stateful_buffers()):
        _probe_warmup(step, block, args, kwargs, counter, device, planning)
    if block.tiles_exactly is not None:  # found by the group's timed probe, or given it by one
        group = planning.model.groups[block.index]
        for other in blocks:
            if planning.model.groups[other.index] == group:
                other.tiles_exactly = block.tiles_exactly


def sampled_at(planning: Any, index: int, key: tuple[int, int]) -> bool:
    """Whether every curve of block ``index``'s group holds a sample at ``key`` (NOTE [Probing a key once])."""
    model = planning.model
    group = model.group_models.get(model.groups[index])
    return group is not None and all(c.has(key) for c in (*group.bytes.values(), *group.ms.values()))


def _probe_warmup(
    step: Any, block: Block, args: tuple, kwargs: dict[str, Any], counter: SavedTensorCounter, device: torch.device,
    planning: Any,
) -> None:
    group = planning.model.groups[block.index]
    timed = group not in step.probed_groups
    step.probed_groups.add(group)
    if step.probe_length is None:  # the blocks that will hold an input on the device by the last: those the plan gives one
        names = step.decision.plan.treatments(planning.n_blocks)
        holding = sum(planning.registry[name].holds_inputs for name in names if name in planning.registry)
        step.probe_length = cut_length(args, kwargs, planning.budget_bytes, device, holding)
    length = step.probe_length
    if length:
        try:
            cut = _cut(args, kwargs, length)
            probed = probe_block(block, *cut, counter, timed, device)
            treated = probe_treatments(block, *cut, counter, device, planning.registry) if timed and not planning.recompute_only else None
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, IndexError):  # a block that refuses the cut: the whole input
            step.probe_length = length = 0
    if not length:
        probed = probe_block(block, args, kwargs, counter, timed, device)
        treated = probe_treatments(block, args, kwargs, counter, device, planning.registry) if timed and not planning.recompute_only else None
        scale = 1.0
    else:
        scale = first_tensor_length(args, kwargs) / length
    step.probes[block.index] = _scaled(probed, scale)
    if treated is not None:
        step.treated_probes[block.index] = {name: _scaled(value, scale) for name, value in treated.items()}


def first_tensor_length(args: tuple, kwargs: dict[str, Any]) -> int:
    """The sequence length of a block's input (its first tensor's second dimension; 0 without one)."""
    x = first_tensor(args, kwargs)
    return int(x.shape[1]) if x is not None and x.dim() >= 2 else 0


def cut_length(args: tuple, kwargs: dict[str, Any], budget_bytes: int | None, device: torch.device, n_blocks: int = 1) -> int:
    """The length a step's probes run at (NOTE [Probing on a cut]): 0 (the whole input) where its estimated
    need fits half of what the budget leaves free once ``n_blocks`` hold an input each, or no cap is known;
    else the longest that does."""
    x = first_tensor(args, kwargs)
    if budget_bytes is None or device.type != "cuda" or x is None or x.dim() < 3:
        return 0
    length = int(x.shape[1])
    need = PROBE_NEED * x.numel() * x.element_size()
    free = (budget_bytes - torch.cuda.memory_allocated(device) - n_blocks * x.numel() * x.element_size()) // 2
    if need <= free or length <= MIN_CUT:
        return 0
    return max(MIN_CUT, min(length - 1, int(length * max(free, 0) / need)))


def _cut(args: tuple, kwargs: dict[str, Any], length: int) -> tuple[tuple, dict[str, Any]]:
    """The inputs cut to the first ``length`` positions of the sequence (NOTE [Probing on a cut])."""
    x = first_tensor(args, kwargs)
    full = int(x.shape[1])

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t is x:
            index = (slice(None), slice(0, length))
        else:
            index = tuple(slice(0, length) if size == full and (d > 0 or t.dim() == 1) else slice(None) for d, size in enumerate(t.shape))
        # a copy of its own: a view's storage is the whole input's, and what a probe counts is storages
        return t.detach()[index].clone().requires_grad_(t.requires_grad)

    return tree_map(cut, (args, kwargs))


def _scaled(measured: tuple[int, float | None], scale: float) -> tuple[int, float | None]:
    nbytes, ms = measured
    return int(round(nbytes * scale)), (None if ms is None else ms * scale)