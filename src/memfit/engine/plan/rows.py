"""Plans of a whole row of lengths at once (NOTE [Planning a row], planning.py): for a stack of one group planned by
recompute alone, every length of a batch size's row from the model's own peak formula over arrays, cached in the
planning's plan cache (``PlanCache.put_row``) and read per shape. ``RowSearch`` reads the run's planning through its
public face, as the per-shape search does (search.py), and writes nothing of it but the cache's rows."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from memfit.engine.plan.planner import Plan
from memfit.engine.shapes import bucket_key

__all__ = ["RowSearch"]


class RowSearch:
    """The rows of plans of a run's ``planning`` (a :class:`~memfit.engine.plan.planning.Planning`, not imported:
    planning.py imports this module)."""

    def __init__(self, planning: Any):
        self.planning = planning

    def row_constant(self, k: tuple[int, int], edge: tuple[int, int], static_bucket: int) -> bool:
        """Whether the row plans every length from ``k`` to ``edge`` alike (NOTE [Plan for the longest shape seen])."""
        planning = self.planning
        row = planning.cache.rows.get((k[0], static_bucket))
        if row is None or row["longest"] < edge[1]:
            return False
        span = slice(k[1] - 1, edge[1])
        return all(len(set(row[name][span])) == 1 for name in ("count", "every_fits", "prefix_fits"))

    def from_row(self, k: tuple[int, int], static_bucket: int) -> Plan | None:
        """``k``'s plan read from its row's arrays, planned first if needed.

        ``None`` (plan ``k`` alone) for a stack of several groups or a shape that no plan fits
        (the per-key path warns then).
        """
        planning = self.planning
        row = planning.cache.rows.get((k[0], static_bucket))
        if row is None or row["longest"] < k[1]:
            row = self._row(k)
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

    def _row(self, k: tuple[int, int]) -> dict[str, Any] | None:
        """Every length of ``k``'s row, up to the longest shape seen, as lists (one group only):
        the model's own peak formula over arrays (NOTE [One evaluator], model.py)."""
        planning = self.planning
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
