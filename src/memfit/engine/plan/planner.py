"""The planner: which blocks to checkpoint so that enough bytes are saved, at least cost.

Pure functions and a small cache; nothing here touches ``torch.cuda`` (habit 4).

Problem: blocks ``i`` with recompute cost ``c_i`` (ms) and savings ``s_i`` (bytes freed by
checkpointing block ``i``); find the set ``P`` minimising ``sum(c_i for i in P)`` subject to
``sum(s_i for i in P) >= need``. This is a min-cost covering knapsack:

* homogeneous stacks (all ``c_i`` equal and all ``s_i`` equal — the common case, a stack of
  identical transformer layers) are solved exactly in O(1): the first ``ceil(need/s)`` blocks;
* mixed stacks exactly by enumerating how many blocks to take from each class of identical
  blocks (Swin's four stages, T5's encoder and decoder), taking the earliest blocks within a
  class (NOTE [Enumerating classes]);
* only when that enumeration would be too large, by a dynamic programme over quantised
  bytes whose table is ``parts x (resolution + 1)`` whatever the need (NOTE [A bounded planner]).

# NOTE [Enumerating classes]
For a fixed count from every class but one, the cheapest count of that last class is the
fewest that covers what is still needed (every cost is positive): one division, not a loop.
So only the other classes are enumerated, as one numpy grid, and the class with the most
members is the one solved by division (a Swin-B detector's classes of 2, 2, 18, 2, 6 and 6
blocks: 1,323 combinations scored at once instead of 25,137 one by one). The grid's products
run in float64 through BLAS (integer matrix products do not), into buffers kept with the grid
(a new array per operation costs page faults on every call). Counts, savings and needs are
integers below 2**53, so every sum is exact in float64 and so is the ceiling of a quotient (a
fraction of at least 1/saving cannot round away); beyond 2**53 bytes the DP plans. The costs'
products are those of the integer grid converted to float64: the same plans, tie for tie, as
integer arithmetic (tested against brute force).

# NOTE [Earliest blocks first]
Among plans of equal cost the planner prefers lower block indices. A checkpointed block is
recomputed when backward reaches it; the first blocks are reached last, when most other
activations have been freed, so recomputing them adds least to the step's peak.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.engine.records import part_label

__all__ = ["Plan", "InfeasiblePlanError", "plan_blocks", "plan_treatments", "plan_with_parts",
           "with_leaner_reruns", "Knapsack", "PlanCache"]


class InfeasiblePlanError(ValueError):
    """Checkpointing every block still does not save enough bytes."""


#: the name of whole-block recompute (memfit.engine.parts.treatments.RECOMPUTE; the planner imports no torch)
_RECOMPUTE = "recompute"


@dataclass(frozen=True, init=False)
class Plan:
    """The treatment of every part for one shape key: which blocks are not kept, and how, and the
    option of each part placed beside the blocks (NOTE [Parts beside the blocks]).

    Attributes:
        blocks: treated (not kept) block indices, ascending.
        cost_ms: estimated extra time of those treatments.
        saved_bytes: estimated bytes the plan saves relative to keeping every block.
        kinds: the treatment of each of ``blocks``, in order; empty when every one is
            ``recompute`` (normalised so, so that equal plans compare equal).
        parts: ``(kind, treatment, param)`` of each part placed beside the blocks (the LM head's
            kind is ``"head"``, its param the chunk count), in the order the planning holds them;
            empty for a plan that places none.

    Example:
        >>> Plan((0, 2)).treatments(3)
        ['recompute', 'keep', 'recompute']
        >>> Plan((0,)).with_option("head", ("chunked", 4)).parts
        (('head', 'chunked', 4),)
    """

    blocks: tuple[int, ...]
    cost_ms: float = 0.0
    saved_bytes: int = 0
    kinds: tuple[str, ...] = ()
    parts: tuple[tuple[str, str, int], ...] = ()

    def __init__(self, blocks: tuple[int, ...], cost_ms: float = 0.0, saved_bytes: int = 0, kinds: tuple[str, ...] = (),
                 parts: Sequence[tuple[str, str, int]] = ()) -> None:
        parts = tuple((str(kind), str(name), int(param)) for kind, name, param in parts)
        if kinds and len(kinds) != len(blocks):
            raise ValueError(f"a plan of {len(blocks)} treated blocks has {len(kinds)} treatment names")
        if kinds and all(k == _RECOMPUTE for k in kinds):
            kinds = ()
        for name, value in (("blocks", tuple(blocks)), ("cost_ms", cost_ms), ("saved_bytes", saved_bytes),
                            ("kinds", tuple(kinds)), ("parts", parts)):
            object.__setattr__(self, name, value)

    def option(self, kind: str) -> tuple[str, int] | None:
        """The ``(treatment, param)`` of the part of ``kind`` beside the blocks, None where the plan places none."""
        return next(((name, param) for k, name, param in self.parts if k == kind), None)

    def with_option(self, kind: str, option: tuple[str, int] | None) -> "Plan":
        """The same plan with the part of ``kind`` at ``option`` (in its place, or last where the plan placed none;
        None: not placed)."""
        entry = () if option is None else ((kind, str(option[0]), int(option[1])),)
        at = next((i for i, part in enumerate(self.parts) if part[0] == kind), len(self.parts))
        return dataclasses.replace(self, parts=(*self.parts[:at], *entry, *self.parts[at + 1:]))

    def part_labels(self) -> dict[str, str]:
        """Each placed part's label by kind, as records and plan files write it (``"chunked:8"``)."""
        return {kind: part_label(name, param) for kind, name, param in self.parts}

    def treatments(self, n_blocks: int) -> list[str]:
        """The treatment of every block ``0..n_blocks-1``."""
        out = ["keep"] * n_blocks
        for i, kind in zip(self.blocks, self.kinds or (_RECOMPUTE,) * len(self.blocks)):
            out[i] = kind
        return out

    def by_treatment(self) -> dict[str, list[int]]:
        """The treated blocks grouped by treatment name (what a step record stores)."""
        out: dict[str, list[int]] = {}
        for i, kind in zip(self.blocks, self.kinds or (_RECOMPUTE,) * len(self.blocks)):
            out.setdefault(kind, []).append(i)
        return out

    @classmethod
    def from_treatments(cls, by_treatment: Mapping[str, Sequence[int]], parts: Sequence[tuple[str, str, int]] = ()) -> "Plan":
        """The plan that treats each block as ``by_treatment`` says (the inverse of :meth:`by_treatment`:
        a step record's ``block_treatments`` and its parts give the plan the step ran)."""
        kinds = {i: kind for kind, blocks in by_treatment.items() for i in blocks}
        blocks = tuple(sorted(kinds))
        return cls(blocks, kinds=tuple(kinds[i] for i in blocks), parts=parts)

    @property
    def layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """What the plan does, its estimates aside: two plans with one layout run alike."""
        return self.blocks, self.kinds


