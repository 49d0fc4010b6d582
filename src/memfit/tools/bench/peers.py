"""Peers: the best-known alternatives to memfit, run by ``memfit train`` for the comparison.

Each peer is applied before the Trainer is built and runs with ``--memfit_method none`` under
the same budget (cap), so memfit only measures (step records, peaks); one peer per run:

* ``--hf_checkpoint_every_n_layers N``: Hugging Face's own activation checkpointing of every
  N-th layer (non-reentrant; NOTE [Two names for Hugging Face's checkpointing]);
  ``--hf_checkpoint_offload`` adds its offload of the checkpointed layers' inputs to pinned
  host memory;
* ``--offload_activations``: TRL's activation offloading (``get_act_offloading_ctx_manager``,
  torchtune's ``OffloadActivations``): every activation the decoder layers save goes to pinned
  host memory during forward and comes back in backward, on a side stream; nothing is
  recomputed (NOTE [Offloading inside memfit's counter]; needs CUDA and TRL);
* ``--memfit_off``: plain ``transformers.Trainer``, no memfit hooks at all: what memfit's
  measuring costs, against ``none``. No step records or summary; on CUDA the budget is still the
  cap, and the allocator's peak over the run is written to :data:`PEER_FILE`;
* ``--compile_activation_memory_budget F`` (0 < F <= 1): ``torch.compile`` of every block with
  ``torch._functorch.config.activation_memory_budget = F``, the min-cut partitioner's
  relative knob (1: the default partition; smaller: it recomputes more, cheapest FLOPs first).
  F is relative to what the compiled graphs would save, not bytes: ``memfit bench`` sweeps it
  (``compile-0.25 compile-0.5 ...``) and ``memfit report`` names the fastest setting that
  stayed within the budget (NOTE [Compile inside the block wrappers]);
* ``--ckptplan_saving_fraction F`` (0 < F <= 1): the PyPI package ``ckptplan`` profiles the
  blocks at the largest batch of the training set and plans, by dynamic programming, which
  blocks to checkpoint to remove F of their activations; that plan runs for every batch
  through memfit's own checkpoint switches (NOTE [ckptplan as a peer]); swept like F above;
* Accelerate's ``find_executable_batch_size`` is the Trainer's own ``--auto_find_batch_size``
  (it changes the batch size, so it is reported apart).

A peer that cannot run here (the installed transformers lacks the option, ``ckptplan`` or TRL is
not installed, no CUDA for ckptplan's profiler or for offloading) fails with one :class:`PeerUnavailableError`;
``memfit bench`` records the configuration as ``skipped`` with that message and goes on. What a
peer measured about itself (compilations, ckptplan's plan) is written to
``<output_dir>/memfit_peer.json`` (:data:`PEER_FILE`), which ``memfit bench`` copies into its
result line (``peer_metrics``, ``note``).

# NOTE [Two names for Hugging Face's checkpointing]
Older transformers turn their checkpointing on with ``gradient_checkpointing_enable(
gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False)``; newer versions
renamed it ``activation_checkpointing_enable(activation_checkpointing_kwargs=None,
every_n_layers=1, offload=False)`` and keep the old name as a deprecated alias taking
``**kwargs``. Both checkpoint every ``every_n_layers``-th ``GradientCheckpointingLayer`` (counted
from the first) and with ``offload`` hold the checkpointed inputs in pinned host memory
(``torch.autograd.graph.save_on_cpu``). The peer calls the new name when its signature has
``every_n_layers``, else the old one when its own does (and ``offload`` when asked), else it is
unavailable.

# NOTE [Offloading inside memfit's counter]
memfit counts saved tensors with its own ``saved_tensors_hooks``, entered when the model's
forward starts; hooks nest and only the innermost pair runs (NOTE [Who sees a checkpointed
block's tensors] in accounting.py). TRL's ``SFTTrainer`` enters its offloading context around
the whole training step, outside the model's forward, where under memfit it would never run. So
the peer enters TRL's context when the decoder body (the module holding the layers) starts its
training forward, inside memfit's counter, and leaves it when the body returns, before the
counter closes: saved-tensor hooks must close in the reverse order they opened. memfit's
counter then sees nothing of the body; on CUDA the records' peaks are the allocator's, which the
offloading does move. Leaving pops only the hooks: the tensors already packed keep their unpack
hook through backward, while TRL's end-of-step cleanup (a device sync of both streams and its
stashes cleared) would run between forward and backward, so it is skipped; TRL's backward
hooks free the stashes, and the next step's enter clears them as TRL's does. The context is made
at the first training forward, when the model is on its device: TRL records the parameters'
addresses so as never to offload them. The head and the loss run outside it, as TRL keeps the
output head from being offloaded.

# NOTE [Compile inside the block wrappers]
Compiling the whole model (``--torch_compile``, ``model.compile()``) puts memfit's Python in
the traced region: its root hooks and block switches (``time.perf_counter``, entering
``saved_tensors_hooks``, storage sizes, the memory model's fit) break the graph, and a break
inside the encoder's layer loop makes Dynamo skip the encoder's frame, which then runs
eagerly. So the peer compiles each block's own ``forward`` before memfit wraps the block
(regional compilation, as PyTorch's recipe and Accelerate's ``use_regional_compilation``
do): memfit's wrappers and hooks run eagerly around the compiled graphs, blocks of one class
share their graphs, and the embeddings and the head run eagerly. The partitioner's knob applies
per graph, so F of each block's activations is F of all the blocks'. memfit still counts what
the compiled blocks save: AOTAutograd saves its tensors through ``saved_tensors_hooks``. With
dynamic padding each new length recompiles until Dynamo marks the dimension dynamic
(usually once), and evaluation compiles again; the run counts frames, recompiles, lazy backward
compilations and the seconds spent, logs them and writes them to :data:`PEER_FILE`
(``TORCH_LOGS=recompiles`` prints each recompile's reason). Dynamo's in-memory cache does not
depend on the knob, so the peer starts from a clean cache (``torch._dynamo.reset()``): a graph
compiled at another F earlier in the process would otherwise be reused.

# NOTE [ckptplan as a peer]
ckptplan (0.1.0rc1) plans from one example shape: ``declare_blocks``, ``profile_blocks``
(activation bytes from the CUDA allocator around an isolated forward, recompute time from a
real recompute; on CPU its profiles are timing-only and ``plan_checkpoints`` refuses them), then
``plan_checkpoints``. Its ``apply_plan`` runs the blocks as one chain, each block's output the
next one's only input, which does not fit BERT (layers take attention masks) or Swin
(stages downsample between layers). So the peer takes memfit's blocks (blocks.py), captures
each block's real inputs in one no-grad forward of the largest batch of the training set (the
per-device batch size of the longest examples, padded as the collator pads), profiles each
block with ckptplan on its own inputs, and plans with ``dynamic_programming``. The chosen
blocks then run checkpointed for every batch through memfit's switches (non-reentrant,
RNG-preserving: the checkpoint memfit itself uses), as the method ``ckptplan``; memfit only
measures. Profiling runs before training and before the cap; its seconds are recorded
(``ckptplan_profile_s``), not counted in the training time.

ckptplan's target is a budget of block activations in bytes, or a share of them to save. A
user with a process budget would have to turn the budget into block bytes: the budget less
weights, gradients, optimizer state, the head's and backward's transients and the allocator's
slack, which is memfit's own memory model. The peer therefore takes the share
(``target_kind="activation_saving_fraction"``), which needs no such model, and the benchmark
sweeps it and reports the fastest share that fit: a tuning by trial that favours the peer, as
a user would need several runs (and OOMs) to find it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.engine.parts.blocks import find_blocks
from memfit.engine.budget import apply_cuda_cap
from memfit.errors import FlagError, UserError
from memfit.engine.methods import Decision, Method
from memfit.engine.plan.planner import Plan
from memfit.engine.shapes import first_tensor

if TYPE_CHECKING:
    from memfit.engine.plan.planning import Planning
    from memfit.tasks import TaskBundle

__all__ = [
    "PEER_FILE",
    "PeerArguments",
    "PeerUnavailableError",
    "Peer",
    "HfEveryN",
    "OffloadActivations",
    "Plain",
    "TorchCompile",
    "Ckptplan",
    "CkptplanPlan",
    "make_peer",
    "plan_blocks",
]

logger = logging.getLogger(__name__)

#: What a peer measured about itself, in the run's output folder.
PEER_FILE = "memfit_peer.json"


class PeerUnavailableError(UserError, RuntimeError):
    """The peer cannot run here (package, option or device missing); the message says what to do."""


@dataclass
class PeerArguments:
    """Alternatives to memfit, for the benchmark's comparison (all off by default; one at a time)."""

    #: the flag that turns on each peer
    PEER_FLAGS: ClassVar[tuple[str, ...]] = (
        "hf_checkpoint_every_n_layers", "compile_activation_memory_budget", "ckptplan_saving_fraction",
        "offload_activations", "memfit_off",
    )

    hf_checkpoint_every_n_layers: int | None = field(
        default=None,
        metadata={"help": "Peer: Hugging Face activation checkpointing of every N-th layer (needs --memfit_method none)."},
    )
    hf_checkpoint_offload: bool = field(
        default=False,
        metadata={"help": "Peer: with --hf_checkpoint_every_n_layers, offload the checkpointed inputs to host memory."},
    )
    compile_activation_memory_budget: float | None = field(
        default=None,
        metadata={
            "help": "Peer: torch.compile every block with torch._functorch.config.activation_memory_budget = F, "
            "0 < F <= 1 (1: the default partition; less: more recompute) (needs --memfit_method none)."
        },
    )
    compile_backend: str | None = field(
        default=None,
        metadata={
            "help": "Backend of the compile peer (default inductor; aot_eager_decomp_partition runs the same "
            "partitioner without generating code)."
        },
    )
    ckptplan_saving_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Peer: ckptplan's plan removing this share (0 < F <= 1) of the blocks' activations at the largest "
            "batch of the training set, run for every batch (needs CUDA, pip install ckptplan, --memfit_method none)."
        },
    )
    offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Peer: TRL's activation offloading of the decoder layers' saved tensors to pinned host memory "
            "(needs CUDA, pip install trl, --memfit_method none)."
        },
    )
    memfit_off: bool = field(
        default=False,
        metadata={
            "help": "Peer: plain transformers.Trainer, no memfit hooks (no step records; the budget stays the CUDA "
            "cap) (needs --memfit_method none)."
        },
    )

    oracle: bool = field(
        default=False,
        metadata={
            "help": "Benchmark: before training, sweep the run's batches for the fewest first blocks that fit each one "
            "under the budget (memfit/tools/bench/oracle.py), then train on those plans."
        },
    )
    oracle_sweep_only: bool = field(
        default=False,
        metadata={"help": "With --oracle: sweep, write memfit_oracle_plans.json and stop, so that a later run "
                  "(--oracle_plans_file) trains on the plans from a cold start, as the other methods do."},
    )
    oracle_plans_file: str | None = field(
        default=None,
        metadata={"help": "With --oracle: train on an earlier sweep's plans (memfit_oracle_plans.json); no sweep."},
    )

    def __post_init__(self) -> None:
        if (self.oracle_sweep_only or self.oracle_plans_file) and not self.oracle:
            raise FlagError("--oracle_sweep_only and --oracle_plans_file go with --oracle")
        if self.hf_checkpoint_offload and not self.hf_checkpoint_every_n_layers:
            raise FlagError("--hf_checkpoint_offload needs --hf_checkpoint_every_n_layers")
        if self.hf_checkpoint_every_n_layers is not None and self.hf_checkpoint_every_n_layers < 1:
            raise FlagError("--hf_checkpoint_every_n_layers must be at least 1")
        if self.compile_backend is not None and self.compile_activation_memory_budget is None:
            raise FlagError("--compile_backend needs --compile_activation_memory_budget")
        for flag in ("compile_activation_memory_budget", "ckptplan_saving_fraction"):
            value = getattr(self, flag)
            if value is not None and not 0 < value <= 1:
                raise FlagError(f"--{flag} {value}: give a share, 0 < F <= 1")
        given = [f"--{name}" for name in self.PEER_FLAGS if _is_set(getattr(self, name))]
        if len(given) > 1:
            raise FlagError(f"give one peer at a time: {' and '.join(given)}")


