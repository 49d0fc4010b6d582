"""The task recipes of ``memfit train <task>``: a registry from task name to recipe module.

Every recipe module has ``build(model_args, data_args, seed=42) -> TaskBundle``: it loads the
data (local file, hub dataset or synthetic), tokenizes it without padding (images: keeps them at
native size), and returns the model, the dynamic-padding collator and the task's metric. A recipe
with flags of its own lists their dataclasses in ``ARGUMENTS``; ``memfit train`` parses them and
passes them to ``build`` after the seed. A recipe that loads no tokenizer sets ``TOKENIZER =
False`` (``memfit train`` then does not ask the hub for one). Modules are imported on first use,
so listing the tasks does not import transformers.

Example:
    >>> from memfit.tasks import DataTrainingArguments, ModelArguments, get_task
    >>> recipe = get_task("text-classification")
    >>> bundle = recipe.build(ModelArguments(), DataTrainingArguments(synthetic=64))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from types import ModuleType

from memfit.errors import FlagError
from memfit.tasks._common import DataFileError, DataTrainingArguments, ModelArguments, TaskBundle

__all__ = ["TASKS", "get_task", "ModelArguments", "DataTrainingArguments", "TaskBundle", "DataFileError"]

#: task name (as typed after ``memfit train``) -> module holding its recipe.
TASKS = {
    "multiple-choice": "memfit.tasks.multiple_choice",
    "question-answering": "memfit.tasks.question_answering",
    "text-classification": "memfit.tasks.text_classification",
    "token-classification": "memfit.tasks.token_classification",
    "causal-lm": "memfit.tasks.causal_lm",
    "object-detection": "memfit.tasks.object_detection",
}


def get_task(name: str) -> ModuleType:
    """The recipe module of task ``name``.

    Raises:
        FlagError: ``name`` is not a known task (the message lists the known ones).
    """
    if name not in TASKS:
        raise FlagError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return importlib.import_module(TASKS[name])
