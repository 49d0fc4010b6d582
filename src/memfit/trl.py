"""TRL integration: ``trl.SFTTrainer`` with memfit's planning, records and OOM replay.

    from memfit.trl import SFTConfig, SFTTrainer   # instead of trl's

``SFTConfig`` is ``trl.SFTConfig`` plus memfit's flags (``--memory_budget``, ``--memfit_method``,
...: :class:`memfit.integrations.hf.MemfitArguments`); ``SFTTrainer`` is ``trl.SFTTrainer`` with
:class:`memfit.integrations.hf.MemfitTrainerMixin`, so it hooks the model TRL trains (the ``PeftModel``
when ``peft_config`` is given) and replays a gradient-accumulation window after an OOM
(NOTE [OOM replay] in memfit/integrations/hf.py), through TRL's own ``training_step``.

# NOTE [TRL's checkpointing default]
``trl.SFTConfig`` turns Hugging Face's gradient checkpointing on by default; memfit decides
which blocks to checkpoint, and both at once would checkpoint twice (memfit refuses it). So
memfit's ``SFTConfig`` defaults ``gradient_checkpointing`` to False; ``--memfit_method full``
checkpoints every block, as TRL's default did.

# NOTE [TRL's activation offloading under memfit]
TRL's ``activation_offloading`` enters its saved-tensor hooks around the whole training step;
memfit's counter enters its own when the model's forward starts, inside them, and only the
innermost pair runs (NOTE [Who sees a checkpointed block's tensors] in memfit/engine/parts/accounting.py):
TRL would offload nothing, silently. So ``SFTConfig`` refuses the flag; the benchmark's
``offload`` peer runs TRL's offloading inside memfit's counter instead (memfit/tools/bench/peers.py).

# NOTE [TRL's loss through memfit's head]
TRL's plain loss (``--loss_type nll``) is the model's causal-LM loss: the negative log-likelihoods of
the tokens whose label is not -100 (TRL's completion-only and assistant-only masks set -100 on the
rest) summed and divided by ``num_items_in_batch`` (the Trainer's count over the accumulation
window), or by this batch's count where it passes none, at least 1 either way. Newer TRL computes
it through a fused head of its own (the model called with ``fused_lm_head=True``, every batch in
tiles), earlier TRL through the model's loss. Either way it is the loss memfit's head computes, so
in training steps ``SFTTrainer.compute_loss`` calls the model with the labels and that count, as
memfit's Trainer does, and the head is planned per batch as elsewhere: kept on short batches (no
tile recomputed), chunked on long ones under a budget (``fit(head="auto")``, ``--memfit_head``). The
rest of TRL's step is TRL's: the loss scaled for ``--average_tokens_across_devices`` as TRL scales
it, its token count. Where TRL's loss is something else the head is left to TRL (``fit(head=False)``),
its bytes counted with the rest of the step, and the start line names who computes it
(:func:`trl_loss_owner`): Liger (``--use_liger_kernel``), ``--loss_type dft``, label smoothing, a
``compute_loss_func``, a router's auxiliary loss, context or sequence parallelism, prompt-learning
PEFT; ``--memfit_head plan`` there is refused. A subclass's own ``compute_loss`` keeps the head too,
as with memfit's Trainer, unless ``--memfit_head plan`` says its loss goes through the model's.
Evaluation and ``return_outputs`` stay TRL's.

# NOTE [TRL's metrics under a chunked head]
TRL logs ``entropy`` and ``mean_token_accuracy`` from the logits (its fused head computes them on
the way). A chunked step makes no logits (``head_logits="drop"``), and ``"detached"`` would make
the whole ``tokens x vocab`` on exactly the steps chunked so as never to hold it. So the metrics come
from a kept step's logits (no grad, a few rows at a time, in float32: a few percent of the kept
head's backward transient) with TRL's definitions, and a chunked step logs none of them: the value
logged averages the window's kept steps, and a window of chunked steps logs neither. Every rank
joins the one gather of every step, measured or not, so ranks whose plans differ never wait on
each other.

Importing this module imports TRL: ``pip install 'memfit[llm]'`` (or ``pip install trl``).

Example:
    >>> from memfit.trl import SFTConfig, SFTTrainer  # doctest: +SKIP
    >>> args = SFTConfig(output_dir="out", memory_budget="6GiB", memfit_method="dynamic")  # doctest: +SKIP
    >>> SFTTrainer(model=model, args=args, train_dataset=dataset).train()  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

try:
    import trl
except ImportError:
    raise ImportError(
        "memfit.trl needs TRL: pip install 'memfit[llm]' (or pip install trl); memfit.Trainer works without it"
    ) from None

from memfit.errors import FlagError
from memfit.integrations.hf import MemfitArguments, MemfitTrainerMixin

__all__ = ["SFTConfig", "SFTTrainer", "trl_loss_owner"]

#: a kept step's metrics read this many bytes of float32 logits at a time, at least (NOTE [TRL's metrics under a chunked head])
METRIC_CHUNK_BYTES = 2**25


@dataclass
class SFTConfig(MemfitArguments, trl.SFTConfig):
    """``trl.SFTConfig`` plus memfit's flags (all optional)."""

    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Hugging Face's checkpointing of every layer. Off here, unlike trl.SFTConfig: memfit chooses what "
            "to checkpoint (NOTE [TRL's checkpointing default] in memfit/trl.py); --memfit_method full checkpoints "
            "every block."
        },
    )


    def __post_init__(self) -> None:
        if self.activation_offloading:
            raise ValueError(
                "--activation_offloading: memfit's saved-tensor counter runs inside TRL's offloading hooks, which then "
                "never run (NOTE [TRL's activation offloading under memfit] in memfit/trl.py); drop it, or train "
                "with trl.SFTTrainer without memfit"
            )
        super().__post_init__()  # trl.SFTConfig's first: it reads a deprecated --loss_type as the one it means
        owner = trl_loss_owner(self)
        if self.memfit_head == "plan" and owner:
            raise FlagError(_plan_refused(owner))


