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
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

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
    "then",
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

    argparse prints the whole usage first, which for ``memfit train`` is hundreds of flags. An
    unknown flag is named with the known flags closest to it (:meth:`unknown_flags`).
    """

    prog: str
    _option_string_actions: dict[str, argparse.Action]

    def __init__(self, *args: Any, **kwargs: Any):
        # an abbreviation (--method for --methods) would be read silently, and change meaning when
        # a flag is added; a flag is typed whole, or named with the closest ones (NOTE [Closest flags])
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # NOTE [A value that starts with a minus]
        # argparse reads a word that starts with "-" as a flag unless it is a plain negative number,
        # so `--memory_budget -3GB` (or `--learning_rate -1e-3`) failed with "expected one argument",
        # naming neither the value nor what to give. A word of a minus and a digit (or ".digit") is a
        # value here, as argparse itself reads it from Python 3.13 on; the flag's own check then
        # refuses it by name ("--memory_budget -3GB: a memory size cannot be negative"). No memfit
        # flag looks like a negative number, so nothing else is read differently.
        self._negative_number_matcher = _NUMBER

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        words = list(sys.argv[1:] if args is None else args)
        unknown = [w for w in words if _is_flag(w) and w.split("=", 1)[0] not in self._option_string_actions]
        if unknown:  # before argparse's own checks: a misspelled required flag is named as misspelled
            self.error(self.unknown_flags(unknown))
        parsed, rest = self.parse_known_args(words, namespace)  # type: ignore[attr-defined]
        if rest:
            self.error(self.unknown_flags(rest))
        return parsed

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {then(message, f'`{self.prog} --help` lists the flags')}\n")  # type: ignore[attr-defined]

    def unknown_flags(self, rest: Sequence[str]) -> str:
        """What argparse could not place, with the known flags closest to each unknown one.

        Args:
            rest: the words left over: unknown flags (``--name`` or ``--name=value``), each followed
                by the values it was given, and any stray value before them.

        Returns:
            ``"unknown flag --memory_bugdet; did you mean --memory_budget?"``; for several,
            ``"unknown flags --a (did you mean --b?), --c"``.
        """
        flags = [word.split("=", 1)[0] for word in rest if _is_flag(word)]
        first = next((i for i, word in enumerate(rest) if _is_flag(word)), len(rest))
        stray = f"unexpected value {' '.join(rest[:first])} (each value follows the flag it sets)" if first else ""
        if not flags:
            return stray
        close = {flag: self.closest_flags(flag) for flag in flags}
        if len(flags) == 1:
            (flag,) = flags
            words = f"unknown flag {flag}" + (f"; did you mean {' or '.join(close[flag])}?" if close[flag] else "")
        else:
            words = "unknown flags " + ", ".join(
                flag + (f" (did you mean {' or '.join(close[flag])}?)" if close[flag] else "") for flag in flags
            )
        return f"{stray}; {words}" if stray else words

    def closest_flags(self, flag: str, most: int = 3) -> list[str]:
        """The known flags closest to ``flag``, each once by its first ``--`` spelling (NOTE [Closest flags]).

        # NOTE [Closest flags]
        Dashes are read as underscores and case is ignored. A known flag is close when difflib's
        ratio is at least 0.6 (its ``get_close_matches`` cutoff). Close flags that the typed one
        begins or ends, or that begin or end it at a word (``--lora_rank`` and ``--lora_r``,
        ``--max_step`` and ``--max_steps``, ``--budget`` and ``--memory_budget``) are named alone: a
        word cut short, run on or missing its first part is the likeliest slip, likelier than a near
        anagram (``--local_rank``, ``--debug``). Else the closest is named, and those within 0.05 of it.
        """
        spelled: dict[str, str] = {}  # every spelling, normalised -> the flag's first ``--`` spelling
        for option, action in self._option_string_actions.items():
            spelled.setdefault(_normalised(option), next((o for o in action.option_strings if o.startswith("--")), option))
        typed = _normalised(flag)[2:]
        ratios: dict[str, float] = {}
        related: set[str] = set()
        for option, name in spelled.items():
            known = option[2:]
            ratios[name] = max(difflib.SequenceMatcher(None, typed, known).ratio(), ratios.get(name, 0.0))
            short, long = sorted((typed, known), key=len)
            if len(short) >= 3 and (long.startswith(short) or long.endswith("_" + short)):
                related.add(name)
        close = [name for name, ratio in ratios.items() if ratio >= 0.6]
        if any(name in related for name in close):
            close = [name for name in close if name in related]
        elif close:
            best = max(ratios[name] for name in close)
            close = [name for name in close if ratios[name] >= best - 0.05]
        return sorted(close, key=lambda name: (-ratios[name], name))[:most]


def then(message: str, hint: str) -> str:
    """``message`` followed by ``hint``: a new sentence after a question, else after a semicolon."""
    return f"{message} {hint}" if message.endswith(("?", ".")) else f"{message}; {hint}"


def _is_flag(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _NUMBER.match(word)


def _normalised(flag: str) -> str:
    return "--" + flag.lstrip("-").replace("-", "_").lower()


_NUMBER = re.compile(r"^-\.?\d")  # a value such as -1, -0.5 or -3GB, not a flag


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors (:class:`OneLineErrors`)."""