def _is_set(value: Any) -> bool:
    """A peer flag given on the command line (a number, or a switch turned on)."""
    return value is not None and value is not False


class Peer:
    """One peer for one run: applied to the model before the Trainer, active while it trains.

    Use as a context manager around building the Trainer, training and evaluating; it restores
    any global setting it changed on exit.
    """

    name: ClassVar[str] = ""
    #: whether the run trains with memfit's Trainer (only measuring); False: plain transformers.Trainer
    uses_memfit: ClassVar[bool] = True

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> Method | None:
        """Apply the peer to ``bundle.model``; return a method to run instead of ``none``, if any."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What the peer measured about itself: ``metrics`` (numbers, lists) and ``note`` (one line)."""
        return {"metrics": {}, "note": None}

    def write(self, output_dir: str) -> None:
        """Write :data:`PEER_FILE` in ``output_dir``."""
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, PEER_FILE), "w", encoding="utf-8") as fh:
            json.dump({"peer": self.name, **self.record()}, fh, indent=1)

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class HfEveryN(Peer):
    """Hugging Face's activation checkpointing of every ``n``-th layer (optionally offloaded)."""

    name = "hf-every-n"

    def __init__(self, n: int, offload: bool = False):
        self.n = n
        self.offload = offload

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> None:
        model = bundle.model
        kwargs: dict[str, Any] = {"every_n_layers": self.n, **({"offload": True} if self.offload else {})}
        # NOTE [Two names for Hugging Face's checkpointing]
        for method, kwargs_name in (
            ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # the newer name
            ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),  # the older one
        ):
            enable = getattr(model, method, None)
            if enable is not None and set(kwargs) <= set(inspect.signature(enable).parameters):
                enable(**{kwargs_name: {"use_reentrant": False}}, **kwargs)
                return None
        wanted = ", ".join(f"{k}=..." for k in kwargs)
        raise PeerUnavailableError(
            f"the installed transformers has neither activation_checkpointing_enable({wanted}) nor "
            f"gradient_checkpointing_enable({wanted}): peer hf-every-n is not available"
        )


