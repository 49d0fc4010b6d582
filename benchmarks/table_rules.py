"""How a figure table of the README is computed from committed result lines: which lines a row takes,
which statistic a cell shows, how a cell reads, and where the table lives in a markdown file.

``benchmarks/tables.py`` holds the tables themselves as data (:class:`Table`); this module is the
rule every one of them follows, so that a table cannot pick its runs or its statistic by hand.

# NOTE [Every run of the cited calls]
A row names a results folder, the configuration (line fields such as ``task``) and, optionally, the
calls it cites; it takes *every* line of those calls in that configuration (every call of the folder
when it names none), never a chosen day or repeat. A cell is the median over the runs of one method
at one budget of a per-run time (:class:`WholeRuns`: the run's total, warm-up included;
:class:`SteadySteps`: its median step after warm-up), divided by the same median over the uncapped
``none`` runs among those lines: ``memfit report``'s ratio (it reads the lines through
``memfit.tools.report``), so that a folder's ``report/report.md`` shows the README's number where
the row takes every call. Bold goes to the lowest ratio of the row at the row's budget, whichever
method it is.

# NOTE [A line's call and commit]
Lines written since ``memfit.tools.bench.provenance`` carry ``commit`` and ``tree_clean``, and
``call`` when ``run_suite.py`` ran them; older lines carry none of them. Each results folder's ``SOURCE.md`` says which lines each call
wrote and at which commit, in a table under the heading ``## Calls and commits`` (``lines``, ``call``,
``commit``, ``tree``: ``changed`` when the call ran with code changes its commit lacks, ``clean``, or
empty when not recorded); the reader here gives every line its call and, where the line has none,
its commit from that table. A line the table does not cover has no call; a cited line with no commit
is an error (tests/test_tables.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.engine.methods import METHODS
from memfit.tools.report import Result, group_rows, read_results, reference_row, table_key

__all__ = [
    "END_MARKER", "Cell", "Column", "Line", "Row", "RowCells", "SteadySteps", "Statistic", "Table", "WholeRuns",
    "begin_marker", "describe", "read_lines", "render", "replace_blocks", "row_cells",
]

GB = 10**9
END_MARKER = "<!-- end benchmarks/tables.py -->"
_CALLS_HEADING = "## Calls and commits"
_TREE = {"changed": False, "clean": True, "": None}


def begin_marker(name: str) -> str:
    """The line that opens a generated block named ``name`` in a markdown file."""
    return f"<!-- benchmarks/tables.py: {name} -->"


# ---------------------------------------------------------------------------------- what a cell shows


@dataclass(frozen=True)
class Statistic:
    """A per-run time a table's cells compare (NOTE [Every run of the cited calls])."""

    field: str = ""
    """The result line's field holding the run's time."""
    words: str = ""
    """What the table's caption says it shows."""
    short: str = ""
    """The same in a few words."""

    def value(self, row) -> float | None:
        """The median of ``field`` over a ``memfit.tools.report.Row``'s finished runs."""
        return row.median_of(self.field) if row is not None else None


@dataclass(frozen=True)
class WholeRuns(Statistic):
    """Each run's total time, warm-up and first steps at each new size included."""

    field: str = "total_s"
    short: str = "whole runs with warm-up (each run's `total_s`)"
    words: str = "Whole runs, warm-up included: the median of the runs' total times"


@dataclass(frozen=True)
class SteadySteps(Statistic):
    """Each run's median step time after warm-up (``loop_bench.py``'s ``steady_step_ms``)."""

    field: str = "steady_step_ms"
    short: str = "steady steps (each run's `steady_step_ms`)"
    words: str = ("Per steady step, warm-up left out: the median of the runs' steady steps (each run's median step "
                  "from its steady step on, `loop_bench.py`'s `steady_step_ms`)")


# ---------------------------------------------------------------------------------- what a table holds


@dataclass(frozen=True)
class Column:
    """One column of a table: a method (or peer) as the result lines name it."""

    header: str
    """Its header cell."""
    method: str
    """The lines' ``method``."""


@dataclass(frozen=True)
class Row:
    """One row: a configuration of one results folder at one budget (NOTE [Every run of the cited calls])."""

    label: str
    """Its first cell."""
    folder: str
    """Results folder under ``benchmarks/results`` (``nvidia-h200/tasks``)."""
    budget_bytes: int
    """The budget of the row's cells."""
    where: Mapping[str, Any] = field(default_factory=dict)
    """Line fields that pick the configuration (``{"task": "multiple-choice"}``)."""
    calls: tuple[str, ...] | None = None
    """The calls it cites (``SOURCE.md``'s names); None: every call of the folder."""
    other_budgets: Mapping[str, int] = field(default_factory=dict)
    """A method shown at another budget than the row's (its cell says which; never bold)."""


