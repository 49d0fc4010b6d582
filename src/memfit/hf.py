"""Hugging Face Trainer integration: swap two classes and a script trains under a budget.

    from memfit import Trainer, TrainingArguments   # instead of transformers'

``TrainingArguments`` adds the budget flags (``--memory_budget 6GiB``, or the original
scripts' ``--memory_threshold 6`` in GB) and the method; ``Trainer`` hooks the model with
:func:`memfit.fit`, writes ``<output_dir>/memfit_steps.jsonl`` (one line per micro-step,
flushed) and ``memfit_summary.json``, adds ``memfit/peak_gib`` and
``memfit/n_checkpointed`` to the Trainer's logs, keeps the memory model in every checkpoint
folder (a resumed run needs no new warm-up) and survives CUDA OOMs.

The memfit behaviour lives in two mixins, so that any ``transformers.Trainer`` subclass can
have it: :class:`MemfitArguments` (the flags) and :class:`MemfitTrainerMixin` (hooks, OOM
replay, records). ``Trainer`` is the mixin on ``transformers.Trainer``; :func:`with_memfit`
puts it on another Trainer class (``memfit.trl.SFTTrainer`` is TRL's ``SFTTrainer`` with it).

# NOTE [OOM replay]
An OOM can hit any micro-batch of a gradient-accumulation window, after earlier
micro-batches have already added to ``.grad``. Retrying only the failed micro-batch would
keep a half-accumulated, possibly corrupted gradient; skipping it would lose a batch. So the
whole window is replayed: gradients are dropped, the controller grows its margin (a safer
plan), and every micro-batch of the window runs again from its first, each with the RNG
state it had the first time (same dropout masks). The earlier micro-batches' losses were
already logged and are not counted again; their replays write no step record. The final
gradients are those of a run that never hit the OOM. With several DDP ranks the replay stays
on the rank that hit the OOM, and the others wait for it at the window's gradient sync
(distributed.py, NOTE [Lockstep under DDP]). Under FSDP every forward and backward holds
collectives (parameter all-gathers, gradient reduce-scatters), so a replay on one rank
cannot be made local: the OOM is raised instead, and torchrun stops the other ranks (the
Trainer refuses ``--fsdp`` for now; the check covers a model sharded some other way).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from memfit.budget import BudgetTooSmallError, parse_bytes
from memfit.distributed import GradientSync, is_fsdp, world_size
from memfit.methods import METHODS, Method, UnknownMethodError
from memfit.records import StepRecord, read_jsonl, summarize
from memfit.runtime import Controller, fit
from memfit.runtime.replay import describe_attempt

__all__ = [
    "MemfitArguments", "TrainingArguments", "MemfitTrainerMixin", "Trainer", "with_memfit", "STATE_FILE", "rank_path",
]

STATE_FILE = "memfit_state.json"
STEPS_FILE = "memfit_steps.jsonl"
SUMMARY_FILE = "memfit_summary.json"
_MAX_OOM_RETRIES = 8


@dataclass
class MemfitArguments:
    """memfit's flags (all optional), mixed into a ``transformers.TrainingArguments`` subclass
    before it: ``class Args(MemfitArguments, transformers.TrainingArguments)``."""

    memory_budget: str | None = field(
        default=None,
        metadata={"help": "Memory budget of the training process: '6GiB' (6*2**30 bytes), '6GB' (6*10**9) or bytes."},
    )
    memory_threshold: float | None = field(
        default=None,
        metadata={"help": "Memory budget in GB (10**9 bytes), as the original experiment scripts' flag."},
    )
    memfit_method: str = field(
        default="dynamic",
        metadata={"help": "How plans are chosen: none | full | dynamic | static | precomputed | reactive."},
    )
    memfit_plans_file: str | None = field(
        default=None,
        metadata={"help": "Plans JSON for --memfit_method precomputed (written by a dynamic run as memfit_plans.json)."},
    )
    memfit_log: str | None = field(
        default=None,
        metadata={"help": "Step-record JSONL path (default: <output_dir>/memfit_steps.jsonl)."},
    )
    memfit_margin: float | None = field(
        default=None,
        metadata={"help": "Share of the budget kept free as a safety margin for prediction error (default 0.03 on CUDA, 0.001 with logical accounting on CPU); on CUDA the allocator's slack, min(256 MiB, budget/16) to start, is kept free on top."},
    )
    memfit_lockstep: bool = field(
        default=True,
        metadata={
            "help": "Under DDP with several ranks, sync gradients once per accumulation window after backward, so an OOM "
            "replay on one rank cannot hang the others (costs DDP's overlap of all-reduce with backward). False: DDP's "
            "own sync, and an OOM on one rank can leave the others waiting in a collective."
        },
    )
    memfit_max_shape: str | None = field(
        default=None,
        metadata={"help": "For --memfit_method static: largest input as 'N,T' (rows, tokens); default: largest seen."},
    )
    memfit_backstop: str = field(
        default="auto",
        metadata={"help": "For --memfit_method dynamic: evict kept blocks when a step nears the cap despite its plan, "
                  "instead of an OOM and a replay. auto (default): only where the Trainer cannot replay an OOM "
                  "(FSDP); true: on every step that could need it; false: never."},
    )

    def __post_init__(self) -> None:
        if self.fsdp:
            raise ValueError(
                "--fsdp: the memfit Trainer does not support FSDP yet (it hooks the model before Accelerate shards "
                "it); with FSDP2, call memfit.fit after fully_shard in your own training loop"
            )
        super().__post_init__()
        if self.memfit_method not in METHODS:
            raise UnknownMethodError(
                f"--memfit_method {self.memfit_method!r} is unknown; choose one of {', '.join(METHODS)}"
            )
        if self.memory_budget is not None and self.memory_threshold is not None:
            if parse_bytes(self.memory_budget) != int(self.memory_threshold * 10**9):
                raise ValueError(
                    f"--memory_budget {self.memory_budget} and --memory_threshold {self.memory_threshold} (GB) "
                    "disagree; give only one of them"
                )
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # fail early on a malformed size
        if self.memfit_method == "precomputed" and not self.memfit_plans_file:
            raise ValueError("--memfit_method precomputed needs --memfit_plans_file")
        if str(self.memfit_backstop).lower() not in ("auto", "true", "false"):
            raise ValueError(f"--memfit_backstop {self.memfit_backstop!r}: give auto, true or false")
        hf_checkpointing = self.gradient_checkpointing or getattr(self, "activation_checkpointing", False)
        if hf_checkpointing and self.memfit_method != "none":
            raise ValueError(
                "--gradient_checkpointing and memfit both checkpoint: drop --gradient_checkpointing "
                "(--memfit_method full does the same)"
            )

    @property
    def memfit_budget_bytes(self) -> int | None:
        """The budget in bytes, from either flag, or None."""
        if self.memory_budget is not None:
            return parse_bytes(self.memory_budget)
        if self.memory_threshold is not None:
            return int(self.memory_threshold * 10**9)
        return None


@dataclass
class TrainingArguments(MemfitArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus memfit's flags (all optional)."""


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class _MemfitCallback(transformers.TrainerCallback):
    """Keeps the memory model in each checkpoint folder."""

    def __init__(self, trainer: "MemfitTrainerMixin"):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder) and state.is_world_process_zero:
            with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self.trainer.memfit.state_dict(), fh)
        return control


