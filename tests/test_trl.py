"""TRL's SFTTrainer with memfit (memfit.trl): planning under a budget, records, and an OOM
replayed to the weights of a run without it; TRL's loss through memfit's planned head (NOTE [TRL's
loss through memfit's head]), and who keeps the head where memfit cannot compute TRL's loss; the mixin
on other Trainer classes."""

import json
import re
import sys

import pytest
import torch
import transformers

import memfit
from _models import FIXTURES, InjectOOM
from memfit.integrations.hf import MemfitTrainerMixin, with_memfit
from memfit.tasks._common import ModelArguments, minilm_path
from memfit.tasks.causal_lm import lm_tokenizer

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from memfit.errors import FlagError  # noqa: E402
from memfit.trl import SFTConfig, SFTTrainer  # noqa: E402

BUDGET = "150MB"


@pytest.fixture(scope="module")
def tokenizer():
    return lm_tokenizer(ModelArguments(tokenizer_name=str(minilm_path())))


@pytest.fixture(scope="module")
def chats():
    """The 20 chat conversations of the SFT fixture, as TRL's conversational dataset."""
    rows = [json.loads(line) for line in (FIXTURES / "sft" / "chat.jsonl").read_text().splitlines()]
    return datasets.Dataset.from_list(rows)


def _sft_trainer(tmp_path, name, tokenizer, chats, accumulation=1, compute_loss_func=None, **extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=37,
        vocab_size=len(tokenizer), attention_dropout=0.1, pad_token_id=tokenizer.pad_token_id, use_cache=False,
    )
    args = SFTConfig(
        output_dir=str(tmp_path / name), max_steps=6 // accumulation, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, bf16=False, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, seed=0, memory_budget=BUDGET, memfit_method="dynamic", **extra,
    )
    return SFTTrainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=chats, processing_class=tokenizer,
                      compute_loss_func=compute_loss_func)


def test_sft_trainer_plans_under_the_budget_and_writes_records(tmp_path, tokenizer, chats):
    trainer = _sft_trainer(tmp_path, "run", tokenizer, chats)
    assert isinstance(trainer, MemfitTrainerMixin) and len(trainer.memfit.blocks) == 3
    trainer.train()
    records = trainer.memfit.records
    assert len(records) == 6 and {r.method for r in records} == {"dynamic"}
    assert all(r.budget_bytes == 150 * 10**6 and r.peak_allocated_bytes <= r.budget_bytes for r in records)
    assert any(r.phase == "steady" for r in records)
    lines = (tmp_path / "run" / "memfit_steps.jsonl").read_text().splitlines()
    summary = json.loads((tmp_path / "run" / "memfit_summary.json").read_text())
    assert len(lines) == 6 and summary["steps"] == 6 and summary["method"] == "dynamic"
    assert any("memfit/peak_gib" in h for h in trainer.state.log_history)


def test_sft_trainer_oom_replay_gives_identical_weights(tmp_path, tokenizer, chats):
    # Accumulation 2: the OOM hits the second micro-step of the second window, so the replay
    # re-runs the window's first micro-step through TRL's training_step (NOTE [OOM replay]).
    clean = _sft_trainer(tmp_path, "clean", tokenizer, chats, accumulation=2)
    clean.train()
    faulty = _sft_trainer(tmp_path, "faulty", tokenizer, chats, accumulation=2)
    at = 4
    injector = InjectOOM(faulty.memfit.blocks[1].module, at=at)
    faulty.train()
    assert injector.fired == 1
    for (name, p), q in zip(clean.model.named_parameters(), faulty.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    faulty_records = faulty.memfit.records
    assert [r.shape for r in faulty_records] == [r.shape for r in clean.memfit.records], "a batch was lost or doubled"
    assert [r.oom_retries for r in faulty_records] == [int(i == at - 1) for i in range(len(faulty_records))]


QWEN_VOCAB = 151_936
#: logical accounting: the static part (weights, gradients, AdamW) is about 156 MB; a kept head holds
#: 0.6 MB of float32 logits per token, so the prompts of about 120 tokens chunk it and those of 20 keep it
HEAD_BUDGET = "200MB"


def _long_and_short_prompts():
    """16 prompt-completion rows, every third prompt about 120 tokens long, the others about 15."""
    words = "the battery lasts all day and the screen is gorgeous but support never answered my mail".split()
    rows = []
    for i in range(16):
        n = 6 if i % 3 else 110
        rows.append({"prompt": "Question: " + " ".join(words[(i + j) % len(words)] for j in range(n)) + "\nAnswer:",
                     "completion": " " + " ".join(words[i % 7: i % 7 + 2 + i % 4])})
    return datasets.Dataset.from_list(rows)


def _qwen(tokenizer):
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=37,
        vocab_size=QWEN_VOCAB, pad_token_id=tokenizer.pad_token_id, use_cache=False,
    ))


