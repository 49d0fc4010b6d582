"""What memfit prints about a run: one line when training starts, a short summary at its end.

Pure functions of plain values and step records, so that the Trainer, ``memfit train`` and
``memfit.fit`` loops print the same words. Budgets are stated as the user gave them and in
bytes, and measured sizes in the family of the budget's unit (:class:`memfit.engine.budget.Budget`,
NOTE [A budget as typed]); binary units without a budget.

Example:
    >>> start_line("dynamic", Budget.parse("500MB"), "logical", ["BertLayer"] * 6)
    'memfit: method dynamic, budget 500MB (500000000 bytes), logical accounting (tensors counted on the host), 6 blocks (BertLayer)'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from memfit.engine.budget import Budget, format_bytes
from memfit.engine.records import StepRecord, mean_treated_fraction, summarize, treated_blocks
from memfit.engine.parts.kind import part_floor_words, part_title
from memfit.engine.parts.treatments import KEEP, RECOMPUTE, in_registry_order

__all__ = [
    "given_unit",
    "start_line", "end_summary", "budget_words", "size_in_given_unit", "parameters_words", "over_budget_words", "verdict",
]

_ACCOUNTING = {
    "cuda": "cuda accounting (allocator peaks, budget enforced as a hard cap)",
    "logical": "logical accounting (tensors counted on the host)",
}


# NOTE [A budget in the unit it was given]
# Records store budgets in bytes only. A budget is typed as a whole number of some unit
# ("500MB", "6GiB", "--memory_threshold 8"), and a whole number of GB is almost never one of
# GiB, so the unit is recovered from the bytes: the first of GB, GiB, MB, MiB in which the
# budget is a whole number names it ("500 MB", not "0.47 GiB"); any other size is shown in
# binary units with decimals.
_GIVEN_UNITS = (("GB", 10**9), ("GiB", 2**30), ("MB", 10**6), ("MiB", 2**20))


def given_unit(n_bytes: int | None) -> tuple[str, int]:
    """The unit a budget was most likely typed in, as ``(name, bytes)``; GiB when there is none
    (NOTE [A budget in the unit it was given]).

    Example:
        >>> given_unit(500 * 10**6), given_unit(None)
        (('MB', 1000000), ('GiB', 1073741824))
    """
    for unit, size in _GIVEN_UNITS:
        if n_bytes and n_bytes > 0 and n_bytes % size == 0:
            return unit, size
    return "GiB", 2**30


def size_in_given_unit(n_bytes: int) -> str:
    """A budget in the unit it was most likely typed in (NOTE [A budget in the unit it was given]).

    Example:
        >>> size_in_given_unit(500 * 10**6), size_in_given_unit(6 * 2**30), size_in_given_unit(8 * 10**9)
        ('500 MB', '6 GiB', '8 GB')
    """
    for unit, size in _GIVEN_UNITS:
        if n_bytes > 0 and n_bytes % size == 0:
            return f"{n_bytes // size} {unit}"
    return format_bytes(n_bytes)


def budget_words(budget: Budget | None) -> str:
    """``'budget 500MB (500000000 bytes)'``, or that nothing is capped when there is no budget."""
    if budget is None:
        return "no budget: nothing is capped (steps are only measured and recorded)"
    return f"budget {budget}"


def _size(n_bytes: float, budget: Budget | None) -> str:
    """A size beside ``budget``, in its unit family (NOTE [A budget as typed]); binary units without one."""
    return budget.size(n_bytes) if budget is not None else format_bytes(n_bytes)


def _blocks_words(block_kinds: Sequence[str]) -> str:
    if not block_kinds:
        return "no blocks"
    counts = Counter(block_kinds)  # first-seen order
    kinds = ", ".join(name if len(counts) == 1 else f"{n} {name}" for name, n in counts.items())
    return f"{len(block_kinds)} block{'s' * (len(block_kinds) != 1)} ({kinds})"


# NOTE [What to change when a step cannot fit]
# A step over the budget even with every block checkpointed has one part that dominates, and
# each part has its own fix: the static part (weights, gradients, optimizer state) shrinks with
# LoRA, bf16 weights or a smaller optimizer state; the part outside the blocks (the LM head's
# logits and loss, the embeddings, a vision model's layers that no block holds) with a chunked head,
# more of the model named as blocks or smaller inputs, and the blocks' own bytes with a smaller batch or
# shorter inputs. The warning (once per run) and the summary's verdict both say it with these
# words, so a user reads one fix, not a count of shapes. A part kind beside the blocks says its
# own (``PartKind.floor_words``: the LM head's, at its most chunks), and is named by its title.
_FIXES = {
    "static": ("the static part (weights, gradients, optimizer state)",
               "train LoRA adapters (--use_peft), store bf16 weights (--torch_dtype bfloat16) or use a smaller "
               "optimizer state (--optim adafactor or adamw_bnb_8bit)"),
    # no part beside the blocks: an LM head kept, or a model with none (a vision model's stem and stages no block holds)
    "outside": ("what runs outside the blocks (an LM head's logits and loss, the embeddings, layers no block holds)",
                "let memfit chunk an LM head (--memfit_head auto, or head='auto' in memfit.fit), name the layers no "
                "block holds as blocks (memfit.fit's blocks=), or lower --per_device_train_batch_size or the inputs' "
                "length (the logits grow with both)"),
    # with the parts beside the blocks (the LM head) counted on their own, each at its most saving as the floor runs
    # it (a part kind's own words: PartKind.floor_words): the rest outside the blocks
    "outside-not-parts": ("what runs outside the blocks besides {parts} (the embeddings, the model's other outputs)",
                          "lower --per_device_train_batch_size or --max_seq_length"),
    "blocks": ("the blocks' activations, even checkpointed",
               "lower --per_device_train_batch_size or --max_seq_length"),
}


def _the(title: str) -> str:
    """A part's title after "besides": "the LM head", "the ballast" (``part ballast``'s)."""
    title = title.removeprefix("part ")
    return title if title.startswith("the ") else f"the {title}"


def over_budget_words(parts_bytes: dict[str, float], budget: Budget | None = None) -> str:
    """What dominates a step that cannot fit, and the flag to change (NOTE [What to change when a step cannot fit]).

    Args:
        parts_bytes: bytes of ``static``, ``outside`` and ``blocks`` (any may be missing).
        budget: the budget, whose unit family the size is in and whose name the words say to raise.

    Example:
        >>> over_budget_words({"static": 10, "outside": 500, "blocks": 40}, Budget.parse("1kB", "--memory_budget"))
        "most of it is what runs outside the blocks (an LM head's logits and loss, the embeddings, layers no block holds), 500 B: let memfit chunk an LM head (--memfit_head auto, or head='auto' in memfit.fit), name the layers no block holds as blocks (memfit.fit's blocks=), or lower --per_device_train_batch_size or the inputs' length (the logits grow with both), or raise --memory_budget"
    """
    part = max(parts_bytes, key=parts_bytes.__getitem__)
    what, fix = _FIXES.get(part) or part_floor_words(part) or (
        f"the {part_title(part)} beside the blocks", "lower --per_device_train_batch_size or --max_seq_length")
    if part == "outside-not-parts":  # named by the part kinds beside the blocks counted apart
        kinds = [kind for kind in parts_bytes if kind not in _FIXES]
        what = what.format(parts=" and ".join(_the(part_title(kind)) for kind in kinds) or "the parts beside them")
    name = budget.name if budget is not None else "the budget"
    return f"most of it is {what}, {_size(int(parts_bytes[part]), budget)}: {fix}, or raise {name}"


def verdict(records: Sequence[StepRecord], budget: Budget | None = None) -> str:
    """The summary's last line: whether the run kept its budget, and if not the one thing to change.

    Args:
        records: the run's step records.
        budget: the budget as the user gave it; else the records' budget, as bytes.
    """
    budget = budget if budget is not None else _recorded_budget(records)
    if budget is None:
        return "memfit: verdict: no budget was given; the peak above is what this run needs"
    over = [r for r in records if r.peak_allocated_bytes > (r.budget_bytes or budget.bytes)]
    if not over:
        return "memfit: verdict: every micro-step kept to the budget"
    worst = max(over, key=lambda r: r.peak_allocated_bytes)
    rest = max(worst.peak_allocated_bytes - worst.static_bytes, 0)
    parts = {"static": worst.static_bytes, "blocks": rest} if worst.static_bytes else {"blocks": rest}
    return (f"memfit: verdict: {len(over)} of {len(records)} micro-steps went over the budget; "
            + over_budget_words(parts, budget).replace("the blocks' activations, even checkpointed", "the activations"))


def _recorded_budget(records: Sequence[StepRecord]) -> Budget | None:
    """The budget the records hold, in bytes, or None; who gave it is not recorded, so it is "the budget"."""
    n_bytes = next((r.budget_bytes for r in records if r.budget_bytes), None)
    return None if n_bytes is None else Budget(n_bytes, name="the budget")


def parameters_words(trainable: int, total: int, adapted: Sequence[str] = (), n_adapted: int = 0) -> str:
    """How many parameters train and, for adapters (LoRA), which modules carry them.

    Example:
        >>> parameters_words(4_096, 2_000_000, ["q_proj", "v_proj"], 8)
        'trainable 4,096 of 2,000,000 parameters (0.20%), adapters on q_proj, v_proj (8 modules)'
    """
    words = f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
    if adapted:
        words += f", adapters on {', '.join(adapted)} ({n_adapted} module{'s' * (n_adapted != 1)})"
    return words


def start_line(
    method: str,
    budget: Budget | None,
    accounting: str,
    block_kinds: Sequence[str],
    parameters: str | None = None,
    compiled: str | None = None,
) -> str:
    """The line printed when training starts.

    Args:
        method: the method's name.
        budget: the budget as the user gave it (stated as typed, with its bytes), or ``None``.
        accounting: ``"cuda"`` or ``"logical"``.
        block_kinds: the class name of each block found, in order.
        parameters: what :func:`parameters_words` says of the model, or ``None`` to leave it out.
        compiled: for compiled blocks, the flag that asked for them (``"--torch_compile"``), or
            ``""`` when none did (``fit(compile=...)``); ``None`` for eager blocks.

    Returns:
        One line, starting ``memfit:``.

    Example:
        >>> start_line("dynamic", None, "cuda", ["LlamaDecoderLayer"] * 2, compiled="--torch_compile").split(", ")[-1]
        "compiled blocks (--torch_compile: each block's body and the loss compiled inside memfit's treatments)"
    """
    compiled_words = None
    if compiled is not None:
        compiled_words = f"compiled blocks ({compiled + ': ' if compiled else ''}each block's body and the loss compiled inside memfit's treatments)"
    return ", ".join(
        [
            f"memfit: method {method}",
            budget_words(budget),
            _ACCOUNTING.get(accounting, f"{accounting} accounting"),
            _blocks_words(block_kinds),
            *([parameters] if parameters else []),
            *([compiled_words] if compiled_words else []),
        ]
    )


def _parts_lines(records: Sequence[StepRecord]) -> list[str]:
    """The summary's line on each part beside the blocks the records hold (the LM head; a part kind
    given to ``fit(parts=...)``: NOTE [Parts in a record], records.py): the steps of each of its
    treatments (registry order, ``keep`` first), with the implementations that ran it where the
    records name them (``implementations``: NOTE [The head in a record]); none without such parts."""
    kinds = list(dict.fromkeys(kind for r in records for kind in r.parts))
    lines = []
    for kind in kinds:
        placed = [(r, r.parts[kind][0]) for r in records if kind in r.parts]
        names = in_registry_order({name for _, name in placed}, part=kind)
        words = []
        for name in sorted(names, key=lambda n: n != KEEP):
            mine = [r for r, ran_as in placed if ran_as == name]
            ran = Counter(r.implementations[kind] for r in mine if kind in r.implementations)
            by = "" if not ran else " (" + ", ".join(impl if len(ran) == 1 else f"{impl} {n}" for impl, n in ran.most_common()) + ")"
            unit = "" if words else f" micro-step{'s' * (len(mine) != 1)}"
            words.append(f"{'kept' if name == KEEP else name} on {len(mine)}{unit}{by}")
        lines.append(f"memfit: {part_title(kind)} {', '.join(words)}")
    return lines


# NOTE [What the summary counts]
# A step record is a micro-step (one forward + backward; several make an optimizer step under
# gradient accumulation, and a merged summary holds every rank's), so the summary counts
# micro-steps and names them so, beside the optimizer steps where its caller counted them: a
# count of records called "steps" read as optimizer steps, several times too many. Its per-step
# averages (blocks treated, each treatment's blocks, their share of the step's time) are over
# steady micro-steps only: warm-up treats blocks to measure them (``dynamic``'s recompute every
# block), so counting it showed a short run's plans treating several times the blocks they did.
# What warm-up did is said apart, in a clause of its own.
def _treated_words(fraction: float, treated: dict[str, int], steps: int, n_blocks: int) -> tuple[str, str]:
    """``("2.0 of 6 blocks recomputed per micro-step on average (33%)", "recompute")``, or with another
    treatment than recompute, each one's blocks per micro-step and ``"treatments"`` (a block under
    another treatment is not recomputed)."""
    recompute_only = set(treated) <= {RECOMPUTE}
    each = "" if recompute_only else ": " + ", ".join(f"{name} {treated[name] / steps:.1f}" for name in in_registry_order(treated))
    words = (f"{fraction * n_blocks:.1f} of {n_blocks} blocks {'recomputed' if recompute_only else 'treated'} per "
             f"micro-step on average ({100 * fraction:.0f}%{each})")
    return words, "recompute" if recompute_only else "treatments"


def _warmup_words(warmup: Sequence[StepRecord], n_blocks: int) -> str:
    """What the warm-up micro-steps did with the blocks (NOTE [What the summary counts])."""
    n = len(warmup)
    every = all(set(r.block_treatments) <= {RECOMPUTE} and r.n_checkpointed >= r.n_blocks for r in warmup)
    if every:
        return f"{n} warm-up micro-step{'s' * (n != 1)} recomputed every block"
    return f"{n} warm-up micro-step{'s' * (n != 1)}: " + _treated_words(
        mean_treated_fraction(warmup), treated_blocks(warmup), n, n_blocks)[0]


def end_summary(records: Sequence[StepRecord], budget: Budget | None = None, optimizer_steps: int | None = None) -> str:
    """The short summary printed when training ends (a few lines, each starting ``memfit:``).

    Micro-steps (and optimizer steps, where known), the peak and its share of the budget,
    micro-steps over budget, OOM replays, blocks treated per steady micro-step (with each
    treatment's share where a plan gave another than recompute) and the estimated share of their
    time spent on them, what warm-up did, the micro-steps' total time, and a one-line verdict
    (:func:`verdict`). NOTE [What the summary counts].

    Args:
        records: the run's step records (every rank's, for a merged summary).
        budget: the budget as the user gave it (see :func:`start_line`); else the records' budget,
            stated in bytes.
        optimizer_steps: the optimizer steps the records made up, where the caller counted them.

    Returns:
        The summary text (no trailing newline).
    """
    if not records:
        return "memfit: no training step ran"
    s = summarize(records, optimizer_steps)
    n_blocks = max(r.n_blocks for r in records)
    steady = [r for r in records if r.phase != "warmup"]
    warmup = [r for r in records if r.phase == "warmup"]
    ranks = len({r.rank for r in records})
    budget = budget if budget is not None else _recorded_budget(records)
    head = (
        f"memfit: {'' if optimizer_steps is None else f'{optimizer_steps} optimizer step' + 's' * (optimizer_steps != 1) + ', '}"
        f"{s.steps} micro-step{'s' * (s.steps != 1)}{f' over {ranks} ranks' if ranks > 1 else ''} "
        f"(forward + backward; {s.warmup_steps} warm-up), method {s.method}, {budget_words(budget)}"
    )
    if s.budget_bytes is None:
        peak = f"memfit: peak {_size(s.max_peak_allocated_bytes, budget)} ({s.accounting} accounting), not capped"
    else:
        share = 100 * s.max_peak_allocated_bytes / s.budget_bytes
        peak = (
            f"memfit: peak {_size(s.max_peak_allocated_bytes, budget)} = {share:.0f}% of the budget "
            f"({s.accounting} accounting), {s.over_budget_steps} micro-step{'s' * (s.over_budget_steps != 1)} over budget"
        )
    peak += f", {s.oom_retries} OOM replay{'s' * (s.oom_retries != 1)}"
    parts = []
    if steady:
        step_ms = sum(r.step_ms or 0.0 for r in steady)
        share_time = f"{100 * sum(r.recompute_ms_est for r in steady) / step_ms:.0f}%" if step_ms > 0 else "-"
        words, what = _treated_words(s.steady_treated_fraction, s.steady_treated_blocks, len(steady), n_blocks)
        # memfit's own decisions (planner_us), measured, where any was timed: issue 59 asks under 1% of a step
        decided_ms = sum(r.planner_us for r in steady) / 1e3
        decided = f", deciding {100 * decided_ms / step_ms:.1f}% (measured)" if decided_ms > 0 and step_ms > 0 else ""
        share = s.steady_collective_wait_share  # NOTE [The collective wait]
        waited = f", waiting on all-gathers {100 * share:.1f}% (measured)" if share is not None else ""
        parts.append(f"{words} over {len(steady)} steady micro-step{'s' * (len(steady) != 1)}, "
                     f"{what} about {share_time} of their time (estimated){decided}{waited}")
    else:
        parts.append("no steady micro-step")
    if warmup:
        parts.append(_warmup_words(warmup, n_blocks))
    total_s = sum(r.step_ms or 0.0 for r in records) / 1e3
    parts.append(f"the {s.steps} micro-step{'s' * (s.steps != 1)} took {total_s:.1f} s")
    lines = [head, peak, "memfit: " + "; ".join(parts), *_parts_lines(records)]
    if any(r.compiled_graphs for r in records):
        lines.append(
            f"memfit: compiling took {s.compile_ms / 1e3:.1f} s, "
            f"{s.steady_compiled_graphs} graph{'s' * (s.steady_compiled_graphs != 1)} compiled after warm-up"
        )
    return "\n".join([*lines, verdict(records, budget)])
