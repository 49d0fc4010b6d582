"""The optimizer step as a part: what ``optimizer.step()`` allocates above weights, gradients and
state, and memfit's lever on it.

# NOTE [The optimizer step's treatments]
The step's moment holds no activations (backward has freed them), so its peak is static bytes
plus the step's temporaries (NOTE [Optimizer step transient], optim_state.py), the same for
every batch. The step is a part held at a moment of its own (``OptimizerStepPart``, NOTE [A part
kind's moment] in kind.py), with two options:

* ``keep``: the implementation torch chose for each parameter group (fused, foreach or the
  for-loop): foreach holds about one copy of a group's parameters at once;
* ``per_tensor``: the groups that would run foreach run torch's for-loop step instead
  (``group["foreach"] = False``, which torch reads at every step): a few copies of the largest
  parameter at once. The same arithmetic on the same tensors: the updates are equal bit for bit
  (tests/test_optimizer_step.py); it costs a kernel launch per tensor instead of per group.

Planning runs ``keep`` where static + its temporaries (the larger of the formula's and what
steps read) fit the room, else ``per_tensor``, chosen per step from the room it has then: a
margin grown by an OOM, or a step's larger static bytes, switches it, and a later room switches
it back. The check before training (``memfit.fit``, ``Controller.set_optimizer``, and before the
Trainer's ``--optim`` makes its optimizer) counts the temporaries of the option that will fit,
and is the one error naming the step where neither does. A step record names the part where
the step ran ``per_tensor``. A fused step has no temporaries and is never changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from memfit.engine.parts.kind import OPTIMIZER_STEP, PartKind
from memfit.engine.parts.optim_state import expected_step_transient_bytes, torch_step_transient_bytes

__all__ = ["AS_MADE", "PER_TENSOR", "OptimizerStepPart", "choose_step", "expected_step_bytes"]

logger = logging.getLogger("memfit")

AS_MADE, PER_TENSOR, KEEP = "as_made", "per_tensor", "keep"


def _per_tensor_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The parameter groups a per-tensor step changes: those that do not run fused (and are not
    already for-loop by request)."""
    return [g for g in optimizer.param_groups if not g.get("fused") and g.get("foreach") is not False]


def _transients(optimizer: torch.optim.Optimizer, local: Callable | None) -> dict[str, int | None]:
    """Each treatment's temporaries (None: the optimizer's class is not predicted)."""
    return {AS_MADE: torch_step_transient_bytes(optimizer, local),
            PER_TENSOR: torch_step_transient_bytes(optimizer, local, per_tensor=True)}


class OptimizerStepPart(PartKind):
    """The optimizer step as a part held at its own moment (NOTE [The optimizer step's treatments]).

    Args:
        optimizer: the torch optimizer whose step it is.
        local: the tensor a rank holds of a parameter (a DTensor's local shard under FSDP2), or None.
    """

    name = "optimizer_step"
    title = "optimizer step"
    moment = OPTIMIZER_STEP

    def __init__(self, optimizer: torch.optim.Optimizer, local: Callable | None = None):
        bytes_by = _transients(optimizer, local)
        self.made, per_tensor = bytes_by[AS_MADE], bytes_by[PER_TENSOR]
        self._groups = _per_tensor_groups(optimizer)
        self._as_made = [g.get("foreach") for g in self._groups]
        saved = self.made - per_tensor if self.made is not None and per_tensor is not None and self._groups else 0
        # not priced (its launches were never timed): it runs only where ``keep``, first and so chosen on a tie, does not fit
        self._options = ((KEEP, 1, 0, 0.0),) + (((PER_TENSOR, 1, int(saved), 0.0),) if saved > 0 else ())
        self._said = False

    def options(self, tokens: int) -> tuple:
        return self._options

    def moment_bytes(self) -> int:
        return self.made or 0

    def apply(self, option: tuple[str, int] | None) -> None:
        per_tensor = option is not None and option[0] == PER_TENSOR
        for group, as_made in zip(self._groups, self._as_made):
            group["foreach"] = False if per_tensor else as_made
        if per_tensor and not self._said:
            self._said = True
            logger.info("memfit: the optimizer step runs per tensor (foreach=False) while foreach's temporaries (%d bytes) "
                        "do not fit the room above weights, gradients and state; per tensor they are %d",
                        self.made, self.made - self._options[1][2])


def choose_step(optimizer: torch.optim.Optimizer | None, free_bytes: int | None, local: Callable | None = None) -> int | None:
    """The temporaries of ``optimizer``'s step as its part runs it with ``free_bytes`` above the static bytes
    (``PartKind.at_moment``: ``keep``'s where they fit, else the per-tensor step's); None: not predicted."""
    if optimizer is None:
        return 0
    part = OptimizerStepPart(optimizer, local)
    if part.made is None or free_bytes is None:
        return part.made
    return part.made - part.at_moment(free_bytes, 0)[2]


def expected_step_bytes(optim: str, params: Iterable[torch.Tensor], weight_decay: float, free_bytes: int | None) -> int | None:
    """The temporaries of the step ``--optim optim`` will make, as :func:`choose_step` will treat it
    once it exists: ``as_made``'s where they fit ``free_bytes``, else the smaller of the two."""
    params = list(params)
    made = expected_step_transient_bytes(optim, params, weight_decay)
    if made is None or free_bytes is None or made <= free_bytes:
        return made
    return min(made, expected_step_transient_bytes(optim, params, weight_decay, foreach=False))