def _decoder_body(model: nn.Module) -> nn.Module:
    """The module whose forward runs every block: the parent of the blocks' list (``model.model``
    of a Hugging Face causal LM, inside a ``PeftModel`` too).

    Raises:
        PeerUnavailableError: the blocks are not the items of one list inside the model.
    """
    names = [name.split(".") for name, _ in find_blocks(model)]
    common = names[0][:-1]
    if any(parts[:-1] != common for parts in names) or len(common) < 2:
        raise PeerUnavailableError(
            "peer offload needs the model's blocks as the items of one list below the root (a decoder's layers); "
            f"found {'.'.join(names[0])} ... {'.'.join(names[-1])}"
        )
    return model.get_submodule(".".join(common[:-1]))


def _offloading_factory() -> Any:
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except ImportError:
        raise PeerUnavailableError(
            "peer offload needs TRL's activation offloading: pip install 'memfit[llm]' (or pip install trl)"
        ) from None
    return get_act_offloading_ctx_manager


class OffloadActivations(Peer):
    """TRL's activation offloading around the decoder body (NOTE [Offloading inside memfit's counter]).

    Raises:
        PeerUnavailableError: (at ``prepare``) not on CUDA, or TRL is not installed.
    """

    name = "offload"

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._factory: Any = None
        self._ctx: Any = None
        self._open = False
        self._handles: list[Any] = []
        self.steps = 0

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> None:
        if training_args.device.type != "cuda":
            raise PeerUnavailableError(
                "peer offload needs CUDA: TRL's activation offloading moves saved activations from an accelerator "
                "to pinned host memory and back (on CPU there is nothing to move)"
            )
        self._factory = _offloading_factory()
        self._model = bundle.model
        body = _decoder_body(bundle.model)
        self._handles = [
            body.register_forward_pre_hook(self._enter),
            body.register_forward_hook(self._exit, always_call=True),
        ]
        return None

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation: TRL offloads training steps only
        if self._ctx is None:  # the model is on its device now: TRL records its parameters' addresses
            self._ctx = self._factory(self._model, warn_if_no_head=False)
        self._ctx.__enter__()
        self._open = True
        self.steps += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open = False
            # only the hooks: TRL's cleanup would sync between forward and backward
            torch.autograd.graph.saved_tensors_hooks.__exit__(self._ctx)

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def record(self) -> dict[str, Any]:
        return {"metrics": {"offload_steps": self.steps}, "note": f"TRL activation offloading in {self.steps} training forwards"}


