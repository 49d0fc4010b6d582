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

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.engine.budget import Budget
from memfit.engine.plan.model import MemoryModel
from memfit.engine.plan.planner import Plan, PlanCache
from memfit.engine.plan.room import Room
from memfit.engine.plan.rows import RowSearch
from memfit.engine.plan.search import MAX_KEPT, Search
from memfit.engine.shapes import bucket_key
from memfit.engine.parts.treatments import KEEP, RECOMPUTE, TreatmentSpec, resolve
from memfit.engine.parts.accounting import gathered_param_bytes
from memfit.engine.parts.treatments.tiled_mlp import widest_intermediate
from memfit.engine.parts.host_weights import NO_WEIGHTS
from memfit.engine.parts.kind import AFTER_BLOCKS, STATIC

__all__ = ["Planning", "ModelUpdate", "ROW_AFTER_STEADY_ASKS"]

logger = logging.getLogger("memfit")

#: steady steps of a bucket in a row that must err the same way before its prediction is
#: corrected (NOTE [Bias per bucket]) ...
BIAS_SEEN = 2
#: ... each by more than this share of the budget
BIAS_SHARE = 0.01
#: steady steps whose least over-prediction lowers every bucket's (NOTE [Over-prediction across buckets])
RUN_BIAS_STEPS = 4


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
        pool_bytes: what other streams' pools held free at a step's end, when read (NOTE [Other streams' pools]).
        net_ms: that step's time less its treatments' predicted time (None: not timed).
        timed_key: the shape ``net_ms`` is the time of, where not ``steady_key`` (under FSDP the ranks' largest: NOTE
            [A retry beside no clean step of its bucket], room.py).
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
    pool_bytes: int | None = None
    net_ms: float | None = None
    timed_key: tuple[int, int] | None = None
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
        self.n_blocks, self.all_blocks = n_blocks, tuple(range(n_blocks))
        #: the run's treatments by name, ``keep`` and ``recompute`` first (engine/parts/treatments/)
        self.registry = resolve(treatments)
        self.model = MemoryModel(groups, bucket_tokens, self.registry)
        self.room = room or Room(budget, margin_bytes, slack_bytes)  # the run's one copy of the budget
        if room is not None and budget is not None and room.budget_bytes != Budget.parse(budget).bytes:
            raise ValueError(f"a room for {room.budget} given with the budget {budget}")
        self.bucket_tokens, self.cache = bucket_tokens, PlanCache()
        self._priced: tuple[int, ...] = ()  # the parts' ``priced`` counts the cached plans were made under
        self.static_bytes = self.max_static_bytes = 0
        self.input_bytes_per_token = self.mlp_bytes_per_token = self.gathered_block_bytes = 0  # note_block_input
        self._widest: int | None = None
        self.search, self.rows = Search(self), RowSearch(self)  # a shape's plan on a cache miss (search.py), a row's (rows.py)
        #: per plan bucket, the most tokens per row seen in it (NOTE [Plan for the longest shape seen])
        self.longest_in_bucket: dict[tuple[int, int], int] = {}
        self.treatments = tuple(name for name in self.registry if name != KEEP)
        self.offload_ms: Callable[[float, float], float] | None = None
        #: the parts beside the blocks by kind, the LM head's (treatments/chunked_head.py HeadPart) first (parts/kind.py),
        #: those held at a moment of their own (the optimizer step's: NOTE [A part kind's moment]), and the one held at
        #: every moment, the blocks' frozen weights (NOTE [Weights on the host], parts/host_weights.py)
        self.parts: dict[str, Any] = {}
        self.moment_parts: dict[str, Any] = {}
        self.weights: Any = NO_WEIGHTS
        self.bias, self.run_bias = BucketBias(), RunBias()  # NOTE [Bias per bucket], NOTE [Over-prediction across buckets]

    def _set_part(self, kind: str, part: Any) -> None:
        """Plan ``part`` as the part of ``kind`` from now on (None: no more), in the order added; the memory model
        prices its options' savings (NOTE [Head in the peaks], model.py)."""
        parts = {k: p for k, p in self.parts.items() if k != kind}
        if part is not None:
            parts[kind] = part
        self.parts = parts
        self.model.part_saving = {k: p.saved_bytes for k, p in parts.items()}
        self.model.parts_apart |= part is not None and getattr(part, "moment_apart", False) and not (self.model.transient_full.fitted or self.model.transient_partial.fitted)  # NOTE [The parts' moment]
        self.cache.clear()

    def add_part(self, part: Any) -> None:
        """Plan ``part`` (a ``PartKind``) from now on, beside the blocks or at a moment of its own (parts/kind.py)."""
        self.remove_part(part.name)
        if part.moment == AFTER_BLOCKS:
            self._set_part(part.name, part)
        elif part.moment == STATIC:
            self.weights = part
        else:
            self.moment_parts[part.name] = part

    def remove_part(self, kind: str) -> None:
        """Plan the part of ``kind`` no more (its option then runs as the model runs it)."""
        self._set_part(kind, None)
        self.moment_parts.pop(kind, None)
        self.weights = NO_WEIGHTS if self.weights.name == kind else self.weights

    def moment_options(self, key: tuple[int, int]) -> dict[str, tuple[str, int]]:
        """Each part at a moment of its own: its option at ``key`` (NOTE [A part kind's moment]), its saving in the model."""
        free = math.inf if self.budget_bytes is None else self.room_bytes - self.static_for(self.planned_shape(key))
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

    def note_block_input(self, x: Any, blocks: Sequence[Any] = ()) -> None:
        """The first block's input of the step being decided: its bytes a token, what a plain forward of the widest gated
        MLP of ``blocks`` holds at once a token, and the most FSDP2 gathers for a block (NOTE [Warm-up on the floor])."""
        if self._widest is None:
            modules = [b.module for b in blocks]
            self._widest, self.gathered_block_bytes = widest_intermediate(modules), max(map(gathered_param_bytes, modules), default=0)
        wide = x is not None and x.dim() >= 3
        self.input_bytes_per_token, self.mlp_bytes_per_token = (x.element_size() * x.shape[-1], 2 * x.element_size() * self._widest) if wide else (0, 0)

    @property
    def recompute_only(self) -> bool:
        """Whether ``recompute`` is the only treatment (plans are then the original first-k rows)."""
        return self.treatments == (RECOMPUTE,)

    def state_dict(self) -> dict[str, Any]:
        """Memory model, margin and slack (what a resumed run needs to skip its warm-up)."""
        return {"model": self.model.to_dict(), "margin_bytes": self.margin_bytes, "slack_bytes": self.slack_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model = MemoryModel.from_dict(state["model"], self.registry)
        self.model.bucket_tokens, self.model.link = self.bucket_tokens, self.offload_ms
        self.model.part_saving = {kind: part.saved_bytes for kind, part in self.parts.items()}
        self.room.margin_bytes, self.room.slack_bytes = int(state["margin_bytes"]), int(state.get("slack_bytes", self.room.slack_bytes))
        self.cache.clear()

    # ------------------------------------------------------------ predictions
    def planned_shape(self, key: tuple[int, int]) -> tuple[int, int]:
        """The shape ``key``'s plan is made and predicted for: the longest seen in its bucket
        (``key`` itself if none longer was) (NOTE [Plan for the longest shape seen])."""
        return (key[0], max(key[1], self.longest_in_bucket.get(bucket_key(key, self.bucket_tokens), 0)))

    def predict_peak(self, key: tuple[int, int], plan: Plan) -> int:
        """Predicted step peak: static + the largest of the step's three peaks (NOTE [Three peaks], model.py)."""
        k = self.planned_shape(key)
        return int(self.static_for(k) + self.model.step_bytes(k, plan)) - self.weights.saved_by(plan)

    def plan_peak(self, key: tuple[int, int], plan: Plan) -> int:
        """What a plan must fit the room with: static + the peaks the plan decides (NOTE [A plan fits what it decides])."""
        return int(self.static_for(k := self.planned_shape(key)) + self.model.plan_bytes(k, plan)) - self.weights.saved_by(plan)

    def static_for(self, k: tuple[int, int]) -> float:
        """The static bytes a prediction at ``k`` starts from: less its bucket's correction (NOTE [Bias per bucket])."""
        return self.static_bytes - self.correction(bucket_key(k, self.bucket_tokens))

    def correction(self, bucket: tuple[int, int]) -> float:
        """What a prediction in ``bucket`` is lowered by: its own correction, else the run's offset
        where an OOM is not fatal (NOTE [Over-prediction across buckets])."""
        if bucket in self.bias.correction:
            return self.bias.correction[bucket]
        return 0.0 if self.room.oom_fatal else self.run_bias.offset_for(bucket[0] * bucket[1])

    @property
    def budget(self) -> Budget | None:
        """The budget as typed (NOTE [A budget as typed]): the room's."""
        return self.room.budget

    @property
    def budget_bytes(self) -> int | None:
        return self.room.budget_bytes

    @property
    def room_bytes(self) -> int:
        """What a plan's predicted peak must fit: the budget less the margin, slack and pools (NOTE [Room], room.py)."""
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
    def _static_bucket(self) -> int | tuple[int, Any]:
        # cached per static bucket (gradients present or not) and where the weights are (NOTE [Bringing the weights back])
        bucket = self.static_bytes // max(1, (self.budget_bytes or 1) // 64)
        return (bucket, self.weights.last) if self.weights.streamable else bucket

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
            from_row = self.rows.from_row(k, static_bucket) if whole_row and settled and self.recompute_only and not (self.parts or self.weights.streamable) else None
            plan = from_row or self.search.plan(k)
            self._drop_stale_plans()  # a part priced anew while this plan was made: those made before are stale
            if from_row is not None and k != edge and self.rows.row_constant(k, edge, static_bucket):
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
        changed |= self.room.after_miss(update.miss_bytes)
        changed |= self.room.learn_pools(update.pool_bytes)
        if update.steady_key is not None:
            changed |= self.room.after_steady(update.steady_key, bucket_key(update.timed_key or update.steady_key, self.bucket_tokens),
                                              update.alloc_retries, update.net_ms, self.search.growth_ms_per_step)
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
            if self.run_bias.observe(error + self.correction(bucket), tolerance, bucket[0] * bucket[1]):
                self.cache.clear()
                changed = True
        if update.error is None:
            return changed
        key, plan, error = update.error
        bucket = bucket_key(key, self.bucket_tokens)
        if not self.bias.observe(bucket, plan, error, tolerance, self.correction(bucket)):
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