def _is_homogeneous(values: Sequence[float], rel_tol: float = 1e-9) -> bool:
    # Blocks of one group get the very same value: an exact count settles it in C.
    if list(values).count(values[0]) == len(values):
        return True
    return all(math.isclose(v, values[0], rel_tol=rel_tol, abs_tol=1e-12) for v in values)


def plan_blocks(
    costs_ms: Sequence[float],
    savings_bytes: Sequence[int],
    need_bytes: int,
    resolution: int = 1024,
) -> Plan:
    """Cheapest set of blocks whose savings reach ``need_bytes``.

    Args:
        costs_ms: recompute cost of each block (any consistent unit; ms by convention).
        savings_bytes: bytes saved by checkpointing each block (negative values count as 0).
        need_bytes: bytes to save; ``<= 0`` means the budget is not binding.
        resolution: DP units for mixed stacks (higher is closer to optimal, slower; NOTE [A
            bounded planner]).

    Returns:
        The :class:`Plan`; empty when nothing needs saving.

    Raises:
        InfeasiblePlanError: if even checkpointing every block saves fewer than ``need_bytes``.

    Example:
        >>> plan_blocks([1.0, 1.0, 1.0], [100, 100, 100], 150).blocks
        (0, 1)
    """
    if len(costs_ms) != len(savings_bytes):
        raise ValueError("costs_ms and savings_bytes must have one entry per block")
    if need_bytes <= 0:
        return Plan(())
    savings = [max(0, int(s)) for s in savings_bytes]
    if sum(savings) < need_bytes:
        raise InfeasiblePlanError(
            f"checkpointing all {len(savings)} blocks saves {sum(savings)} bytes, "
            f"{need_bytes} are needed"
        )
    if _is_homogeneous(costs_ms) and _is_homogeneous(savings):
        k = math.ceil(need_bytes / savings[0])
        chosen = tuple(range(k))
    else:
        chosen = _enumerate_classes(costs_ms, savings, need_bytes)
        if chosen is None:
            options = [[(_RECOMPUTE, s, float(c))] for c, s in zip(costs_ms, savings)]
            chosen = tuple(sorted(_choose_by_dp(options, need_bytes, resolution)))
    return Plan(chosen, float(sum(costs_ms[i] for i in chosen)), int(sum(savings[i] for i in chosen)))


_MAX_COMBINATIONS = 200_000
#: the most combinations of odd blocks' options planned beside one alike group (NOTE [A few odd blocks])
_MAX_ODD_COMBINATIONS = 64


@functools.lru_cache(maxsize=16)
def _count_grid(sizes: tuple[int, ...]) -> np.ndarray:
    """Every combination of counts ``0..n`` per class, one row each (read-only: it is shared).

    A pure function of the class sizes, memoised: a model's classes keep their sizes.
    """
    grid = np.array(list(itertools.product(*(range(n + 1) for n in sizes))), dtype=np.int64).reshape(-1, len(sizes))
    grid.flags.writeable = False
    return grid


