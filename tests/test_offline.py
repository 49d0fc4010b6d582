"""Offline runs make no hub round-trip: bundled configs and the MiniLM never contact it, and an
unreachable hub is asked once (NOTE [One hub probe] in memfit/tasks/_hub.py).

This machine may have no network; every test here also blocks it, counting each attempt (a
host-name lookup), and turns off the suite's HF_HUB_OFFLINE so that memfit decides alone.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from huggingface_hub import constants

from _models import FIXTURES
from memfit import cli
from memfit.tasks import DataTrainingArguments, ModelArguments
from memfit.tasks._common import load_tokenizer
from memfit.tasks._hub import hub_names, hub_or_offline


@pytest.fixture()
def lookups(monkeypatch) -> list[tuple]:
    """Host names looked up (every network attempt starts with one); each lookup fails."""
    seen: list[tuple] = []

    def blocked(host, port, *args, **kwargs):
        seen.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "blocked by the test")

    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return seen


def test_names_that_need_the_hub(tmp_path):
    local = tmp_path / "config.json"
    local.write_text("{}")
    none = DataTrainingArguments()
    assert hub_names(ModelArguments(), none) == []  # the MiniLM
    assert hub_names(ModelArguments(config_name=str(local), tokenizer_name=str(tmp_path)), none) == []
    assert hub_names(ModelArguments(config_name="conditional-detr-swin-micro"), none, tokenizer=False) == []
    # a bundled config, but its tokenizer is named after it
    assert hub_names(ModelArguments(config_name="bert-base-cased"), none) == ["bert-base-cased"]
    assert hub_names(ModelArguments(model_name_or_path="org/model"), DataTrainingArguments(dataset_name="squad")) == [
        "org/model", "squad"]


def test_nothing_to_fetch_runs_offline_and_restores(lookups):
    with hub_or_offline([]) as online:
        assert not online and constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert not constants.HF_HUB_OFFLINE and "HF_HUB_OFFLINE" not in os.environ
    assert lookups == []


def test_unreachable_hub_is_asked_once(lookups, caplog):
    started = time.perf_counter()
    with hub_or_offline(["bert-base-cased"]) as online:
        tokenizer = load_tokenizer(ModelArguments(config_name="bert-base-cased"))
    assert not online and len(tokenizer) == 30522  # fell back to the MiniLM tokenizer at once
    assert len(lookups) == 1 and "is out of reach" in caplog.text
    assert time.perf_counter() - started < 20  # the hub's retries alone took 23 s


def test_readme_commands_make_no_network_call(lookups, tmp_path, capsys):
    """The README's two offline commands, shortened: the MiniLM on MRPC and the detection CPU run."""
    text = [
        "train", "text-classification", "--task_name", "mrpc", "--train_file", str(FIXTURES / "glue/MRPC/train.tsv"),
        "--do_train", "--max_steps", "1", "--memory_budget", "500MB", "--report_to", "none", "--save_strategy", "no",
        "--output_dir", str(tmp_path / "mrpc"),
    ]
    detection = [
        "train", "object-detection", "--synthetic", "4", "--config_name", "conditional-detr-swin-micro",
        "--shortest_edge", "96-128", "--longest_edge", "160", "--do_train", "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--memory_budget", "26MB", "--use_cpu", "--report_to", "none",
        "--save_strategy", "no", "--output_dir", str(tmp_path / "detection"),
    ]
    for argv in (text, detection):
        assert cli.main(argv) == 0
        assert json.loads((tmp_path / argv[argv.index("--output_dir") + 1] / "memfit_summary.json").read_text())["steps"] == 1
    assert lookups == []
    err = capsys.readouterr().err
    assert err.count("memfit: method dynamic, budget") == 2 and err.count("memfit: 1 optimizer step, 1 micro-step (forward + backward; ") == 2
