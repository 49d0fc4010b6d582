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


def _loop_bench():
    """benchmarks/loop_bench.py as a module (it is a script)."""
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(loop_bench, out, steps, lo, hi, *extra):
    """A reach run of llama-tiny on CPU (caps in GiB, 0.03 apart) into ``out``; its exit status."""
    return loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:16:24",
                            "--batch", "2", "--steps", str(steps), "--steady_from", "1", "--reach_gib", lo, hi,
                            "--reach_step_gib", "0.03", "--repeats", "1", *extra, "--output_dir", str(out)])


@pytest.mark.parametrize("n, threshold", [(1, 0), (1, None), (2, 1), (7, 0), (7, 3), (7, 6), (7, None), (16, 5), (31, 30)])
def test_bisection_finds_the_smallest_fitting_cap_in_log_trials(n, threshold):
    caps = [float(c) for c in range(10, 10 + n)]
    smallest, tried = smallest_fitting(caps, lambda c: threshold is not None and c >= caps[threshold])
    assert smallest == (None if threshold is None else caps[threshold])
    assert tried[0][0] == caps[-1]  # the largest first: if it does not fit, nothing else runs
    assert len(tried) <= 1 + math.ceil(math.log2(n))
    assert len({c for c, _ in tried}) == len(tried)  # no cap tried twice
    assert all(ok == (threshold is not None and c >= caps[threshold]) for c, ok in tried)


@pytest.mark.parametrize("seed", range(40))
def test_guesses_and_a_first_cap_never_change_the_answer_or_its_certificate(seed):
    """Whatever a trial guesses (right, wrong, absent) and wherever the search starts, the answer is the
    smallest fitting cap, proven by a fitting trial and a failing one a step below (or the range's lowest)."""
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 40)
    caps = [float(c) for c in range(4, 4 + n)]
    threshold = rng.choice([None, *range(n)])
    fitting = lambda c: threshold is not None and c >= caps[threshold]  # noqa: E731
    first = rng.choice([None, rng.randrange(n)])

    def trial(c):
        ok = fitting(c)
        return (ok, rng.choice([None, rng.uniform(0, 50), caps[threshold] - rng.random() if threshold is not None else 1.0]))

    smallest, tried = smallest_fitting(caps, trial, first)
    assert smallest == (None if threshold is None else caps[threshold])
    assert len({c for c, _ in tried}) == len(tried) and all(ok == fitting(c) for c, ok in tried)
    assert tried[0][0] == caps[-1 if first is None else first]
    if smallest is not None:
        assert (smallest, True) in tried and (smallest == caps[0] or (smallest - 1, False) in tried)


def test_a_fixed_policys_peak_finds_its_cap_in_three_trials():
    caps = [float(c) for c in range(4, 65)]  # 61 caps: a plain bisection tries 7
    need = 27.3  # the policy's peak, read at any cap that fits

    smallest, tried = smallest_fitting(caps, lambda c: (c >= need, need if c >= need else None))
    assert smallest == 28.0 and tried == [(64.0, True), (28.0, True), (27.0, False)]
    # memfit first at the peer's cap: a fit there bisects below it only
    smallest, tried = smallest_fitting(caps, lambda c: c >= 17, first=caps.index(28.0))
    assert smallest == 17.0 and tried[0] == (28.0, True) and all(c <= 28 for c, _ in tried)
    # and where it does not fit there, the largest, then the range above
    smallest, tried = smallest_fitting(caps, lambda c: c >= 40, first=caps.index(28.0))
    assert smallest == 40.0 and tried[:2] == [(28.0, False), (64.0, True)] and all(c > 28 for c, _ in tried[1:])


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
    loop_bench = _loop_bench()
    out = tmp_path / "out"
    assert _dry_run(loop_bench, out, 2, "0.03", "0.09", "--methods", "dynamic") == 0
    (row,) = [json.loads(t) for t in (out / "out.reach.jsonl").read_text().splitlines()]
    lines = [json.loads(t) for t in (out / "results.jsonl").read_text().splitlines()]
    assert row["method"] == "dynamic" and row["complete"] and len(row["trials"]) == len(lines) >= 2
    assert [line["reach_trial_gib"] for line in lines] == [c for c, _ in row["trials"]]
    fitting = [c for c, ok in row["trials"] if ok]
    assert row["smallest_gib"] == min(fitting)  # logical accounting: the static need bounds it from below
    assert all(not ok for c, ok in row["trials"] if c < row["smallest_gib"])
    assert "| dynamic |" in (out / "out.reach.md").read_text()


