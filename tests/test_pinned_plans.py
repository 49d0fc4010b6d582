"""The engine's plans and predictions on fixed CPU streams equal those pinned in the fixture.

``tests/fixtures/pinned_plans.json`` was written by ``tests/_pinned_streams.py``; any change of
the engine that alters a plan, a prediction, a counted peak, an eviction or the backstop's
arming on these streams (logical budgets; BERT, Llama and T5 stacks, a mixed Swin stack;
``dynamic`` with and without the backstop, ``static``, ``reactive``) fails here.
"""

import json

import pytest

from _pinned_streams import FIELDS, FIXTURE, STREAMS, run_stream

PINNED = json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_stream_plans_and_predictions_are_pinned(name):
    got = run_stream(name)
    want = PINNED[name]
    assert got["budget_bytes"] == want["budget_bytes"]
    assert len(got["steps"]) == len(want["steps"])
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"]), 1):
        assert {f: g[f] for f in FIELDS} == {f: w[f] for f in FIELDS}, f"{name} step {step}"
