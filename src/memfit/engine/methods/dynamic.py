"""``dynamic`` and ``static``: plans from the memory model, learnt in a short warm-up and refined online.

# NOTE [Which steps count]
Counting the saved tensors costs a hook call per tensor, and only a step the model learns
from needs it (NOTE [What a step teaches], learner.py): a warm-up step; a step of more tokens
than any counted before, or fewer (outside the range the curves were fitted on, where they
extrapolate); a step whose plan is partial at a length the partial transient does not predict
yet (NOTE [Two transient regimes], model.py: until it does, such a plan's backward start is the
full regime's guess, the gradients and a block too high, and only a counted step teaches it);
the replay of a step that ran out of memory; a step of a bucket whose last
uncounted step peaked above its prediction by more than a quarter of the margin, or below it
by more than 1% of the budget (the allocator's peak, read whatever the step counts, tells
both); and one step in ``COUNT_EVERY``, so that a model that drifts is still seen. Every other
step has a size inside what the model has measured, and its peak says it was predicted right:
it runs with no counting hook. Counting every length not seen before would count nearly every
step of data whose lengths rarely repeat (chat).

# NOTE [A replay treats more]
An OOM grows the margin or the slack and clears the plans, so the replay is planned with less
room; but a model that predicts far too little for the shape (a curve extrapolated below its
samples) plans the same blocks again, and again, however much the margin grows. So a replay
whose plan treats nothing the failed attempt did not runs every block recomputed instead; a
replay of every block recomputed (warm-up's plan included) runs the floor plan, every block
re-run whole on the re-run that keeps least where the run offers one (``floor_treatment``: its
input off the device, then its MLP tiled: ``host_checkpoint_tiled``, ``host_checkpoint``,
``recompute_tiled``) and the LM head, where the run plans one, in the chunk count that keeps least
(not the count a plan without a head runs: NOTE [A plan without a head], chunked_head.py); if that
is still too much and no part beside the blocks has a way that keeps less (``PartKind.leaner``: the
head's leanest implementation, NOTE [Warm-up's head keeps least], chunked_head.py), the budget is too
small (``note_oom`` says so).

# NOTE [Warm-up on the floor]
Warm-up recomputes every block while the probes measure. At the tight end that plan does not fit a
long batch (a recomputed block's MLP, all its tokens at once, over the room), so each warm-up step
ran out of memory once and replayed on the floor: every step of a run of one long length paid a
failed forward. Once warm-up's plan has run out of memory at some number of tokens, later warm-up
steps of at least as many start on the floor plan. The first one does too where the plan cannot fit
by a bound that needs no measurement: every block recomputed keeps every block's input on the
device, ``blocks x tokens x`` the first block's input bytes a token, and the last block's forward
holds besides them its gated MLP's gate and up outputs, ``2 x tokens x`` its intermediate width in
the input's dtype, all beside the static bytes (an 8B model at 64k tokens: 16 + 3.5 GiB beside
15.7 GiB of weights, against a 24 GiB cap; at 32k, 8 + 1.75 GiB) and, under FSDP2, beside the last
block's parameters gathered for it (static bytes are a rank's shards: 0.41 GiB for an 8B block).
Under that bound a warm-up step tries the plan only where it is expected to fit, which a failed
forward would otherwise cost a replay the tight end cannot afford (a 30-step run at the smallest cap
may replay none): where the memory model can predict (it is ready), the plan's predicted peak within
the room, each part beside the blocks at the option the step runs it with (the LM head chunked: NOTE [A
plan without a head]; priced with the head kept, whose float32 logits alone may be over the room, long
warm-up steps ran the floor where every block recomputed fit: docs/devlog.md); before it can, a bound
of what the re-run of one block holds besides the inputs, its kept forward and its backward, which the
probes take to be at most ``PROBE_NEED`` times its input (NOTE [Probing on a cut], probe.py):
``(blocks + PROBE_NEED) x tokens x`` the input's bytes a token beside the static bytes. Where neither says
it fits, that one step runs the floor (docs/devlog.md has the run that needed it). Unlike a failed plan,
this is not remembered: the next warm-up step is judged again, by what the model has
learnt since. A run whose floor is plain recompute is unchanged by it (its floor is this plan).
A warm-up on the floor runs no block recomputed, so the probe measures what a checkpoint keeps
(``Recompute.probe``: the block's input): else the memory model, which needs it, is never ready and
every step of a run of one long length stays in warm-up, probed and counted.
"""

from __future__ import annotations

import numbers

import dataclasses

from collections.abc import Callable
from typing import TYPE_CHECKING

from memfit.engine.plan import learner
from memfit.engine.methods.base import Decision, Method
from memfit.engine.parts.kind import with_untreated
from memfit.engine.parts.probe import PROBE_NEED
from memfit.engine.parts.treatments import RECOMPUTE, floor_treatment
from memfit.engine.plan.planner import Plan
from memfit.engine.run.protection import Backstop, Protection, Unprotected
from memfit.engine.shapes import bucket_key

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planning import Planning
    from memfit.engine.parts.store import ReactiveStore

