"""token-classification: named-entity recognition on CoNLL-2003, as HF ``run_ner.py``.

Words are split into sub-tokens; the first sub-token of each word carries the word's tag and
the others are ignored (-100), or, with ``--label_all_tokens``, carry it too (``B-`` turned into
``I-``). Tags are BIO (IOB2); IOB1 input, as in the original CoNLL files, is converted on
reading. Metric: entity-level precision, recall and F1 (micro, seqeval's default BIO semantics:
an ``I-X`` after ``O`` or after another type starts an entity) plus token accuracy, computed
here without the seqeval dependency.

Data: CoNLL column files (``word POS chunk NER``, ``-DOCSTART-`` lines, a blank line between
sentences; the first column is the word and the last the tag), JSON lines with ``tokens`` and
``ner_tags``, or ``--dataset_name conll2003``.

Synthetic lengths (sub-tokens of the bert uncased vocabulary with [CLS]/[SEP], at
``QUANTILE_LEVELS``): the 14,041 sentences of CoNLL-2003 ``eng.train`` in
``shared/data/conll2003`` (mean 14.5 words, 20.0 tokens; longest 113 words, 164 tokens).
Synthetic words are one token each and their tag is a function of the word, so it is learnable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, EvalPrediction

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

__all__ = [
    "TaggedSentence",
    "read_conll",
    "iob1_to_bio",
    "entities",
    "entity_scores",
    "synthetic_examples",
    "build",
]

_SENTENCE_TOKENS = (3, 6, 7, 10, 15, 28, 40, 45, 56, 164)
_CONLL_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


@dataclass
class TaggedSentence:
    """One sentence with a BIO tag per word."""

    words: list[str]
    """The words, as split in the file."""
    tags: list[str]
    """``O``, ``B-<type>`` or ``I-<type>`` for each word."""


def iob1_to_bio(tags: list[str]) -> list[str]:
    """Convert IOB1 tags (``B-`` only between adjacent entities of a type) to BIO.

    BIO input comes back unchanged, except that an ``I-X`` that follows ``O`` or another type
    becomes ``B-X``, which is how seqeval reads it anyway.

    Example:
        >>> iob1_to_bio(["I-LOC", "I-LOC", "B-LOC", "O", "I-PER"])
        ['B-LOC', 'I-LOC', 'B-LOC', 'O', 'B-PER']
    """
    return [
        f"B-{tag[2:]}" if tag.startswith("I-") and (i == 0 or tags[i - 1][2:] != tag[2:]) else tag
        for i, tag in enumerate(tags)
    ]


def _check_tag(tag: str) -> str:
    if tag != "O" and not (tag[:2] in ("B-", "I-") and len(tag) > 2):
        raise ValueError(f"tag {tag!r} is not O, B-<type> or I-<type>")
    return tag


def read_conll(path: str | Path) -> list[TaggedSentence]:
    """Read a CoNLL column file (``.jsonl``/``.json``: one ``{"tokens", "ner_tags"}`` per line).

    Raises:
        DataFileError: a line with fewer than 2 columns or a tag that is not O/B-X/I-X.
    """
    if Path(path).suffix.lower() in (".json", ".jsonl"):
        return [_from_record(record, path, line) for line, record in read_records(path)]
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if words:
                    sentences.append(TaggedSentence(words, iob1_to_bio(tags)))
                words, tags = [], []
                continue
            if len(fields) < 2:
                raise DataFileError(path, line_no, "expected 'word ... tag' columns (CoNLL-2003: word POS chunk NER)")
            try:
                tags.append(_check_tag(fields[-1]))
            except ValueError as err:
                raise DataFileError(path, line_no, str(err)) from None
            words.append(fields[0])
    if words:
        sentences.append(TaggedSentence(words, iob1_to_bio(tags)))
    return sentences


def _from_record(record: dict[str, Any], path: str | Path = "<hub>", line: int = 0) -> TaggedSentence:
    try:
        words, tags = list(record["tokens"]), [_check_tag(t) for t in record["ner_tags"]]
    except KeyError as err:
        raise DataFileError(path, line, f"missing field {err}") from None
    except ValueError as err:
        raise DataFileError(path, line, str(err)) from None
    if len(words) != len(tags):
        raise DataFileError(path, line, f"{len(words)} tokens but {len(tags)} tags")
    return TaggedSentence(words, iob1_to_bio(tags))


def synthetic_examples(n: int, text: SyntheticText) -> list[TaggedSentence]:
    """``n`` random sentences with CoNLL-2003 lengths; each word's tag follows from the word."""
    sentences = []
    for total in text.lengths(_SENTENCE_TOKENS, n):
        ids = text.ids(max(total - 2, 1))
        tags = [_CONLL_LABELS[i % len(_CONLL_LABELS)] for i in ids]
        sentences.append(TaggedSentence([text.words[i] for i in ids], tags))
    return sentences


