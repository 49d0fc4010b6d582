"""The search for one shape's plan: the cheapest treatment of every block and one option of each part beside
them whose predicted peaks fit the room (``Search``, one per ``Planning``, which asks it on a cache miss).

It reads the run's planning through its public face (the memory model, the room, the static bytes of a shape,
the registry and the parts) and writes nothing of it but the plan cache's rows (``PlanCache.put_row``) and, while
it plans a shape, the model's evaluator of that shape (NOTE [A search reads the curves once], model.py); what it
keeps of its own is the shapes already said not to fit. Planning caches, learns and keeps the room; the search
only plans (NOTE [Three peaks], model.py; NOTE [Treatments never lose]); a row of
shapes at once is rows.py's (NOTE [Planning a row]).

# NOTE [Planning with the stashes back]
The ``depth + 1`` stashes of offloaded blocks that backward brings back at once (NOTE [Treated
peaks], model.py) are not in the knapsack's savings: offloading ``depth + 1`` blocks or fewer
saves nothing at the backward's start. A mix over the room asks again for what it saved and
what it is over by; each ask offloads at least as many blocks as the first more, until the
stashes back are paid for, so a run asks up to ``depth + 2`` times (3 at least, for the other
peaks). A mix that never fits is None: the caller keeps its recompute plan, never a last
resort while keeping blocks fits.

# NOTE [Leaner re-runs]
A treatment may keep what another keeps at the backward's start and re-run leaner (``keeps_as``:
``recompute_tiled`` keeps as ``recompute`` does, its re-run holding one chunk of the MLP's
intermediates, NOTE [Tiled MLP]). The knapsack, which sees savings at the backward's start only,
never picks the dearer twin; so a mix whose re-run peak is what is over the room is asked again
with every treated block's twin swapped in (its price the twins' difference), and kept if that
fits while the next asks look for a mix that saves more and still costs less than it: the
cheapest that fits of those the asks saw is the plan (the cheaper twins kept, never a dearer
one after them). Where recompute alone fits nothing, a mix that fits this way is the plan (never every block
recomputed over the room, which would only run out of memory and replay).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from memfit.engine.plan.model import ShapePeaks, spread
from memfit.engine.plan.planner import (InfeasiblePlanError, Knapsack, Plan, every_block_rerun, on_base, plan_blocks,
                                        with_leaner_reruns)
from memfit.engine.parts.treatments import OFFLOAD, RECOMPUTE, floor_treatment
from memfit.engine.summary_text import over_budget_words

__all__ = ["Search", "UNFIT_MS", "MAX_KEPT"]

logger = logging.getLogger("memfit")

#: the price of a shape where nothing fits, before the bytes over the room (NOTE [The plans choose the implementation])
UNFIT_MS = 1e12
#: the most entries a per-shape or per-plan record of the planning's holds (a long run's shapes are not bounded)
MAX_KEPT = 4096


def _spread(planning: Any, k: tuple[int, int], options: list[list[tuple[str, int, float]]],
            need: int) -> tuple[Plan, list[list[tuple[str, int, float]]]] | None:
    """The offloaded blocks whose copies the compute hides (NOTE [Spread stashes], model.py), the fewest of them from
    the bottom up that save ``need`` or all, at the link's fixed price each, and the other blocks' options (none for
    those); None where the run offers no ``offload`` or the forward hides no copy."""
    if need <= 0 or OFFLOAD not in planning.treatments:
        return None
    saving = {i: o[1] for i, opts in enumerate(options) for o in opts if o[0] == OFFLOAD and o[1] > 0}
    chosen, saved = [], 0
    for i in spread(planning.model, k, OFFLOAD):
        if saved >= need:
            break
        if i in saving:
            chosen.append(i)
            saved += saving[i]
    if not chosen:
        return None
    forced = Plan(tuple(chosen), float(getattr(planning.model.link, "fixed_ms", 0.0)) * len(chosen), saved,
                  kinds=(OFFLOAD,) * len(chosen))
    return forced, [[] if i in chosen else opts for i, opts in enumerate(options)]


def _weights(search: "Search", k: tuple[int, int]) -> tuple[str, int, int, float] | None:
    """The option of the blocks' frozen weights ``k``'s plan is made with (None: kept on the device).

    # NOTE [The weights' room]
    The weights part (NOTE [Weights on the host], parts/host_weights.py) saves the same bytes at
    every moment of the step: an option is room that every plan of the blocks and the other parts
    is made in. So each of its few options (a share of the stack, from the bottom up) is tried as
    :meth:`Search.cost_with_room` plans with that much more room, at its price beside what the plan
    then costs, and the cheapest sum wins, keeping the weights on a tie; an option priced above the
    cheapest sum so far is not planned. Where no option fits, the one that saves most (the floor's).
    """
    part, model = search.planning.weights, search.planning.model
    if not part.streamable or not model.ready or search.planning.budget_bytes is None:
        return None
    forward = model.costs(k)
    best_ms, best = search.cost_with_room(k) + part.back_ms(0, forward), None  # NOTE [Bringing the weights back]
    if best_ms <= 0:
        return None
    options = [(*o[:3], o[3] + part.back_ms(o[1], forward)) for o in part.priced(forward)]
    for option in options:
        if option[2] > 0 and option[3] < best_ms and (ms := option[3] + search.cost_with_room(k, option[2])) < 0.999 * best_ms:
            best_ms, best = ms, option
    if best is None and math.isinf(best_ms) and options:
        best = max(options, key=lambda option: option[2])
    return best


def _with_weights(search: "Search", k: tuple[int, int], plan: Callable[[], Plan]) -> Plan:
    """``plan()`` made in the room the weights' option for ``k`` adds, with that option and its price (NOTE [The weights'
    room])."""
    weights = _weights(search, k)
    search._extra_room = weights[2] if weights else 0
    try:
        made = plan()
    finally:
        search._extra_room = 0
    part = search.planning.weights
    if not part.streamable or made.option(part.name) is not None:
        return made
    if not weights:  # named, so the run keeps them (a plan naming none runs the last one's: HostWeights.untreated)
        return made.with_option(part.name, ("keep", 1))
    return Plan(made.blocks, made.cost_ms + weights[3], made.saved_bytes, made.kinds, made.parts).with_option(part.name, weights[:2])


class Search:
    """The plan of one shape for a run's ``planning`` (a :class:`~memfit.engine.plan.planning.Planning`, not imported:
    planning.py imports this module), read through its public attributes (the module's docstring).

    Attributes:
        infeasible_keys: shapes already said not to fit (at most :data:`MAX_KEPT`).
        optimizer_said: an optimizer step over the budget whatever the plan has been said.
    """

    def __init__(self, planning: Any):
        self.planning, self.optimizer_said = planning, False
        self.infeasible_keys: set[tuple[int, int]] = set()
        #: bytes added to the room while :meth:`cost_with_room` plans (0 otherwise)
        self._extra_room = 0

    def _room(self) -> int:
        """The room the search plans in: the planning's, and what :meth:`cost_with_room` adds while it asks."""
        return self.planning.room_bytes + self._extra_room

    def cost_with_room(self, k: tuple[int, int], extra_bytes: int = 0) -> float:
        """What ``k``'s cheapest plan would cost (ms) were the room ``extra_bytes`` larger: every treatment and part the
        run offers, as :meth:`plan` chooses, with nothing said; infinite where no plan would fit (the floor would run).
        What an over-predicted step is judged by (NOTE [What a step teaches], learner.py)."""
        planning, before = self.planning, self._extra_room
        self._extra_room = before + int(extra_bytes)
        try:
            with ShapePeaks(planning.model, k):
                plan = self._parts_mix(k) if planning.parts else self._blocks_plan(k, quiet=True)
        finally:
            self._extra_room = before
        if plan is None:
            return float("inf")
        unpriced = plan.blocks == planning.all_blocks and not plan.cost_ms and not plan.kinds  # the mend's every block
        return float(sum(planning.model.costs(k)) if unpriced else plan.cost_ms)

    def plan(self, k: tuple[int, int]) -> Plan:
        """``k``'s plan (:meth:`parts_plan` where the run has parts beside the blocks, else recompute alone or a cheaper
        mix: NOTE [Treatments never lose]); an optimizer step over the budget whatever the plan is said once."""
        planning = self.planning
        with ShapePeaks(planning.model, k):  # NOTE [A search reads the curves once], model.py
            plan = _with_weights(self, k, lambda: self.parts_plan(k) if planning.parts else self._blocks_plan(k))
            peak = planning.predict_peak(k, plan)  # NOTE [A plan fits what it decides]
        if not self.optimizer_said and peak > planning.budget_bytes >= planning.plan_peak(k, plan):
            self.optimizer_said = True
            logger.warning("memfit: the optimizer step is predicted at %s, over the budget of %s, whatever the blocks' "
                           "plan (their peaks fit); a smaller optimizer state (--optim adafactor or adamw_bnb_8bit) or LoRA "
                           "would fit it", planning.budget.size(peak), planning.budget)
        return plan

    def _blocks_plan(self, k: tuple[int, int], quiet: bool = False) -> Plan | None:
        """``k``'s plan of the blocks alone; where none fits, the floor, said once (``quiet``: None, nothing said)."""
        planning = self.planning
        mixes = not (planning.recompute_only or not planning.model.ready)
        plan = self.recompute_plan(k, warn=not (mixes or quiet))
        mixed = self.mixed_plan(k) if mixes else None
        if plan is None or mixed is None:  # where recompute alone fits nothing, a mix that fits wins (NOTE [Leaner re-runs])
            return plan or mixed or (None if quiet else self.recompute_plan(k, warn=True))
        base_ms = plan.cost_ms if plan.blocks != planning.all_blocks or plan.cost_ms else sum(planning.model.costs(k))
        return mixed if mixed.cost_ms < 0.999 * base_ms else plan

    def _infeasible_log(self, k: tuple[int, int]) -> Callable[..., None] | None:
        """How to say that no plan fits ``k``: the run's first such shape at warning, later ones at debug, and a
        shape said before not again (None) (NOTE [What to change when a step cannot fit], summary_text.py)."""
        if k in self.infeasible_keys:
            return None
        log = logger.debug if self.infeasible_keys else logger.warning
        self.infeasible_keys = (self.infeasible_keys if len(self.infeasible_keys) < MAX_KEPT else set()) | {k}  # bounded
        return log


    def recompute_plan(self, k: tuple[int, int], warn: bool = True) -> Plan | None:
        planning = self.planning
        # Treating blocks lowers the start-of-backward peak only; the plan is then checked
        # against the other two (NOTE [Three peaks], model.py), and mended if one is over
        # (NOTE [Blocks held below a recompute]). Where none fits: every block, said once (``warn``), or None.
        room = self._room()
        need = int(planning.static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
        try:
            costs, savings = planning.model.costs(k), planning.model.savings(k)
            plan = plan_blocks(costs, savings, need)
            if not plan.blocks or planning.plan_peak(k, plan) <= room:
                return plan
            if planning.plan_peak(k, Plan(planning.all_blocks)) > room:
                raise InfeasiblePlanError("the recompute or optimizer-step peak is over the budget")
            return self._mend(k, plan, need, costs, savings)
        except InfeasiblePlanError:
            if not warn:
                return None
            most = self.floor(k[0] * k[1])
            peak_bytes = planning.plan_peak(k, most)  # NOTE [Over the room, not the budget]
            log = self._infeasible_log(k) if peak_bytes > planning.budget_bytes else None
            if log is not None:
                outside = planning.model.outside(k) if planning.model.ready else 0.0
                parts = {"static": planning.static_bytes - planning.weights.most_saved, "outside": outside, "blocks": planning.model.step_bytes(k, most) - outside}
                log("memfit: shape %s is predicted to need %s even with every block checkpointed, over the budget of %s; "
                    "running it with every block checkpointed; %s", k, planning.budget.size(peak_bytes), planning.budget,
                    over_budget_words(parts, planning.budget))
            return most

    def mixed_plan(self, k: tuple[int, int]) -> Plan | None:
        """# NOTE [Treatments never lose]
        The cheapest mix of treatments that saves what is needed at the start of backward, if
        it also fits the other two peaks (NOTE [Treated peaks], model.py); else None. It is
        taken only when its predicted price is under the recompute-only plan's, which is
        always made too: a mix never costs more than recompute alone would.
        """
        planning = self.planning
        room = self._room()
        need = int(planning.static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
        options = planning.model.options(k, planning.treatments, planning.offload_ms)
        if need <= 0 or all(name == "recompute" for opts in options for name, _, _ in opts):
            return None
        plan = self._mix_that_fits(k, options, need, room)
        hidden = _spread(planning, k, options, need)
        if hidden is not None:  # NOTE [Spread stashes], model.py
            mixed = self._mix_that_fits(k, hidden[1], need - hidden[0].saved_bytes, room, forced=hidden[0])
            if mixed is not None and (plan is None or mixed.cost_ms < plan.cost_ms - 0.001 * abs(plan.cost_ms)):
                plan = mixed
        return plan

    def _mend(self, k: tuple[int, int], plan: Plan, need: int, costs: list[float], savings: list[int]) -> Plan:
        """A plan whose recompute peak is over the room, mended.

        # NOTE [Blocks held below a recompute]
        While backward recomputes a checkpointed block, every kept block below it still holds
        its activations. The cheapest set of blocks can leave such blocks (the largest layers
        of a Swin stack, under checkpointed later ones), and the recompute then peaks over
        the room. Such a plan is mended, not replaced by every block: the cheaper of the plan
        with every block under its topmost one added, and the shortest run of first blocks
        that saves enough; both hold nothing below a recompute.
        """
        planning = self.planning
        room = self._room()
        below = tuple(range(max(plan.blocks) + 1))  # the plan and every block under it
        covered = itertools.accumulate(savings)
        prefix = tuple(range(next(i for i, total in enumerate(covered, 1) if total >= need)))
        mended = [p for p in {below, prefix} if planning.plan_peak(k, Plan(p)) <= room]
        if not mended:
            return Plan(planning.all_blocks)
        best = min(mended, key=lambda p: (sum(costs[i] for i in p), p))
        return Plan(best, float(sum(costs[i] for i in best)), int(sum(savings[i] for i in best)))

    # ---------------------------------------------------------------- the slack's price (NOTE [The slack is priced], room.py)

    def growth_ms_per_step(self) -> float:
        """What a growth of the slack adds to a step's plan, the mean over the latest steady steps'
        shapes (NOTE [The slack is priced], room.py)."""
        planning = self.planning
        shapes = [planning.planned_shape(key) for key, _ in planning.room.times.recent]
        priced = {shape: self.slack_cost_ms(shape, planning.room.slack_step_bytes) for shape in set(shapes)}
        return sum(priced[shape] for shape in shapes) / len(shapes) if shapes else 0.0

    def slack_cost_ms(self, key: tuple[int, int], extra_bytes: int) -> float:
        """What ``key``'s recompute plan would cost more were the room ``extra_bytes`` smaller
        (infinite where it could not fit; 0 before the model is fitted or without a budget)."""
        planning = self.planning
        if not planning.model.ready or planning.budget_bytes is None:
            return 0.0
        k = planning.planned_shape(key)
        need = int(planning.static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - planning.room_bytes
        costs, savings = planning.model.costs(k), planning.model.savings(k)
        try:
            now = plan_blocks(costs, savings, need).cost_ms if need > 0 else 0.0
            smaller = plan_blocks(costs, savings, need + extra_bytes).cost_ms if need + extra_bytes > 0 else 0.0
        except InfeasiblePlanError:
            return float("inf")
        return float(smaller - now)

    # ---------------------------------------------------------------- parts beside the blocks (NOTE [Parts beside the blocks], planner.py)

    def parts_plan(self, k: tuple[int, int]) -> Plan:
        """``k``'s plan with the parts beside the blocks (NOTE [Parts beside the blocks], planner.py; the LM
        head: NOTE [The head in the plan]): the cheapest mix of the blocks' treatments and one option per
        part that saves what the backward's start needs and fits all three peaks (NOTE [Planning with the
        stashes back]), a mix with other treatments than recompute only where it is cheaper (NOTE
        [Treatments never lose]); else, where nothing fits, every block recomputed, each part at its most."""
        planning = self.planning
        if planning.model.ready and planning.budget_bytes is not None:  # NOTE [The plans choose the implementation]
            seen = planning.model.max_key
            longest = k if seen is None or k[0] * k[1] >= seen[0] * seen[1] else tuple(seen)
            for part in list(planning.parts.values()):
                part.choose_by_plans(lambda key: self._parts_plan_ms(planning.planned_shape(key)), longest,
                                     shape=planning.planned_shape)
        plan = self._parts_mix(k)
        if plan is not None:
            return plan
        most = self.floor(k[0] * k[1])
        # NOTE [Over the room, not the budget]
        # Where no plan fits the room (the budget less its margins), the floor runs. It is said to need more than the
        # budget only where its predicted peak is over the budget itself: a floor predicted inside the budget's margins
        # may well fit (a 65,536-token step predicted at 23.2 GiB, margins 2 GiB, ran at 22.2 GiB of a 24 GiB cap).
        log = self._infeasible_log(k) if planning.plan_peak(k, most) > planning.budget_bytes else None
        if log is not None:
            peak = planning.budget.size(planning.plan_peak(k, most))
            # each part's bytes from its own formula, known before the model is (NOTE [The head's bytes in a budget error])
            shares = {kind: share for kind, part in planning.parts.items()
                      if (share := part.budget_share(k[0] * k[1], planning.budget.size)) is not None}
            kept, least = sum(s[0] for s in shares.values()), sum(s[1] for s in shares.values())
            outside = max(0.0, planning.model.outside(k) - kept) if planning.model.ready else 0.0
            blocks = max(0.0, planning.model.step_bytes(k, most) - outside - least) if planning.model.ready else 0.0
            # each part at its most saving, as the floor runs it: the kept bytes are not in the peak said
            parts = {"static": planning.static_bytes - planning.weights.most_saved, **{kind: s[1] for kind, s in shares.items()},
                     "outside-not-parts" if shares else "outside": outside, "blocks": blocks}
            at_most = " and ".join(s[2] for s in shares.values()) or "every part beside the blocks at its most saving"
            log("memfit: shape %s is predicted to need %s even with every block checkpointed and %s, over the budget of %s; %s",
                k, peak, at_most, planning.budget, over_budget_words(parts, planning.budget))
        return most

    def _parts_mix(self, k: tuple[int, int]) -> Plan | None:
        """``k``'s cheapest mix of block treatments and one option per part that fits (:meth:`parts_plan`), or None."""
        planning = self.planning
        room = self._room()
        need = int(planning.static_for(k) + planning.model.backward_start_bytes(k, Plan(()))) - room
        parts = [(kind, part.options(k[0] * k[1])) for kind, part in planning.parts.items()]
        options = planning.model.options(k, planning.treatments, planning.offload_ms)
        # NOTE [Treatments never lose]: the mix only where it fits and is cheaper than recompute alone
        plan = self._mix_that_fits(k, [[o for o in opts if o[0] == RECOMPUTE] for opts in options], need, room, parts)
        # NOTE [Every block re-run], planner.py; and the blocks whose copies the compute hides: NOTE [Spread stashes], model.py
        asks = [] if planning.recompute_only else [(options, need, every, None) for every in (False, True)]
        if asks and (hidden := _spread(planning, k, options, need)) is not None:
            asks.append((hidden[1], need - hidden[0].saved_bytes, False, hidden[0]))
        for opts, needed, every, forced in asks:
            mixed = self._mix_that_fits(k, opts, needed, room, parts, every, below=plan.cost_ms if plan else math.inf,
                                        forced=forced)
            # a tenth of a percent cheaper, of a cost that may be below 0 (a head priced faster chunked: NOTE [Pricing the head])
            if mixed is not None and (plan is None or mixed.cost_ms < plan.cost_ms - 0.001 * abs(plan.cost_ms)):
                plan = mixed
        return plan

    def _parts_plan_ms(self, k: tuple[int, int]) -> float:
        """The ms of ``k``'s cheapest plan with the parts as priced now (NOTE [The plans choose the
        implementation], chunked_head.py); where nothing fits, :data:`UNFIT_MS` plus the bytes the most
        any plan saves leaves over the room, so the head that holds less is the cheaper there too."""
        planning = self.planning
        plan = self._parts_mix(k)
        if plan is not None:
            return float(plan.cost_ms)
        return UNFIT_MS + max(0.0, float(planning.plan_peak(k, self.floor(k[0] * k[1])) - self._room()))

    def floor(self, tokens: int) -> Plan:
        """The plan that keeps least, what runs where no plan is predicted to fit: every block on the run's floor treatment
        (the re-run that keeps least it offers: NOTE [A replay treats more], methods/dynamic.py; plain ``recompute`` where it
        offers no other), each part beside the blocks at its option that saves most at ``tokens`` tokens."""
        planning = self.planning
        floor = floor_treatment(planning.registry)
        parts = [(kind, *part.most(tokens)) for kind, part in planning.parts.items()]
        if planning.weights.streamable:  # NOTE [The weights' room]
            parts.append((planning.weights.name, *planning.weights.most(tokens)))
        return Plan(planning.all_blocks, kinds=() if floor == RECOMPUTE else (floor,) * planning.n_blocks, parts=parts)

    def _mix_that_fits(self, k: tuple[int, int], options: list[list[tuple[str, int, float]]], need: int, room: int,
                       parts: Sequence[tuple[str, Sequence[tuple[str, int, int, float]]]] = (), every: bool = False,
                       below: float = math.inf, forced: Plan | None = None) -> Plan | None:
        """The cheapest mix saving ``need`` bytes (with one of each part's options, ``(kind, options)``, for the parts
        beside the blocks) whose predicted peak fits ``room``, or None (NOTE [Planning with the stashes back], NOTE
        [Leaner re-runs]); with ``every``, of the mixes that re-run every block (NOTE [Every block re-run]), None
        where none of them can cost less than ``below``; with ``forced``, each mix with those blocks' treatments too
        (``options`` offers them nothing: NOTE [Spread stashes], model.py)."""
        planning = self.planning
        order = {name: t.order for name, t in planning.registry.items()}
        leaner = {t.keeps_as: name for name, t in planning.registry.items() if t.keeps_as and name in planning.treatments}
        found = every_block_rerun(options, lambda name: planning.registry[name].reruns) if every else (None, options)
        if found is None:
            return None
        bases, steps = found
        if bases is not None and sum(b[2] for b in bases) + sum(min(0.0, *(o[3] for o in opts)) for _, opts in parts if opts) >= below:
            return None  # every block at its cheapest re-run costs more already
        if bases is not None:  # what the steps up save: the every-block plan's own overshoot, not the kept stack's
            need = int(planning.plan_peak(k, on_base(Plan(()), bases))) - room
        asks, stack = max(3, planning.model.offload_depth(k) + 2), Knapsack(steps, order=order)  # one stack, each ask's need
        fits: Plan | None = None  # a leaner re-run that fits, kept while a plan saving more may cost less
        for _ in range(asks):
            try:
                mixed = stack.with_parts(parts, need)
            except InfeasiblePlanError:
                break
            saved, mixed = mixed.saved_bytes, on_base(mixed, bases) if bases else mixed
            if forced is not None:
                names = mixed.treatments(planning.n_blocks)
                for i, name in zip(forced.blocks, forced.kinds):
                    names[i] = name
                treated = tuple(i for i, name in enumerate(names) if name != "keep")
                mixed = Plan(treated, mixed.cost_ms + forced.cost_ms, mixed.saved_bytes + forced.saved_bytes,
                             kinds=tuple(names[i] for i in treated), parts=mixed.parts)
            if fits is not None and mixed.cost_ms >= fits.cost_ms:
                break  # every later ask saves more and costs no less
            over = planning.plan_peak(k, mixed) - room
            if over <= 0:
                return mixed
            lean = with_leaner_reruns(mixed, options, leaner) if leaner else None  # NOTE [Leaner re-runs]
            if lean is not None and (fits is None or lean.cost_ms < fits.cost_ms) and planning.plan_peak(k, lean) <= room:
                fits = lean
            need = int(max(need, saved) + over) + 1
        return fits
