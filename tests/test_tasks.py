"""Task recipes without the Trainer: readers of the real formats (fixtures), features and
dynamic padding, a forward + backward on a collated batch, metrics against hand-computed values,
the synthetic generators, offline model resolution and the error messages."""

from __future__ import annotations

import json
import logging
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, EvalPrediction

from _models import FIXTURES, TINY_BERT
from memfit.tasks import DataFileError, DataTrainingArguments, ModelArguments, get_task
from memfit.tasks import multiple_choice as mc
from memfit.tasks import question_answering as qa
from memfit.tasks import text_classification as tc
from memfit.tasks import token_classification as ner
from memfit.tasks._common import (
    QUANTILE_LEVELS,
    SyntheticText,
    load_model,
    load_splits,
    load_tokenizer,
    max_seq_length,
    minilm_path,
)


FIXTURE_DATA = {
    "multiple-choice": dict(train_file="swag/sample.csv", validation_file="swag/sample.jsonl"),
    "question-answering": dict(train_file="squad/dev-v1.1.slice.json", validation_file="squad/dev-v1.1.slice.json"),
    "text-classification": dict(
        task_name="mrpc", train_file="glue/MRPC/train.tsv", validation_file="glue/MRPC/dev.tsv"
    ),
    "token-classification": dict(train_file="conll2003/eng.train", validation_file="conll2003/eng.testa"),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="module")
def tiny_model_args(tmp_path_factory) -> ModelArguments:
    config = tmp_path_factory.mktemp("config") / "tiny-bert.json"
    config.write_text(json.dumps(TINY_BERT))
    return ModelArguments(config_name=str(config), tokenizer_name=str(minilm_path()))


def _sequences(features: list[dict], task: str) -> list[list[int]]:
    """The token sequences of features (a multiple-choice feature holds one per choice)."""
    return [ids for f in features for ids in (f["input_ids"] if task == "multiple-choice" else [f["input_ids"]])]


def _fixture_args(task: str, **extra) -> DataTrainingArguments:
    files = {k: str(FIXTURES / v) if k.endswith("_file") else v for k, v in FIXTURE_DATA[task].items()}
    return DataTrainingArguments(**files, **extra)


# --- every task, end to end without the Trainer -------------------------------------------


@pytest.mark.parametrize("source", ["fixtures", "synthetic"])
@pytest.mark.parametrize("task", sorted(FIXTURE_DATA))
def test_task_builds_pads_dynamically_and_trains_a_step(task, source, tiny_model_args):
    data_args = _fixture_args(task) if source == "fixtures" else DataTrainingArguments(synthetic=24)
    bundle = get_task(task).build(tiny_model_args, data_args, seed=0)
    assert bundle.train_dataset and bundle.eval_dataset
    features = bundle.train_dataset[:4]
    batch = bundle.data_collator(features)

    # padded to the batch's longest input, not to a maximum length
    assert batch["input_ids"].shape[-1] == max(len(ids) for ids in _sequences(features, task))
    if task == "multiple-choice":
        assert batch["input_ids"].shape[:2] == (4, mc.NUM_CHOICES)
    loss = bundle.model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in bundle.model.parameters() if p.requires_grad)


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="choose one of: multiple-choice, question-answering, text-classification"):
        get_task("summarization")


# --- multiple-choice ----------------------------------------------------------------------


def test_swag_csv_as_distributed_and_jsonl_read_the_same():
    from_csv = mc.read_swag(FIXTURES / "swag/sample.csv")
    assert from_csv == mc.read_swag(FIXTURES / "swag/sample.jsonl")
    assert len(from_csv) == 10 and from_csv[1].label == 3 and from_csv[0].sent2 == "A drum line"


def test_swag_bad_label_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = {"sent1": "a", "sent2": "b", "ending0": "c", "ending1": "d", "ending2": "e", "ending3": "f"}
    bad.write_text(f"{json.dumps({**row, 'label': 1})}\n\n{json.dumps({**row, 'label': 7})}\n")
    with pytest.raises(DataFileError, match=r"bad\.jsonl:3: label 7 is not an ending index 0-3"):
        mc.read_swag(bad)


