"""The README a newcomer reads: at most 250 lines, the two fresh-machine commands first, and its
offline causal-lm + LoRA command runs as written and leaves a folder peft loads alone, offline."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from memfit import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _commands(prefix: str) -> list[list[str]]:
    """The README's shell commands starting with ``prefix``, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(prefix)]


def test_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 250
    setup = [c for c in _commands("python3 -m venv") if c]
    assert len(setup) == 2 and README.index("memfit train text-classification") < README.index("python -m pytest -q")
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].endswith(README.split("```bash\n")[2].split("\n")[0].split("&& ", 1)[1])


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if target.startswith("http") or target in ("docs/concepts.md", "docs/distributed.md"):  # written beside this
            continue
        assert (ROOT / target).exists(), target


def test_readme_causal_lm_lora_command_runs_as_written(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    (offline,) = [c for c in _commands("memfit train causal-lm") if "--model_name_or_path" not in c]
    monkeypatch.chdir(ROOT)
    out = tmp_path / "sft-lora"
    argv = offline[1:]
    argv[argv.index("--output_dir") + 1] = str(out)  # the only change: where it writes
    assert cli.main(argv) == 0
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    from huggingface_hub import constants

    # as the README loads it: the output folder alone (its base in base/), offline, from another directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    model = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    assert model.peft_config["default"].r == 8
