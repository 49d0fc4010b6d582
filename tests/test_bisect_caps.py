"""The reach suite's bisection (benchmarks/bisect_caps.py): the smallest fitting cap of a monotone
rule in about log2 trials, the rule a trial's line is judged by, and loop_bench's --reach_gib end to end
on a CPU dry run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bisect_caps import caps_gib, fits, smallest_fitting  # noqa: E402


@pytest.mark.parametrize("n, threshold", [(1, 0), (1, None), (2, 1), (7, 0), (7, 3), (7, 6), (7, None), (16, 5), (31, 30)])
def test_bisection_finds_the_smallest_fitting_cap_in_log_trials(n, threshold):
    caps = [float(c) for c in range(10, 10 + n)]
    smallest, tried = smallest_fitting(caps, lambda c: threshold is not None and c >= caps[threshold])
    assert smallest == (None if threshold is None else caps[threshold])
    assert tried[0][0] == caps[-1]  # the largest first: if it does not fit, nothing else runs
    assert len(tried) <= 1 + math.ceil(math.log2(n))
    assert len({c for c, _ in tried}) == len(tried)  # no cap tried twice
    assert all(ok == (threshold is not None and c >= caps[threshold]) for c, ok in tried)


def test_caps_and_the_rule_a_trial_is_judged_by():
    assert caps_gib(20, 24, 1) == [20, 21, 22, 23, 24] and caps_gib(0.5, 0.6, 0.05) == [0.5, 0.55, 0.6]
    with pytest.raises(ValueError, match="LO <= HI"):
        caps_gib(24, 20, 1)
    assert fits({"status": "ok", "oom_count": 0, "lost_steps": 0}, 30)
    assert not fits({"status": "ok", "oom_count": 1, "lost_steps": 0}, 30)  # one replay in 30 steps: over 1 per 100
    assert fits({"status": "ok", "oom_count": 2, "lost_steps": 0}, 200)
    assert not fits({"status": "ok", "oom_count": 0, "lost_steps": 1}, 30)
    assert not fits({"status": "oom", "oom_count": 1}, 30) and not fits({"status": "time_limit"}, 30)


def test_loop_bench_reach_on_a_cpu_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:16:24",
                            "--batch", "2", "--steps", "2", "--steady_from", "1", "--reach_gib", "0.03", "0.09",
                            "--reach_step_gib", "0.03", "--repeats", "1", "--methods", "dynamic",
                            "--output_dir", str(out)]) == 0
    (row,) = [json.loads(t) for t in (out / "out.reach.jsonl").read_text().splitlines()]
    lines = [json.loads(t) for t in (out / "results.jsonl").read_text().splitlines()]
    assert row["method"] == "dynamic" and row["complete"] and len(row["trials"]) == len(lines) >= 2
    assert [line["reach_trial_gib"] for line in lines] == [c for c, _ in row["trials"]]
    fitting = [c for c, ok in row["trials"] if ok]
    assert row["smallest_gib"] == min(fitting)  # logical accounting: the static need bounds it from below
    assert all(not ok for c, ok in row["trials"] if c < row["smallest_gib"])
    assert "| dynamic |" in (out / "out.reach.md").read_text()