def test_loop_bench_reach_tries_memfit_first_at_the_best_peers_cap(tmp_path):
    """On CPU a peer has no cap (it fits everywhere, smallest is the lowest); memfit's first trial is that
    cap, and its row compares the two there; a replay past the rule's would stop a trial (max_replays)."""
    loop_bench = _loop_bench()
    out = tmp_path / "out"
    assert _dry_run(loop_bench, out, 3, "0.06", "0.12", "--no_untimed", "--methods", "dynamic", "hf-every-1") == 0
    rows = {r["method"]: r for r in map(json.loads, (out / "out.reach.jsonl").read_text().splitlines())}
    assert list(rows) == ["hf-every-1", "dynamic"]  # the fixed policy first, whatever the order given
    assert rows["hf-every-1"]["smallest_gib"] == 0.06
    mine = rows["dynamic"]
    assert mine["trials"][0][0] == 0.06
    if mine["trials"][0][1]:
        assert mine["vs_best_peer"]["peer"] == "hf-every-1" and mine["vs_best_peer"]["steps"] == 2
        assert mine["vs_best_peer"]["step_ratio"] > 0


def test_a_trial_past_the_rules_replays_stops_there(tmp_path, monkeypatch):
    """A memfit trial that replayed an OOM has failed the rule (0 replays in under 100 steps): it stops at that
    step, not after every step, and the bisection goes on to the next cap."""
    import torch

    loop_bench = _loop_bench()
    build = loop_bench._build
    calls = {"n": 0}

    def build_failing_once(args):
        model, rest = build(args)
        forward = model.forward

        def once(*a, **k):
            calls["n"] += 1
            if calls["n"] == 6:  # the second trial's step 1 (the first, at the largest cap, ran 4)
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            return forward(*a, **k)

        model.forward = once
        return model, rest

    monkeypatch.setattr(loop_bench, "_build", build_failing_once)
    out = tmp_path / "out"
    assert _dry_run(loop_bench, out, 4, "0.06", "0.12", "--no_untimed", "--methods", "dynamic") == 0
    lines = [json.loads(t) for t in (out / "results.jsonl").read_text().splitlines()]
    assert lines[1]["status"] == "replays" and lines[1]["oom_count"] == 1 and len(lines[1]["step_ms"]) == 2
    assert all(x["status"] == "ok" and len(x["step_ms"]) == 4 for x in lines[:1] + lines[2:])
    (row,) = [json.loads(t) for t in (out / "out.reach.jsonl").read_text().splitlines()]
    assert row["trials"][0] == [0.12, True] and row["trials"][1][1] is False and row["smallest_gib"] is not None


def test_loop_bench_reach_starts_memfit_where_told_without_a_peer(tmp_path):
    """--reach_start_gib: memfit's first trial when the call has no fixed policy (the workload's methods split over
    calls), the cap of the bisection nearest to it."""
    loop_bench = _loop_bench()
    out = tmp_path / "out"
    assert _dry_run(loop_bench, out, 2, "0.03", "0.12", "--reach_start_gib", "0.085", "--no_untimed", "--methods", "dynamic") == 0
    (row,) = [json.loads(t) for t in (out / "out.reach.jsonl").read_text().splitlines()]
    assert row["trials"][0][0] == 0.09 and "vs_best_peer" not in row


def test_a_start_outside_the_range_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--reach_start_gib 0.5 is outside --reach_gib 0.03 0.12"):
        _dry_run(_loop_bench(), tmp_path / "out", 2, "0.03", "0.12", "--reach_start_gib", "0.5", "--methods", "dynamic")
    assert not (tmp_path / "out").exists()  # said before anything is built or written


