"""memfit: train PyTorch / Hugging Face models inside a memory budget at the lowest time cost.

Input-aware dynamic activation checkpointing: for every batch memfit predicts the step's
peak memory from the batch's shape and checkpoints just enough blocks to fit the budget.

Example:
    >>> import memfit  # doctest: +SKIP
    >>> ctl = memfit.fit(model, budget="6GiB", method="dynamic", optimizer=opt)  # doctest: +SKIP
"""

from memfit.engine.parts.blocks import NoBlocksError
from memfit.engine.budget import BudgetTooSmallError, parse_bytes
from memfit.engine.run.controller import Controller, fit
from memfit.engine.methods import METHODS, UnknownMethodError
from memfit.engine.records import RunSummary, StepRecord
from memfit.engine.parts.kind import PartKind

__all__ = [
    "fit",
    "Controller",
    "PartKind",
    "StepRecord",
    "RunSummary",
    "METHODS",
    "parse_bytes",
    "BudgetTooSmallError",
    "UnknownMethodError",
    "NoBlocksError",
    "Trainer",
    "TrainingArguments",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Trainer integration imports transformers; load it only when asked for.
    if name in {"Trainer", "TrainingArguments"}:
        from memfit.integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
