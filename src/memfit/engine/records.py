"""Step records and run summaries: the dataclasses and their JSONL reader/writer.

Everything memfit measures ends up here first (habit 7: structured results first). Reports
and plots read these files only, never printed text.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "StepRecord",
    "RunSummary",
    "JsonlWriter",
    "read_jsonl",
    "read_jsonl_numbered",
    "summarize",
    "mean_treated_fraction",
    "treated_blocks",
    "part_steps",
    "part_label",
    "parse_part_label",
]

#: Version of the step-record and summary schema. Bump on any incompatible change.
SCHEMA_VERSION = 1

#: how an earlier version named a part's implementation in a record: ``<kind>_implementation``
_IMPLEMENTATION = "_implementation"


def part_label(treatment: str, param: int = 1) -> str:
    """A part's option as records, plan files and reports write it: ``"keep"`` for the untreated
    option, else ``"<treatment>:<param>"`` (``"chunked:8"``: the head in 8 chunks) (NOTE [Parts in a record]).

    Example:
        >>> part_label("chunked", 8), part_label("keep")
        ('chunked:8', 'keep')
    """
    return treatment if treatment == "keep" else f"{treatment}:{int(param)}"


def parse_part_label(label: str, kind: str = "part") -> tuple[str, int]:
    """A part's treatment and parameter from its label (the inverse of :func:`part_label`):
    ``"keep"`` -> ``("keep", 1)``, ``"chunked:8"`` -> ``("chunked", 8)``.

    Raises:
        ValueError: naming the label and the part's ``kind``, when it is neither form.

    Example:
        >>> parse_part_label("chunked:8")
        ('chunked', 8)
    """
    name, sep, count = str(label).partition(":")
    try:
        n_chunks = int(count) if sep else 1
    except ValueError:
        n_chunks = 0
    if not name or n_chunks < 1:
        raise ValueError(f"{kind} label {label!r} is neither 'keep' nor '<treatment>:<n>' (e.g. the head's 'chunked:8')")
    return name, n_chunks


@dataclass
class StepRecord:
    """One optimizer micro-step (one training forward + backward).

    ``plan`` lists the blocks the plan treated (not kept), ``n_checkpointed`` counts them and
    ``treatments`` says how each was treated.

    # NOTE [Parts in a record]
    A step whose plan placed parts beside the blocks (the LM head, a part kind given to
    ``fit(parts=...)``: memfit.engine.parts.kind) holds each one's label (:func:`part_label`)
    under its kind's name in ``treatments``: a string where a block treatment's value is a list
    of block indices, so readers tell them apart by the value and know no kind's name
    (:attr:`parts`, :attr:`block_treatments`, :func:`part_steps`).

    # NOTE [The head in a record]
    A step whose plan placed the LM head (``fit(head=...)``, NOTE [The head in the plan] in
    planner.py) has ``treatments["head"]``: the head's label, ``"keep"`` or ``"chunked:<n>"``
    (``n`` chunks), as the plan files write it. It is the one key of ``treatments`` whose value is
    no block list: :attr:`parts` reads it as ``(treatment, n_chunks)`` under ``"head"`` and
    :attr:`block_treatments` leaves it out. A step without a planned head has no such key. A step whose
    head ran chunked names the implementation in ``implementations["head"]``, as any part that runs by one
    of several does under its kind; the end summary gives the steps kept and chunked, and by which
    implementation.

    Byte counts are plain bytes; ``budget_bytes`` is ``None`` when no budget is set.
    With ``accounting == "logical"`` (CPU), ``peak_allocated_bytes`` is parameters +
    gradients + optimizer state + saved activations counted from the tensors, and
    ``peak_reserved_bytes`` equals it. With ``accounting == "cuda"`` both come from the
    caching allocator (``max_memory_allocated`` / ``max_memory_reserved``, reset per step).
    """

    step: int
    shape: list[int]
    tokens: int
    method: str
    plan: list[int]
    n_checkpointed: int
    n_blocks: int
    predicted_peak_bytes: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    budget_bytes: int | None
    accounting: str
    step_ms: float | None
    recompute_ms_est: float
    oom_retries: int = 0
    phase: str = "steady"
    saved_activation_bytes: int = 0
    static_bytes: int = 0
    planner_us: float = 0.0
    #: the plan was made this step (no cached plan for its shape bucket), not read from the cache
    planned: bool = False
    evicted_blocks: list[int] = field(default_factory=list)
    #: the backstop ran this step's un-checkpointed blocks under the reactive store (NOTE
    #: [Backstop] in protection.py)
    backstop_armed: bool = False
    #: bytes the backstop's stores kept only as block inputs (no saved tensor held them):
    #: what arming added to the step beyond the blocks' own saved tensors
    backstop_input_bytes: int = 0
    #: the step counted its saved tensors (``saved_activation_bytes`` is 0 when it did not: NOTE
    #: [Counting what teaches] in engine/run/controller.py)
    counted: bool = True
    #: allocations of this step the CUDA caching allocator served only after releasing its
    #: cache (a device sync each; priced against the slack that would avoid them: NOTE [The slack is priced] in room.py)
    alloc_retries: int = 0
    #: the bytes the CUDA caching allocator held free in other streams' pools at the step's end, where read (the
    #: run's first step and a step that retried: NOTE [Other streams' pools] in room.py); None where not read
    stream_pool_bytes: int | None = None
    #: the peak until the parts beside the blocks (the LM head) finished their backward, read apart where the model
    #: learns that moment so (CUDA: NOTE [The parts' moment] in plan/model.py); None elsewhere
    parts_peak_bytes: int | None = None
    #: the treated blocks of the plan, by treatment name (``{"recompute": [0, 1]}``); every
    #: other block was kept (engine/parts/treatments/); and the LM head's label under ``"head"`` when the
    #: plan placed it (NOTE [The head in a record])
    treatments: dict[str, Any] = field(default_factory=dict)
    #: per part kind beside the blocks that runs by one of several implementations, the one that ran it this step
    #: (the LM head chunked: ``pure``, ``pure_grad_in_forward``, ``liger``, ``cce``, NOTE [Pricing the head] in
    #: treatments/chunked_head.py); a record of an earlier version holds it as ``<kind>_implementation``
    implementations: dict[str, str] = field(default_factory=dict)
    #: the attempts of this step that ran out of memory and were replayed, oldest first:
    #: ``stage`` (forward / backward / optimizer), ``plan``, ``phase``, ``shape``,
    #: ``predicted_peak_bytes``, ``margin_bytes``, ``slack_bytes``, ``pool_bytes``, ``evicted_blocks``,
    #: ``error`` (the allocator's message), and on CUDA ``allocated_bytes``,
    #: ``peak_allocated_bytes``, ``reserved_bytes``, ``unusable_reserved_bytes`` and
    #: ``backward_peak_bytes`` when the OOM was noted
    oom_attempts: list[dict[str, Any]] = field(default_factory=list)
    rank: int = 0
    #: with compiled blocks: time Dynamo spent compiling during this step, and the graphs it made
    #: (0 after warm-up when no new batch size or length recompiles: NOTE [Dynamic batch and
    #: length] in blocks.py)
    compile_ms: float = 0.0
    compiled_graphs: int = 0
    #: under FSDP2 over several ranks, the ms this step's compute waited on the parameters' all-gathers (NOTE [The
    #: collective wait] in engine/run/collectives.py); None elsewhere
    collective_wait_ms: float | None = None
    #: the ms the process spent in the garbage collector's passes since the record before (NOTE [The collector's
    #: pauses] in engine/run/collector.py)
    gc_ms: float = 0.0
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (the JSONL line)."""
        return dataclasses.asdict(self)

    @property
    def parts(self) -> dict[str, tuple[str, int]]:
        """Per part kind placed beside the blocks, its ``(treatment, param)`` this step (NOTE [Parts in a record])."""
        return {k: parse_part_label(v) for k, v in self.treatments.items() if isinstance(v, str)}

    @property
    def block_treatments(self) -> dict[str, list[int]]:
        """The treated blocks by treatment name, the parts' labels left out (NOTE [Parts in a record];
        a record of schema 1, with no ``treatments``, recomputed its ``plan``)."""
        kinds = {k: v for k, v in self.treatments.items() if not isinstance(v, str)}
        return kinds or ({"recompute": list(self.plan)} if self.plan else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepRecord":
        """Build a record from a JSONL line, ignoring fields this version does not know (a part's implementation
        written as ``<kind>_implementation`` by an earlier version goes to :attr:`implementations`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key.endswith(_IMPLEMENTATION) and isinstance(value, str) and key not in names:
                record.implementations.setdefault(key[: -len(_IMPLEMENTATION)], value)
        return record


@dataclass
class RunSummary:
    """Totals of one run plus the per-input-size peak table (``memory_count``).

    A record is a micro-step (one forward + backward): ``steps`` counts them, several per optimizer
    step under gradient accumulation, and those of every rank in a merged summary. Warm-up
    micro-steps treat blocks to measure them (``dynamic``'s recompute every block), so the
    ``steady_*`` fields give what the plans did once it ended.

    ``memory_count`` maps the input size (tokens per micro-batch, as a string key so the
    JSON round-trips) to ``{"steps": n, "max_peak_bytes": b}``: the per-input-size peak
    table of the original experiments.
    """

    method: str
    budget_bytes: int | None
    accounting: str
    #: micro-steps recorded (one forward + backward each)
    steps: int
    #: micro-steps of warm-up (``phase == "warmup"``); the rest are steady
    warmup_steps: int
    oom_retries: int
    max_peak_allocated_bytes: int
    max_peak_reserved_bytes: int
    over_budget_steps: int
    #: mean fraction of blocks treated (by the plan, or evicted), over every micro-step, warm-up included
    mean_checkpointed_fraction: float
    total_step_ms: float
    mean_planner_us: float
    memory_count: dict[str, dict[str, int]]
    #: steps whose kept blocks ran under the backstop's store (NOTE [Backstop] in protection.py)
    armed_steps: int = 0
    #: steps that evicted blocks mid-step (the backstop, or ``reactive``)
    evicting_steps: int = 0
    #: steps that counted their saved tensors (NOTE [Counting what teaches] in engine/run/controller.py)
    counted_steps: int = 0
    #: per treatment name, how many block-steps it was given (a block in one step counts once)
    treated_blocks: dict[str, int] = field(default_factory=dict)
    #: per part kind placed beside the blocks (the LM head's ``"head"`` among them: ``{"head": {"keep": 3,
    #: "chunked:8": 2}}``), steps per label (:func:`part_steps`, NOTE [Parts in a record])
    part_steps: dict[str, dict[str, int]] = field(default_factory=dict)
    #: with compiled blocks: compile time over the run, and graphs compiled in steady steps
    #: other than the run's first (recompiles after warm-up)
    compile_ms: float = 0.0
    steady_compiled_graphs: int = 0
    #: mean fraction of blocks treated (by the plan, or evicted) over steady micro-steps; None without one
    steady_treated_fraction: float | None = None
    #: :attr:`treated_blocks` over steady micro-steps
    steady_treated_blocks: dict[str, int] = field(default_factory=dict)
    #: optimizer steps the run took, where its caller counted them (the optimizer's step hook); None otherwise
    optimizer_steps: int | None = None
    #: the steady micro-steps' waits on FSDP2's all-gathers over their time (NOTE [The collective wait] in
    #: engine/run/collectives.py); None where no record read one
    steady_collective_wait_share: float | None = None
    #: with several ranks: each rank's own summary, by rank (as a string key)
    per_rank: dict[str, dict[str, Any]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(records: Iterable[StepRecord], optimizer_steps: int | None = None) -> RunSummary:
    """Fold step records into a :class:`RunSummary`.

    Args:
        records: the run's step records (micro-steps).
        optimizer_steps: the optimizer steps they made up, where the caller counted them.

    Raises:
        ValueError: if ``records`` is empty.
    """
    records = list(records)
    if not records:
        raise ValueError("cannot summarize a run with no step records")
    memory_count: dict[str, dict[str, int]] = {}
    for r in records:
        row = memory_count.setdefault(str(r.tokens), {"steps": 0, "max_peak_bytes": 0})
        row["steps"] += 1
        row["max_peak_bytes"] = max(row["max_peak_bytes"], r.peak_allocated_bytes)
    memory_count = dict(sorted(memory_count.items(), key=lambda kv: int(kv[0])))
    budget = records[-1].budget_bytes
    steady = [r for r in records if r.phase != "warmup"]
    return RunSummary(
        method=records[-1].method,
        budget_bytes=budget,
        accounting=records[-1].accounting,
        steps=len(records),
        warmup_steps=sum(r.phase == "warmup" for r in records),
        oom_retries=sum(r.oom_retries for r in records),
        max_peak_allocated_bytes=max(r.peak_allocated_bytes for r in records),
        max_peak_reserved_bytes=max(r.peak_reserved_bytes for r in records),
        over_budget_steps=sum(
            budget is not None and r.peak_allocated_bytes > budget for r in records
        ),
        mean_checkpointed_fraction=mean_treated_fraction(records),
        total_step_ms=sum(r.step_ms or 0.0 for r in records),
        mean_planner_us=sum(r.planner_us for r in records) / len(records),
        memory_count=memory_count,
        armed_steps=sum(r.backstop_armed for r in records),
        evicting_steps=sum(bool(r.evicted_blocks) for r in records),
        counted_steps=sum(r.counted for r in records),
        treated_blocks=treated_blocks(records),
        part_steps=part_steps(records),
        compile_ms=sum(r.compile_ms for r in records),
        steady_compiled_graphs=sum(r.compiled_graphs for r in records[1:] if r.phase == "steady"),
        steady_treated_fraction=mean_treated_fraction(steady) if steady else None,
        steady_treated_blocks=treated_blocks(steady),
        optimizer_steps=optimizer_steps,
        steady_collective_wait_share=_wait_share(steady),
    )


def _wait_share(steady: Sequence[StepRecord]) -> float | None:
    """The steady steps' ``collective_wait_ms`` over their time, where any step read it (NOTE [The collective wait])."""
    waits = [r.collective_wait_ms for r in steady if r.collective_wait_ms is not None]
    step_ms = sum(r.step_ms or 0.0 for r in steady)
    return sum(waits) / step_ms if waits and step_ms > 0 else None


def mean_treated_fraction(records: Sequence[StepRecord]) -> float:
    """The mean fraction of blocks a step treated: given a treatment by its plan, or evicted and
    recomputed (``reactive``, the backstop); 0.0 for no records."""
    return sum((r.n_checkpointed + len(r.evicted_blocks)) / max(r.n_blocks, 1) for r in records) / max(len(records), 1)


def treated_blocks(records: Sequence[StepRecord]) -> dict[str, int]:
    """Blocks given each treatment, summed over ``records`` (:attr:`StepRecord.block_treatments`:
    the LM head's label is no block)."""
    out: dict[str, int] = {}
    for r in records:
        for kind, blocks in r.block_treatments.items():
            out[kind] = out.get(kind, 0) + len(blocks)
    return dict(sorted(out.items()))


def part_steps(records: Sequence[StepRecord]) -> dict[str, dict[str, int]]:
    """Per part kind the records hold (NOTE [Parts in a record]), steps per label, each kind's
    labels by parameter then treatment (the head's fewest chunks first); empty when no plan
    placed a part beside the blocks.

    Example:
        >>> r = StepRecord(1, [8, 100], 800, "dynamic", [], 0, 2, None, 0, 0, None, "logical", None, 0.0)
        >>> part_steps([r, dataclasses.replace(r, treatments={"head": "chunked:4"})])
        {'head': {'chunked:4': 1}}
    """
    out: dict[str, dict[str, int]] = {}
    for r in records:
        for kind, label in r.treatments.items():
            if isinstance(label, str):
                counts = out.setdefault(kind, {})
                counts[label] = counts.get(label, 0) + 1
    return {kind: dict(sorted(counts.items(), key=lambda kv: parse_part_label(kv[0])[::-1])) for kind, counts in out.items()}


class JsonlWriter:
    """Write JSON lines to a file, flushed per line so a crashed run keeps its records.

    The file (and its folder) is made at the first line, so a run that fails before its first
    record leaves none.

    Args:
        path: file to write.
        append: add to an existing file instead of truncating it.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool = False):
        self.path = os.fspath(path)
        self.append = append
        self._fh: Any = None

    def write(self, obj: Any) -> None:
        if self._fh is None:
            folder = os.path.dirname(self.path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            self._fh = open(self.path, "a" if self.append else "w", encoding="utf-8")
        data = obj.to_dict() if hasattr(obj, "to_dict") else obj
        self._fh.write(json.dumps(data, sort_keys=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file (gzip-compressed when it ends in ``.gz``);
    blank lines are skipped.

    Raises:
        ValueError: naming the file and line of a line that is not valid JSON, or the file
            when it ends in ``.gz`` but is not gzip data.
    """
    for _, obj in read_jsonl_numbered(path):
        yield obj


def read_jsonl_numbered(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """:func:`read_jsonl`, each object with its line number (for messages about it)."""
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        lines = enumerate(fh, 1)
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
                raise ValueError(f"{os.fspath(path)}: not a readable gzip file ({exc}); re-compress it with gzip") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not valid JSON ({exc.msg})") from None
            yield lineno, obj