__all__ = ["Dynamic", "Static", "COUNT_EVERY"]

#: A steady step that teaches nothing new is still counted once in this many (NOTE [Which steps count]).
COUNT_EVERY = 50


class Dynamic(Method):
    """Per shape key, the cheapest plan whose predicted peak fits the budget.

    Args:
        warmup_steps: fewest warm-up steps (run as ``full`` while the probe measures).
        warmup_keys: fewest distinct token counts to see before leaving warm-up, so the
            fit of ``N·T`` and ``N·T²`` is determined; unless ``warmup_steps`` steps in a
            row brought no new token count (the data repeats a few shapes: padded to a
            fixed length, or a few fixed lengths), when waiting for more costs probing
            steps and teaches nothing the counting of a later new shape would not.
        max_warmup_steps: leave warm-up after this many steps even with fewer keys.
        backstop: when a prediction was wrong and a step nears the cap mid-forward, evict
            already-run kept blocks instead of running out of memory; armed only for steps
            longer than any before or predicted within reach of the cap (NOTE [Backstop] in
            protection.py). ``"auto"`` (the default): only on steps that no caller replays
            after an OOM (NOTE [Protection by expected cost]); ``True``: on replayable steps
            too; ``False``: never.

    Raises:
        ValueError: unless ``1 <= warmup_steps <= max_warmup_steps``, or for another ``backstop``.
    """

    name = "dynamic"
    adapts = True
    learns = True
    #: plan a shape's whole row on a miss (NOTE [Planning a row] in planning.py)
    plans_rows = True

    def __init__(
        self, warmup_steps: int = 3, warmup_keys: int = 3, max_warmup_steps: int = 12, backstop: bool | str = "auto",
    ):
        if not 1 <= warmup_steps <= max_warmup_steps:
            raise ValueError("need 1 <= warmup_steps <= max_warmup_steps")
        if backstop not in (True, False, "auto"):
            raise ValueError(f"backstop must be 'auto', True or False, not {backstop!r}")
        self.backstop = backstop
        self.warmup_steps = warmup_steps
        self.warmup_keys = warmup_keys
        self.max_warmup_steps = max_warmup_steps
        self._warm_steps = 0
        self._warm_tokens: set[int] = set()
        self._warm_repeats = 0  # warm-up steps in a row whose token count was seen before
        self._steady = False  # warm-up is over for good (a step's first check is then skipped)
        self._decided = 0
        #: the fewest and most tokens of a counted step so far (NOTE [Which steps count])
        self._counted_range: tuple[int, int] | None = None
        #: buckets whose next step counts: an uncounted step of theirs peaked above its prediction
        self._count_next: set[tuple[int, int]] = set()
        #: the fewest tokens at which warm-up's every-block-recomputed plan ran out of memory (NOTE [Warm-up on the floor])
        self._floor_tokens: int | None = None

    def make_protection(
        self, new_store: Callable[[], "ReactiveStore"], planning: "Planning", meter: object, counter: "SavedTensorCounter",
    ) -> Protection:
        if not self.backstop:
            return Unprotected()
        return Backstop(new_store(), planning, meter, counter, always=self.backstop is True)

    def resume(self) -> None:
        """End warm-up now (the memory model was loaded from a checkpoint)."""
        self._warm_steps = self.max_warmup_steps
        self._steady = False  # checked again against the loaded model

    def in_warmup(self, planning: "Planning") -> bool:
        if not planning.model.ready:
            return True
        if self._warm_steps >= self.max_warmup_steps:
            return False
        if self._warm_steps < self.warmup_steps:
            return True
        return len(self._warm_tokens) < self.warmup_keys and self._warm_repeats < self.warmup_steps

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        self._decided += 1
        bucket, tokens = bucket_key(key, planning.bucket_tokens), key[0] * key[1]
        if not self._steady:
            if self.in_warmup(planning):
                self._warm_steps += 1
                self._warm_repeats = self._warm_repeats + 1 if tokens in self._warm_tokens else 0
                self._warm_tokens.add(tokens)
                self._note_counted(tokens)
                every = Plan(planning.all_blocks)
                if (failed is not None and failed.layout == every.layout) or _inputs_over(planning, tokens):  # NOTE [Warm-up on the floor]
                    self._floor_tokens = min(tokens, self._floor_tokens or tokens)
                on_floor = self._floor_tokens is not None and tokens >= self._floor_tokens
                warm = planning.search.floor(tokens) if on_floor or _may_not_fit(planning, key, every, tokens) else every
                return Decision(_treating_more(planning, warm, failed, tokens), warmup=True, count=True)
            self._steady = True  # the model stays ready and the counts only grow
        low, high = self._counted_range or (tokens, tokens - 1)
        count = (  # NOTE [Which steps count]
            not low <= tokens <= high or failed is not None or bucket in self._count_next
            or self._decided % COUNT_EVERY == 0
        )
        self._count_next.discard(bucket)
        if count:
            self._note_counted(tokens)
        plan = planning.plan_for(self.planning_key(planning, key), whole_row=self.plans_rows)
        if failed is not None and set(plan.blocks) <= set(failed.blocks):
            plan = _treating_more(planning, Plan(planning.all_blocks), failed, tokens)  # NOTE [A replay treats more]
        model = planning.model
        if not count and plan.blocks and (len(plan.blocks) < len(model.groups) or plan.kinds) and not model.partial_predicts(tokens):
            count = True  # NOTE [Which steps count]: it teaches the partial transient
            self._note_counted(tokens)
        return Decision(plan, count=count)

    def _note_counted(self, tokens: int) -> None:
        low, high = self._counted_range or (tokens, tokens)
        self._counted_range = (min(low, tokens), max(high, tokens))

    def learn(self, planning: "Planning", outcome: "StepOutcome") -> int | None:
        planning.apply(learner.learn_optimizer_peak(planning, outcome))
        predicted = planning.predict_peak(outcome.key, outcome.plan) if planning.model.ready else None
        taught = learner.learn_step(planning, outcome, predicted, self.planning_key(planning, outcome.key))
        planning.apply(taught)
        planning.apply(learner.grow_margin(planning, outcome, predicted))
        planning.apply(learner.grow_slack(planning, outcome))
        if not taught.samples:  # an error measured against curves that just changed says nothing
            bias = learner.note_bias(planning, outcome, predicted)
            if not self.plans_rows:  # one shape planned: the others' errors say nothing of it
                bias = dataclasses.replace(bias, run_error=None)
            planning.apply(bias)
        if not outcome.counted and learner.mispredicted(planning, outcome, predicted):
            self._count_next.add(bucket_key(outcome.key, planning.bucket_tokens))
        return predicted


