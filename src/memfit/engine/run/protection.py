"""Protection: what a method does during a step when memory runs short despite its plan.

* :class:`Unprotected`: nothing; an OOM is survived by replaying the step with a safer plan
  where the caller replays (the Trainer, ``Controller.run_step``: engine/run/replay.py);
* :class:`Eviction` (method ``reactive``): every block runs under the saved-tensor store
  (store.py); at each block entry, room is made by evicting already-run blocks, which backward
  recomputes (NOTE [Reactive room]);
* :class:`Backstop` (``dynamic``): the blocks the plan keeps run under the store on steps whose
  prediction may be wrong, and are evicted only if the step nears the cap (NOTE [Backstop]);
  by default only where the caller cannot replay an OOM (NOTE [Protection by expected cost]).

A protection is made per run by the method (``Method.make_protection``) and called by the
runtime at fixed points of every step: its start, the plan's application, each block's entry,
the forward's end and after the step was learnt.

# NOTE [Reactive room]
Eviction can only act between blocks, so at each block entry the bytes in use (the allocator's
on CUDA; static + counted saved tensors, logically) plus the reserve plus the largest block seen
this step must fit the budget, else already-run blocks are evicted. At the forward's end the
same check (with nothing to come) makes room for backward. The logical peak is the largest count
seen at these checks *before* evicting, so the margin must cover what runs between two checks
outside any block (the head and loss after the last block): give ``reactive`` a margin of a few
percent under logical accounting.

# NOTE [Room inside a block]
Eviction acts between blocks, so what a block allocates while it runs (its saved tensors, and
temporaries such as attention's intermediates, which at long lengths exceed what it saves) must
be free at its entry. On CUDA the meter reads each stored block's own allocation peak above its
entry (NOTE [Block windows], engine/run/meter.py); :class:`BlockPeaks` keeps, per block, the
largest at each length, and a block's entry keeps free the largest of its own peak at any
length at least as long, or, beyond the longest seen, that peak scaled by the length ratio to
the power its samples show (between 1, linear, and 2, quadratic attention; 2 from a single
sample). The *tail* (what runs after the last block: the head, its logits and the loss, which
for a language model's vocabulary is often the largest allocation of the step) is read and
learnt the same way, from the last block's exit to the forward's end; the last block's entry
keeps its own peak and the tail's free, and the forward's end the tail's (the backward's start
holds the logits' gradients). An OOM inside a block, or in the tail, teaches the allocation that
failed: what was allocated then, plus the request, less what was allocated where it began.

# NOTE [Protection by expected cost]
An OOM that the caller replays (the Trainer's window replay, ``Controller.run_step``) costs one
step's work and loses nothing; the backstop costs a hook per saved tensor and a copy of each
stored block's inputs on every step it is armed, whether or not it evicts, and it is armed on
most steps that extend what the model has seen. Where replay is possible, a wrong prediction is
cheaper paid for by an occasional replay (which also grows the margin, so it does not recur)
than insured against on every uncertain step. So ``dynamic``'s default backstop (``"auto"``)
arms only on steps that nothing would replay: a plain loop that calls the model directly, or a
sharded run whose ranks cannot replay alone. ``backstop=True`` arms it wherever the rule of
NOTE [Backstop] says, replay or not. So the backstop arms only where an OOM ends the run, and
there its share stays fixed: insuring only against the misses measured so far (the margin then
covers them) let a steady step of a sharded LoRA run under-predict its head's logits by more
than any miss before it, unarmed, and stop every rank (docs/devlog.md).

# NOTE [Backstop]
The backstop runs the blocks its plan keeps under the store, which costs a pack hook per saved
tensor and an RNG-state copy per block, and keeps each such block's inputs until backward. So
it is *armed* only for a step that needs it: one longer (in tokens) than any step so far, where
the model extrapolates, or one whose activations, ``BACKSTOP_ARM_SHARE`` above their
prediction, would cross the backstop's threshold, unless the same plan already ran a shape of
its bucket at least as long and stayed under that threshold (the same blocks on the same shape
hold the same bytes). Room is made only when the bytes in use plus the largest stored block
*still to run* (predicted, times the largest excess of the blocks run so far this step over
their prediction) would leave less than a third of the margin free (the plan keeps the whole
margin free); reserving the stack's largest block instead evicts needlessly in stacks whose
first blocks are far larger than the rest (Swin detectors). Then the DTR policy evicts
already-run blocks, recomputed in backward; the step's record lists them.

An armed step holds more than its plan run plainly: its stores keep each block's inputs, and
those that no saved tensor holds (a stage input that a norm saves only as a cast copy, a mask
every block takes) would be freed in a plain run. So an armed step teaches what its plan holds
run plainly: its blocks' saved tensors without the stores' inputs, and its peaks less those
inputs (all of them at the backward's start; from the first recompute on, those of the stores
below it); the record's ``backstop_input_bytes`` says how much that was. An armed step counts
as the proof that its plan fits unarmed (the rule above) if its plan would: by its peak less
the inputs or, had it evicted, by the model's prediction, learnt from what its blocks saved.
"""

