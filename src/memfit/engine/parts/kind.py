"""A part kind: a part of the step beside the blocks that the planner treats per batch.

The LM head is one (treatments/chunked_head.py's ``HeadPart``); a user's part is another, given to
``memfit.fit(..., parts=[...])``. The planner chooses one option of each beside the blocks'
treatments (NOTE [Parts beside the blocks], plan/planner.py), the memory model takes the chosen
option's saving off the step's peaks (NOTE [Head in the peaks], plan/model.py), the controller
sets it before the step's forward and the step record holds its label under the kind's name
(NOTE [Parts in a record], records.py: :func:`~memfit.engine.records.part_label`, ``"chunked:8"``),
where the summary line and ``memfit report`` read it.

# NOTE [A part kind's moment]
A part kind's bytes are held at one moment of the step, its ``moment``:

* ``AFTER_BLOCKS`` (the default): from after the last block's forward until its own backward, as
  the LM head's logits are. Its options' savings are taken off the backward's start (and the
  recompute bound), never off a block's moment, and the planner chooses them beside the blocks'.
* ``OPTIMIZER_STEP``: during the optimizer step, when no activation is held (the step's
  temporaries: parts/optimizer_step.py). Its bytes are the same for every batch and meet no
  block's, so no knapsack weighs them against the blocks: Planning runs the cheapest option whose
  bytes there fit the room above static (:meth:`PartKind.at_moment`), its untreated bytes the
  larger of what steps read there and what the part predicts (:meth:`PartKind.moment_bytes`), and
  the memory model takes its saving off that moment's peak.

* ``STATIC``: at every moment of the step, as the static bytes are (the blocks' frozen weights:
  parts/host_weights.py). An option's saving adds to the room every plan of the blocks and the
  other parts is made in (NOTE [The weights' room], plan/search.py), and comes off every predicted
  peak (``Planning.predict_peak``); the static bytes Planning plans from are those with the part
  untreated, and those a step teaches are less its option's saving.

A part whose bytes peak at another moment is not a part kind yet.

# NOTE [A part kind's options]
``options(tokens)`` lists ``(treatment, param, bytes saved, ms)`` for a batch of ``tokens`` tokens,
the untreated option first (``("keep", 1, 0, 0.0)``), bytes and ms relative to it: what the part
measured or priced, the planner's only view of it. ``saved_bytes`` must give an option's saving
for any option a step ran (the learner adds it back: the curves describe the part untreated), and
``transient_saved_bytes`` the part of it that lives at the backward's start only (0 by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from memfit.engine.parts.head import HEAD_KEY

__all__ = ["PartKind", "Option", "RunParts", "check_parts", "with_untreated", "part_title", "part_param_words", "part_floor_words",
           "AFTER_BLOCKS", "OPTIMIZER_STEP", "STATIC"]

#: ``(treatment, param, bytes saved, ms)`` of a part's option (NOTE [A part kind's options])
Option = tuple[str, int, int, float]
#: the moments a part kind's bytes may be held at (NOTE [A part kind's moment])
AFTER_BLOCKS, OPTIMIZER_STEP, STATIC = "after_blocks", "optimizer_step", "static"
#: each part kind's class by its name, where the class declares its title (PartKind.title): records name a part by its
#: kind alone, and the summary and the report say it by the class's words
_KINDS: dict[str, type["PartKind"]] = {}


def part_title(kind: str) -> str:
    """What people call the part kind named ``kind``: its class's ``title``, else ``part <kind>``.

    Example:
        >>> part_title("a_kind_no_class_declared")
        'part a_kind_no_class_declared'
    """
    return (_KINDS[kind].title if kind in _KINDS else "") or f"part {kind}"


def part_param_words(kind: str) -> str:
    """What the parameter of the part kind named ``kind`` counts (its class's ``param_words``), "" where not said."""
    return _KINDS[kind].param_words if kind in _KINDS else ""


def part_floor_words(kind: str) -> tuple[str, str] | None:
    """What the part kind named ``kind`` is when it dominates a step that cannot fit, and what to change (its class's
    ``floor_words``: NOTE [What to change when a step cannot fit], summary_text.py); None where not said."""
    return (_KINDS[kind].floor_words or None) if kind in _KINDS else None


def with_untreated(plan: Any, parts: Iterable["PartKind"], tokens: int) -> Any:
    """``plan`` with each of ``parts`` it names no option of at the option a step of ``tokens`` tokens runs it with
    untreated (``PartKind.untreated``; the LM head's: chunked, NOTE [A plan without a head]), placed last: what a plan
    made without a part runs, and what judging such a plan must price.

    Example:
        >>> from memfit.engine.plan.planner import Plan
        >>> class Squeeze(PartKind):
        ...     name = "norm_of_the_doctest"
        >>> with_untreated(Plan((0,)), [Squeeze()], 10).parts
        (('norm_of_the_doctest', 'keep', 1),)
    """
    for part in parts:
        if plan.option(part.name) is None:
            plan = plan.with_option(part.name, part.untreated(tokens))
    return plan


class PartKind:
    """A part beside the blocks (NOTE [A part kind's options]); subclass it and give ``name``,
    :meth:`options` and :meth:`apply`.

    Attributes:
        name: the part's kind: its key in a step record's ``treatments`` and in a plan's ``parts``
            (the LM head's is ``"head"``); never a block treatment's name.

    Example:
        >>> class Squeeze(PartKind):
        ...     name = "norm"
        ...     def options(self, tokens):
        ...         return (("keep", 1, 0, 0.0), ("squeezed", 1, 64 * tokens, 0.5))
        ...     def apply(self, option):
        ...         self.now = option
        >>> Squeeze().saved_bytes(10, ("squeezed", 1)), Squeeze().most(10)
        (640, ('squeezed', 1))
    """

    name: str = ""
    #: what people call it (the summary's line, the report's table and plot: :func:`part_title`); ``part <name>`` unset
    title: str = ""
    #: what its option's parameter counts, where the report gives its mean (the LM head's chunks); "" for none
    param_words: str = ""
    #: ``(what it is at its most saving, what to change)`` where it dominates a step that cannot fit (:func:`part_floor_words`)
    floor_words: tuple[str, str] | tuple[()] = ()
    #: when its bytes are held (NOTE [A part kind's moment])
    moment: str = AFTER_BLOCKS
    #: its backward's moment is read apart and learnt as a curve of its own (NOTE [The parts' moment], model.py):
    #: where its options' transients are priced
    moment_apart: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name and "title" in vars(cls):  # a class that says its title claims its name's words (a stand-in does not)
            _KINDS[cls.name] = cls

    def options(self, tokens: int) -> Sequence[Option]:
        """The part's options for a batch of ``tokens`` tokens, untreated first."""
        raise NotImplementedError

    def apply(self, option: tuple[str, int]) -> None:
        """Run the coming step's part as ``option`` (``(treatment, param)``) says."""
        raise NotImplementedError

    def saved_bytes(self, tokens: int, option: tuple[str, int] | None) -> int:
        """What ``option`` saves at ``tokens`` tokens against the untreated option (0 for None or one not offered)."""
        if option is None:
            return 0
        return next((int(saved) for name, param, saved, _ in self.options(tokens) if (name, param) == tuple(option)), 0)

    def transient_saved_bytes(self, tokens: int, option: tuple[str, int] | None) -> int:
        """The part of :meth:`saved_bytes` that lives at the backward's start only (none by default)."""
        return 0

    def choose_by_plans(self, plan_ms: Callable[[tuple[int, int]], float | None], key: tuple[int, int] | None = None,
                        shape: Callable[[tuple[int, int]], tuple[int, int]] = lambda k: k) -> bool:
        """Choose among the part's own implementations by what ``plan_ms`` prices the plans at (none by default);
        ``shape`` gives the shape a key's plan is made for, where the part reads its own options."""
        return False

    def budget_share(self, tokens: int, size: Callable[[float], str]) -> tuple[float, float, str] | None:
        """For the error of a step no plan fits: the part's bytes untreated and at its most saving option at ``tokens``
        tokens, and words naming that option with those sizes (``size`` writes one in the budget's units); None where
        the part knows no bytes of its own (the default: they are in what runs outside the blocks)."""
        return None

    def recover_in_step(self, note: "Callable[[str, str], None] | None") -> None:
        """While ``note`` is set, an OOM in the part's own run is noted (``note(message, where)``) and the part runs
        again in its option that saves most, in step with the other ranks (NOTE [Replay under FSDP], replay.py);
        None ends it. A part that cannot recover so lets its OOM reach the replay (the default)."""

    def leaner(self, tokens: int) -> bool:
        """A step on the floor ran out of memory at ``tokens`` tokens: run the part a way that keeps less from now on and
        return True (the step is replayed: NOTE [A replay treats more], methods/dynamic.py); False where it has none (the
        default)."""
        return False

    def moment_bytes(self) -> int:
        """What the part holds untreated at a moment of its own, as predicted before a step reads it (0: not predicted)."""
        return 0

    def at_moment(self, free_bytes: float, measured: float) -> Option:
        """The option a part held at a moment of its own runs (NOTE [A part kind's moment]): the cheapest whose bytes there
        fit ``free_bytes``, untreated the larger of ``measured`` and :meth:`moment_bytes`; where none fits, the one that
        saves most."""
        untreated, options = max(measured, self.moment_bytes()), self.options(0)
        fits = [option for option in options if untreated - option[2] <= free_bytes]
        return min(fits, key=lambda option: option[3]) if fits else max(options, key=lambda option: option[2])

    def untreated(self, tokens: int) -> tuple[str, int]:
        """The option a step runs whose plan placed no option of the part."""
        name, param, _, _ = self.options(max(1, tokens))[0]
        return name, int(param)

    def most(self, tokens: int) -> tuple[str, int]:
        """The option that saves most at ``tokens`` tokens (the earlier on a tie)."""
        name, param, _, _ = max(self.options(max(1, tokens)), key=lambda option: option[2])
        return name, int(param)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_parts(parts: Sequence[Any], reserved: Sequence[str]) -> None:
    """Raise where ``fit(parts=...)`` holds a part that is no :class:`PartKind` or whose name is
    empty, repeated or one of ``reserved`` (the head's, a block treatment's)."""
    seen: set[str] = set()
    for part in parts:
        if not isinstance(part, PartKind):
            raise TypeError(f"parts={list(parts)!r}: each must be a memfit.PartKind (got {type(part).__name__})")
        if not part.name or part.name in seen or part.name in reserved:
            raise ValueError(f"parts: {part!r} needs a name of its own (not empty, repeated, nor one of {sorted(reserved)})")
        seen.add(part.name)


class RunParts:
    """The run's parts beside the blocks as the controller sees them: the LM head's run
    (treatments/chunked_head.py ``RunHead``) and the part kinds given to ``fit(parts=...)``,
    planned from now on.

    Args:
        head: the run's ``RunHead``.
        parts: the user's part kinds (:func:`check_parts`).
        planning: the run's planning (each part is added to it).

    Raises:
        TypeError, ValueError: as :func:`check_parts`.
    """

    def __init__(self, head: Any, parts: Sequence[Any], planning: Any):
        check_parts(parts, reserved=(HEAD_KEY, *planning.registry, "key", "blocks", "treatments"))
        self.head, self.kinds, self.planning = head, tuple(parts), planning
        for part in self.kinds:
            planning.add_part(part)

    def decide(self, decision: Any, key: tuple[int, int]) -> Any:
        """``decision`` with the head's treatment set (``RunHead.decide``) and every part kind's option
        applied; a plan made without a part (warm-up's, ``none``'s, ``full``'s, a replay's) runs it
        untreated, and says so; a part held at a moment of its own runs what Planning chooses for it
        (NOTE [A part kind's moment])."""
        decision = self.head.decide(decision, key)
        plan, tokens = decision.plan, key[0] * key[1]
        moments = self.planning.moment_options(key)
        for kind, option in moments.items():
            plan = plan.with_option(kind, option)
        plan = with_untreated(plan, [part for part in self.kinds if part.name not in moments], tokens)
        decision = dataclasses.replace(decision, plan=plan)
        for part in {part.name: part for part in (*self.kinds, *self.planning.moment_parts.values())}.values():
            part.apply(plan.option(part.name))
        return decision

    def record(self, record: Any, plan: Any) -> None:
        """What a step's record says of the parts: each one's label under its kind (NOTE [Parts in a
        record], records.py), and the head's implementation where it ran chunked (``RunHead.record``).
        A part held at a moment of its own is said where the step treated it (untreated, every step of
        every run with an optimizer would say so)."""
        self.head.record(record, plan)
        ran = {part.name for part in self.kinds}  # a plan's label for a part the run does not plan says nothing ran
        ran |= {kind for kind in self.planning.moment_parts if (plan.option(kind) or ("keep",))[0] != "keep"}
        record.treatments.update({kind: label for kind, label in plan.part_labels().items() if kind in ran})
