"""The model at the end of ``memfit train causal-lm`` (NOTE [The model at the end] in memfit/cli/train.py):
with the default save strategy a full fine-tuning run leaves a model ``from_pretrained`` loads, a
LoRA run leaves an adapter ``peft.PeftModel.from_pretrained`` loads, and each reproduces the
trained model's loss on one batch (the run's ``eval_loss`` over a one-batch evaluation set); a
model of random weights (the bundled llama-tiny) loads offline from the output folder alone, its
LoRA base saved in ``base/``; ``--save_strategy no`` leaves no weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from _models import FIXTURES
from memfit.tasks import ModelArguments
from memfit.tasks import causal_lm as clm
from memfit.cli.train import run

SFT = FIXTURES / "sft"
N_EVAL = 4
FLAGS = [
    "--train_file", str(SFT / "prompt_completion.jsonl"), "--validation_file", str(SFT / "prompt_completion.jsonl"),
    "--max_eval_samples", str(N_EVAL), "--per_device_eval_batch_size", str(N_EVAL), "--do_train", "--do_eval",
    "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--use_cpu",
    "--report_to", "none",
]


def _loss_on_the_eval_batch(model: torch.nn.Module, folder) -> float:
    """The loss of ``model`` on the run's evaluation batch, tokenized by the tokenizer saved in ``folder``."""
    tokenizer = clm.lm_tokenizer(ModelArguments(tokenizer_name=str(folder)))
    examples = clm.read_lm_file(SFT / "prompt_completion.jsonl", tokenizer)[:N_EVAL]
    batch = clm.CausalLMCollator(tokenizer.pad_token_id)(clm.tokenize_examples(examples, tokenizer))
    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, run("causal-lm", [*FLAGS, "--output_dir", str(out)])


def _offline_elsewhere(monkeypatch, folder) -> None:
    """No hub from here on (HF_HUB_OFFLINE=1), and a working directory that is not the run's."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)


def test_full_fine_tuning_leaves_a_model_that_reproduces_the_loss(full_run, tmp_path, monkeypatch):
    out, metrics = full_run  # llama-tiny from its bundled config, random weights
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer_config.json").is_file()
    _offline_elsewhere(monkeypatch, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert _loss_on_the_eval_batch(model, out) == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_lora_run_leaves_an_adapter_that_reproduces_the_loss(full_run, tmp_path, capfd):
    peft = pytest.importorskip("peft")
    base, _ = full_run  # a pretrained base in a local folder, as a fine-tuner starts from
    out = tmp_path / "lora"
    metrics = run("causal-lm", [*FLAGS, "--model_name_or_path", str(base), "--use_peft", "--output_dir", str(out)])
    err = capfd.readouterr().err
    assert f"memfit: saved the trained LoRA adapter and tokenizer to {out}" in err
    assert "adapters on q_proj, v_proj (8 modules)" in err  # peft's default targets for Llama, 2 per layer
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter alone, not the base weights
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert not (out / "base").exists()  # a base with a name is loaded by it, not copied
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    loss = _loss_on_the_eval_batch(model, out)
    assert loss == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert loss != pytest.approx(_loss_on_the_eval_batch(AutoModelForCausalLM.from_pretrained(base), out), rel=1e-4)


def test_save_strategy_no_leaves_no_weights(tmp_path):
    run("causal-lm", [*FLAGS, "--max_steps", "1", "--save_strategy", "no", "--output_dir", str(tmp_path)])
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("checkpoint-*"))
    assert (tmp_path / "memfit_summary.json").is_file()


def test_lora_on_random_weights_saves_its_base_and_loads_offline_from_the_folder_alone(tmp_path, monkeypatch, capfd):
    """No model flag: llama-tiny from its bundled config, random weights that exist nowhere else. The output
    folder holds them in base/, which adapter_config.json names, so peft loads the trained model from the folder
    alone, offline, from any working directory; moved, it loads with the base named by hand."""
    peft = pytest.importorskip("peft")
    out = tmp_path / "lora"
    metrics = run("causal-lm", [*FLAGS, "--use_peft", "--output_dir", str(out)])
    assert f"and the base model it adapts (random weights) to {(out / 'base').resolve()}" in capfd.readouterr().err
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str((out / "base").resolve())
    assert all((out / "base" / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer_config.json"))
    _offline_elsewhere(monkeypatch, tmp_path / "elsewhere")
    trained = _loss_on_the_eval_batch(peft.AutoPeftModelForCausalLM.from_pretrained(out), out)
    assert trained == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert _loss_on_the_eval_batch(AutoModelForCausalLM.from_pretrained(out), out) == pytest.approx(trained, rel=1e-6)
    base = AutoModelForCausalLM.from_pretrained(out / "base")  # the base as it was: the adapters alone trained
    assert _loss_on_the_eval_batch(base, out) != pytest.approx(trained, rel=1e-4)
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moved / "base"), moved)
    assert _loss_on_the_eval_batch(model, moved) == pytest.approx(trained, rel=1e-6)