class MemfitTrainerMixin:
    """What memfit adds to a ``transformers.Trainer`` (sub)class, placed before it in the bases.

    Accepts the arguments of the Trainer class it is mixed into, and ``memfit_method``: a
    :class:`~memfit.methods.Method` instance to run instead of ``args.memfit_method`` (how the
    ckptplan peer and the oracle of :mod:`memfit.bench` run their plans). With plain
    ``transformers.TrainingArguments`` it runs method ``dynamic`` with no budget (records
    only).

    Attributes:
        memfit: the :class:`~memfit.runtime.Controller` hooked on the model.
    """

    def __init__(self, *args: Any, memfit_method: Method | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        a = self.args
        method: str | Method = memfit_method or getattr(a, "memfit_method", "dynamic")
        method_kwargs: dict[str, Any] = {}
        if method == "precomputed":
            method_kwargs["path"] = a.memfit_plans_file
        if method == "static" and getattr(a, "memfit_max_shape", None):
            method_kwargs["max_shape"] = tuple(int(x) for x in a.memfit_max_shape.split(","))
        if method == "dynamic":
            method_kwargs["backstop"] = {"true": True, "false": False}.get(str(getattr(a, "memfit_backstop", "auto")).lower(), "auto")
        log = rank_path(getattr(a, "memfit_log", None) or os.path.join(a.output_dir, STEPS_FILE), a.process_index, a.world_size)
        # Each rank has its own budget (its own process cap), plans for its own batches and
        # writes its own records; rank 0 merges the summaries.
        self.memfit: Controller = fit(
            self.model, getattr(a, "memfit_budget_bytes", None), method, log=log, margin=getattr(a, "memfit_margin", None), **method_kwargs
        )
        self._window: list[tuple[dict[str, Any], dict[str, Any], Any]] = []
        self._oom_total = 0
        self._grad_sync: GradientSync | None = None
        self._grad_sync_of: torch.nn.Module | None = None  # the DDP wrapper it syncs for
        self.add_callback(_MemfitCallback(self))

    # ------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        inner = getattr(optimizer, "optimizer", optimizer)
        self.memfit.set_optimizer(inner)
        inner.register_step_post_hook(lambda *_: self._window.clear())
        return optimizer

    # ------------------------------------------------------------ OOM replay
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step; on OOM, replays the accumulation window (NOTE [OOM replay])."""
        if self.memfit.method.measures_only:
            # Nothing to make safer: the OOM goes to the caller as it is (Accelerate's
            # find_executable_batch_size, behind --auto_find_batch_size, catches it).
            return super().training_step(model, inputs, num_items_in_batch)
        # an OOM is replayed below, except with several FSDP ranks (NOTE [OOM replay])
        self.memfit.replays_ooms = not (world_size() > 1 and is_fsdp(model))
        sync = self._lockstep_sync(model)
        if sync is not None:
            model = model.module  # no collective inside a micro-step (NOTE [Lockstep under DDP])
        self._window.append((inputs, _rng_state(), num_items_in_batch))
        replay = False
        for _ in range(_MAX_OOM_RETRIES + 1):
            failed = False
            try:
                if replay:
                    self._replay_window_head(model)
                loss = super().training_step(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError as err:
                if world_size() > 1 and is_fsdp(model):
                    raise torch.OutOfMemoryError(
                        f"{err}\nmemfit: under FSDP with several ranks a step cannot be replayed on one rank alone "
                        "(NOTE [OOM replay] in memfit/hf.py); raise --memfit_margin or --memory_budget"
                    ) from err
                failed = True  # recover outside the except block, so its frames are freed
                message = str(err)
            if not failed:
                if sync is not None and self.accelerator.sync_gradients:
                    sync.sync()
                return loss
            self._recover_from_oom(model, message)
            replay = True
        attempts = self.memfit.pending_oom_attempts
        raise BudgetTooSmallError(
            f"still out of memory after {_MAX_OOM_RETRIES} replays with safer plans; the last: "
            f"{describe_attempt(attempts[-1], len(self.memfit.blocks)) if attempts else 'not recorded'}. Raise "
            "--memory_budget or --memfit_margin, or lower the batch size"
        )

    def _lockstep_sync(self, model: torch.nn.Module) -> GradientSync | None:
        """The gradient sync replacing DDP's, or None to train through DDP as it is.

        Only when an OOM can be replayed: the method adapts its plans (``full`` and
        ``precomputed`` cannot, and keep DDP's overlapped sync).
        """
        method = self.memfit.method
        adapts = method.adapts
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if not (ddp and adapts and getattr(self.args, "memfit_lockstep", True) and world_size() > 1):
            return None
        if self._grad_sync is None or self._grad_sync_of is not model:
            buffers = list(model.module.buffers()) if model.broadcast_buffers else []
            self._grad_sync = GradientSync(model.module.parameters(), buffers, group=model.process_group)
            self._grad_sync_of = model
        return self._grad_sync

    def _recover_from_oom(self, model: torch.nn.Module, message: str) -> None:
        self._oom_total += 1
        self.memfit.note_oom(message)  # raises when no safer plan exists
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _replay_window_head(self, model: torch.nn.Module) -> None:
        """Re-run the window's earlier micro-batches, then restore the failed one's RNG."""
        self.memfit.replaying = True
        try:
            for inputs, rng, n_items in self._window[:-1]:
                _set_rng_state(rng)
                super().training_step(model, inputs, n_items)
        finally:
            self.memfit.replaying = False
        _set_rng_state(self._window[-1][1])

    # ------------------------------------------------------------ logs and files
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        records = self.memfit.records if "loss" in logs else []
        if records:
            last = records[-1]
            logs["memfit/peak_gib"] = round(last.peak_allocated_bytes / 2**30, 4)
            logs["memfit/n_checkpointed"] = last.n_checkpointed
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint:
            folder = resume_from_checkpoint
            if folder is True:
                folder = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            state_path = os.path.join(folder, STATE_FILE) if folder else None
            if state_path and os.path.exists(state_path):
                with open(state_path, encoding="utf-8") as fh:
                    self.memfit.load_state_dict(json.load(fh))
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.write_summary()
        return output

    def write_summary(self) -> dict[str, Any] | None:
        """Write ``memfit_summary.json``, and for methods with a memory model ``memfit_plans.json``
        (for ``precomputed``) and ``memfit_state.json`` (the model, as in a checkpoint folder).

        With several ranks, each writes ``memfit_summary.rank{r}.json``; rank 0 then merges
        every rank's step records into ``memfit_summary.json``, with ``per_rank`` peaks.
        """
        a = self.args
        os.makedirs(a.output_dir, exist_ok=True)
        if a.world_size > 1:
            with open(rank_path(os.path.join(a.output_dir, SUMMARY_FILE), a.process_index, a.world_size), "w") as fh:
                json.dump(summarize(self.memfit.records).to_dict() if self.memfit.records else {}, fh, indent=1)
            self.accelerator.wait_for_everyone()
        if not self.is_world_process_zero() or not self.memfit.records:
            return None
        if a.world_size > 1:
            steps = os.path.join(a.output_dir, STEPS_FILE) if not a.memfit_log else a.memfit_log
            per_rank = {r: [StepRecord.from_dict(d) for d in read_jsonl(rank_path(steps, r, a.world_size))] for r in range(a.world_size)}
            summary = summarize([rec for recs in per_rank.values() for rec in recs])
            summary.per_rank = {str(r): summarize(recs).to_dict() for r, recs in per_rank.items() if recs}
        else:
            summary = self.memfit.summary()
        data = summary.to_dict()
        data.update(self.memfit.meter.run_stats())  # the allocator's retries and device allocations (CUDA)
        with open(os.path.join(a.output_dir, SUMMARY_FILE), "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
        if self.memfit.method.learns:
            self.memfit.save_plans(os.path.join(a.output_dir, "memfit_plans.json"))
            # the memory model as the run ended: to resume from, or to read what it predicted
            with open(os.path.join(a.output_dir, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self.memfit.state_dict(), fh)
        return data


class Trainer(MemfitTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that trains inside ``args.memory_budget`` (:class:`MemfitTrainerMixin`)."""


def with_memfit(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass) with memfit's planning and OOM replay.

    The class returned is ``MemfitTrainerMixin`` placed before ``trainer_cls``, so the mixin's
    ``training_step`` wraps the subclass's own (TRL's activation-offloading context included)
    and replays through it. Its arguments are ``trainer_cls``'s plus ``memfit_method``; the
    budget flags are read from ``args`` (a :class:`MemfitArguments` subclass of the class's own
    arguments type; without them: method ``dynamic``, no budget).

    Raises:
        TypeError: ``trainer_cls`` is not a ``transformers.Trainer`` subclass.

    Example:
        >>> import transformers
        >>> class MyTrainer(transformers.Trainer): ...
        >>> MemfitMyTrainer = with_memfit(MyTrainer)
        >>> MemfitMyTrainer.__mro__[1:3] == (MemfitTrainerMixin, MyTrainer)
        True
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"with_memfit needs a transformers.Trainer subclass, not {trainer_cls!r}")
    if issubclass(trainer_cls, MemfitTrainerMixin):
        return trainer_cls
    return type(
        trainer_cls.__name__,
        (MemfitTrainerMixin, trainer_cls),
        {"__doc__": f"``{trainer_cls.__module__}.{trainer_cls.__qualname__}`` with memfit (:class:`MemfitTrainerMixin`).",
         "__module__": __name__, "__qualname__": trainer_cls.__qualname__},
    )


def rank_path(path: str, rank: int, world_size: int) -> str:
    """``memfit_steps.jsonl`` → ``memfit_steps.rank1.jsonl`` when there are several ranks."""
    if world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"
