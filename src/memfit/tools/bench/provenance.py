"""Which code and which call a benchmark line measured: the commit of memfit's checkout, whether its
code was committed, and the suite call that ran it (``commit``, ``tree_clean``, ``call``), written
into every line the benchmark drivers write (:func:`provenance`).

# NOTE [What tree_clean counts]
A line's ``tree_clean`` is False when ``git status --porcelain`` lists a change to the code (under
``src/memfit`` or a script of ``benchmarks/``) that ``commit`` lacks: the line then measured code no
commit holds. Untracked files, documentation and published results do not count, so that a
benchmark call writing its results into the tree, or a README edited meanwhile, does not mark the
next line. Outside a git checkout (memfit installed as a package, a copy of the tree without
``.git``) both are None: unknown, never guessed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["CALL_ENV", "CODE_PATHS", "code_version", "provenance"]

#: The environment variable ``benchmarks/run_suite.py`` sets to the name of the call it runs.
CALL_ENV = "MEMFIT_BENCH_CALL"

#: The pathspecs whose uncommitted changes make a line's code not its commit's (NOTE [What tree_clean counts]).
CODE_PATHS = ("src/memfit", ":(glob)benchmarks/**/*.py", ":(glob)benchmarks/*.sh")


def _checkout() -> Path:
    """The folder that holds ``src/memfit`` when memfit runs from a source checkout."""
    return Path(__file__).resolve().parents[4]


def code_version(root: str | Path | None = None) -> dict[str, str | bool | None]:
    """``{"commit": short hash of HEAD, "tree_clean": no uncommitted code change}`` of the git
    checkout at ``root`` (default: the one memfit runs from); both None outside a checkout.

    Args:
        root: a repository's top folder; by default the checkout whose ``src/memfit`` is this package.

    Returns:
        The two fields a result line carries (NOTE [What tree_clean counts]).

    Example:
        >>> sorted(code_version("/"))
        ['commit', 'tree_clean']
    """
    top = Path(root) if root is not None else _checkout()

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(top), *args], capture_output=True, text=True, check=False)
        except OSError:  # no git on this machine
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    found = git("rev-parse", "--show-toplevel")
    # an installed memfit may sit inside some other repository (a venv in a project): not memfit's code
    not_memfit = root is None and not (top / "src" / "memfit").is_dir()
    if found is None or Path(found).resolve() != top.resolve() or not_memfit:
        return {"commit": None, "tree_clean": None}
    commit = git("rev-parse", "--short=7", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    return {"commit": commit, "tree_clean": None if commit is None or changed is None else changed == ""}


def provenance() -> dict[str, str | bool | None]:
    """What a result line says of its origin: :func:`code_version`'s ``commit`` and ``tree_clean``, and
    ``call``, the suite call that ran it (:data:`CALL_ENV`; None outside ``run_suite.py``)."""
    return {**code_version(), "call": os.environ.get(CALL_ENV) or None}
