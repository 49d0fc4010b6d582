"""question-answering: extractive QA on SQuAD v1.1, as HF ``run_qa.py``.

A question and its context become ``[CLS] question [SEP] context [SEP]``; a context too long for
``--max_seq_length`` is cut into windows that share ``--doc_stride`` tokens, each a feature of its
own (its answer span, or [CLS] when the answer is not inside it). For evaluation the start/end
logits of all windows of a question are turned back into the best-scoring answer text (at most
``--n_best_size`` candidates per side, ``--max_answer_length`` tokens), scored with the official
SQuAD v1.1 exact match and F1 (0-100; answers lower-cased, punctuation and articles removed).

Data: SQuAD JSON as distributed (``data -> paragraphs -> qas``) or ``--dataset_name squad``.

Synthetic lengths (tokens of the bert uncased vocabulary, without specials, at
``QUANTILE_LEVELS``), from the complete SQuAD v1.1 dev set (10,570 questions; there is no train
split offline) in ``shared/data/squad_v1.1``: question mean 12.6 tokens; context per question
(each question counts its paragraph) mean 161.0 tokens. With doc_stride 128 this gives 10,784
windows at 384 tokens (mean 176) and 10,626 at 512. Synthetic answers are random spans of 1-3
words, so the labels are not learnable.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForQuestionAnswering, DataCollatorWithPadding, EvalPrediction

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
)

__all__ = [
    "QAExample",
    "Window",
    "read_squad",
    "tokenize_windows",
    "synthetic_examples",
    "predict_answers",
    "squad_scores",
    "build",
]

_QUESTION_TOKENS = (4, 7, 8, 10, 12, 15, 18, 20, 25, 38)
_CONTEXT_TOKENS = (30, 73, 95, 117, 147, 188, 247, 284, 432, 789)


@dataclass
class QAExample:
    """One question about one context."""

    id: str
    """The question id (unique in the file)."""
    question: str
    """The question text."""
    context: str
    """The paragraph that holds the answer."""
    answers: list[str]
    """Accepted answer texts (the first one is trained on)."""
    answer_starts: list[int]
    """Character offset of each answer in ``context``."""


@dataclass
class Window:
    """What post-processing needs to know about one feature (one window of a context)."""

    example: int
    """Index of its example in the evaluation examples."""
    offsets: list[tuple[int, int] | None]
    """Character span in the context of each token; ``None`` for tokens outside the context."""


def read_squad(path: str | Path) -> list[QAExample]:
    """Read a SQuAD v1.1 JSON file.

    Raises:
        DataFileError: invalid JSON (with its line) or a missing key (with its place in the file).
    """
    with open(path, encoding="utf-8") as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as err:
            raise DataFileError(path, err.lineno, f"not valid JSON ({err.msg})") from None
    examples, where = [], "data"
    try:
        for a, article in enumerate(document["data"]):
            for p, paragraph in enumerate(article["paragraphs"]):
                for q, qa in enumerate(paragraph["qas"]):
                    where = f"data[{a}].paragraphs[{p}].qas[{q}]"
                    examples.append(
                        QAExample(
                            id=str(qa["id"]),
                            question=qa["question"],
                            context=paragraph["context"],
                            answers=[answer["text"] for answer in qa["answers"]],
                            answer_starts=[int(answer["answer_start"]) for answer in qa["answers"]],
                        )
                    )
    except (KeyError, TypeError) as err:
        raise DataFileError(path, where, f"not SQuAD JSON: missing or wrong key {err}") from None
    return examples


def _from_hub_row(row: dict[str, Any]) -> QAExample:
    answers = row["answers"]
    return QAExample(row["id"], row["question"], row["context"], list(answers["text"]), list(answers["answer_start"]))


def synthetic_examples(n: int, text: SyntheticText) -> list[QAExample]:
    """``n`` random questions and contexts with SQuAD-like lengths (module docstring)."""
    questions = text.lengths(_QUESTION_TOKENS, n)
    contexts = text.lengths(_CONTEXT_TOKENS, n)
    examples = []
    for i in range(n):
        words = [text.words[j] for j in text.ids(contexts[i])]
        start = int(text.rng.integers(len(words)))
        answer = " ".join(words[start : start + int(text.rng.integers(1, 4))])
        char_start = len(" ".join(words[:start])) + (start > 0)
        question = text.text(text.ids(questions[i]))
        examples.append(QAExample(f"synthetic-{i}", question, " ".join(words), [answer], [char_start]))
    return examples


def _answer_tokens(offsets: list[tuple[int, int] | None], start_char: int, end_char: int) -> tuple[int, int]:
    """Token span of ``[start_char, end_char)`` in one window; (0, 0), i.e. [CLS], if not inside."""
    context = [t for t, span in enumerate(offsets) if span is not None]
    if not context or offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return 0, 0
    start = max(t for t in context if offsets[t][0] <= start_char)
    end = min(t for t in context if offsets[t][1] >= end_char)
    return start, end


def tokenize_windows(
    examples: list[QAExample], tokenizer: Any, max_length: int, doc_stride: int
) -> tuple[list[dict[str, Any]], list[Window]]:
    """Features (one per window, labelled with the answer's token span) and their windows."""
    enc = tokenizer(
        [ex.question.lstrip() for ex in examples],
        [ex.context for ex in examples],
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    features, windows = [], []
    for i, example_index in enumerate(enc["overflow_to_sample_mapping"]):
        ex = examples[example_index]
        spans = zip(enc["offset_mapping"][i], enc.sequence_ids(i))
        offsets = [tuple(span) if sequence == 1 else None for span, sequence in spans]
        start, end = (0, 0)
        if ex.answers:
            start, end = _answer_tokens(offsets, ex.answer_starts[0], ex.answer_starts[0] + len(ex.answers[0]))
        feature = {k: enc[k][i] for k in tokenizer.model_input_names if k in enc}
        features.append({**feature, "start_positions": start, "end_positions": end})
        windows.append(Window(example_index, offsets))
    return features, windows


def predict_answers(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    windows: list[Window],
    examples: list[QAExample],
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """The best-scoring answer text of each example over all its windows (as ``run_qa``).

    ``start_logits``/``end_logits`` are (n_windows, L) with L at least each window's length
    (the Trainer pads them with -100 across batches; positions past a window are ignored).
    Returns ``{example id: answer text}`` (empty when no valid span was found).
    """
    best: dict[int, tuple[float, str]] = {}
    for w, window in enumerate(windows):
        n = len(window.offsets)
        starts, ends = start_logits[w, :n], end_logits[w, :n]
        best_ends = np.argsort(ends)[::-1][:n_best_size]
        for s in np.argsort(starts)[::-1][:n_best_size]:
            for e in best_ends:
                if window.offsets[s] is None or window.offsets[e] is None or not 0 <= e - s < max_answer_length:
                    continue
                score = float(starts[s] + ends[e])
                if score > best.get(window.example, (-np.inf, ""))[0]:
                    context = examples[window.example].context
                    best[window.example] = (score, context[window.offsets[s][0] : window.offsets[e][1]])
    return {ex.id: best.get(i, (0.0, ""))[1] for i, ex in enumerate(examples)}


def _normalize(text: str) -> str:
    """SQuAD v1.1 answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _f1(prediction: str, truth: str) -> float:
    pred, gold = _normalize(prediction).split(), _normalize(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], examples: list[QAExample]) -> dict[str, float]:
    """Official SQuAD v1.1 ``exact_match`` and ``f1`` (0-100; best over each question's answers)."""
    exact = [max(_normalize(predictions[ex.id]) == _normalize(a) for a in ex.answers) for ex in examples]
    f1 = [max(_f1(predictions[ex.id], a) for a in ex.answers) for ex in examples]
    return {"exact_match": 100.0 * float(np.mean(exact)), "f1": 100.0 * float(np.mean(f1))}


def build(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int = 42) -> TaskBundle:
    """Load SQuAD-style data and a question-answering model (see the module docstring)."""
    tokenizer = load_tokenizer(model_args)
    max_length = max_seq_length(data_args, tokenizer)
    train, evals = load_splits(
        data_args,
        read_file=read_squad,
        from_hub_row=_from_hub_row,
        synthesize=lambda n, s: synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, s)),
        seed=seed,
    )
    stride = data_args.doc_stride
    train_features = None if train is None else tokenize_windows(train, tokenizer, max_length, stride)[0]
    eval_features, windows = (None, []) if evals is None else tokenize_windows(evals, tokenizer, max_length, stride)
    # Examples without an answer cannot be scored (SQuAD v1.1 has none; a v2.0 file would).
    scored = [ex for ex in evals or [] if ex.answers]

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        start_logits, end_logits = p.predictions[:2]
        answers = predict_answers(
            start_logits, end_logits, windows, evals, data_args.n_best_size, data_args.max_answer_length
        )
        return squad_scores(answers, scored)

    return TaskBundle(
        model=load_model(model_args, AutoModelForQuestionAnswering, tokenizer),
        tokenizer=tokenizer,
        train_dataset=train_features,
        eval_dataset=eval_features,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )
