"""Surviving an OOM: the failed attempt's record, a safer plan, and the replay of the step.

One engine replays: the :class:`Replayer` the controller owns (``ctl.replay``). A plain loop
reaches it through ``Controller.run_step``; the Trainer's ``training_step`` (and so TRL's
``SFTTrainer``) runs every micro-step through it too, under DDP and FSDP alike (NOTE [OOM
replay] in memfit/integrations/hf.py). On an OOM it calls ``Controller.note_oom``, which drops
the failed step and keeps more room free (:func:`after_oom`), then replays.

# NOTE [Replay in a plain loop]
``Replayer.run(fn)`` runs one micro-step (the forward and backward inside ``fn``). On an OOM the
failed attempt has added part of its gradients to ``.grad``, which cannot be taken back; so
every gradient is dropped and the micro-steps of the accumulation window that ran before it
are rerun first, each with the RNG state it had, then the failed one, with its own: the
gradients are then bitwise those of a run without the OOM, as nothing else differs but the
plans. The window (the accumulation window) is the micro-steps since the optimizer's last step (the controller's
optimizer, whose step hook closes it) or since the gradients were last all ``None``. Without
an optimizer to close windows, a call that finds gradients already present keeps a copy of
them to restore instead (memory: one copy of the gradients).

# NOTE [Replay under FSDP]
Under FSDP with several ranks every block's forward and backward hold collectives (FSDP2
all-gathers a block's parameters before it runs and reduce-scatters its gradients after its
backward), and every rank must issue the same ones in the same order. A rank that stopped at
an OOM and replayed alone would leave the others waiting in the next all-gather. So inside
``Replayer.run`` an OOM in a block's forward is not raised: that block runs again under whole-block
recompute, as does every later block of the step, and the step goes on to the end, its
collectives in step with the other ranks, its gradients wrong; the failed attempt is noted when
it is raised (its stage and memory readings are the failure's), and the rest of the step is not
recorded. An OOM in a planned LM head (its logits and loss, after the last block) is kept in
step the same way: its loss is computed again in its most chunks, which makes no collective of
its own (the weight is gathered for the call it runs in: NOTE [The head as its own FSDP unit],
head.py). After each micro-step the ranks
agree, by one all-reduce of a flag on the host, whether any of them failed (its cost: the host
waiting for the slowest rank's host, never for the device: NOTE [The ranks' agreement on the
host], ranks.py); if one did, every rank drops
the window's gradients and replays it (NOTE [Replay in a plain loop]), the failed rank with a
safer plan, the others with their own. An OOM elsewhere (a backward, a head memfit does not
plan) cannot be kept in step this way: it is raised with an error that says so, and the
launcher stops the other ranks. So is an OOM in a block that holds FSDP modules of its own:
its failed forward may have issued some of their all-gathers, which a rerun would repeat.

# NOTE [cuDNN attention after an OOM]
On CUDA an OOM raised inside cuDNN's scaled-dot-product attention can leave cuDNN's attention
failing for the rest of the process (later calls raise in ``mha_graph.execute`` with
``is_good()``), and cuDNN's attention fails so at times under a tight cap without any OOM. Turning
it off costs much: PyTorch's flash or memory-efficient attention computes the same attention, but
a step of long batches takes up to 40% longer without cuDNN's (docs/devlog.md). So it stays on through
an OOM, and the failure itself is the signal: a micro-step that raises a ``RuntimeError`` naming
cuDNN while its attention is on (:func:`cudnn_attention_failed`) turns it off for the rest of the
process, says so once, and is replayed with the same plan (:func:`avoid_cudnn_attention`); a
second such error is raised. Under FSDP with several ranks a failure on one rank could not be
replayed in step (the others would wait in their next collective), so there the first OOM on
CUDA turns it off at once. ``benchmarks/cudnn_oom.py`` measures both: what cuDNN's attention is
worth, and whether it survives an OOM raised inside it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from memfit.engine.budget import BudgetTooSmallError, format_bytes
from memfit.engine.ranks import Agreement, is_fsdp, sharded_over_ranks
from memfit.engine.plan.planner import Plan
from memfit.engine.run.step import Stage, StepState
from memfit.engine.parts.treatments import RECOMPUTE, floor_treatment

if TYPE_CHECKING:
    from memfit.engine.parts.blocks import Block
    from memfit.engine.methods import Method
    from memfit.engine.plan.planning import Planning
    from memfit.engine.run.protection import Protection
    from memfit.engine.run.meter import Meter
    from memfit.engine.parts.treatments import Treatment

__all__ = ["MAX_OOM_RETRIES", "describe_attempt", "OomLog", "after_oom", "avoid_cudnn_attention", "cudnn_attention_failed", "MicroStep", "Replayer",
           "rng_state", "set_rng_state"]

logger = logging.getLogger("memfit")

#: Replays of one step with ever safer plans before the budget is declared too small.
MAX_OOM_RETRIES = 8
#: static bytes above the failed attempt's own after its clean-up that the run says it still holds (NOTE [What a failed
#: attempt leaves]): the allocator's rounding and the optimizer's step counters stay under it
LEFT_SAID_BYTES = 64 * 2**20


def describe_attempt(attempt: dict[str, Any], n_blocks: int) -> str:
    """One line on a failed attempt: where, what ran, memory then."""
    plan = attempt.get("plan")
    if plan is None:
        ran = "no plan yet"
    elif attempt.get("treatments"):
        counts = {kind: attempt["treatments"].count(kind) for kind in dict.fromkeys(attempt["treatments"])}
        ran = f"{len(plan)} of {n_blocks} blocks treated: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
    else:
        ran = f"{len(plan)} of {n_blocks} blocks checkpointed"
    memory = ", ".join(
        f"{name} {format_bytes(attempt[key])}"
        for name, key in (("allocated", "allocated_bytes"), ("peak", "peak_allocated_bytes"), ("reserved", "reserved_bytes"))
        if attempt.get(key) is not None
    )
    return f"out of memory in {attempt['stage']} at shape {attempt.get('shape')} ({ran}{'; ' + memory if memory else ''})"


@dataclass
class OomLog:
    """The failed attempts of the step being replayed; its record gets them when it succeeds.

    Attributes:
        attempts: what each was (:meth:`add`), oldest first.
        failed_plan: the last failed attempt's plan (None before a plan was made).
    """

    attempts: list[dict[str, Any]] = field(default_factory=list)
    failed_plan: Plan | None = None

    def add(
        self, step: StepState | None, meter: "Meter", planning: "Planning", protection: "Protection",
        error: BaseException | str | None,
    ) -> dict[str, Any]:
        """Record a failed attempt: what ran, where it failed, memory then.

        ``stage`` is where the OOM was raised: ``forward`` (the forward had not finished),
        ``backward`` (it had; the optimizer step had not started) or ``optimizer``. On CUDA,
        ``peak_allocated_bytes`` is the highest allocation since the step's forward began
        (since the optimizer step's start, at that stage), before the request that failed, and
        ``unusable_reserved_bytes`` is reserved less that peak: at least what the allocator
        held but could not hand out then (NOTE [Room], room.py). ``margin_bytes`` and
        ``slack_bytes`` are those the failed plan was made with.
        """
        decision = step.decision if step is not None else None
        plan = decision.plan if decision is not None else None
        attempt: dict[str, Any] = {
            "stage": (step.stage if step is not None else Stage.FORWARD).value,
            "plan": list(plan.blocks) if plan is not None else None,
            "phase": None if decision is None else "warmup" if decision.warmup else "steady",
            "shape": step.shape if step is not None else None,
            "predicted_peak_bytes": (
                planning.predict_peak(step.key, plan) if plan is not None and planning.model.ready else None
            ),
            "margin_bytes": planning.margin_bytes,
            "slack_bytes": planning.slack_bytes,
            "pool_bytes": planning.room.pool_bytes,
            "evicted_blocks": protection.evicted_so_far() if decision is not None else [],
            "error": str(error).splitlines()[0][:300] if error else None,
        }
        if plan is not None and plan.kinds:
            attempt["treatments"] = list(plan.kinds)
        if step is not None:
            attempt["static_bytes"] = step.static_bytes
        attempt.update(meter.oom_readings(step))
        self.attempts.append(attempt)
        self.failed_plan = plan
        return attempt

    def clear(self) -> None:
        """The step succeeded: its record has taken the attempts."""
        self.attempts, self.failed_plan = [], None


def after_oom(
    method: "Method", planning: "Planning", step: StepState | None, attempt: dict[str, Any], n_blocks: int,
    earlier: Sequence[dict[str, Any]] = (),
) -> None:
    """Keep more room free so that the replay runs a safer plan, or say why none exists.

    On CUDA the allocator's slack grows to cover the reserved bytes that were not allocated
    when the step failed; where that explains nothing new, the margin grows by a twentieth of
    the budget (NOTE [Room], room.py). The plan cache is cleared either way.

    # NOTE [The floor retried once]
    The floor has nothing safer below it, but an OOM there is not always the step's own need: the
    allocator's fragmentation, or on a shared card another process's memory, can fail a floor that
    was predicted inside the budget, and the same plan then runs once the cache is released and the
    slack has grown. So such a floor is replayed once a micro-step (``earlier``: its attempts before
    this one); a floor predicted over the budget (said before it ran) or failed twice is the budget's
    limit.

    Raises:
        BudgetTooSmallError: when the method cannot adapt its plans (``none``, ``full``,
            ``precomputed``), or the failed step already ran the floor plan (every block on the run's
            ``floor_treatment``; recomputed, outside warm-up, where the run offers nothing below it) and no part
            beside the blocks has a way that keeps less (``PartKind.leaner``), where that floor was predicted over
            the budget or failed before in this micro-step (NOTE [The floor retried once]).
    """
    if not method.adapts:
        raise BudgetTooSmallError(
            f"out of memory under method {method.name!r}, which cannot adapt its plans; use "
            "method 'dynamic', or raise the memory budget"
        )
    decision = step.decision if step is not None else None
    budget = planning.budget  # a plan of every block is made for a budget
    floor = floor_treatment(planning.registry)  # NOTE [A replay treats more], methods/dynamic.py
    on_floor = decision is not None and decision.plan.layout == planning.search.floor(1).layout
    attempt["floor"] = on_floor
    predicted, budget_bytes = attempt.get("predicted_peak_bytes"), planning.budget_bytes
    retried = any(a.get("floor") for a in earlier) or predicted is None or budget_bytes is None or predicted > budget_bytes
    if on_floor and retried and (floor != RECOMPUTE or not decision.warmup) and not any(
            [part.leaner(step.key[0] * step.key[1]) for part in planning.parts.values()]):  # each part asked
        how = "checkpointed" if floor == RECOMPUTE else f"on {floor} (the floor)"
        raise BudgetTooSmallError(
            f"out of memory with every block {how} and the LM head chunked where there is one (shape {step.shape}); "
            f"static memory is {budget.size(step.static_bytes)} of the budget of {budget}. Raise {budget.name}, lower "
            "the batch size (use gradient accumulation) or the longest sequence (--max_seq_length), train adapters "
            "(LoRA), or use bf16/fp16 or a lighter optimizer (see `memfit estimate --advise`)"
        )
    if budget is not None:
        planning.after_oom(attempt.get("unusable_reserved_bytes") or 0)
    logger.warning("memfit: %s; replaying it with %s kept free", describe_attempt(attempt, n_blocks),
                   (budget.size if budget is not None else format_bytes)(planning.room.kept_bytes))


def cudnn_attention_failed(err: BaseException) -> bool:
    """Whether ``err`` (not an OOM) may be cuDNN's attention failing: it names cuDNN, or cuDNN's
    attention graph (NOTE [cuDNN attention after an OOM])."""
    text = str(err)
    return not isinstance(err, torch.OutOfMemoryError) and ("mha_graph" in text or "cudnn" in text.lower())


def avoid_cudnn_attention() -> bool:
    """Turn cuDNN's SDPA backend off for the rest of the process and say so once (NOTE [cuDNN
    attention after an OOM]). Returns whether it was turned off now (False on CPU, or already off)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()) or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    logger.warning("memfit: cuDNN's attention is turned off for the rest of this process (it failed, or may after an "
                   "out-of-memory error under FSDP; PyTorch's flash or memory-efficient attention computes the same "
                   "attention, more slowly; NOTE [cuDNN attention after an OOM] in memfit/engine/run/replay.py)")
    return True


