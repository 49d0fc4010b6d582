"""The learner: pure functions from a finished step's readings to updates of the memory model.

The runtime reads a step (engine/run/meter.py) and hands the readings here as :class:`Peaks`;
:func:`step_outcome` turns them into what the step teaches (:class:`StepOutcome`), and a
method that plans from the model (``dynamic``, ``static``) asks :func:`learn_optimizer_peak`,
:func:`learn_step`, :func:`grow_margin` and :func:`grow_slack` what to change; warm-up probes
go to :func:`learn_probes`. Each returns a :class:`~memfit.engine.plan.planning.ModelUpdate` and
writes nothing: ``Planning.apply`` applies it and keeps its plan cache valid. Nothing here
touches ``torch``: every function is tested with plain numbers.

# NOTE [What a step teaches]
Warm-up steps always add samples. A steady step changes the model only when its peak was
under-predicted by more than a quarter of the margin (safety; or the backstop evicted), or
over-predicted a new shape by more than 1% of the budget so that the right prediction would
have given a cheaper plan (speed: it treated blocks for nothing); then each curve that erred
the same way by more than 0.5% learns the step's value. Every other steady step leaves the
model and the plan cache untouched: smaller errors are the margin's to absorb, and each change
of the model clears every cached plan, which costs a replan of every shape. The partial
transient also learns its first 8 shapes and any shape beyond the range it has seen (NOTE [Two
transient regimes], model.py), from the backward's start where the step read it apart (NOTE
[Reading the backward's start]), else only when the model predicts the start to be the peak.
Warm-up runs every block checkpointed whatever is predicted, from a model of one or two
samples: its misses say nothing of steady plans and never grow the margin.

# NOTE [Reading the backward's start]
A partial plan's backward has two peaks (NOTE [Three peaks], model.py): its start, which the
partial transient describes, and the recompute of its topmost checkpointed block, which the
model bounds from ``full``'s transient and the blocks held below. The allocator keeps one peak
per step, so the meter reads the peak so far at the step's first recompute (the start's: the
forward, the loss and the backward of the blocks above) and resets it. The partial transient
learns from that reading alone: learnt from the whole step's peak, a recompute's bytes would
be taken for the start's transient and lift the partial curve's envelope for good.

# NOTE [A step's transient]
The transient is what the step's peak holds beyond static memory and saved activations. When
the optimizer step's peak was read apart, the backward's peak is compared with the static
bytes the step began with, less the optimizer state its first step creates (which did not
exist yet), plus what the step allocated for good (the first step's library workspaces: static
from the next step on, not transient). Otherwise the whole step's peak is compared with the
larger of the static bytes at its start and at its end.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from memfit.engine.plan.planner import InfeasiblePlanError, Plan, plan_blocks
from memfit.engine.plan.planning import ModelUpdate, Planning
from memfit.engine.shapes import bucket_key

__all__ = [
    "would_plan_less",
    "GROUP_SPLIT_SHARE",
    "Peaks",
    "StepOutcome",
    "step_outcome",
    "learn_optimizer_peak",
    "learn_step",
    "mispredicted",
    "grow_margin",
    "grow_slack",
    "note_bias",
    "learn_probes",
]

logger = logging.getLogger("memfit")

#: Blocks of one group whose probes saved more than this share apart are split (NOTE [Blocks
#: alike only in name]).
GROUP_SPLIT_SHARE = 0.01


@dataclass(frozen=True)
class Peaks:
    """What the meter read of one finished step (bytes).

    Attributes:
        peak: the step's peak, backward and forward (the optimizer step's apart, when read).
        reserved: the allocator's reserved peak (logical: the peak).
        rest: the peak from the first recompute on, when the backward's start was read apart;
            else the peak.
        start: the backward's start, read at its first recompute (CUDA), or None.
        parts: the peak until the LM head's backward was done, read apart (CUDA: NOTE [The parts' moment],
            model.py), or None; ``start`` and ``rest`` are then what came after it, and ``peak`` holds it.
        optimizer: the optimizer step's peak, read apart (CUDA), or None.
        exact: logical accounting (counted tensors): the peak holds no transient.
        alloc_retries: allocations the caching allocator served only after releasing its
            cache during the step (CUDA).
        pool_bytes: what other streams' pools held free at the step's end, when read (CUDA: NOTE [Other streams'
            pools], room.py).
    """

    peak: int
    reserved: int
    rest: int
    start: int | None = None
    parts: int | None = None
    optimizer: int | None = None
    exact: bool = False
    alloc_retries: int = 0
    pool_bytes: int | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What a finished step teaches.

    Attributes:
        key: the step's shape key.
        plan: the plan it ran.
        warmup: a warm-up step.
        outside: bytes saved outside every block.
        by_block: bytes each block saved (under the backstop: before evicting, without the
            stores' inputs).
        static: static bytes at the step's start.
        peak: the step's peak as recorded (the optimizer step's included).
        plain_peak: the peak its plan holds run plainly (NOTE [Backstop], protection.py): what
            predictions are compared with.
        transient: the backward's transient (NOTE [A step's transient]); None under logical
            accounting.
        start_transient: the transient at the backward's start, when read apart.
        parts_transient: the transient at the parts' moment (the LM head's backward done), when read apart (NOTE
            [The parts' moment], model.py); ``transient`` and ``start_transient`` are then the rest's.
        optimizer_above_static: the optimizer step's peak above static, when read apart.
        evicted: blocks the backstop evicted.
        counted: the step counted its saved tensors (``outside`` and ``by_block`` are then
            known; otherwise they are 0 and only the peaks teach).
        alloc_retries: allocations the caching allocator served only after releasing its cache.
        pool_bytes: what other streams' pools held free at the step's end, when read.
        net_ms: the step's time less its treatments' predicted time, or None when not timed
            (what prices a retry: NOTE [The slack is priced], room.py).
        timed_key: the shape whose time ``net_ms`` is: under FSDP the ranks' largest rows and length (the slowest
            rank sets the step's time); None: ``key`` (NOTE [A retry beside no clean step of its bucket], room.py).
        block_keys: each block's own (N, T) (NOTE [What the key cannot see], shapes.py).
    """

    key: tuple[int, int]
    plan: Plan
    warmup: bool
    outside: int
    by_block: list[int]
    static: int
    peak: int
    plain_peak: int
    transient: int | None
    start_transient: int | None = None
    parts_transient: int | None = None
    optimizer_above_static: int | None = None
    evicted: tuple[int, ...] = field(default_factory=tuple)
    counted: bool = True
    alloc_retries: int = 0
    pool_bytes: int | None = None
    net_ms: float | None = None
    timed_key: tuple[int, int] | None = None
    block_keys: dict[int, tuple[int, int]] = field(default_factory=dict)


