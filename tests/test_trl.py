"""TRL's SFTTrainer with memfit (memfit.trl): planning under a budget, records, and an OOM
replayed to the weights of a run without it; the mixin on other Trainer classes."""

import json
import sys

import pytest
import torch
import transformers

import memfit
from _models import FIXTURES, InjectOOM
from memfit.integrations.hf import MemfitTrainerMixin, with_memfit
from memfit.cli.tasks._common import ModelArguments, minilm_path
from memfit.cli.tasks.causal_lm import lm_tokenizer

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
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


def _sft_trainer(tmp_path, name, tokenizer, chats, accumulation=1, **extra):
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
    return SFTTrainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=chats, processing_class=tokenizer)


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