def _inputs_over(planning: "Planning", tokens: int) -> bool:
    """Whether every block's input at ``tokens`` tokens and the last block's MLP run, beside the static bytes, are over
    the budget: every block recomputed cannot fit (NOTE [Warm-up on the floor])."""
    return _held_over(planning, tokens, planning.mlp_bytes_per_token)


def _held_over(planning: "Planning", tokens: int, besides_per_token: float) -> bool:
    """Whether every block's input at ``tokens`` tokens, ``besides_per_token`` bytes a token more and the last block's
    gathered parameters are over the budget beside the static bytes (NOTE [Warm-up on the floor])."""
    budget, per_token = planning.budget_bytes, planning.input_bytes_per_token
    held = (planning.n_blocks * per_token + besides_per_token) * tokens + planning.gathered_block_bytes
    return bool(budget and per_token and planning.static_bytes + held > budget)


def _may_not_fit(planning: "Planning", key: tuple[int, int], every: Plan, tokens: int) -> bool:
    """Whether every block recomputed is not expected to fit at ``key``: predicted over the room where the model is
    ready, else over the budget by the bound of one block's re-run (NOTE [Warm-up on the floor]); never where the
    run's floor is plain recompute."""
    if not planning.budget_bytes or floor_treatment(planning.registry) == RECOMPUTE:
        return False
    if planning.model.ready:
        parts = [*planning.parts.values(), *([planning.weights] if planning.weights.streamable else [])]
        return planning.plan_peak(key, with_untreated(every, parts, tokens)) > planning.room_bytes
    return _held_over(planning, tokens, PROBE_NEED * planning.input_bytes_per_token)


def _treating_more(planning: "Planning", plan: Plan, failed: Plan | None, tokens: int) -> Plan:
    """``plan``, or the floor plan where ``failed`` already was ``plan`` (NOTE [A replay treats more])."""
    if failed is None or failed.layout != plan.layout:
        return plan
    return planning.search.floor(tokens)


class Static(Dynamic):
    """The ``dynamic`` plan of the largest input, applied to every batch.

    Args:
        max_shape: ``(N, T)`` of the largest input, when known (e.g. from the length list of
            the data set). Without it, the largest key seen so far (warm-up included) is
            used, so the plan only ever grows.
        backstop: as for ``dynamic`` (off by default: the largest shape's plan leaves room).
        **kwargs: warm-up settings, as for ``dynamic``.
    """

    name = "static"
    plans_rows = False  # one shape, the largest, is ever planned

    def __init__(self, max_shape: tuple[int, int] | None = None, backstop: bool = False, **kwargs: int):
        super().__init__(backstop=backstop, **kwargs)
        if max_shape and (isinstance(max_shape, (str, bytes)) or len(max_shape) != 2
                          or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in max_shape)):
            raise ValueError(f"max_shape={max_shape!r}: give the largest input's (N, T) as two positive whole numbers, e.g. (8, 512)")
        self.max_shape = tuple(int(v) for v in max_shape) if max_shape else None

    def planning_key(self, planning: "Planning", key: tuple[int, int]) -> tuple[int, int]:
        candidates = [key] + [k for k in (self.max_shape, planning.model.max_key) if k]
        return max(candidates, key=lambda k: (k[0] * k[1], k))
