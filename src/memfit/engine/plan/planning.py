"""Planning for one run: the memory model, the planner and the plan cache, behind one object.

Methods ask :meth:`Planning.plan_for` for a shape's plan; the runtime tells it each step's
static bytes (:meth:`Planning.begin_step`); the learner (learner.py) returns what a step
teaches as a :class:`ModelUpdate`, which :meth:`Planning.apply` applies. Planning is the only
writer of its model, its room (room.py) and its plan cache, so it alone keeps the cache valid.

# NOTE [Plan for the longest shape seen]
A plan serves every shape of its bucket (tokens rounded up to ``bucket_tokens``) up to the
length it was made for: the longest the run has met in that bucket, not the bucket's upper
edge, which no batch may reach (planning for the edge over-predicts and checkpoints blocks for
nothing, and nothing corrects it: each curve is right at the lengths that run). A longer shape
of the bucket is planned anew when it comes. Where a row of plans (NOTE [Planning a row]) gives
every length from the shape to the bucket's edge the same plan, that plan serves the whole
bucket and no longer shape of it replans. Plans are not monotone in length everywhere (where
the partial transient's range begins a shorter shape can need a block more), so a row's
lengths are checked one by one, not the edge's plan alone.

# NOTE [Planning a row]
For a stack of one group (every block alike) with only ``keep`` and ``recompute``, the plan of
a shape is the shortest prefix of blocks that fits, so a miss plans the whole row at once:
every length of the shape's batch size, one token apart, up to a few buckets past the longest
shape seen, with numpy over the row: the model's one peak formula evaluated over arrays
(NOTE [One evaluator], model.py), so that the plans are the same bit for bit as the per-key
planner's (tested) with no copy of its arithmetic here; each length's plan is built from
the row's arrays when first asked. A row costs several single plans, so it pays only while the
model behind it lasts: a miss plans a row once the cache has served more than
``ROW_AFTER_STEADY_ASKS`` requests since its last clear, or the model before it did (a settled
model's later changes are corrections that last). Shapes that no plan fits, mixed stacks and
``static`` plan per key.

# NOTE [Bias per bucket]
The curves are upper envelopes (model.py) and one shape's plan is made from several of them, so
a bucket can be over- or under-predicted by the same bytes step after step: over, it treats
blocks for nothing; under, the margin absorbs it until it cannot. A steady step that ran its
plan whole (nothing evicted) leaves its error before correction, predicted minus observed peak,
with its bucket and plan (:class:`BucketBias`). A plan's bias is the median of its last
``BIAS_SEEN`` errors; once one plan of a bucket was seen that often, the bucket's correction is
the least bias of every plan it ran (an error can depend on the plan: corrected by the least, no
plan seen is predicted under what it peaked at, and an under-predicted one raises the bucket's
predictions), applied when it differs from the bucket's correction by more than ``BIAS_SHARE``
of the budget (so a bias near that share does not toggle it on noise), and the bucket's plans
are redone. A correction is an
offset of the bucket's static bytes, so the one peak formula still makes every prediction and
plan of it; the bucket then plans per key (a row spans buckets). A change of the model's
curves drops every correction: they were measured against the curves before.

# NOTE [Over-prediction across buckets]
Per bucket and plan a correction needs the same plan seen twice in its bucket, which a run of
uneven lengths meets rarely, so the curves' envelope over-predicts every bucket step after
step (8-18% of the cap on a 152k-vocabulary model's steps, every length band). So the run also
keeps its last ``RUN_BIAS_STEPS`` steady steps' raw errors (before any correction; every step
that ran its plan whole, a chunked head's too), and while all of them are over-predictions by
more than ``BIAS_SHARE`` of the budget, every bucket without a correction of its own and within
the range of those steps (in tokens) starts its predictions from its static bytes less the least
of them (:class:`RunBias`): none of those steps would have been predicted under its peak. A shape
outside that range keeps the envelope: the over-prediction moves with the tokens (the curves'
envelopes and the bounds of a treated step's later moments grow with them, the head's part too),
so what longer or shorter steps erred by says nothing of it (an offset learnt on shorter steps
under-predicted a longer one, every block recomputed, and one learnt on longer steps a shorter
one planned otherwise: docs/devlog.md). One under-prediction among them, or a change of the
curves, drops it. A run where an OOM is fatal (NOTE [Room where an OOM is fatal], room.py) keeps
the envelope: there a step predicted under its peak is not replayed.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import statistics

from memfit.engine.budget import Budget
from memfit.engine.plan.model import MemoryModel
from memfit.engine.plan.planner import with_leaner_reruns, InfeasiblePlanError, Plan, PlanCache, plan_blocks, plan_with_parts
from memfit.engine.plan.room import Room
from memfit.engine.shapes import bucket_key
from memfit.engine.summary_text import over_budget_words
from memfit.engine.parts.treatments import KEEP, RECOMPUTE, TreatmentSpec, floor_treatment, resolve
from memfit.engine.parts.treatments.tiled_mlp import widest_intermediate
from memfit.engine.parts.kind import AFTER_BLOCKS

__all__ = ["Planning", "ModelUpdate", "ROW_AFTER_STEADY_ASKS"]

logger = logging.getLogger("memfit")

#: steady steps of a bucket in a row that must err the same way before its prediction is
#: corrected (NOTE [Bias per bucket]) ...
BIAS_SEEN = 2
#: ... each by more than this share of the budget
BIAS_SHARE = 0.01
#: steady steps whose least over-prediction lowers every bucket's (NOTE [Over-prediction across buckets])
RUN_BIAS_STEPS = 4
#: the most entries a per-shape or per-plan record of Planning's holds (a long run's shapes are not bounded)
MAX_KEPT = 4096


@dataclass
class BucketBias:
    """Per shape bucket and plan, the latest steady steps' prediction errors before correction
    (predicted minus observed peak, bytes), and per bucket the correction learnt from them (NOTE
    [Bias per bucket])."""

    errors: dict[tuple[tuple[int, int], tuple], list[float]] = field(default_factory=dict)
    correction: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, bucket: tuple[int, int], plan: Plan, error: float, tolerance: float, applied: float | None = None) -> bool:
        """A steady step of ``bucket`` ran ``plan`` and its prediction, corrected by ``applied``
        (default: the bucket's correction), erred by ``error``; returns whether the bucket's correction changed."""
        raw = float(error) + (self.correction.get(bucket, 0.0) if applied is None else applied)
        seen = self.errors.setdefault((bucket, (plan.blocks, plan.kinds, plan.parts)), [])
        if len(self.errors) > MAX_KEPT:  # bounded whatever the shapes: the first recorded goes first
            del self.errors[next(iter(self.errors))]
        seen.append(raw)
        del seen[:-BIAS_SEEN]
        plans = [e for (b, _), e in self.errors.items() if b == bucket]
        if len(seen) < BIAS_SEEN and not any(len(e) >= BIAS_SEEN for e in plans):
            return False
        # the least of its plans' biases: no plan seen is then predicted under what it peaked at; it
        # replaces the correction only where it moved by more than the tolerance (a bias near the
        # tolerance, zeroed below it, toggled the correction and replanned its bucket on noise)
        wanted = min(statistics.median(e) for e in plans)
        before = self.correction.get(bucket, 0.0)
        if abs(wanted - before) <= tolerance:
            return False
        self.correction[bucket] = wanted
        return True

    def clear(self) -> bool:
        """Drop every correction (the curves changed); returns whether there was one."""
        had = bool(self.correction)
        self.correction.clear()
        self.errors.clear()
        return had


@dataclass
class RunBias:
    """The run's last steady steps' raw prediction errors (bytes, before any correction) and the
    offset they give every bucket without a correction of its own (NOTE [Over-prediction across
    buckets])."""

    errors: deque = field(default_factory=lambda: deque(maxlen=RUN_BIAS_STEPS))
    offset: float = 0.0
    #: the most tokens of the steps behind the offset: no longer shape takes it
    max_tokens: int = 0
    #: the fewest tokens of the steps behind the offset: no shorter shape takes it
    min_tokens: int = 0

    def observe(self, raw_error: float, tolerance: float, tokens: int = 0) -> bool:
        """A steady step of a bucket of ``tokens`` tokens erred by ``raw_error`` before correction; returns
        whether the offset, or the shapes it covers, changed."""
        self.errors.append((float(raw_error), int(tokens)))
        least = min(error for error, _ in self.errors)
        wanted = least if len(self.errors) == RUN_BIAS_STEPS and least > tolerance else 0.0
        longest = max(n for _, n in self.errors) if wanted else 0
        shortest = min(n for _, n in self.errors) if wanted else 0
        same = wanted == self.offset or (wanted and self.offset and abs(wanted - self.offset) <= tolerance)
        if same and (shortest, longest) == (self.min_tokens, self.max_tokens):
            return False
        if not same:
            self.offset = wanted
        self.min_tokens, self.max_tokens = shortest, longest
        return True

    def offset_for(self, tokens: int) -> float:
        """The offset for a bucket of ``tokens`` tokens: 0 for one outside the range of the steps behind it."""
        return self.offset if self.min_tokens <= tokens <= self.max_tokens else 0.0

    def clear(self) -> bool:
        """Drop the errors and the offset (the curves changed); returns whether there was an offset."""
        had = bool(self.offset)
        self.errors.clear()
        self.offset, self.min_tokens, self.max_tokens = 0.0, 0, 0
        return had


#: Rows are planned only once the plan cache, or the one before its last clear, has served
#: more than this many requests: before, the model changes every step or two (NOTE [Planning a row]).
ROW_AFTER_STEADY_ASKS = 3

@dataclass
class ModelUpdate:
    """What a finished step or a warm-up probe teaches, as the learner returns it (learner.py);
    :meth:`Planning.apply` applies it.

    Attributes:
        groups: the blocks' new group ids (a split: NOTE [Blocks alike only in name]), applied first.
        samples: ``(curve, key, value)``; a curve is named by its path in the model:
            ``("outside",)``, ``("transient_full",)``, ``("transient_partial",)``,
            ``("bytes", group, treatment)`` or ``("ms", group, treatment)``.
        seen_key: a shape the run met (the model's ``max_key``).
        optimizer_above_static: an optimizer step's peak above ``static_bytes`` (NOTE [Three peaks]).
        static_bytes: the static bytes of the step that ran that optimizer step.
        miss_bytes: a steady step's peak above its prediction (the room's margin rule).
        alloc_retries: the allocator released its cache to serve the steady step ``steady_key``
            (the room's slack rules: NOTE [The slack is priced], room.py).
        steady_key: a steady step's shape key, for the slack rules (None: no steady step).
        net_ms: that step's time less its treatments' predicted time (None: not timed).
        error: a steady step's shape key, plan, and predicted minus observed peak (NOTE [Bias per bucket]).
        run_error: a steady step's shape key and predicted minus observed peak, a chunked head's
            step too (NOTE [Over-prediction across buckets]).
    """

    groups: list[int] | None = None
    samples: list[tuple[tuple, tuple[int, int], float]] = field(default_factory=list)
    seen_key: tuple[int, int] | None = None
    optimizer_above_static: float | None = None
    static_bytes: int = 0
    miss_bytes: int | None = None
    alloc_retries: bool = False
    steady_key: tuple[int, int] | None = None
    net_ms: float | None = None
    error: tuple[tuple[int, int], Plan, float] | None = None
    run_error: tuple[tuple[int, int], float] | None = None


class Planning:
    """Memory model + planner + plan cache for one run (what methods see).

    Args:
        n_blocks, groups: the number of blocks and each one's group id (identical blocks share a model).
        budget: the budget (bytes, or a ``Budget`` its warnings quote as given), or ``None`` for no budget.
        margin_bytes, slack_bytes: kept free below the budget: the safety margin (prediction error) and the
            allocator's reserved-but-unusable bytes (NOTE [Room], room.py), or ``room``, made from them when None.
        bucket_tokens: token granularity of plan buckets.
        treatments: what the planner may give a block besides ``keep`` (names or classes: engine/parts/treatments/).

    Attributes: ``offload_ms`` (offload's price, once the link was measured: probe.py), ``static_bytes`` (no plan
    changes them: :meth:`begin_step`), ``max_static_bytes`` (the largest of a step that ran an optimizer step).
    """

    def __init__(
        self, n_blocks: int, groups: Sequence[int], budget: Budget | int | None, margin_bytes: int, bucket_tokens: int,
        slack_bytes: int = 0, treatments: Sequence[TreatmentSpec] = (RECOMPUTE,), room: Room | None = None,
    ):
        self.n_blocks = n_blocks
        self.all_blocks = tuple(range(n_blocks))
        #: the run's treatments by name, ``keep`` and ``recompute`` first (engine/parts/treatments/)
        self.registry = resolve(treatments)
        self.model = MemoryModel(groups, bucket_tokens, self.registry)
        self.budget = None if budget is None else Budget.parse(budget)  # NOTE [A budget as typed]
        self.budget_bytes = None if self.budget is None else self.budget.bytes
        self.room = room or Room(self.budget_bytes, margin_bytes, slack_bytes)
        self.bucket_tokens = bucket_tokens
        self.cache = PlanCache()
        self._priced: tuple[int, ...] = ()  # the parts' ``priced`` counts the cached plans were made under
        self.static_bytes = 0
        self.max_static_bytes = 0
        self.input_bytes_per_token = self.mlp_bytes_per_token = 0  # at the step being decided (note_block_input)
        self._widest: int | None = None
        self.infeasible_keys: set[tuple[int, int]] = set()
        #: per plan bucket, the most tokens per row seen in it (NOTE [Plan for the longest shape seen])
        self.longest_in_bucket: dict[tuple[int, int], int] = {}
        self.treatments = tuple(name for name in self.registry if name != KEEP)
        self.offload_ms: Callable[[float, float], float] | None = None
        #: the parts beside the blocks by kind, the LM head's (treatments/chunked_head.py HeadPart) first (parts/kind.py),
        #: and those held at a moment of their own (the optimizer step's: NOTE [A part kind's moment])
        self.parts: dict[str, Any] = {}
        self.moment_parts: dict[str, Any] = {}
        self.bias, self.run_bias = BucketBias(), RunBias()  # NOTE [Bias per bucket], NOTE [Over-prediction across buckets]

    def _set_part(self, kind: str, part: Any) -> None:
        """Plan ``part`` as the part of ``kind`` from now on (None: no more), in the order added; the memory model
        prices its options' savings (NOTE [Head in the peaks], model.py)."""
        parts = {k: p for k, p in self.parts.items() if k != kind}
        if part is not None:
            parts[kind] = part
        self.parts = parts
        self.model.part_saving = {k: p.saved_bytes for k, p in parts.items()}
        self.cache.clear()

    def add_part(self, part: Any) -> None:
        """Plan ``part`` (a ``PartKind``) from now on, beside the blocks or at a moment of its own (parts/kind.py)."""
        self.remove_part(part.name)
        if part.moment == AFTER_BLOCKS:
            self._set_part(part.name, part)
        else:
            self.moment_parts[part.name] = part

    def remove_part(self, kind: str) -> None:
        """Plan the part of ``kind`` no more (its option then runs as the model runs it)."""
        self._set_part(kind, None)
        self.moment_parts.pop(kind, None)

    def moment_options(self, key: tuple[int, int]) -> dict[str, tuple[str, int]]:
        """Each part at a moment of its own: its option at ``key`` (NOTE [A part kind's moment]), its saving in the model."""
        free = math.inf if self.budget_bytes is None else self.room_bytes - self._static_for(self.planned_shape(key))
        chosen = {kind: part.at_moment(free, self.model.optimizer_bytes) for kind, part in self.moment_parts.items()}
        if (saved := float(sum(option[2] for option in chosen.values()))) != self.model.step_saved:
            self.model.step_saved = saved
            self.cache.clear()
        return {kind: (option[0], int(option[1])) for kind, option in chosen.items()}

    def price_offload(self, offload_ms: Callable[[float, float], float]) -> None:
        """Offload is priced by ``offload_ms`` (moved bytes, forward ms) -> ms from now on (probe.py's LinkPrice, whose
        ``depth`` the memory model counts: NOTE [Treated peaks], model.py); cached plans are dropped."""
        self.offload_ms = self.model.link = offload_ms
        self.cache.clear()

    def offload_depth(self, key: tuple[int, int]) -> int:
        """The prefetch depth ``key``'s plan counted, at its planned shape (NOTE [Prefetch depth], treatments/offload.py)."""
        return self.model.offload_depth(self.planned_shape(key))

    @property
    def margin_bytes(self) -> int:
        return self.room.margin_bytes

    @margin_bytes.setter
    def margin_bytes(self, value: int) -> None:  # set from outside: only grows from here (NOTE [The margin follows the misses])
        self.room.margin_bytes = self.room.least_margin_bytes = self.room.start_margin_bytes = int(value)
        self.cache.clear()

    @property
    def slack_bytes(self) -> int:
        return self.room.slack_bytes

    @slack_bytes.setter
    def slack_bytes(self, value: int) -> None:
        self.room.slack_bytes = int(value)
        self.cache.clear()

    def begin_step(self, static_bytes: int) -> None:
        """A step starts with ``static_bytes`` no plan changes (its plans are cached per static bucket)."""
        self.static_bytes = static_bytes

    def note_block_input(self, x: "torch.Tensor | None", blocks: Sequence[Any] = ()) -> None:
        """The first block's input of the step being decided: its bytes a token, and what a plain forward of the widest
        gated MLP of ``blocks`` holds at once a token (NOTE [Warm-up on the floor])."""
        if self._widest is None:
            self._widest = widest_intermediate([b.module for b in blocks])
        wide = x is not None and x.dim() >= 3
        self.input_bytes_per_token = x.element_size() * x.shape[-1] if wide else 0
        self.mlp_bytes_per_token = 2 * x.element_size() * self._widest if wide else 0

    @property
    def recompute_only(self) -> bool:
        """Whether ``recompute`` is the only treatment (plans are then the original first-k rows)."""
        return self.treatments == (RECOMPUTE,)

    def state_dict(self) -> dict[str, Any]:
        """Memory model, margin and slack (what a resumed run needs to skip its warm-up)."""
        return {"model": self.model.to_dict(), "margin_bytes": self.margin_bytes, "slack_bytes": self.slack_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model = MemoryModel.from_dict(state["model"], self.registry)
        self.model.bucket_tokens = self.bucket_tokens
        self.model.part_saving = {kind: part.saved_bytes for kind, part in self.parts.items()}
        self.model.link = self.offload_ms
        self.room.margin_bytes = int(state["margin_bytes"])
        self.room.slack_bytes = int(state.get("slack_bytes", self.room.slack_bytes))
        self.cache.clear()

    # ------------------------------------------------------------ predictions
    def planned_shape(self, key: tuple[int, int]) -> tuple[int, int]:
        """The shape ``key``'s plan is made and predicted for: the longest seen in its bucket
        (``key`` itself if none longer was) (NOTE [Plan for the longest shape seen])."""
        return (key[0], max(key[1], self.longest_in_bucket.get(bucket_key(key, self.bucket_tokens), 0)))

    def predict_peak(self, key: tuple[int, int], plan: Plan) -> int:
        """Predicted step peak: static + the largest of the step's three peaks (NOTE [Three peaks], model.py)."""
        k = self.planned_shape(key)
        return int(self._static_for(k) + self.model.step_bytes(k, plan))

    def _static_for(self, k: tuple[int, int]) -> float:
        """The static bytes a prediction at ``k`` starts from: less its bucket's correction (NOTE [Bias per bucket])."""
        return self.static_bytes - _correction(self, bucket_key(k, self.bucket_tokens))

    @property
    def room_bytes(self) -> int:
        """What a plan's predicted peak must fit: the budget less the margin and the slack (NOTE [Room], room.py)."""
        return self.room.free_bytes

    def recompute_ms(self, key: tuple[int, int], plan: Plan) -> float:
        """Predicted extra time of ``plan``'s treatments at ``key`` (0 before the model is fitted)."""
        if not self.model.ready:
            return 0.0
        k, kinds = self.planned_shape(key), plan.kinds
        if not kinds:
            return float(sum(self.model.block_cost_ms(i, k) for i in plan.blocks))
        options = self.model.options(k, self.treatments, self.offload_ms)
        price = {(i, name): ms for i, opts in enumerate(options) for name, _, ms in opts}
        return float(sum(price.get((i, kind), self.model.block_cost_ms(i, k)) for i, kind in zip(plan.blocks, kinds)))

    # ------------------------------------------------------------ plans
    def _static_bucket(self) -> int:
        # Static bytes differ between micro-steps (gradients present or not); plans are
        # cached per (shape bucket, static bucket) so both stay cached.
        unit = max(1, (self.budget_bytes or 1) // 64)
        return self.static_bytes // unit

    def plan_for(self, key: tuple[int, int], whole_row: bool = True) -> Plan:
        """The cheapest plan whose predicted peak fits the room (cached).

        ``whole_row``: on a miss, plan the shape's whole row when the stack allows
        (NOTE [Planning a row]); ``static`` asks for one shape only.
        """
        if self.budget_bytes is None:
            return Plan(())
        self.moment_options(key)  # their savings in the model before it plans the blocks
        self._drop_stale_plans()
        k, edge = self.planned_shape(key), bucket_key(key, self.bucket_tokens)
        self.longest_in_bucket[edge] = k[1]
        static_bucket = self._static_bucket()
        # a plan made for the bucket's edge serves every shape of it
        cache_key = (edge, static_bucket) if self.cache.peek((edge, static_bucket)) is not None else (k, static_bucket)
        plan = self.cache.get(cache_key)
        if plan is None:
            settled = self.cache.settled(ROW_AFTER_STEADY_ASKS)
            whole_row = whole_row and edge not in self.bias.correction  # NOTE [Bias per bucket]
            from_row = _plan_from_row(self, k, static_bucket) if whole_row and settled and self.recompute_only and not self.parts else None
            plan = from_row or (_plan_parts(self, k) if self.parts else self._plan(k))
            self._drop_stale_plans()  # a part priced anew while this plan was made: those made before are stale
            if from_row is not None and k != edge and _row_constant(self, k, edge, static_bucket):
                self.cache.put((edge, static_bucket), plan)  # no longer shape of the bucket will replan
            self.cache.put(cache_key, plan)
        return plan

    def _drop_stale_plans(self) -> None:
        """# NOTE [Parts priced anew]
        A part that prices itself anew (the head's implementation measured or chosen by plans) counts it in
        ``priced``; the plans cached before are stale, and Planning drops them itself (no part clears its cache)."""
        priced = tuple(getattr(part, "priced", 0) for part in self.parts.values())
        if priced != self._priced:
            self.cache.clear()
            self._priced = priced

    def _plan(self, k: tuple[int, int]) -> Plan:
        """``k``'s plan: the cheapest by recompute alone, or, where the run may give other
        treatments, the cheapest mix when that is cheaper still and fits (NOTE [Treatments never lose])."""
        mixes = not (self.recompute_only or not self.model.ready)
        plan = _plan_recompute(self, k, warn=not mixes)
        mixed = _plan_mixed(self, k) if mixes else None
        if plan is None or mixed is None:  # where recompute alone fits nothing, a mix that fits wins (NOTE [Leaner re-runs])
            return plan or mixed or _plan_recompute(self, k, warn=True)
        base_ms = plan.cost_ms if plan.blocks != self.all_blocks or plan.cost_ms else sum(self.model.costs(k))
        return mixed if mixed.cost_ms < 0.999 * base_ms else plan

    def _infeasible_log(self, k: tuple[int, int]) -> Callable[..., None] | None:
        """How to say that no plan fits ``k``: the run's first such shape at warning, later ones at debug, and a
        shape said before not again (None) (NOTE [What to change when a step cannot fit], summary_text.py)."""
        if k in self.infeasible_keys:
            return None
        log = logger.debug if self.infeasible_keys else logger.warning
        self.infeasible_keys = (self.infeasible_keys if len(self.infeasible_keys) < MAX_KEPT else set()) | {k}  # bounded
        return log

    # ------------------------------------------------------------ the only writer
    def apply(self, update: ModelUpdate) -> bool:
        """Apply what the learner returned; drop the cached plans if it changed any (returns that).

        An optimizer step's larger peak changes a plan only once the largest static bytes
        seen plus it is over the room (plans read it only through ``static + max(activations,
        it) <= room``), so it keeps the cache until then.
        """
        model, changed = self.model, False
        if update.groups is not None and update.groups != model.groups:
            model.split(update.groups)
            changed = True
        for path, key, value in update.samples:
            self._curve(path).add(key, value)
            changed = True
        corrected = self._bias_rules(update)
        if update.seen_key is not None:
            model.observe_key(update.seen_key)
        above = update.optimizer_above_static
        if above is not None:
            self.max_static_bytes = max(self.max_static_bytes, update.static_bytes)
            if above > model.optimizer_bytes:
                model.optimizer_bytes = float(above)
                changed |= self.budget_bytes is None or self.max_static_bytes + above > self.room_bytes
        if update.miss_bytes is not None:
            changed |= self.room.after_miss(update.miss_bytes)
        if update.steady_key is not None:
            changed |= _slack_rules(self, update)
        if changed:
            self.cache.clear()
        return changed or corrected

    def _bias_rules(self, update: ModelUpdate) -> bool:
        """New curve samples drop every correction (they were measured against the curves before); a
        steady step's prediction error goes to its bucket's bias, and only that bucket's plans are
        dropped when its correction changes (returns whether it did: NOTE [Bias per bucket])."""
        if update.samples:
            self.bias.clear()
            self.run_bias.clear()
            return False
        if self.budget_bytes is None:
            return False
        tolerance = BIAS_SHARE * self.budget_bytes
        changed = False
        if update.run_error is not None:  # NOTE [Over-prediction across buckets]
            key, error = update.run_error
            bucket = bucket_key(key, self.bucket_tokens)
            if self.run_bias.observe(error + _correction(self, bucket), tolerance, bucket[0] * bucket[1]):
                self.cache.clear()
                changed = True
        if update.error is None:
            return changed
        key, plan, error = update.error
        bucket = bucket_key(key, self.bucket_tokens)
        if not self.bias.observe(bucket, plan, error, tolerance, _correction(self, bucket)):
            return changed
        self.cache.drop(lambda cached: bucket_key(cached[0], self.bucket_tokens) == bucket)
        return True

    def _curve(self, path: tuple) -> Any:
        if path[0] in ("bytes", "ms"):
            group = self.model.group_models[path[1]]
            return group.bytes_curve(path[2]) if path[0] == "bytes" else group.ms_curve(path[2])
        return getattr(self.model, path[0])

    def after_oom(self, unusable_bytes: int) -> None:
        """A step ran out of memory: the room grows (NOTE [Room], room.py) and the plans are redone."""
        self.room.after_oom(unusable_bytes)
        self.cache.clear()


def _plan_recompute(planning: Planning, k: tuple[int, int], warn: bool = True) -> Plan | None:
    # Treating blocks lowers the start-of-backward peak only; the plan is then checked
    # against the other two (NOTE [Three peaks], model.py), and mended if one is over
    # (NOTE [Blocks held below a recompute]). Where none fits: every block, said once (``warn``), or None.
    room = planning.room_bytes
    need = int(planning._static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
    try:
        costs, savings = planning.model.costs(k), planning.model.savings(k)
        plan = plan_blocks(costs, savings, need)
        if not plan.blocks or planning.predict_peak(k, plan) <= room:
            return plan
        if planning.predict_peak(k, Plan(planning.all_blocks)) > room:
            raise InfeasiblePlanError("the recompute or optimizer-step peak is over the budget")
        return _mend(planning, k, plan, need, costs, savings)
    except InfeasiblePlanError:
        if not warn:
            return None
        most = floor_plan(planning, k[0] * k[1])
        peak_bytes = planning.predict_peak(k, most)  # NOTE [Over the room, not the budget]
        log = planning._infeasible_log(k) if peak_bytes > planning.budget_bytes else None
        if log is not None:
            outside = planning.model.outside(k) if planning.model.ready else 0.0
            parts = {"static": planning.static_bytes, "outside": outside, "blocks": planning.model.step_bytes(k, most) - outside}
            log("memfit: shape %s is predicted to need %s even with every block checkpointed, over the budget of %s; "
                "running it with every block checkpointed; %s", k, planning.budget.size(peak_bytes), planning.budget,
                over_budget_words(parts, planning.budget))
        return most


def _plan_mixed(planning: Planning, k: tuple[int, int]) -> Plan | None:
    """# NOTE [Treatments never lose]
    The cheapest mix of treatments that saves what is needed at the start of backward, if
    it also fits the other two peaks (NOTE [Treated peaks], model.py); else None. It is
    taken only when its predicted price is under the recompute-only plan's, which is
    always made too: a mix never costs more than recompute alone would.
    """
    room = planning.room_bytes
    need = int(planning._static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
    options = planning.model.options(k, planning.treatments, planning.offload_ms)
    if need <= 0 or all(name == "recompute" for opts in options for name, _, _ in opts):
        return None
    return _mix_that_fits(planning, k, options, need, room)


def _mend(planning: Planning, k: tuple[int, int], plan: Plan, need: int, costs: list[float], savings: list[int]) -> Plan:
    """A plan whose recompute peak is over the room, mended.

    # NOTE [Blocks held below a recompute]
    While backward recomputes a checkpointed block, every kept block below it still holds
    its activations. The cheapest set of blocks can leave such blocks (the largest layers
    of a Swin stack, under checkpointed later ones), and the recompute then peaks over
    the room. Such a plan is mended, not replaced by every block: the cheaper of the plan
    with every block under its topmost one added, and the shortest run of first blocks
    that saves enough; both hold nothing below a recompute.
    """
    room = planning.room_bytes
    below = tuple(range(max(plan.blocks) + 1))  # the plan and every block under it
    covered = itertools.accumulate(savings)
    prefix = tuple(range(next(i for i, total in enumerate(covered, 1) if total >= need)))
    mended = [p for p in {below, prefix} if planning.predict_peak(k, Plan(p)) <= room]
    if not mended:
        return Plan(planning.all_blocks)
    best = min(mended, key=lambda p: (sum(costs[i] for i in p), p))
    return Plan(best, float(sum(costs[i] for i in best)), int(sum(savings[i] for i in best)))


# ---------------------------------------------------------------- the bias (NOTE [Bias per bucket])
def _correction(planning: Planning, bucket: tuple[int, int]) -> float:
    """What a prediction in ``bucket`` is lowered by: its own correction, else the run's offset
    where an OOM is not fatal (NOTE [Over-prediction across buckets])."""
    if bucket in planning.bias.correction:
        return planning.bias.correction[bucket]
    return 0.0 if planning.room.oom_fatal else planning.run_bias.offset_for(bucket[0] * bucket[1])



# ---------------------------------------------------------------- the slack (NOTE [The slack is priced], room.py)
def _slack_rules(planning: Planning, update: ModelUpdate) -> bool:
    """A steady step with or without allocator retries, to the room's slack rules (NOTE [The
    slack is priced], room.py): a retry is priced against the bucket's clean steps (waiting for
    the first where there is none yet), the growth against the planner's price of the smaller
    room, both per step over the latest steady steps."""
    bucket = bucket_key(update.steady_key, planning.bucket_tokens)
    times, room = planning.room.times, planning.room
    times.note(update.steady_key, bool(update.alloc_retries))
    if not update.alloc_retries:
        if update.net_ms is None:
            return room.after_clean_step()
        times.add_clean(bucket, update.net_ms)
        changed = room.after_clean_step()
        waited = times.waited_retry_ms(bucket)
        if waited is None:
            return changed
        return room.price_retry(waited * times.retry_share, growth_ms_per_step(planning)) or changed
    if update.net_ms is None:
        return room.after_alloc_retries(None)
    retry_ms = times.retry_ms(bucket, update.net_ms)
    if retry_ms is not None:
        return room.after_alloc_retries(retry_ms * times.retry_share, growth_ms_per_step(planning))
    if times.wait(bucket, update.net_ms):
        return room.after_alloc_retries(None)  # the bucket retried twice before a clean step
    return room.after_waiting_retry()


def growth_ms_per_step(planning: Planning) -> float:
    """What a growth of the slack adds to a step's plan, the mean over the latest steady steps'
    shapes (NOTE [The slack is priced], room.py)."""
    shapes = [planning.planned_shape(key) for key, _ in planning.room.times.recent]
    priced = {shape: slack_cost_ms(planning, shape, planning.room.slack_step_bytes) for shape in set(shapes)}
    return sum(priced[shape] for shape in shapes) / len(shapes) if shapes else 0.0


def slack_cost_ms(planning: Planning, key: tuple[int, int], extra_bytes: int) -> float:
    """What ``key``'s recompute plan would cost more were the room ``extra_bytes`` smaller
    (infinite where it could not fit; 0 before the model is fitted or without a budget)."""
    if not planning.model.ready or planning.budget_bytes is None:
        return 0.0
    k = planning.planned_shape(key)
    need = int(planning._static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - planning.room_bytes
    costs, savings = planning.model.costs(k), planning.model.savings(k)
    try:
        now = plan_blocks(costs, savings, need).cost_ms if need > 0 else 0.0
        smaller = plan_blocks(costs, savings, need + extra_bytes).cost_ms if need + extra_bytes > 0 else 0.0
    except InfeasiblePlanError:
        return float("inf")
    return float(smaller - now)


# ---------------------------------------------------------------- parts beside the blocks (NOTE [Parts beside the blocks], planner.py)
def _plan_parts(planning: Planning, k: tuple[int, int]) -> Plan:
    """``k``'s plan with the parts beside the blocks (NOTE [Parts beside the blocks], planner.py; the LM
    head: NOTE [The head in the plan]): the cheapest mix of the blocks' treatments and one option per
    part that saves what the backward's start needs and fits all three peaks (NOTE [Planning with the
    stashes back]), a mix with other treatments than recompute only where it is cheaper (NOTE
    [Treatments never lose]); else, where nothing fits, every block recomputed, each part at its most."""
    if planning.model.ready and planning.budget_bytes is not None:  # NOTE [The plans choose the implementation]
        seen = planning.model.max_key
        longest = k if seen is None or k[0] * k[1] >= seen[0] * seen[1] else tuple(seen)
        for part in list(planning.parts.values()):
            part.choose_by_plans(lambda key: _parts_plan_ms(planning, planning.planned_shape(key)), longest)
    plan = _parts_mix(planning, k)
    if plan is not None:
        return plan
    most = floor_plan(planning, k[0] * k[1])
    # NOTE [Over the room, not the budget]
    # Where no plan fits the room (the budget less its margins), the floor runs. It is said to need more than the
    # budget only where its predicted peak is over the budget itself: a floor predicted inside the budget's margins
    # may well fit (a 65,536-token step predicted at 23.2 GiB, margins 2 GiB, ran at 22.2 GiB of a 24 GiB cap).
    log = planning._infeasible_log(k) if planning.predict_peak(k, most) > planning.budget_bytes else None
    if log is not None:
        peak = planning.budget.size(planning.predict_peak(k, most))
        # each part's bytes from its own formula, known before the model is (NOTE [The head's bytes in a budget error])
        shares = {kind: share for kind, part in planning.parts.items()
                  if (share := part.budget_share(k[0] * k[1], planning.budget.size)) is not None}
        kept, least = sum(s[0] for s in shares.values()), sum(s[1] for s in shares.values())
        outside = max(0.0, planning.model.outside(k) - kept) if planning.model.ready else 0.0
        blocks = max(0.0, planning.model.step_bytes(k, most) - outside - least) if planning.model.ready else 0.0
        parts = {"static": planning.static_bytes, **{kind: s[0] for kind, s in shares.items()},
                 "outside-not-parts" if shares else "outside": outside, "blocks": blocks}
        at_most = " and ".join(s[2] for s in shares.values()) or "every part beside the blocks at its most saving"
        log("memfit: shape %s is predicted to need %s even with every block checkpointed and %s, over the budget of %s; %s",
            k, peak, at_most, planning.budget, over_budget_words(parts, planning.budget))
    return most


def _parts_mix(planning: Planning, k: tuple[int, int]) -> Plan | None:
    """``k``'s cheapest mix of block treatments and one option per part that fits (:func:`_plan_parts`), or None."""
    room = planning.room_bytes
    need = int(planning._static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
    parts = [(kind, part.options(k[0] * k[1])) for kind, part in planning.parts.items()]
    options = planning.model.options(k, planning.treatments, planning.offload_ms)
    # NOTE [Treatments never lose]: the mix only where it fits and is cheaper than recompute alone
    plan = _mix_that_fits(planning, k, [[o for o in opts if o[0] == RECOMPUTE] for opts in options], need, room, parts)
    if not planning.recompute_only:
        mixed = _mix_that_fits(planning, k, options, need, room, parts)
        # a tenth of a percent cheaper, of a cost that may be below 0 (a head priced faster chunked: NOTE [Pricing the head])
        if mixed is not None and (plan is None or mixed.cost_ms < plan.cost_ms - 0.001 * abs(plan.cost_ms)):
            plan = mixed
    return plan


#: the price of a shape where nothing fits, before the bytes over the room (NOTE [The plans choose the implementation])
UNFIT_MS = 1e12


def _parts_plan_ms(planning: Planning, k: tuple[int, int]) -> float:
    """The ms of ``k``'s cheapest plan with the parts as priced now (NOTE [The plans choose the
    implementation], chunked_head.py); where nothing fits, :data:`UNFIT_MS` plus the bytes the most
    any plan saves leaves over the room, so the head that holds less is the cheaper there too."""
    plan = _parts_mix(planning, k)
    if plan is not None:
        return float(plan.cost_ms)
    return UNFIT_MS + max(0.0, float(planning.predict_peak(k, floor_plan(planning, k[0] * k[1])) - planning.room_bytes))


def floor_plan(planning: Planning, tokens: int) -> Plan:
    """The plan that keeps least, what runs where no plan is predicted to fit: every block on the run's floor treatment
    (the re-run that keeps least it offers: NOTE [A replay treats more], methods/dynamic.py; plain ``recompute`` where it
    offers no other), each part beside the blocks at its option that saves most at ``tokens`` tokens."""
    floor = floor_treatment(planning.registry)
    parts = [(kind, *part.most(tokens)) for kind, part in planning.parts.items()]
    return Plan(planning.all_blocks, kinds=() if floor == RECOMPUTE else (floor,) * planning.n_blocks, parts=parts)


# ---------------------------------------------------------------- rows (NOTE [Planning a row])
def _row_constant(planning: Planning, k: tuple[int, int], edge: tuple[int, int], static_bucket: int) -> bool:
    """Whether the row plans every length from ``k`` to ``edge`` alike (NOTE [Plan for the longest shape seen])."""
    row = planning.cache.rows.get((k[0], static_bucket))
    if row is None or row["longest"] < edge[1]:
        return False
    span = slice(k[1] - 1, edge[1])
    return all(len(set(row[name][span])) == 1 for name in ("count", "every_fits", "prefix_fits"))


def _mix_that_fits(
    planning: Planning, k: tuple[int, int], options: list[list[tuple[str, int, float]]], need: int, room: int,
    parts: Sequence[tuple[str, Sequence[tuple[str, int, int, float]]]] = (),
) -> Plan | None:
    """The cheapest mix saving ``need`` bytes (with one of each part's options, ``(kind, options)``,
    for the parts beside the blocks) whose predicted peak fits ``room``, or None.

    # NOTE [Planning with the stashes back]
    The ``depth + 1`` stashes of offloaded blocks that backward brings back at once (NOTE [Treated
    peaks], model.py) are not in the knapsack's savings: offloading ``depth + 1`` blocks or fewer
    saves nothing at the backward's start. A mix over the room asks again for what it saved and
    what it is over by; each ask offloads at least as many blocks as the first more, until the
    stashes back are paid for, so a run asks up to ``depth + 2`` times (3 at least, for the other
    peaks). A mix that never fits is None: the caller keeps its recompute plan, never a last
    resort while keeping blocks fits.

    # NOTE [Leaner re-runs]
    A treatment may keep what another keeps at the backward's start and re-run leaner (``keeps_as``:
    ``recompute_tiled`` keeps as ``recompute`` does, its re-run holding one chunk of the MLP's
    intermediates, NOTE [Tiled MLP]). The knapsack, which sees savings at the backward's start only,
    never picks the dearer twin; so a mix whose re-run peak is what is over the room is asked again
    with every treated block's twin swapped in (its price the twins' difference), and taken if that
    fits. Where recompute alone fits nothing, a mix that fits this way is the plan (never every
    block recomputed over the room, which would only run out of memory and replay).
    """
    order = {name: t.order for name, t in planning.registry.items()}
    leaner = {t.keeps_as: name for name, t in planning.registry.items() if t.keeps_as and name in planning.treatments}
    asks = max(3, planning.model.offload_depth(k) + 2)
    for _ in range(asks):
        try:
            mixed = plan_with_parts(options, parts, need, order=order)
        except InfeasiblePlanError:
            return None
        over = planning.predict_peak(k, mixed) - room
        if over <= 0:
            return mixed
        lean = with_leaner_reruns(mixed, options, leaner) if leaner else None  # NOTE [Leaner re-runs]
        if lean is not None and planning.predict_peak(k, lean) <= room:
            return lean
        need = int(max(need, mixed.saved_bytes) + over) + 1
    return None


def _plan_from_row(planning: Planning, k: tuple[int, int], static_bucket: int) -> Plan | None:
    """``k``'s plan read from its row's arrays, planned first if needed.

    ``None`` (plan ``k`` alone) for a stack of several groups or a shape that no plan fits
    (the per-key path warns then).
    """
    row = planning.cache.rows.get((k[0], static_bucket))
    if row is None or row["longest"] < k[1]:
        row = _plan_row(planning, k)
        if row is None:
            return None
        planning.cache.put_row((k[0], static_bucket), row)
    i = k[1] - 1
    c, m = row["count"][i], planning.n_blocks
    if c == 0:
        return Plan(())
    if c < 0 or not row["every_fits"][i]:
        return None  # over the budget with every block
    if c == m or row["prefix_fits"][i]:
        # what the chosen blocks cost, summed one block at a time as plan_blocks sums them
        cost = float(sum(itertools.repeat(row["cost_ms"][i], c)))
        return Plan(planning.all_blocks if c == m else tuple(range(c)), cost, row["saved_bytes"][i])
    return Plan(planning.all_blocks)  # the mend's candidates are this very prefix (NOTE [Blocks held below a recompute])


def _plan_row(planning: Planning, k: tuple[int, int]) -> dict[str, Any] | None:
    """Every length of ``k``'s row, up to the longest shape seen, as lists (one group only):
    the model's own peak formula over arrays (NOTE [One evaluator], model.py)."""
    model = planning.model
    n, b = k[0], planning.bucket_tokens
    longest = max(k[1], bucket_key(model.max_key, b)[1] if model.max_key else 0)
    # a few buckets past the longest shape seen: a row costs about the same at any
    # length, and a step just past it would otherwise replan the whole row
    longest = -(-longest // (8 * b)) * (8 * b)
    ts = np.arange(1, longest + 1, dtype=np.int64)  # per token: plan keys are lengths seen
    rows = model.prefix_rows(n, ts)
    if rows is None:
        return None
    m, room, static = planning.n_blocks, planning.room_bytes, float(planning.static_bytes)
    saving = rows.saving
    need = np.trunc(static + rows.peaks(0)[0]).astype(np.int64) - room  # as plan_blocks is asked
    every = rows.peaks(m)[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        count = np.where(need > 0, np.ceil(need / np.maximum(saving, 1)), 0).astype(np.int64)
    count = np.where(m * saving < need, -1, np.minimum(count, m))  # -1: no plan saves enough
    clipped = np.maximum(count, 0)
    peak = rows.peaks(clipped)[1]
    return {
        "longest": longest, "count": count.tolist(), "every_fits": (np.trunc(static + every) <= room).tolist(),
        "prefix_fits": (np.trunc(static + peak) <= room).tolist(),
        "cost_ms": rows.cost_ms.tolist(),  # one block's
        "saved_bytes": (clipped * saving).tolist(),
    }
