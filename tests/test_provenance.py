"""memfit.tools.bench.provenance: every new result line carries the commit it ran, whether its code
was committed (NOTE [What tree_clean counts]) and the suite call that ran it; loop_bench and memfit
bench write them, run_suite names the call."""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from memfit.tools.bench import matrix
from memfit.tools.bench.provenance import CALL_ENV, code_version, provenance

ROOT = Path(__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_checkout_gives_its_commit_and_only_code_changes_make_it_unclean(tmp_path):
    (tmp_path / "src" / "memfit").mkdir(parents=True)
    (tmp_path / "src" / "memfit" / "x.py").write_text("a = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    assert code_version(tmp_path) == {"commit": head, "tree_clean": True}
    (tmp_path / "README.md").write_text("edited\n")  # documentation and new files are not the code
    (tmp_path / "results.jsonl").write_text("{}\n")
    assert code_version(tmp_path) == {"commit": head, "tree_clean": True}
    (tmp_path / "src" / "memfit" / "x.py").write_text("a = 2\n")
    assert code_version(tmp_path) == {"commit": head, "tree_clean": False}


def test_outside_a_checkout_both_are_unknown(tmp_path):
    assert code_version(tmp_path) == {"commit": None, "tree_clean": None}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drivers_lines_carry_the_commit_of_this_checkout_and_the_call(monkeypatch):
    monkeypatch.setenv(CALL_ENV, "ft-r0")
    expected = {**code_version(ROOT), "call": "ft-r0"}
    assert expected == provenance()  # memfit runs from this checkout (PYTHONPATH=src)
    assert {k: matrix._versions()[k] for k in expected} == expected
    versions = _load("loop_bench")._versions(argparse.Namespace(device="cpu"))
    assert {k: versions[k] for k in expected} == expected
    monkeypatch.delenv(CALL_ENV)
    assert provenance()["call"] is None  # a driver run by hand


def test_run_suite_tells_each_command_its_call(tmp_path):
    run_suite = _load("run_suite")
    echo = [sys.executable, "-c", f"import os; print('call:', os.environ['{CALL_ENV}'])"]
    run_suite._run_call(run_suite.Call("tc-fits", [echo]), tmp_path, {})
    assert "call: tc-fits" in (tmp_path / "tc-fits" / "tc-fits.log").read_text()