from __future__ import annotations

import itertools
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from memfit.engine.plan.planner import Plan
from memfit.engine.shapes import bucket_key
from memfit.engine.parts.store import ReactiveStore
from memfit.engine.budget import UNIT_BYTES
from memfit.engine.parts.treatments import KEEP, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.parts.blocks import Block
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planning import Planning

__all__ = ["BACKSTOP_ARM_SHARE", "Protection", "Unprotected", "Eviction", "Backstop", "Stored", "BlockPeaks", "requested_bytes"]

#: The backstop is armed for a step unless its activations could exceed the prediction by
#: this share and still leave the backstop's reserve free (NOTE [Backstop]).
BACKSTOP_ARM_SHARE = 0.5


class _Step(Protocol):
    """The step state a protection reads and writes (engine/run/step.py's StepState)."""

    static_bytes: int
    replayable: bool
    armed: bool
    upcoming: list[tuple[float, float]]
    evicted: list[int]
    evicted_ms: float
    kept_now: int | None
    backstop_input: list[int]


class _Meter(Protocol):
    def in_use(self, step: Any, held: Callable[[], int]) -> int: ...

    def window_start(self, step: Any) -> int | None: ...

    def window_peak(self, step: Any) -> int | None: ...


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")


def requested_bytes(message: str | None) -> int | None:
    """The allocation a CUDA OOM message says failed ("Tried to allocate 1.95 GiB"), or None.

    Example:
        >>> requested_bytes("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has ...")
        2097152
    """
    match = _REQUEST.search(message or "")
    return None if match is None else int(float(match.group(1)) * UNIT_BYTES[match.group(2)])


class BlockPeaks:
    """Per block, the largest allocation above its entry seen at each length (NOTE [Room inside a block]);
    :data:`TAIL` keys what runs after the last block."""

    #: the key of the tail (the head and the loss after the last block)
    TAIL = -1

    def __init__(self) -> None:
        self._by_block: dict[int, dict[int, int]] = {}

    def add(self, index: int, tokens: int, nbytes: int) -> None:
        seen = self._by_block.setdefault(index, {})
        seen[tokens] = max(seen.get(tokens, 0), int(nbytes))

    def predict(self, index: int, tokens: int) -> int:
        """What block ``index`` may allocate above its entry at ``tokens`` (0 before any sample)."""
        seen = self._by_block.get(index)
        if not seen:
            return 0
        longer = [b for t, b in seen.items() if t >= tokens]
        if longer:
            return max(longer)
        ordered = sorted(seen.items())
        t_max, b_max = ordered[-1]
        power = 2.0
        if len(ordered) >= 2:
            (t1, b1), (t2, b2) = ordered[-2], ordered[-1]
            if t2 > t1 and b1 > 0 and b2 > 0:
                power = min(2.0, max(1.0, math.log(b2 / b1) / math.log(t2 / t1)))
        return int(b_max * (tokens / t_max) ** power)


