"""A part kind defined here only (memfit.PartKind, fit(parts=...)): measured, priced, planned, recorded,
summarised and reported with nothing in src/ knowing its name (NOTE [A part kind's options] in parts/kind.py)."""

import pytest
import torch

import memfit
from memfit.engine.plan.planner import Plan, plan_with_parts
from memfit.engine.records import StepRecord, part_steps
from memfit.engine.summary_text import end_summary
from memfit.tools.report import build_report

from _models import build_decoder

#: the ballast's float32 copies of the final norm's output per hidden unit (what "squeezed" does not hold)
WIDTH = 48


class Ballast(memfit.PartKind):
    """The final norm, kept: it holds ``WIDTH`` float32 copies of its output for backward (a ballast of
    known bytes, live from after the last block until the backward: NOTE [A part kind's moment]);
    squeezed: it holds none, for a little time."""

    name = "ballast"
    title = "the final norm's ballast"

    def __init__(self, norm: torch.nn.Module, hidden: int):
        self.hidden, self.now, self.applied = hidden, None, []
        self.handle = norm.register_forward_hook(self._hook)

    def _bytes(self, tokens: int) -> int:
        return tokens * self.hidden * WIDTH * 4

    def options(self, tokens):
        return (("keep", 1, 0, 0.0), ("squeezed", 1, self._bytes(tokens), 0.01))

    def apply(self, option):
        self.now = option
        self.applied.append(option)

    def _hook(self, module, args, out):
        if self.now is not None and self.now[0] == "squeezed" or not torch.is_grad_enabled():
            return out
        ballast = out.float().unsqueeze(-1).expand(*out.shape, WIDTH).contiguous()
        return out + (ballast * ballast).sum(-1).to(out.dtype) * 0


def _run(budget, method, lengths, log=None):
    torch.manual_seed(0)
    model, batch = build_decoder("llama")
    model.train()
    part = Ballast(model.model.norm, model.config.hidden_size)
    ctl = memfit.fit(model, budget=budget, method=method, parts=[part], head=False, announce=False, log=log)
    for length in lengths:
        inputs = batch(2, length)
        ctl.run_step(lambda: model(**inputs).loss.backward())
        model.zero_grad(set_to_none=True)
    records = list(ctl.records)
    ctl.remove()
    part.handle.remove()
    return records, part


def test_the_planner_takes_a_parts_options_beside_the_blocks():
    blocks = [[("recompute", 100, 10.0)]] * 2
    squeeze = [("keep", 1, 0, 0.0), ("squeezed", 1, 150, 1.0)]
    for need, option, n_blocks in [(0, "keep", 0), (50, "squeezed", 0), (150, "squeezed", 0), (250, "squeezed", 1), (350, "squeezed", 2)]:
        plan = plan_with_parts(blocks, [("ballast", squeeze)], need)
        assert (plan.parts, len(plan.blocks)) == ((("ballast", option, 1),), n_blocks), need
    assert Plan((), parts=[("ballast", "squeezed", 1)]).part_labels() == {"ballast": "squeezed:1"}


def test_a_part_kind_of_the_tests_is_planned_recorded_summarised_and_reported(tmp_path):
    lengths = [48] * 10
    free, _ = _run(None, "full", lengths[:3])
    assert all(r.parts == {"ballast": ("keep", 1)} for r in free)  # a plan without the part runs it untreated
    ballast = 2 * 48 * 32 * WIDTH * 4
    # every block recomputed, the part kept: over the budget by half the ballast; squeezed, it fits
    budget = max(r.peak_allocated_bytes for r in free) - ballast // 2
    log = tmp_path / "run" / "memfit_steps.jsonl"
    records, part = _run(budget, "dynamic", lengths, log=str(log))
    steady = [r for r in records if r.phase == "steady"]
    assert steady and all(r.treatments["ballast"] == "squeezed:1" for r in steady), [r.treatments for r in records]
    assert ("squeezed", 1) in part.applied
    assert all(r.peak_allocated_bytes <= budget for r in steady), [(r.peak_allocated_bytes, budget) for r in steady]
    # the records read back from JSONL hold it; the summary line and the report's table name it
    # warm-up's steps too, where every block recomputed with the part kept is not expected to fit (NOTE [Warm-up on
    # the floor]: the floor squeezes it): no step over the budget, warm-up's included
    squeezed = [r for r in records if r.treatments["ballast"] == "squeezed:1"]
    assert len(squeezed) == len(records) > len(steady), [r.treatments for r in records]
    assert all(r.peak_allocated_bytes <= budget for r in records), [(r.peak_allocated_bytes, budget) for r in records]
    again = [StepRecord.from_dict(r.to_dict()) for r in records]
    assert part_steps(again)["ballast"]["squeezed:1"] == len(squeezed)
    summary = end_summary(records)  # said by the title its class gives (PartKind.title)
    assert f"memfit: the final norm's ballast squeezed on {len(squeezed)} micro-steps" in summary, summary
    from memfit.tools import report as report_module

    figures = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_module, "_save", lambda fig, path: figures.append(fig))
        markdown = build_report(tmp_path / "run", tmp_path / "out").read_text()
    assert "ballast (micro-steps)" in markdown and f"squeezed:1 ×{len(steady)}" in markdown, markdown  # steady steps
    (mix,) = [f for f in figures if "Treatment mix" in f.get_suptitle()]  # its line in the treatment plot
    assert "the final norm's ballast squeezed" in {t.get_text() for legend in mix.legends for t in legend.get_texts()}


