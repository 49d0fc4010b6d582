"""The room (engine/room.py): the margin and the allocator's slack, and the only rules that grow them."""

from __future__ import annotations

import pytest

from memfit.engine.room import ALLOCATOR_SLACK_BYTES, MAX_RETRY_SLACK_SHARE, RETRY_SLACK_SHARE, Room


@pytest.mark.parametrize(
    "budget, accounting, share, margin, slack",
    [
        (2**30, "cuda", None, int(0.03 * 2**30), 2**30 // 16),  # a small budget: a sixteenth as slack
        (2**40, "cuda", None, int(0.03 * 2**40), ALLOCATOR_SLACK_BYTES),
        (2**30, "logical", None, int(0.001 * 2**30), 0),  # no allocator, no slack
        (2**30, "cuda", 0.0, 0, 2**30 // 16),  # the caller's margin share
        (None, "cuda", None, 0, 0),  # no budget
    ],
)
def test_a_run_starts_with_its_accountings_room(budget, accounting, share, margin, slack):
    room = Room.for_run(budget, accounting, share)
    assert (room.margin_bytes, room.slack_bytes) == (margin, slack)


def test_each_rule_says_whether_the_room_shrank():
    room = Room(1_000_000, margin_bytes=1000, slack_bytes=0)
    assert room.free_bytes == 999_000
    assert not room.after_miss(500)  # 1.25 x 500 < the margin
    assert room.after_miss(2000) and room.margin_bytes == 2500
    assert not room.after_miss(-10_000)  # over-predicted: the margin stays
    assert room.learn_slack(800) and room.slack_bytes == 1000
    assert not room.learn_slack(800)
    assert room.after_oom(10) and room.margin_bytes == 2500 + 1_000_000 // 20  # the slack explains nothing
    assert room.after_oom(8000) and room.slack_bytes == 10_000
    grown = [room.after_alloc_retries() for _ in range(6)]
    assert room.slack_bytes == int(MAX_RETRY_SLACK_SHARE * 1_000_000) and grown[-1] is False
    assert int(RETRY_SLACK_SHARE * 1_000_000) > 0
    assert not Room(None).after_alloc_retries() and not Room(None).after_oom(10)