class Plain(Peer):
    """Plain ``transformers.Trainer``: no memfit at all, so the run measures what memfit's hooks cost.

    On CUDA the budget is still the cap, and :meth:`record` gives the allocator's peak over the
    run (its evaluation included, with ``--do_eval``).
    """

    name = "plain"
    uses_memfit = False

    def __init__(self) -> None:
        self._device: torch.device | None = None

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> None:
        device = training_args.device
        if device.type == "cuda":
            budget = getattr(training_args, "memfit_budget_bytes", None)
            if budget is not None:
                apply_cuda_cap(budget, device)
            torch.cuda.reset_peak_memory_stats(device)
            self._device = device
        return None

    def record(self) -> dict[str, Any]:
        if self._device is None:
            return {"metrics": {}, "note": "plain transformers.Trainer, no memfit: time only (no CUDA allocator)"}
        metrics = {
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(self._device),
            "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(self._device),
        }
        return {"metrics": metrics, "note": "plain transformers.Trainer, no memfit: time and the CUDA allocator's peak"}


class TorchCompile(Peer):
    """``torch.compile`` of every block under ``activation_memory_budget`` (NOTE [Compile inside the block wrappers]).

    Args:
        budget: the partitioner's knob, 0 < F <= 1.
        backend: a ``torch.compile`` backend (``inductor``; ``aot_eager_decomp_partition`` runs
            the same partitioner without generating code).
    """

    name = "compile"

    def __init__(self, budget: float, backend: str = "inductor"):
        self.budget = budget
        self.backend = backend
        self.frames = 0
        self.lazy_backward = 0
        self.compile_s = 0.0
        self._block_classes: set[type] = set()
        self._started: float | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "TorchCompile":
        import torch._dynamo
        import torch._functorch.config
        from torch._dynamo.callback import callback_handler

        torch._dynamo.reset()  # its cache ignores the knob (NOTE [Compile inside the block wrappers])
        self._stack.enter_context(torch._functorch.config.patch(activation_memory_budget=self.budget))
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        self._stack.callback(callback_handler.remove_start_callback, self._on_start)
        self._stack.callback(callback_handler.remove_end_callback, self._on_end)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        logger.info("%s", self.record()["note"])

    def _on_start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def _on_end(self, *args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if self._started is not None:
            self.compile_s += time.perf_counter() - self._started
            self._started = None
        trigger = getattr(args[0], "callback_trigger", None) if args else None
        if trigger == CallbackTrigger.LAZY_BACKWARD:  # a backward graph compiled at its first backward
            self.lazy_backward += 1
        else:
            self.frames += 1

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> None:
        # the memfit Trainer's arguments turn --torch_compile into compiled blocks and say which flag asked
        if getattr(training_args, "torch_compile", False) or getattr(training_args, "memfit_compile", False):
            raise ValueError(
                "--torch_compile compiles the whole model, memfit's hooks included; the compile peer compiles each "
                "block itself (NOTE [Compile inside the block wrappers] in memfit/peers.py): drop --torch_compile "
                "and --memfit_compile"
            )
        import torch._dynamo

        if self.backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"--compile_backend {self.backend!r} is not a torch.compile backend here")
        for _, module in find_blocks(bundle.model):
            self._block_classes.add(type(module))
            # Before memfit wraps the block: its switch then calls the compiled forward.
            module.forward = torch.compile(module.forward, backend=self.backend)
        return None

    @property
    def recompiles(self) -> int:
        """Frames compiled again (new input shapes, eval mode): all but one per block class."""
        return max(0, self.frames - len(self._block_classes))

    def record(self) -> dict[str, Any]:
        metrics = {
            "compile_activation_memory_budget": self.budget,
            "compile_frames": self.frames,
            "compile_recompiles": self.recompiles,
            "compile_lazy_backward": self.lazy_backward,
            "compile_s": round(self.compile_s, 3),
        }
        note = (
            f"torch.compile ({self.backend}, activation_memory_budget {self.budget:g}): {self.frames} frames compiled "
            f"({self.recompiles} recompiles), {self.compile_s:.1f} s compiling"
        )
        return {"metrics": metrics, "note": note}


