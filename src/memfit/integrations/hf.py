"""Hugging Face Trainer integration: swap two classes and a script trains under a budget.

    from memfit import Trainer, TrainingArguments   # instead of transformers'

``TrainingArguments`` adds the budget flags (``--memory_budget 6GiB``, or the original
scripts' ``--memory_threshold 6`` in GB) and the method; ``Trainer`` hooks the model with
:func:`memfit.fit`, writes ``<output_dir>/memfit_steps.jsonl`` (one line per micro-step,
flushed) and ``memfit_summary.json``, adds ``memfit/peak_gib`` and
``memfit/n_checkpointed`` to the Trainer's logs, keeps the memory model in every checkpoint
folder (a resumed run needs no new warm-up) and survives CUDA OOMs. Before it opens its records
it checks the budget against weights, gradients and the optimizer state ``--optim`` will make
(optim_state.py) and refuses an ``--output_dir`` holding an earlier run (run_dir.py); it prints
one line as training starts and a short summary at its end (summary_text.py).

The memfit behaviour lives in two mixins, so that any ``transformers.Trainer`` subclass can
have it: :class:`MemfitArguments` (the flags) and :class:`MemfitTrainerMixin` (hooks, OOM
replay, records). ``Trainer`` is the mixin on ``transformers.Trainer``; :func:`with_memfit`
puts it on another Trainer class (``memfit.trl.SFTTrainer`` is TRL's ``SFTTrainer`` with it, computing
TRL's loss through memfit's head).

# NOTE [OOM replay]
``training_step`` runs every micro-batch through the controller's replayer
(``Trainer.memfit.replay``, memfit/engine/run/replay.py), the same engine as ``Controller.run_step``.
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
collectives (parameter all-gathers, gradient reduce-scatters), so a replay on one rank cannot
be made local: every rank replays the window together (NOTE [Replay under FSDP] in
memfit/engine/run/replay.py); an OOM outside the blocks' forwards is a clear error there.

# NOTE [Hooked after sharding]
Under FSDP2 (``--fsdp`` with ``fsdp_config`` ``{"fsdp_version": 2}``, or an Accelerate config
file) Accelerate shards the model in place when training starts (``fully_shard`` replaces each
parameter by this rank's shard), after ``__init__``. memfit must count the shards, exclude the
parameters FSDP gathers and hold the sharded parameters' gradients, so the controller is made at
the first micro-step, on the sharded model and with the optimizer Accelerate prepared:
``Trainer.memfit`` is None until then, and the budget is checked then, per rank. Each rank
plans for its own batches under its own cap. Every micro-step reduce-scatters its gradients
(``set_requires_gradient_sync(True)``), also inside an accumulation window: FSDP2's skipped sync
accumulates unsharded gradients of the whole model on every rank, which defeats the budget, and
which a replay could not drop (they live inside FSDP, not in ``.grad``). FSDP1 and FSDP's own
activation checkpointing are refused (:func:`check_fsdp_plugin`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import transformers

from memfit.engine.budget import Budget, parse_bytes
from memfit.engine.ranks import world_size
from memfit.integrations.distributed import GradientSync
from memfit.errors import FlagError, MissingFileError
from memfit.engine.methods import METHODS, Method, UnknownMethodError
from memfit.engine.parts.optim_state import expected_state_bytes
from memfit.engine.parts.optimizer_step import expected_step_bytes
from memfit.engine.records import StepRecord, read_jsonl, summarize
from memfit.integrations.run_dir import claim_output_dir
from memfit.engine.run.controller import DEEPSPEED_INSTEAD, Controller, check_static_need_of, fit, weights_saved_of
from memfit.engine.parts.host_weights import weights_words
from memfit.engine.summary_text import end_summary, parameters_words, start_line
from memfit.engine.parts.treatments import KEEP, TREATMENTS

__all__ = [
    "MemfitArguments", "TrainingArguments", "MemfitTrainerMixin", "Trainer", "with_memfit", "STATE_FILE", "rank_path",
    "check_fsdp_plugin",
]

STATE_FILE = "memfit_state.json"
STEPS_FILE = "memfit_steps.jsonl"
SUMMARY_FILE = "memfit_summary.json"
#: ``--memfit_host_weights``' values and the ``memfit.fit(host_weights=...)`` each means (NOTE [Weights on the host])
HOST_WEIGHTS_FLAG = {"auto": "auto", "on": True, "off": False}
#: ``--memfit_head``'s values and the ``memfit.fit(head=...)`` each means (NOTE [The head by default])
HEAD_FLAG = MappingProxyType({"auto": "auto", "plan": True, "keep": False})
logger = logging.getLogger(__name__)


# NOTE [--torch_compile compiles the blocks]
# Hugging Face's --torch_compile compiles the whole model, and with it memfit's hooks: Dynamo
# breaks its graph at each of them and the treatments' checkpoint and saved-tensor hooks, which
# leaves it slower than compiled blocks and its saved tensors out of the plans' reach. So with the
# memfit Trainer the flag asks for memfit's compiled blocks instead (each block's body compiled
# inside the treatments, and the loss: NOTE [Compiled blocks], blocks.py), with its
# --torch_compile_backend and --torch_compile_mode; the arguments then say torch_compile False
# so that the Trainer and Accelerate compile nothing more, and memfit_compile_flag keeps which
# flag asked (the start line names it). --memfit_compile is the same request by memfit's name.


@dataclass
class MemfitArguments:
    """memfit's flags (all optional), mixed into a ``transformers.TrainingArguments`` subclass
    before it: ``class Args(MemfitArguments, transformers.TrainingArguments)``."""

    memory_budget: str | None = field(
        default=None,
        metadata={"help": "Memory budget of the training process: '6GiB' (6*2**30 bytes), '6GB' (6*10**9) or bytes; "
                  "units are read as written, case included ('6gb' is refused, naming both readings)."},
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
    memfit_treatments: str = field(
        default="auto",
        metadata={"help": "How the planner may free a block's activation memory, comma-separated: "
                  + ", ".join(f"{t.name} ({t.help})" for t in TREATMENTS.values() if t.name != KEEP)
                  + ". Per batch and block it picks the "
                  "cheapest mix that fits, from each treatment's measured bytes and time. recompute is always "
                  "available, named or not (warm-up, --memfit_method full and OOM replays use it). Default: auto: "
                  "recompute; elementwise, tiled_mlp and recompute_tiled for eager blocks with a gated MLP (decoder "
                  "LLMs) to tile; host_checkpoint for blocks on a GPU, and host_checkpoint_tiled for those of them "
                  "with a gated MLP to tile; lean for eager bf16 or fp16 blocks with norms or LoRA layers; selective with "
                  "--memfit_compile."},
    )
    memfit_host_budget: str | None = field(
        default=None,
        metadata={"help": "Pinned host memory the treatments that move tensors to the host (offload, host_checkpoint) "
                  "may hold, per rank: '16GiB', '16GB' or bytes. Default: half of what the host has available at the "
                  "start, shared among the ranks of one host."},
    )
    memfit_host_weights: str = field(
        default="auto",
        metadata={"help": "LoRA's frozen block weights in pinned host memory between uses, where a batch needs the room: "
                  "auto (on a GPU with host_checkpoint), on, off."},
    )
    memfit_compile: bool = field(
        default=False,
        metadata={"help": "Compile each block's body with torch.compile inside memfit's wrapper, the treatments "
                  "around it, and the model's loss function (NOTE [Compiled blocks]); there the selective treatment is "
                  "the body compiled again under torch.compile's activation memory budget 0.5. --torch_compile "
                  "does the same with the memfit Trainer (NOTE [--torch_compile compiles the blocks])."},
    )
    memfit_head: str = field(
        default="auto",
        metadata={"help": "The LM head of a causal LM (final norm -> lm_head -> loss) as a part memfit plans per batch: "
                  "kept, or its logits and loss computed a chunk of tokens at a time (never the whole float32 tokens x "
                  "vocab), whichever the budget and the measured time call for. auto: where memfit "
                  "recognises the head, --memfit_method is dynamic or static, a budget is given and the model is "
                  "called with labels (default); plan: plan it with any method (none and full, which plan no head, chunk it "
                  "on every step), or stop where memfit cannot; keep: never. "
                  "Under a chunked head a training step returns no logits."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train into an --output_dir that holds an earlier run: its memfit records, summary and plans are "
            "removed first (checkpoint folders stay). Without it such a folder is refused unless "
            "--resume_from_checkpoint continues the run (NOTE [Earlier runs in the output folder], run_dir.py)."
        },
    )

    def __post_init__(self) -> None:
        if self.output_dir and os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise FlagError(f"--output_dir {self.output_dir} is a file; name a folder (new or existing)")
        super().__post_init__()
        if self.memfit_method not in METHODS:
            raise UnknownMethodError(
                f"--memfit_method {self.memfit_method!r} is unknown; choose one of {', '.join(METHODS)}"
            )
        budget = self.memfit_budget  # refuses a malformed --memory_budget
        if self.memory_threshold is not None and self.memory_threshold <= 0:
            raise FlagError(f"--memory_threshold {self.memory_threshold:g}: give a positive number of GB (10**9 bytes)")
        if self.memory_budget is not None and self.memory_threshold is not None and budget.bytes != int(self.memory_threshold * 10**9):
            raise FlagError(
                f"--memory_budget {self.memory_budget} and --memory_threshold {self.memory_threshold:g} (GB) "
                "disagree; give only one of them"
            )
        if self.memfit_host_budget is not None:
            try:
                parse_bytes(self.memfit_host_budget, argument="--memfit_host_budget")
            except ValueError as err:
                raise FlagError(str(err)) from None
        if self.memfit_margin is not None and not 0 <= self.memfit_margin < 1:
            raise FlagError(f"--memfit_margin {self.memfit_margin}: give a share of the budget in [0, 1), e.g. 0.05")
        if self.memfit_method == "precomputed" and not self.memfit_plans_file:
            raise FlagError(
                "--memfit_method precomputed needs --memfit_plans_file (the memfit_plans.json of a dynamic run)"
            )
        if self.memfit_plans_file and not os.path.isfile(self.memfit_plans_file):
            raise MissingFileError(
                f"--memfit_plans_file {self.memfit_plans_file}: no such file; give the memfit_plans.json a dynamic "
                "run wrote in its --output_dir"
            )
        if self.memfit_max_shape is not None:
            max_shape(self.memfit_max_shape)  # fail early on a malformed shape
        names = treatment_names(self.memfit_treatments)
        self.memfit_treatments = "auto" if names is None else ",".join(names)
        self.memfit_compile_flag = "--memfit_compile" if self.memfit_compile else None
        if getattr(self, "torch_compile", False):  # NOTE [--torch_compile compiles the blocks]
            self.memfit_compile_flag = "--torch_compile"
            self.memfit_compile_options = {
                k: v for k, v in (("backend", self.torch_compile_backend), ("mode", self.torch_compile_mode)) if v
            }
            self.memfit_compile = True
            self.torch_compile, self.torch_compile_backend, self.torch_compile_mode = False, None, None
        if self.memfit_head not in HEAD_FLAG:
            raise FlagError(f"--memfit_head {self.memfit_head!r}: give auto, plan or keep")
        if self.memfit_host_weights not in HOST_WEIGHTS_FLAG:
            raise FlagError(f"--memfit_host_weights {self.memfit_host_weights!r}: give auto, on or off")
        if str(self.memfit_backstop).lower() not in ("auto", "true", "false"):
            raise FlagError(f"--memfit_backstop {self.memfit_backstop!r}: give auto, true or false")
        # the flag's newer name first (reading the old one warns where both exist; older versions have only it)
        hf_checkpointing = getattr(self, "activation_checkpointing", None)
        if hf_checkpointing is None:
            hf_checkpointing = self.gradient_checkpointing
        fsdp_config = self.fsdp_config if self.fsdp and isinstance(self.fsdp_config, dict) else {}
        _check_fsdp(fsdp_config.get("version", fsdp_config.get("fsdp_version", 2)),
                    fsdp_config.get("activation_checkpointing", False))
        if hf_checkpointing and self.memfit_method != "none":
            raise FlagError(
                "--gradient_checkpointing and memfit both checkpoint: drop --gradient_checkpointing "
                "(--memfit_method full does the same)"
            )

    @property
    def memfit_budget(self) -> Budget | None:
        """The budget as the user gave it, from either flag (``--memory_threshold 8`` is ``8 GB``), or None.

        Raises:
            FlagError: a ``--memory_budget`` that is not a budget (NOTE [A budget as typed] in budget.py).
        """
        if self.memory_budget is not None:
            try:
                return Budget.parse(self.memory_budget, "--memory_budget")
            except ValueError as err:
                raise FlagError(str(err)) from None
        if self.memory_threshold is not None:
            return Budget(int(self.memory_threshold * 10**9), f"{self.memory_threshold:g} GB", "GB", "--memory_threshold")
        return None

    @property
    def memfit_budget_bytes(self) -> int | None:
        """The budget in bytes, from either flag, or None."""
        budget = self.memfit_budget
        return None if budget is None else budget.bytes


def _check_fsdp(version: Any, activation_checkpointing: Any) -> None:
    """Refuse what memfit cannot run under: FSDP1, and FSDP's own activation checkpointing.

    Raises:
        FlagError: naming the setting to change.
    """
    if str(version) not in ("2", "2.0"):
        raise FlagError(
            f"--fsdp with fsdp_version {version}: memfit runs under FSDP2 only; set \"fsdp_version\": 2 in --fsdp_config "
            "(or fsdp_version: 2 in the Accelerate config file)"
        )
    if str(activation_checkpointing).lower() in ("true", "1"):
        raise FlagError(
            "FSDP's activation_checkpointing and memfit both checkpoint: drop \"activation_checkpointing\" from "
            "--fsdp_config (fsdp_activation_checkpointing in the Accelerate config file); --memfit_method full does the same"
        )


def check_fsdp_plugin(plugin: Any) -> None:
    """The FSDP settings Accelerate runs with (from ``--fsdp`` or its config file) suit memfit.

    Raises:
        FlagError: FSDP1, or FSDP's activation checkpointing on (:func:`_check_fsdp`).
    """
    _check_fsdp(getattr(plugin, "fsdp_version", 1), getattr(plugin, "activation_checkpointing", False))


def treatment_names(text: str) -> tuple[str, ...] | None:
    """``--memfit_treatments``' comma-separated names as a tuple (``keep`` and ``recompute`` are always
    allowed: NOTE [Recompute always at hand], treatments/__init__.py), or None for ``auto`` (``fit``'s default).

    Raises:
        FlagError: an unknown name, or none.
    """
    if str(text).strip().lower() == "auto":
        return None
    names = tuple(dict.fromkeys(n.strip().lower() for n in str(text).split(",") if n.strip() and n.strip().lower() != KEEP))
    choices = ", ".join(n for n in TREATMENTS if n != KEEP)
    unknown = [n for n in names if n not in TREATMENTS]
    if unknown or not names:
        raise FlagError(
            f"--memfit_treatments {text!r}: {f'unknown treatment {unknown[0]!r}' if unknown else 'no treatment'}; "
            f"give auto or one or more of {choices}, comma-separated (e.g. recompute,selective,offload)"
        )
    return names


@dataclass
class TrainingArguments(MemfitArguments, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus memfit's flags (all optional)."""


def _compile_option(args: Any) -> bool | dict[str, Any]:
    """``fit``'s ``compile`` from the arguments: False, True, or the backend and mode
    ``--torch_compile_backend``/``--torch_compile_mode`` gave (NOTE [--torch_compile compiles the blocks])."""
    if not getattr(args, "memfit_compile", False):
        return False
    return dict(getattr(args, "memfit_compile_options", None) or {}) or True


def max_shape(text: str) -> tuple[int, int]:
    """``--memfit_max_shape "8,128"`` → ``(8, 128)``.

    Raises:
        FlagError: not two positive integers separated by a comma.
    """
    parts = text.replace(" ", "").split(",")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise FlagError(
            f"--memfit_max_shape {text}: write the largest input as N,T (rows, tokens per row), e.g. 8,128"
        )
    return int(parts[0]), int(parts[1])


class _MemfitCallback(transformers.TrainerCallback):
    """Keeps the memory model in each checkpoint folder."""

    def __init__(self, trainer: "MemfitTrainerMixin"):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder) and state.is_world_process_zero and self.trainer.memfit is not None:
            with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self.trainer.memfit.state_dict(), fh)
        return control