@functools.lru_cache(maxsize=16)
def _workspace(sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The count grid as float64 (read-only), and three float64 and one bool buffer of its
    length that :func:`_enumerate_classes` reuses (NOTE [Enumerating classes]; one planner
    per process: not for concurrent threads)."""
    products = _count_grid(sizes).astype(np.float64)
    products.flags.writeable = False
    n = len(products)
    return products, np.empty(n), np.empty(n), np.empty(n), np.empty(n, dtype=bool)


def _enumerate_classes(costs: Sequence[float], savings: Sequence[int], need: int) -> tuple[int, ...] | None:
    """Exact min-cost cover over classes of identical blocks (NOTE [Enumerating classes]).

    Returns None when the grid of the other classes' counts would exceed ``_MAX_COMBINATIONS``.
    """
    classes: dict[tuple[float, int], list[int]] = {}
    for i, pair in enumerate(zip(costs, savings)):
        classes.setdefault(pair, []).append(i)
    members = sorted(classes.values(), key=len)
    last, others = members[-1], members[:-1]
    if math.prod(len(m) + 1 for m in others) > _MAX_COMBINATIONS:
        return None
    if sum(savings) >= 2**53:
        return None  # the float products below are exact below 2**53 bytes only
    sizes = tuple(len(m) for m in others)
    grid = _count_grid(sizes)
    products, last_count, cost, scratch, feasible = _workspace(sizes)
    # short of need after the others' counts, then the last class's count covering it
    np.matmul(products, np.array([savings[m[0]] for m in others], dtype=np.float64), out=last_count)
    np.maximum(np.subtract(need, last_count, out=last_count), 0.0, out=last_count)
    last_saving = savings[last[0]]
    if last_saving > 0:
        np.ceil(np.divide(last_count, last_saving, out=last_count), out=last_count)
    else:
        last_count[:] = np.where(last_count > 0, len(last) + 1, 0)
    np.less_equal(last_count, len(last), out=feasible)
    if not feasible.any():
        return None
    np.matmul(products, np.array([costs[m[0]] for m in others], dtype=np.float64), out=cost)
    np.add(cost, np.multiply(last_count, costs[last[0]], out=scratch), out=cost)
    np.copyto(cost, np.inf, where=np.logical_not(feasible, out=feasible))
    best_cost = cost.min()
    ties = np.flatnonzero(cost <= best_cost + 1e-12 * max(1.0, abs(best_cost)))

    def chosen(row: int) -> tuple[int, ...]:
        counts = list(grid[row]) + [int(last_count[row])]
        return tuple(sorted(i for m, k in zip(others + [last], counts) for i in m[:k]))

    return min(chosen(r) for r in ties)


def with_leaner_reruns(
    plan: Plan, options: Sequence[Sequence[tuple[str, int, float]]], leaner: Mapping[str, str],
) -> Plan | None:
    """``plan`` with each treated block's treatment swapped for its leaner re-run (``leaner``: a
    treatment's name -> the one that keeps as it does at the backward's start, NOTE [Leaner re-runs]
    in planning.py) where the block's ``options`` price both; its cost moved by their difference,
    its savings unchanged. None when no block swaps.

    Example:
        >>> opts = [[("recompute", 100, 10.0), ("recompute_tiled", 100, 12.0)]] * 2
        >>> with_leaner_reruns(Plan((1,), 10.0, 100), opts, {"recompute": "recompute_tiled"}).treatments(2)
        ['keep', 'recompute_tiled']
    """
    kinds = plan.treatments(len(options))
    cost, swapped = plan.cost_ms, False
    for i in plan.blocks:
        lean = leaner.get(kinds[i])
        prices = {name: ms for name, _, ms in options[i]}
        if lean is not None and lean in prices and kinds[i] in prices:
            cost += prices[lean] - prices[kinds[i]]
            kinds[i], swapped = lean, True
    if not swapped:
        return None
    return Plan(plan.blocks, cost, plan.saved_bytes, kinds=tuple(kinds[i] for i in plan.blocks), parts=plan.parts)


def every_block_rerun(
    options: Sequence[Sequence[tuple[str, int, float]]], reruns: Callable[[str], bool],
) -> tuple[list[tuple[str, int, float]], list[list[tuple[str, int, float]]]] | None:
    """Per block its cheapest option that ``reruns`` (the base), and the other re-runs that save more as steps up
    from it, ``(name, bytes more, ms more)``; None where a block has no re-run.

    # NOTE [Every block re-run]
    The knapsack covers a need in bytes, which assumes the step's peak falls by what the treatments save. A plan
    that re-runs every block breaks that: its backward reads the full regime's transient, not the partial one
    (NOTE [Two transient regimes], model.py), which may be lower by gigabytes, so such a plan can fit where the
    cheapest mix that saves more does not (an 8B LoRA at 16k tokens under 24.7 GB: 29 host checkpoints and three
    recomputed blocks fit at 829 ms; the cheapest mixes with kept blocks fit at 957). No need in bytes
    finds that regime, so the search also plans it as its own stack: every block at its base, and the knapsack
    choosing which blocks step up (:func:`on_base` puts the bases back).

    Example:
        >>> opts = [[("recompute", 100, 10.0), ("host", 120, 12.0), ("lean", 30, 1.0)]] * 2
        >>> every_block_rerun(opts, lambda name: name != "lean")[1][0]
        [('host', 20, 2.0)]
    """
    bases, steps = [], []
    for opts in options:
        rerun = [o for o in opts if reruns(o[0])]
        if not rerun:
            return None
        base = min(rerun, key=lambda o: (o[2], -o[1]))
        bases.append(base)
        steps.append([(o[0], o[1] - base[1], o[2] - base[2]) for o in rerun if o[1] > base[1]])
    return bases, steps


def on_base(plan: Plan, bases: Sequence[tuple[str, int, float]]) -> Plan:
    """``plan`` of the steps up (:func:`every_block_rerun`) with every other block at its base: each block treated."""
    names = [base[0] if name == "keep" else name for name, base in zip(plan.treatments(len(bases)), bases)]
    return Plan(tuple(range(len(bases))), plan.cost_ms + float(sum(b[2] for b in bases)),
                plan.saved_bytes + int(sum(b[1] for b in bases)), kinds=tuple(names), parts=plan.parts)


#: the most combinations of the parts' options :func:`plan_with_parts` tries (NOTE [Parts beside the blocks])
MAX_PART_COMBINATIONS = 64


def plan_with_parts(
    options: Sequence[Sequence[tuple[str, int, float]]],
    parts: Sequence[tuple[str, Sequence[tuple[str, int, int, float]]]],
    need_bytes: int,
    resolution: int = 1024,
    order: Mapping[str, int] | None = None,
) -> Plan:
    """Cheapest mix of block treatments and one option per part beside the blocks whose savings reach ``need_bytes``.

    # NOTE [Parts beside the blocks]
    A part beside the blocks (the LM head; a part kind given to ``fit(parts=...)``,
    memfit.engine.parts.kind) offers options ``(treatment, param, bytes saved, ms)``, the first
    untreated. Each combination of one option per part is tried with the blocks' cheapest plan
    for what is still needed, and the cheapest sum wins; ties go to the earlier combination
    (every part's earlier options first). They are tried cheapest *bound* first: the
    combination's ms plus the least the blocks can cost for what is still needed when a block may
    take a share of two options (``Knapsack.lower_bound``: each block's options on their lower
    convex hull, the hulls' steps cheapest per byte first), which no plan of the blocks costs
    less than; once a bound is above the best sum found, no later combination can win and none
    is planned. The plan is the one trying all would give, for a fifth to a third of the blocks'
    plans (a programme planned for each of a head's 7 options made a decision about 4% of an 8B shape's
    step: docs/devlog.md). The combinations are bounded by
    :data:`MAX_PART_COMBINATIONS`: past it, options another option of the same part dominates
    (saves no more, costs no less) are dropped, then each part keeps its untreated option and
    those that save most, so a plan's time stays bounded whatever the parts offer. The head
    alone offers fewer, and is planned over all of its options (NOTE [The head in the plan],
    treatments/chunked_head.py).

    Args:
        options: per block, ``(treatment, bytes saved, ms)`` as :func:`plan_treatments` takes them.
        parts: per part, its kind and its options, bytes and ms relative to its untreated option.
        need_bytes: bytes to save relative to keeping every part; ``<= 0`` keeps every part.
        resolution: DP units for stacks of unlike blocks.
        order: as :func:`plan_treatments`.

    Returns:
        The :class:`Plan`, its ``parts`` naming each part's option (none without parts).

    Raises:
        InfeasiblePlanError: when no combination with every block treated saves enough; the
            message names the most each part's treatments save.

    Example:
        >>> blocks = [[("recompute", 100, 10.0)]] * 2
        >>> norm = [("keep", 1, 0, 0.0), ("squeezed", 1, 80, 1.0)]
        >>> plan_with_parts(blocks, [("norm", norm)], 150).parts
        (('norm', 'squeezed', 1),)
    """
    return Knapsack(options, resolution, order).with_parts(parts, need_bytes)


def _bounded_options(per_part: list[tuple[tuple, ...]]) -> list[tuple[tuple, ...]]:
    """Each part's options, fewer where their combinations pass :data:`MAX_PART_COMBINATIONS` (NOTE [Parts beside the blocks])."""
    if math.prod(len(opts) for opts in per_part) <= MAX_PART_COMBINATIONS:
        return per_part
    kept = []
    for opts in per_part:
        rest = [o for o in opts[1:] if not any(p is not o and p[2] >= o[2] and p[3] <= o[3] and (p[2], p[3]) != (o[2], o[3])
                                               for p in opts)]
        kept.append((opts[0], *rest))
    each = max(2, int(MAX_PART_COMBINATIONS ** (1 / len(kept))))
    return [(opts[0], *sorted(opts[1:], key=lambda o: -o[2])[: each - 1]) for opts in kept]


def plan_treatments(
    options: Sequence[Sequence[tuple[str, int, float]]], need_bytes: int, resolution: int = 1024,
    order: Mapping[str, int] | None = None,
) -> Plan:
    """Cheapest treatment per block whose savings reach ``need_bytes`` (keep is free and saves nothing).

    # NOTE [Choosing treatments]
    A multiple-choice covering knapsack: each block takes one of its options (or stays
    kept). For a stack whose blocks all have the same options it is exact: every count of
    blocks per treatment is scored at once (numpy) and the cheapest that covers the need is
    placed in ``order`` from the first block up (each treatment declares its place,
    ``Treatment.order``: recomputed blocks first, nothing held below them, NOTE [Earliest
    blocks first]; offloaded ones last, furthest from the backward's start, so the prefetch
    has time); ties go to fewer treated
    blocks. A stack too large to score every count (28 blocks and 9 treatments: 124 million
    counts) first drops the options another beats (saves as much for no more time), which no
    cheapest plan needs; the rest are scored where they can be (4 of them: 36 thousand counts). Where
    they are too many, every count of all but the last option is scored, that one's count the fewest that cover
    the need (every block left where it is priced below keep): as exact as scoring every count, for given other
    counts fewer of it do not cover and more cost no less and treat more blocks (32 blocks and 5 options: 59
    thousand counts for 436 thousand). Else the dynamic programme chooses the counts, placed alike. A few odd
    blocks beside one alike group are planned exactly too (NOTE [A few odd blocks]). Otherwise
    the dynamic programme of NOTE [A bounded planner]: savings never below ``need``, bounded in time and memory
    whatever the need.

    Args:
        options: per block, ``(treatment, bytes saved, ms)`` of each treatment it may take.
        need_bytes: bytes to save; ``<= 0`` keeps every block.
        resolution: DP units for stacks of unlike blocks.
        order: per treatment name, its place from the first block up (lower first; an
            unnamed one last); default: the order of the options.

    Returns:
        The :class:`Plan`, its ``kinds`` naming each treated block's treatment.

    Raises:
        InfeasiblePlanError: when the best option of every block together saves too little.

    Example:
        >>> opts = [[("recompute", 100, 10.0), ("selective", 60, 2.0)]] * 3
        >>> plan_treatments(opts, 150).treatments(3)
        ['selective', 'selective', 'selective']
    """
    return Knapsack(options, resolution, order).plan(need_bytes)


class Knapsack:
    """One stack's options, read once and planned for any need (:func:`plan_treatments`), with the parts beside the
    blocks too (:func:`plan_with_parts`: once for each combination of the parts' options). A caller that plans one
    stack for several needs (the search's asks: NOTE [Planning with the stashes back], search.py) makes one.

    Args:
        options: per block, ``(treatment, bytes saved, ms)`` of each treatment it may take.
        resolution: DP units for stacks of unlike blocks (NOTE [A bounded planner]).
        order: per treatment name, its place from the first block up (:func:`plan_treatments`).
    """

    def __init__(self, options: Sequence[Sequence[tuple[str, int, float]]], resolution: int = 1024,
                 order: Mapping[str, int] | None = None):
        self.options, self.resolution, self.order = tuple(map(tuple, options)), resolution, order or {}
        options = self.options
        first = options[0] if options else ()
        self.alike = first if all(opts == first for opts in options) else None
        #: unlike blocks that are a few beside one alike group: (that group's blocks, its Knapsack, the others' blocks
        #: and their combinations) (NOTE [A few odd blocks]); None where the dynamic programme plans
        self._odd: tuple | None = None if self.alike is not None else self._few_odd()
        if self.alike is not None:  # alike blocks: one block's reading, repeated (the same sums, term by term)
            self.best_each = sum(itertools.repeat(max((o[1] for o in first), default=0), len(options)))
            self.by_name = [{o[0]: o for o in reversed(first)}] * len(options)
        else:
            self.best_each = sum(max((o[1] for o in opts), default=0) for opts in options)
            self.by_name = [{o[0]: o for o in reversed(opts)} for opts in options]  # a name's first option, as next() read it
        #: the alike stack's options it is chosen over and their counts scored (() where too many to score), found once
        self._scored: tuple | None = None
        self._scored_opts = self.alike
        #: the fractional relaxation's steps, cumulative (saved, ms) from (0, 0), and the bytes its steps of negative
        #: cost save, found once (:meth:`lower_bound`)
        self._steps: tuple[list[float], list[float], float] | None = None
        #: the parts :meth:`with_parts` was last given (frozen) and their combinations
        self._combos: tuple[list, list] | None = None

    def lower_bound(self, need_bytes: int) -> float:
        """No plan of this stack saving ``need_bytes`` costs less (NOTE [Parts beside the blocks]): the relaxation that
        lets a block take a share of two options, each block's options on their lower convex hull from keep, the
        hulls' steps taken cheapest per byte first (inf where every block treated saves too little)."""
        if need_bytes <= 0:
            return 0.0
        if need_bytes > self.best_each:
            return math.inf
        if self._steps is None:
            hulls: dict[tuple, list[tuple[float, float]]] = {}  # alike blocks: one hull
            for opts in self.options:
                if opts not in hulls:
                    hulls[opts] = _hull_steps(opts)
            steps = sorted(step for opts in self.options for step in hulls[opts])
            # plain floats, summed in order (numpy's cumulative sums would add them alike, at a call's cost each)
            saved = list(itertools.accumulate((step[1] for step in steps), initial=0.0))
            # steps that cost less than nothing (an option priced faster than keep) are taken whatever the need
            self._steps = saved, list(itertools.accumulate((step[1] * step[0] for step in steps), initial=0.0)), \
                saved[sum(step[0] < 0 for step in steps)]
        saved, ms, free = self._steps
        need = float(max(need_bytes, free))
        i = min(bisect.bisect_left(saved, need), len(saved) - 1)
        if saved[i] <= saved[i - 1]:
            return ms[i]
        return ms[i - 1] + (need - saved[i - 1]) * (ms[i] - ms[i - 1]) / (saved[i] - saved[i - 1])

    def plan(self, need_bytes: int) -> Plan:
        options = self.options
        if need_bytes <= 0:
            return Plan(())
        if self.best_each < need_bytes:
            raise InfeasiblePlanError(f"treating all {len(options)} blocks saves {self.best_each} bytes, {need_bytes} are needed")
        if self._odd is not None:
            chosen = self._plan_odd(need_bytes)
        elif self.alike is not None:
            if self._scored is None:
                self._scored = _scored(self.alike, len(options), last_apart=False) or ()
                if not self._scored:  # too many counts to score: the options no other beats first (NOTE [Choosing treatments])
                    self._scored_opts = _frontier(self.alike)
                    self._scored = _scored(self._scored_opts, len(options)) or ()
            chosen = _alike(self._scored_opts, len(options), need_bytes, self.order, self.resolution, self._scored or None)
        else:
            chosen = _choose_by_dp(options, need_bytes, self.resolution)
        blocks = tuple(sorted(chosen))
        costs = {i: self.by_name[i][chosen[i]] for i in blocks}
        return Plan(
            blocks, float(sum(costs[i][2] for i in blocks)), int(sum(costs[i][1] for i in blocks)),
            kinds=tuple(chosen[i] for i in blocks),
        )

    def _few_odd(self) -> tuple | None:
        """The largest alike group's blocks, its own Knapsack, the other blocks, and every combination of their
        options (keep first) as ``(ms, saved, treated, place, picks)``; None where those are more than
        ``_MAX_ODD_COMBINATIONS`` or the group holds under half of the blocks.

        # NOTE [A few odd blocks]
        A stack is often one alike group but for a block or two: under LoRA the first block's input (the frozen
        embeddings' output) needs no gradient, so it keeps less than the others and is planned apart. The dynamic
        programme would plan every such stack, quantised, at every ask (32 blocks of 7 options: 2.5 ms each, most of an
        8B LoRA decision). Planned as the few odd blocks' combinations beside the group, each combination's rest
        chosen exactly by the group (NOTE [Choosing treatments]), cheapest bound first (the group's relaxation,
        :meth:`lower_bound`) until no later combination can cost less, the plan is as exact as the group's own choice
        (exact where its counts are scored) and the group's treatments lie in their order. Ties go to fewer treated blocks, then the earlier combination.
        """
        groups: dict[tuple, list[int]] = {}
        for i, opts in enumerate(self.options):
            groups.setdefault(opts, []).append(i)
        opts, alike = max(groups.items(), key=lambda kv: len(kv[1]))
        odd = [i for i in range(len(self.options)) if self.options[i] != opts]
        if 2 * len(alike) < len(self.options) or math.prod(len(self.options[i]) + 1 for i in odd) > _MAX_ODD_COMBINATIONS:
            return None
        choices = [((None, 0, 0.0), *self.options[i]) for i in odd]
        combos = [(sum(float(o[2]) for o in picks), sum(int(o[1]) for o in picks), sum(o[0] is not None for o in picks), at,
                   picks) for at, picks in enumerate(itertools.product(*choices))]
        return alike, Knapsack([opts] * len(alike), self.resolution, self.order), odd, combos

    def _plan_odd(self, need_bytes: int) -> dict[int, str]:
        """The cheapest choice for a few odd blocks beside one alike group (NOTE [A few odd blocks])."""
        alike, group, odd, combos = self._odd
        best: tuple | None = None  # (ms, treated, place, group's plan, picks)
        for bound, ms, saved, treated, at, picks in sorted((ms + group.lower_bound(need_bytes - saved), ms, saved, treated,
                                                            at, picks) for ms, saved, treated, at, picks in combos):
            if best is not None and bound > best[0] + 1e-9 * max(1.0, abs(best[0])):
                break  # this one and every later one cost more than the best found, whatever the group's plan
            try:
                sub = group.plan(need_bytes - saved)
            except InfeasiblePlanError:
                continue
            key = (ms + sub.cost_ms, treated + len(sub.blocks), at)
            if best is None or key[0] < best[0] - 1e-12 * max(1.0, abs(best[0])) or (
                    key[0] <= best[0] + 1e-12 * max(1.0, abs(best[0])) and key[1:] < best[1:3]):
                best = (*key, sub, picks)
        if best is None:
            raise InfeasiblePlanError(f"treating all {len(self.options)} blocks saves {self.best_each} bytes, "
                                      f"{need_bytes} are needed")
        names = best[3].treatments(len(alike))  # a plan of recomputes alone names none (Plan.kinds)
        chosen = {alike[j]: names[j] for j in best[3].blocks}
        chosen.update((i, o[0]) for i, o in zip(odd, best[4]) if o[0] is not None)
        return chosen

    def with_parts(self, parts: Sequence[tuple[str, Sequence[tuple[str, int, int, float]]]], need_bytes: int) -> Plan:
        """The cheapest mix of this stack's treatments and one option per part beside the blocks (:func:`plan_with_parts`)."""
        parts = [(kind, tuple(tuple(o) for o in opts)) for kind, opts in parts if opts]
        if self._combos is None or parts != self._combos[0]:  # the parts' combinations, kept for the next need
            self._combos = parts, [(sum(float(o[3]) for o in combo), sum(int(o[2]) for o in combo), at, combo)
                                   for at, combo in enumerate(itertools.product(*_bounded_options([o for _, o in parts])))]
        combos = self._combos[1]
        if not parts:
            return self.plan(need_bytes)
        best: tuple[float, int, Plan] | None = None  # (ms, the combination's place, plan): ties go to the earlier one
        bounded = sorted(((ms + self.lower_bound(need_bytes - saved), at), ms, saved, combo) for ms, saved, at, combo in combos)
        for (bound, at), ms, saved, combo in bounded:
            if best is not None and bound > best[0] + 1e-9 * max(1.0, abs(best[0])):
                break  # this one and every later one cost more than the best found, whatever the blocks' plan
            try:
                blocks = self.plan(need_bytes - saved)
            except InfeasiblePlanError:
                continue
            total = blocks.cost_ms + ms
            if best is None or (total, at) < best[:2]:
                placed = tuple((kind, str(o[0]), int(o[1])) for (kind, _), o in zip(parts, combo))
                best = (total, at, Plan(blocks.blocks, total, blocks.saved_bytes + saved, kinds=blocks.kinds, parts=placed))
        if best is None:
            blocks_most = sum(max((o[1] for o in opts), default=0) for opts in self.options)
            parts_most = ", ".join(f"the {kind}'s treatments at most {max(int(o[2]) for o in opts)} bytes" for kind, opts in parts)
            raise InfeasiblePlanError(f"treating all {len(self.options)} blocks saves {blocks_most} bytes and {parts_most}, "
                                      f"{need_bytes} are needed")
        return best[2]


def _hull_steps(opts: Sequence[tuple[str, int, float]]) -> list[tuple[float, float]]:
    """One block's options as steps ``(ms per byte, bytes)`` along their lower convex hull from keep ``(0, 0)`` to the
    most-saving option, each step dearer per byte than the one before."""
    hull = [(0.0, 0.0)]
    for saved, ms in sorted({(float(o[1]), float(o[2])) for o in opts if o[1] > 0}):
        if ms >= hull[-1][1] and saved == hull[-1][0]:
            continue
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (saved - hull[-2][0]) >= (ms - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        if saved == hull[-1][0]:
            hull.pop()
        hull.append((saved, ms))
    return [((b[1] - a[1]) / (b[0] - a[0]), b[0] - a[0]) for a, b in zip(hull, hull[1:])]


@functools.lru_cache(maxsize=16)
def _counts(m: int, t: int) -> np.ndarray:
    """Every way to give ``t`` treatments to at most ``m`` blocks: rows of counts (read-only).

    Built a column at a time (never the ``(m + 1) ** t`` product filtered down); the caller
    bounds the row count, ``comb(m + t, t)``, by ``_MAX_COMBINATIONS``.
    """
    rows = np.zeros((1, 0), dtype=np.int64)  # counts so far, and what each row has left
    left = np.array([m], dtype=np.int64)
    for _ in range(t):
        reps = left + 1
        base = np.repeat(rows, reps, axis=0)
        starts = np.repeat(np.cumsum(reps) - reps, reps)
        take = np.arange(len(base)) - starts
        rows = np.column_stack([base, take])
        left = np.repeat(left, reps) - take
    grid = rows.astype(np.float64)
    grid.flags.writeable = False
    return grid


def _scored(opts: tuple[tuple[str, int, float], ...], m: int, last_apart: bool = True) -> tuple | None:
    """Every count of ``m`` alike blocks per treatment, with what each saves and costs: ``(grid, saved, cost, last)``,
    ``last`` None (NOTE [Choosing treatments]). Where those are too many to score and ``last_apart``, the counts of
    every option but the last, ``last`` that option's ``(bytes, ms, blocks left)``: its count follows from the need
    (:func:`_alike`). None where even those are too many (the dynamic programme chooses then)."""
    k = len(opts)
    if math.comb(m + k, k) <= _MAX_COMBINATIONS:
        grid = _counts(m, k)
        return grid, grid @ np.array([o[1] for o in opts], dtype=np.float64), grid @ np.array([o[2] for o in opts], dtype=np.float64), None
    if not last_apart or k < 2 or math.comb(m + k - 1, k - 1) > _MAX_COMBINATIONS:
        return None
    grid, scored = _counts(m, k - 1), opts[:-1]
    # whole bytes, exact in float64 below 2**53, and so is the ceiling of their quotient (NOTE [Enumerating classes])
    saved = grid @ np.array([o[1] for o in scored], dtype=np.float64)
    left = m - grid @ np.ones(k - 1)  # a matvec: sum(axis=1) took 6x as long
    # the last option's count and the rows' costs with it are worked in these buffers: a new array per operation
    # cost page faults on every call (NOTE [Enumerating classes])
    last = (int(opts[-1][1]), float(opts[-1][2]), left, np.empty(len(grid)), np.empty(len(grid)), np.empty(len(grid), dtype=bool))
    return grid, saved, grid @ np.array([o[2] for o in scored], dtype=np.float64), last


def _frontier(opts: tuple[tuple[str, int, float], ...]) -> tuple[tuple[str, int, float], ...]:
    """``opts`` less those that save nothing and those another option beats: saves at least as much for at most the
    cost (of two equal options, the first stays). No cheapest plan needs one of them (NOTE [Choosing treatments]).

    Example:
        >>> _frontier((("a", 10, 5.0), ("b", 12, 5.0), ("c", 4, 1.0), ("d", 4, 2.0), ("e", 0, 0.0), ("f", 12, 5.0)))
        (('b', 12, 5.0), ('c', 4, 1.0))
    """
    def beaten(j: int, o: tuple[str, int, float]) -> bool:
        return any(k != j and p[1] >= o[1] and p[2] <= o[2] and (p[1] > o[1] or p[2] < o[2] or k < j)
                   for k, p in enumerate(opts))

    return tuple(o for j, o in enumerate(opts) if o[1] > 0 and not beaten(j, o))


def _alike(opts: tuple[tuple[str, int, float], ...], m: int, need: int, order: Mapping[str, int], resolution: int,
           scored: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict[int, str]:
    """The choice for ``m`` blocks with the same options (NOTE [Choosing treatments]): exact
    while every count of blocks per treatment can be scored (``scored``: :func:`_scored`'s, where the caller kept
    it), else the dynamic programme's counts."""
    scored = scored if scored is not None else _scored(opts, m)
    if scored is not None:
        grid, saved, cost, last = scored
        n = None
        if last is not None and last[1] < 0:  # the last option priced below keep: all that are left take it
            n, bytes_last = last[2], last[0]
            cost = np.where(saved + n * bytes_last >= need, cost + n * last[1], np.inf)
        elif last is not None:  # the last option's count: the fewest that cover the need
            bytes_last, ms_last, left, n, total, over = last
            np.maximum(np.ceil(np.divide(np.subtract(need, saved, out=n), bytes_last, out=n), out=n), 0.0, out=n)
            np.add(np.multiply(n, ms_last, out=total), cost, out=total)
            np.copyto(total, np.inf, where=np.greater(n, left, out=over))
            cost = total
        else:
            cost = np.where(saved >= need, cost, np.inf)

        def counts(r: int) -> np.ndarray:
            return grid[r] if n is None else np.append(grid[r], n[r])

        best = cost.min()
        ties = np.flatnonzero(cost <= best + 1e-12 * max(1.0, abs(best)))
        best_row = ties[0] if len(ties) == 1 else min(ties, key=lambda r: (counts(r).sum(), tuple(-counts(r))))
        row = [int(c) for c in counts(best_row)]
    else:
        taken = list(_choose_by_dp([opts] * m, need, resolution).values())
        row = [taken.count(o[0]) for o in opts]
    placed = sorted(range(len(opts)), key=lambda j: (order.get(opts[j][0], math.inf), j))
    chosen, at = {}, 0
    for j in placed:
        for _ in range(row[j]):
            chosen[at] = opts[j][0]
            at += 1
    return chosen


def _choose_by_dp(options: Sequence[Sequence[tuple[str, int, float]]], need: int, resolution: int) -> dict[int, str]:
    """Min-cost multiple-choice cover with a table of ``parts x (resolution + 1)`` (NOTE [A bounded planner]).

    # NOTE [A bounded planner]
    Planning's time and memory are bounded by parts x ``resolution``, whatever the need: a
    table sized in bytes (once the fallback when quantised savings could not reach the need)
    takes the host down at exactly the tight budgets memfit is for. Two forms of one problem,
    each with a table of ``resolution + 1`` columns:

    * *cover*: savings quantised **down** into units of ``need / resolution``; a plan reaching
      the target reaches the need. Fails to prove a cover when the need comes within about one
      unit per part of the most the parts can save.
    * *pack*: what each part leaves unsaved (its most-saving option's bytes minus its choice's)
      quantised **up** into units of ``slack / resolution``, where slack is the most saved minus
      the need; a plan within the slack covers the need, and every part at its most-saving
      option always fits, so it never fails.

    The form with the finer unit runs (cover falling back to pack). What is lost: the plan costs
    at most what the exact optimum costs for a need larger by one unit per part, and the unit
    is ``min(need, slack) / resolution`` (tested against enumeration).
    """
    most = [max((o[1] for o in opts), default=0) for opts in options]
    slack = sum(most) - need
    cover_unit = max(1, -(-need // resolution))
    pack_unit = max(1, -(-slack // resolution))
    if cover_unit <= pack_unit:
        chosen = _cover(options, need, cover_unit)
        if chosen is not None:
            return chosen
    return _pack(options, most, slack, pack_unit)


def _cover(options: Sequence[Sequence[tuple[str, int, float]]], need: int, unit: int) -> dict[int, str] | None:
    """The cover form of NOTE [A bounded planner]; None when the quantised savings cannot reach the need."""
    target = -(-need // unit)
    if sum(max((o[1] // unit for o in opts), default=0) for opts in options) < target:
        return None
    best = np.full(target + 1, np.inf)
    best[0] = 0.0
    picks = []  # per block: the option taken and the units it came from, per units reached
    for opts in options:
        new, pick, pred = best.copy(), np.full(target + 1, -1, dtype=np.int32), np.arange(target + 1, dtype=np.int32)
        for j, (_, saving, cost) in enumerate(opts):
            units = min(saving // unit, target)
            if units <= 0:
                continue
            # below the target each reached units has one source; the target has every source within `units` of it
            candidate = best[: target - units] + cost
            better = candidate < new[units:target] - 1e-12
            new[units:target][better] = candidate[better]
            pick[units:target][better] = j
            pred[units:target][better] = np.flatnonzero(better)
            tail = best[target - units :] + cost
            src = int(np.argmin(tail))
            if tail[src] < new[target] - 1e-12:
                new[target], pick[target], pred[target] = tail[src], j, target - units + src
        picks.append((pick, pred))
        best = new
    return _walk_back(options, picks, target) if np.isfinite(best[target]) else None


def _pack(options: Sequence[Sequence[tuple[str, int, float]]], most: Sequence[int], slack: int, unit: int) -> dict[int, str]:
    """The pack form of NOTE [A bounded planner]: least cost whose quantised unsaved bytes fit the slack."""
    cap = slack // unit
    best = np.full(cap + 1, np.inf)  # least cost leaving exactly u units unsaved
    best[0] = 0.0
    picks = []
    for opts, m in zip(options, most):
        new = np.full(cap + 1, np.inf)
        pick, pred = np.full(cap + 1, -1, dtype=np.int32), np.zeros(cap + 1, dtype=np.int32)
        # keep (-1) first: on a tie the part stays kept
        for j, saving, cost in [(-1, 0, 0.0)] + [(j, o[1], o[2]) for j, o in enumerate(opts) if o[1] > 0]:
            units = -(-(m - saving) // unit)
            if units > cap:
                continue
            candidate = best[: cap + 1 - units] + cost
            better = candidate < new[units:] - 1e-12
            new[units:][better] = candidate[better]
            pick[units:][better] = j
            pred[units:][better] = np.flatnonzero(better)
        picks.append((pick, pred))
        best = new
    return _walk_back(options, picks, int(np.argmin(best)))


def _walk_back(options: Sequence[Sequence[tuple[str, int, float]]], picks: list[tuple[np.ndarray, np.ndarray]], u: int) -> dict[int, str]:
    """The treatment of each part from the table's picks, from the last part back (kept parts left out)."""
    chosen = {}
    for i in range(len(options) - 1, -1, -1):
        pick, pred = picks[i]
        if pick[u] >= 0:
            chosen[i] = options[i][int(pick[u])][0]
        u = int(pred[u])
    return chosen


#: the most plans (and rows) a cache holds: past it the oldest go first (a run of many shapes, static buckets and places
#: of the weights keeps its host memory bounded; a plan dropped is made again if asked)
MAX_CACHED = 4096


def _bounded_put(table: dict[Hashable, Any], key: Hashable, value: Any) -> None:
    """``table[key] = value``, the oldest entry dropped first where the table holds :data:`MAX_CACHED`."""
    if key not in table and len(table) >= MAX_CACHED:
        del table[next(iter(table))]
    table[key] = value


class PlanCache:
    """Plans per shape bucket, at most :data:`MAX_CACHED` (the oldest dropped first); cleared whenever the memory model
    or margin changes."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, Plan] = {}
        #: rows of plans not yet read, per (batch size, static bucket) (NOTE [Planning a row], planning.py);
        #: readers read it, :meth:`put_row` and :meth:`clear` alone write it
        self.rows: dict[Hashable, Any] = {}
        self.hits = 0
        self.misses = 0
        #: plans asked for since the last clear (a cache cleared again and again: a model still learning)
        self.asked_since_clear = 0
        #: plans asked for between the last two clears: how long the previous model lasted
        self.asked_before_clear = 0

    def get(self, key: Hashable) -> Plan | None:
        self.asked_since_clear += 1
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def peek(self, key: Hashable) -> Plan | None:
        """The cached plan of ``key``, not counted as asked (a lookup on the planner's own behalf)."""
        return self._plans.get(key)

    def settled(self, asks: int) -> bool:
        """Whether the memory model behind these plans looks settled: it has served more than
        ``asks`` requests, or the one before it did (then a change is a correction, not a model
        still learning every step)."""
        return self.asked_since_clear > asks or self.asked_before_clear > asks

    def put(self, key: Hashable, plan: Plan) -> None:
        _bounded_put(self._plans, key, plan)

    def put_row(self, key: Hashable, row: Any) -> None:
        """Store ``row``, the plans of every length of a (batch size, static bucket), until the next clear."""
        _bounded_put(self.rows, key, row)

    def clear(self) -> None:
        self._plans.clear()
        self.rows.clear()
        self.asked_before_clear, self.asked_since_clear = self.asked_since_clear, 0

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Drop the plans whose key ``which`` names (one bucket's, its prediction corrected), keeping the rest."""
        for key in [k for k in self._plans if which(k)]:
            del self._plans[key]

    def items(self) -> list[tuple[Hashable, Plan]]:
        return list(self._plans.items())
