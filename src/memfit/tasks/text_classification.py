"""text-classification: one sentence or a pair -> a label (GLUE and any labelled CSV/JSON),
as HF ``run_glue.py``.

Metrics: accuracy; plus F1 of the positive class for MRPC and QQP, Matthews correlation for
CoLA; Pearson and Spearman correlation (no accuracy) for the regression task STS-B.

Data:
  * GLUE ``.tsv`` files as distributed by ``download_glue_data.py``, with ``--task_name``: the
    layout of each task is in ``GLUE_TASKS`` (CoLA has no header; MRPC has a BOM; labels are
    digits or names as in the files and become the GLUE label names of the hub).
  * ``.csv``/``.json``/``.jsonl`` (and ``.tsv`` without ``--task_name``) with a header, read as
    ``run_glue`` reads them: the ``label`` column, and as text ``sentence1``/``sentence2`` if
    present, else the first one or two other columns (``idx`` is skipped). Labels are sorted
    and numbered unless ``--task_name`` fixes them.
  * ``--dataset_name glue --dataset_config_name <task>`` (the task name follows the config).

Synthetic lengths (total tokens with [CLS]/[SEP], bert uncased vocabulary, at
``QUANTILE_LEVELS``), from the GLUE train files in ``shared/data/glue``: CoLA 8,551 sentences
(mean 11.3), SST-2 67,349 (mean 13.3), MRPC 3,668 pairs (mean 53.2), RTE 2,490 pairs (mean
70.2). ``--task_name`` picks the table (default mrpc). A synthetic label is the id of the first
word modulo the number of labels, so it is learnable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from memfit.errors import FlagError
from memfit.tasks._common import (
    DataFileError,
    DataTrainingArguments,
    ModelArguments,
    SyntheticText,
    TaskBundle,
    load_model,
    load_splits,
    load_tokenizer,
    max_seq_length,
    read_records,
)

__all__ = ["GlueTask", "GLUE_TASKS", "TextExample", "read_text_file", "synthetic_examples", "glue_metrics", "build"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueTask:
    """Layout and scoring of one GLUE task."""

    text_a: str
    """Column of the first sentence in the task's ``.tsv`` files."""
    text_b: str | None
    """Column of the second sentence; ``None`` for single-sentence tasks."""
    label: str
    """Column of the label."""
    labels: tuple[str, ...] | None
    """Label names in the order of the hub's ids (digit labels in the files index it); ``None``:
    regression."""
    metrics: tuple[str, ...] = ()
    """Metrics reported besides accuracy."""
    columns: tuple[str, ...] | None = None
    """Field names of a header-less file (CoLA); ``None``: the file's first row."""


#: The GLUE tasks, by ``--task_name``.
GLUE_TASKS = {
    "cola": GlueTask(
        "sentence", None, "label", ("unacceptable", "acceptable"), ("matthews_correlation",),
        columns=("source", "label", "original_label", "sentence"),
    ),
    "sst2": GlueTask("sentence", None, "label", ("negative", "positive")),
    "mrpc": GlueTask("#1 String", "#2 String", "Quality", ("not_equivalent", "equivalent"), ("f1",)),
    "qqp": GlueTask("question1", "question2", "is_duplicate", ("not_duplicate", "duplicate"), ("f1",)),
    "stsb": GlueTask("sentence1", "sentence2", "score", None, ("pearson", "spearmanr")),
    "mnli": GlueTask("sentence1", "sentence2", "gold_label", ("entailment", "neutral", "contradiction")),
    "qnli": GlueTask("question", "sentence", "label", ("entailment", "not_entailment")),
    "rte": GlueTask("sentence1", "sentence2", "label", ("entailment", "not_entailment")),
    "wnli": GlueTask("sentence1", "sentence2", "label", ("not_entailment", "entailment")),
}

