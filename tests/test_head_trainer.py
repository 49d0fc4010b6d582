"""The LM head planned everywhere a user trains (issue 39): the memfit Trainer computes the loss
through the planned head with ``num_items_in_batch`` over a gradient-accumulation window (weights
equal a plain ``transformers.Trainer``'s within float32 tolerance), ``--memfit_head`` on the
command line (the start line names the head's treatment; a bad value is one line, exit 2), and
TRL's ``SFTTrainer`` plans it too, ``--memfit_head keep`` leaving it to TRL's loss (NOTE [TRL's loss
through memfit's head])."""

from __future__ import annotations

import json

import pytest
import torch

tf = pytest.importorskip("transformers")

import memfit  # noqa: E402
from memfit import cli  # noqa: E402

VOCAB = 8000


def _llama() -> "tf.LlamaForCausalLM":
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              intermediate_size=37, vocab_size=VOCAB, use_cache=False))


class _Rows(torch.utils.data.Dataset):
    """16 rows of 64 tokens; the first tokens of some rows are ignored, so micro-batches count
    different numbers of items and ``num_items_in_batch`` matters."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (16, 64), generator=g)
        self.labels = self.ids.clone()
        for i in range(0, 16, 3):
            self.labels[i, : 8 * (i % 5 + 1)] = -100

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _flags(out, **extra):
    return dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True, seed=0, logging_steps=1, **extra)


def test_the_trainer_chunks_the_head_with_num_items_in_batch_and_matches_a_plain_trainer(tmp_path, capsys):
    plain = tf.Trainer(model=_llama(), args=tf.TrainingArguments(**_flags(tmp_path / "plain")), train_dataset=_Rows())
    plain.train()
    args = memfit.TrainingArguments(**_flags(tmp_path / "memfit", memory_budget="12MB", memfit_method="dynamic", memfit_head="auto"))
    trainer = memfit.Trainer(model=_llama(), args=args, train_dataset=_Rows())
    trainer.train()
    assert "LM head planned per batch" in capsys.readouterr().err
    heads = [r.treatments.get("head") for r in trainer.memfit.records]
    assert heads and all(h is not None and h.startswith("chunked:") for h in heads), heads
    assert trainer.memfit.head.part.switch.chunked_forwards == len(heads)
    for (name, p), q in zip(plain.model.named_parameters(), trainer.model.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")


def test_memfit_head_keep_leaves_the_head_to_the_model(tmp_path, capsys):
    args = memfit.TrainingArguments(**_flags(tmp_path, memory_budget="1GB", memfit_method="dynamic", memfit_head="keep"))
    trainer = memfit.Trainer(model=_llama(), args=args, train_dataset=_Rows())
    trainer.train()
    assert trainer.memfit.head.part is None and "LM head kept (" in capsys.readouterr().err
    assert all("head" not in r.treatments for r in trainer.memfit.records)


def test_a_trainer_class_with_its_own_compute_loss_keeps_the_head_under_auto(tmp_path):
    class Own(memfit.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    args = memfit.TrainingArguments(**_flags(tmp_path, memory_budget="1GB", memfit_method="dynamic", memfit_head="auto"))
    trainer = Own(model=_llama(), args=args, train_dataset=_Rows())
    assert trainer.memfit.head.part is None and "Own.compute_loss" in trainer.memfit.head.words


def test_cli_start_line_names_the_head_and_a_bad_value_is_one_line(tmp_path, capsys):
    from memfit.cli.train import run

    flags = ["--do_train", "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none",
             "--save_strategy", "no", "--use_cpu", "--memory_budget", "1GB", "--memfit_method", "dynamic",
             "--synthetic", "8", "--max_seq_length", "48"]
    run("causal-lm", [*flags, "--output_dir", str(tmp_path / "auto"), "--memfit_head", "auto"])
    err = capsys.readouterr().err
    assert "memfit: method dynamic" in err and "LM head planned per batch" in err
    records = [json.loads(line) for line in (tmp_path / "auto" / "memfit_steps.jsonl").read_text().splitlines()]
    assert all("head" in r["treatments"] for r in records)
    run("causal-lm", [*flags, "--output_dir", str(tmp_path / "keep"), "--memfit_head", "keep"])
    assert "LM head kept (" in capsys.readouterr().err
    assert cli.main(["train", "causal-lm", *flags, "--output_dir", str(tmp_path / "bad"), "--memfit_head", "chunky"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memfit_head 'chunky'" in err[0] and "Traceback" not in err[0]


def test_trl_sft_trainer_plans_the_head_and_keep_leaves_it_to_trls_loss(tmp_path, capsys):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from memfit.trl import SFTConfig, SFTTrainer

    from _models import FIXTURES
    from memfit.tasks._common import ModelArguments, minilm_path
    from memfit.tasks.causal_lm import lm_tokenizer

    tokenizer = lm_tokenizer(ModelArguments(tokenizer_name=str(minilm_path())))
    rows = datasets.Dataset.from_list([json.loads(line) for line in (FIXTURES / "sft" / "chat.jsonl").read_text().splitlines()])

    def trainer(head):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                   intermediate_size=37, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                   use_cache=False))
        args = SFTConfig(output_dir=str(tmp_path / head), max_steps=2, per_device_train_batch_size=4, use_cpu=True, report_to="none",
                         save_strategy="no", bf16=False, memory_budget="1GB", memfit_method="dynamic", memfit_head=head)
        return SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)

    auto = trainer("auto")
    auto.train()
    assert "LM head planned per batch" in capsys.readouterr().err
    assert all("head" in r.treatments for r in auto.memfit.records)
    assert trainer("plan").memfit.head.part is not None
    keep = trainer("keep")
    assert keep.memfit.head.part is None and keep.memfit.head.words.startswith("LM head left to TRL's loss (")
