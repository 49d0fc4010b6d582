"""benchmarks/tables.py: the README's figure tables are what the committed result lines give, over
every run of the calls each row cites, and every line they use names its call and commit.

Reads committed files only (the results folders, README.md, docs/benchmarks.md, SOURCE.md files);
a table edited by hand, or a line added to a cited folder without rewriting the tables, fails here:
``python benchmarks/tables.py --write`` brings the files back in step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from memfit.engine.summary_text import size_in_given_unit
from memfit.tools.report import read_results, table_key

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)
rules = sys.modules["table_rules"]


@pytest.fixture(scope="module")
def lines_of() -> dict:
    return {folder: rules.read_lines(tables.RESULTS / folder) for folder in tables._folders()}


@pytest.fixture(scope="module")
def cells(lines_of) -> dict:
    return tables.compute(lines_of)


def test_the_markdown_files_hold_the_tables_the_lines_give(cells):
    for path, named in tables.blocks(cells).items():
        text = path.read_text(encoding="utf-8")
        for name, body in named.items():
            begin = rules.begin_marker(name)
            assert text.count(begin) == 1, f"{path.relative_to(ROOT)} lacks its block {name!r}"
            held = text.split(begin, 1)[1].split(rules.END_MARKER, 1)[0].strip("\n")
            assert held == body, f"{path.relative_to(ROOT)}: block {name!r} drifted (python benchmarks/tables.py --write)"


def test_every_line_of_a_cited_folder_has_one_call_and_a_commit(lines_of):
    for folder, lines in lines_of.items():
        calls = rules._calls_table(tables.RESULTS / folder / "SOURCE.md")
        covered = [n for first, last, *_ in calls for n in range(first, last + 1)]
        assert sorted(covered) == sorted(set(covered)), f"{folder}: calls overlap in SOURCE.md"
        assert [line for line in lines if line.call is None or line.commit is None] == [], folder
        assert len(covered) == len(lines), f"{folder}: SOURCE.md's calls cover {len(covered)} of {len(lines)} lines"


def test_rows_that_take_every_call_are_the_folders_report(cells):
    # one reader: where a row takes every call, memfit report's `vs none` column shows its ratios
    for table in tables.TABLES:
        if not isinstance(table.statistic, rules.WholeRuns):
            continue
        for computed in cells[table.name]:
            if computed.row.calls is not None:
                continue
            report = (tables.RESULTS / computed.row.folder / "report" / "report.md").read_text(encoding="utf-8")
            section = report.split(f"## {table_key(computed.reference[0].result).title()}\n", 1)[1].split("\n## ", 1)[0]
            for cell in computed.cells:
                if cell.ratio is None:
                    continue
                row = next(line for line in section.splitlines()
                           if line.startswith(f"| {cell.column.method} | {size_in_given_unit(cell.budget_bytes)} |"))
                assert row.split(" | ")[3] == f"{cell.ratio:.2f}×", (computed.row.label, cell.column.method)


def _write(folder: Path, lines: list[dict], calls: str) -> None:
    folder.mkdir(parents=True)
    common = {"task": "t", "model": "m", "batch_size": 4, "steps": 10, "max_peak_allocated_bytes": 1,
              "recomputed_fraction": 0.0, "device": "d", "torch": "2", "transformers": "5"}
    (folder / "results.jsonl").write_text("".join(json.dumps({**common, "oom_count": 0, "status": "ok", **line}) + "\n"
                                                  for line in lines))
    (folder / "SOURCE.md").write_text(f"# s\n\n## Calls and commits\n\n| lines | call | commit | tree |\n"
                                      f"| --- | --- | --- | --- |\n{calls}")


def test_a_row_takes_every_run_of_its_calls_and_bold_goes_to_the_fastest(tmp_path):
    gb = rules.GB
    _write(tmp_path / "d" / "s", [
        {"method": "none", "budget_bytes": None, "total_s": 10.0},
        {"method": "dynamic", "budget_bytes": 2 * gb, "total_s": 12.0},
        {"method": "static", "budget_bytes": 2 * gb, "total_s": 13.0},
        {"method": "full", "budget_bytes": 2 * gb, "total_s": None, "status": "oom", "oom_count": 1},
        {"method": "none", "budget_bytes": None, "total_s": 12.0, "commit": "fffffff", "tree_clean": True},
        {"method": "dynamic", "budget_bytes": 2 * gb, "total_s": 15.0, "commit": "fffffff", "tree_clean": True},
        {"method": "static", "budget_bytes": 2 * gb, "total_s": 11.0, "commit": "fffffff", "tree_clean": True},
        {"method": "full", "budget_bytes": 1 * gb, "total_s": 14.0, "commit": "fffffff", "tree_clean": True},
    ], "| 1-4 | `a` | `aaaaaaa` | changed |\n| 5-8 | `b` | `bbbbbbb` |  |\n")
    lines = rules.read_lines(tmp_path / "d" / "s")
    assert [(line.call, line.commit, line.tree_clean) for line in lines][3:5] == [
        ("a", "aaaaaaa", False), ("b", "fffffff", True)]  # a line's own commit first, else SOURCE.md's
    columns = (rules.Column("`full`", "full"), rules.Column("`static`", "static"), rules.Column("`dynamic`", "dynamic"))
    every = rules.Row("every call", "d/s", 2 * gb)
    one = rules.Row("call a", "d/s", 2 * gb, calls=("a",), other_budgets={"full": 1 * gb})
    table = rules.Table("t", "T", rules.WholeRuns(), columns, (every, one))
    computed = [rules.row_cells(table, row, lines) for row in table.rows]
    assert [c.ratio for c in computed[0].cells] == [None, 12.0 / 11.0, 13.5 / 11.0]  # medians over both calls
    text = rules.render(table, computed)
    assert "| every call | OOM | **1.09×** | 1.23× | 1 / 2 / 2 |" in text  # `static` leads: bold is its
    assert "| call a | | 1.30× | **1.20×** | 0 / 1 / 1 |" in text  # call a alone; `full` ran at 1 GB in call b only
    assert "code of `bbbbbbb`" not in text and "`fffffff`; `aaaaaaa` with uncommitted changes" in text
    assert "`full`, `static` and `dynamic`: 1 OOM in their 7 runs." in text
    with pytest.raises(ValueError, match="no line of d/s"):
        rules.row_cells(table, rules.Row("none", "d/s", 2 * gb, calls=("c",)), lines)


def test_blocks_are_replaced_between_their_markers_only():
    text = f"a {rules.begin_marker('x')}\nold\n{rules.END_MARKER}\nb\n"
    new, changed = rules.replace_blocks(text, {"x": "new", "y": "other"})
    assert (new, changed) == (f"a {rules.begin_marker('x')}\nnew\n{rules.END_MARKER}\nb\n", ["x"])
    assert rules.replace_blocks(new, {"x": "new"}) == (new, [])