def test_multiple_choice_accuracy():
    scores = np.array([[0.1, 0.9, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    assert mc.accuracy(EvalPrediction(scores, np.array([1, 2, 3]))) == {"accuracy": pytest.approx(2 / 3)}


# --- question-answering -------------------------------------------------------------------


def test_squad_reader_keeps_every_question_and_answer_offset():
    examples = qa.read_squad(FIXTURES / "squad/dev-v1.1.slice.json")
    assert len(examples) == 95
    for ex in examples:
        assert all(ex.context[s : s + len(a)] == a for a, s in zip(ex.answers, ex.answer_starts))


def test_squad_windows_overlap_and_perfect_logits_score_100(tokenizer):
    examples = qa.read_squad(FIXTURES / "squad/dev-v1.1.slice.json")
    features, windows = qa.tokenize_windows(examples, tokenizer, max_length=96, doc_stride=32)
    assert len(features) > 2 * len(examples)  # long contexts become several windows
    assert max(len(f["input_ids"]) for f in features) == 96

    # One-hot logits at the labelled span of every window that holds the answer, padded with
    # -100 to a common length as the Trainer pads predictions across batches.
    start_logits = np.full((len(features), 100), -100.0)
    end_logits = np.full((len(features), 100), -100.0)
    for i, f in enumerate(features):
        start_logits[i, : len(f["input_ids"])] = 0.0
        end_logits[i, : len(f["input_ids"])] = 0.0
        start_logits[i, f["start_positions"]] = end_logits[i, f["end_positions"]] = 10.0
    answers = qa.predict_answers(start_logits, end_logits, windows, examples)
    scores = qa.squad_scores(answers, examples)
    # 6 of the 95 gold answers are parts of a token ("8" inside "18", "gold" inside "golden"):
    # token-level predictions cannot match those exactly, here or in run_qa.
    assert scores["exact_match"] == scores["f1"] == pytest.approx(100 * 89 / 95)


def test_squad_metric_normalises_like_the_official_script():
    example = qa.QAExample("q1", "", "", ["Denver Broncos", "the Broncos"], [0, 0])
    assert qa.squad_scores({"q1": "The Broncos!"}, [example]) == {"exact_match": 100.0, "f1": 100.0}
    assert qa.squad_scores({"q1": "Denver"}, [example])["f1"] == pytest.approx(100 * 2 / 3)


def test_squad_malformed_files_name_the_place(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [\n{"title": "x",}\n]}')
    with pytest.raises(DataFileError, match=r"broken\.json:2: not valid JSON"):
        qa.read_squad(broken)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"data": [{"title": "x", "paragraphs": [{"context": "c", "qas": [{"id": "1"}]}]}]}))
    with pytest.raises(DataFileError, match=r"wrong\.json:data\[0\]\.paragraphs\[0\]\.qas\[0\]: .*'question'"):
        qa.read_squad(wrong)


# --- text-classification ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, task_name, n, pair, first_text",
    [
        ("glue/MRPC/train.tsv", "mrpc", 30, True, "Amrozi accused his brother"),
        ("glue/MRPC/dev.tsv", "mrpc", 20, True, "He said the foodservice pie business"),
        ("glue/CoLA/dev.tsv", "cola", 20, False, "The sailors rode the breeze clear of the rocks."),
        ("glue/RTE/dev.tsv", "rte", 20, True, "Dana Reeve, the widow of the actor"),
        ("glue/SST-2/dev.tsv", "sst2", 20, False, "it 's a charming and often affecting journey . "),
    ],
)
def test_glue_tsv_files_as_distributed(path, task_name, n, pair, first_text):
    examples = tc.read_text_file(FIXTURES / path, task_name)
    assert len(examples) == n
    assert examples[0].text_a.startswith(first_text)
    assert (examples[0].text_b is not None) == pair
    assert {ex.label for ex in examples} <= set(tc.GLUE_TASKS[task_name].labels)


def test_headed_csv_and_jsonl_read_like_run_glue(tmp_path):
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text('idx,sentence2,label,sentence1\n0,"b, quoted",yes,a\n')
    assert tc.read_text_file(csv_file) == [tc.TextExample("a", "b, quoted", "yes")]
    jsonl = tmp_path / "single.jsonl"
    jsonl.write_text('{"label": 3, "review": "fine"}\n')
    assert tc.read_text_file(jsonl) == [tc.TextExample("fine", None, "3")]