def _recording_losses(trainer):
    """``trainer`` with each micro-step's loss, as ``compute_loss`` returns it, kept in a list (returned)."""
    losses = []
    inner = trainer.compute_loss

    def compute_loss(*args, **kwargs):
        loss = inner(*args, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer.compute_loss = compute_loss
    return losses


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory, tokenizer):
    """A plain ``trl.SFTTrainer`` and memfit's under ``HEAD_BUDGET`` on the same data, seed and model: a
    Qwen-sized vocabulary, completion-only loss, one row a micro-batch, two micro-batches a window
    (so ``num_items_in_batch`` counts the completion tokens of both)."""
    import trl

    tmp = tmp_path_factory.mktemp("head")
    data = _long_and_short_prompts()
    common = dict(max_steps=6, per_device_train_batch_size=1, gradient_accumulation_steps=2, learning_rate=1e-3,
                  bf16=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                  completion_only_loss=True, gradient_checkpointing=False)
    plain = trl.SFTTrainer(model=_qwen(tokenizer), args=trl.SFTConfig(output_dir=str(tmp / "plain"), **common),
                           train_dataset=data, processing_class=tokenizer)
    plain_losses = _recording_losses(plain)
    plain.train()
    args = SFTConfig(output_dir=str(tmp / "memfit"), memory_budget=HEAD_BUDGET, memfit_method="dynamic", **common)
    trainer = SFTTrainer(model=_qwen(tokenizer), args=args, train_dataset=data, processing_class=tokenizer)
    losses = _recording_losses(trainer)
    trainer.train()
    return plain, plain_losses, trainer, losses


def test_sft_trainer_plans_the_head_per_batch_and_its_losses_are_trls(head_runs):
    plain, plain_losses, trainer, losses = head_runs
    assert "LM head planned per batch" in trainer.memfit.head.words
    records = trainer.memfit.records
    assert len(records) == len(losses) == len(plain_losses) == 12
    steady = [(r.shape[1], r.treatments["head"]) for r in records if r.phase == "steady"]
    assert all(head == "keep" for tokens, head in steady if tokens < 30), steady
    assert all(head.startswith("chunked:") for tokens, head in steady if tokens > 100), steady
    assert {head == "keep" for _, head in steady} == {True, False}, steady
    assert all(r.peak_allocated_bytes <= r.budget_bytes for r in records)
    # TRL's completion-only loss (one row a batch: each -100 is a prompt token) over the window's completion
    # tokens, within float32 rounding
    labels = next(iter(trainer.get_train_dataloader()))["labels"]
    assert (labels == -100).any() and (labels != -100).any()
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.model.named_parameters(), trainer.model.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")