def test_a_part_kind_needs_a_name_of_its_own():
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="needs a name of its own"):
        memfit.fit(model, budget=None, parts=[Ballast(model.model.norm, 32), Ballast(model.model.norm, 32)], announce=False)
    with pytest.raises(TypeError, match="must be a memfit.PartKind"):
        memfit.fit(model, budget=None, parts=[object()], announce=False)


def test_a_part_priced_anew_has_planning_drop_its_cached_plans_itself():
    """NOTE [Parts priced anew]: a part counts its new prices in ``priced``; the next plan asked for is made anew (a
    miss), with no part calling into Planning's cache; a plan asked again with nothing priced anew is a hit."""
    from memfit.engine.plan.planning import Planning
    from test_model import _model

    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000

    class Priced(memfit.PartKind):
        name, priced = "priced", 0

        def options(self, tokens):
            return (("keep", 1, 0, 0.0), ("thin", 1, 1000 * tokens, 0.01 + self.priced))

        def apply(self, option):
            pass

    part = Priced()
    planning.add_part(part)
    key = (4, 60)
    planning.plan_for(key)
    misses = planning.cache.misses
    planning.plan_for(key)
    assert planning.cache.misses == misses  # cached
    part.priced += 1
    planning.plan_for(key)
    assert planning.cache.misses == misses + 1  # made anew
    planning.plan_for(key)
    assert planning.cache.misses == misses + 1


def test_the_lm_head_is_a_part_kind():
    """The LM head is planned as a part kind like a user's (parts/kind.py): its name is the records' key."""
    from memfit.engine.parts.treatments.chunked_head import HeadPart
    from memfit.engine.parts.head import HEAD_KEY

    assert issubclass(HeadPart, memfit.PartKind) and HeadPart.name == HEAD_KEY == "head"


def test_a_step_no_plan_fits_names_each_parts_own_bytes_in_its_warning(caplog):
    """NOTE [The head's bytes in a budget error]: where no plan fits, the warning names each part beside the blocks at
    its most saving option in the part's own words (``PartKind.budget_share``; the head's are its chunk count and
    sizes), counts its bytes apart from the rest outside the blocks, and the plan run has the part at its most."""
    import logging

    from memfit.engine.plan.planning import Planning
    from test_model import _model

    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 2_000_000  # over the budget by itself: nothing fits

    class Sized(memfit.PartKind):
        name = "sized"

        def options(self, tokens):
            return (("keep", 1, 0, 0.0), ("thin", 1, 10 * tokens, 0.01))

        def apply(self, option):
            pass

        def budget_share(self, tokens, size):
            return 12 * tokens, 2 * tokens, f"the sized part thin ({size(2 * tokens)})"

    planning.add_part(Sized())
    with caplog.at_level(logging.WARNING, logger="memfit"):
        plan = planning.plan_for((4, 60))
    said = [r.getMessage() for r in caplog.records if "predicted to need" in r.getMessage()]
    assert len(said) == 1 and "even with every block checkpointed and the sized part thin (480 B)" in said[0], said
    assert "most of it is the static part" in said[0]
    assert plan.option("sized") == ("thin", 1) and plan.blocks == (0, 1, 2, 3)


class StepBallast(memfit.PartKind):
    """A part held at the optimizer step (NOTE [A part kind's moment]): a pre-hook on the step allocates ``nbytes`` of
    ballast, and ``"light"`` a quarter of it. Defined here only."""

    name = "step_ballast"
    moment = memfit.engine.parts.kind.OPTIMIZER_STEP

    def __init__(self, optimizer, nbytes):
        self.nbytes, self.now, self.held = nbytes, None, []
        optimizer.register_step_pre_hook(lambda *_: self.held.append(torch.empty(self.bytes_now() // 4)))
        optimizer.register_step_post_hook(lambda *_: self.held.clear())

    def bytes_now(self):
        return self.nbytes // 4 if self.now is not None and self.now[0] == "light" else self.nbytes

    def options(self, tokens):
        return (("keep", 1, 0, 0.0), ("light", 1, self.nbytes - self.nbytes // 4, 0.01))

    def moment_bytes(self):
        return self.nbytes

    def apply(self, option):
        self.now = option


def test_a_part_of_the_tests_held_at_the_optimizer_step_is_chosen_by_the_room_recorded_and_summarised():
    """A part kind held at the optimizer step's moment, defined here only: kept where its bytes fit the room above
    static, light where only that fits; recorded under its name each step and named by the summary line."""
    from memfit.engine.summary_text import end_summary

    def run(budget):
        torch.manual_seed(0)
        model, batch = build_decoder("llama")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        part = StepBallast(opt, 64 * 2**20)
        ctl = memfit.fit(model, budget=budget, optimizer=opt, parts=[part], head=False, announce=False)
        for _ in range(3):
            inputs = batch(2, 32)
            ctl.run_step(lambda: model(**inputs).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
        records = list(ctl.records)
        ctl.remove()
        return records

    roomy = run("4GB")
    assert [r.parts.get("step_ballast") for r in roomy] == [("keep", 1)] * 3
    tight = run(int(max(r.peak_allocated_bytes for r in roomy) + 40 * 2**20))  # 64 MiB do not fit, 16 MiB do
    assert [r.parts.get("step_ballast") for r in tight] == [("light", 1)] * 3
    assert "part step_ballast light on 3 micro-steps" in end_summary(tight, None, 3)