def _memfit_places(args: Any, model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``fit`` places ``model`` (NOTE [A model larger than its card]): a CUDA run whose model is on the CPU, its
    blocks eager, not sharded, the weights part not turned off, and its parameters over the budget or the card's free
    memory (a model that fits both the Trainer moves as it always does)."""
    if device.type != "cuda" or any(p.device.type != "cpu" for p in model.parameters()) or _compile_option(args) \
            or HOST_WEIGHTS_FLAG[getattr(args, "memfit_host_weights", "auto")] is False or getattr(args, "fsdp", None):
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = getattr(args, "memfit_budget", None)
    room = min(torch.cuda.mem_get_info(device)[0], Budget.parse(budget, "--memory_budget").bytes if budget is not None else math.inf)
    return weights > room


class MemfitTrainerMixin:
    """What memfit adds to a ``transformers.Trainer`` (sub)class, placed before it in the bases.

    Accepts the arguments of the Trainer class it is mixed into, and ``memfit_method``: a
    :class:`~memfit.engine.methods.Method` instance to run instead of ``args.memfit_method`` (how the
    ckptplan peer and the oracle of :mod:`memfit.tools.bench` run their plans). With plain
    ``transformers.TrainingArguments`` it runs method ``dynamic`` with no budget (records
    only).

    Attributes:
        memfit: the :class:`~memfit.engine.Controller` hooked on the model.
    """

    def __init__(self, *args: Any, memfit_method: Method | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False):  # NOTE [DeepSpeed is refused] (controller.py)
            raise FlagError(f"--deepspeed: memfit does not run under DeepSpeed ZeRO; drop --deepspeed and {DEEPSPEED_INSTEAD}")
        a = self.args
        method: str | Method = memfit_method or getattr(a, "memfit_method", "dynamic")
        method_kwargs: dict[str, Any] = {}
        if method == "precomputed":
            method_kwargs["path"] = a.memfit_plans_file
        if method == "static" and getattr(a, "memfit_max_shape", None):
            method_kwargs["max_shape"] = max_shape(a.memfit_max_shape)
        if method == "dynamic":
            method_kwargs["backstop"] = {"true": True, "false": False}.get(str(getattr(a, "memfit_backstop", "auto")).lower(), "auto")
        #: every rank's step-record file is this path with the rank's suffix (rank_path)
        self._steps_path = getattr(a, "memfit_log", None) or os.path.join(a.output_dir, STEPS_FILE)
        log = rank_path(self._steps_path, a.process_index, a.world_size)
        self._log_path = log
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None:
            check_fsdp_plugin(plugin)

        # Each rank has its own budget (its own process cap), plans for its own batches and
        # writes its own records; rank 0 merges the summaries.
        def hook(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Controller:
            return self._hooked(fit(
                model, getattr(a, "memfit_budget", None), method, optimizer=optimizer, log=log,
                margin=getattr(a, "memfit_margin", None), announce=False,
                treatments=treatment_names(getattr(a, "memfit_treatments", "auto")),
                compile=_compile_option(a), head=self._memfit_head(), host_budget=getattr(a, "memfit_host_budget", None),
                host_weights=HOST_WEIGHTS_FLAG[getattr(a, "memfit_host_weights", "auto")],
                device=getattr(self, "_memfit_device", None), **method_kwargs,
            ))

        self._hook = hook
        self._pending_state: dict[str, Any] | None = None
        #: the controller; under FSDP, None until the first micro-step (NOTE [Hooked after sharding])
        self.memfit: Controller | None = None
        self._unhooked_before_first_step = False
        if plugin is None:
            self._check_static_need_before_optimizer()
            self.memfit = hook(self.model)
        self._grad_sync: GradientSync | None = None
        self._grad_sync_of: torch.nn.Module | None = None  # the DDP wrapper it syncs for
        self.add_callback(_MemfitCallback(self))

    def _loss_owner(self) -> str | None:
        """Who computes the loss instead of the model's head, or None: memfit then leaves the head to it and
        says so in the start line (NOTE [The head by default]). Here a Trainer class that overrides
        ``compute_loss`` (it may read ``outputs.logits``, which a chunked head does not make); a class that
        knows its loss overrides this (``memfit.trl.SFTTrainer``: NOTE [TRL's loss through memfit's head])."""
        overridden = type(self).compute_loss is not transformers.Trainer.compute_loss
        return f"{type(self).__name__}.compute_loss" if overridden else None

    def _memfit_head(self) -> bool | str:
        """``fit``'s ``head`` from ``--memfit_head`` (:data:`HEAD_FLAG`); under ``auto``, False where the
        Trainer class computes the loss itself (:meth:`_loss_owner`)."""
        head = HEAD_FLAG[getattr(self.args, "memfit_head", "keep")]
        return False if head == "auto" and self._loss_owner() else head

    def _hooked(self, ctl: Controller) -> Controller:
        """``ctl``, its start line naming who computes the head where the Trainer class does."""
        owner = self._loss_owner()
        if owner and ctl.head.part is None:
            ctl.head.words = f"LM head left to {owner}, its bytes counted with the rest of the step"
        return ctl

    def _check_static_need_before_optimizer(self) -> None:
        """Check weights + gradients + the optimizer state ``--optim`` will make against the budget.

        The optimizer is made when training starts; checking only then would fail a second
        time, with a larger need, after a first error that left its state out (NOTE [Expected
        optimizer state] in optim_state.py). An optimizer passed in, or one whose state
        cannot be known in advance, is checked by the runtime when it is set.

        Raises:
            BudgetTooSmallError: stating the whole need, in the format of
                :func:`memfit.engine.budget.check_static_need`.
        """
        a = self.args
        budget = getattr(a, "memfit_budget", None)
        if budget is None or self.optimizer is not None or self.optimizer_cls_and_kwargs is not None:
            return
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        state = expected_state_bytes(a.optim, trainable, a.optim_args)
        if state is None:
            logger.info("--optim %s: its state is counted once it exists (the first optimizer step)", a.optim)
        check_static_need_of(self.model, budget, state, f"optimizer state ({getattr(a.optim, 'value', a.optim)}, expected)",
                             transient_bytes=lambda free: expected_step_bytes(a.optim, trainable, a.weight_decay, free),
                             weights_saved=weights_saved_of(self.model, treatment_names(getattr(a, "memfit_treatments", "auto")),
                                                            _compile_option(a), host_budget=getattr(a, "memfit_host_budget", None),
                                                            host_weights=HOST_WEIGHTS_FLAG[getattr(a, "memfit_host_weights", "auto")],
                                                            device=getattr(self, "_memfit_device", None)))

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """The Trainer's move of the model, left to ``fit`` where the model's weights are over the budget or the card's
        free memory and the blocks' frozen weights may wait on the host (NOTE [A model larger than its card])."""
        if _memfit_places(self.args, model, device):
            self._memfit_device = device
            return
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.memfit is not None:  # under FSDP the controller is made later, with the optimizer
            self.memfit.set_optimizer(getattr(optimizer, "optimizer", optimizer))  # its steps close the accumulation window
        return optimizer

    # ------------------------------------------------------------ OOM replay
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step, through the controller's replayer: on an OOM, the accumulation window is
        replayed (NOTE [OOM replay])."""
        if self.memfit is None:
            self._hook_sharded(model)
        if self.memfit.method.measures_only:
            # Nothing to make safer: the OOM goes to the caller as it is (Accelerate's
            # find_executable_batch_size, behind --auto_find_batch_size, catches it).
            return super().training_step(model, inputs, num_items_in_batch)
        sync = self._lockstep_sync(model)
        if sync is not None:
            model = model.module  # no collective inside a micro-step (NOTE [Lockstep under DDP])
        step = super().training_step
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (NOTE [Hooked after sharding])
            def step(model, inputs, num_items_in_batch, _step=step):
                model.set_requires_gradient_sync(True)
                return _step(model, inputs, num_items_in_batch)
        loss = self.memfit.replay.run(step, (model, inputs, num_items_in_batch), raise_what=f"{self.memfit.budget.name if self.memfit.budget else '--memory_budget'} or --memfit_margin")
        if sync is not None and self.accelerator.sync_gradients:
            sync.sync()
        return loss

    def _hook_sharded(self, model: torch.nn.Module) -> None:
        """Hook the model Accelerate has just sharded, with its optimizer (NOTE [Hooked after sharding])."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self.memfit = self._hook(model, optimizer)
        if self._pending_state is not None:
            self.memfit.load_state_dict(self._pending_state)
        self._say(self._start_line())

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

    # ------------------------------------------------------------ logs and files
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        records = self.memfit.records if "loss" in logs and self.memfit is not None else []
        if records:
            last = records[-1]
            logs["memfit/peak_gib"] = round(last.peak_allocated_bytes / 2**30, 4)
            logs["memfit/n_checkpointed"] = last.n_checkpointed
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if self.memfit is None and self._unhooked_before_first_step:
            self.memfit = self._hook(self.model)  # hooked again after a train() that failed before its first step
        try:
            return self._train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            # all or nothing before the first step (NOTE [Setup is all or nothing], controller.py):
            # the model is left as it was, and a later train() hooks it again
            if self.memfit is not None and not self.memfit.records:
                self.memfit.remove()
                self.memfit, self._unhooked_before_first_step = None, True
            raise
        finally:
            if self.memfit is not None:  # hooked between train() calls, the heap unfrozen (NOTE [The collector's pauses])
                self.memfit.pauses.thaw()

    def _train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        a = self.args
        if isinstance(a, MemfitArguments):  # the flag is memfit's, not transformers.TrainingArguments'
            # the step-record file opens at the first record, so the folder is claimed here, where the
            # resume is known (NOTE [Earlier runs in the output folder] in run_dir.py)
            claim_output_dir(
                a.output_dir, self._log_path, overwrite=a.overwrite_output_dir,
                resume=bool(resume_from_checkpoint or a.resume_from_checkpoint), rank=a.process_index,
            )
        if resume_from_checkpoint:
            folder = resume_from_checkpoint
            if folder is True:
                folder = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            state_path = os.path.join(folder, STATE_FILE) if folder else None
            if state_path and os.path.exists(state_path):
                with open(state_path, encoding="utf-8") as fh:
                    self._pending_state = json.load(fh)
                if self.memfit is not None:
                    self.memfit.load_state_dict(self._pending_state)
        if self.memfit is not None:  # under FSDP: said when the model is hooked
            self._say(self._start_line())
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        self.write_summary()
        return output

    # ------------------------------------------------------------ what the user reads
    def _say(self, text: str) -> None:
        """Print ``text`` to stderr on the main process, unless ``--log_level`` is error or critical."""
        if self.is_world_process_zero() and str(self.args.log_level) not in ("error", "critical"):
            print(text, file=sys.stderr, flush=True)

    def _start_line(self) -> str:
        ctl = self.memfit
        kinds = [type(b.module).__name__ for b in ctl.blocks]
        params = list(self.model.parameters())
        adapter = next(iter(getattr(self.model, "peft_config", {}).values()), None)  # a peft model's config
        adapted = getattr(adapter, "target_modules", None) or ()
        adapted = [adapted] if isinstance(adapted, str) else sorted(adapted)
        words = parameters_words(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params),
                                 adapted, sum(hasattr(m, "lora_A") for m in self.model.modules()))
        compiled = (getattr(self.args, "memfit_compile_flag", None) or "") if ctl.blocks[0].compiled else None
        return start_line(ctl.method.name, ctl.budget, ctl.accounting, kinds, words, compiled) + ctl.head.start_words() + weights_words(ctl.parts.kinds)

    def write_summary(self) -> dict[str, Any] | None:
        """Write ``memfit_summary.json``, and for methods with a memory model ``memfit_plans.json``
        (for ``precomputed``) and ``memfit_state.json`` (the model, as in a checkpoint folder).

        With several ranks, each writes ``memfit_summary.rank{r}.json``; rank 0 then merges
        every rank's step records into ``memfit_summary.json``, with ``per_rank`` peaks.
        """
        a = self.args
        if self.memfit is None:
            return None  # no training step ran under FSDP: nothing was hooked
        os.makedirs(a.output_dir, exist_ok=True)
        if a.world_size > 1:
            with open(rank_path(os.path.join(a.output_dir, SUMMARY_FILE), a.process_index, a.world_size), "w") as fh:
                json.dump(self.memfit.summary().to_dict() if self.memfit.records else {}, fh, indent=1)
            self.accelerator.wait_for_everyone()
        if not self.is_world_process_zero() or not self.memfit.records:
            return None
        if a.world_size > 1:
            per_rank = {r: [StepRecord.from_dict(d) for d in read_jsonl(rank_path(self._steps_path, r, a.world_size))]
                        for r in range(a.world_size)}
            records = [rec for recs in per_rank.values() for rec in recs]
            summary = summarize(records, self.memfit.optimizer_steps)
            summary.per_rank = {str(r): summarize(recs).to_dict() for r, recs in per_rank.items() if recs}
        else:
            records = self.memfit.records
            summary = self.memfit.summary()
        self._say(end_summary(records, self.memfit.budget, self.memfit.optimizer_steps))
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
