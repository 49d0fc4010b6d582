"""``precomputed``: plans from a file written by an earlier run; no warm-up, no model.

# NOTE [Plans files]
A plans file is JSON: ``{"schema_version", "n_blocks", "model", "plans": [{"key": [N, T],
"blocks": [...], "treatments": [...], "head": "chunked:8"}]}``. ``blocks`` lists the treated blocks of a shape key;
``treatments`` names the treatment of each of them and is left out when every one is
``recompute``, so a file of schema 1 (blocks only) reads as whole-block recompute. ``head`` (schema
3) is the LM head's label as step records write it (``"keep"`` or ``"chunked:<n>"``, NOTE [The head
in a record] in records.py), left out for a plan that did not place the head, so files of schema 1
and 2 read as plans without a head; every other part beside the blocks is written so too, its label
under its kind's name (a string where the row's other values are lists: NOTE [Parts in a record]).
A run that does not plan a part drops a file's labels of it. ``model``
fingerprints the blocks the plans were made for (their names, classes and parameter counts:
:func:`memfit.engine.parts.blocks.fingerprint`); a file made for another model is refused when the run
binds it: by block count always, by fingerprint when both are known.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

from memfit.errors import DataError, MissingFileError, UserError
from memfit.engine.methods.base import Decision, Method
from memfit.engine.plan.planner import Plan
from memfit.engine.records import parse_part_label

if TYPE_CHECKING:
    from memfit.engine.plan.planning import Planning

__all__ = ["PLANS_SCHEMA_VERSION", "PlansMismatchError", "Precomputed", "save_plans", "load_plans"]

PLANS_SCHEMA_VERSION = 3


class PlansMismatchError(UserError, ValueError):
    """A plans file was made for another model than the one being trained."""


class Precomputed(Method):
    """Plans from a file written by ``Controller.save_plans``; no warm-up, no model.

    A key missing from the file takes the plan of the smallest larger key with the same
    batch rows (safe: it treats at least as much as needed), else every block recomputed.

    Args:
        path: the JSON plans file.

    Raises:
        FileNotFoundError / ValueError: naming the file, when missing or malformed.
    """

    name = "precomputed"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.plans, self.n_blocks, self.fingerprint = load_plans(self.path)

    def bind(self, n_blocks: int, fingerprint: str) -> None:
        made_for = f"{self.n_blocks} blocks" + (f", model {self.fingerprint}" if self.fingerprint else "")
        this = f"{n_blocks} blocks, model {fingerprint}"
        mismatch = self.n_blocks is not None and self.n_blocks != n_blocks
        mismatch = mismatch or bool(self.fingerprint and fingerprint and self.fingerprint != fingerprint)
        top = max((max(p.blocks, default=-1) for p in self.plans.values()), default=-1)
        if mismatch or top >= n_blocks:
            raise PlansMismatchError(
                f"plans file {self.path} was made for another model ({made_for}) than this one ({this}); "
                "write plans for this model with a dynamic run (memfit_plans.json), or pass the plans file of this model"
            )

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        plan = self.plans.get(key)
        if plan is None:
            larger = [k for k in self.plans if k[0] == key[0] and k[1] >= key[1]]
            plan = self.plans[min(larger)] if larger else Plan(planning.all_blocks)
        if any(kind not in planning.parts for kind, _, _ in plan.parts):  # this run does not plan that part
            plan = dataclasses.replace(plan, parts=[p for p in plan.parts if p[0] in planning.parts])
        return Decision(plan)


def save_plans(
    path: str | os.PathLike[str], n_blocks: int, plans: dict[tuple[int, int], Plan], fingerprint: str = "",
) -> None:
    """Write plans as JSON (NOTE [Plans files]).

    Args:
        path: the file.
        n_blocks: blocks of the model the plans were made for.
        plans: per shape key, its :class:`~memfit.engine.plan.planner.Plan`.
        fingerprint: :func:`memfit.engine.parts.blocks.fingerprint` of that model ("" when unknown).
    """
    rows = []
    for key, plan in sorted(plans.items()):
        row = {"key": list(key), "blocks": list(plan.blocks)}
        if plan.kinds:
            row["treatments"] = list(plan.kinds)
        row.update(plan.part_labels())
        rows.append(row)
    data = {"schema_version": PLANS_SCHEMA_VERSION, "n_blocks": n_blocks, "model": fingerprint, "plans": rows}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)


def load_plans(path: str) -> tuple[dict[tuple[int, int], Plan], int | None, str]:
    """Read a plans file written by :func:`save_plans` (schema 1, 2 or 3).

    Returns:
        ``(plans, n_blocks, fingerprint)``: per shape key its plan; the block count and the
        model fingerprint the file was made for (None / "" when the file does not say).

    Raises:
        FileNotFoundError: naming the file, when it does not exist.
        ValueError: naming the file and the expected layout, when it is malformed.
    """
    if not os.path.exists(path):
        raise MissingFileError(f"plans file {path} does not exist; write one with Controller.save_plans")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        plans = {}
        for p in data["plans"]:
            blocks = tuple(int(i) for i in p["blocks"])
            parts = [(kind, *parse_part_label(label, kind)) for kind, label in p.items() if isinstance(label, str)]
            kinds = tuple(str(k) for k in p.get("treatments", ()))
            plans[tuple(int(x) for x in p["key"])] = Plan(blocks, kinds=kinds, parts=parts)
        n_blocks = data.get("n_blocks")
        return plans, (None if n_blocks is None else int(n_blocks)), str(data.get("model") or "")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise DataError(
            f"plans file {path} is malformed ({exc}); expected JSON with a 'plans' list of "
            "{'key': [N, T], 'blocks': [...]} (and optionally 'treatments', 'head' and each other part's label) as written by Controller.save_plans"
        ) from None