class CkptplanPlan(Method):
    """ckptplan's plan at the largest batch, run for every batch (NOTE [ckptplan as a peer]).

    Args:
        blocks: indices of memfit's blocks to checkpoint.
    """

    name = "ckptplan"

    def __init__(self, blocks: Sequence[int]):
        self.blocks = tuple(sorted(blocks))

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Any = None) -> Decision:
        return Decision(Plan(self.blocks))


def plan_blocks(plan: Any, names: Sequence[str]) -> tuple[int, ...]:
    """memfit's block indices of the blocks a ckptplan ``CheckpointPlan`` checkpoints.

    Args:
        plan: a ``ckptplan.CheckpointPlan`` whose block ids are memfit's block names.
        names: memfit's block names, in memfit's order (:func:`memfit.engine.parts.blocks.find_blocks`).

    Raises:
        ValueError: the plan's blocks are not ``names`` in that order.

    Example:
        >>> from types import SimpleNamespace as N
        >>> plan = N(decisions=[N(block_id="l.0", checkpointed=False), N(block_id="l.1", checkpointed=True)])
        >>> plan_blocks(plan, ["l.0", "l.1"])
        (1,)
    """
    ids = [d.block_id for d in plan.decisions]
    if ids != list(names):
        raise ValueError(f"the ckptplan plan is for blocks {ids}, not memfit's {list(names)}")
    return tuple(i for i, d in enumerate(plan.decisions) if d.checkpointed)