def _plain_peaks(
    peaks: Peaks, plan: Plan, evicted: Sequence[int], inputs: Sequence[int], peak: int,
) -> tuple[int, int | None]:
    """The step's peak and backward-start peak as its plan holds them run plainly: an armed
    step's less what its stores kept only as block inputs (NOTE [Backstop], protection.py)."""
    total = sum(inputs)
    if not total:
        return peak, peaks.start
    if peaks.start is None:  # no recompute (or logical): the peak is the backward's start, every store alive
        return peak - total, None
    # from the first recompute on (the topmost recomputed block), the stores above it are gone
    top = max([*plan.blocks, *evicted], default=len(inputs))
    return max(peaks.start - total, peaks.rest - sum(inputs[:top])), peaks.start - total


def step_outcome(
    peaks: Peaks,
    *,
    key: tuple[int, int],
    plan: Plan,
    warmup: bool,
    outside: int,
    by_block: list[int],
    static: int,
    state_to_come: int,
    static_now: int,
    evicted: Sequence[int] = (),
    backstop_input: Sequence[int] = (),
    counted: bool = True,
    net_ms: float | None = None,
    timed_key: tuple[int, int] | None = None,
    block_keys: dict[int, tuple[int, int]] | None = None,
) -> StepOutcome:
    """What a finished step teaches, from its readings (NOTE [A step's transient]).

    Args:
        peaks: the meter's readings.
        key, plan, warmup: the step's shape key, plan and phase.
        outside, by_block: the bytes saved outside the blocks and by each block.
        static: static bytes at the step's start.
        state_to_come: optimizer state counted in ``static`` that its first step creates.
        static_now: static bytes now, after the step.
        evicted: blocks the backstop evicted.
        backstop_input: per block, what an armed step's stores kept only as block inputs.
        counted: the step counted its saved tensors; without the counts no transient is known.
        net_ms: the step's time less its treatments' predicted time (None: not timed).
        timed_key: the shape ``net_ms`` is the time of, where not ``key`` (the ranks' largest under FSDP).
    """
    saved = outside + sum(by_block)
    peak = peaks.peak
    # the rest of the step apart from the parts' moment, where that was read (NOTE [The parts' moment], model.py)
    rest_peak = peak if peaks.parts is None else max(peaks.rest, peaks.start or 0)
    plain_peak, plain_start = _plain_peaks(peaks, plan, evicted, backstop_input, rest_peak)
    plain_parts = None if peaks.parts is None else peaks.parts - sum(backstop_input)  # every store alive then
    rest_plain, plain_peak = plain_peak, max(plain_peak, plain_parts or 0)
    start_transient = optimizer_above = parts_transient = None
    if peaks.exact or not counted:
        transient = None
        if peaks.optimizer is not None:
            optimizer_above = peaks.optimizer - static
            peak, plain_peak = max(peak, peaks.optimizer), max(plain_peak, peaks.optimizer)
    elif peaks.optimizer is not None:
        grown = max(0, static_now - static)
        base = static - state_to_come + grown + saved
        transient = rest_plain - base
        start_transient = None if plain_start is None else plain_start - base
        parts_transient = None if plain_parts is None else plain_parts - base
        optimizer_above = peaks.optimizer - static
        peak, plain_peak = max(peak, peaks.optimizer), max(plain_peak, peaks.optimizer)
    else:
        base = max(static, static_now) + saved
        transient = rest_plain - base
        start_transient = None if plain_start is None else plain_start - base
        parts_transient = None if plain_parts is None else plain_parts - base
    return StepOutcome(
        key=key, plan=plan, warmup=warmup, outside=outside, by_block=list(by_block), static=static, peak=peak,
        plain_peak=plain_peak, transient=transient, start_transient=start_transient, parts_transient=parts_transient,
        optimizer_above_static=optimizer_above, evicted=tuple(evicted), counted=counted,
        alloc_retries=peaks.alloc_retries, pool_bytes=peaks.pool_bytes, net_ms=net_ms, timed_key=timed_key,
        block_keys=dict(block_keys or {}),
    )


