"""The planner: which blocks to checkpoint so that enough bytes are saved, at least cost.

Pure functions and a small cache; nothing here touches ``torch.cuda`` (habit 4).

Problem: blocks ``i`` with recompute cost ``c_i`` (ms) and savings ``s_i`` (bytes freed by
checkpointing block ``i``); find the set ``P`` minimising ``sum(c_i for i in P)`` subject to
``sum(s_i for i in P) >= need``. This is a min-cost covering knapsack:

* homogeneous stacks (all ``c_i`` equal and all ``s_i`` equal — the common case, a stack of
  identical transformer layers) are solved exactly in O(1): the first ``ceil(need/s)`` blocks;
* mixed stacks exactly by enumerating how many blocks to take from each class of identical
  blocks (Swin's four stages, T5's encoder and decoder: a few hundred combinations), taking
  the earliest blocks within a class;
* only when that enumeration would be too large, by dynamic programming over savings
  quantised *downwards* (so the true savings of the chosen set are never below ``need``)
  into ``resolution`` units: within about ``n/resolution`` of optimal.

# NOTE [Earliest blocks first]
Among plans of equal cost the planner prefers lower block indices. A checkpointed block is
recomputed when backward reaches it; the first blocks are reached last, when most other
activations have been freed, so recomputing them adds least to the step's peak.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Plan", "InfeasiblePlanError", "plan_blocks", "PlanCache"]


class InfeasiblePlanError(ValueError):
    """Checkpointing every block still does not save enough bytes."""


@dataclass(frozen=True)
class Plan:
    """Blocks to checkpoint for one shape key.

    Attributes:
        blocks: checkpointed block indices, ascending.
        cost_ms: estimated recompute time of those blocks.
        saved_bytes: estimated bytes the plan saves relative to checkpointing nothing.
    """

    blocks: tuple[int, ...]
    cost_ms: float = 0.0
    saved_bytes: int = 0


def _is_homogeneous(values: Sequence[float], rel_tol: float = 1e-9) -> bool:
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
        resolution: DP units for mixed stacks (higher is closer to optimal, slower).

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
            chosen = _knapsack_cover(costs_ms, savings, need_bytes, resolution)
    return Plan(chosen, float(sum(costs_ms[i] for i in chosen)), int(sum(savings[i] for i in chosen)))


_MAX_COMBINATIONS = 200_000


def _enumerate_classes(costs: Sequence[float], savings: Sequence[int], need: int) -> tuple[int, ...] | None:
    """Exact min-cost cover over classes of identical blocks; None if too many combinations."""
    classes: dict[tuple[float, int], list[int]] = {}
    for i, pair in enumerate(zip(costs, savings)):
        classes.setdefault(pair, []).append(i)
    members = list(classes.values())
    if math.prod(len(m) + 1 for m in members) > _MAX_COMBINATIONS:
        return None
    best: tuple[float, tuple[int, ...]] | None = None
    for counts in itertools.product(*(range(len(m) + 1) for m in members)):
        saved = sum(savings[m[0]] * k for m, k in zip(members, counts) if k)
        if saved < need:
            continue
        chosen = tuple(sorted(i for m, k in zip(members, counts) for i in m[:k]))
        candidate = (sum(costs[i] for i in chosen), chosen)
        if best is None or candidate < best:
            best = candidate
    return best[1] if best else None


def _knapsack_cover(costs: Sequence[float], savings: Sequence[int], need: int, resolution: int) -> tuple[int, ...]:
    """Min-cost cover by DP over quantised savings (see module docstring)."""
    unit = max(1, math.ceil(need / resolution))
    target = math.ceil(need / unit)
    units = [s // unit for s in savings]
    if sum(units) < target:  # quantisation lost too much: fall back to exact units of 1 byte
        unit, target, units = 1, need, list(savings)
    inf = math.inf
    # best[u] = (cost, chosen) reaching at least u units; u capped at target.
    best: list[tuple[float, tuple[int, ...]] | None] = [None] * (target + 1)
    best[0] = (0.0, ())
    for i in range(len(costs)):
        if units[i] == 0:
            continue
        for u in range(target, -1, -1):
            entry = best[u]
            if entry is None:
                continue
            v = min(target, u + units[i])
            candidate = (entry[0] + costs[i], entry[1] + (i,))
            current = best[v]
            if current is None or (candidate[0], candidate[1]) < (current[0], current[1]):
                best[v] = candidate
    result = best[target]
    if result is None or result[0] == inf:
        raise InfeasiblePlanError("no set of blocks saves enough bytes")
    return tuple(sorted(result[1]))


class PlanCache:
    """Plans per shape bucket; cleared whenever the memory model or margin changes."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, Plan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Plan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key: Hashable, plan: Plan) -> None:
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def items(self) -> list[tuple[Hashable, Plan]]:
        return list(self._plans.items())
