"""An output folder that holds an earlier run: refused, replaced, or resumed (NOTE [Earlier runs in
the output folder] in memfit/integrations/run_dir.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.errors import FlagError
from memfit.integrations.run_dir import claim_output_dir, earlier_run


def _earlier(folder: Path) -> None:
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "memfit_steps.jsonl").write_text('{"step": 1}\n')
    (folder / "memfit_summary.json").write_text("{}")
    (folder / "memfit_plans.json").write_text("{}")
    (folder / "train_results.json").write_text("{}")


def test_a_fresh_or_empty_folder_is_free(tmp_path):
    claim_output_dir(str(tmp_path / "new"), str(tmp_path / "new" / "memfit_steps.jsonl"), overwrite=False, resume=False)
    (tmp_path / "memfit_steps.jsonl").write_text("")  # an eval-only run's empty record file is no run
    assert earlier_run(str(tmp_path), str(tmp_path / "memfit_steps.jsonl")) == []


def test_an_earlier_run_is_refused_and_left_alone(tmp_path):
    _earlier(tmp_path)
    with pytest.raises(FlagError, match=r"holds an earlier run \(checkpoint-2, memfit_steps\.jsonl, memfit_summary\.json\)"):
        claim_output_dir(str(tmp_path), str(tmp_path / "memfit_steps.jsonl"), overwrite=False, resume=False)
    assert (tmp_path / "memfit_steps.jsonl").read_text() == '{"step": 1}\n'


def test_a_record_file_elsewhere_counts(tmp_path):
    log = tmp_path / "logs" / "steps.jsonl"
    log.parent.mkdir()
    log.write_text('{"step": 1}\n')
    with pytest.raises(FlagError, match="steps.jsonl"):
        claim_output_dir(str(tmp_path / "out"), str(log), overwrite=False, resume=False)


def test_overwrite_removes_memfit_files_and_keeps_checkpoints(tmp_path):
    _earlier(tmp_path)
    claim_output_dir(str(tmp_path), str(tmp_path / "memfit_steps.jsonl"), overwrite=True, resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "train_results.json"]


def test_resume_keeps_each_earlier_run_under_a_new_name(tmp_path):
    _earlier(tmp_path)
    log = str(tmp_path / "memfit_steps.jsonl")
    claim_output_dir(str(tmp_path), log, overwrite=False, resume=True)
    assert (tmp_path / "memfit_steps.run1.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "memfit_summary.run1.json").exists() and not (tmp_path / "memfit_steps.jsonl").exists()
    (tmp_path / "memfit_steps.jsonl").write_text('{"step": 2}\n')  # the resumed run's records
    claim_output_dir(str(tmp_path), log, overwrite=False, resume=True)
    assert (tmp_path / "memfit_steps.run2.jsonl").read_text() == '{"step": 2}\n'


def test_only_rank_zero_touches_the_shared_files(tmp_path):
    _earlier(tmp_path)
    rank1 = tmp_path / "memfit_steps.rank1.jsonl"
    rank1.write_text('{"step": 1}\n')
    claim_output_dir(str(tmp_path), str(rank1), overwrite=True, resume=False, rank=1)
    assert not rank1.exists() and (tmp_path / "memfit_summary.json").exists()
