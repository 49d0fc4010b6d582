"""The README's figure tables, computed from the committed result lines (and written back).

Each table below is data: the results folder of each row, the configuration and calls it cites, the
methods of its columns, the budget, and the statistic (whole runs or steady steps). The rule they all
follow (every run of the cited calls, ``memfit report``'s ratio, bold to the fastest) is
``table_rules.py``'s. The same blocks stand in ``README.md`` and ``docs/benchmarks.md``, and each cited
folder's ``SOURCE.md`` holds a generated paragraph saying how its lines make the README's rows.

Usage (repository root):
    python benchmarks/tables.py            # print every table
    python benchmarks/tables.py --write    # rewrite the generated blocks (README.md, docs/benchmarks.md, SOURCE.md)
    python benchmarks/tables.py --check    # exit 1 naming the blocks that differ from the lines (tests/test_tables.py)
    python benchmarks/tables.py --runs     # each cell's runs: where the line is, its call, commit and time
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from table_rules import (  # noqa: E402
    GB, Column, Line, Row, RowCells, SteadySteps, Table, WholeRuns, describe, read_lines, render, replace_blocks,
    row_cells,
)

FULL, STATIC, DYNAMIC = Column("`full`", "full"), Column("`static`", "static"), Column("`dynamic`", "dynamic")
ENGINE, TASKS, DETECTION = "nvidia-h200/engine", "nvidia-h200/tasks", "nvidia-h200/detection"
SWIN_T = {"model": "conditional-detr-swin-tiny (config, random weights)"}
SWIN_B = {"model": "conditional-detr-swin-base (config, random weights)"}

TABLES = (
    Table(
        "encoders", "Encoders", WholeRuns(), (FULL, STATIC, DYNAMIC, Column("oracle", "oracle")),
        (
            Row("batch 32, lengths 32..512, 4 GB", ENGINE, 4 * GB, {"task": "uniform-32-512"}),
            Row("same, 6 GB", ENGINE, 6 * GB, {"task": "uniform-32-512"}),
            Row("same, 8 GB", ENGINE, 8 * GB, {"task": "uniform-32-512"}),
            Row("multiple choice, batch 16, 3 GB", TASKS, 3 * GB, {"task": "multiple-choice"}),
            Row("text classification, batch 32, 3 GB", TASKS, 3 * GB, {"task": "text-classification"}),
            Row("question answering, batch 12, 4 GB", TASKS, 4 * GB, {"task": "question-answering"}),
            Row("token classification, batch 64, 6 GB", TASKS, 6 * GB, {"task": "token-classification"},
                other_budgets={"full": 5 * GB}),  # `full` ran at 5 GB only: its plan does not depend on the budget
        ),
    ),
    Table(
        "detection", "Object detection", WholeRuns(), (FULL, STATIC, DYNAMIC),
        (
            Row("Swin-T DETR, 17.78 GB", DETECTION, 17_780_000_000, SWIN_T),
            Row("same, 24.92 GB", DETECTION, 24_920_000_000, SWIN_T),
            Row("Swin-B DETR, 35.49 GB", DETECTION, 35_490_000_000, SWIN_B),
            Row("same, 49.70 GB", DETECTION, 49_700_000_000, SWIN_B),
        ),
    ),
    Table(
        "llm", "Decoder LLM fine-tuning", SteadySteps(),
        (FULL, STATIC, DYNAMIC, Column("HF checkpointing", "hf-every-1"), Column("HF + offload", "hf-offload"),
         Column("TRL offload", "trl-offload")),
        (
            Row("full FT, SFT lengths up to 2,048, batch 8, cap 0.5", "nvidia-h100/llm", 18_181_060_608, calls=("ft",)),
            Row("same, cap 0.7", "nvidia-h100/llm", 25_453_484_851, calls=("ft",)),
            Row("LoRA r 16 on every linear layer, cap 0.5", "nvidia-h100/llm", 22_834_735_616, calls=("lora",)),
            Row("batch 1, 8k and 16k tokens, cap 0.5 (H200)", "nvidia-h200/llm", 16_771_371_008, calls=("long",)),
        ),
    ),
)

#: The markdown files holding every table's block.
DOCS = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
#: The name of the generated paragraph in each cited folder's SOURCE.md.
SOURCE_BLOCK = "source"


def _folders() -> list[str]:
    return sorted({row.folder for table in TABLES for row in table.rows})


def compute(lines_of: dict[str, list[Line]] | None = None) -> dict[str, list[RowCells]]:
    """Every table's cells, by table name, from the committed lines."""
    lines_of = lines_of if lines_of is not None else {f: read_lines(RESULTS / f) for f in _folders()}
    return {t.name: [row_cells(t, row, lines_of[row.folder]) for row in t.rows] for t in TABLES}