def learn_optimizer_peak(planning: Planning, outcome: StepOutcome) -> ModelUpdate:
    """The optimizer step's peak above the step's static bytes (its batch included); Planning
    keeps its plans while the largest static seen plus it stays within the room."""
    if outcome.optimizer_above_static is None:
        return ModelUpdate()
    # in untreated terms, as the curves are: what the step's part saved added back (NOTE [A part kind's moment])
    above = outcome.optimizer_above_static + int(planning.model.step_saved)
    return ModelUpdate(optimizer_above_static=above, static_bytes=outcome.static)


def _backward_start_dominates(planning: Planning, key: tuple[int, int], plan: Plan) -> bool:
    """Whether a partial plan's backward peak is its start (so it teaches the partial regime)."""
    model = planning.model
    if not model.ready or not model.transient_full.fitted:
        return True
    k = planning.planned_shape(key)
    return model.backward_start_bytes(k, plan) >= model.recompute_bytes(k, plan)


def _parts_transient_saved(planning: Planning, key: tuple[int, int], plan: Plan) -> int:
    """The transient part of what ``plan``'s parts beside the blocks save at ``key`` (NOTE [A chunked head's step in kept terms]).

    # NOTE [A chunked head's step in kept terms]
    The curves describe a step with the LM head kept, and a plan that chunks it takes the head part's
    saving off its peaks (NOTE [Head in the peaks], model.py). That saving has two parts: the kept
    head's saved float32 logits less the chunked head's saved rows, which live from the head's
    forward on (outside the blocks), and the kept head's backward transient less the chunk's work,
    which live at the backward's start (the transient). A step that chunked the head gives each
    curve its own part back: its outside bytes the saved part, its transient the transient part, so
    the partial transient learns long shapes, which only ever chunk, as keep-head steps would have
    taught it. Given all to the outside bytes (warm-up chunks the head), the outside curve held the
    kept head's transient and the partial transient held it again: keep-head steps were predicted a
    kept head's transient too high (14% of the cap on the llm suite's model) until a bucket
    correction took it off, and long partial plans, which no step taught a partial transient, took
    the full regime's, 3% of the cap too much (docs/devlog.md).
    """
    tokens = key[0] * key[1]
    return int(sum(planning.parts[kind].transient_saved_bytes(tokens, (name, param))
                   for kind, name, param in plan.parts if kind in planning.parts))