def _label_list(sentences: list[TaggedSentence]) -> list[str]:
    """O, then B-/I- of every entity type seen, types sorted."""
    types = sorted({tag[2:] for s in sentences for tag in s.tags if tag != "O"})
    return ["O"] + [f"{prefix}-{t}" for t in types for prefix in "BI"]


def _features(
    sentences: list[TaggedSentence], tokenizer: Any, max_length: int, label_ids: dict[str, int], label_all_tokens: bool
) -> list[dict[str, Any]]:
    enc = tokenizer([s.words for s in sentences], is_split_into_words=True, truncation=True, max_length=max_length)
    features = []
    for i, sentence in enumerate(sentences):
        labels, previous = [], None
        for word in enc.word_ids(i):
            if word is None:
                labels.append(-100)
            elif word != previous:
                labels.append(label_ids[sentence.tags[word]])
            else:
                labels.append(label_ids[sentence.tags[word].replace("B-", "I-", 1)] if label_all_tokens else -100)
            previous = word
        features.append({**{k: v[i] for k, v in enc.items()}, "labels": labels})
    return features


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """The entities of a BIO sequence as ``(type, start, end)`` (end exclusive), seqeval-style.

    Example:
        >>> sorted(entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"]))
        [('LOC', 3, 4), ('LOC', 4, 5), ('PER', 0, 2)]
    """
    found, kind, start = set(), None, 0
    for i, tag in enumerate([*tags, "O"]):
        prefix, tag_type = tag[:1], tag[2:]
        if kind is not None and (prefix != "I" or tag_type != kind):
            found.add((kind, start, i))
            kind = None
        if prefix == "B" or (prefix == "I" and kind is None):
            kind, start = tag_type, i
    return found


def entity_scores(true_tags: list[list[str]], pred_tags: list[list[str]]) -> dict[str, float]:
    """Micro entity precision/recall/F1 over sentences, and token accuracy (as run_ner reports)."""
    true_n = pred_n = correct = 0
    for truth, pred in zip(true_tags, pred_tags):
        t, p = entities(truth), entities(pred)
        true_n, pred_n, correct = true_n + len(t), pred_n + len(p), correct + len(t & p)
    precision = correct / pred_n if pred_n else 0.0
    recall = correct / true_n if true_n else 0.0
    tokens = [(a == b) for truth, pred in zip(true_tags, pred_tags) for a, b in zip(truth, pred)]
    return {
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "accuracy": float(np.mean(tokens)) if tokens else 0.0,
    }


def build(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int = 42) -> TaskBundle:
    """Load CoNLL-style data and a token-classification model (see the module docstring)."""
    tokenizer = load_tokenizer(model_args)
    max_length = max_seq_length(data_args, tokenizer)
    train, evals = load_splits(
        data_args,
        read_file=read_conll,
        from_hub_row=_from_record,
        synthesize=lambda n, s: synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, s)),
        seed=seed,
    )
    label_list = _label_list((train or []) + (evals or []))
    label_ids = {label: i for i, label in enumerate(label_list)}

    def features(sentences: list[TaggedSentence] | None) -> list[dict[str, Any]] | None:
        if not sentences:
            return None
        return _features(sentences, tokenizer, max_length, label_ids, data_args.label_all_tokens)

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        predictions = np.argmax(p.predictions, axis=-1)
        keep = [row != -100 for row in p.label_ids]
        true = [[label_list[i] for i in row[k]] for row, k in zip(p.label_ids, keep)]
        pred = [[label_list[i] for i in row[k]] for row, k in zip(predictions, keep)]
        return entity_scores(true, pred)

    return TaskBundle(
        model=load_model(
            model_args,
            AutoModelForTokenClassification,
            tokenizer,
            num_labels=len(label_list),
            id2label=dict(enumerate(label_list)),
            label2id=label_ids,
        ),
        tokenizer=tokenizer,
        train_dataset=features(train),
        eval_dataset=features(evals),
        data_collator=DataCollatorForTokenClassification(tokenizer),
        compute_metrics=compute_metrics,
    )
