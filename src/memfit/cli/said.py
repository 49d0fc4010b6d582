"""What a ``memfit`` command says on stderr besides its one error line: memfit's log lines and the
libraries' Python warnings, at the level ``--verbose``/``--debug`` ask for (NOTE [Quiet until asked]).

Example:
    >>> with Said(logging.WARNING) as said:  # doctest: +SKIP
    ...     run_the_command()  # memfit.cli.main does this around every command
"""

from __future__ import annotations

import logging
import sys
import warnings
from types import TracebackType
from typing import Any

__all__ = ["Said", "setup_done"]

# NOTE [Quiet until asked]
# Rule 1. A command that stops at a mistake prints its one error line and nothing else. What was
# said on the way there (the hub out of reach, examples truncated, a library's UserWarning) is
# about a run that did not happen; the error is what to fix first. So, by default, memfit's
# warnings and the libraries' Python warnings are held back until the setup is done (the first
# training step: setup_done, called by memfit train when its Trainer starts training), then said,
# and from then on said as they come. A user error before then drops them; a bug (a traceback)
# or the command's end says them.
# Rule 2. memfit's INFO lines (which model is built, a flag the task sets) are printed with
# --verbose, its DEBUG lines (the engine's diagnostics: a group of blocks split, the head's
# price per 1k tokens) with --debug; either says everything as it comes, nothing held back.
# Rule 3. The libraries' FutureWarnings and DeprecationWarnings are about how memfit calls them,
# nothing a user of the command can change: printed with --verbose or --debug only.
# Said is the one place that decides, for the command's duration only: one handler on the
# "memfit" logger and the warnings filters are as they were after it. Records still propagate,
# so a root handler set up by a program that runs memfit.cli.main sees them too.

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Said(logging.StreamHandler):
    """memfit's log lines and Python warnings on stderr while a command runs, held back until its
    setup is done when quiet (NOTE [Quiet until asked]).

    Args:
        level: ``logging.WARNING`` (the default: quiet), ``logging.INFO`` (``--verbose``) or
            ``logging.DEBUG`` (``--debug``).
    """

    def __init__(self, level: int):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(_FORMAT))
        self.level_asked = level
        self.holding = level > logging.INFO
        self._records: list[logging.LogRecord] = []
        self._warnings: list[tuple[Any, ...]] = []
        self._logger = logging.getLogger("memfit")
        self._level_before = self._logger.level
        self._filters = warnings.catch_warnings()
        self._show: Any = None

    def __enter__(self) -> Said:
        self._logger.addHandler(self)
        self._logger.setLevel(self.level_asked)
        self._filters.__enter__()
        if self.holding:
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
        self._show = warnings.showwarning
        warnings.showwarning = self._warning
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_holding()  # the command ended, or a bug: what was held is said (a user error dropped it first)
        self._filters.__exit__(kind, error, tb)
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level_before)

    def emit(self, record: logging.LogRecord) -> None:
        if self.holding:
            self._records.append(record)
        else:
            super().emit(record)

    def _warning(self, *shown: Any) -> None:
        if self.holding:
            self._warnings.append(shown)
        else:
            self._show(*shown)

    def stop_holding(self) -> None:
        """Say what was held back, and from now on say everything as it comes."""
        self.holding = False
        records, shown, self._records, self._warnings = self._records, self._warnings, [], []
        for record in records:
            super().emit(record)
        for warning in shown:
            self._show(*warning)

    def drop(self) -> None:
        """Forget what was held back: a user error ended the setup (rule 1)."""
        self._records, self._warnings = [], []


def setup_done() -> None:
    """The command's setup is done: say what its :class:`Said` held back, and then say everything
    as it comes (NOTE [Quiet until asked]); nothing without one (a recipe run from Python)."""
    for handler in logging.getLogger("memfit").handlers:
        if isinstance(handler, Said):
            handler.stop_holding()
