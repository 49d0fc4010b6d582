"""benchmarks/fsdp_bench.py: configurations, one launch for many (gloo ranks on CPU), the summary."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("fsdp_bench", ROOT / "benchmarks" / "fsdp_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fsdp_bench", module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text, name, fields", [
    ("llama-3b/none", "llama-3b-x2-none", dict(method="none", share=None, reference=None, lora=False, steps=16)),
    ("llama-3b/dynamic@0.5", "llama-3b-x2-dynamic-0.5", dict(share=0.5, reference="llama-3b-x2-none")),
    ("llama-8b+lora/hf-ckpt@0.7:4", "llama-8b-lora-x2-hf-ckpt-0.7", dict(lora=True, steps=4, reference="llama-8b-lora-x2-none")),
    ("llama-8b+lora/dynamic@0.5#4", "llama-8b-lora-b4-x2-dynamic-0.5", dict(batch_size=4, reference="llama-8b-lora-b4-x2-none")),
    ("oom-check:llama-1b", "oom-check-llama-1b-x2", dict(method="oom-check", model="llama-1b")),
    ("llama-8b+lora/dynamic@24GiB:4#1", "llama-8b-lora-b1-x2-dynamic-24GiB", dict(share=None, cap_gib=24.0, reference=None,
                                                                                 steps=4, batch_size=1)),
])
def test_configurations_read_from_their_text(text, name, fields):
    config = _bench().parse_config(text, world=2, steps=16)
    assert config.name == name
    assert {k: getattr(config, k) for k in fields} == fields


@pytest.mark.parametrize("text, match", [
    ("llama-3b/dynamic", "every other method needs one"), ("llama-3b/none@0.5", "none runs uncapped"),
    ("llama-70b/none", "MODEL one of"), ("llama-3b/magic@0.5", "METHOD one of"), ("oom-check:gpt", "the model is one of"),
])
def test_a_bad_configuration_names_what_to_write(text, match):
    with pytest.raises(SystemExit, match=match):
        _bench().parse_config(text, world=2, steps=16)


def _config(root: Path, name: str, method: str, world: int, share, step_ms, peak_gib, cap_gib=None, status="ok"):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "status.json").write_text(json.dumps({"status": status}))
    if step_ms is None:
        return
    for rank in range(world):
        (folder / f"rank{rank}.json").write_text(json.dumps({
            "name": name, "method": method, "rank": rank, "world_size": world, "model": "llama-3b", "lora": False,
            "budget_bytes": int(cap_gib * 2**30) if cap_gib else None, "share": share, "batch_size": 5,
            "static_need_bytes": 10 * 2**30, "steps": 16, "steady_from": 8, "step_ms": [step_ms] * 16,
            "median_steady_step_ms": step_ms + rank, "max_peak_allocated_bytes": int(peak_gib * 2**30),
            "oom_retries": 0, "records": 16, "mean_treated_blocks": 3.0, "n_blocks": 28, "fired": 0,
            "device": "cpu", "torch": "x", "transformers": "y",
        }))


def test_summary_compares_dynamic_with_the_fastest_peer_under_the_cap_and_4_ranks_with_2(tmp_path):
    two, four = tmp_path / "x2", tmp_path / "x4"
    _config(two, "llama-3b-x2-none", "none", 2, None, 500.0, 40.0)
    _config(two, "llama-3b-x2-dynamic-0.5", "dynamic", 2, 0.5, 600.0, 19.0, 20.0)
    _config(two, "llama-3b-x2-hf-ckpt-0.5", "hf-ckpt", 2, 0.5, 700.0, 19.5, 20.0)
    _config(two, "llama-3b-x2-accelerate-ac-0.5", "accelerate-ac", 2, 0.5, 650.0, 21.0, 20.0)  # over its cap
    _config(two, "llama-3b-x2-full-0.5", "full", 2, 0.5, None, 0, 20.0, status="failed")
    _config(four, "llama-3b-x4-dynamic-0.5", "dynamic", 4, 0.5, 660.0, 15.0, 16.0)
    rows = _bench().summarize([str(two), str(four)], summary=str(tmp_path / "scaling.md"))
    table = (tmp_path / "scaling.md").read_text()
    assert "| llama-3b-x2-dynamic-0.5 | 601.0 | hf-ckpt | 701.0 | 0.86× |" in table  # accelerate-ac went over its cap
    assert "| llama-3b-x4-dynamic-0.5 | 601.0 | 663.0 | 1.81× |" in table  # slowest ranks: 601 on 2, 663 on 4
    failed = next(line for line in table.splitlines() if line.startswith("| llama-3b-x2-full-0.5 |"))
    assert failed.endswith("| failed |") and "| full | 20.00 |" not in failed  # no rank files: only the status
    assert not (two / "results.jsonl").exists()
    assert {r["name"]: r.get("under_cap") for r in rows}["llama-3b-x2-accelerate-ac-0.5"] is False
    _bench().summarize([str(two)])
    lines = [json.loads(line) for line in (two / "results.jsonl").read_text().splitlines()]
    failed_line = {line["name"]: line for line in lines}["llama-3b-x2-full-0.5"]
    assert failed_line["status"] == "error" and failed_line["method"] == "full" and failed_line["share"] == 0.5
    # memfit report reads every line, the failed configuration's too (what its name says, the rest None)
    from memfit.tools.report import main as report

    assert report([str(two), "--output_dir", str(tmp_path / "report")]) == 0


def test_repeats_fold_into_one_row_per_configuration_by_the_median(tmp_path):
    """``--repeats``: repeat r > 0 is ``<name>-r<r>``; the summary has one row per configuration,
    its step time the median of the repeats' (the slowest rank's in each), its peak the largest."""
    root = tmp_path / "m"
    for suffix, none_ms, dyn_ms, peak in (("", 500.0, 640.0, 19.0), ("-r1", 520.0, 600.0, 19.6), ("-r2", 480.0, 700.0, 18.0)):
        _config(root, f"llama-3b-x2-none{suffix}", "none", 2, None, none_ms, 40.0)
        _config(root, f"llama-3b-x2-dynamic-0.5{suffix}", "dynamic", 2, 0.5, dyn_ms, peak, 20.0)
    _config(root, "llama-3b-x2-full-0.5", "full", 2, 0.5, 650.0, 15.0, 20.0)
    _config(root, "llama-3b-x2-full-0.5-r1", "full", 2, 0.5, None, 0, 20.0, status="failed")
    rows = {r["name"]: r for r in _bench().summarize([str(root)])}
    assert set(rows) == {"llama-3b-x2-none", "llama-3b-x2-dynamic-0.5", "llama-3b-x2-full-0.5"}
    dynamic = rows["llama-3b-x2-dynamic-0.5"]
    assert dynamic["step_ms_repeats"] == [641.0, 601.0, 701.0] and dynamic["step_ms"] == 641.0
    assert dynamic["vs_none"] == 641.0 / 501.0  # medians of the interleaved repeats, side by side
    assert dynamic["max_peak_allocated_bytes"] == int(19.6 * 2**30)
    assert rows["llama-3b-x2-full-0.5"]["status"] == "failed (1 of 2 repeats ran)"
    summary = (root / "summary.md").read_text()
    assert "| llama-3b-x2-dynamic-0.5 | 2 | dynamic | 20.00 | 10.00 | 641.0 (median of 3) |" in summary
    # per step, within each repeat (the same batches): 8 steady steps each of 640/500, 600/520 and 700/480; not against
    # full, which failed a repeat; summed over those steps (whole runs): (641 + 601 + 701) / (501 + 521 + 481)
    assert "| llama-3b-x2-dynamic-0.5 | llama-3b-x2-none | 1.280× | 1.293× | 24 |" in summary
    assert "| llama-3b-x2-dynamic-0.5 | llama-3b-x2-full-0.5 |" not in summary
    assert _repeat_plan(tmp_path, 2) == {"tiny-x2-none", "tiny-x2-dynamic-0.7", "tiny-x2-none-r1", "tiny-x2-dynamic-0.7-r1"}


def _repeat_plan(tmp_path, repeats):
    """The configurations ``matrix --repeats`` would run (each recorded as not run: the deadline is past)."""
    args = _bench()._parser().parse_args(["matrix", "--output_dir", str(tmp_path / "plan"), "--repeats", str(repeats),
                                          "--deadline_s", "0", "tiny/none", "tiny/dynamic@0.7"])
    _bench().matrix(args)
    return {p.parent.name for p in (tmp_path / "plan").glob("*/status.json")}


@pytest.mark.slow
def test_one_launch_runs_many_configurations_and_a_failure_costs_one_relaunch(tmp_path):
    """Two gloo ranks: none gives the caps; a cap below the static need is skipped by both ranks
    together; the injected-OOM check ends its launch (rank 1 stops with the backward's clear error)
    and the configurations after it run in a second launch; one past the deadline is recorded."""
    out = tmp_path / "m"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "fsdp_bench.py"), "matrix", "--output_dir", str(out),
               "--nproc", "2", "--port", "29741", "--steps", "6", "--steady_from", "3", "--max_length", "64",
               "--config_limit_s", "60", "--models_every_step", "tiny/none", "tiny/full@0.05", "oom-check:tiny", "tiny/dynamic@0.7"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    status = {p.parent.name: json.loads(p.read_text())["status"] for p in out.glob("*/status.json")}
    assert status == {"tiny-x2-none": "ok", "tiny-x2-full-0.05": "cap below the static need",
                      "oom-check-tiny-x2": "ok", "tiny-x2-dynamic-0.7": "ok"}, status
    assert (out / "launches.log").read_text().count("--- launch") == 2
    checks = [json.loads((out / "oom-check-tiny-x2" / f"oom_check.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(c["forward"]["weights_equal"] for c in checks)
    assert [c["forward"]["oom_retries"] for c in checks] == [0, 1]
    assert "cannot be replayed in step" in checks[1]["backward"]["error"]
    dynamic = [json.loads((out / "tiny-x2-dynamic-0.7" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(d["steps"] == 6 and d["budget_bytes"] for d in dynamic)
    for r in (0, 1):  # --models_every_step: each rank's model after each step, for the CPU replays
        models = gzip.open(out / "tiny-x2-dynamic-0.7" / f"memfit_models.rank{r}.jsonl.gz", "rt").read().splitlines()
        assert len(models) == 6 and all("model" in json.loads(m) for m in models)
    assert not (out / "tiny-x2-none" / "memfit_models.rank0.jsonl.gz").exists()  # none learns nothing
    assert "| tiny-x2-dynamic-0.7 | 2 | dynamic |" in (out / "summary.md").read_text()
    # a matrix whose deadline has passed starts nothing and records why
    late = subprocess.run([*command[:4], str(tmp_path / "late"), *command[5:-4], "--deadline_s", "1", "tiny/none"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert late.returncode == 0, late.stderr[-2000:]
    assert json.loads((tmp_path / "late" / "tiny-x2-none" / "status.json").read_text())["status"].startswith("not run")


def test_the_scaling_table_reads_published_folders_too(tmp_path):
    bench = _bench()
    two, four = tmp_path / "x2", tmp_path / "x4"
    _config(two, "llama-3b-x2-dynamic-0.5", "dynamic", 2, 0.5, 600.0, 19.0, 20.0)
    _config(four, "llama-3b-x4-dynamic-0.5", "dynamic", 4, 0.5, 660.0, 15.0, 16.0)
    for folder in (two, four):
        bench.summarize([str(folder)])
        published = tmp_path / "published" / folder.name
        published.mkdir(parents=True)
        (published / "results.jsonl").write_text((folder / "results.jsonl").read_text())
    bench.summarize([str(tmp_path / "published" / "x4"), str(tmp_path / "published" / "x2"), str(tmp_path / "absent")],
                    summary=str(tmp_path / "scaling.md"))
    assert "| llama-3b-x4-dynamic-0.5 | 601.0 | 663.0 | 1.81× |" in (tmp_path / "scaling.md").read_text()


def test_node_ranks_run_the_matrix_and_replay_an_oom_together(tmp_path):
    """``--nodes 2``: two torchrun agents of one gloo rank each at a c10d rendezvous on localhost (two node ranks of
    one host): a cap in GiB needs no ``none`` first, its rank files say what the blocks ran as, the host memory
    taken and (``--profile``) the time in collectives of one more step; the injected-OOM check's forward OOM on rank
    1 is replayed by both, weights bitwise."""
    out = tmp_path / "m"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "benchmarks" / "fsdp_bench.py"), "matrix", "--output_dir", str(out),
               "--nproc", "2", "--nodes", "2", "--port", "29743", "--steps", "6", "--steady_from", "3", "--max_length", "64",
               "--config_limit_s", "60", "--profile", "--profile_trace", "tiny/full@1GiB", "oom-check:tiny"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    status = {p.parent.name: json.loads(p.read_text())["status"] for p in out.glob("*/status.json")}
    assert status == {"tiny-x2-full-1GiB": "ok", "oom-check-tiny-x2": "ok"}, status
    full = [json.loads((out / "tiny-x2-full-1GiB" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(f["budget_bytes"] == 2**30 and f["world_size"] == 2 and f["max_rss_bytes"] > 0 for f in full)
    # the six timed steps' records; the profiled step's collectives (gloo's are synchronous: their host time counts)
    assert all(f["block_treatments"] == {"recompute": 6 * f["n_blocks"]} and f["records"] == 6 for f in full), full[0]
    assert all(f["collective_ms"] > 0 and f["steps"] == 6 for f in full), [f["collective_ms"] for f in full]
    assert all("Self CPU" in (out / "tiny-x2-full-1GiB" / f"profile.rank{r}.txt").read_text() for r in (0, 1))
    assert all(json.loads(gzip.open(out / "tiny-x2-full-1GiB" / f"trace.rank{r}.json.gz").read())["traceEvents"] for r in (0, 1))
    # NOTE [A launch warms up untimed]: the launch's untimed steps left no configuration of their own
    assert not any((out / f"warmup-tiny-{m}" / "status.json").exists() for m in ("none", "full"))
    recomputed = [json.loads(line) for line in (out / "warmup-tiny-full" / "memfit_steps.rank0.jsonl").read_text().splitlines()]
    assert {r["method"] for r in recomputed} == {"full"}
    warm = [json.loads(line) for line in (out / "warmup-tiny-none" / "memfit_steps.rank0.jsonl").read_text().splitlines()]
    assert [w["shape"][1] for w in warm] == [r["shape"][1] for r in map(json.loads, (out / "tiny-x2-full-1GiB" / "memfit_steps.rank0.jsonl").read_text().splitlines())][:6]
    row = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| tiny-x2-full-1GiB |"))
    assert row.split(" | ")[-2] == " / ".join(f"{f['collective_ms']:.1f}" for f in full)
    checks = [json.loads((out / "oom-check-tiny-x2" / f"oom_check.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(c["forward"]["weights_equal"] and c["world_size"] == 2 for c in checks)
    assert [c["forward"]["oom_retries"] for c in checks] == [0, 1]


def test_decisions_reads_the_steady_steps_of_every_file(tmp_path):
    """``fsdp_bench.py decisions``: the steady steps' ``planner_us`` over every file given (warm-up left out)."""
    import gzip

    rows = [{"phase": "warmup", "planner_us": 900_000.0}] + [{"phase": "steady", "planner_us": 1000.0 * ms} for ms in (1, 2, 3)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"phase": "steady", "planner_us": 10_000.0}) + "\n")
    text = _bench().decisions([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")])
    assert text == "4 steady decisions: median 2.5 ms, 90th percentile 10.0 ms, most 10.0 ms\n"


def test_kernels_compares_two_traces_busiest_streams_by_kind(tmp_path):
    """``fsdp_bench.py kernels``: per kind of kernel, the device time on each trace's busiest stream and the
    difference; other streams' kernels (a collective's) are left out."""
    def trace(path, kernels):
        events = [{"ph": "X", "cat": "kernel", "name": name, "tid": tid, "ts": ts, "dur": dur} for name, tid, ts, dur in kernels]
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 99})
        path.write_text(json.dumps({"traceEvents": events}))
        return str(path)

    base = trace(tmp_path / "a.json", [("nvjet_sm90_tst", 7, 0, 3000), ("ncclDevKernel_AllGather", 9, 0, 500)])
    treated = trace(tmp_path / "b.json", [("nvjet_sm90_tst", 7, 0, 3000), ("nvjet_sm90_tst", 7, 3000, 1000),
                                          ("vectorized_elementwise_kernel", 7, 5000, 2000), ("ncclDevKernel", 9, 0, 5500)])
    table = _bench().kernels([base, treated])
    assert "| matmul | 3.0 | 4.0 | +1.0 |" in table and "| elementwise and copies | 0.0 | 2.0 | +2.0 |" in table
    assert "collective" not in table and "| span (first kernel to last) | 3.0 | 7.0 | +4.0 |" in table
    with pytest.raises(SystemExit, match="holds no device event"):
        _bench().kernels([trace(tmp_path / "c.json", []), treated])


