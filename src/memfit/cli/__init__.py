"""The ``memfit`` command: one subcommand per module, each owning its own parser.

``memfit <command> --help`` shows the flags of each command. A user error (a flag, a file or a
budget to change) prints one line on stderr and exits 2; ``--debug``, before the command or
among its flags, shows its traceback instead (NOTE [User errors] in errors.py). What else a
command says on stderr is :class:`~memfit.cli.said.Said`'s (NOTE [Quiet until asked]): by default
memfit's warnings, held back until training starts and dropped at a user error; its INFO lines and
the libraries' FutureWarnings with ``--verbose``, its DEBUG lines with ``--debug``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from memfit import __version__
from memfit.cli.said import Said
from memfit.errors import is_user_error, one_line

__all__ = ["main"]

# command -> (module, one-line help). Modules are imported lazily so that `memfit report`
# does not pay for importing transformers.
_COMMANDS = {
    "train": ("memfit.cli.train", "train a task under a memory budget (HF Trainer)"),
    "bench": ("memfit.tools.bench.matrix", "run a tasks x methods x budgets benchmark matrix"),
    "report": ("memfit.tools.report", "tables and plots from step records and bench results"),
    "estimate": ("memfit.tools.estimate.cli", "memory anatomy of a training step; advice for a budget"),
}


def _usage() -> str:
    lines = ["usage: memfit [--debug] [--verbose] <command> [flags]", "       memfit --version", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += [
        "",
        "`memfit <command> --help` lists the flags of a command. --debug (here or among a command's",
        "flags) prints the traceback of an error instead of its one-line message, and memfit's DEBUG",
        "lines; --verbose prints memfit's INFO lines and the libraries' FutureWarnings.",
    ]
    return "\n".join(lines)


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """Remove memfit's bare ``--debug`` flags from ``argv``, before a ``--`` separator.

    A ``--debug`` followed by a value (``--debug underflow_overflow``) is left in place: it is
    the ``transformers.TrainingArguments`` flag of that name.

    Returns:
        The remaining arguments and whether a bare ``--debug`` was there.
    """
    end = argv.index("--") if "--" in argv else len(argv)
    kept, debug = [], False
    for i, arg in enumerate(argv[:end]):
        bare = i + 1 >= end or argv[i + 1].startswith("-")
        if arg == "--debug" and bare:
            debug = True
        else:
            kept.append(arg)
    return kept + argv[end:], debug


def take_verbose_flag(argv: list[str]) -> tuple[list[str], bool]:
    """Remove ``--verbose`` flags from ``argv``, before a ``--`` separator (after it, the flags belong
    to the command ``memfit bench`` runs).

    Returns:
        The remaining arguments and whether ``--verbose`` was there.
    """
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [arg for arg in argv[:end] if arg != "--verbose"]
    return kept + argv[end:], len(kept) < end


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(argv) and argv[0] == "--debug"  # before the command: always memfit's
    argv, debug_among_flags = take_debug_flag(argv[debug:])
    debug = debug or debug_among_flags
    argv, verbose = take_verbose_flag(argv)
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"memfit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"memfit: error: unknown command {name!r}; choose one of {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    if name in {"train", "bench"}:
        # Expandable segments keep reserved memory close to allocated memory, so a hard cap
        # is not lost to fragmentation. It must be set before CUDA initialises, and a
        # user's own allocator settings win.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with Said(level) as said:
        return _run(name, rest, debug, said)


def _run(name: str, rest: list[str], debug: bool, said: Said) -> int:
    """Run command ``name``: its status, or 2 after one line for a user error (NOTE [User errors]),
    which drops what ``said`` held back (NOTE [Quiet until asked])."""
    module = importlib.import_module(_COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except SystemExit as exit_:  # argparse's --help and flag errors: return the status
        status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        if status:
            said.drop()
        return status
    except Exception as error:
        if debug or not is_user_error(error):
            raise
        said.drop()
        print(f"memfit {name}: error: {one_line(error)}", file=sys.stderr)
        return 2
