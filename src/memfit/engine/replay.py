"""Surviving an OOM: the failed attempt's record, a safer plan, and the replay of the step.

``Controller.note_oom`` drops the failed step and keeps more room free (:func:`after_oom`);
the caller replays the step. The Trainer replays its accumulation window (NOTE [OOM replay]
in hf.py); a plain loop calls ``Controller.run_step`` (:func:`run_step`), which does the same.

# NOTE [Replay in a plain loop]
``run_step(fn)`` runs one micro-step (the forward and backward inside ``fn``). On an OOM the
failed attempt has added part of its gradients to ``.grad``, which cannot be taken back; so
every gradient is dropped and the micro-steps of the accumulation window that ran before it
are rerun first, each with the RNG state it had, then the failed one, with its own: the
gradients are then bitwise those of a run without the OOM, as nothing else differs but the
plans. The window is the ``run_step`` calls since the optimizer's last step (the controller's
optimizer, whose step hook closes it) or since the gradients were last all ``None``. Without
an optimizer to close windows, a call that finds gradients already present keeps a copy of
them to restore instead (memory: one copy of the gradients).

# NOTE [Replay under FSDP]
Under FSDP with several ranks every block's forward and backward hold collectives (FSDP2
all-gathers a block's parameters before it runs and reduce-scatters its gradients after its
backward), and every rank must issue the same ones in the same order. A rank that stopped at
an OOM and replayed alone would leave the others waiting in the next all-gather. So inside
``run_step`` an OOM in a block's forward is not raised: that block runs again under whole-block
recompute, as does every later block of the step, and the step goes on to the end, its
collectives in step with the other ranks, its gradients wrong; the failed attempt is noted when
it is raised (its stage and memory readings are the failure's), and the rest of the step is not
recorded. After each micro-step the ranks
agree, by one all-reduce of a flag, whether any of them failed (its cost: a collective of four
bytes and the host waiting for the backward, once per micro-step); if one did, every rank drops
the window's gradients and replays it (NOTE [Replay in a plain loop]), the failed rank with a
safer plan, the others with their own. An OOM elsewhere (the head after the last block, a
backward) cannot be kept in step this way: it is raised with an error that says so, and the
launcher stops the other ranks. So is an OOM in a block that holds FSDP modules of its own:
its failed forward may have issued some of their all-gathers, which a rerun would repeat.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from memfit.engine.budget import BudgetTooSmallError, format_bytes
from memfit.integrations.distributed import is_fsdp, world_size
from memfit.engine.planner import Plan
from memfit.engine.step import Stage, StepState
from memfit.engine.treatments import RECOMPUTE

if TYPE_CHECKING:
    from memfit.engine.blocks import Block
    from memfit.engine.methods import Method
    from memfit.engine.planning import Planning
    from memfit.engine.protection import Protection
    from memfit.engine.controller import Controller
    from memfit.engine.meter import Meter

__all__ = ["MAX_OOM_RETRIES", "describe_attempt", "OomLog", "after_oom", "run_step", "rng_state", "set_rng_state",
           "replays_exhausted", "sharded"]

logger = logging.getLogger("memfit")

#: Replays of one step with ever safer plans before the budget is declared too small.
MAX_OOM_RETRIES = 8


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
        held but could not hand out then (NOTE [Room], planning.py). ``margin_bytes`` and
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
            "evicted_blocks": protection.evicted_so_far() if decision is not None else [],
            "error": str(error).splitlines()[0][:300] if error else None,
        }
        if plan is not None and plan.kinds:
            attempt["treatments"] = list(plan.kinds)
        attempt.update(meter.oom_readings(step))
        self.attempts.append(attempt)
        self.failed_plan = plan
        return attempt

    def clear(self) -> None:
        """The step succeeded: its record has taken the attempts."""
        self.attempts, self.failed_plan = [], None


def after_oom(
    method: "Method", planning: "Planning", step: StepState | None, attempt: dict[str, Any], n_blocks: int,
) -> None:
    """Keep more room free so that the replay runs a safer plan, or say why none exists.

    On CUDA the allocator's slack grows to cover the reserved bytes that were not allocated
    when the step failed; where that explains nothing new, the margin grows by a twentieth of
    the budget (NOTE [Room], planning.py). The plan cache is cleared either way.

    Raises:
        BudgetTooSmallError: when the method cannot adapt its plans (``none``, ``full``,
            ``precomputed``), or the failed step already recomputed every block.
    """
    if not method.adapts:
        raise BudgetTooSmallError(
            f"out of memory under method {method.name!r}, which cannot adapt its plans; use "
            "method 'dynamic', or raise the memory budget"
        )
    decision = step.decision if step is not None else None
    if decision is not None and decision.plan.layout == (planning.all_blocks, ()) and not decision.warmup:
        raise BudgetTooSmallError(
            f"out of memory with every block checkpointed (shape {step.shape}); static memory is "
            f"{format_bytes(step.static_bytes)} of the {format_bytes(planning.budget_bytes)} budget. Raise "
            "--memory_budget, lower the batch size (use gradient accumulation), or use bf16/fp16 or a "
            "lighter optimizer (see `memfit estimate --advise`)"
        )
    if planning.budget_bytes is not None:
        unusable = attempt.get("unusable_reserved_bytes") or 0
        if not planning.learn_slack(unusable):
            planning.raise_margin(max(planning.budget_bytes // 20, 1))
    logger.warning("memfit: %s; replaying it with %s kept free", describe_attempt(attempt, n_blocks),
                   format_bytes(planning.margin_bytes + planning.slack_bytes))


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


def replays_exhausted(attempts: list[dict[str, Any]], n_blocks: int, raise_what: str) -> BudgetTooSmallError:
    """The error after :data:`MAX_OOM_RETRIES` replays; ``raise_what`` names the budget and margin."""
    return BudgetTooSmallError(
        f"still out of memory after {MAX_OOM_RETRIES} replays with safer plans; the last: "
        f"{describe_attempt(attempts[-1], n_blocks) if attempts else 'not recorded'}. Raise {raise_what}, or lower "
        "the batch size"
    )


def run_step(ctl: "Controller", fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``fn(*args, **kwargs)`` (one micro-step: forward and backward), replaying it on an
    OOM with the same RNG state and a safer plan (NOTE [Replay in a plain loop]).

    Raises:
        BudgetTooSmallError: when no safer plan exists, or after :data:`MAX_OOM_RETRIES` replays.
    """
    params = ctl.grad_params
    window = ctl.window
    has_grads = any(p.grad is not None for p in params)
    kept = None
    if not has_grads:
        window.clear()  # a new accumulation window
    elif ctl.optimizer is None:
        window.clear()
        kept = [None if p.grad is None else p.grad.detach().clone() for p in params]
    window.append((fn, args, kwargs, rng_state()))
    together = _InStep(ctl) if sharded(ctl) else None
    for retry in range(MAX_OOM_RETRIES + 1):
        message = None
        try:
            if together is None:
                if retry:
                    _replay_head(ctl, window)
                return fn(*args, **kwargs)
            with together:  # NOTE [Replay under FSDP]
                if retry:
                    _replay_head(ctl, window)
                result = fn(*args, **kwargs)
            if not together.any_rank_failed():
                return result
            del result
        except torch.OutOfMemoryError as err:
            message = str(err)  # recovered outside the except block, so its frames are freed
            if together is not None:
                raise BudgetTooSmallError(
                    f"{message}\nmemfit: under FSDP with several ranks, an OOM outside the blocks' forwards (the head "
                    "after the last block, or a backward) cannot be replayed in step with the other ranks (NOTE [Replay "
                    "under FSDP]); raise the memory budget or the margin, or lower the batch size"
                ) from None
        if together is None:
            ctl.note_oom(message)  # raises when no safer plan exists
        elif together.message is None:
            ctl.drop_step()  # another rank failed: replay with this rank's own plan
        # else this rank's OOM was noted when it was raised (_InStep)
        for p, grad in zip(params, kept or [None] * len(params)):
            p.grad = grad if grad is None else grad.clone()
        gc.collect()
        ctl.meter.release()
    raise replays_exhausted(ctl.pending_oom_attempts, len(ctl.blocks), "the memory budget or the margin")


