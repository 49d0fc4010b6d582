"""An output folder that already holds a run: refuse it, replace the run, or resume it.

The memfit Trainer calls :func:`claim_output_dir` as training starts, before its first step record
(NOTE [Earlier runs in the output folder]).

# NOTE [Earlier runs in the output folder]
A run writes its step records, summary, plans and memory model into ``--output_dir``, and the
Trainer its ``checkpoint-*`` folders. A second run into the same folder would truncate the
first's records while its checkpoints stay, mixing two runs. So, as Hugging Face's scripts
did for checkpoints with ``overwrite_output_dir`` (a flag ``transformers.TrainingArguments``
lacks and memfit's ``TrainingArguments`` has):

Rule 1. A folder holding step records (a non-empty ``memfit_steps*.jsonl``), a summary or a
checkpoint folder is refused, naming what it holds and the flags that decide.
Rule 2. ``--resume_from_checkpoint`` continues the run: the earlier step records and summary are
kept under the next free ``.runN`` name (``memfit_steps.run1.jsonl``), which ``memfit report``
reads as a run of its own, and the resumed run writes fresh ones.
Rule 3. ``--overwrite_output_dir`` removes the earlier run's memfit files (records, summary,
plans, memory model) before the new run starts; checkpoint folders are left as they are.
Each rank handles its own step-record file; rank 0 the shared files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from memfit.errors import FlagError

__all__ = ["earlier_run", "claim_output_dir"]

logger = logging.getLogger(__name__)

_SHARED = ("memfit_summary*.json", "memfit_plans.json", "memfit_state.json")


def earlier_run(output_dir: str, log_path: str) -> list[str]:
    """Names of what an earlier run left in ``output_dir`` (Rule 1); empty when nothing.

    Args:
        output_dir: the run's output folder.
        log_path: this run's step-record file (``--memfit_log`` may put it elsewhere).
    """
    folder = Path(output_dir)
    found: set[Path] = set()
    if folder.is_dir():
        found |= {p for p in folder.glob("memfit_steps*.jsonl") if p.stat().st_size > 0}
        found |= set(folder.glob("memfit_summary*.json"))
        found |= {p for p in folder.glob("checkpoint-*") if p.is_dir()}
    log = Path(log_path)
    if log.is_file() and log.stat().st_size > 0:
        found.add(log)
    return sorted(os.path.relpath(p, output_dir) for p in found)


def _kept_name(path: Path, n: int) -> Path:
    return path.with_name(f"{path.stem}.run{n}{path.suffix}")


def _keep_aside(paths: list[Path]) -> list[str]:
    """Rename each file to its first free ``.runN`` name (Rule 2); return the new names."""
    kept = []
    for path in paths:
        n = 1
        while _kept_name(path, n).exists():
            n += 1
        path.rename(_kept_name(path, n))
        kept.append(_kept_name(path, n).name)
    return kept


def claim_output_dir(
    output_dir: str, log_path: str, *, overwrite: bool, resume: bool, rank: int = 0
) -> None:
    """Make ``output_dir`` ready for a new run (NOTE [Earlier runs in the output folder]).

    Args:
        output_dir: the run's output folder.
        log_path: this rank's step-record file.
        overwrite: ``--overwrite_output_dir``: remove the earlier run's memfit files.
        resume: ``--resume_from_checkpoint`` was given: keep the earlier records aside.
        rank: this process's rank (rank 0 handles the shared files).

    Raises:
        FlagError: the folder holds an earlier run and neither flag was given.
    """
    earlier = earlier_run(output_dir, log_path)
    if not earlier:
        return
    folder = Path(output_dir)
    log = Path(log_path)
    mine = [log] if log.is_file() else []
    shared = [p for pattern in _SHARED for p in folder.glob(pattern)] if rank == 0 else []
    if overwrite:
        kept_before = list(folder.glob("memfit_steps*.run*.jsonl")) if rank == 0 else []
        for path in mine + shared + kept_before:
            path.unlink(missing_ok=True)
        return
    if resume:
        summaries = [p for p in shared if p.name.startswith("memfit_summary") and ".run" not in p.name]
        moved = [p for p in mine + summaries if p.stat().st_size > 0]
        kept = _keep_aside(moved)
        if kept:
            logger.info("resuming: the earlier run's %s kept as %s", ", ".join(p.name for p in moved), ", ".join(kept))
        return
    shown = ", ".join(earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
    raise FlagError(
        f"--output_dir {output_dir} holds an earlier run ({shown}); pass --resume_from_checkpoint to continue it, "
        "--overwrite_output_dir to replace it, or another --output_dir"
    )