_SYNTHETIC_TOKENS = {
    "cola": (4, 6, 7, 9, 10, 13, 17, 20, 25, 47),
    "sst2": (3, 4, 4, 6, 10, 18, 27, 33, 44, 66),
    "mrpc": (19, 32, 36, 44, 53, 62, 70, 74, 83, 103),
    "rte": (13, 29, 33, 43, 56, 85, 135, 157, 197, 289),
}
_PAIR_TASKS = {"mrpc", "rte"}


@dataclass
class TextExample:
    """One sentence or sentence pair with its label."""

    text_a: str
    """The (first) sentence."""
    text_b: str | None
    """The second sentence of a pair task; ``None`` otherwise."""
    label: str | float
    """The label name, or the score of a regression task."""


def _glue_task(name: str | None) -> GlueTask | None:
    if name is not None and name not in GLUE_TASKS:
        raise FlagError(f"--task_name {name}: not a GLUE task; choose one of: {', '.join(GLUE_TASKS)}")
    return None if name is None else GLUE_TASKS[name]


def _text_columns(columns: list[str]) -> tuple[str, str | None]:
    """``run_glue``'s rule: sentence1/sentence2, else the first one or two non-label columns."""
    names = [c for c in columns if c not in ("label", "idx")]
    if "sentence1" in names and "sentence2" in names:
        return "sentence1", "sentence2"
    if not names:
        raise ValueError(f"no text column besides 'label' among {columns}")
    return names[0], (names[1] if len(names) > 1 else None)


def _label(value: Any, glue: GlueTask | None) -> str | float:
    """A file's label as a label name (GLUE: digits index the task's names) or a score."""
    if glue is None:
        return str(value)
    if glue.labels is None:
        return float(value)
    name = str(value)
    if name.isdigit() and int(name) < len(glue.labels):
        name = glue.labels[int(name)]
    if name not in glue.labels:
        raise ValueError(f"label {value!r} is not one of {glue.labels}")
    return name


def _example(record: dict[str, Any], glue: GlueTask | None, layout: tuple[str, str | None, str]) -> TextExample:
    text_a, text_b, label = layout
    return TextExample(record[text_a], None if text_b is None else record[text_b], _label(record[label], glue))


def read_text_file(path: str | Path, task_name: str | None = None) -> list[TextExample]:
    """Read a GLUE ``.tsv`` (with ``task_name``) or a headed ``.csv``/``.tsv``/``.json``/``.jsonl``.

    Raises:
        FlagError: ``task_name`` is not a GLUE task.
        DataFileError: a row with a missing field, wrong field count or unknown label.
    """
    glue = _glue_task(task_name)
    glue_tsv = glue is not None and Path(path).suffix.lower() == ".tsv"
    examples, layout = [], None
    for line, record in read_records(path, fieldnames=glue.columns if glue_tsv else None):
        try:
            if layout is None:
                layout = (glue.text_a, glue.text_b, glue.label) if glue_tsv else (*_text_columns(list(record)), "label")
            examples.append(_example(record, glue, layout))
        except KeyError as err:
            raise DataFileError(path, line, f"missing column {err}") from None
        except ValueError as err:
            raise DataFileError(path, line, str(err)) from None
    return examples


def _from_hub_row(row: dict[str, Any], glue: GlueTask | None) -> TextExample:
    return _example(row, glue, (*_text_columns(list(row)), "label"))


def synthetic_examples(n: int, text: SyntheticText, task_name: str) -> list[TextExample]:
    """``n`` random examples with the lengths and labels of a GLUE task (module docstring)."""
    if task_name not in _SYNTHETIC_TOKENS:
        raise FlagError(
            f"--synthetic with --task_name {task_name}: no length table for it; "
            f"choose one of: {', '.join(_SYNTHETIC_TOKENS)}"
        )
    labels = GLUE_TASKS[task_name].labels
    examples = []
    for total in text.lengths(_SYNTHETIC_TOKENS[task_name], n):
        if task_name in _PAIR_TASKS:
            ids = text.ids(max(total - 3, 2))
            half = len(ids) // 2
            example = TextExample(text.text(ids[:half]), text.text(ids[half:]), labels[ids[0] % len(labels)])
        else:
            ids = text.ids(max(total - 2, 1))
            example = TextExample(text.text(ids), None, labels[ids[0] % len(labels)])
        examples.append(example)
    return examples


