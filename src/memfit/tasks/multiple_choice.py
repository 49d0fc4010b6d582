"""multiple-choice: pick the right ending of a situation out of 4 (SWAG), as HF ``run_swag.py``.

Each example becomes 4 sequences ``[CLS] sent1 [SEP] sent2 ending_i [SEP]``; a batch of B
examples is padded to its longest choice and reaches the encoder as (B*4, L). Metric: accuracy.

Data: SWAG ``.csv`` as distributed (``[index,]video-id,fold-ind,startphrase,sent1,sent2,
gold-source,ending0..ending3,label``), JSON lines with ``sent1, sent2, ending0..3, label``, or
``--dataset_name swag --dataset_config_name regular``.

Synthetic lengths (tokens of the bert uncased vocabulary, at ``QUANTILE_LEVELS``): only a
10-row sample of SWAG was available (HF transformers ``tests/fixtures/tests_samples/swag``), so
the tables below are that sample's quantiles and only an imitation of the real dataset: 10
contexts (``sent1``: mean 10.6 tokens) and 40 second segments (``sent2 + " " + ending``: mean
12.1 tokens), i.e. 16-40 tokens per choice with the specials. SWAG's captions (LSMDC and
ActivityNet, Zellers et al. 2018) have longer tails than 10 rows can show.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForMultipleChoice, DataCollatorForMultipleChoice, EvalPrediction

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

__all__ = ["NUM_CHOICES", "ChoiceExample", "read_swag", "synthetic_examples", "accuracy", "build"]

NUM_CHOICES = 4

_SENT1_TOKENS = (7, 7, 7, 9, 10, 13, 13, 14, 14, 14)
_SECOND_SEGMENT_TOKENS = (6, 6, 8, 9, 11, 14, 18, 20, 23, 24)


@dataclass
class ChoiceExample:
    """One SWAG question."""

    sent1: str
    """The context sentence."""
    sent2: str
    """The start of the next sentence; each ending completes it."""
    endings: list[str]
    """The ``NUM_CHOICES`` candidate endings."""
    label: int
    """Index of the right ending."""


def _example(record: dict[str, Any]) -> ChoiceExample:
    label = int(record["label"])
    if not 0 <= label < NUM_CHOICES:
        raise ValueError(f"label {label} is not an ending index 0-{NUM_CHOICES - 1}")
    endings = [record[f"ending{i}"] for i in range(NUM_CHOICES)]
    return ChoiceExample(sent1=record["sent1"], sent2=record["sent2"], endings=endings, label=label)


def read_swag(path: str | Path) -> list[ChoiceExample]:
    """Read a SWAG ``.csv`` (as distributed) or a ``.jsonl`` file.

    Raises:
        DataFileError: a row lacks a field or has a label outside 0-3 (names file and line).
    """
    examples = []
    for line, record in read_records(path):
        try:
            examples.append(_example(record))
        except KeyError as err:
            raise DataFileError(path, line, f"missing field {err}") from None
        except ValueError as err:
            raise DataFileError(path, line, str(err)) from None
    return examples


def synthetic_examples(n: int, text: SyntheticText) -> list[ChoiceExample]:
    """``n`` random questions with SWAG-like lengths (module docstring).

    The right ending starts with the marker word, so the label is learnable.
    """
    contexts = text.lengths(_SENT1_TOKENS, n)
    segments = text.lengths(_SECOND_SEGMENT_TOKENS, (n, NUM_CHOICES))
    labels = text.rng.integers(NUM_CHOICES, size=n)
    examples = []
    for i in range(n):
        endings = []
        for c in range(NUM_CHOICES):
            ids = text.ids(segments[i, c])
            if c == labels[i]:
                ids[0] = 0
            endings.append(text.text(ids))
        examples.append(ChoiceExample(text.text(text.ids(contexts[i])), "", endings, int(labels[i])))
    return examples


def _features(examples: list[ChoiceExample], tokenizer: Any, max_length: int) -> list[dict[str, Any]]:
    firsts = [ex.sent1 for ex in examples for _ in range(NUM_CHOICES)]
    seconds = [f"{ex.sent2} {ending}".strip() for ex in examples for ending in ex.endings]
    enc = tokenizer(firsts, seconds, truncation=True, max_length=max_length)
    return [
        {**{k: v[i * NUM_CHOICES : (i + 1) * NUM_CHOICES] for k, v in enc.items()}, "labels": ex.label}
        for i, ex in enumerate(examples)
    ]


def accuracy(p: EvalPrediction) -> dict[str, float]:
    """Fraction of questions whose highest-scoring choice is the right one."""
    return {"accuracy": float(np.mean(np.argmax(p.predictions, axis=-1) == p.label_ids))}


def build(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int = 42) -> TaskBundle:
    """Load SWAG-style data and a multiple-choice model (see the module docstring)."""
    tokenizer = load_tokenizer(model_args)
    max_length = max_seq_length(data_args, tokenizer)
    train, evals = load_splits(
        data_args,
        read_file=read_swag,
        from_hub_row=_example,
        synthesize=lambda n, s: synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, s)),
        seed=seed,
    )
    return TaskBundle(
        model=load_model(model_args, AutoModelForMultipleChoice, tokenizer),
        tokenizer=tokenizer,
        train_dataset=None if train is None else _features(train, tokenizer, max_length),
        eval_dataset=None if evals is None else _features(evals, tokenizer, max_length),
        data_collator=DataCollatorForMultipleChoice(tokenizer),
        compute_metrics=accuracy,
    )