def test_trl_metrics_come_from_kept_steps_and_chunked_windows_log_none(head_runs):
    """NOTE [TRL's metrics under a chunked head]: a window whose micro-steps all kept the head logs TRL's
    entropy and token accuracy; a window whose micro-steps all chunked it logs neither, and the rest as TRL."""
    plain, _, trainer, _ = head_runs
    records = trainer.memfit.records
    mine = [h for h in trainer.state.log_history if "loss" in h]
    theirs = [h for h in plain.state.log_history if "loss" in h]
    kept_windows = chunked_windows = 0
    for window, (log, plain_log) in enumerate(zip(mine, theirs)):
        heads = {records[2 * window + i].treatments["head"] == "keep" for i in (0, 1)}
        assert log["num_tokens"] == plain_log["num_tokens"]
        if heads == {True}:
            kept_windows += 1
            for key in ("entropy", "mean_token_accuracy"):
                assert log[key] == pytest.approx(plain_log[key], rel=1e-5), key
        if heads == {False}:
            chunked_windows += 1
            assert "entropy" not in log and "mean_token_accuracy" not in log
    assert kept_windows and chunked_windows


@pytest.mark.parametrize("extra, owner", [
    (dict(loss_type="dft"), "TRL's dft loss (--loss_type dft)"),
    (dict(label_smoothing_factor=0.1), "TRL's label smoothing (--label_smoothing_factor)"),
    (dict(use_liger_kernel=True), "TRL with Liger's kernels (--use_liger_kernel)"),
])
def test_a_trl_loss_memfit_cannot_compute_keeps_the_head_and_the_start_line_names_it(tmp_path, tokenizer, chats, extra, owner):
    trainer = _sft_trainer(tmp_path, "run", tokenizer, chats, **extra)
    assert trainer.memfit.head.part is None
    assert trainer.memfit.head.words.startswith(f"LM head left to {owner}"), trainer.memfit.head.words
    with pytest.raises(FlagError, match=re.escape(f"--memfit_head plan: the loss is computed by {owner}")):
        SFTConfig(output_dir=str(tmp_path / "plan"), use_cpu=True, report_to="none", bf16=False, memfit_head="plan", **extra)


def test_a_compute_loss_func_keeps_the_head_and_a_subclass_loss_keeps_it_unless_told_to_plan(tmp_path, tokenizer, chats):
    def loss_func(outputs, labels, num_items_in_batch=None):
        return outputs.logits.float().mean()

    trainer = _sft_trainer(tmp_path, "func", tokenizer, chats, compute_loss_func=loss_func)
    assert trainer.memfit.head.part is None and "left to the trainer's compute_loss_func" in trainer.memfit.head.words

    class Own(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=37, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    for head, planned in (("auto", False), ("plan", True)):
        args = SFTConfig(output_dir=str(tmp_path / head), use_cpu=True, report_to="none", bf16=False, memory_budget=BUDGET,
                         memfit_head=head)
        own = Own(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=chats, processing_class=tokenizer)
        assert (own.memfit.head.part is not None) == planned
        assert planned or "LM head left to Own.compute_loss" in own.memfit.head.words


def test_sft_config_leaves_checkpointing_to_memfit(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True)
    assert args.gradient_checkpointing is False  # trl.SFTConfig's default is True
    with pytest.raises(ValueError, match="drop --gradient_checkpointing"):
        SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, gradient_checkpointing=True)
    assert SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, memory_budget="2GB").memfit_budget_bytes == 2 * 10**9
    with pytest.raises(ValueError, match="--activation_offloading: memfit's saved-tensor counter"):
        SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, activation_offloading=True)


def test_with_memfit_puts_the_mixin_first():
    class Custom(transformers.Trainer):
        pass

    wrapped = with_memfit(Custom)
    assert wrapped.__mro__[1:3] == (MemfitTrainerMixin, Custom) and wrapped.__name__ == "Custom"
    assert with_memfit(wrapped) is wrapped and with_memfit(memfit.Trainer) is memfit.Trainer
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        with_memfit(torch.nn.Module)


def test_memfit_trl_says_how_to_install_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "memfit.trl")
    with pytest.raises(ImportError, match=r"pip install 'memfit\[llm\]'"):
        import memfit.trl  # noqa: F401
