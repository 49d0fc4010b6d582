"""The flag parser of ``memfit train <task>``: memfit's and the task's flags first.

One ``HfArgumentParser`` over the model flags (:class:`~memfit.tasks.ModelArguments`), the data
flags (:class:`~memfit.tasks.DataTrainingArguments`), :class:`memfit.integrations.hf.TrainingArguments` and the
benchmark's :class:`~memfit.tools.bench.peers.PeerArguments`. ``--help`` lists the model and data
flags of the task, memfit's own flags and the training flags most runs set; ``--help-all``
adds every other ``transformers.TrainingArguments`` flag and the benchmark flags, each under
its own heading. A flag error is one line with exit status 2, as every user error of ``memfit``.

Example:
    >>> parser = TrainFlagParser("text-classification")  # doctest: +SKIP
    >>> model_args, data_args, training_args, peer_args = parser.parse(["--synthetic", "8"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import transformers
from transformers import HfArgumentParser

from memfit.tools.bench.peers import PeerArguments
from memfit.errors import FlagError, OneLineErrors, is_user_error, then
from memfit.integrations.hf import TrainingArguments
from memfit.tasks import TASKS, DataTrainingArguments, ModelArguments

__all__ = ["TrainFlagParser", "COMMON_TRAINING_FLAGS", "FLAG_RANGES"]

#: The ``transformers.TrainingArguments`` flags ``--help`` shows; ``--help-all`` shows them all.
COMMON_TRAINING_FLAGS = (
    "output_dir", "do_train", "do_eval", "num_train_epochs", "max_steps", "per_device_train_batch_size",
    "per_device_eval_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay", "optim",
    "bf16", "fp16", "seed", "resume_from_checkpoint", "logging_steps", "save_strategy", "report_to", "use_cpu",
)


# NOTE [Flag ranges]
# A value out of a flag's range is a one-line error before anything is loaded, whichever dataclass
# owns the flag: transformers' TrainingArguments accept a batch size of 0 and fail later with a
# traceback (ranges it checks itself in one line, such as --warmup_steps, are not repeated).
# This table is the one place these ranges live: (flag, accepts(value), what to give). ``None``
# (not given) always passes; a check that needs two flags lives in its dataclass.
FLAG_RANGES: tuple[tuple[str, Any, str], ...] = (
    ("per_device_train_batch_size", lambda v: v >= 1, "give at least 1 example per device"),
    ("per_device_eval_batch_size", lambda v: v >= 1, "give at least 1 example per device"),
    ("gradient_accumulation_steps", lambda v: v >= 1, "give at least 1 step"),
    ("max_steps", lambda v: v == -1 or v >= 1, "give at least 1 step, or -1 to train --num_train_epochs"),
    ("num_train_epochs", lambda v: v > 0, "give a positive number of epochs"),
    ("learning_rate", lambda v: v >= 0, "give a rate of 0 or more"),
    ("weight_decay", lambda v: v >= 0, "give a decay of 0 or more"),
    ("warmup_ratio", lambda v: 0 <= v <= 1, "give a share of the steps in [0, 1]"),
    ("max_grad_norm", lambda v: v >= 0, "give a norm of 0 or more (0 turns clipping off)"),
    ("max_seq_length", lambda v: v >= 1, "give a length of at least 1 token"),
    ("max_train_samples", lambda v: v >= 0, "give 0 or more examples"),
    ("max_eval_samples", lambda v: v >= 0, "give 0 or more examples"),
    ("doc_stride", lambda v: v >= 0, "give 0 or more tokens"),
    ("lora_alpha", lambda v: v > 0, "give a positive alpha"),
)


def check_ranges(parsed: Sequence[Any]) -> None:
    """Refuse the first flag value out of its range (NOTE [Flag ranges]).

    Raises:
        FlagError: ``--<flag> <value>: <what to give>``.
    """
    for name, accepts, give in FLAG_RANGES:
        for args in parsed:
            value = getattr(args, name, None)
            if value is not None and not isinstance(value, bool) and not accepts(value):
                shown = f"{value:g}" if isinstance(value, float) else value  # as typed: 0, not 0.0
                raise FlagError(f"--{name} {shown}: {give}")


def _names(dataclass_type: type) -> list[str]:
    return [f.name for f in dataclasses.fields(dataclass_type) if f.init]


def _for_task(name: str, help_text: str | None, task: str) -> bool:
    """Whether a data flag applies to ``task``: a help text that names a task first
    (``"object-detection: ..."``, ``"text-classification only: ..."``) limits it to that task."""
    head = (help_text or "").split(":", 1)[0].removesuffix(" only").strip()
    return head not in TASKS or head == task


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """States a flag's default unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or "" if action.default is None else super()._get_help_string(action)