def rng_state() -> dict[str, Any]:
    """The host's and every CUDA device's RNG state (what a replayed micro-step draws from)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class MicroStep:
    """One micro-step of the accumulation window: ``fn(*args, **kwargs)`` and the RNG state it drew from."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    rng: dict[str, Any]


class Replayer:
    """The one OOM-replay engine (NOTE [Replay in a plain loop], NOTE [Replay under FSDP]).

    Owned by the controller (``ctl.replay``); ``Controller.run_step`` and the Trainer's
    ``training_step`` (TRL's too) run every micro-step through :meth:`run`. It owns the
    accumulation window (the micro-steps since the optimizer's last step, each with its RNG
    state), the retries, and under FSDP the ranks' agreement after each micro-step. What it
    needs of the controller comes in as arguments, so neither imports the other.

    Args:
        model: the hooked model (read once, at the first micro-step, for FSDP sharding).
        params: the parameters whose gradients a replay drops.
        blocks: the wrapped blocks (under FSDP an OOM in one reruns it and the later ones).
        recompute: the whole-block recompute treatment (NOTE [Recompute always at hand], treatments/__init__.py).
        note_oom: drops the failed step and makes the next plan safer; raises when none is.
        drop_step: drops the pending step unrecorded (another rank's OOM replays it).
        release: returns cached memory to the device after an OOM.
        parts: the planned parts beside the blocks (parts/kind.py), each recovering from an OOM in its own run
            in step with the other ranks where it can (``PartKind.recover_in_step``).
        step_key: the running micro-step's shape key (rows, length), which the ranks' agreement takes the largest of
            (NOTE [A retry beside no clean step of its bucket], room.py); None before its first block.

    Attributes:
        accumulation: the accumulation window's micro-steps, oldest first.
        oom: the failed attempts of the micro-step being replayed (its record takes them).
        replaying: set while the window's earlier micro-steps are rerun (their steps write no record).
        closed_by_optimizer: an optimizer's step closes the window (:meth:`close_window` is
            hooked on it); without one, gradients present before a micro-step are kept to restore.
        windows_closed: optimizer steps taken while hooked (the summary's optimizer steps).
    """

    def __init__(
        self, model: torch.nn.Module, params: list[torch.nn.Parameter], blocks: "list[Block]", recompute: "Treatment",
        note_oom: Callable[[str], None], drop_step: Callable[[], None], release: Callable[[], None],
        parts: Callable[[], Sequence[Any]] = tuple,
        step_key: Callable[[], tuple[int, int] | None] = lambda: None,
    ):
        self._model, self._params, self._blocks, self._recompute = model, params, blocks, recompute
        self._parts, self._step_key = parts, step_key
        self._note_oom, self._drop_step, self._release = note_oom, drop_step, release
        self.accumulation: list[MicroStep] = []
        self.oom = OomLog()
        self.replaying = False
        self.closed_by_optimizer = False
        self.windows_closed = 0
        self._running = 0
        self._sharded: bool | None = None
        self._said_left = False
        self.agreement = Agreement()  # NOTE [The ranks' agreement on the host]

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over several ranks (FSDP); read at the first micro-step
        (memfit hooks a model after it is sharded, so it never changes after that)."""
        if self._sharded is None:
            self._sharded = sharded_over_ranks(self._model)
        return self._sharded

    @property
    def replayable(self) -> bool:
        """Whether an OOM in the step now starting would be replayed: it runs inside :meth:`run`,
        unsharded (under FSDP an OOM outside a block's forward cannot be: NOTE [Protection by
        expected cost], protection.py)."""
        return self._running > 0 and not self.sharded

    def take_agreed_key(self) -> tuple[int, int] | None:
        """The ranks' largest step shape at the last micro-step's agreement (None: none since the last take; NOTE [A
        retry beside no clean step of its bucket], room.py)."""
        key, self.agreement.key = self.agreement.key, None
        return key

    def close_window(self, *_: Any) -> None:
        """The optimizer stepped: the next micro-step opens a new window (an optimizer step post-hook)."""
        self.accumulation.clear()
        self.windows_closed += 1

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None, *,
            raise_what: str = "the memory budget or the margin") -> Any:
        """Run ``fn(*args, **kwargs)`` (one micro-step: forward and backward), replaying the
        window on an OOM with the same RNG states and a safer plan (NOTE [Replay in a plain loop]).

        ``raise_what`` names what the user raises when no replay helps (arguments or flags).

        Raises:
            BudgetTooSmallError: when no safer plan exists, after :data:`MAX_OOM_RETRIES` replays,
                or under FSDP for an OOM outside the blocks' forwards (NOTE [Replay under FSDP]).
        """
        kwargs = kwargs or {}
        self._running += 1
        try:
            return self._run(MicroStep(fn, args, kwargs, rng_state()), raise_what)
        finally:
            self._running -= 1

    def _run(self, micro: MicroStep, raise_what: str) -> Any:
        params, window = self._params, self.accumulation
        kept = None
        if not any(p.grad is not None for p in params):
            window.clear()  # a new accumulation window
        elif not self.closed_by_optimizer:
            window.clear()
            kept = [None if p.grad is None else p.grad.detach().clone() for p in params]
        window.append(micro)
        together = _InStep(self) if self.sharded else None
        for retry in range(MAX_OOM_RETRIES + 1):
            message = None
            try:
                if together is None:
                    if retry:
                        self._replay_window()
                    return micro.fn(*micro.args, **micro.kwargs)
                with together:  # NOTE [Replay under FSDP]
                    if retry:
                        self._replay_window()
                    result = micro.fn(*micro.args, **micro.kwargs)
                if not together.any_rank_failed():
                    return result
                del result
            except torch.OutOfMemoryError as err:
                message = str(err)  # recovered outside the except block, so its frames are freed
                if together is not None:
                    raise BudgetTooSmallError(
                        f"{message}\nmemfit: under FSDP with several ranks, an OOM outside the blocks' forwards and the "
                        "planned LM head (a backward, or a head memfit does not plan) cannot be replayed in step with the other ranks "
                        f"(NOTE [Replay under FSDP] in memfit/engine/run/replay.py); raise {raise_what}, or lower the batch size"
                    ) from None
            except RuntimeError as err:
                if together is not None or not cudnn_attention_failed(err) or not avoid_cudnn_attention():
                    raise
            if together is None and message is not None:
                self._note_oom(message)  # raises when no safer plan exists
            elif together is None:
                self._drop_step()  # cuDNN's attention failed (NOTE [cuDNN attention after an OOM]): the same plan again
            elif together.message is None:
                self._drop_step()  # another rank failed: replay with this rank's own plan
            # else this rank's OOM was noted when it was raised (_InStep)
            for p, grad in zip(params, kept or [None] * len(params)):
                p.grad = grad if grad is None else grad.clone()
            gc.collect()
            self._note_left(self._release())
        attempts = self.oom.attempts
        raise BudgetTooSmallError(
            f"still out of memory after {MAX_OOM_RETRIES} replays with safer plans; the last: "
            f"{describe_attempt(attempts[-1], len(self._blocks)) if attempts else 'not recorded'}. Raise {raise_what}, "
            "or lower the batch size"
        )

    def _note_left(self, static_now: int | None) -> None:
        """# NOTE [What a failed attempt leaves]
        Once an OOM's attempt is cleaned up (its gradients put back, its frames freed, the collector run, the
        cache returned), the static bytes should be what the attempt started with. Where they are more, the
        failed attempt's tensors are still held by something the clean-up cannot reach (after a backward OOM
        among checkpointed blocks, the failed backward's saved tensors can outlive it, as pytorch/pytorch#82218
        reports of an OOM in backward: docs/devlog.md, session 29).
        The replay's static reading counts them, so its plan allows for them; the record's attempt says how
        much (``left_bytes``) and the run says it once.
        """
        attempt = self.oom.attempts[-1] if self.oom.attempts else None
        if static_now is None or attempt is None or attempt.get("static_bytes") is None:
            return
        left = static_now - attempt["static_bytes"]
        if left <= LEFT_SAID_BYTES:
            return
        attempt["left_bytes"] = left
        if not self._said_left:
            self._said_left = True
            logger.warning("memfit: %s of the failed attempt are still allocated after its clean-up (held by something "
                           "outside memfit's reach); the replay counts them with the static memory", format_bytes(left))

    def _replay_window(self) -> None:
        """Rerun the window's earlier micro-steps (no records), then restore the failed one's RNG."""
        self.replaying = True
        try:
            for micro in self.accumulation[:-1]:
                set_rng_state(micro.rng)
                micro.fn(*micro.args, **micro.kwargs)
        finally:
            self.replaying = False
        set_rng_state(self.accumulation[-1].rng)


class _InStep:
    """While entered, an OOM in a block's forward reruns that block and every later one under
    whole-block recompute instead of raising (NOTE [Replay under FSDP])."""

    def __init__(self, replayer: Replayer):
        self.replayer = replayer
        self.message: str | None = None
        self.parts: Sequence[Any] = ()

    def __enter__(self) -> "_InStep":
        self.message = None
        for block in self.replayer._blocks:
            block.on_oom = self._go_on
        self.parts = tuple(self.replayer._parts())
        for part in self.parts:
            part.recover_in_step(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for block in self.replayer._blocks:
            block.on_oom = None
        for part in self.parts:
            part.recover_in_step(None)

    def _note(self, message: str, where: str) -> None:
        """The step's first OOM: said once and noted now, while the attempt's stage and memory
        readings are those of the failure; the rest of the step runs unrecorded (raises when no
        safer plan exists). Then the cache goes back to the device."""
        replayer = self.replayer
        if self.message is None:
            self.message = message
            logger.warning("memfit: out of memory in %s; the step runs to its end in step with the other ranks, then "
                           "every rank replays it", where)
            replayer._note_oom(message)
            avoid_cudnn_attention()  # NOTE [cuDNN attention after an OOM]: no failure could be replayed in step
        gc.collect()
        replayer._release()

    def _go_on(self, block: "Block", args: tuple, kwargs: dict[str, Any], message: str) -> Any:
        replayer = self.replayer
        if any(is_fsdp(child) for child in block.module.children()):
            raise BudgetTooSmallError(
                f"{message}\nmemfit: block {block.name} holds FSDP modules of its own, so its failed forward cannot "
                "be rerun in step with the other ranks (NOTE [Replay under FSDP]); shard whole blocks, or raise the "
                "memory budget or the margin, or lower the batch size"
            )
        self._note(message, f"block {block.index} ({block.name})")
        for later in replayer._blocks[block.index:]:
            later.treatment = replayer._recompute
        return replayer._recompute.run(block, args, kwargs)

    def any_rank_failed(self) -> bool:
        """All-reduce of this rank's flag: whether any rank ran out of memory in this attempt."""
        return self.replayer.agreement.any(self.message is not None, self.replayer._step_key())