@dataclass(frozen=True)
class Table:
    """A figure table of the README: its statistic, columns and rows."""

    name: str
    """Its marker's name in the markdown files."""
    title: str
    """What the README calls it."""
    statistic: Statistic
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Line:
    """A result line with its call and commit (NOTE [A line's call and commit])."""

    result: Result
    call: str | None
    commit: str | None
    tree_clean: bool | None

    @property
    def place(self) -> str:
        """``device/suite/results.jsonl:N``: where the line is, under ``benchmarks/results``."""
        source = self.result.source
        return f"{source.parent.parent.name}/{source.parent.name}/{source.name}:{self.result.line}"


@dataclass(frozen=True)
class Cell:
    """What one column shows for one row, and the runs it came from."""

    column: Column
    budget_bytes: int
    lines: tuple[Line, ...]
    """Every run of the method at that budget, finished or not."""
    ratio: float | None
    """Its statistic over the reference's; None when no run finished."""

    @property
    def failed(self) -> dict[str, int]:
        """Runs that did not finish, by status (``oom``, ``error``, ...)."""
        out: dict[str, int] = {}
        for line in self.lines:
            if line.result.status != "ok":
                out[line.result.status] = out.get(line.result.status, 0) + 1
        return out


# ---------------------------------------------------------------------------------- reading


def _calls_table(source_md: Path) -> list[tuple[int, int, str, str | None, bool | None]]:
    """``SOURCE.md``'s ``## Calls and commits`` rows: (first line, last line, call, commit, tree_clean)."""
    if not source_md.is_file():
        return []
    text = source_md.read_text(encoding="utf-8")
    if _CALLS_HEADING not in text:
        return []
    out = []
    for line in text.split(_CALLS_HEADING, 1)[1].splitlines():
        if line.startswith("## "):
            break
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 4 or not re.fullmatch(r"\d+(-\d+)?", cells[0]):
            continue
        first, _, last = cells[0].partition("-")
        if cells[3] not in _TREE:
            raise ValueError(f"{source_md}: tree {cells[3]!r} is not one of changed, clean or empty")
        out.append((int(first), int(last or first), cells[1], cells[2] or None, _TREE[cells[3]]))
    return out


def read_lines(folder: Path) -> list[Line]:
    """Every result line of a results folder, with its call and commit (NOTE [A line's call and commit])."""
    calls = _calls_table(folder / "SOURCE.md")
    lines = []
    for r in read_results(folder):
        found = next(((call, commit, clean) for first, last, call, commit, clean in calls if first <= r.line <= last),
                     (None, None, None))
        commit = r.data.get("commit") or found[1]
        clean = r.data["tree_clean"] if "commit" in r.data else found[2]
        lines.append(Line(r, r.data.get("call") or found[0], commit, clean))
    return lines


# ---------------------------------------------------------------------------------- computing


def _selected(row: Row, lines: Sequence[Line]) -> list[Line]:
    chosen = [line for line in lines
              if all(line.result.data.get(k) == v for k, v in row.where.items())
              and (row.calls is None or line.call in row.calls)]
    if not chosen:
        raise ValueError(f"row {row.label!r}: no line of {row.folder} in its configuration and calls (a line's call "
                         "comes from SOURCE.md's Calls and commits)")
    keys = {table_key(line.result) for line in chosen}
    if len(keys) != 1:
        raise ValueError(f"row {row.label!r}: its lines of {row.folder} make {len(keys)} tables of memfit report, "
                         f"not one ({', '.join(k.title() for k in sorted(keys))}); narrow `where` or `calls`")
    return chosen


@dataclass(frozen=True)
class RowCells:
    """A row's cells and the uncapped ``none`` runs they are divided by."""

    row: Row
    cells: tuple[Cell, ...]
    reference: tuple[Line, ...]

    @property
    def lines(self) -> list[Line]:
        """Every run the row's numbers come from."""
        return [*self.reference, *(line for cell in self.cells for line in cell.lines)]


def row_cells(table: Table, row: Row, lines: Sequence[Line]) -> RowCells:
    """The cells of ``row`` from a folder's ``lines`` (NOTE [Every run of the cited calls])."""
    chosen = _selected(row, lines)
    by_result = {id(line.result): line for line in chosen}
    rows = group_rows(line.result for line in chosen)
    reference = reference_row(rows)
    ref = table.statistic.value(reference)
    if not ref:
        raise ValueError(f"row {row.label!r}: no finished uncapped `none` run among its lines of {row.folder}")
    cells = []
    for column in table.columns:
        budget = row.other_budgets.get(column.method, row.budget_bytes)
        found = next((r for r in rows if r.method == column.method and r.budget_bytes == budget), None)
        value = table.statistic.value(found)
        mine = tuple(by_result[id(r)] for r in found.results) if found else ()
        cells.append(Cell(column, budget, mine, None if value is None else value / ref))
    return RowCells(row, tuple(cells), tuple(by_result[id(r)] for r in reference.results))