#: per controller, whether its model is sharded over several ranks (fit comes after fully_shard,
#: so it never changes; read once instead of walking the modules every micro-step)
_SHARDED: "weakref.WeakKeyDictionary[Controller, bool]" = weakref.WeakKeyDictionary()


def sharded(ctl: "Controller") -> bool:
    """Whether ``ctl``'s model is sharded over several ranks (FSDP), read once per controller."""
    if ctl not in _SHARDED:
        _SHARDED[ctl] = world_size() > 1 and is_fsdp(ctl.model)
    return _SHARDED[ctl]


class _InStep:
    """While entered, an OOM in a block's forward reruns that block and every later one under
    whole-block recompute instead of raising (NOTE [Replay under FSDP])."""

    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.message: str | None = None
        self._recompute = ctl.treatments[RECOMPUTE]  # NOTE [Recompute always at hand], treatments.py

    def __enter__(self) -> "_InStep":
        self.message = None
        for block in self.ctl.blocks:
            block.on_oom = self._go_on
        return self

    def __exit__(self, *exc: object) -> None:
        for block in self.ctl.blocks:
            block.on_oom = None

    def _go_on(self, block: "Block", args: tuple, kwargs: dict[str, Any], message: str) -> Any:
        if any(is_fsdp(child) for child in block.module.children()):
            raise BudgetTooSmallError(
                f"{message}\nmemfit: block {block.name} holds FSDP modules of its own, so its failed forward cannot "
                "be rerun in step with the other ranks (NOTE [Replay under FSDP]); shard whole blocks, or raise the "
                "memory budget or the margin, or lower the batch size"
            )
        if self.message is None:
            self.message = message
            logger.warning("memfit: out of memory in block %d (%s); the step runs to its end in step with the other "
                           "ranks, then every rank replays it", block.index, block.name)
            # noted now, while the attempt's stage and memory readings are those of the failure;
            # the rest of the step runs unrecorded (raises when no safer plan exists)
            self.ctl.note_oom(message)
        gc.collect()
        self.ctl.meter.release()
        for later in self.ctl.blocks[block.index:]:
            later.treatment = self._recompute
        return self._recompute.run(block, args, kwargs)

    def any_rank_failed(self) -> bool:
        """All-reduce of this rank's flag: whether any rank ran out of memory in this attempt."""
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([0 if self.message is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _replay_head(ctl: "Controller", window: list) -> None:
    """Rerun the window's earlier micro-steps (no records), then restore the failed one's RNG."""
    ctl.replaying = True
    try:
        for fn, args, kwargs, rng in window[:-1]:
            set_rng_state(rng)
            fn(*args, **kwargs)
    finally:
        ctl.replaying = False
    set_rng_state(window[-1][3])
