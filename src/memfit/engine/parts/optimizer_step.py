"""The optimizer step as a part: what ``optimizer.step()`` allocates above weights, gradients and
state, and memfit's lever on it.

# NOTE [The optimizer step's treatments]
The step's moment holds no activations (backward has freed them), so its peak is static bytes
plus the step's temporaries (NOTE [Optimizer step transient], optim_state.py), the same for
every batch. Two treatments:

* ``as_made``: the implementation torch chose for each parameter group (fused, foreach or the
  for-loop): foreach holds about one copy of a group's parameters at once;
* ``per_tensor``: the groups that would run foreach run torch's for-loop step instead
  (``group["foreach"] = False``, which torch reads at every step): a few copies of the largest
  parameter at once. The same arithmetic on the same tensors: the updates are equal bit for bit
  (tests/test_optimizer_step.py); it costs a kernel launch per tensor instead of per group.

Since no batch changes the need, the choice is made when the optimizer and the budget are known
(``memfit.fit``, ``Controller.set_optimizer``, and before the Trainer's ``--optim`` makes its
optimizer): ``as_made`` where static + its temporaries fit the budget, else ``per_tensor`` where
that fits and is smaller, else the one error naming the step (budget.py). It is said once, at
INFO. A fused step has no temporaries and is never changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from memfit.engine.parts.optim_state import expected_step_transient_bytes, torch_step_transient_bytes

__all__ = ["AS_MADE", "PER_TENSOR", "choose_step", "expected_step_bytes"]

logger = logging.getLogger("memfit")

AS_MADE, PER_TENSOR = "as_made", "per_tensor"


def _per_tensor_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The parameter groups a per-tensor step changes: those that do not run fused (and are not
    already for-loop by request)."""
    return [g for g in optimizer.param_groups if not g.get("fused") and g.get("foreach") is not False]


def _transients(optimizer: torch.optim.Optimizer, local: Callable | None) -> dict[str, int | None]:
    """Each treatment's temporaries (None: the optimizer's class is not predicted)."""
    return {AS_MADE: torch_step_transient_bytes(optimizer, local),
            PER_TENSOR: torch_step_transient_bytes(optimizer, local, per_tensor=True)}


def choose_step(
    optimizer: torch.optim.Optimizer | None, free_bytes: int | None, local: Callable | None = None,
) -> tuple[int | None, Callable[[], None] | None]:
    """Treat the optimizer step so that its temporaries fit ``free_bytes`` (the budget less the
    static bytes), when ``as_made``'s do not (NOTE [The optimizer step's treatments]).

    Returns:
        The temporaries of the step as it will run (None: not predicted) and an undo of the change
        (None: nothing changed).
    """
    if optimizer is None:
        return 0, None
    bytes_by = _transients(optimizer, local)
    made, per_tensor = bytes_by[AS_MADE], bytes_by[PER_TENSOR]
    if free_bytes is None or made is None or made <= free_bytes or per_tensor is None or per_tensor > free_bytes:
        return made, None  # fits as made, or does not fit either way: the static check's one error names the step
    groups = _per_tensor_groups(optimizer)
    before = [g.get("foreach") for g in groups]
    for g in groups:
        g["foreach"] = False
    logger.info("memfit: the optimizer step runs per tensor (foreach=False): its foreach temporaries (%d bytes) do not "
                "fit the %d bytes the budget leaves above weights, gradients and state; per tensor they are %d",
                made, max(free_bytes, 0), per_tensor)

    def undo() -> None:
        for g, was in zip(groups, before):
            g["foreach"] = was

    return per_tensor, undo


def expected_step_bytes(optim: str, params: Iterable[torch.Tensor], weight_decay: float, free_bytes: int | None) -> int | None:
    """The temporaries of the step ``--optim optim`` will make, as :func:`choose_step` will treat it
    once it exists: ``as_made``'s where they fit ``free_bytes``, else the smaller of the two."""
    params = list(params)
    made = expected_step_transient_bytes(optim, params, weight_decay)
    if made is None or free_bytes is None or made <= free_bytes:
        return made
    return min(made, expected_step_transient_bytes(optim, params, weight_decay, foreach=False))