class Stored(Treatment):
    """``keep``, with the saved tensors in the store, which may evict them (store.py)."""

    name = KEEP

    def __init__(self, store: ReactiveStore):
        self.store = store

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.store.run(block, args, kwargs)


class Protection:
    """No protection (the base class): every hook does nothing."""

    def start_step(self, step: _Step) -> None:
        """A training step starts."""

    def arm(self, step: _Step, blocks: Sequence["Block"], key: tuple[int, int], plan: Plan, warmup: bool) -> None:
        """The plan was applied to ``blocks``; change how blocks run this step, if needed."""

    def enter(self, step: _Step, block: "Block", args: tuple, kwargs: dict[str, Any]) -> None:
        """``block`` starts its forward."""

    def forward_end(self, step: _Step, by_block: list[int]) -> list[int]:
        """The forward ended; returns what each block saved (``by_block``: what the counter saw)."""
        return by_block

    def exit(self, step: _Step, block: "Block") -> None:
        """``block`` ended its forward."""

    def after_step(self, step: _Step, outcome: "StepOutcome") -> None:
        """The step was learnt."""

    def note_oom(self, step: _Step | None, attempt: dict[str, Any]) -> None:
        """The step ran out of memory (``attempt``: its description, engine/run/replay.py)."""

    def evicted_so_far(self) -> list[int]:
        """Blocks evicted so far this step (for an OOM's record)."""
        return []


class Unprotected(Protection):
    """Nothing mid-step: an OOM is replayed by the caller with a safer plan."""


class _Evicting(Protection):
    """Shared by the protections that run blocks under the store and evict."""

    def __init__(self, store: ReactiveStore, planning: "Planning", meter: _Meter, counter: "SavedTensorCounter"):
        self.store = store
        self.stored = Stored(store)
        self.planning = planning
        self.meter = meter
        self.counter = counter

    def start_step(self, step: _Step) -> None:
        self.store.start_step()

    def reserve_bytes(self) -> int:
        """What making room keeps free: the margin, and the allocator's slack and other pools (NOTE [Room], room.py)."""
        return self.planning.room.kept_bytes

    def _held_bytes(self) -> int:
        """Logical bytes in use beyond static: the counter's and the stores', each storage once."""
        return self.counter.total_bytes + self.store.kept_bytes_beyond(self.counter.counted_ptrs)

    def make_room(self, step: _Step, upcoming_bytes: int, inputs: Any = ()) -> None:
        """Evict already-run blocks if in-use + reserve + ``upcoming_bytes`` crosses the budget.

        ``inputs`` are the next block's: they stay alive whatever is evicted (NOTE [Reactive room]).
        """
        in_use = self.meter.in_use(step, self._held_bytes)
        budget = self.planning.budget_bytes
        if budget is None:
            return
        need_bytes = in_use + self.reserve_bytes() + upcoming_bytes - budget
        if need_bytes > 0:
            self.store.evict(need_bytes, [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)])

    def evicted_so_far(self) -> list[int]:
        return list(self.store.evicted_blocks)

    def _note_evictions(self, step: _Step) -> None:
        step.evicted = list(self.store.evicted_blocks)
        step.evicted_ms = self.store.evicted_ms