def learn_step(planning: Planning, outcome: StepOutcome, predicted: int | None, planning_key: tuple[int, int]) -> ModelUpdate:
    """What a finished step teaches the memory model (NOTE [What a step teaches]).

    Args:
        planning: the run's planning (read only: it applies the update).
        outcome: the step.
        predicted: the peak predicted for it before learning, or None.
        planning_key: the shape whose plan the step ran (``static``: the largest one); a step
            at another shape, over-predicted, says nothing of that plan.
    """
    model = planning.model
    key, by_block, evicted = outcome.key, outcome.by_block, outcome.evicted
    words = model.key_check.note(key, outcome.block_keys)  # NOTE [What the key cannot see] (shapes.py)
    if words is not None:
        logger.warning(words)
    if not outcome.counted:  # only its peaks are known: the method counts the bucket's next step if they erred
        return ModelUpdate(seen_key=key)
    miss = None if predicted is None else outcome.plain_peak - predicted
    planned = set(outcome.plan.blocks)
    names = outcome.plan.treatments(len(model.groups))
    # a chunked head's saving added back, its saved part to the outside bytes and its transient part to
    # the transient: the curves describe the step with the head kept (NOTE [A chunked head's step in kept terms])
    parts_saved = model.parts_saved_bytes(key, outcome.plan)
    parts_transient = _parts_transient_saved(planning, key, outcome.plan) if parts_saved else 0
    curves: list[tuple] = [(("outside",), model.outside, outcome.outside + parts_saved - parts_transient)]
    # NOTE [The parts' moment], model.py: the parts' moment in kept terms, the rest less the parts' saved bytes
    rest_terms = parts_transient if not model.parts_apart else parts_transient - parts_saved
    if model.parts_apart and outcome.parts_transient is not None and not evicted:
        curves.append((("transient_parts",), model.transient_parts, outcome.parts_transient + parts_transient))
    treated_parts = bool(parts_saved) and not outcome.warmup  # NOTE [A chunked head's step teaches less]
    for group_id, group in model.group_models.items():
        members = [i for i, g in enumerate(model.groups) if g == group_id]
        for name in dict.fromkeys(names[i] for i in members):  # each treatment's curve learns its blocks' bytes
            value = max(by_block[i] for i in members if names[i] == name)
            curves.append((("bytes", group_id, name), group.bytes.get(name), value))
    # a step whose parts' moment was not read apart teaches the rest its whole transient: at least the rest's
    transient_path, transient = None, outcome.transient
    if transient is not None and not evicted:  # an evicting step's transient was lowered by its evictions
        if len(planned) == len(model.groups) and not outcome.plan.kinds:
            transient_path = ("transient_full",)
        elif outcome.start_transient is not None:  # NOTE [Reading the backward's start]
            transient_path, transient = ("transient_partial",), outcome.start_transient
        elif _backward_start_dominates(planning, key, outcome.plan):
            transient_path = ("transient_partial",)
        if transient_path is not None:
            curves.append((transient_path, getattr(model, transient_path[0]), transient + rest_terms))
        gap = model.rerun_gap(key, outcome.plan) if outcome.plan.kinds and len(planned) == len(model.groups) else None
        if gap is not None:  # NOTE [Full terms of a re-run step], model.py
            curves.append((("transient_full",), model.transient_full, outcome.transient + rest_terms + gap))
    step_under = bool(evicted) or (miss is not None and miss > _teaching_margin(planning) / 4)
    b = planning.bucket_tokens
    may_over = (
        miss is not None and planning.budget_bytes is not None and -miss > 0.01 * planning.budget_bytes
        and bucket_key(planning_key, b) == bucket_key(key, b)
    )
    # asked once, and only where a curve would learn from it: the search it may run is a plan's (or two)
    step_over = functools.cache(lambda: would_plan_less(planning, key, outcome.plan, -miss))
    samples = []
    for path, curve, observed in curves:
        if outcome.warmup or curve is None or not curve.fitted:
            samples.append((path, key, observed))
            continue
        predicted_value = curve(key)
        under = step_under and observed > predicted_value + 0.005 * abs(observed)
        over = may_over and observed < predicted_value - 0.005 * abs(observed) and not curve.has(key) and step_over()
        learn = under or over
        if path == ("outside",) and treated_parts:
            # NOTE [A chunked head's step teaches less]
            # A steady step that chunked the head did not run the step the curves describe (the
            # head kept). Its outside bytes hold the head part's estimate of the kept logits, not a
            # reading, so it may lower the outside curve but not raise it; steps that keep the head
            # raise it from readings. Taught whole, an over-estimate moved the curves for every
            # shape: each later step was predicted 2-5 GB above its peak and recomputed blocks it
            # could keep (docs/devlog.md). Its blocks' bytes and its transient (in kept terms: NOTE
            # [A chunked head's step in kept terms]) it teaches as any step does.
            learn = over
        if path == ("transient_partial",) and path == transient_path:
            learn = learn or (not curve.has(key) and curve.distinct_keys < 8)
            # a partial step beyond the partial curve's range extends it (NOTE [Two transient
            # regimes]); one that treated nothing is left out: its transient matters only once
            # a shape that long needs a plan, and it then teaches the curve itself
            learn = learn or (bool(planned) and not model.partial_covers(key[0] * key[1]))
        if learn:
            samples.append((path, key, observed))
    return ModelUpdate(samples=samples, seen_key=key)


