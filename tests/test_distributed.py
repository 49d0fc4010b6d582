"""memfit under DDP: 2 CPU processes (torchrun, gloo), ranks checkpointing different blocks."""

import json
import os
import subprocess
import sys

import pytest
import torch

import memfit
from _ddp_common import LENGTHS, STEPS, batch, build_model

HERE = os.path.dirname(__file__)


def _budget():
    """A logical budget that rank 1's long inputs exceed without checkpointing, rank 0's do not."""
    model = build_model()
    ctl = memfit.fit(model, budget=None, method="none")
    model(**batch(0, 1, max(LENGTHS[1]))).loss.backward()
    peak_long = ctl.records[-1].peak_allocated_bytes
    model.zero_grad(set_to_none=True)
    model(**batch(0, 0, max(LENGTHS[0]))).loss.backward()
    peak_short = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return (peak_short + peak_long) // 2


@pytest.mark.slow
def test_ddp_two_ranks_match_single_process(tmp_path):
    budget = _budget()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           os.path.join(HERE, "_ddp_worker.py"), str(tmp_path), str(budget)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Per-rank records: each rank planned for its own shapes.
    records = {r: [json.loads(x) for x in open(tmp_path / f"steps.rank{r}.jsonl")] for r in (0, 1)}
    assert all(rec["rank"] == r for r in (0, 1) for rec in records[r])
    steady = [(a["n_checkpointed"], b["n_checkpointed"]) for a, b in zip(records[0], records[1]) if a["phase"] == b["phase"] == "steady"]
    assert steady and all(a == 0 for a, _ in steady) and any(b > 0 for _, b in steady), "the ranks should checkpoint differently"
    assert all(rec["peak_allocated_bytes"] <= budget for r in (0, 1) for rec in records[r])

    # The same global batches in one process: average the two ranks' gradients, then step.
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for rank in (0, 1):
            torch.manual_seed(1000 * step + rank)
            (model(**batch(step, rank, LENGTHS[rank][step])).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    final = torch.load(tmp_path / "final.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_trainer_under_torchrun_writes_per_rank_records(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29518",
           os.path.join(HERE, "_ddp_trainer_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        lines = [json.loads(x) for x in open(tmp_path / f"memfit_steps.rank{rank}.jsonl")]
        assert len(lines) == 4 and {x["rank"] for x in lines} == {rank}
    summary = json.loads((tmp_path / "memfit_summary.json").read_text())
    assert summary["steps"] == 8 and set(summary["per_rank"]) == {"0", "1"}
    assert summary["max_peak_allocated_bytes"] == max(s["max_peak_allocated_bytes"] for s in summary["per_rank"].values())