def test_text_classification_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--task_name mprc: not a GLUE task; choose one of: cola, sst2, mrpc"):
        tc.read_text_file(FIXTURES / "glue/MRPC/dev.tsv", "mprc")
    short = tmp_path / "dev.tsv"
    short.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tone\ttwo\n0\t3\t4\tthree\n")
    with pytest.raises(DataFileError, match=r"dev\.tsv:3: expected 5 fields, found 4"):
        tc.read_text_file(short, "mrpc")
    short.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n5\t1\t2\tone\ttwo\n")
    with pytest.raises(DataFileError, match=r"dev\.tsv:2: label '5' is not one of"):
        tc.read_text_file(short, "mrpc")


def test_glue_metrics_match_hand_computed_values():
    logits = np.eye(2)[[1, 1, 0, 0]]
    labels = np.array([1, 0, 0, 0])
    assert tc.glue_metrics("mrpc", logits, labels) == {"accuracy": 0.75, "f1": pytest.approx(2 / 3)}
    # Matthews: tp=1 fp=1 tn=2 fn=0 -> (1*2 - 1*0) / sqrt(2*3*2*1)
    assert tc.glue_metrics("cola", logits, labels)["matthews_correlation"] == pytest.approx(2 / np.sqrt(12))
    scores = np.array([[0.1], [0.4], [0.2], [3.0]])
    stsb = tc.glue_metrics("stsb", scores, np.array([1.0, 3.0, 2.0, 4.0]))
    assert stsb["spearmanr"] == pytest.approx(1.0) and 0.5 < stsb["pearson"] < 1.0
    assert tc.glue_metrics(None, logits, labels) == {"accuracy": 0.75}


# --- token-classification -----------------------------------------------------------------


def test_conll_reader_skips_docstart_and_converts_iob1_to_bio():
    sentences = ner.read_conll(FIXTURES / "conll2003/eng.train")
    assert sentences[0].words[:3] == ["EU", "rejects", "German"]
    assert sentences[0].tags[:3] == ["B-ORG", "O", "B-MISC"]
    assert not any("-DOCSTART-" in s.words for s in sentences)
    golan = next(s for s in sentences if "Golan" in s.words)
    i = golan.words.index("Golan")
    assert golan.tags[i : i + 3] == ["B-LOC", "I-LOC", "B-LOC"]  # "Golan Heights" then "Israel" (IOB1 B-LOC)


def test_conll_malformed_lines_name_file_and_line(tmp_path):
    bad = tmp_path / "eng.bad"
    bad.write_text("-DOCSTART- -X- O O\n\nEU NNP I-NP I-ORG\nrejects\n")
    with pytest.raises(DataFileError, match=r"eng\.bad:4: expected 'word \.\.\. tag' columns"):
        ner.read_conll(bad)
    bad.write_text("EU NNP I-NP X-ORG\n")
    with pytest.raises(DataFileError, match=r"eng\.bad:1: tag 'X-ORG' is not O, B-<type> or I-<type>"):
        ner.read_conll(bad)


@pytest.mark.parametrize(
    "tags, expected",
    [
        (["B-PER", "I-PER", "O"], {("PER", 0, 2)}),
        (["I-PER", "I-PER"], {("PER", 0, 2)}),  # I- after O starts an entity (seqeval default)
        (["B-PER", "B-PER"], {("PER", 0, 1), ("PER", 1, 2)}),
        (["B-PER", "I-LOC"], {("PER", 0, 1), ("LOC", 1, 2)}),  # type change ends one and starts another
        (["O", "O"], set()),
    ],
)
def test_entities_follow_seqeval_semantics(tags, expected):
    assert ner.entities(tags) == expected


def test_entity_scores():
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "B-MISC"]]
    scores = ner.entity_scores(true, pred)
    assert scores["precision"] == pytest.approx(2 / 3) and scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 / 3) and scores["accuracy"] == pytest.approx(4 / 6)


@pytest.mark.parametrize(
    "label_all_tokens, expected", [(False, ["B-PER", None, None, "O"]), (True, ["B-PER", "I-PER", "I-PER", "O"])]
)
def test_sub_token_labels(tokenizer, label_all_tokens, expected):
    sentence = ner.TaggedSentence(["Netanyahu", "spoke"], ["B-PER", "O"])
    assert tokenizer.tokenize("Netanyahu") == ["net", "##any", "##ahu"]
    label_ids = {label: i for i, label in enumerate(["O", "B-PER", "I-PER"])}
    [feature] = ner._features([sentence], tokenizer, 16, label_ids, label_all_tokens)
    names = [None if i == -100 else ["O", "B-PER", "I-PER"][i] for i in feature["labels"]]
    assert names == [None, *expected, None]  # [CLS] and [SEP] are ignored