def test_slack_replays_the_ranks_steps_through_the_slack_rules(tmp_path):
    """``fsdp_bench.py slack``: a rank's retry in a bucket without clean steps, priced against the clean steps of the
    ranks' larger shapes with the next step's excess (NOTE [A retry beside no clean step of its bucket]), grows its
    slack; the rank that never retried keeps it."""
    def records(path, rows):
        path.write_text("".join(json.dumps({"step": i + 1, "phase": phase, "shape": [3, length, 64], "step_ms": ms,
                                            "recompute_ms_est": 0.0, "alloc_retries": retries, "budget_bytes": 2**34}) + "\n"
                                for i, (phase, length, ms, retries) in enumerate(rows)))
        return str(path)

    zero = records(tmp_path / "r0.jsonl", [("warmup", 900, 5000.0, 0), ("steady", 3000, 900.0, 0),
                                           ("steady", 2700, 880.0, 1), ("steady", 2500, 1300.0, 0)])
    one = records(tmp_path / "r1.jsonl", [("warmup", 900, 5000.0, 0), ("steady", 2900, 900.0, 0),
                                          ("steady", 2000, 880.0, 0), ("steady", 2400, 1300.0, 0)])
    out = _bench().slack([zero, one], growth_ms=1.0)
    assert out.splitlines()[0] == "rank 0: steady steps that retried [3]; the slack grew after steps [4]"
    assert out.splitlines()[-1] == "rank 1: steady steps that retried []; the slack grew after steps []"
    # rank 0's one clean step (step 2, 900 ms, the longest) bounds the others: step 3 ran 20 ms under it, step 4 400 over
    assert ("rank 0: over the clean steps nearest above, median: retry steps -20.0 ms (1 bounded), the steps after them "
            "400.0 ms (1); 1 of 3 steady steps retried, mean step 1026.7 ms") in out
