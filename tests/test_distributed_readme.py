"""README's two multi-GPU launch commands (Accelerate, torchrun) ask memfit train for what they
mean: the same training flags, which parse, train, and ask for FSDP2 with a per-rank budget."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _launches() -> dict[str, list[str]]:
    """The README's launch commands by launcher, continuation lines joined."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return {line.split()[0]: shlex.split(line) for line in lines if line.startswith(("accelerate launch", "torchrun"))}


def test_both_launchers_run_the_same_memfit_train_command_which_parses():
    from memfit.cli.flags import TrainFlagParser
    from memfit.tasks import causal_lm

    launches = _launches()
    assert set(launches) == {"accelerate", "torchrun"}
    tails = {name: argv[argv.index("memfit.cli") + 1:] for name, argv in launches.items()}
    assert tails["accelerate"] == tails["torchrun"]
    assert launches["accelerate"][:4] == ["accelerate", "launch", "--num_processes", "4"]
    assert launches["torchrun"][:3] == ["torchrun", "--nproc_per_node", "4"]
    task, *flags = tails["torchrun"][1:]
    assert task == "causal-lm"
    _, _, training_args, *_ = TrainFlagParser(task, tuple(causal_lm.ARGUMENTS)).parse(flags)
    assert training_args.do_train and training_args.memfit_budget_bytes == 20 * 2**30
    assert training_args.memfit_method == "dynamic"
    config = training_args.fsdp_config  # transformers renames fsdp_version to version (5.2x)
    assert training_args.fsdp and config.get("version", config.get("fsdp_version")) == 2