def _import_ckptplan() -> ModuleType:
    try:
        return importlib.import_module("ckptplan")
    except ImportError:
        raise PeerUnavailableError(
            "peer ckptplan needs the ckptplan package: pip install ckptplan==0.1.0rc1 (Python < 3.13, torch < 2.14); "
            "offline, bash benchmarks/carry_wheels.sh here and pip install --no-index .carry/wheels/*.whl there"
        ) from None


class Ckptplan(Peer):
    """ckptplan's static plan at the largest batch, run through memfit's switches (NOTE [ckptplan as a peer]).

    Args:
        saving_fraction: share of the blocks' activations to remove, 0 < F <= 1.

    Raises:
        PeerUnavailableError: ckptplan is not installed.
    """

    name = "ckptplan"

    def __init__(self, saving_fraction: float):
        self.saving_fraction = saving_fraction
        self.ckptplan = _import_ckptplan()
        self.shape: list[int] = []
        self.blocks: tuple[int, ...] = ()
        self.n_blocks = 0
        self.profile_s = 0.0
        self.predicted_bytes: tuple[int, int] = (0, 0)

    def prepare(self, bundle: "TaskBundle", training_args: Any) -> CkptplanPlan:
        model, device = bundle.model, training_args.device
        if not bundle.train_dataset:
            raise ValueError("the ckptplan peer plans on the largest training batch: it needs --do_train and training data")
        model.to(device)
        batch = _largest_batch(bundle.train_dataset, bundle.data_collator, training_args.per_device_train_batch_size)
        named = find_blocks(model)
        t0 = time.perf_counter()
        with _autocast(training_args, device):
            on_device = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, dict(batch))
            inputs = _block_inputs(model, named, on_device)
            self.shape = list(first_tensor(*inputs[0]).shape)
            profiles = _profile_blocks(self.ckptplan, model, named, inputs, device)
        del inputs, on_device, batch
        self.profile_s = time.perf_counter() - t0
        plan = self.ckptplan.plan_checkpoints(
            profiles, self.ckptplan.declare_blocks(model, named), target_kind="activation_saving_fraction",
            target_value=self.saving_fraction, planner="dynamic_programming",
        )
        self.blocks = plan_blocks(plan, [name for name, _ in named])
        self.n_blocks = len(named)
        self.predicted_bytes = (plan.predicted_activation_bytes_before, plan.predicted_activation_bytes_after)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("%s", self.record()["note"])
        return CkptplanPlan(self.blocks)

    def record(self) -> dict[str, Any]:
        metrics = {
            "ckptplan_saving_fraction": self.saving_fraction,
            "ckptplan_shape": self.shape,
            "ckptplan_plan": list(self.blocks),
            "ckptplan_n_blocks": self.n_blocks,
            "ckptplan_profile_s": round(self.profile_s, 3),
            "ckptplan_predicted_activation_bytes_before": self.predicted_bytes[0],
            "ckptplan_predicted_activation_bytes_after": self.predicted_bytes[1],
        }
        note = (
            f"ckptplan (saving fraction {self.saving_fraction:g}) at first-block input {self.shape}: checkpoints "
            f"{len(self.blocks)} of {self.n_blocks} blocks {list(self.blocks)}; profiled in {self.profile_s:.1f} s "
            "before training"
        )
        return {"metrics": metrics, "note": note}