def trl_loss_owner(args: Any, trainer: Any = None) -> str | None:
    """Who computes TRL's loss where memfit's head cannot compute it exactly, or None where it can
    (NOTE [TRL's loss through memfit's head]): from the arguments, and the trainer's state where given.

    Example:
        >>> from types import SimpleNamespace
        >>> trl_loss_owner(SimpleNamespace(loss_type="nll", use_liger_kernel=False, label_smoothing_factor=0.0))
        >>> trl_loss_owner(SimpleNamespace(loss_type="dft"))
        "TRL's dft loss (--loss_type dft)"
    """
    if getattr(args, "use_liger_kernel", False):
        return "TRL with Liger's kernels (--use_liger_kernel)"
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        return f"TRL's {loss_type} loss (--loss_type {loss_type})"
    if getattr(args, "label_smoothing_factor", 0.0):
        return "TRL's label smoothing (--label_smoothing_factor)"
    if trainer is None:
        return None
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "the trainer's compute_loss_func"
    if getattr(trainer, "aux_loss_enabled", False):
        return "TRL (its loss adds the router's auxiliary loss)"
    parallel = getattr(trainer.accelerator, "parallelism_config", None)
    if parallel is not None and (getattr(parallel, "cp_enabled", False) or getattr(parallel, "sp_enabled", False)):
        return "TRL (context or sequence parallelism)"
    if any(getattr(c, "is_prompt_learning", False) for c in (getattr(trainer.model, "peft_config", None) or {}).values()):
        return "TRL (prompt-learning PEFT adds virtual tokens)"
    return None


def _plan_refused(owner: str) -> str:
    return (f"--memfit_head plan: the loss is computed by {owner}, not through the model's head (NOTE [TRL's loss "
            "through memfit's head] in memfit/trl.py); give --memfit_head auto or keep")


