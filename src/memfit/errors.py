"""Errors a user can fix, and how the ``memfit`` command reports them.

A user error says what was wrong and what to change (a flag, a file, a budget). The
``memfit`` command prints it as one line on stderr and exits 2; any other exception is a bug
and keeps its traceback. ``--debug`` shows the traceback of a user error too.

# NOTE [User errors]
Rule 1. Only errors memfit raises on purpose are user errors: subclasses of
:class:`UserError` (the engine's ``BudgetTooSmallError``, ``UnknownMethodError``,
``NoBlocksError``, ``PlansMismatchError`` and ``HostMemoryError`` among them).
Rule 2. A library's ``ValueError`` is a user error only where memfit knows it came from a flag:
the argument dataclasses' ``__post_init__`` checks, which ``memfit train`` re-raises as
:class:`FlagError`. A ``ValueError`` from deeper inside a library may be a bug, so it is not
caught and keeps its traceback.
Rule 3. Each class also derives from the built-in type code caught before it existed
(``ValueError``, ``FileNotFoundError``, ``OSError``, ``ImportError``), so existing ``except``
clauses still work.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = [
    "UserError",
    "FlagError",
    "DataError",
    "MissingFileError",
    "LoadError",
    "MissingPackageError",
    "is_user_error",
    "one_line",
    "OneLineErrors",
    "ArgumentParser",
]


class UserError(Exception):
    """Base of the errors whose message names what was wrong and what to change."""


class FlagError(UserError, ValueError):
    """A flag's value, or a combination of flags, that cannot work."""


class DataError(UserError, ValueError):
    """A data file or folder that is empty, malformed or of an unsupported kind."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder named by a flag does not exist."""


class LoadError(UserError, OSError):
    """A model, config or tokenizer that cannot be loaded (not found, or the hub out of reach)."""


class MissingPackageError(UserError, ImportError):
    """An optional package the flags need is not installed (the message names the ``pip install``)."""


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is one the user can fix (NOTE [User errors]).

    Example:
        >>> is_user_error(FlagError("--memfit_max_shape 8x128: write N,T")), is_user_error(KeyError("x"))
        (True, False)
    """
    return isinstance(error, UserError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (line breaks and runs of spaces become single spaces)."""
    return " ".join(str(error).split()) or type(error).__name__


class OneLineErrors:
    """Mixin for an ``argparse.ArgumentParser``: a flag error is one line, exit status 2.

    argparse prints the whole usage first, which for ``memfit train`` is hundreds of flags.
    """

    prog: str

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists the flags\n")  # type: ignore[attr-defined]


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors (:class:`OneLineErrors`)."""