def test_loop_bench_sets_its_share_budgets_from_none_on_the_longest_batch_alone(tmp_path):
    """``--reference_longest``: where none is not a method compared, the uncapped none whose peak ``--budgets``' shares
    are of runs the longest batch twice (its peak is the run's), its line saying so; the methods run every step."""
    loop_bench = _loop_bench()
    out = tmp_path / "out"
    # a share of 2: under logical accounting the static need (the optimizer step's temporaries in it) is over none's peak
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:8:24",
                            "--batch", "2", "--steps", "5", "--steady_from", "1", "--budgets", "2", "--reference_longest",
                            "--repeats", "1", "--no_untimed", "--methods", "dynamic", "--output_dir", str(out)]) == 0
    none, dynamic = [json.loads(t) for t in (out / "results.jsonl").read_text().splitlines()]
    assert none["method"] == "none" and len(none["step_ms"]) == 2 and "--reference_longest" in none["note"]
    assert dynamic["method"] == "dynamic" and len(dynamic["step_ms"]) == 5
    assert len(dynamic["gc_ms"]) == 5 and len(none["gc_ms"]) == 2  # the collector's ms per step, every configuration
    assert dynamic["budget_bytes"] == int(2 * none["max_peak_allocated_bytes"]) and dynamic["status"] == "ok"
    assert "step_ratio_vs_none" not in dynamic  # two steps of another batch pair with none of its steps



@pytest.mark.parametrize("extra, warmed", [((), 0), (("--untimed_fused", "2"), 2)])
def test_loop_bench_compiles_the_fused_losses_untimed_on_a_few_batches_when_asked(tmp_path, monkeypatch, extra, warmed):
    """``--untimed_fused N`` beside ``--no_untimed``: each fused loss's peer runs untimed (repeat -1, no line) on the first
    N batches before the first configuration, so that no configuration compiles Triton's kernels for the ones after."""
    loop_bench = _loop_bench()
    from memfit.engine.parts.head import FUSED

    ran, original = [], loop_bench.run_config
    monkeypatch.setattr(loop_bench, "run_config", lambda args, model, batches, initial, name, budget, repeat, out_dir:
                        ran.append((name, len(batches), repeat)) or original(args, model, batches, initial, name, budget,
                                                                             repeat, out_dir))
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:8:24",
                            "--batch", "2", "--steps", "4", "--steady_from", "1", "--budget_gb", "1", "--repeats", "1",
                            "--no_untimed", *extra, "--methods", "dynamic", "--output_dir", str(out)]) == 0
    fused = sorted(f"hf-every-1{part}" for part, (impl, _) in loop_bench.FIXED_HEADS.items() if impl in FUSED)
    untimed = [r for r in ran if r[2] == -1]
    assert sorted(name for name, _, _ in untimed) == (fused if warmed else [])
    assert all(n == warmed for _, n, _ in untimed) and ran[-1][0] == "dynamic"
    lines = [json.loads(t)["method"] for t in (out / "results.jsonl").read_text().splitlines()]
    assert "dynamic" in lines and not set(lines) & set(fused)  # the untimed runs write no line


def test_loop_bench_runs_memfits_warm_up_untimed_first_when_asked(tmp_path, monkeypatch):
    """``--untimed_memfit N``: ``dynamic+auto`` runs untimed (repeat -1, no line) on the first N batches, capped, before
    every timed configuration, so a machine's first memfit warm-up (its probe's kernel compiles) falls on no timed run."""
    loop_bench = _loop_bench()
    ran, original = [], loop_bench.run_config
    monkeypatch.setattr(loop_bench, "run_config", lambda args, model, batches, initial, name, budget, repeat, out_dir:
                        ran.append((name, len(batches), budget, repeat)) or original(args, model, batches, initial, name,
                                                                                     budget, repeat, out_dir))
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:8:24",
                            "--batch", "2", "--steps", "4", "--steady_from", "1", "--budget_gb", "1", "--repeats", "1",
                            "--no_untimed", "--untimed_memfit", "2", "--methods", "dynamic", "--output_dir", str(out)]) == 0
    name, n, budget, repeat = ran[0]
    assert (name, n, repeat) == ("dynamic+auto", 2, -1) and budget is not None
    assert all(r[3] != -1 for r in ran[1:]) and ran[-1][0] == "dynamic"  # then the timed ones, as without it
    lines = [json.loads(t)["method"] for t in (out / "results.jsonl").read_text().splitlines()]
    assert "dynamic" in lines and "dynamic+auto" not in lines  # the untimed run writes no line