# ---------------------------------------------------------------------------------- rendering


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / GB:.2f}".rstrip("0").rstrip(".") + " GB"


def _status(status: str) -> str:
    return "OOM" if status == "oom" else status.replace("_", " ")


def _cell_text(cell: Cell, row: Row, bold: bool) -> str:
    failed = cell.failed
    if cell.ratio is None:
        return " / ".join(_status(status) for status in failed)
    text = f"{cell.ratio:.2f}×"
    text = f"**{text}**" if bold else text
    if cell.budget_bytes != row.budget_bytes:
        text += f" ({_gb(cell.budget_bytes)})"
    if failed:
        text += " (" + ", ".join(f"{n} of {len(cell.lines)} {_status(s)}" for s, n in failed.items()) + ")"
    return text


def _commits(lines: Sequence[Line]) -> str:
    clean, changed = [], []
    for line in lines:
        target = changed if line.tree_clean is False else clean
        if line.commit and f"`{line.commit}`" not in clean + changed:
            target.append(f"`{line.commit}`")
    parts = [", ".join(clean)] if clean else []
    parts += [", ".join(changed) + " with uncommitted changes"] if changed else []
    return "; ".join(parts)


def _and(words: Sequence[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)


def _table_row(texts: Sequence[str]) -> str:
    return "|" + "|".join(f" {t} " if t else " " for t in texts) + "|"


def render(table: Table, rows: Sequence[RowCells]) -> str:
    """The markdown of ``table`` (caption and table) from its rows' cells, as the markdown files hold it."""
    used = list({id(line): line for row in rows for line in row.lines}.values())
    calls = {(line.call, line.commit) for line in used}
    ours = [c.method for c in table.columns if c.method in METHODS]
    runs = [line for row in rows for cell in row.cells if cell.column.method in ours for line in cell.lines]
    ooms = sum(line.result.status == "oom" or bool(line.result.oom_count) for line in runs)
    caption = (f"{table.statistic.words} over that of the uncapped `none` runs of the same calls and configuration "
               f"(runs per column: the last one); bold: the fastest of its row. {len(used)} runs of {len(calls)} "
               f"calls, code of {_commits(used)}. {_and([f'`{m}`' for m in ours])}: {ooms} OOM in their {len(runs)} "
               "runs.")
    lines = [caption, "", _table_row(["setting", *(c.header for c in table.columns), "runs"]),
             "| --- |" + " ---: |" * (len(table.columns) + 1)]
    for computed in rows:
        row = computed.row
        at_budget = [c.ratio for c in computed.cells if c.ratio is not None and c.budget_bytes == row.budget_bytes]
        best = min(round(r, 2) for r in at_budget) if at_budget else None
        texts = [_cell_text(c, row, c.ratio is not None and c.budget_bytes == row.budget_bytes
                            and round(c.ratio, 2) == best) for c in computed.cells]
        lines.append(_table_row([row.label, *texts, " / ".join(str(len(c.lines)) for c in computed.cells)]))
    return "\n".join(lines)


def describe(table: Table, row: Row) -> str:
    """One line saying which lines and statistic a row takes (for its folder's ``SOURCE.md``)."""
    where = " and ".join(f"{k} `{v}`" for k, v in row.where.items())
    calls = "every call" if row.calls is None else "the calls named " + " or ".join(f"`{c}`" for c in row.calls)
    budgets: dict[int, list[str]] = {}
    for c in table.columns:
        budgets.setdefault(row.other_budgets.get(c.method, row.budget_bytes), []).append(f"`{c.method}`")
    methods = "; ".join(f"{', '.join(names)} at {_gb(b)}" for b, names in budgets.items())
    return (f"- {table.title}, \"{row.label}\": the lines of {calls}" + (f" with {where}" if where else "")
            + f"; {methods}; {table.statistic.short}.")


# ---------------------------------------------------------------------------------- markdown files


def replace_blocks(text: str, blocks: Mapping[str, str]) -> tuple[str, list[str]]:
    """``text`` with each generated block named in ``blocks`` replaced; returns it and the names whose
    block changed. A block runs from its :func:`begin_marker` line to the next :data:`END_MARKER` line."""
    changed = []
    for name, body in blocks.items():
        begin = begin_marker(name)
        if begin not in text:
            continue
        head, rest = text.split(begin, 1)
        old, sep, tail = rest.partition(END_MARKER)
        if not sep:
            raise ValueError(f"{begin} has no {END_MARKER} after it")
        new = f"\n{body}\n"
        if old != new:
            changed.append(name)
        text = head + begin + new + END_MARKER + tail
    return text, changed