def mispredicted(planning: Planning, outcome: StepOutcome, predicted: int | None) -> bool:
    """Whether a steady step peaked above its prediction by more than a quarter of the margin,
    or below it by more than 1% of the budget (what makes a step teach: NOTE [What a step teaches])."""
    if predicted is None or outcome.warmup:
        return False
    miss = outcome.plain_peak - predicted
    return miss > _teaching_margin(planning) / 4 or (planning.budget_bytes is not None and -miss > 0.01 * planning.budget_bytes)


def _teaching_margin(planning: Planning) -> int:
    """The margin whose quarter a miss must pass to teach: the margin, never below the one the run
    started with (NOTE [The margin follows the misses], room.py: noise must not move the curves)."""
    return max(planning.margin_bytes, planning.room.start_margin_bytes)


def grow_margin(planning: Planning, outcome: StepOutcome, predicted: int | None) -> ModelUpdate:
    """A steady step above its prediction: the miss the room's margin rule reads (NOTE [Room], room.py)."""
    if predicted is None or outcome.warmup:
        return ModelUpdate()
    return ModelUpdate(miss_bytes=outcome.plain_peak - predicted)


def grow_slack(planning: Planning, outcome: StepOutcome) -> ModelUpdate:
    """A steady step, with or without allocations the caching allocator served only after
    releasing its cache: what the room's slack rules read (NOTE [The slack is priced], room.py); and
    any step's reading of other streams' pools (NOTE [Other streams' pools], room.py)."""
    if outcome.warmup:
        return ModelUpdate(pool_bytes=outcome.pool_bytes)
    return ModelUpdate(alloc_retries=outcome.alloc_retries > 0, steady_key=outcome.key, net_ms=outcome.net_ms,
                       pool_bytes=outcome.pool_bytes, timed_key=outcome.timed_key)


def note_bias(planning: Planning, outcome: StepOutcome, predicted: int | None) -> ModelUpdate:
    """A steady step that ran its plan whole: its prediction's error, for its bucket's bias
    (NOTE [Bias per bucket], planning.py). The caller leaves out a step that changed the curves."""
    if predicted is None or outcome.warmup or outcome.evicted:
        return ModelUpdate()
    error = float(predicted - outcome.plain_peak)
    # NOTE [A chunked head's step corrects its bucket]
    # A step that chunked the head is in its bucket's bias like any other: its plan (the head's
    # treatment in it) is one of the bucket's plans, whose least bias is the correction. Left out,
    # no bucket was ever corrected once the head's price chose to chunk every step (a fused kernel
    # faster than keeping it): a bias only the curves could then take off (docs/devlog.md).
    return ModelUpdate(error=(outcome.key, outcome.plan, error), run_error=(outcome.key, error))


