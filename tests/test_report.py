"""Tests of memfit report on the fixture JSONL in tests/fixtures/report: table values computed
from the fixture, plots, byte-identical reruns, and clear errors for bad inputs."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from memfit.engine.summary_text import given_unit

from memfit import cli
from memfit.errors import DataError
from memfit.tools.report import build_report

FIXTURE = Path(__file__).parent / "fixtures" / "report"
GIB = 2**30


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return build_report(FIXTURE, tmp_path_factory.mktemp("report"))


def fixture_results() -> list[dict]:
    lines = (FIXTURE / "bench" / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def table_rows(markdown: str, heading: str, first_column: str = "method") -> list[dict[str, str]]:
    """The rows of the first table after ``heading`` whose header starts with ``first_column``."""
    lines = markdown.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def budget_cell(budget_bytes: int | None) -> str:
    """A budget as the report shows it: in the unit it was typed in (the fixture's are GiB)."""
    return "—" if budget_bytes is None else f"{budget_bytes // GIB} GiB"


def expected_configs(task: str) -> dict[tuple[str, int | None], list[dict]]:
    configs: dict[tuple[str, int | None], list[dict]] = {}
    for r in fixture_results():
        if r["task"] == task:
            configs.setdefault((r["method"], r["budget_bytes"]), []).append(r)
    return configs


def median_ok_time(results: list[dict]) -> float | None:
    times = [r["total_s"] for r in results if r["status"] == "ok"]
    return statistics.median(times) if times else None


def test_methods_table_matches_fixture(report):
    markdown = report.read_text()
    rows = table_rows(markdown, "## multiple-choice")
    configs = expected_configs("multiple-choice")
    assert len(rows) == len(configs)
    reference = median_ok_time(configs[("none", None)])
    for (method, budget), results in configs.items():
        row = next(r for r in rows if r["method"] == method and r["budget"] == budget_cell(budget))
        median = median_ok_time(results)
        peak = max(r["max_peak_allocated_bytes"] for r in results)
        assert row["median time (s)"] == ("—" if median is None else f"{median:.2f}")
        assert row["vs none"] == ("—" if median is None else f"{median / reference:.2f}×")
        assert row["max peak (GiB)"] == f"{peak / GIB:.2f}"
        assert row["peak / budget"] == ("—" if budget is None else f"{100 * peak / budget:.0f}%")
        assert row["OOMs"] == str(max(r["oom_count"] for r in results))
        assert row["repeats"] == str(len(results))


def test_failed_configurations_are_shown(report):
    rows = table_rows(report.read_text(), "## multiple-choice")
    by_key = {(r["method"], r["budget"]): r for r in rows}
    assert by_key[("none", "6 GiB")]["status"] == "oom 1/1"
    assert by_key[("none", "6 GiB")]["median time (s)"] == "—"
    assert by_key[("dynamic", "4 GiB")]["status"] == "ok 1/2, oom 1/2"
    assert by_key[("dynamic", "6 GiB")]["status"] == "ok"


def test_rows_in_method_order(report):
    methods = [r["method"] for r in table_rows(report.read_text(), "## multiple-choice")]
    assert methods == ["none", "none", "full", "dynamic", "dynamic", "static", "hf-every-2"]


def test_savers_table_relative_to_vanilla(report):
    rows = table_rows(report.read_text(), "Memory savers")
    configs = expected_configs("text-classification")
    vanilla = configs[("none", None)][0]
    for row in rows:
        r = configs[(row["method"], None)][0]
        assert row["time vs vanilla"] == f"{r['total_s'] / vanilla['total_s']:.2f}×"
        assert row["peak vs vanilla"] == f"{r['max_peak_allocated_bytes'] / vanilla['max_peak_allocated_bytes']:.2f}×"
        assert row["Δ vs vanilla"] == f"{r['eval_value'] - vanilla['eval_value']:+.4f}"
    assert {r["method"] for r in rows} == {"none", "bf16", "adafactor"}


def test_step_records_table(report):
    rows = table_rows(report.read_text(), "## Step records: train_run", first_column="step file")
    records = [json.loads(line) for line in (FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["micro-steps"] == str(len(records))  # a record per micro-step
    steady = [r for r in records if r["phase"] != "warmup"]
    treated = sum((r["n_checkpointed"] + len(r["evicted_blocks"])) / r["n_blocks"] for r in steady) / len(steady)
    assert rows[0]["treated (steady)"] == f"{100 * treated:.1f}%"  # warm-up's blocks left out
    # one unit per table: the budget's (NOTE [One unit per table])
    unit_name, unit = given_unit(records[0]["budget_bytes"])
    assert rows[0][f"max peak ({unit_name})"] == f"{max(r['peak_allocated_bytes'] for r in records) / unit:.2f}"
    assert rows[0]["budget"] == f"{records[0]['budget_bytes'] // unit} {unit_name}"


@pytest.mark.parametrize("budget, unit", [(300 * 10**6, "MB"), (6 * 2**30, "GiB"), (8 * 10**9, "GB"), (None, "GiB")])
def test_one_unit_per_table_is_the_budgets(budget, unit):
    from memfit.tools.report import _unit

    assert _unit([budget])[0] == unit and _unit([8 * 10**9, budget])[0] == ("GB" if budget is None or budget > 8e9 else unit)


def test_steps_per_size_are_bucketed():
    from memfit.tools.report import size_buckets

    sizes = list(range(100, 1700, 100))  # 16 sizes, each seen once: one bar per size would be flat
    edges = size_buckets(sizes)
    assert len(edges) - 1 == 4 and edges[0] == 100 and edges[-1] == 1600
    counts = [sum(a <= s < b or (b == edges[-1] and s == b) for s in sizes) for a, b in zip(edges, edges[1:])]
    assert sum(counts) == 16 and max(counts) > 1


def test_plots_are_written(report):
    markdown = report.read_text()
    names = sorted(p.name for p in report.parent.glob("*.png"))
    assert names == [
        "memory_count_multiple-choice-bert-base-uncased.png",
        "memory_count_train-run.png",
        "peak_vs_tokens_multiple-choice-bert-base-uncased.png",
        "peak_vs_tokens_train-run.png",
        "time_vs_budget_multiple-choice-bert-base-uncased.png",
        "treatments_multiple-choice-bert-base-uncased.png",
        "treatments_train-run.png",
    ]
    for name in names:
        assert f"]({name})" in markdown
        data = (report.parent / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000  # 64 colours: a one-panel plot is about 8 kB


def test_output_is_byte_identical(tmp_path):
    # two copies in different places: no absolute path or run-dependent byte leaks out
    outputs = []
    for name in ("a", "b"):
        shutil.copytree(FIXTURE, tmp_path / name / "results")
        outputs.append(build_report(tmp_path / name / "results", tmp_path / name / "out").parent)
    files = sorted(p.name for p in outputs[0].iterdir())
    assert files == sorted(p.name for p in outputs[1].iterdir())
    for name in files:
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name


def _copy_with_results(tmp_path: Path, extra_line: str) -> tuple[Path, int]:
    """The fixture with a blank line and then ``extra_line`` appended; returns its line number."""
    shutil.copytree(FIXTURE, tmp_path / "results")
    path = tmp_path / "results" / "bench" / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, "", extra_line]) + "\n")
    return tmp_path / "results", len(lines) + 2


def test_malformed_line_names_file_and_line(tmp_path):
    folder, line = _copy_with_results(tmp_path, '{"task": "multiple-choice", ')
    with pytest.raises(ValueError, match=rf"bench/results\.jsonl:{line}: not valid JSON"):
        build_report(folder, tmp_path / "out")


def test_missing_field_names_file_and_field(tmp_path):
    result = fixture_results()[0]
    del result["status"]
    folder, line = _copy_with_results(tmp_path, json.dumps(result))
    with pytest.raises(ValueError, match=rf"bench/results\.jsonl:{line}: missing field\(s\) status"):
        build_report(folder, tmp_path / "out")


def test_folder_without_jsonl(tmp_path):
    (tmp_path / "notes.txt").write_text("printed text is never read\n")
    with pytest.raises(FileNotFoundError, match="no bench results .*results.jsonl.* or step records"):
        build_report(tmp_path, tmp_path / "out")


def test_step_records_alone(tmp_path):
    shutil.copytree(FIXTURE / "train_run", tmp_path / "run")
    markdown = build_report(tmp_path / "run", tmp_path / "out").read_text()
    assert "## Step records: run" in markdown
    assert "| method | budget | median time (s)" not in markdown


def test_step_records_table_gives_the_all_gather_wait_where_a_run_read_it(tmp_path):
    """NOTE [The collective wait]: a run whose records read the wait on FSDP2's all-gathers (two ranks' files) gets
    its steady steps' share in a column of its own; a table of runs that read none has no such column."""
    records = [json.loads(line) for line in (FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()]
    for rank, wait_ms in ((0, 3.0), (1, None)):
        lines = [json.dumps({**r, "collective_wait_ms": None if wait_ms is None or r["phase"] == "warmup" else wait_ms})
                 for r in records]
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / f"memfit_steps.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    rows = table_rows(build_report(tmp_path / "run", tmp_path / "out").read_text(), "## Step records: run", first_column="step file")
    steady = [r for r in records if r["phase"] != "warmup"]
    share = 3.0 * len(steady) / sum(r["step_ms"] for r in steady)
    assert {row["step file"]: row["all-gather wait (steady)"] for row in rows} == {
        "`memfit_steps.rank0.jsonl`": f"{100 * share:.1f}%", "`memfit_steps.rank1.jsonl`": "—"}
    markdown = build_report(FIXTURE / "train_run", tmp_path / "plain").read_text()
    assert "all-gather wait" not in markdown


def test_a_tables_only_report_writes_no_plot_and_says_so(tmp_path, capsys):
    """``--no_plots``: the same tables, no PNG and no image link, and a line saying how to draw them."""
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "stale.png").write_bytes(b"")  # an earlier report's plot: not counted as drawn
    assert cli.main(["report", str(FIXTURE), "--output_dir", str(tmp_path / "tables"), "--no_plots"]) == 0
    assert "and no plot (--no_plots)" in capsys.readouterr().out
    (tmp_path / "tables" / "stale.png").unlink()
    tables = (tmp_path / "tables" / "report.md").read_text()
    full = build_report(FIXTURE, tmp_path / "full").read_text()
    assert not list((tmp_path / "tables").glob("*.png")) and list((tmp_path / "full").glob("*.png"))
    assert "![" not in tables and "Tables only (`memfit report --no_plots`)" in tables
    assert [line for line in full.splitlines() if line.startswith("|")] == [
        line for line in tables.splitlines() if line.startswith("|")]  # every table as the full report has it


def test_cli(tmp_path, capsys):
    assert cli.main(["report", str(FIXTURE), "--output_dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").is_file()
    assert cli.main(["report", str(tmp_path / "out")]) == 2
    assert "no bench results" in capsys.readouterr().err


def test_gzipped_step_records_read_as_plain(tmp_path):
    """Long runs' step records may be committed gzip-compressed (the CPU soak's are)."""
    import gzip

    from memfit.engine.records import read_jsonl

    plain = FIXTURE / "train_run" / "memfit_steps.jsonl"
    packed = tmp_path / "memfit_steps.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(read_jsonl(packed)) == list(read_jsonl(plain))
    assert len(list(read_jsonl(packed))) > 1


def test_savers_table_shows_median_step_times(tmp_path):
    """With step records linked, the savers table gives each run's median step and its ratio."""
    shutil.copytree(FIXTURE, tmp_path / "results")
    bench = tmp_path / "results" / "bench"
    template = json.loads((FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()[0])
    # micro-steps of a 50-step run; bf16's accumulates two per optimizer step (100 records)
    step_ms = {"none": [500.0] + [20.0] * 24 + [22.0] * 25, "bf16": [3000.0] + [30.0] * 49 + [34.0] * 50}
    lines = []
    for line in (bench / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["task"] == "text-classification" and r["method"] in step_ms:
            name = f"steps/tc_{r['method']}_steps.jsonl"
            records = [{**template, "step": i + 1, "step_ms": ms, "method": r["method"]} for i, ms in enumerate(step_ms[r["method"]])]
            (bench / name).write_text("".join(json.dumps(x) + "\n" for x in records))
            r["steps_file"] = name
        lines.append(json.dumps(r))
    (bench / "results.jsonl").write_text("\n".join(lines) + "\n")
    rows = {r["method"]: r for r in table_rows(build_report(tmp_path / "results", tmp_path / "out").read_text(), "Memory savers")}
    assert rows["none"]["median step (ms)"] == "22.0" and rows["bf16"]["median step (ms)"] == "68.0"
    assert rows["bf16"]["step vs vanilla"] == f"{68.0 / 22.0:.2f}×"
    assert rows["adafactor"]["median step (ms)"] == "—"  # no step records linked
    # a steps_file compressed after the run (name.jsonl -> name.jsonl.gz) still links
    import gzip

    packed = bench / "steps" / "tc_bf16_steps.jsonl"
    packed.with_name(packed.name + ".gz").write_bytes(gzip.compress(packed.read_bytes()))
    packed.unlink()
    again = {r["method"]: r for r in table_rows(build_report(tmp_path / "results", tmp_path / "out2").read_text(), "Memory savers")}
    assert again["bf16"]["median step (ms)"] == "68.0"
    # the methods table shows the same medians, relative to none
    methods = {r["method"]: r for r in table_rows(build_report(tmp_path / "results", tmp_path / "out").read_text(), "## text-classification")}
    assert methods["none"]["median step (ms)"] == "22.0" and methods["none"]["step vs none"] == "1.00×"
    assert methods["bf16"]["step vs none"] == f"{68.0 / 22.0:.2f}×"


def test_corrupt_gzip_names_the_file(tmp_path):
    from memfit.engine.records import read_jsonl

    bad = tmp_path / "memfit_steps.jsonl.gz"
    bad.write_bytes(b"not gzip at all\n")
    with pytest.raises(ValueError, match=r"memfit_steps\.jsonl\.gz: not a readable gzip file"):
        list(read_jsonl(bad))


def test_peer_sweep_names_the_fastest_setting_within_budget(tmp_path):
    base = {"task": "token-classification", "model": "m", "batch_size": 8, "steps": 10, "device": "cpu",
            "torch": "t", "transformers": "t", "recomputed_fraction": 0.0}

    def line(method, budget, status, total_s=None, peak=None):
        return {**base, "method": method, "budget_bytes": budget, "status": status, "total_s": total_s,
                "max_peak_allocated_bytes": peak, "oom_count": int(status == "oom")}

    budget = 4 * GIB
    lines = [
        line("none", None, "ok", 10.0, 5 * GIB),
        line("compile-1", budget, "ok", 11.0, 5 * GIB),  # fastest, but over the budget
        line("compile-0.5", budget, "ok", 12.0, 3 * GIB),
        line("compile-0.25", budget, "ok", 14.0, 2 * GIB),
        line("compile-0.1", budget, "oom"),
        line("ckptplan-0.5", budget, "skipped"),
        line("ckptplan-1", budget, "skipped"),
        line("hf-every-2", budget, "ok", 13.0, 3 * GIB),  # one setting: no sweep
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    markdown = build_report(tmp_path / "in", tmp_path / "out").read_text()
    rows = table_rows(markdown, "Peer sweeps", first_column="peer")
    assert rows == [
        {"peer": "ckptplan", "budget": "4 GiB", "fastest within budget": "—", "median time (s)": "—",
         "vs none": "—", "max peak (GiB)": "—", "settings within budget": "0 of 2"},
        {"peer": "compile", "budget": "4 GiB", "fastest within budget": "compile-0.5", "median time (s)": "12.00",
         "vs none": "1.20×", "max peak (GiB)": "3.00", "settings within budget": "2 of 4: 0.25, 0.5"},
    ]
    skipped = next(r for r in table_rows(markdown, "## token-classification") if r["method"] == "ckptplan-0.5")
    assert skipped["status"] == "skipped 1/1"


def test_a_trial_stopped_past_its_replays_is_reported_and_an_unknown_status_refused(tmp_path):
    """The reach suite's ``replays`` status (a trial stopped once it replayed more OOMs than its rule allows) is a
    status of its own in the method table; a status the report does not know is one clear error."""
    base = {"task": "causal-lm", "model": "m", "batch_size": 8, "steps": 30, "device": "cpu", "torch": "t",
            "transformers": "t", "recomputed_fraction": None, "max_peak_allocated_bytes": None, "total_s": None}
    lines = [{**base, "method": "none", "budget_bytes": None, "status": "ok", "total_s": 10.0, "oom_count": 0},
             {**base, "method": "dynamic", "budget_bytes": 4 * GIB, "status": "replays", "oom_count": 1}]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    markdown = build_report(tmp_path / "in", tmp_path / "out").read_text()
    row = next(r for r in table_rows(markdown, "## causal-lm") if r["method"] == "dynamic")
    assert row["status"] == "replays 1/1", row
    (tmp_path / "in" / "results.jsonl").write_text(json.dumps({**lines[1], "status": "stalled"}) + "\n")
    with pytest.raises(DataError, match="status 'stalled' is not one of"):
        build_report(tmp_path / "in", tmp_path / "out2")


def test_paired_runs_table_lists_each_repeat_and_the_median(tmp_path):
    base = {"task": "causal-lm", "model": "m", "batch_size": 8, "steps": 10, "device": "cpu", "torch": "t",
            "transformers": "t", "recomputed_fraction": None, "budget_bytes": None, "status": "ok",
            "max_peak_allocated_bytes": None, "oom_count": 0}
    lines = [{**base, "method": "none", "total_s": 10.0}]
    for repeat, (step, total) in enumerate([(1.0046, 1.003), (1.0064, 1.0091), (1.0016, 1.0026)]):
        lines.append({**base, "method": "alt-plain", "total_s": 10.0, "repeat": repeat})
        lines.append({**base, "method": "alt-none", "total_s": 10.0, "repeat": repeat, "paired_with": "alt-plain",
                      "paired_step_ratio": step, "paired_sum_ratio": total})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    markdown = build_report(tmp_path / "in", tmp_path / "out").read_text()
    rows = table_rows(markdown, "Paired runs")
    assert [(r["against"], r["repeat"], r["median per-step ratio"], r["summed ratio"]) for r in rows] == [
        ("alt-plain", "0", "1.0046", "1.0030"), ("alt-plain", "1", "1.0064", "1.0091"),
        ("alt-plain", "2", "1.0016", "1.0026"), ("alt-plain, median of 3", "", "1.0046", ""),
    ]
    assert {r["method"] for r in rows} == {"alt-none"}


def test_treatment_mix_per_input_size(tmp_path):
    """Per input-size range, the mean blocks each treatment got in a run's steady steps,
    counted from the records' ``treatments``; a run with one mix at every size gets one row."""
    base = json.loads((FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()[0])
    run = tmp_path / "run"
    run.mkdir()
    mixes = {  # tokens -> treatments of a 4-block model
        100: {}, 110: {},
        480: {"selective": [2, 3]}, 490: {"selective": [1, 2, 3]},
        900: {"recompute": [0], "offload": [1], "selective": [2, 3]},
    }
    lines = [json.dumps({**base, "step": 1, "tokens": 900, "phase": "warmup", "n_blocks": 4, "plan": [0, 1, 2, 3],
                         "n_checkpointed": 4, "treatments": {"recompute": [0, 1, 2, 3]}})]
    for i, (tokens, kinds) in enumerate(mixes.items(), 2):
        plan = sorted(b for blocks in kinds.values() for b in blocks)
        lines.append(json.dumps({**base, "step": i, "tokens": tokens, "phase": "steady", "n_blocks": 4, "plan": plan,
                                 "n_checkpointed": len(plan), "treatments": kinds}))
    (run / "memfit_steps.jsonl").write_text("\n".join(lines) + "\n")
    markdown = build_report(run, tmp_path / "out").read_text()
    rows = table_rows(markdown, "Treatment mix per input size", first_column="run")
    by_size = {row["tokens"]: row for row in rows}
    # 6 ranges of 134 tokens from 100 to 900; the warm-up step is left out
    assert list(by_size) == ["100-233", "368-501", "770-903"]
    assert [by_size["100-233"][k] for k in ("micro-steps", "recompute", "selective", "offload", "kept")] == ["2", "0.0", "0.0", "0.0", "4.0"]
    assert [by_size["368-501"][k] for k in ("micro-steps", "selective", "kept")] == ["2", "2.5", "1.5"]
    assert [by_size["770-903"][k] for k in ("recompute", "selective", "offload", "kept")] == ["1.0", "2.0", "1.0", "0.0"]


def test_each_of_twenty_methods_gets_its_own_colour():
    from matplotlib.colors import to_hex

    from memfit.tools.report import _color

    methods = [f"m{i}" for i in range(20)]
    assert len({to_hex(_color(m, methods)) for m in methods}) == 20


def test_treatment_mix_shows_the_lm_heads_treatment_per_input_size(tmp_path):
    """A run that planned the LM head: each input-size range says how many steps kept the head and
    how many chunked it in how many chunks, beside the blocks' mix, and the treatment plot is drawn."""
    base = json.loads((FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()[0])
    run = tmp_path / "run"
    (run / "head").mkdir(parents=True)
    steps = [  # tokens, blocks' treatments, the head's label
        (100, {}, "keep"), (120, {}, "keep"),
        (480, {"recompute": [0]}, "chunked:4"), (500, {"recompute": [0]}, "keep"),
        (900, {"recompute": [0, 1]}, "chunked:16"), (910, {"recompute": [0, 1]}, "chunked:16"),
    ]
    lines = [json.dumps({**base, "step": 1, "tokens": 900, "phase": "warmup", "n_blocks": 4, "plan": [0, 1, 2, 3],
                         "n_checkpointed": 4, "treatments": {"recompute": [0, 1, 2, 3], "head": "chunked:32"}})]
    for i, (tokens, kinds, head) in enumerate(steps, 2):
        plan = sorted(b for blocks in kinds.values() for b in blocks)
        lines.append(json.dumps({**base, "step": i, "tokens": tokens, "phase": "steady", "n_blocks": 4, "plan": plan,
                                 "n_checkpointed": len(plan), "treatments": {**kinds, "head": head}}))
    (run / "head" / "memfit_steps.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    markdown = build_report(run, out).read_text()
    rows = table_rows(markdown, "Treatment mix per input size", first_column="run")
    head = {row["tokens"]: row for row in rows if row["run"].startswith(base["method"])}
    assert [(r["micro-steps"], r["recompute"], r["head (micro-steps)"]) for r in head.values()] == [
        ("2", "0.0", "keep ×2"), ("2", "1.0", "keep ×1, chunked:4 ×1"), ("2", "2.0", "chunked:16 ×2")]
    assert "(treatments_" in markdown and list(out.glob("treatments_*.png"))


def test_no_head_column_for_runs_that_never_planned_the_head(tmp_path):
    base = json.loads((FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()[0])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "memfit_steps.jsonl").write_text(json.dumps(
        {**base, "step": 1, "tokens": 500, "phase": "steady", "n_blocks": 4, "plan": [0], "n_checkpointed": 1,
         "treatments": {"recompute": [0]}}) + "\n")
    markdown = build_report(tmp_path / "run", tmp_path / "out").read_text()
    assert "head (micro-steps)" not in markdown and "Treatment mix per input size" in markdown


def test_compressed_bench_results_give_the_same_report(tmp_path, report):
    """A ``results.jsonl`` gzipped after the run (as committed results are, to stay compact) is read
    like the plain file: the report's text is the same."""
    import gzip
    import shutil

    root = tmp_path / "input"
    shutil.copytree(FIXTURE, root)
    plain = root / "bench" / "results.jsonl"
    with open(plain, "rb") as src, gzip.open(plain.with_name("results.jsonl.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    compressed = build_report(root, tmp_path / "out")
    assert compressed.read_text() == report.read_text()


def _mix_run(tmp_path: Path, steps: list[tuple[int, dict, str | None]], n_blocks: int = 4) -> Path:
    """A run folder of steady step records: (tokens, blocks' treatments, the head's label or None)."""
    base = json.loads((FIXTURE / "train_run" / "memfit_steps.jsonl").read_text().splitlines()[0])
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for i, (tokens, kinds, head) in enumerate(steps, 1):
        plan = sorted(b for blocks in kinds.values() for b in blocks)
        lines.append(json.dumps({**base, "step": i, "tokens": tokens, "phase": "steady", "n_blocks": n_blocks, "plan": plan,
                                 "n_checkpointed": len(plan), "treatments": {**kinds, **({"head": head} if head else {})}}))
    (run / "memfit_steps.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_treatment_mix_has_a_column_per_treatment_the_records_hold(tmp_path):
    """``elementwise`` and a treatment the registry does not know (a class a run was given) each get
    their column, in registry order then the unknown ones; they are not counted as kept."""
    run = _mix_run(tmp_path, [
        (500, {"recompute": [0], "elementwise": [1, 2], "my_offload": [3]}, None),
        (510, {"elementwise": [1]}, None),
    ])
    rows = table_rows(build_report(run, tmp_path / "out").read_text(), "Treatment mix per input size", first_column="run")
    assert list(rows[0])[3:] == ["recompute", "elementwise", "my_offload", "kept"]
    assert [[row[k] for k in ("tokens", "recompute", "elementwise", "my_offload", "kept")] for row in rows] == [
        ["500-501", "1.0", "2.0", "1.0", "0.0"], ["510-511", "0.0", "1.0", "0.0", "3.0"]]


def test_treatment_plot_draws_and_names_every_treatment_with_a_stable_colour(tmp_path, monkeypatch):
    """Every block and head treatment the records hold gets its bar or line and its legend entry; a
    registered treatment's colour does not depend on the others in the plot, and an unregistered one
    gets a fallback colour of its own (NOTE [A colour per treatment])."""
    from matplotlib.colors import to_hex

    from memfit.tools import report as report_module

    figures = []
    monkeypatch.setattr(report_module, "_save", lambda fig, path: figures.append(fig))
    run = _mix_run(tmp_path, [
        (500, {"recompute": [0], "elementwise": [1, 2], "my_offload": [3]}, "chunked:4"),
        (900, {"elementwise": [1]}, "my_head:2"),
    ])
    build_report(run, tmp_path / "out")
    (fig,) = [f for f in figures if "Treatment mix" in f.get_suptitle()]
    labels = {t.get_text() for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if legend
              for t in legend.get_texts()}
    assert {"recompute", "elementwise", "my_offload", "kept", "LM head chunked", "LM head my_head"} <= labels

    colors = report_module._treatment_colors
    alone, crowded = colors(["recompute", "my_offload"], {}), colors(["elementwise", "my_offload", "zz"], {"head": ["chunked", "mine"]})
    assert alone[("block", "recompute")] == colors(["recompute", "selective", "offload"], {})[("block", "recompute")]
    assert alone[("block", "my_offload")] == crowded[("block", "my_offload")]
    assert alone[("block", "my_offload")][1] == "//"  # unregistered: hatched
    registered = {to_hex(c) for key, (c, hatch) in colors(["recompute", "selective", "offload", "elementwise"],
                                                          {"head": ["keep", "chunked"]}).items()}
    unknown = [to_hex(c) for key, (c, hatch) in crowded.items() if hatch]
    assert len(unknown) == 3 and len(set(unknown)) == 3 and not set(unknown) & registered


def test_treatment_plot_is_its_siblings_size_with_a_legend_that_covers_nothing(tmp_path, monkeypatch):
    """800 pixels wide like the peak and memory_count plots (one run: the peak plot's size), and one
    legend outside every axes, so that no bar or line is under it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    from memfit.tools import report as report_module

    run = _mix_run(tmp_path, [
        (500, {"recompute": [0], "elementwise": [1, 2], "my_offload": [3]}, "chunked:4"),
        (900, {"recompute": [0, 1, 2, 3]}, "keep"),
    ])
    out = build_report(run, tmp_path / "out").parent
    sizes = {p.name.split("_")[0]: Image.open(p).size for p in out.glob("*.png")}
    assert sizes["treatments"] == sizes["peak"] == (800, 450) and sizes["memory"][0] == 800

    figures = []
    monkeypatch.setattr(report_module, "_save", lambda fig, path: figures.append(fig))
    build_report(run, tmp_path / "again")
    (fig,) = [f for f in figures if "Treatment mix" in f.get_suptitle()]
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert not legend.overlaps(fig._suptitle.get_window_extent(renderer))


def test_a_colour_drawn_as_a_thin_line_survives_the_64_colour_png(tmp_path):
    """The LM head's lines are a few pixels wide beside large grey and coloured bars: the saved
    palette keeps their colours (NOTE [A colour per treatment] is worth nothing if the PNG greys them)."""
    import math

    from matplotlib.colors import to_rgb
    from PIL import Image

    from memfit.tools.report import _treatment_colors

    run = _mix_run(tmp_path, [(500, {"recompute": [0]}, "keep"), (900, {"recompute": [0, 1, 2, 3]}, "chunked:4")])
    out = build_report(run, tmp_path / "out").parent
    with Image.open(next(out.glob("treatments_*.png"))) as image:
        drawn = {c for _, c in image.convert("RGB").getcolors(1 << 16)}
    for name in ("keep", "chunked"):
        want = [255 * x for x in to_rgb(_treatment_colors([], {"head": ["keep", "chunked"]})[("head", name)][0])]
        assert min(math.dist(want, c) for c in drawn) < 8, name