def _example_size(example: Any) -> int:
    """What dynamic padding pads a batch to: its longest sequence (its largest image)."""
    if isinstance(example, dict) and "input_ids" in example:
        ids = example["input_ids"]
        return max(len(x) for x in ids) if ids and isinstance(ids[0], (list, tuple)) else len(ids)
    inner = getattr(example, "example", None)  # object detection's DetectionFeature
    if inner is not None and hasattr(inner, "height"):
        return int(inner.height) * int(inner.width)
    raise ValueError(f"the ckptplan peer cannot size a training example of type {type(example).__name__}")


def _largest_batch(dataset: Sequence[Any], collator: Any, batch_size: int) -> dict[str, Any]:
    """The ``batch_size`` largest training examples, collated (detection: at the largest scale)."""
    order = sorted(range(len(dataset)), key=lambda i: _example_size(dataset[i]), reverse=True)
    chosen = [dataset[i] for i in order[:batch_size]]
    chosen = [dataclasses.replace(f, multi_scale=False) if hasattr(f, "multi_scale") else f for f in chosen]
    # copies: collators may pop from the examples (multiple choice pops "labels"), which the
    # Trainer then collates again
    return collator([dict(f) if isinstance(f, Mapping) else f for f in chosen])


def _autocast(training_args: Any, device: torch.device) -> contextlib.AbstractContextManager:
    """The Trainer's mixed precision, so that blocks are profiled as they train."""
    if getattr(training_args, "bf16", False):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if getattr(training_args, "fp16", False):
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _block_inputs(model: nn.Module, named: Sequence[tuple[str, nn.Module]], batch: dict[str, Any]) -> list[tuple[tuple, dict]]:
    """Each block's ``(args, kwargs)`` in one no-grad training-mode forward of ``batch``."""
    captured: list[tuple[tuple, dict]] = []
    handles = [
        module.register_forward_pre_hook(lambda _m, args, kwargs: captured.append((args, dict(kwargs))), with_kwargs=True)
        for _, module in named
    ]
    was_training = model.training
    try:
        model.train()
        with torch.no_grad():
            model(**batch)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if len(captured) != len(named):
        raise RuntimeError(f"the largest batch ran {len(captured)} block forwards, expected {len(named)}")
    return captured


def _profile_blocks(
    ckptplan: ModuleType, model: nn.Module, named: Sequence[tuple[str, nn.Module]],
    inputs: Sequence[tuple[tuple, dict]], device: torch.device,
) -> tuple[Any, ...]:
    """ckptplan's profile of each block on its own inputs, numbered in memfit's order.

    Raises:
        PeerUnavailableError: not on CUDA (ckptplan measures activation bytes only there).
    """
    if device.type != "cuda":
        raise PeerUnavailableError(
            "peer ckptplan needs CUDA: ckptplan measures activation bytes with the CUDA allocator (on CPU its "
            "profiles are timing-only and plan_checkpoints refuses them)"
        )
    profiles = []
    was_training = model.training
    model.train()  # dropout on, as in training: its masks are activations too
    try:
        for order, ((name, module), (args, kwargs)) in enumerate(zip(named, inputs)):
            (profile,) = ckptplan.profile_blocks(ckptplan.declare_blocks(model, [(name, module)]), args, kwargs, device=device)
            profiles.append(dataclasses.replace(profile, order=order))
    finally:
        model.train(was_training)
    return tuple(profiles)


def make_peer(peers: PeerArguments, memfit_method: str) -> Peer | None:
    """The peer the flags ask for, or ``None``.

    Raises:
        FlagError: a peer with a memfit method other than ``none`` (both would checkpoint).
        PeerUnavailableError: ckptplan is asked for and not installed.
    """
    flag = next((name for name in PeerArguments.PEER_FLAGS if _is_set(getattr(peers, name))), None)
    if flag is None:
        return None
    if memfit_method != "none":
        raise FlagError(f"--{flag} is a peer of memfit: run it with --memfit_method none")
    if flag == "hf_checkpoint_every_n_layers":
        return HfEveryN(peers.hf_checkpoint_every_n_layers, peers.hf_checkpoint_offload)
    if flag == "offload_activations":
        return OffloadActivations()
    if flag == "memfit_off":
        return Plain()
    if flag == "compile_activation_memory_budget":
        return TorchCompile(peers.compile_activation_memory_budget, peers.compile_backend or "inductor")
    return Ckptplan(peers.ckptplan_saving_fraction)
