"""How plans are chosen: one small class per method, picked by name (habit 1).

Each method answers one question per training step, *before* the first block runs
(NOTE [Plan is fixed before forward] in runtime.py): which blocks to checkpoint for this
shape key, and is this a warm-up step (the runtime then probes blocks to fit the model).

| name          | plan                                                                  |
| ------------- | --------------------------------------------------------------------- |
| `none`        | nothing checkpointed                                                  |
| `full`        | every block                                                           |
| `dynamic`     | warm-up with `full` while measuring, then the cheapest plan that fits |
| `static`      | the `dynamic` plan of the largest shape (given, or seen so far)       |
| `precomputed` | plans from a JSON file written by ``Controller.save_plans``; no model |
| `reactive`    | no plan: blocks keep their saved tensors in memfit's store, evicted   |
|               | under pressure and recomputed in backward (reactive.py)               |
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from memfit.runtime import Planning

__all__ = [
    "Decision",
    "Method",
    "NoCheckpoint",
    "FullCheckpoint",
    "Dynamic",
    "Static",
    "Precomputed",
    "Reactive",
    "METHODS",
    "make_method",
    "UnknownMethodError",
]

PLANS_SCHEMA_VERSION = 1


class UnknownMethodError(ValueError):
    """The method name is not one memfit knows."""


@dataclass(frozen=True)
class Decision:
    """What a method decided for one step.

    Attributes:
        blocks: indices of the blocks to checkpoint.
        warmup: probe blocks this step to fit the memory model.
    """

    blocks: tuple[int, ...]
    warmup: bool = False


class Method:
    """Base class: subclasses set ``name`` and implement :meth:`decide`."""

    name: ClassVar[str] = ""
    #: whether the runtime keeps a memory model up to date for this method
    uses_model: ClassVar[bool] = True
    #: whether blocks run under the reactive store (reactive.py), which evicts their saved
    #: tensors during forward when the step nears the budget
    evicts: ClassVar[bool] = False
    #: whether blocks the plan leaves un-checkpointed run under the reactive store, which
    #: evicts them only when a step nears the cap despite its plan (NOTE [Backstop], runtime.py)
    backstop: bool = False

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        raise NotImplementedError

    def planning_key(self, planning: "Planning", key: tuple[int, int]) -> tuple[int, int]:
        """The shape whose plan this step runs (``static``: the largest one)."""
        return key


class NoCheckpoint(Method):
    """Never checkpoint: fastest, and OOMs when the step does not fit."""

    name = "none"
    uses_model = False

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        return Decision(())


class FullCheckpoint(Method):
    """Checkpoint every block (HF ``gradient_checkpointing=True``)."""

    name = "full"
    uses_model = False

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        return Decision(planning.all_blocks)


class Dynamic(Method):
    """Per shape key, the cheapest plan whose predicted peak fits the budget.

    Args:
        warmup_steps: fewest warm-up steps (run as ``full`` while the probe measures).
        warmup_keys: fewest distinct token counts to see before leaving warm-up, so the
            fit of ``N·T`` and ``N·T²`` is determined.
        max_warmup_steps: leave warm-up after this many steps even with fewer keys.
        backstop: when a prediction was wrong and a step nears the cap mid-forward, evict
            already-run un-checkpointed blocks instead of running out of memory; armed only
            for steps longer than any before or predicted within reach of the cap (NOTE
            [Backstop] in runtime.py).
    """

    name = "dynamic"
    #: plan a shape's whole row on a miss (NOTE [Planning a row] in runtime.py)
    plans_rows = True

    def __init__(self, warmup_steps: int = 3, warmup_keys: int = 3, max_warmup_steps: int = 12, backstop: bool = True):
        if not 1 <= warmup_steps <= max_warmup_steps:
            raise ValueError("need 1 <= warmup_steps <= max_warmup_steps")
        self.backstop = backstop
        self.warmup_steps = warmup_steps
        self.warmup_keys = warmup_keys
        self.max_warmup_steps = max_warmup_steps
        self._warm_steps = 0
        self._warm_tokens: set[int] = set()
        self._steady = False  # warm-up is over for good (a step's first check is then skipped)

    def skip_warmup(self) -> None:
        """End warm-up now (the memory model was loaded from a checkpoint)."""
        self._warm_steps = self.max_warmup_steps
        self._steady = False  # checked again against the loaded model

    def in_warmup(self, planning: "Planning", key: tuple[int, int]) -> bool:
        if not planning.model.ready:
            return True
        if self._warm_steps >= self.max_warmup_steps:
            return False
        return self._warm_steps < self.warmup_steps or len(self._warm_tokens) < self.warmup_keys

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        if not self._steady:
            if self.in_warmup(planning, key):
                self._warm_steps += 1
                self._warm_tokens.add(key[0] * key[1])
                return Decision(planning.all_blocks, warmup=True)
            self._steady = True  # the model stays ready and the counts only grow
        return Decision(planning.plan_for(self.planning_key(planning, key), whole_row=self.plans_rows))


class Static(Dynamic):
    """The ``dynamic`` plan of the largest input, applied to every batch.

    Args:
        max_shape: ``(N, T)`` of the largest input, when known (e.g. from the length list of
            the data set). Without it, the largest key seen so far (warm-up included) is
            used, so the plan only ever grows.
    """

    name = "static"
    plans_rows = False  # one shape, the largest, is ever planned

    def __init__(self, max_shape: tuple[int, int] | None = None, backstop: bool = False, **kwargs: int):
        super().__init__(backstop=backstop, **kwargs)
        self.max_shape = tuple(max_shape) if max_shape else None

    def planning_key(self, planning: "Planning", key: tuple[int, int]) -> tuple[int, int]:
        candidates = [key] + [k for k in (self.max_shape, planning.model.max_key) if k]
        return max(candidates, key=lambda k: (k[0] * k[1], k))


class Precomputed(Method):
    """Plans from a file written by ``Controller.save_plans``; no warm-up, no model.

    A key missing from the file takes the plan of the smallest larger key with the same
    batch rows (safe: it checkpoints at least as much as needed), else every block.

    Args:
        path: the JSON plans file.

    Raises:
        FileNotFoundError / ValueError: naming the file, when missing or malformed.
    """

    name = "precomputed"
    uses_model = False

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.plans = load_plans(self.path)

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        plan = self.plans.get(key)
        if plan is None:
            larger = [k for k in self.plans if k[0] == key[0] and k[1] >= key[1]]
            plan = self.plans[min(larger)] if larger else planning.all_blocks
        return Decision(tuple(i for i in plan if i < planning.n_blocks))


class Reactive(Method):
    """No plan, no model: evict already-run blocks' saved tensors under pressure (DTR-style).

    Every block runs under memfit's saved-tensor store; at each block entry, when the bytes
    in use plus the margin plus the largest block so far would cross the budget, the blocks
    with the least recompute time per byte freed (and the stalest) are evicted, and re-run
    in backward when first needed (reactive.py).
    """

    name = "reactive"
    uses_model = False
    evicts = True

    def decide(self, planning: "Planning", key: tuple[int, int]) -> Decision:
        return Decision(())


def save_plans(path: str | os.PathLike[str], n_blocks: int, plans: dict[tuple[int, int], tuple[int, ...]]) -> None:
    """Write plans as JSON: ``{"schema_version", "n_blocks", "plans": [{"key", "blocks"}]}``."""
    data = {
        "schema_version": PLANS_SCHEMA_VERSION,
        "n_blocks": n_blocks,
        "plans": [{"key": list(k), "blocks": list(v)} for k, v in sorted(plans.items())],
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)


def load_plans(path: str) -> dict[tuple[int, int], tuple[int, ...]]:
    """Read a plans file written by :func:`save_plans`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"plans file {path} does not exist; write one with Controller.save_plans")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return {tuple(p["key"]): tuple(int(i) for i in p["blocks"]) for p in data["plans"]}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f"plans file {path} is malformed ({exc}); expected JSON with a 'plans' list of "
            "{'key': [N, T], 'blocks': [...]} as written by Controller.save_plans"
        ) from None


METHODS: dict[str, type[Method]] = {
    m.name: m for m in (NoCheckpoint, FullCheckpoint, Dynamic, Static, Precomputed, Reactive)
}


def make_method(name: str | Method, **kwargs) -> Method:
    """Build a method from its name (``kwargs`` go to its constructor).

    Raises:
        UnknownMethodError: listing the valid names.
    """
    if isinstance(name, Method):
        return name
    cls = METHODS.get(name)
    if cls is None:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return cls(**kwargs)
