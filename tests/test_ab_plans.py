"""benchmarks/ab_plans.py: two versions' plans and step times compared step by step."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ab_plans", ROOT / "benchmarks" / "ab_plans.py")
ab_plans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_plans)


def _write(folder: Path, name: str, records: list[dict]) -> None:
    (folder / "steps").mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "steps" / f"{name}.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def _records(plans: list[dict], ms: float) -> list[dict]:
    return [{"treatments": p, "step_ms": ms, "peak_allocated_bytes": 2**30, "oom_retries": 0} for p in plans]


def test_a_differing_plan_and_the_time_ratio_are_found(tmp_path, capsys):
    same = [{"recompute": [0, 1]}] * 12
    _write(tmp_path / "new-0", "dynamic-6GB-r0", _records(same, 110.0))
    _write(tmp_path / "old-0", "dynamic-6GB-r0", _records(same[:11] + [{"recompute": [0]}], 100.0))
    _write(tmp_path / "new-0", "none-uncapped-r0", _records([{}] * 12, 50.0))  # old lacks it: not compared
    rows = ab_plans.compare(tmp_path, steady_from=2)
    assert [(r["config"], r["plans_differ"], r["first_differing_steps"]) for r in rows] == [("dynamic-6GB", 1, [11])]
    assert rows[0]["median_step_ratio_new_over_old"] == 1.1
    assert ab_plans.main([str(tmp_path)]) == 0 and "| dynamic-6GB | 0 | 12 | 1 | 1.1 |" in capsys.readouterr().out


def test_a_folder_without_both_versions_is_one_error(tmp_path, capsys):
    _write(tmp_path / "new-0", "dynamic-6GB-r0", _records([{}], 1.0))
    assert ab_plans.main([str(tmp_path)]) == 2 and "no configuration that both versions ran" in capsys.readouterr().err
    assert ab_plans.main([str(tmp_path / "missing")]) == 2