def _features(
    examples: list[TextExample], tokenizer: Any, max_length: int, label_ids: dict[str, int] | None
) -> list[dict[str, Any]]:
    pairs = None if examples[0].text_b is None else [ex.text_b for ex in examples]
    enc = tokenizer([ex.text_a for ex in examples], pairs, truncation=True, max_length=max_length)
    labels = [ex.label if label_ids is None else label_ids[ex.label] for ex in examples]
    return [{**{k: v[i] for k, v in enc.items()}, "labels": label} for i, label in enumerate(labels)]


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2)[inverse]


def glue_metrics(task_name: str | None, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """GLUE's metrics of a task from model outputs (logits, or scores for STS-B) and label ids.

    Accuracy always (except STS-B); F1 of class 1 for MRPC/QQP; Matthews correlation for CoLA;
    Pearson and Spearman correlation for STS-B. Without a task name: accuracy only.
    """
    metrics = () if task_name is None else GLUE_TASKS[task_name].metrics
    if "pearson" in metrics:
        scores = predictions.reshape(-1)
        return {
            "pearson": float(np.corrcoef(scores, labels)[0, 1]),
            "spearmanr": float(np.corrcoef(_ranks(scores), _ranks(labels))[0, 1]),
        }
    preds = np.argmax(predictions, axis=-1)
    out = {"accuracy": float(np.mean(preds == labels))}
    if "f1" in metrics:
        tp = np.sum((preds == 1) & (labels == 1))
        out["f1"] = float(2 * tp / max(np.sum(preds == 1) + np.sum(labels == 1), 1))
    if "matthews_correlation" in metrics:
        n_classes = int(max(preds.max(), labels.max())) + 1
        confusion = np.zeros((n_classes, n_classes))
        np.add.at(confusion, (labels, preds), 1)
        t, p, c, s = confusion.sum(1), confusion.sum(0), np.trace(confusion), confusion.sum()
        denominator = np.sqrt((s**2 - p @ p) * (s**2 - t @ t))
        out["matthews_correlation"] = float((c * s - t @ p) / denominator) if denominator else 0.0
    return out


def build(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int = 42) -> TaskBundle:
    """Load classification data and a sequence-classification model (see the module docstring)."""
    task_name = data_args.task_name
    if task_name is None and data_args.dataset_name == "glue":
        task_name = data_args.dataset_config_name
    if task_name is None and data_args.synthetic:
        task_name = "mrpc"
        logger.info("--synthetic without --task_name: using the lengths, labels and metrics of GLUE MRPC")
    glue = _glue_task(task_name)
    tokenizer = load_tokenizer(model_args)
    max_length = max_seq_length(data_args, tokenizer)
    train, evals = load_splits(
        data_args,
        read_file=lambda path: read_text_file(path, task_name),
        from_hub_row=lambda row: _from_hub_row(row, glue),
        synthesize=lambda n, s: synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, s), task_name),
        seed=seed,
    )
    if glue is not None and glue.labels is None:
        label_list, config_kwargs = None, {"num_labels": 1}
    else:
        seen = {ex.label for ex in (train or []) + (evals or [])}
        label_list = list(glue.labels) if glue is not None else sorted(seen)
        config_kwargs = {
            "num_labels": len(label_list),
            "id2label": dict(enumerate(label_list)),
            "label2id": {label: i for i, label in enumerate(label_list)},
        }
    label_ids = None if label_list is None else {label: i for i, label in enumerate(label_list)}

    def features(examples: list[TextExample] | None) -> list[dict[str, Any]] | None:
        return None if not examples else _features(examples, tokenizer, max_length, label_ids)

    return TaskBundle(
        model=load_model(model_args, AutoModelForSequenceClassification, tokenizer, **config_kwargs),
        tokenizer=tokenizer,
        train_dataset=features(train),
        eval_dataset=features(evals),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: glue_metrics(task_name, p.predictions, p.label_ids),
    )
