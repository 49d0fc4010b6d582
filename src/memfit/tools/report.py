"""Tables and plots from bench results and step records: ``memfit report <dir>``.

Reads JSON lines only, never printed text (habit 7), from anywhere under ``<dir>``:

* bench results, ``results.jsonl``: one line per benchmark configuration and repeat (fields
  in :data:`RESULT_FIELDS`, optional ones in :data:`OPTIONAL_RESULT_FIELDS`);
* step records, ``*steps*.jsonl``: one :class:`memfit.engine.records.StepRecord` per micro-step.
  Their run summary (``memory_count`` included) is recomputed with
  :func:`memfit.engine.records.summarize`, the function that writes ``memfit_summary.json``.

and writes ``report.md`` (per task: a table of methods × budgets, a table of memory savers
when results carry ``eval_metric``, and one of peer sweeps when a peer ran at several settings
of its knob) and PNG plots: peak memory vs input size, time vs budget, and the
``memory_count`` histogram over input-size buckets, and the treatment mix per input size (every
treatment the records hold, the LM head's beside the blocks': NOTE [A colour per treatment]). Units: each table and plot shows sizes in the
unit its budget was given in, GiB without one (NOTE [One unit per table]; NOTE [A budget in the
unit it was given], summary_text.py). Warm-up steps are counted in the tables and drawn as
crosses in the peak plot; steps over their budget are ringed in red. Other readers of the same lines
(``benchmarks/tables.py``, the README's tables) take them from :func:`read_results` and group them
with :func:`table_key` and :func:`group_rows`, so that a ratio means the same in both.

# NOTE [Peer sweeps]
A peer whose knob is relative, not bytes (``compile-F``: torch.compile's activation memory
budget; ``ckptplan-F``: ckptplan's saving fraction; memfit.peers), runs once per setting as
methods named ``<peer>-<setting>``. Which setting fits a budget is only known by running it,
so the sweep table names, per peer and budget, the fastest setting whose repeats all finished
with their peak within the budget, and which settings did: the peer at its best tuning.

# NOTE [Deterministic output]
The same inputs give byte-identical ``report.md`` and PNGs, so that regenerating a committed
report shows no diff: files and rows are sorted, paths are written relative to ``<dir>``,
numbers have fixed formats, figures use matplotlib's default style (not the user's rc file)
and are saved without the ``Software`` PNG metadata (Agg writes no timestamp). Figures are
``matplotlib.figure.Figure`` objects, not pyplot, so no global backend or state is touched.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import ArgumentParser, DataError, MissingFileError
from memfit.engine.records import (
    RunSummary, StepRecord, parse_part_label, part_steps, read_jsonl_numbered, summarize, treated_blocks,
)
from memfit.engine.parts.kind import part_param_words, part_title
from memfit.engine.parts.treatments import BY_PART, KEEP, in_registry_order
from memfit.engine.summary_text import given_unit, size_in_given_unit

__all__ = [
    "RESULT_FIELDS", "OPTIONAL_RESULT_FIELDS", "Result", "Row", "TableKey", "build_report", "group_rows", "main",
    "read_results", "reference_row", "table_key",
]

GIB = 2**30
#: Fields every line of ``results.jsonl`` must have (``budget_bytes`` is null when uncapped).
RESULT_FIELDS = (
    "task", "model", "method", "budget_bytes", "batch_size", "steps", "total_s", "max_peak_allocated_bytes",
    "oom_count", "recomputed_fraction", "status", "device", "torch", "transformers",
)
#: Fields a result line may have.
OPTIONAL_RESULT_FIELDS = (
    "repeat", "warmup_steps", "planner_us_per_step", "steps_file", "eval_metric", "eval_value", "note",
    "peer_metrics", "paired_with", "paired_step_ratio", "paired_sum_ratio", "steady_step_ms", "commit", "tree_clean",
    "call",
)
# skipped: a peer that cannot run on that machine (not installed, needs CUDA); time_limit: a
# configuration a bench stopped before its last step (its time limit); replays: one stopped once it had replayed
# more OOMs than its rule allows (the reach suite's bisection: benchmarks/bisect_caps.py)
_STATUSES = ("ok", "oom", "error", "skipped", "time_limit", "replays")
# Table and legend order: memfit's methods first, then peers and savers alphabetically.
_METHOD_ORDER = ("none", "full", "dynamic", "oracle", "static", "precomputed", "reactive")
_DASH = "—"


@dataclass(frozen=True, eq=False)
class Result:
    """One line of ``results.jsonl``: one configuration, one repeat."""

    data: dict[str, Any]
    """The line's fields."""
    source: Path
    """The results file it came from."""
    line: int = 0
    """Its line number in ``source`` (1 for the first)."""
    median_step_ms: float | None = None
    """Median ``step_ms`` of the step records its ``steps_file`` names, times their micro-steps
    per optimizer step (None without them)."""

    def __getattr__(self, name: str) -> Any:
        if name in RESULT_FIELDS or name in OPTIONAL_RESULT_FIELDS:
            return self.data.get(name)
        raise AttributeError(name)


@dataclass(frozen=True, order=True)
class TableKey:
    """What a table holds fixed: results are comparable only within one table."""

    task: str
    """Task (recipe) name."""
    model: str
    """Model name."""
    device: str
    """GPU name."""
    batch_size: int
    """Examples per optimizer step."""
    steps: int
    """Optimizer steps run."""

    def title(self) -> str:
        return f"{self.task} · {self.model} · batch {self.batch_size} · {self.steps} steps · {self.device}"

    def slug(self) -> str:
        return _slug(f"{self.task}_{self.model}")