def learn_probes(
    planning: Planning, key: tuple[int, int], probes: dict[int, tuple[int, float | None]],
    treated: dict[int, dict[str, tuple[int, float | None]]] | None = None,
) -> ModelUpdate:
    """Split groups whose members' probes saved different bytes, then give each group its
    first member's probe (bytes; the time of the group's timed member).

    # NOTE [Blocks alike only in name]
    Blocks of one class and parameter count share a group (one memory and cost model), but
    such blocks need not save the same bytes: Swin's shifted-window layers add the shift mask
    to the attention bias, which a CUDA attention kernel keeps for backward, where the
    unshifted layers keep none. Planned as their group's first member, such a block is
    under-predicted and a plan that keeps it runs out of memory. So warm-up probes every block
    (the first of each group timed, the others once, for their bytes), and a group whose
    members saved more than ``GROUP_SPLIT_SHARE`` apart is split before its samples are
    added: each kind of member gets its own group (a copy of the group's curves from earlier
    steps, where its members were measured alike) with its first member's bytes, and the
    group's timed price, as blocks of one class and size cost about the same.

    Args:
        planning: the run's planning.
        key: the step's shape key.
        probes: block index -> (saved bytes, forward ms or None when untimed).
        treated: block index -> per treatment (bytes kept on the device, ms or None): the
            group's ``selective`` and ``offload`` curves (engine/parts/probe.py).
    """
    model = planning.model
    before, groups = list(model.groups), list(model.groups)
    next_id = max(groups) + 1
    timed_ms: dict[int, float] = {}  # per group before the split: its first member's time
    kinds: dict[int, list[tuple[int, int]]] = {}  # per group before the split: (bytes, new id)
    for i in sorted(probes):
        nbytes, ms = probes[i]
        g = model.groups[i]
        if ms is not None:
            timed_ms[g] = ms
        same = kinds.setdefault(g, [])
        match = next((gid for ref, gid in same if abs(nbytes - ref) <= GROUP_SPLIT_SHARE * max(nbytes, ref)), None)
        if match is None:  # a new kind: the group's first keeps its id, a later one gets a new id
            if same:
                match, next_id = next_id, next_id + 1
            else:
                match = g
            same.append((nbytes, match))
        groups[i] = match
    if groups != before:
        changed = sorted({g for g in groups if groups.count(g) != before.count(g)})
        logger.debug(  # a diagnostic (NOTE [Quiet until asked], cli/said.py): the plans take it in
            "memfit: blocks of one class and size saved different bytes at shape key %s; planned apart now: %s",
            key, "; ".join(str([i for i, x in enumerate(groups) if x == g]) for g in changed),
        )
    samples: list[tuple[tuple, tuple[int, int], float]] = []
    seen: set[int] = set()
    for i in sorted(probes):
        g = groups[i]
        if g in seen:
            continue
        seen.add(g)
        nbytes, ms = probes[i]
        samples.append((("bytes", g, "keep"), key, nbytes))
        samples.append((("ms", g, "recompute"), key, ms if ms is not None else timed_ms[before[i]]))
        source = i if treated and i in treated else next((j for j in sorted(treated or {}) if before[j] == before[i]), None)
        for name, (kept, name_ms) in (treated or {}).get(source, {}).items():
            samples.append((("bytes", g, name), key, kept))
            if name_ms is not None:  # priced by its own measured time (else by the link)
                samples.append((("ms", g, name), key, name_ms))
    return ModelUpdate(groups=groups if groups != before else None, samples=samples)


def would_plan_less(planning: "Planning", key: tuple[int, int], plan: Plan, over_bytes: int) -> bool:
    """Whether a prediction ``over_bytes`` lower would have given a cheaper plan than ``plan``.

    An over-predicted step costs time only if it made the plan treat more: one that
    treated nothing, or whose cheaper alternative still needs the same blocks (the
    over-prediction was smaller than what one block saves), cost nothing. Recompute alone
    answers first; a run that offers other treatments or parts beside the blocks asks its
    search too, with every one of them: a step on the floor (every block on the host and
    tiled), where recompute alone fits nothing, is the step whose over-prediction costs most.
    """
    blocks = plan.blocks
    if not blocks or planning.budget_bytes is None:
        return False
    k = planning.planned_shape(key)
    need = int(planning.static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - planning.room_bytes - over_bytes
    if need <= 0:
        return True
    costs = planning.model.costs(k)
    try:
        if plan_blocks(costs, planning.model.savings(k), need).cost_ms < 0.999 * sum(costs[i] for i in blocks):
            return True
    except InfeasiblePlanError:
        pass
    if planning.recompute_only and not planning.parts:
        return False
    return planning.search.cost_with_room(k, over_bytes) < 0.999 * planning.search.cost_with_room(k)