def _short(action: argparse.Action) -> argparse.Action:
    """The action as ``--help`` lists it: its first (underscore) spelling only."""
    if not action.option_strings[0].startswith("--"):
        return action  # -h, --help
    shown = copy.copy(action)
    shown.option_strings = action.option_strings[:1]
    return shown


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(parser.format_help(full=True))  # type: ignore[call-arg]
        parser.exit()


class TrainFlagParser(OneLineErrors, HfArgumentParser):
    """The flags of ``memfit train <task>``, with memfit's own listed first (module docstring).

    Args:
        task: a task name of :data:`memfit.tasks.TASKS`.
        task_types: the recipe's own flag dataclasses (its ``ARGUMENTS``), parsed after the others.
    """

    def __init__(self, task: str, task_types: Sequence[type] = ()):
        self.task_types = tuple(task_types)
        super().__init__(
            (ModelArguments, DataTrainingArguments, TrainingArguments, PeerArguments, *self.task_types),
            prog=f"memfit train {task}",
            usage=f"memfit train {task} [flags]",
            formatter_class=_Formatter,
        )
        self.task = task
        self.add_argument("--help-all", action=_HelpAll, help="list every flag: all of transformers.TrainingArguments and the benchmark's")

    # --------------------------------------------------------------------- help
    def _sections(self, full: bool) -> list[tuple[str, list[argparse.Action]]]:
        by_dest: dict[str, list[argparse.Action]] = {}
        for action in self._actions:
            by_dest.setdefault(action.dest, []).append(action)

        def actions(names: Sequence[str], keep: Any = lambda action: True) -> list[argparse.Action]:
            return [a for n in names for a in by_dest.get(n, []) if keep(a)]

        hf_names = set(_names(transformers.TrainingArguments))
        memfit_names = [n for n in _names(TrainingArguments) if n not in hf_names]
        data = actions(_names(DataTrainingArguments), lambda a: full or _for_task(a.dest, a.help, self.task))
        common = [n for n in COMMON_TRAINING_FLAGS if n in hf_names]
        sections = [
            ("model", actions(_names(ModelArguments))),
            ("data", data),
            *((f"{self.task}", actions([n for t in self.task_types for n in _names(t)])) for _ in self.task_types[:1]),
            ("memfit: budget and method", actions(memfit_names)),
            ("training (the most used transformers.TrainingArguments flags)", actions(common)),
        ]
        if full:
            rest = [n for n in _names(TrainingArguments) if n in hf_names and n not in common]
            sections += [
                ("every other transformers.TrainingArguments flag", actions(rest)),
                ("benchmark flags (memfit bench: peers and the oracle)", actions(_names(PeerArguments))),
            ]
        sections.append(("help", [a for a in self._actions if a.dest in ("help", "help_all")]))
        return sections

    def format_help(self, full: bool = False) -> str:
        """``--help`` text; ``full`` adds every flag (``--help-all``)."""
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [], [])
        for title, section in self._sections(full):
            if not full:  # one spelling per flag; `--no_x` repeats the help of `--x`
                section = [_short(a) for a in section if not a.option_strings[0].startswith("--no_")]
            formatter.start_section(title)
            formatter.add_arguments(section)
            formatter.end_section()
        formatter.add_text(
            "A bare --debug (no value; `--debug <option>` is transformers' own flag) prints the traceback of an "
            "error instead of its one-line message, and memfit's DEBUG lines; --verbose prints memfit's INFO lines "
            "(which model is built, what the task sets) and the libraries' FutureWarnings."
        )
        if not full:
            shown = {a.dest for _, section in self._sections(False) for a in section}
            n_hidden = len({a.dest for a in self._actions} - shown)
            formatter.add_text(f"--help-all lists {n_hidden} more flags: every transformers.TrainingArguments flag and "
                               "the benchmark's.")
        return formatter.format_help()

    # ------------------------------------------------------------------- parse
    def parse(self, argv: Sequence[str]) -> tuple[Any, ...]:
        """Parse ``argv`` into the model, data, training and peer dataclasses, then the task's own.

        Raises:
            FlagError: an unknown flag (named with the known flags closest to it), or a value or combination the dataclasses' checks refuse
                (NOTE [User errors], rule 2, in errors.py).
        """
        try:
            *parsed, rest = self.parse_args_into_dataclasses(args=list(argv), return_remaining_strings=True)
        except ValueError as err:  # raised by a dataclass's __post_init__: a flag to change
            if is_user_error(err):
                raise
            raise FlagError(str(err)) from err
        if rest:
            raise FlagError(then(self.unknown_flags(rest), f"`{self.prog} --help-all` lists every flag"))
        check_ranges(parsed)
        return tuple(parsed)