# --- synthetic data -----------------------------------------------------------------------


def test_synthetic_words_are_one_token_each_and_lengths_follow_the_table(tokenizer):
    text = SyntheticText.for_tokenizer(tokenizer, seed=0)
    ids = text.ids(50)
    assert len(tokenizer(text.text(ids), add_special_tokens=False)["input_ids"]) == 50
    table = (4, 7, 8, 10, 12, 15, 18, 20, 25, 38)
    quantiles = np.percentile(text.lengths(table, 20_000), [100 * q for q in QUANTILE_LEVELS])
    np.testing.assert_allclose(quantiles, table, atol=1.0)


@pytest.mark.parametrize(
    "task, median_tokens",
    # medians of the real data tokenized with the bert uncased vocabulary (see each module)
    [("multiple-choice", 25), ("question-answering", 163), ("text-classification", 53), ("token-classification", 15)],
)
def test_synthetic_feature_lengths_imitate_the_real_data(task, median_tokens, tiny_model_args):
    bundle = get_task(task).build(tiny_model_args, DataTrainingArguments(synthetic=300), seed=1)
    lengths = [len(ids) for ids in _sequences(bundle.train_dataset, task)]
    assert np.median(lengths) == pytest.approx(median_tokens, rel=0.15)
    assert len(bundle.eval_dataset) >= 30 // (4 if task == "multiple-choice" else 1)


# --- model, tokenizer and data resolution -------------------------------------------------


def test_bundled_config_offline_with_tokenizer_fallback(caplog):
    model_args = ModelArguments(config_name="bert-base-cased")
    with caplog.at_level(logging.INFO):
        tokenizer = load_tokenizer(model_args)
        model = load_model(model_args, AutoModelForSequenceClassification, tokenizer, num_labels=3)
    assert len(tokenizer) == 30522  # the MiniLM tokenizer (uncased BERT vocabulary)
    assert model.config.vocab_size == 30522 and model.config.hidden_size == 768 and model.num_labels == 3
    assert "using the MiniLM tokenizer" in caplog.text
    assert "config bert-base-cased: memfit's bundled copy" in caplog.text  # read directly, not after a hub miss
    assert "config vocab_size 28996 is smaller than the tokenizer's 30522 tokens" in caplog.text


def test_default_model_is_the_pretrained_minilm(tokenizer):
    model = load_model(ModelArguments(), AutoModelForSequenceClassification, tokenizer, num_labels=2)
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6


def test_unknown_config_lists_the_bundled_ones():
    bundled = "Llama-3.1-8B, Llama-3.2-1B, Llama-3.2-3B, OLMo-2-0425-1B, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen3-1.7B, SmolLM-360M, " \
        "bert-base-cased, bert-base-uncased, bert-large-uncased, " \
        "conditional-detr-swin-base, conditional-detr-swin-micro, conditional-detr-swin-small, " \
        "conditional-detr-swin-tiny, gemma-2-2b, llama-tiny, roberta-base"
    with pytest.raises(OSError, match=f"bundled: {bundled}"):
        load_model(ModelArguments(config_name="no-such/model"), AutoModelForSequenceClassification, None)


def test_data_errors_name_the_flag_to_change(tokenizer):
    def load(**kwargs):
        return load_splits(DataTrainingArguments(**kwargs), read_file=list, from_hub_row=dict, synthesize=None, seed=0)

    with pytest.raises(FileNotFoundError, match="--validation_file missing.tsv: no such file"):
        load(validation_file="missing.tsv")
    with pytest.raises(ValueError, match="--synthetic replaces the data"):
        load(synthetic=8, train_file="x.tsv")
    with pytest.raises(ValueError, match="--max_seq_length 1024 exceeds the model's limit of 512 tokens"):
        max_seq_length(DataTrainingArguments(max_seq_length=1024), tokenizer)
    if find_spec("datasets") is None:
        with pytest.raises(ImportError, match="pip install datasets.*--train_file"):
            load(dataset_name="glue", dataset_config_name="mrpc")