class Eviction(_Evicting):
    """Every kept block under the store; room made at every block entry (NOTE [Reactive room],
    NOTE [Room inside a block])."""

    def __init__(self, store: ReactiveStore, planning: "Planning", meter: _Meter, counter: "SavedTensorCounter"):
        super().__init__(store, planning, meter, counter)
        self.peaks = BlockPeaks()
        #: the block (or the tail) running now: (index, tokens, bytes allocated where it began)
        self._running: tuple[int, int, int] | None = None
        self._last = -2

    def arm(self, step: _Step, blocks: Sequence["Block"], key: tuple[int, int], plan: Plan, warmup: bool) -> None:
        self._last = len(blocks) - 1
        for b in blocks:
            if b.treatment.name == KEEP:
                b.treatment = self.stored

    def enter(self, step: _Step, block: "Block", args: tuple, kwargs: dict[str, Any]) -> None:
        tokens = step.key[0] * step.key[1]
        ahead = max(self.store.largest_block_bytes, self.peaks.predict(block.index, tokens))
        if block.index == self._last:
            ahead += self.peaks.predict(BlockPeaks.TAIL, tokens)
        self.make_room(step, ahead, (args, kwargs))
        entry = self.meter.window_start(step)
        self._running = None if entry is None else (block.index, tokens, entry)

    def _learn_window(self, step: _Step) -> None:
        running, self._running = self._running, None
        if running is not None:
            peak = self.meter.window_peak(step)
            if peak is not None:
                self.peaks.add(running[0], running[1], peak - running[2])

    def exit(self, step: _Step, block: "Block") -> None:
        if sys.exc_info()[1] is not None:
            return  # the block raised (an OOM inside it): note_oom learns from it
        if self._running is not None and self._running[0] == block.index:
            self._learn_window(step)
        if block.index == self._last:  # the tail's window: the head and the loss
            entry = self.meter.window_start(step)
            self._running = None if entry is None else (BlockPeaks.TAIL, step.key[0] * step.key[1], entry)

    def note_oom(self, step: _Step | None, attempt: dict[str, Any]) -> None:
        """Learn the allocation that failed inside a block (NOTE [Room inside a block])."""
        running, self._running = self._running, None
        request = requested_bytes(attempt.get("error"))
        allocated = attempt.get("allocated_bytes")
        if running is not None and request is not None and allocated is not None:
            index, tokens, entry = running
            self.peaks.add(index, tokens, allocated + request - entry)

    def forward_end(self, step: _Step, by_block: list[int]) -> list[int]:
        if self._running is not None and self._running[0] == BlockPeaks.TAIL:
            self._learn_window(step)
        self._running = None
        # the backward's start holds the logits' gradients: the tail's room again
        self.make_room(step, self.peaks.predict(BlockPeaks.TAIL, step.key[0] * step.key[1]))
        self._note_evictions(step)
        # the counter sees nothing inside the store's blocks (their tensors are the store's),
        # only the inputs of blocks the plan recomputes
        return [a + b for a, b in zip(by_block, self.store.kept_by_block(len(by_block)))]