def _source_paragraph(folder: str) -> str:
    mine = [(t, row) for t in TABLES for row in t.rows if row.folder == folder]
    same = all(isinstance(t.statistic, WholeRuns) and row.calls is None for t, row in mine)
    return "\n".join([
        "`python benchmarks/tables.py` computes the README's figure tables (and their copies in `docs/benchmarks.md`)",
        "from the lines of `results.jsonl`: for each row, every line of the calls it cites in its configuration; for",
        "each column, the median over those runs of the method's time divided by the same median over the uncapped",
        "`none` runs among them (NOTE [Every run of the cited calls], `benchmarks/table_rules.py`); each line's",
        "call and commit from the table under *Calls and commits*"
        + (". These rows take every call, so `report/report.md`'s `vs none` column shows the same ratios." if same
           else "."),
        "The rows drawn from this folder:",
        "",
        *(describe(t, row) for t, row in mine),
    ])


def blocks(cells: dict[str, list[RowCells]]) -> dict[Path, dict[str, str]]:
    """The text of every generated block, by file and block name."""
    tables = {t.name: render(t, cells[t.name]) for t in TABLES}
    out: dict[Path, dict[str, str]] = {path: tables for path in DOCS}
    for folder in _folders():
        out[RESULTS / folder / "SOURCE.md"] = {SOURCE_BLOCK: _source_paragraph(folder)}
    return out


def _runs(cells: dict[str, list[RowCells]]) -> str:
    def listed(line: Line, field: str) -> str:
        changes = " (uncommitted changes)" if line.tree_clean is False else ""
        return (f"    {line.place}  call {line.call}  commit {line.commit}{changes}  {line.result.status}"
                f"  {field} {line.result.data.get(field)}")

    out = []
    for table in TABLES:
        field = table.statistic.field
        for computed in cells[table.name]:
            out.append(f"{table.title} | {computed.row.label} | uncapped none (the reference)")
            out += [listed(line, field) for line in computed.reference]
            for cell in computed.cells:
                ratio = "" if cell.ratio is None else f" = {cell.ratio:.3f}×"
                out.append(f"{table.title} | {computed.row.label} | {cell.column.method}{ratio}")
                out += [listed(line, field) for line in cell.lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the generated blocks in the markdown files")
    action.add_argument("--check", action="store_true", help="exit 1 if a generated block differs from the lines")
    action.add_argument("--runs", action="store_true", help="print each cell's runs")
    args = parser.parse_args(argv)
    cells = compute()
    if args.runs:
        print(_runs(cells))
        return 0
    if not (args.write or args.check):
        print("\n\n".join(render(t, cells[t.name]) for t in TABLES))
        return 0
    stale = []
    for path, named in blocks(cells).items():
        text = path.read_text(encoding="utf-8")
        new, changed = replace_blocks(text, named)
        stale += [f"{path.relative_to(ROOT)}: {name}" for name in changed]
        if args.write and new != text:
            path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("generated blocks that differ from the result lines (python benchmarks/tables.py --write):\n  "
              + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