@dataclass
class Row:
    """The repeats of one (method, budget) configuration in one table."""

    method: str
    """Method (or peer / saver) name."""
    budget_bytes: int | None
    """Budget, ``None`` when uncapped."""
    results: list[Result]
    """One result per repeat."""

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == "ok"]

    @property
    def median_s(self) -> float | None:
        times = [r.total_s for r in self.ok if r.total_s is not None]
        return statistics.median(times) if times else None

    def median_of(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.ok if getattr(r, name) is not None]
        return statistics.median(values) if values else None

    @property
    def max_peak_bytes(self) -> int | None:
        peaks = [r.max_peak_allocated_bytes for r in self.results if r.max_peak_allocated_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def status(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in sorted({r.status for r in self.results})}
        if list(counts) == ["ok"]:
            return "ok"
        return ", ".join(f"{s} {n}/{len(self.results)}" for s, n in counts.items())

    @property
    def label(self) -> str:
        return f"{self.method} @ {_budget_text(self.budget_bytes)}"


@dataclass(frozen=True)
class _StepRun:
    """One step-record file and what it is plotted as."""

    path: str
    """Path relative to the input folder (posix)."""
    records: tuple[StepRecord, ...]
    """The step records, in file order."""
    summary: RunSummary
    """``summarize(records)``: totals and the ``memory_count`` table."""
    group: str
    """Plot group: the bench table it belongs to, else its folder."""
    stem: str
    """File-name stem of the group's plots."""
    repeat: int
    """Repeat number of the bench result that names this file (0 when none does)."""
    configuration: str | None = None
    """The method of the bench result that names this file (``dynamic+compile``, where the records
    say ``dynamic``); None when none does."""

    @property
    def method(self) -> str:
        return self.configuration or self.summary.method

    @property
    def budget_bytes(self) -> int | None:
        return self.summary.budget_bytes


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "run"


def _method_rank(method: str) -> tuple[int, str]:
    return (_METHOD_ORDER.index(method), "") if method in _METHOD_ORDER else (len(_METHOD_ORDER), method)


def _row_order(row: Row) -> tuple:
    return (_method_rank(row.method), row.budget_bytes is not None, row.budget_bytes or 0)


def _budget_text(budget_bytes: int | None) -> str:
    return "no budget" if budget_bytes is None else size_in_given_unit(budget_bytes)


def _budget_cell(budget_bytes: int | None) -> str:
    return _DASH if budget_bytes is None else size_in_given_unit(budget_bytes)


def _gib(n: float | None, unit: tuple[str, int] = ("GiB", GIB)) -> str:
    """A size in ``unit`` (NOTE [One unit per table])."""
    return _DASH if n is None else f"{n / unit[1]:.2f}"


# NOTE [One unit per table]
# A table or a plot shows every size in one unit, the one its (smallest) budget was given in,
# so that a peak reads against its budget without conversion: "300 MB" beside "0.58 GiB" did
# not. Without a budget the unit is GiB. Budgets keep their own cell text ("300 MB").
def _unit(budgets: Iterable[int | None]) -> tuple[str, int]:
    given = sorted(b for b in budgets if b)
    return given_unit(given[0] if given else None)


def _num(x: float | None, fmt: str) -> str:
    return _DASH if x is None else format(x, fmt)


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


# ---------------------------------------------------------------------------------- reading


def _numbered(path: Path) -> Iterable[tuple[int, Any]]:
    """``read_jsonl_numbered``, whose malformed lines are a :class:`DataError` (the user's file)."""
    try:
        yield from read_jsonl_numbered(path)
    except ValueError as err:
        raise DataError(str(err)) from None


def _read_results(path: Path) -> list[Result]:
    results = []
    for line, data in _numbered(path):
        where = f"{path}:{line}"
        if not isinstance(data, dict):
            raise DataError(f"{where}: a bench result must be a JSON object")
        missing = [f for f in RESULT_FIELDS if f not in data]
        if missing:
            raise DataError(f"{where}: missing field(s) {', '.join(missing)}; every line needs {', '.join(RESULT_FIELDS)}")
        if data["status"] not in _STATUSES:
            raise DataError(f"{where}: status {data['status']!r} is not one of {', '.join(_STATUSES)}")
        results.append(Result(data, path, line))
    return results


def _read_steps(path: Path) -> list[StepRecord]:
    required = [f.name for f in dataclasses.fields(StepRecord) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    records = []
    for line, data in _numbered(path):
        missing = [f for f in required if not isinstance(data, dict) or f not in data]
        if missing:
            raise DataError(f"{path}:{line}: not a step record, missing {', '.join(missing)}")
        records.append(StepRecord.from_dict(data))
    return records


def table_key(r: Result) -> TableKey:
    """What ``r`` shares with the results it may be compared with: one table of the report."""
    return TableKey(str(r.task), str(r.model), str(r.device), int(r.batch_size), int(r.steps))


def read_results(input_dir: str | Path) -> list[Result]:
    """Every bench result under ``input_dir``, as ``memfit report`` reads them (files and lines in
    sorted order; ``median_step_ms`` from the step records a line names).

    Args:
        input_dir: folder searched recursively for ``results.jsonl`` (or ``.gz``) and step records.

    Returns:
        One :class:`Result` per line; group them with :func:`table_key` and :func:`group_rows`.

    Raises:
        MissingFileError: no bench results or step records under ``input_dir``.
        DataError: a malformed line (the file and line named).
    """
    return _load(Path(input_dir).resolve())[0]


def _load(root: Path) -> tuple[list[Result], list[_StepRun], list[str]]:
    """Bench results, step runs and notes on skipped inputs, all in sorted order."""
    result_files = sorted(  # compressed after the run, as step records may be
        (p for name in ("results.jsonl", "results.jsonl.gz") for p in root.rglob(name) if p.is_file()),
        key=lambda p: _relative(p, root),
    )
    step_files = sorted(
        (p for pattern in ("*steps*.jsonl", "*steps*.jsonl.gz") for p in root.rglob(pattern) if p.is_file()),
        key=lambda p: _relative(p, root),
    )
    if not result_files and not step_files:
        raise MissingFileError(
            f"no bench results (results.jsonl[.gz]) or step records (*steps*.jsonl[.gz]) under {root}; "
            "pass the folder that `memfit bench` or `memfit train` wrote"
        )
    results = [r for f in result_files for r in _read_results(f)]
    linked: dict[str, Result] = {}
    skipped = []
    for r in results:
        if r.steps_file:
            target = (r.source.parent / r.steps_file).resolve()
            if not target.is_file() and target.with_name(target.name + ".gz").is_file():
                target = target.with_name(target.name + ".gz")  # compressed after the run
            if target.is_file() and target.is_relative_to(root):
                linked[_relative(target, root)] = r
            else:
                skipped.append(f"steps_file `{r.steps_file}` of {_relative(r.source, root)} ({r.method}) not found")
    # Step files named by a result's `steps_file` count whatever their names.
    step_files = sorted(set(step_files) | {root / name for name in linked}, key=lambda p: _relative(p, root))
    runs = []
    medians: dict[int, float] = {}  # id(result) -> median step time of its step records
    for f in step_files:
        name = _relative(f, root)
        records = _read_steps(f)
        if not records:
            skipped.append(f"`{name}` holds no step records")
            continue
        result = linked.get(name)
        folder = Path(name).parent.as_posix() if "/" in name else root.name
        group, stem = (table_key(result).title(), table_key(result).slug()) if result else (folder, _slug(folder))
        repeat = int(result.repeat or 0) if result else 0
        runs.append(_StepRun(name, tuple(records), summarize(records), group, stem, repeat,
                             result.method if result else None))
        step_ms = [r.step_ms for r in records if r.step_ms is not None]
        if result is not None and step_ms and result.steps:
            # records are micro-steps: scale to one optimizer step (gradient accumulation)
            medians[id(result)] = statistics.median(step_ms) * len(records) / int(result.steps)
    results = [dataclasses.replace(r, median_step_ms=medians.get(id(r))) for r in results]
    return results, runs, skipped


# ---------------------------------------------------------------------------------- tables


def group_rows(results: Iterable[Result]) -> list[Row]:
    """``results`` (of one table: :func:`table_key`) grouped by method and budget, in table order."""
    rows: dict[tuple[str, int | None], Row] = {}
    for r in results:
        rows.setdefault((r.method, r.budget_bytes), Row(r.method, r.budget_bytes, [])).results.append(r)
    return sorted(rows.values(), key=_row_order)


def reference_row(rows: Sequence[Row]) -> Row | None:
    """The uncapped ``none`` row: the speed reference of its table."""
    return next((r for r in rows if r.method == "none" and r.budget_bytes is None and r.median_s), None)


def _ratio(value: float | None, ref: float | None) -> str:
    return _DASH if value is None or not ref else f"{value / ref:.2f}×"


def _methods_table(rows: Sequence[Row], ref: Row | None) -> list[str]:
    unit = _unit(row.budget_bytes for row in rows)
    lines = [
        f"| method | budget | median time (s) | vs none | median step (ms) | step vs none | max peak ({unit[0]}) "
        "| peak / budget | OOMs | recomputed | warm-up steps | planner µs/step | repeats | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    ref_step = ref.median_of("median_step_ms") if ref else None
    for row in rows:
        peak, budget = row.max_peak_bytes, row.budget_bytes
        share = _DASH if peak is None or budget is None else f"{100 * peak / budget:.0f}%"
        ooms = max(r.oom_count or 0 for r in row.results)
        recomputed = [r.recomputed_fraction for r in row.ok if r.recomputed_fraction is not None]
        recomputed_text = f"{100 * statistics.fmean(recomputed):.1f}%" if recomputed else _DASH
        warmup = [r.warmup_steps for r in row.results if r.warmup_steps is not None]
        step = row.median_of("median_step_ms")
        lines.append(
            f"| {row.method} | {_budget_cell(budget)} | {_num(row.median_s, '.2f')} | "
            f"{_ratio(row.median_s, ref.median_s if ref else None)} | {_num(step, '.1f')} | {_ratio(step, ref_step)} | "
            f"{_gib(peak, unit)} | {share} | {ooms} | {recomputed_text} | {max(warmup) if warmup else _DASH} | "
            f"{_num(row.median_of('planner_us_per_step'), '.1f')} | {len(row.results)} | {row.status} |"
        )
    return lines


def _savers_table(rows: Sequence[Row], ref: Row | None) -> list[str]:
    savers = [r for r in rows if any(x.eval_metric for x in r.results)]
    if not savers:
        return []
    ref_metric = next((x.eval_metric for x in ref.results if x.eval_metric), None) if ref else None
    ref_value = ref.median_of("eval_value") if ref else None
    unit = _unit(row.budget_bytes for row in savers)
    lines = [
        "",
        "Memory savers (relative to the vanilla row, `none` with no budget; *median step*: the median "
        "`step_ms` of the run's step records times its micro-steps per optimizer step, less swayed than the "
        "total by one-off costs such as a first step or a first step per new input shape):",
        "",
        "| method | budget | median time (s) | time vs vanilla | median step (ms) | step vs vanilla "
        f"| max peak ({unit[0]}) | peak vs vanilla | metric | value | Δ vs vanilla |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    ref_step = ref.median_of("median_step_ms") if ref else None
    for row in savers:
        metric = next(x.eval_metric for x in row.results if x.eval_metric)
        value = row.median_of("eval_value")
        same = metric == ref_metric and value is not None and ref_value is not None
        step = row.median_of("median_step_ms")
        lines.append(
            f"| {row.method} | {_budget_cell(row.budget_bytes)} | {_num(row.median_s, '.2f')} | "
            f"{_ratio(row.median_s, ref.median_s if ref else None)} | {_num(step, '.1f')} | {_ratio(step, ref_step)} | "
            f"{_gib(row.max_peak_bytes, unit)} | "
            f"{_ratio(row.max_peak_bytes, ref.max_peak_bytes if ref else None)} | {metric} | {_num(value, '.4f')} | "
            f"{format(value - ref_value, '+.4f') if same else _DASH} |"
        )
    return lines


_SETTING = re.compile(r"^(?P<peer>.+)-(?P<setting>\d+(?:\.\d+)?)$")


def _sweeps_table(rows: Sequence[Row], ref: Row | None) -> list[str]:
    """Per swept peer and budget, the fastest setting within the budget (NOTE [Peer sweeps])."""
    sweeps: dict[tuple[str, int], list[tuple[float, Row]]] = {}
    for row in rows:
        match = _SETTING.match(row.method)
        if match and row.budget_bytes is not None:
            sweeps.setdefault((match["peer"], row.budget_bytes), []).append((float(match["setting"]), row))
    sweeps = {key: settings for key, settings in sweeps.items() if len(settings) > 1}
    if not sweeps:
        return []
    unit = _unit(budget for _, budget in sweeps)
    lines = [
        "",
        "Peer sweeps (methods named `<peer>-<setting>`, NOTE [Peer sweeps]): per budget, the fastest setting "
        "whose repeats all finished with their peak within the budget:",
        "",
        f"| peer | budget | fastest within budget | median time (s) | vs none | max peak ({unit[0]}) | settings within budget |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for (peer, budget), settings in sorted(sweeps.items()):
        settings.sort(key=lambda s: s[0])
        fitting = [
            (setting, row) for setting, row in settings
            if row.status == "ok" and row.median_s is not None and (row.max_peak_bytes or 0) <= budget
        ]
        within = f"{len(fitting)} of {len(settings)}" + (f": {', '.join(f'{s:g}' for s, _ in fitting)}" if fitting else "")
        if not fitting:
            lines.append(f"| {peer} | {_budget_cell(budget)} | {_DASH} | {_DASH} | {_DASH} | {_DASH} | {within} |")
            continue
        _, best = min(fitting, key=lambda s: (s[1].median_s, s[0]))
        lines.append(
            f"| {peer} | {_budget_cell(budget)} | {best.method} | {_num(best.median_s, '.2f')} | "
            f"{_ratio(best.median_s, ref.median_s if ref else None)} | {_gib(best.max_peak_bytes, unit)} | {within} |"
        )
    return lines


def _paired_table(rows: Sequence[Row]) -> list[str]:
    """Runs timed step by step in turn with another in one process (``paired_with``): per repeat,
    the median of their per-step time ratios and the ratio of their summed steady steps."""
    paired = [(row, r) for row in rows for r in row.results if r.paired_step_ratio is not None]
    if not paired:
        return []
    lines = [
        "",
        "Paired runs (two configurations step by step in turn in one process, on the same batches: the GPU's "
        "drift between runs falls on both): per repeat, the median over steady steps of each step's time over "
        "its twin's, and the ratio of their summed steady steps:",
        "",
        "| method | against | repeat | median per-step ratio | summed ratio |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row, r in sorted(paired, key=lambda p: (p[0].method, p[1].repeat if p[1].repeat is not None else -1)):
        lines.append(f"| {row.method} | {r.paired_with or _DASH} | {_DASH if r.repeat is None else r.repeat} | "
                     f"{r.paired_step_ratio:.4f} | {_num(r.paired_sum_ratio, '.4f')} |")
    pairs: dict[tuple[str, str], list[float]] = {}
    for row, r in paired:
        pairs.setdefault((row.method, r.paired_with or _DASH), []).append(r.paired_step_ratio)
    for (method, twin), ratios in sorted(pairs.items()):
        if len(ratios) > 1:
            lines.append(f"| {method} | {twin}, median of {len(ratios)} | | {statistics.median(ratios):.4f} | |")
    return lines


def _runs_table(runs: Sequence[_StepRun]) -> list[str]:
    """Per step-record file: its micro-steps (a record each, NOTE [What the summary counts] in
    summary_text.py), peaks, and the share of blocks its steady micro-steps treated."""
    unit = _unit(run.summary.budget_bytes for run in runs)
    # under FSDP over several ranks: the steady steps' share waited on the all-gathers (NOTE [The collective wait])
    waits = any(run.summary.steady_collective_wait_share is not None for run in runs)
    lines = [
        f"| step file | method | budget | accounting | micro-steps | warm-up | max peak ({unit[0]}) | over budget "
        f"| OOM retries | treated (steady) | planner µs |{' all-gather wait (steady) |' * waits}",
        f"| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |{' ---: |' * waits}",
    ]
    for run in runs:
        s, share = run.summary, run.summary.steady_collective_wait_share
        lines.append(
            f"| `{run.path}` | {run.method} | {_budget_cell(s.budget_bytes)} | {s.accounting} | {s.steps} | {s.warmup_steps} | "
            f"{_gib(s.max_peak_allocated_bytes, unit)} | {s.over_budget_steps} | {s.oom_retries} | "
            f"{_DASH if s.steady_treated_fraction is None else f'{100 * s.steady_treated_fraction:.1f}%'} | "
            f"{s.mean_planner_us:.1f} |{(f' {_DASH} |' if share is None else f' {100 * share:.1f}% |') * waits}"
        )
    return lines


def _treatment_names(runs: Sequence[_StepRun]) -> tuple[list[str], dict[str, list[str]]]:
    """The block treatments ``runs``' records hold, and per part kind beside the blocks they hold (in the
    records' order) its treatments, each in registry order, any name the registry does not know after
    (:func:`in_registry_order`); ``keep`` is no block column: a block no treatment lists was kept."""
    records = [rec for run in runs for rec in run.records]
    blocks = in_registry_order({name for rec in records for name in rec.block_treatments} - {KEEP})
    kinds = dict.fromkeys(kind for rec in records for kind in rec.parts)
    parts = {kind: in_registry_order({rec.parts[kind][0] for rec in records if kind in rec.parts}, part=kind) for kind in kinds}
    return blocks, parts


@dataclass(frozen=True)
class _MixRow:
    """One input-size range of a run's steady steps: the mean blocks per step each treatment got,
    and how many steps ran the LM head each way (``{"keep": 3, "chunked:8": 2}``; empty when no step
    planned the head: NOTE [The head in a record], records.py)."""

    first: int
    last: int
    steps: int
    mix: tuple[tuple[str, float], ...]
    """Per block treatment of the table (:func:`_treatment_names`), the mean blocks per step it got."""
    kept: float
    parts: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    """Per part kind beside the blocks the records hold (NOTE [Parts in a record], records.py), its steps per label."""

    def part_text(self, kind: str) -> str:
        return ", ".join(f"{label} ×{n}" for label, n in dict(self.parts).get(kind, ())) or _DASH

    def shares(self, kind: str) -> dict[str, tuple[float, float]]:
        """Per treatment of the part kind ``kind`` the range's steps ran, the share of those steps and the mean of
        their labels' parameter (the LM head's chunk count); empty where none ran it."""
        labels = dict(self.parts).get(kind, ())
        steps = sum(count for _, count in labels)
        out: dict[str, tuple[int, int]] = {}  # treatment -> (steps, parameter summed over them)
        for label, count in labels:
            name, param = parse_part_label(label, kind)
            n, total = out.get(name, (0, 0))
            out[name] = (n + count, total + param * count)
        return {name: (n / steps, round(total / n, 1)) for name, (n, total) in out.items()}


def _mixed_runs(runs: Sequence[_StepRun]) -> list[_StepRun]:
    """The runs whose plans treated a block or placed the LM head."""
    return [r for r in runs if any(rec.treatments or rec.plan for rec in r.records)]


def _mix_rows(runs: Sequence[_StepRun], bins: int = 6) -> dict[int, list[_MixRow]]:
    """Per run (by ``id``), its steady steps in ``bins`` equal ranges of tokens shared by ``runs``, with
    the treatment mix of each range (a column per block treatment any of ``runs`` holds); a run with one
    mix at every size gets one row."""
    steady = {id(r): [rec for rec in r.records if rec.phase != "warmup"] for r in runs}
    tokens = [rec.tokens for recs in steady.values() for rec in recs]
    if not tokens:
        return {}
    names, _ = _treatment_names(runs)
    low, high = min(tokens), max(tokens)
    width = max(1, -(-(high - low + 1) // bins))
    out = {}
    for run in runs:
        by_bin: dict[int, list[StepRecord]] = {}
        for rec in steady[id(run)]:
            by_bin.setdefault((rec.tokens - low) // width, []).append(rec)
        rows = []
        for b in sorted(by_bin):
            recs = by_bin[b]
            counts = treated_blocks(recs)
            mix = tuple((name, counts.get(name, 0) / len(recs)) for name in names)
            kept = recs[0].n_blocks - sum(m for _, m in mix)
            rows.append(_MixRow(low + b * width, low + (b + 1) * width - 1, len(recs), mix, kept, _part_rows(recs)))
        if len({(row.mix, tuple((kind, tuple(label for label, _ in counts)) for kind, counts in row.parts)) for row in rows}) == 1:
            # one mix at every size (full, static)
            rows = [dataclasses.replace(rows[0], last=rows[-1].last, steps=sum(row.steps for row in rows), parts=_part_rows(steady[id(run)]))]
        out[id(run)] = rows
    return out


def _part_rows(records: Sequence[StepRecord]) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """Per part kind ``records`` hold beside the blocks, its steps per label (:func:`part_steps`)."""
    return tuple((kind, tuple(counts.items())) for kind, counts in part_steps(records).items())


def _mix_table(runs: Sequence[_StepRun], bins: int = 6) -> list[str]:
    """The treatment mix per input size: for each run that treated blocks or placed the head, its
    steady steps in ``bins`` equal ranges of tokens, the mean number of blocks each treatment got
    there, and per part kind beside the blocks a run's records hold (the LM head, a user's part kind)
    the steps per label of it, a column each (NOTE [Parts in a record], records.py)."""
    treated = _mixed_runs(runs)
    rows = _mix_rows(treated, bins)
    if not rows:
        return []
    names, _ = _treatment_names(treated)
    kinds = list(dict.fromkeys(kind for run_rows in rows.values() for row in run_rows for kind, _ in row.parts))
    about = ""
    if kinds:
        counted = "".join(f" (the {part_title(kind)}'s n: {part_param_words(kind)})" for kind in kinds if part_param_words(kind))
        about = f"; per part beside the blocks, its treatment as `<treatment>:<n>`{counted} and its micro-steps"
    lines = [
        "", "Treatment mix per input size (steady micro-steps; mean blocks per micro-step given each treatment the "
        "records hold, the rest kept" + about + "):", "",
        "| run | tokens | micro-steps | " + "".join(f"{name} | " for name in names) + "kept |" + "".join(f" {kind} (micro-steps) |" for kind in kinds),
        "| --- | --- | ---: | " + "".join("---: | " for _ in names) + "---: |" + " --- |" * len(kinds),
    ]
    for run in treated:
        for row in rows.get(id(run), []):
            lines.append(f"| {_label(run)} | {row.first}-{row.last} | {row.steps} | " + "".join(f"{m:.1f} | " for _, m in row.mix)
                         + f"{row.kept:.1f} |" + "".join(f" {row.part_text(kind)} |" for kind in kinds))
    return lines


_LEGEND = (
    "Per configuration (method × budget), over its repeats: *median time* of the repeats that "
    "finished (`ok`); *vs none*: that time over the median of `none` with no budget in the same "
    "table; *median step*: the median of a run's step times (from its step records, per optimizer "
    "step), the median over repeats, and its ratio to `none`'s: robust to the first step of each new "
    "input size (kernel choice, allocator growth), which a short multi-scale run's total is not; "
    "*max peak*: largest `max_peak_allocated_bytes` of any repeat, and its share of the "
    "budget; *OOMs*: most OOMs of one repeat; *recomputed*: mean fraction of blocks recomputed; "
    "*status*: `ok`, or the share of repeats per status. Sizes in the unit of the table's budget, as its column "
    "says (GB = 10**9 bytes, GiB = 2**30, MB = 10**6, MiB = 2**20); GiB without a budget."
)


# ---------------------------------------------------------------------------------- plots


def _figure(**kwargs: Any):
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig: Any, path: Path) -> None:
    """Write ``fig`` as a 64-colour PNG: a quarter of the size of matplotlib's RGBA one, and a
    plot of a few line colours loses nothing visible (published results stay small). The palette
    is an octree's: median cut splits by pixel count, so a colour drawn only as a thin line (a
    method in the time plot, a head treatment) lost its hue to the grey around it."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=64, method=Image.Quantize.FASTOCTREE).save(path, format="PNG", optimize=True)


def _wrap(title: str) -> str:
    """A plot's title in lines that fit the figure (a group's title names model, task and device)."""
    import textwrap

    return "\n".join(textwrap.fill(line, 100) for line in title.split("\n"))


def _legend(ax: Any) -> None:
    """A legend of at most 8 rows: a matrix of many methods and budgets gets more columns, not a
    legend taller than its axes."""
    entries = len(ax.get_legend_handles_labels()[0])
    ax.legend(fontsize=8 if entries <= 8 else 7, ncol=-(-entries // 8))


def _color(method: str, methods: Sequence[str]) -> Any:
    """One colour per method of a plot: matplotlib's ten, then the ten lighter shades of tab20
    (a suite's group compares up to twenty methods)."""
    import matplotlib

    i = methods.index(method) % 20
    return f"C{i}" if i < 10 else matplotlib.colormaps["tab20"](2 * (i - 10) + 1)


def _plot_time_vs_budget(key: TableKey, rows: Sequence[Row], ref: Row | None, path: Path) -> None:
    fig = _figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    methods = sorted({r.method for r in rows}, key=_method_rank)
    for method in methods:
        mine = [r for r in rows if r.method == method]
        capped = [r for r in mine if r.budget_bytes is not None and r.median_s is not None]
        for r in mine:
            if r.budget_bytes is None and r.median_s is not None:
                ax.axhline(r.median_s, color=_color(method, methods), linestyle="--", label=f"{method} (no budget)")
        if capped:
            ax.plot([r.budget_bytes / GIB for r in capped], [r.median_s for r in capped], marker="o",
                    color=_color(method, methods), label=method)
        failed = [r.budget_bytes / GIB for r in mine if r.budget_bytes is not None and r.median_s is None]
        if failed:
            ax.plot(failed, [0.02] * len(failed), linestyle="none", marker="x", markersize=9,
                    color=_color(method, methods), transform=ax.get_xaxis_transform(), label=f"{method}: failed")
    if ref is not None:
        ax.secondary_yaxis("right", functions=(lambda t: t / ref.median_s, lambda x: x * ref.median_s)).set_ylabel(
            "time relative to none (no budget)"
        )
    budgets = sorted({r.budget_bytes for r in rows if r.budget_bytes is not None})
    if budgets:  # positions in GiB, labels in the unit each budget was given
        ax.set_xticks([b / GIB for b in budgets], [_budget_text(b) for b in budgets])
    ax.set_xlabel("memory budget (axis in GiB)")
    ax.set_ylabel("median total time (s)")
    ax.set_title(_wrap(f"Time vs budget\n{key.title()}"), fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path)


def _run_styles(runs: Sequence[_StepRun]) -> tuple[list[str], list[int]]:
    """Methods (one colour each) and budgets (one line style each) of ``runs``, sorted."""
    methods = sorted({r.method for r in runs}, key=_method_rank)
    budgets = sorted({r.budget_bytes for r in runs if r.budget_bytes is not None})
    return methods, budgets


def _linestyle(run: _StepRun, budgets: Sequence[int]) -> str:
    styles = ("-", "--", ":", "-.")
    return styles[0 if run.budget_bytes is None else (budgets.index(run.budget_bytes) + 1) % len(styles)]


def _label(run: _StepRun) -> str:
    return f"{run.method} @ {_budget_text(run.budget_bytes)}"


def _plot_peak_vs_tokens(group: str, runs: Sequence[_StepRun], path: Path) -> None:
    methods, budgets = _run_styles(runs)
    panels = budgets or [None]
    unit_name, unit = _unit(budgets)
    fig = _figure(figsize=(max(8.0, 5.5 * len(panels)), 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, budget in zip(axes, panels):
        for run in runs:
            if run.budget_bytes not in (budget, None):
                continue
            for warmup in (False, True):  # warm-up steps (measured as `full`) as crosses
                steps = [r for r in run.records if (r.phase == "warmup") == warmup]
                if steps:
                    ax.scatter([r.tokens for r in steps], [r.peak_allocated_bytes / unit for r in steps], s=12 + 12 * warmup,
                               alpha=0.7, color=_color(run.method, methods), marker="x" if warmup else "o",
                               label=f"{_label(run)}, warm-up" if warmup else _label(run))
            over = [r for r in run.records if r.budget_bytes and r.peak_allocated_bytes > r.budget_bytes]
            if over:  # ringed in red: the steps over their budget
                ax.scatter([r.tokens for r in over], [r.peak_allocated_bytes / unit for r in over], s=70,
                           facecolors="none", edgecolors="red", linewidths=1.2, label=f"{_label(run)}: over budget")
        if budget is not None:
            ax.axhline(budget / unit, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_title(f"budget {_budget_text(budget)}", fontsize=10)
        ax.set_xlabel("input size (tokens per micro-batch)")
        ax.grid(alpha=0.3)
        _legend(ax)
    accounting = ", ".join(sorted({r.summary.accounting for r in runs}))
    axes[0].set_ylabel(f"peak allocated per micro-step ({unit_name}, {accounting} accounting)")
    fig.suptitle(_wrap(f"Peak memory vs input size\n{group}"), fontsize=11)
    _save(fig, path)


def size_buckets(sizes: Sequence[int]) -> list[float]:
    """Edges of the steps-per-size histogram: about ``sqrt(n)`` equal buckets over the distinct
    sizes (4 to 20), so that sizes that each occur once still stack into a distribution.

    Example:
        >>> size_buckets(list(range(100, 1700, 100)))
        [100.0, 475.0, 850.0, 1225.0, 1600.0]
    """
    import numpy as np

    if len(sizes) < 2:
        return [sizes[0] - 0.5, sizes[0] + 0.5] if sizes else [0.0, 1.0]
    n = int(np.clip(round(len(sizes) ** 0.5), 4, 20))
    return [float(e) for e in np.linspace(min(sizes), max(sizes), n + 1)]


def _plot_memory_count(group: str, runs: Sequence[_StepRun], path: Path) -> None:
    methods, budgets = _run_styles(runs)
    fig = _figure(figsize=(8, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    unit_name, unit = _unit(budgets)
    sizes = sorted({int(k) for run in runs for k in run.summary.memory_count})
    edges = size_buckets(sizes)
    for run in runs:
        table = sorted((int(k), v) for k, v in run.summary.memory_count.items())
        style = {"color": _color(run.method, methods), "linestyle": _linestyle(run, budgets)}
        top.hist([k for k, _ in table], bins=edges, weights=[v["steps"] for _, v in table], histtype="step",
                 label=_label(run), **style)
        bottom.plot([k for k, _ in table], [v["max_peak_bytes"] / unit for _, v in table], marker=".",
                    label=_label(run), **style)
        over = [(k, v) for k, v in table if run.budget_bytes and v["max_peak_bytes"] > run.budget_bytes]
        if over:  # ringed in red: sizes whose largest peak went over the budget
            bottom.scatter([k for k, _ in over], [v["max_peak_bytes"] / unit for _, v in over], s=60, facecolors="none",
                           edgecolors="red", linewidths=1.2, label=f"{_label(run)}: over budget")
    for budget in budgets:
        bottom.axhline(budget / unit, color="gray", linestyle="--", linewidth=1, label=f"budget {_budget_text(budget)}")
    top.set_ylabel("micro-steps")
    top.set_title(f"micro-steps per input-size bucket ({len(edges) - 1} buckets)", fontsize=10)
    bottom.set_ylabel(f"largest peak ({unit_name})")
    bottom.set_title("largest peak per input size", fontsize=10)
    bottom.set_xlabel("input size (tokens per micro-batch)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.suptitle(_wrap(f"memory_count: steps and largest peak per input size\n{group}"), fontsize=11)
    _save(fig, path)


# NOTE [A colour per treatment]
# A treatment keeps its colour in every plot, whatever else the runs' records hold, so that two
# reports read alike: a registered one takes the slot of matplotlib's ten given by its place in the
# registry (BY_PART: the blocks' treatments, then the LM head's; the eleventh to twentieth take tab20's
# lighter twins of those ten, in order), kept blocks are light grey, and a
# name the registry does not know (a class a run was given) is hatched, in one of Dark2's eight
# colours picked by a checksum of its name (crc32: the same on every machine and run, unlike
# hash()); where two unknown names of one plot pick the same, the later (alphabetically) takes the
# next free one.
def _treatment_colors(blocks: Sequence[str], parts: Mapping[str, Sequence[str]]) -> dict[tuple[str, str], tuple[Any, str]]:
    """The colour and hatch of each ``(part, treatment)`` of a plot (NOTE [A colour per treatment])."""
    import zlib

    import matplotlib

    registered = [(part, name) for part, names in BY_PART.items() for name in names if (part, name) != ("block", KEEP)]
    fallback = matplotlib.colormaps["Dark2"].colors
    out: dict[tuple[str, str], tuple[Any, str]] = {("block", KEEP): ("0.8", "")}
    taken: set[int] = set()
    for key in [("block", name) for name in blocks] + [(kind, name) for kind, names in parts.items() for name in names]:
        if key in out:
            continue
        i = registered.index(key) if key in registered else None
        if i is not None and i < 10:
            out[key] = (f"C{i}", "")
            continue
        if i is not None and i < 20:  # past matplotlib's ten: tab20's lighter twins of them, in order
            out[key] = (matplotlib.colormaps["tab20"].colors[2 * (i - 10) + 1], "")
            continue
        slot = zlib.crc32(key[1].encode()) % len(fallback)
        while slot in taken and len(taken) < len(fallback):
            slot = (slot + 1) % len(fallback)
        taken.add(slot)
        out[key] = (fallback[slot], "//")
    return out


def _plot_treatments(group: str, runs: Sequence[_StepRun], path: Path) -> bool:
    """Per run with steady steps, the treatment mix per input size (:func:`_mix_rows`) as stacked bars
    of blocks, a bar per treatment the records hold, and, where the run planned the LM head, the share
    of steps that ran it each way on the right axis, each point labelled with those steps' mean chunk
    count. Returns whether it drew anything."""
    rows = _mix_rows(runs)
    blocks, parts = _treatment_names(runs)
    runs = [r for r in runs if rows.get(id(r))]
    if not runs:
        return False
    colors = _treatment_colors(blocks, parts)
    # 800 pixels wide like the other plots, one panel per run on a shared axis of tokens, and one
    # legend for every panel below them, where it covers no bar or line
    fig = _figure(figsize=(8, 1.6 + 2.9 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False).ravel()
    entries: dict[str, Any] = {}  # legend label -> handle, every panel's, in drawing order
    for ax, run in zip(axes, runs):
        mine = rows[id(run)]
        centres = [(row.first + row.last) / 2 for row in mine]
        width = 0.8 * min(row.last - row.first + 1 for row in mine)
        bottom = [0.0] * len(mine)
        for name in [*blocks, KEEP]:
            heights = [row.kept if name == KEEP else dict(row.mix)[name] for row in mine]
            if any(heights):
                color, hatch = colors[("block", name)]
                ax.bar(centres, heights, width=width, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                       label="kept" if name == KEEP else name)
                bottom = [b + h for b, h in zip(bottom, heights)]
        drawn = [kind for kind in parts if any(dict(row.parts).get(kind) for row in mine)]
        if drawn:
            right = ax.twinx()
            for at, kind in enumerate(drawn):  # a marker per kind: two kinds' lines at one share both show
                ran = [(c, row.shares(kind)) for c, row in zip(centres, mine)]
                for name in parts[kind]:
                    points = [(c, shares[name]) for c, shares in ran if name in shares]
                    if not points:
                        continue
                    color, hatch = colors[(kind, name)]
                    right.plot([c for c, _ in points], [100 * share for _, (share, _) in points], color=color,
                               marker="os^Dv"[at % 5], markersize=7 - 2 * (at % 2), linestyle="--" if hatch else "-",
                               label=f"{part_title(kind)} {name}")
                    for c, (share, param) in points:
                        if param > 1:
                            right.annotate(f"×{param:g}", (c, 100 * share), textcoords="offset points", xytext=(0, 5),
                                           ha="center", fontsize=7)
            right.set_ylim(-5, 115)
            words = sorted({part_param_words(kind) for kind in drawn} - {""})
            title = part_title(drawn[0]) if len(drawn) == 1 else "parts beside the blocks"
            right.set_ylabel(f"{title}: micro-steps (%)" + "".join(f"\n×mean {w}" for w in words), fontsize=8)
            entries.update(zip(*right.get_legend_handles_labels()[::-1]))
        entries.update(zip(*ax.get_legend_handles_labels()[::-1]))
        ax.set_title(_label(run), fontsize=9)
        ax.set_ylabel("blocks per micro-step (mean)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("input size (tokens per micro-batch)", fontsize=8)
    parts_labels = {f"{part_title(kind)} {name}" for kind, names in parts.items() for name in names}
    blocks_first = sorted(entries, key=lambda label: label in parts_labels)
    fig.legend([entries[label] for label in blocks_first], blocks_first, loc="outside lower center",
               ncol=min(len(entries), 5), fontsize=8)
    fig.suptitle(_wrap(f"Treatment mix per input size (steady micro-steps)\n{group}"), fontsize=11)
    _save(fig, path)
    return True


# ---------------------------------------------------------------------------------- report


def _unique_names(keys: Sequence[Any], slug: Any) -> dict[Any, str]:
    """A distinct file-name stem per key (sorted order; ``-2``, ``-3`` for collisions)."""
    names: dict[Any, str] = {}
    for key in keys:
        stem = candidate = slug(key)
        n = 2
        while candidate in names.values():
            candidate, n = f"{stem}-{n}", n + 1
        names[key] = candidate
    return names


def build_report(input_dir: str | Path, output_dir: str | Path | None = None, plots: bool = True) -> Path:
    """Write ``report.md`` and PNG plots from the JSONL files under ``input_dir``.

    Args:
        input_dir: folder searched recursively for ``results.jsonl`` and ``*steps*.jsonl`` (each may be gzipped: ``.gz``).
        output_dir: where to write; ``<input_dir>/report`` by default. Existing files of the
            same names are overwritten; others are left alone.
        plots: draw the plots (False: the tables alone, the report saying so; a committed results folder's report
            stays small, and ``memfit report`` of the folder draws them).

    Returns:
        Path of ``report.md``.

    Raises:
        MissingFileError: when ``input_dir`` is missing or holds no such JSONL file.
        DataError: naming the file and line of a malformed line or a line missing fields.

    Example:
        >>> build_report("benchmarks/results")  # doctest: +SKIP
        PosixPath('benchmarks/results/report/report.md')
    """
    import matplotlib.style

    root = Path(input_dir).resolve()
    if not root.is_dir():
        raise MissingFileError(f"{input_dir} is not a folder; pass the folder that holds the JSONL results")
    out = Path(output_dir) if output_dir is not None else root / "report"
    results, runs, skipped = _load(root)
    out.mkdir(parents=True, exist_ok=True)

    lines = ["# memfit report", ""]
    lines.append(f"{len(results)} bench results and {len(runs)} step-record files under the input folder.")
    if not plots:
        lines += ["", "Tables only (`memfit report --no_plots`): `memfit report` of the folder draws the plots as well."]
    tables: dict[TableKey, list[Result]] = {}
    for r in results:
        tables.setdefault(table_key(r), []).append(r)
    keys = sorted(tables)
    with matplotlib.style.context("default"):
        if keys:
            lines += ["", _LEGEND]
        plot_names = _unique_names(keys, TableKey.slug)
        for key in keys:
            rows = group_rows(tables[key])
            ref = reference_row(rows)
            versions = sorted({f"torch {r.torch}, transformers {r.transformers}" for r in tables[key]})
            lines += ["", f"## {key.title()}", "", f"Software: {'; '.join(versions)}.", ""]
            lines += _methods_table(rows, ref)
            if ref is None:
                lines += ["", "No finished `none` run with no budget: ratios are not available."]
            lines += _savers_table(rows, ref)
            lines += _sweeps_table(rows, ref)
            lines += _paired_table(rows)
            notes = [f"- {row.label}: {r.note}" for row in rows for r in row.results if r.note]
            lines += ["", "Notes:", "", *dict.fromkeys(notes)] if notes else []
            if plots and any(r.budget_bytes is not None for r in rows):
                name = f"time_vs_budget_{plot_names[key]}.png"
                ran = [r for r in rows if any(x.status != "skipped" for x in r.results)]  # skipped: not a failure
                _plot_time_vs_budget(key, ran, ref, out / name)
                lines += ["", f"![Time vs budget, {key.task}]({name})"]

        groups: dict[str, list[_StepRun]] = {}
        for run in runs:
            groups.setdefault(run.group, []).append(run)
        group_names = _unique_names(sorted(groups), lambda g: groups[g][0].stem)
        for group in sorted(groups):
            shown = _one_run_per_label(groups[group])
            lines += ["", f"## Step records: {group}", ""]
            lines += _runs_table(groups[group])
            lines += _mix_table(shown)
            stem = group_names[group]
            if not plots:
                continue
            _plot_peak_vs_tokens(group, shown, out / f"peak_vs_tokens_{stem}.png")
            _plot_memory_count(group, shown, out / f"memory_count_{stem}.png")
            mixed = _plot_treatments(group, _mixed_runs(shown), out / f"treatments_{stem}.png")
            lines += [
                "",
                f"Plots show one run per method and budget (the lowest repeat): {', '.join(f'`{r.path}`' for r in shown)}.",
                "",
                f"![Peak memory vs input size, {group}](peak_vs_tokens_{stem}.png)",
                "",
                f"![memory_count, {group}](memory_count_{stem}.png)",
            ]
            lines += ["", f"![Treatment mix, {group}](treatments_{stem}.png)"] if mixed else []
    if skipped:
        lines += ["", "## Skipped inputs", "", *(f"- {s}" for s in skipped)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_run_per_label(runs: Sequence[_StepRun]) -> list[_StepRun]:
    chosen: dict[str, _StepRun] = {}
    for run in sorted(runs, key=lambda r: (r.repeat, r.path)):
        chosen.setdefault(_label(run), run)
    return sorted(chosen.values(), key=lambda r: (_method_rank(r.method), r.budget_bytes is not None, r.budget_bytes or 0))


def main(argv: list[str] | None = None) -> int:
    """``memfit report <dir> [--output_dir D]``.

    Raises:
        MissingFileError: no bench results or step records under ``<dir>``.
        DataError: a malformed line (the file and line named).
    """
    parser = ArgumentParser(
        prog="memfit report",
        description="Tables (report.md) and PNG plots from bench results (results.jsonl) and step records "
        "(*steps*.jsonl) found under a folder. Reads JSON lines only.",
    )
    parser.add_argument("input_dir", help="folder searched recursively for results.jsonl and *steps*.jsonl (or .gz)")
    parser.add_argument("--output_dir", help="where to write report.md and the plots (default: <input_dir>/report)")
    parser.add_argument("--no_plots", action="store_true", help="write the tables alone (report.md), no plot")
    args = parser.parse_args(argv)
    path = build_report(args.input_dir, args.output_dir, plots=not args.no_plots)
    drawn = f"{len(list(path.parent.glob('*.png')))} plots" if not args.no_plots else "no plot (--no_plots)"
    print(f"wrote {path} and {drawn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
