"""The ``memfit`` command: one subcommand per module, each owning its own parser.

``memfit <command> --help`` shows the flags of each command.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["main"]

# command -> (module, one-line help). Modules are imported lazily so that `memfit report`
# does not pay for importing transformers.
_COMMANDS = {
    "train": ("memfit.train", "train a task under a memory budget (HF Trainer)"),
    "bench": ("memfit.bench.matrix", "run a tasks x methods x budgets benchmark matrix"),
    "report": ("memfit.report", "tables and plots from step records and bench results"),
    "estimate": ("memfit.estimate.cli", "memory anatomy of a training step; advice for a budget"),
}


def _usage() -> str:
    lines = ["usage: memfit <command> [flags]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "`memfit <command> --help` lists the flags of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"memfit: unknown command {name!r}; choose one of {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    if name in {"train", "bench"}:
        # Expandable segments keep reserved memory close to allocated memory, so a hard cap
        # is not lost to fragmentation. It must be set before CUDA initialises, and a
        # user's own allocator settings win.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
