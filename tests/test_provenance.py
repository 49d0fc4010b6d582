"""memfit.tools.bench.provenance: every new result line carries the commit it ran and whether its code
was committed (NOTE [What tree_clean counts]); loop_bench and memfit bench write both."""

import argparse
import importlib.util
import subprocess
from pathlib import Path

from memfit.tools.bench import matrix
from memfit.tools.bench.provenance import code_version

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


def test_the_drivers_lines_carry_the_commit_of_this_checkout():
    expected = code_version(ROOT)
    assert expected == code_version()  # memfit runs from this checkout (PYTHONPATH=src)
    assert {k: matrix._versions()[k] for k in ("commit", "tree_clean")} == expected
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    versions = loop_bench._versions(argparse.Namespace(device="cpu"))
    assert {k: versions[k] for k in ("commit", "tree_clean")} == expected
