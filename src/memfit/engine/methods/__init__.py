"""How plans are chosen: one small class per method, picked by name (the extension point).

Each method answers, per training step and before the first block runs, which treatment
every block gets for this shape key, and whether this is a warm-up step (the runtime then
probes blocks to fit the memory model); it learns from the finished step if it plans from
the model, and says what protects its steps mid-step (protection.py).

| name          | plan                                                                  |
| ------------- | --------------------------------------------------------------------- |
| `none`        | every block kept                                                      |
| `full`        | every block recomputed                                                |
| `dynamic`     | warm-up with `full` while measuring, then the cheapest plan that fits |
| `static`      | the `dynamic` plan of the largest shape (given, or seen so far)       |
| `precomputed` | plans from a file written by ``Controller.save_plans``; no model      |
| `reactive`    | no plan: blocks keep their saved tensors in memfit's store, evicted   |
|               | under pressure and recomputed in backward (store.py)                  |

A new method is a subclass of :class:`Method` added to :data:`METHODS`.
"""

from __future__ import annotations

from memfit.errors import FlagError
from memfit.engine.methods.base import Decision, Method, UnknownMethodError
from memfit.engine.methods.dynamic import Dynamic, Static
from memfit.engine.methods.fixed import FullCheckpoint, NoCheckpoint
from memfit.engine.methods.precomputed import PLANS_SCHEMA_VERSION, PlansMismatchError, Precomputed, load_plans, save_plans
from memfit.engine.methods.reactive import Reactive

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
    "PlansMismatchError",
    "PLANS_SCHEMA_VERSION",
    "save_plans",
    "load_plans",
]

#: every method, by name
METHODS: dict[str, type[Method]] = {
    m.name: m for m in (NoCheckpoint, FullCheckpoint, Dynamic, Static, Precomputed, Reactive)
}


def make_method(name: str | Method, **kwargs) -> Method:
    """Build a method from its name (``kwargs`` go to its constructor).

    Raises:
        UnknownMethodError: listing the valid names.
        FlagError: for ``precomputed`` without ``path``, naming it.

    Example:
        >>> make_method("static", max_shape=(8, 512)).max_shape
        (8, 512)
    """
    if isinstance(name, Method):
        return name
    cls = METHODS.get(name)
    if cls is None:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    if cls is Precomputed and "path" not in kwargs:
        raise FlagError("method 'precomputed' needs path= (a plans file written by Controller.save_plans)")
    return cls(**kwargs)