class Backstop(_Evicting):
    """The kept blocks under the store on steps that may need it; evicted only near the cap (NOTE [Backstop]).

    Args:
        store, planning, meter, counter: the run's.
        always: arm on replayable steps too (else only where no caller replays an OOM: NOTE
            [Protection by expected cost]).
    """

    def __init__(
        self, store: ReactiveStore, planning: "Planning", meter: _Meter, counter: "SavedTensorCounter", always: bool = False,
    ):
        super().__init__(store, planning, meter, counter)
        self.always = always
        #: per plan bucket, the last steady step's (tokens, plan layout, peak above static): a
        #: step that repeats it needs no backstop
        self._held: dict[tuple[int, int], tuple[int, Any, int]] = {}

    def reserve_bytes(self) -> int:
        """A third of the margin (the plan keeps all of it free) and the allocator's slack and other pools."""
        return self.planning.margin_bytes // 3 + self.planning.room.allocator_bytes

    def arm(self, step: _Step, blocks: Sequence["Block"], key: tuple[int, int], plan: Plan, warmup: bool) -> None:
        if warmup or (step.replayable and not self.always) or not self._armed(key, plan):
            return
        step.armed = True
        kept = set()
        for b in blocks:
            if b.treatment.name == KEEP:
                b.treatment = self.stored
                kept.add(b.index)
        step.upcoming = self._upcoming(bucket_key(key, self.planning.bucket_tokens), kept, len(blocks))

    def _armed(self, key: tuple[int, int], plan: Plan) -> bool:
        """Whether this step's kept blocks run under the store (NOTE [Backstop])."""
        planning = self.planning
        if planning.budget_bytes is None:
            return False
        seen = planning.model.max_key
        if seen is None or key[0] * key[1] > seen[0] * seen[1]:
            return True  # longer than any step so far: the model extrapolates
        threshold = planning.budget_bytes - self.reserve_bytes()  # where the backstop makes room
        held = self._held.get(bucket_key(key, planning.bucket_tokens))
        if held is not None:
            tokens, layout, above_static = held
            if layout == plan.layout and key[0] * key[1] <= tokens and planning.static_bytes - planning.weights.saved_by(plan) + above_static <= threshold:
                return False  # this plan ran this long a shape before and stayed under the threshold
        predicted = planning.plan_peak(key, plan)  # the optimizer step's moment is no block's (NOTE [A plan fits what it decides])
        return predicted + BACKSTOP_ARM_SHARE * max(0, predicted - planning.static_bytes) > threshold

    def _upcoming(self, k: tuple[int, int], stored: set[int], n_blocks: int) -> list[tuple[float, float]]:
        """Per block: the largest predicted bytes of the stored blocks from it on, and of those before it.

        What the backstop keeps room for at a block's entry (NOTE [Backstop]): blocks run in
        index order, and only the stored (kept) blocks add their activations.
        """
        model = self.planning.model
        per_group = {g: m.bytes["keep"](k) for g, m in model.group_models.items()}
        pred = [per_group[model.groups[i]] if i in stored else 0.0 for i in range(n_blocks)]
        ahead = list(itertools.accumulate(reversed(pred), max))[::-1]
        behind = [0.0, *itertools.accumulate(pred, max)][:-1]
        return list(zip(ahead, behind))

    def enter(self, step: _Step, block: "Block", args: tuple, kwargs: dict[str, Any]) -> None:
        if block.treatment is not self.stored:
            return  # only stored (kept) blocks add much
        ahead, behind = step.upcoming[block.index]
        seen = self.store.largest_block_bytes
        excess = seen / behind if behind > 0 and seen > behind else 1.0
        self.make_room(step, int(ahead * excess), (args, kwargs))

    def forward_end(self, step: _Step, by_block: list[int]) -> list[int]:
        if not step.armed:
            return by_block
        self.make_room(step, 0)
        self._note_evictions(step)
        # what the blocks saved, before any eviction, without the stores' inputs (NOTE [Backstop])
        n = len(by_block)
        in_store = self.store.kept_by_block(n, before_eviction=True, inputs=False)
        step.kept_now = self._held_bytes()
        step.backstop_input = self.store.input_only_by_block(n, self.counter.counted_ptrs)  # what arming added
        return [a + b for a, b in zip(by_block, in_store)]

    def after_step(self, step: _Step, outcome: "StepOutcome") -> None:
        """Remember what the step's plan held above static, unarmed (NOTE [Backstop])."""
        if outcome.warmup:
            return
        planning, key, plan = self.planning, outcome.key, outcome.plan
        bucket, tokens = bucket_key(key, planning.bucket_tokens), key[0] * key[1]
        held = self._held.get(bucket)
        same = held is not None and held[1] == plan.layout
        # a step that evicted held less than its plan: the model, which has just learnt what
        # its blocks saved, says how much
        above = int(outcome.plain_peak - outcome.static)
        if outcome.evicted:
            above = max(above, int(planning.predict_peak(key, plan) - planning.static_bytes))
        self._held[bucket] = (
            max(tokens, held[0]) if same else tokens, plan.layout, max(above, held[2]) if same else above,
        )