class SFTTrainer(MemfitTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with memfit (:class:`memfit.integrations.hf.MemfitTrainerMixin`); pass an :class:`SFTConfig`.
    Its training steps compute TRL's loss through memfit's planned head (NOTE [TRL's loss through memfit's head])."""

    def _loss_owner(self) -> str | None:
        """TRL where its loss is not the one memfit's head computes (:func:`trl_loss_owner`), else a subclass
        that overrides ``compute_loss`` (under ``--memfit_head plan`` its loss is taken to go through the model's)."""
        owner = trl_loss_owner(self.args, self)
        if owner is None and type(self).compute_loss is not SFTTrainer.compute_loss:
            owner = f"{type(self).__name__}.compute_loss"
        return owner

    def _memfit_head(self) -> bool | str:
        head = super()._memfit_head()
        owner = trl_loss_owner(self.args, self)
        if head is True and owner:
            raise FlagError(_plan_refused(owner))
        return head

    def _hooked(self, ctl: Any) -> Any:
        ctl = super()._hooked(ctl)
        kept = "LM head kept"
        if ctl.head.part is None and ctl.head.words.startswith(kept):  # TRL's own loss computes it, fused or not
            ctl.head.words = "LM head left to TRL's loss" + ctl.head.words[len(kept):]
        return ctl

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """TRL's loss; in a training step where memfit plans the head, through it (NOTE [TRL's loss through
        memfit's head])."""
        planned = self.memfit is not None and self.memfit.head.part is not None
        if not planned or return_outputs or not model.training or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        inputs["use_cache"] = False
        shifted = inputs.get("shift_labels")
        targets = F.pad(inputs["labels"], (0, 1), value=-100)[..., 1:] if shifted is None else shifted
        kwargs = {}
        if getattr(self, "model_accepts_loss_kwargs", True):  # else the model's mean, as the Trainer's
            items = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
            kwargs["num_items_in_batch"] = torch.as_tensor(items, device=targets.device).clamp(min=1)
        outputs = model(**inputs, **kwargs)
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            tp_size = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
            loss = loss * (self.accelerator.num_processes // tp_size)
        self._log_token_metrics(outputs.logits, targets)
        self._count_tokens(inputs)
        return loss

    def _log_token_metrics(self, logits: torch.Tensor | None, targets: torch.Tensor) -> None:
        """TRL's ``entropy`` and ``mean_token_accuracy`` from a kept step's logits; none from a chunked step's
        (NOTE [TRL's metrics under a chunked head])."""
        stats = torch.zeros(4, device=targets.device)
        if logits is not None:
            with torch.no_grad():
                stats = torch.cat([_token_stats(logits, targets), stats.new_ones(1)])
        entropy, hits, tokens, measured = self.accelerator.gather_for_metrics(stats[None]).sum(0).tolist()
        if measured:
            self._metrics["train"]["entropy"].append(entropy / tokens if tokens else 0.0)
            self._metrics["train"]["mean_token_accuracy"].append(hits / tokens if tokens else 0.0)

    def _count_tokens(self, inputs: dict[str, Any]) -> None:
        """TRL's ``num_tokens``: the tokens trained on so far, padding-free batches included."""
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        elif "position_ids" in inputs:
            local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        tokens = int(self.accelerator.gather_for_metrics(local).sum().item())
        self._total_train_tokens += tokens // getattr(self, "_tp_size", 1)  # TP ranks see the same batch
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]


def _token_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(entropy sum, top-1 hits, tokens)`` in float32 over the tokens whose target is not -100, as TRL
    defines its metrics: ``logits`` ``(..., vocab)`` and ``targets`` (shifted labels) of its leading shape,
    read a few rows at a time (at least :data:`METRIC_CHUNK_BYTES` of float32, at most 64 reads).

    Example:
        >>> _token_stats(torch.tensor([[[0.0, 9.0], [9.0, 0.0]]]), torch.tensor([[1, -100]])).tolist()[1:]
        [1.0, 1.0]
    """
    rows, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device)
    step = max(1, METRIC_CHUNK_BYTES // (4 * rows.shape[-1]), -(-rows.shape[0] // 64))
    out = torch.zeros(3, dtype=torch.float32, device=rows.device)
    for chunk, target in zip(rows.split(step), targets.split(step)):
        valid = target != -100
        logp = F.log_softmax(chunk.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        out += torch.stack([(entropy * valid).sum(), ((chunk.argmax(-1) == target) & valid).sum().float(), valid.sum().float()])
    return out
