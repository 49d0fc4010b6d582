"""Memory anatomy of one training step, from a model config alone: ``memfit estimate``.

Weights, gradients, optimizer state, activations and the CUDA context of a training step,
in bytes, for a precision, an optimizer, a (micro-batch, accumulation) split and a checkpoint
plan, and whether that fits a budget. Nothing is allocated: the model is built on the meta
device to count its parameters exactly. ``--advise`` (see :mod:`memfit.tools.estimate.advise`) searches
the setups that fit a budget and ranks them by estimated step time.

Units: GiB = 2**30 bytes, GB = 10**9 bytes. All fields are plain bytes.

# NOTE [What each part assumes]
* weights: 4 B/param (fp32 master weights, in every precision).
* autocast copies: under fp16/bf16 mixed precision (autocast) a 2 B half copy of every weight
  that feeds a matmul (``nn.Linear``/``nn.Conv*``; embeddings and LayerNorm are not cast).
  Autocast caches them for the whole forward and the layers save them for backward, which
  frees a layer's copies when it has run; none is left at ``optimizer.step()``.
* gradients: 4 B/param (fp32 gradients of the fp32 master weights, in every precision).
  With ``zero_grad(set_to_none=True)`` they appear during backward, block by block, while the
  blocks' saved activations are freed (NOTE [Phases of a step]).
* optimizer state (fp32): AdamW 8 B/param (exp_avg, exp_avg_sq); 8-bit AdamW
  (bitsandbytes) 2 B/param plus one fp32 absmax per 256 values and state, for tensors of at
  least 4096 values (smaller ones keep 8 B/param); Adafactor (HF, ``beta1=None``) a row and
  a column second-moment vector for tensors of 2+ dims ((rows + cols)·4 B) and 4 B/param
  for 1-D ones; SGD none; SGD with momentum 4 B/param.
* optimizer step temporaries: foreach AdamW (``--optim adamw_torch``, the CUDA default of
  ``torch.optim.AdamW``) allocates ``sqrt(exp_avg_sq)`` (4 B/param) during ``step()``;
  HF Adafactor, looping over tensors, two fp32 tensors the size of the largest parameter
  (``grad**2 + eps`` while ``grad**2`` lives, then the factored update while the previous
  one lives).
* activations: bytes saved for backward (``saved_tensors_hooks`` bytes), from the analytic
  formula of :func:`bert_layer_saved_bytes` for BERT-family encoders, else counted by
  running the model on the meta device as a CUDA step runs it (NOTE [What the meta count runs]:
  the weights' dtype, LoRA, the fused kernels' saved tensors).
* backward temporaries: the gradients a block's backward holds besides what it saved, from
  :func:`bert_layer_backward_bytes` for BERT-family encoders; twice the block's input (the
  gradients of its output and input) for other models.
* LM head (causal-lm): the head's bytes by memfit's own formula
  (:func:`memfit.engine.parts.head.head_saved_bytes`, NOTE [Head bytes]): kept as Hugging Face computes
  it, cross-entropy's float32 ``log_softmax`` saved for backward, and while the loss runs the
  logits in the model's dtype and their float32 upcast; chunked (memfit's ``chunked`` head), the
  hidden rows saved and one chunk's logits at a time (NOTE [The head in the estimate]).
* CUDA library workspaces: cuBLAS and cuBLASLt allocate their workspaces through PyTorch's
  caching allocator at the first matmul and keep them, so they count against a cap:
  :data:`LIBRARY_WORKSPACE_BYTES`.
* CUDA context: about 1 GB (10**9) for the driver context, cuBLAS/cuDNN handles and loaded
  kernels. It lives outside PyTorch's caching allocator, so a budget enforced with
  ``torch.cuda.set_per_process_memory_fraction`` does not include it: the GPU must hold
  budget + context.

# NOTE [Phases of a step]
The allocator's peak is the larger of two moments, both on top of the weights, the
optimizer state and the library workspaces:

* forward and backward: at the end of the forward every kept activation is alive, with all
  autocast copies (the cache holds even those of checkpointed blocks until autocast exits).
  Backward then runs the blocks in reverse; while block j runs, the blocks before it still
  hold what they kept, block j holds all it saved (recomputed, when checkpointed) and its
  backward temporaries, and the gradients of the head and of every block after j exist. What
  the code after the last block saved (the final norm's copy, the head's, the loss's) is gone:
  their backward ran first (a float32 norm copy at 64k x 4096 is 1 GiB).
  For long inputs the first block to run backward (the last one) sets the peak, for short
  ones the last (gradients have replaced most activations). The embeddings' gradients
  appear after every block has run, so they count in the optimizer step only; an embedding
  tied to the LM head is the head's weight, whose gradient the head's backward makes first.
* optimizer step: all gradients plus the step's temporaries; activations and autocast
  copies are gone.

Counting gradients and activations whole at the same time instead would over-estimate by up
to the smaller of the two (14% for bert-base, fp32, AdamW, batch 32 × 52 tokens, against
measured peaks: docs/devlog.md).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.engine.budget import Budget
from memfit.engine.parts.head import HeadBytes, head_saved_bytes
from memfit.engine.parts.treatments.base import RECOMPUTE
from memfit.engine.parts.treatments.chunked_head import head_options, head_without_a_plan
from memfit.engine.parts.treatments.elementwise import elementwise_parts
from memfit.engine.parts.treatments.host_checkpoint import HOST_CHECKPOINT
from memfit.engine.parts.treatments.host_checkpoint_tiled import HOST_CHECKPOINT_TILED
from memfit.engine.parts.treatments.offload import size_class
from memfit.engine.parts.treatments.recompute_tiled import RECOMPUTE_TILED
from memfit.engine.parts.treatments.tiled_mlp import (
    Chunking, graph_edges, keeps_sum_order, lean_parts, mlp_chunks, noting_mlps, tileable_mlps, tiled,
)
from memfit.engine.parts.optim_state import expected_step_transient_bytes, state_bytes_of_shapes
from memfit.engine.parts.optimizer_step import KEEP, PER_TENSOR
from memfit.errors import DataError, FlagError, MissingFileError
from memfit.tasks.causal_lm import LORA_DROPOUT, check_lora_dropout
from memfit.tools.estimate.meta_kernels import cuda_kernels
from memfit.tools.estimate.sharded import gathered_bytes, per_rank

__all__ = [
    "TASKS",
    "PRECISIONS",
    "OPTIMIZERS",
    "optimizer_available",
    "CUDA_CONTEXT_BYTES",
    "LIBRARY_WORKSPACE_BYTES",
    "ElementBytes",
    "bert_layer_saved_bytes",
    "bert_layer_backward_bytes",
    "attention_and_adapter_backward_bytes",
    "load_config",
    "ModelProfile",
    "ActivationProfile",
    "MlpTiling",
    "activation_profile",
    "TrainingSetup",
    "MemoryEstimate",
    "backward_phase_bytes",
    "block_backward_moment",
    "pinned_host_bytes",
    "most_head_chunks",
    "estimate",
    "format_table",
    "table_unit",
]

GIB = 2**30

#: task name -> transformers Auto class that puts its head on the model.
TASKS = {
    "text-classification": "AutoModelForSequenceClassification",
    "multiple-choice": "AutoModelForMultipleChoice",
    "question-answering": "AutoModelForQuestionAnswering",
    "token-classification": "AutoModelForTokenClassification",
    "image-classification": "AutoModelForImageClassification",
    "causal-lm": "AutoModelForCausalLM",
}
PRECISIONS = ("fp32", "bf16", "fp16")
#: Round figure for the CUDA context (see NOTE [What each part assumes]); outside the cap.
CUDA_CONTEXT_BYTES = 10**9
#: cuBLAS + cuBLASLt workspaces inside the caching allocator (NOTE [What each part assumes]):
#: 32 MiB each, cuBLAS's size on the newest GPUs; the allocator holds about that much more than
#: weights + gradients + AdamW state at every step start (docs/devlog.md). Older GPUs use
#: smaller workspaces, so there this over-counts by a few tens of MiB.
LIBRARY_WORKSPACE_BYTES = 64 * 2**20
# Encoders whose layers are BertLayer copies, so the analytic formula applies.
_BERT_FAMILY = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _fp32_copy(shapes: Sequence[Sequence[int]]) -> int:
    return sum(4 * _numel(s) for s in shapes)


def _no_bytes(shapes: Sequence[Sequence[int]]) -> int:
    return 0


def _per_tensor_step_bytes(optim: str, shapes: Sequence[Sequence[int]], width: int) -> int:
    """The temporaries of ``optim``'s step run per tensor over parameters of ``shapes`` in ``width`` bytes, by the
    engine's own rule (engine/parts/optim_state.py), on meta tensors."""
    dtype = torch.float32 if width == 4 else torch.bfloat16
    params = [torch.empty(tuple(s), dtype=dtype, device="meta", requires_grad=True) for s in shapes]
    return expected_step_transient_bytes(optim, params, foreach=False) or 0


def _adafactor_step_temp(shapes: Sequence[Sequence[int]]) -> int:
    return 2 * 4 * max((_numel(s) for s in shapes), default=0)


@dataclass(frozen=True)
class _Optimizer:
    """How one optimizer's memory scales with the parameter shapes."""

    name: str
    """Name on the ``memfit estimate --optimizer`` flag."""
    train_flags: tuple[str, ...]
    """Flags that select it in ``memfit train`` (HF ``--optim`` names)."""
    step_temp: Callable[[Sequence[Sequence[int]]], int]
    """Parameter shapes -> bytes of temporaries inside ``optimizer.step()``."""
    needs: str | None = None
    """Python package it needs, if any."""
    per_tensor: str | None = None
    """The ``--optim`` name whose step memfit can run per tensor where its temporaries do not fit (NOTE [The
    optimizer step's treatments], parts/optimizer_step.py): torch's AdamW; None for a step that runs as made."""

    def state(self, shapes: Sequence[Sequence[int]]) -> int:
        """Parameter shapes (float32) -> bytes of optimizer state, read from the one
        optimizer-state table (engine/parts/optim_state.py) by its ``--optim`` row."""
        flags = dict(zip(self.train_flags[::2], self.train_flags[1::2]))
        return state_bytes_of_shapes(flags["--optim"], shapes, 4, flags.get("--optim_args")) or 0


OPTIMIZERS = {
    o.name: o
    for o in (
        _Optimizer("adamw", ("--optim", "adamw_torch"), _fp32_copy, per_tensor="adamw_torch"),
        _Optimizer("adamw-8bit", ("--optim", "adamw_bnb_8bit"), _no_bytes, "bitsandbytes"),
        _Optimizer("adafactor", ("--optim", "adafactor"), _adafactor_step_temp),
        _Optimizer("sgd", ("--optim", "sgd"), _no_bytes),
        _Optimizer("sgd-momentum", ("--optim", "sgd", "--optim_args", "momentum=0.9"), _no_bytes),
    )
}


def optimizer_available(name: str) -> bool:
    """Whether the package the optimizer ``name`` needs is importable here."""
    needs = OPTIMIZERS[name].needs
    return needs is None or importlib.util.find_spec(needs) is not None


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of each kind of tensor a BERT layer saves for backward.

    The values differ between fp32 and autocast, and between CUDA and CPU kernels;
    :meth:`cuda` gives the CUDA ones (checked against counted bytes on a GPU by the
    ``gpu`` test), :meth:`cpu` the CPU ones (checked by the CPU tests).
    """

    matmul: int
    """Inputs of linear layers and attention matmuls: 4 in fp32, 2 under fp16/bf16 autocast."""
    residual: int = 4
    """Residual stream and LayerNorm inputs: fp32 in both (autocast runs LayerNorm in fp32
    and the residual add of a half and an fp32 tensor promotes to fp32)."""
    softmax: int = 4
    """Attention probabilities: CUDA autocast runs softmax in fp32."""
    dropout_mask: int = 1
    """CUDA's fused dropout saves a bool mask; CPU saves the scaled noise in the input dtype."""
    input_copies: int = 1
    """Copies of the layer input saved by the Q, K and V projections: 1 in fp32; 3 under
    autocast, which casts the (non-leaf) input once per linear and caches only parameters."""

    @classmethod
    def cuda(cls, precision: str) -> "ElementBytes":
        """The element sizes of CUDA kernels for ``precision`` (fp32, fp16 or bf16)."""
        _check_choice("precision", precision, PRECISIONS)
        return cls(matmul=4) if precision == "fp32" else cls(matmul=2, input_copies=3)

    @classmethod
    def cpu(cls, precision: str) -> "ElementBytes":
        """The element sizes of CPU kernels for ``precision`` (fp32 or bf16).

        Unfused dropout saves its scaled noise in the input dtype (not a bool mask), and CPU
        autocast leaves softmax in bf16 when no float mask promotes it. Attention dropout
        makes CPU SDPA fall back to the unfused kernel (use ``attention="eager"`` then).
        """
        _check_choice("precision", precision, ("fp32", "bf16"))
        if precision == "fp32":
            return cls(matmul=4, dropout_mask=4)
        return cls(matmul=2, softmax=2, dropout_mask=2, input_copies=3)


def bert_layer_saved_bytes(
    rows: int,
    seq_length: int,
    hidden: int,
    heads: int,
    intermediate: int,
    *,
    element_bytes: ElementBytes,
    attention: str = "sdpa",
    attention_dropout: bool = True,
    hidden_dropout: bool = True,
    padding_mask: bool = True,
) -> int:
    """Bytes one BERT layer (``BertLayer``) saves for backward in a training forward.

    With b = ``rows``, s = ``seq_length``, h = ``hidden``, a = ``heads``,
    i = ``intermediate`` and the element sizes E = ``matmul``, R = ``residual``,
    P = ``softmax``, M = ``dropout_mask``, n = ``input_copies``::

        b·s·h · ((n + 5)·E + 2·R + 2·M)     input copies, Q, K, V, attention output,
                                           LayerNorm-1 output; 2 LayerNorm inputs;
                                           2 hidden-dropout masks (M → 0 without dropout)
      + b·s·i · 2·E                        GELU input and output
      + b·s · 16                           mean and rstd of 2 LayerNorms (fp32)
      + eager:  b·a·s² · (P + M + E)       softmax output, dropout mask, dropped probs
                                           (no attention dropout: P, plus E if P != E,
                                           the cast copy the PV matmul saves)
      + sdpa:   b·a·⌈s/32⌉·32 · 4 + 16     logsumexp of the fused kernel (fp32; the
                                           memory-efficient kernel pads s to 32), RNG state
              + b·s² · E                   the padding mask, converted to the query dtype
                                           per layer (only when the batch has padding)

    The quadratic b·a·s² term exists only for eager attention; fused SDPA (flash /
    memory-efficient / cuDNN, CUDA) keeps no attention matrix, only the b·s² padding mask.
    Matched byte for byte against saved-tensor counts of a ``BertLayer`` on CPU (fp32 and
    bf16 autocast) and CUDA (fp32 and bf16, eager and SDPA, with and without padding); the
    half copies of the layer's weights that autocast saves are part of the weights
    (NOTE [What each part assumes]), not of this count.

    Args:
        rows: sequences in the micro-batch (batch × choices for multiple choice).
        seq_length: tokens per sequence (the padded length of the batch).
        hidden: ``hidden_size``.
        heads: ``num_attention_heads``.
        intermediate: ``intermediate_size``.
        element_bytes: element sizes, e.g. ``ElementBytes.cuda("bf16")``.
        attention: ``"sdpa"`` (fused kernel) or ``"eager"``.
        attention_dropout: ``attention_probs_dropout_prob > 0``.
        hidden_dropout: ``hidden_dropout_prob > 0``.
        padding_mask: the batch carries a padding mask (dynamic padding: almost always).

    Returns:
        Saved bytes of one layer, parameters and their autocast copies excluded.

    Example:
        >>> bert_layer_saved_bytes(2, 40, 64, 4, 96, element_bytes=ElementBytes.cuda("fp32"), attention="eager")
        352000
    """
    _check_choice("attention", attention, ("sdpa", "eager"))
    b, s, h, a, i = rows, seq_length, hidden, heads, intermediate
    e = element_bytes
    mask = e.dropout_mask if hidden_dropout else 0
    total = b * s * h * ((e.input_copies + 5) * e.matmul + 2 * e.residual + 2 * mask)
    total += b * s * i * 2 * e.matmul + b * s * 16
    if attention == "eager":
        if attention_dropout:
            per_prob = e.softmax + e.dropout_mask + e.matmul
        else:
            per_prob = e.softmax + (e.matmul if e.matmul != e.softmax else 0)
        total += b * a * s * s * per_prob
    else:
        total += b * a * (-(-s // 32) * 32) * 4 + (16 if attention_dropout else 0)
        total += b * s * s * e.matmul if padding_mask else 0
    return total


def bert_layer_backward_bytes(rows: int, seq_length: int, hidden: int, intermediate: int, *, element_bytes: ElementBytes) -> int:
    """Bytes one BERT layer's backward holds on top of what the layer saved (its peak).

    At the feed-forward part: the gradients of the GELU output and input (b·s·i, matmul
    element size; the first replaces the saved GELU output, freed by then) and two
    residual-stream gradients (b·s·h, fp32)::

        b·s · (i·E + 2·h·R)

    Fitted on measured fp32 peaks of bert-base at batch 32 × 32..512 tokens, which grew by
    17.7 kB per token over weights + state + saved activations + workspaces (i + 1.75·h
    floats; the formula gives 18.4 kB), and checked in bf16 by the estimator's GPU check
    (docs/devlog.md).

    Example:
        >>> bert_layer_backward_bytes(8, 128, 768, 3072, element_bytes=ElementBytes.cuda("fp32"))
        18874368
    """
    e = element_bytes
    return rows * seq_length * (intermediate * e.matmul + 2 * hidden * e.residual)


def _bert_outside_bytes(config: Any, task: str, rows: int, s: int, e: ElementBytes) -> int:
    """Embeddings, head and loss of a BERT-family model (see :func:`activation_profile`)."""
    h = config.hidden_size
    hidden_mask = e.dropout_mask if config.hidden_dropout_prob > 0 else 0
    head_p = getattr(config, "classifier_dropout", None)
    head_mask = e.dropout_mask if (config.hidden_dropout_prob if head_p is None else head_p) > 0 else 0
    # token ids (int64), LayerNorm input, mean and rstd, dropout mask
    embeddings = rows * s * (8 + 8) + rows * s * h * (e.residual + hidden_mask)
    # fp32: a linear on the last hidden state saves a view of it, keeping all of it alive;
    # autocast saves a half cast of only what the head reads.
    # Loss, per logit: fp32 log-softmax output (4 B); under CUDA autocast log_softmax runs in
    # half and nll_loss saves an fp32 copy of its output (2 + 4 B). Plus int64 labels.
    logit = 4 if e.matmul == 4 else e.matmul + 4
    if task == "token-classification":
        return embeddings + rows * s * h * (e.matmul + head_mask) + logit * rows * s * config.num_labels + 8 * rows * s
    if task == "question-answering":
        return embeddings + rows * s * h * e.matmul + 2 * (logit * rows * s + 8 * rows)
    # pooled heads: pooler dense input, tanh output, [dropout mask and output,] classifier
    last = rows * s * h * 4 if e.matmul == 4 else rows * h * e.matmul
    pooled = rows * h * (e.matmul + (head_mask + e.matmul if head_mask else 0))
    labels = 1 if task == "multiple-choice" else config.num_labels
    return embeddings + last + pooled + logit * rows * labels + 8 * rows


def _check_choice(flag: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise FlagError(f"--{flag} {value!r} is not one of {', '.join(map(str, choices))}")


def load_config(model: str | None = None, config_path: str | Path | None = None) -> Any:
    """Resolve a transformers config without downloading weights.

    Order: ``config_path`` (a ``config.json`` with ``model_type``); a config shipped in
    ``memfit/configs/<name>.json`` (offline, deterministic); else
    ``AutoConfig.from_pretrained(model)`` (a local folder, the HF cache, or the Hub).

    Args:
        model: a model name (``bert-base-uncased``) or a local folder.
        config_path: path to a config JSON file; wins over ``model``.

    Returns:
        A ``transformers.PretrainedConfig``.

    Raises:
        FlagError: when neither is given, or ``model`` cannot be resolved (naming the
            shipped configs and ``--config``).
        MissingFileError / DataError: ``config_path`` missing, not JSON, or without ``model_type``.
    """
    from transformers import AutoConfig

    if config_path is not None:
        if not Path(config_path).is_file():
            raise MissingFileError(f"--config {config_path}: no such file; give the path of a config.json")
        try:
            data = json.loads(Path(config_path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"--config {config_path}: not JSON ({err})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise DataError(f"{config_path}: a config JSON needs a 'model_type' field")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    if model is None:
        raise FlagError("pass --model NAME or --config path/to/config.json")
    shipped = resources.files("memfit") / "configs"
    candidate = shipped / f"{model.rstrip('/').split('/')[-1]}.json"
    if candidate.is_file():
        return load_config(config_path=str(candidate))
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        files = shipped.iterdir() if shipped.is_dir() else ()
        names = sorted(p.name[: -len(".json")] for p in files if p.name.endswith(".json"))
        raise FlagError(
            f"cannot resolve --model {model!r}: no shipped config (shipped: {', '.join(names)}) "
            f"and AutoConfig.from_pretrained failed ({exc}); pass --config path/to/config.json"
        ) from None


@dataclass(frozen=True, eq=False)
class ModelProfile:
    """What the estimate needs from a model: parameter shapes, blocks, and its config."""

    name: str
    """Model name shown in tables."""
    task: str
    """Head the model carries (a key of :data:`TASKS`)."""
    config: Any
    """The transformers config."""
    model: nn.Module
    """The model on the meta device (no storage); used to count activations of non-BERT models."""
    param_shapes: tuple[tuple[int, ...], ...]
    """Shapes of the trainable parameters."""
    matmul_weight_params: int
    """Values in weights of ``nn.Linear``/``nn.Conv*`` (autocast keeps a half copy of those)."""
    n_blocks: int
    """Checkpointable blocks (transformer layers)."""
    block_params: tuple[int, ...] = ()
    """Trainable parameters of each block (empty: unknown, all counted as head)."""
    block_matmul_params: tuple[int, ...] = ()
    """Matmul weight values of each block (their autocast copies are saved by the block)."""
    embedding_params: int = 0
    """Trainable parameters of the input embeddings, whose gradients backward makes last; an embedding tied to the
    output head is the head's (its gradient is made at the head's backward, first)."""
    block_linear_shapes: tuple[tuple[int, int], ...] = ()
    """``(in_features, out_features)`` of every linear layer inside the blocks (LoRA's all-linear)."""

    def lora_shapes(self, r: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of LoRA's A and B matrices of rank ``r`` on every linear layer of the blocks."""
        return tuple(shape for i, o in self.block_linear_shapes for shape in ((r, i), (o, r)))

    @property
    def n_params(self) -> int:
        """Trainable parameters."""
        return sum(_numel(s) for s in self.param_shapes)

    @property
    def bert_family(self) -> bool:
        """Whether the analytic BERT layer formula applies."""
        return self.config.model_type in _BERT_FAMILY

    @classmethod
    def from_config(cls, config: Any, task: str = "text-classification", name: str | None = None) -> "ModelProfile":
        """Build the model with its ``task`` head on the meta device and read its shapes.

        Raises:
            FlagError: for an unknown task or a config the task's Auto class does not take.
        """
        import transformers

        _check_choice("task", task, tuple(TASKS))
        auto = getattr(transformers, TASKS[task])
        # eager attention: counting on the meta device (non-BERT models) then sees plain ops;
        # the BERT formula takes the attention kernel as its own argument. from_config sets
        # the attention kernel on the config it is given: a copy keeps the caller's intact.
        config = copy.deepcopy(config)
        with torch.device("meta"):
            try:
                model = auto.from_config(config, attn_implementation="eager")
            except ValueError as exc:
                raise FlagError(f"--task {task}: {type(config).__name__} has no such head ({exc})") from None
        from memfit.engine.parts.blocks import find_blocks

        params = [p for p in model.parameters() if p.requires_grad]
        blocks = [b for _, b in find_blocks(model)]
        if config.model_type in _BERT_FAMILY and len(blocks) != config.num_hidden_layers:
            raise ValueError(f"found {len(blocks)} blocks in a model with {config.num_hidden_layers} layers")
        embeddings = [m for n, m in model.named_modules() if n.split(".")[-1] == "embeddings" or isinstance(m, nn.Embedding)]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        tied = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
        return cls(
            name=name or getattr(config, "name_or_path", "") or config.model_type,
            task=task,
            config=config,
            model=model,
            param_shapes=tuple(tuple(p.shape) for p in params),
            matmul_weight_params=_matmul_params(model),
            n_blocks=len(blocks),
            block_params=tuple(_trainable_params(b) for b in blocks),
            block_matmul_params=tuple(_matmul_params(b) for b in blocks),
            embedding_params=_trainable_params(*embeddings, exclude=tied),
            block_linear_shapes=tuple(
                (m.in_features, m.out_features) for b in blocks for m in b.modules() if isinstance(m, nn.Linear)
            ),
        )


def _matmul_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)))


def _trainable_params(*modules: nn.Module, exclude: set[int] = frozenset()) -> int:
    """Trainable values of ``modules``, each parameter counted once (modules may nest), those in ``exclude`` (ids) left
    out."""
    unique = {id(p): p for m in modules for p in m.parameters() if p.requires_grad and id(p) not in exclude}
    return sum(p.numel() for p in unique.values())


@dataclass(frozen=True)
class MlpTiling:
    """How the count ran the blocks' gated MLPs where the setup tiles them (NOTE [The tiled MLP in the estimate]).

    Attributes:
        tiled_blocks: blocks whose MLP was counted tiled (0: none, and ``why_not`` says why).
        chunks: the most chunks a tiled MLP ran in: the engine's :class:`~memfit.engine.parts.treatments.tiled_mlp.Chunking`
            at this shape.
        chunk_tokens: tokens of the longest chunk.
        why_not: why the engine would not tile the blocks' MLPs; empty where it tiles them.
        dropout_inside: the blocks' MLPs are gated, but a dropout of p > 0 inside them (peft's LoRA dropout) keeps
            the engine from tiling them.
    """

    tiled_blocks: int = 0
    chunks: int = 0
    chunk_tokens: int = 0
    why_not: str = ""
    dropout_inside: bool = False


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one micro-batch, split by block."""

    outside_bytes: int
    """Embeddings, head and loss (never checkpointed)."""
    block_bytes: tuple[int, ...]
    """Per block, when it is not checkpointed."""
    block_input_bytes: tuple[int, ...]
    """Per block, when it is checkpointed: the inputs the checkpoint keeps."""
    block_backward_bytes: tuple[int, ...] = ()
    """Per block, the temporaries of its backward on top of what it saved (empty: none)."""
    shared_input_bytes: int = 0
    """Inputs every block is given besides its hidden states (an attention mask, position embeddings) that
    nothing saved before the first block: a checkpoint keeps them, once for all the blocks."""
    fused_attention: bool = False
    """Counted on the meta device with attention as the fused kernel saves it (NOTE [Fused kernels on the
    meta device]); False for eager attention and for the BERT formula (which takes its kernel itself)."""
    padded: bool = False
    """Counted with a padded batch's mask (NOTE [Fused kernels on the meta device]): the fused attention's bias and key
    and value at the query's heads per block, the boolean mask once."""
    mlp_tiling: MlpTiling | None = None
    """How the blocks' gated MLPs were counted where the setup tiles them (NOTE [The tiled MLP in the estimate]);
    None where it does not ask: every MLP on every token at once."""
    outside_after_bytes: int = 0
    """Of :attr:`outside_bytes`, what the code after the last block saves (the final norm, the head, the loss): its
    backward runs, and frees it, before any block's (NOTE [Phases of a step]); 0 where not counted apart."""
    inputs_saved: tuple[bool, ...] = ()
    """Per block, whether it saves its input tensor itself, so that recomputing it adds nothing for the input the
    checkpoint kept (empty: every block does). Under autocast a block saves half copies instead; a LoRA model's first
    block, whose input needs no gradient, runs its norm plainly and saves a float32 copy instead."""

    def recompute_bytes(self, index: int, on_host: bool = False) -> int:
        """Bytes block ``index`` holds while it is recomputed: what it saves, and its kept input; on the host
        (``host_checkpoint``), also the stashes fetched ahead of it (NOTE [Checkpoints on the host in the estimate])."""
        saved = self.inputs_saved[index] if self.inputs_saved else True
        own = self.block_bytes[index] + (0 if saved else self.block_input_bytes[index])
        if not on_host:
            return own
        return own + sum(self.block_input_bytes[max(0, index - HOST_PREFETCH_DEPTH):index])

    def kept_bytes(self, n_checkpointed: int, on_host: bool = False) -> list[int]:
        """Per block, what it keeps until backward with the first ``n_checkpointed`` checkpointed; on the host
        (``host_checkpoint``), a checkpointed block keeps nothing on the device."""
        blocks = zip(self.block_bytes, self.block_input_bytes)
        return [(0 if on_host else given) if k < n_checkpointed else saved for k, (saved, given) in enumerate(blocks)]

    def shared_bytes(self, n_checkpointed: int) -> int:
        """The inputs every block is given, kept once by the checkpoints (none without one)."""
        return self.shared_input_bytes if n_checkpointed else 0

    def in_flight_bytes(self, on_host: bool) -> int:
        """At the end of the forward, the last blocks' inputs whose copies to the host may not be done yet."""
        return sum(self.block_input_bytes[-HOST_IN_FLIGHT:]) if on_host else 0

    def total_bytes(self, n_checkpointed: int, on_host: bool = False) -> int:
        """Peak saved bytes with the ``n_checkpointed`` earliest blocks checkpointed (on the host: ``on_host``).

        # NOTE [Checkpoint the earliest blocks]
        Backward runs the blocks in reverse and recomputes a checkpointed block whole, while
        the blocks before it still hold what they saved. The peak is the larger of the bytes
        saved at the start of backward and, for each checkpointed block k, the bytes of
        blocks < k plus block k recomputed. Checkpointing the earliest blocks keeps that
        second term lowest (checkpointing only the last block saves nothing at all).
        """
        kept = self.kept_bytes(n_checkpointed, on_host)
        peak, before = sum(kept) + self.in_flight_bytes(on_host), 0
        for k in range(n_checkpointed):
            peak = max(peak, before + self.recompute_bytes(k, on_host))
            before += kept[k]
        return self.outside_bytes + self.shared_bytes(n_checkpointed) + peak


# NOTE [Checkpoints on the host in the estimate]
# ``--checkpoint host`` puts every block on ``host_checkpoint`` (NOTE [Checkpoints on the host],
# host_checkpoint.py), as ``host_checkpoint_tiled`` where the engine tiles the model's MLP (NOTE [The tiled MLP
# in the estimate]): a block keeps nothing on the device between its forward and its recompute (its
# input waits in pinned host memory; the inputs every block is given stay, once). What stays on the device
# for the blocks is then one block at a time: while block j is recomputed and runs its backward, what it
# saves, its input back from the host, the stash below it fetched ahead (HOST_PREFETCH_DEPTH: the engine's
# depth where no link was measured; a slow link deepens it, a block input more each) and its backward's
# temporaries; at the end of the forward, the last blocks' inputs whose copies may still run (at most
# HOST_IN_FLIGHT: the forward waits for the copy before the last two). The host holds every block's input
# in the pool's size classes (:func:`memfit.engine.parts.treatments.offload.size_class`, pinned): :func:`pinned_host_bytes`.
#: stashes fetched ahead of the block being recomputed (NOTE [Checkpoints on the host in the estimate])
HOST_PREFETCH_DEPTH = 1
#: block inputs whose copies to the host may still run at the end of the forward
HOST_IN_FLIGHT = 2


def pinned_host_bytes(activations: "ActivationProfile", n_on_host: int) -> int:
    """Pinned host memory the ``n_on_host`` blocks on ``host_checkpoint`` hold: each block's input in the
    pool's size class (the power of two at or above it; NOTE [Pinned pool], offload.py)."""
    return sum(size_class(b, pinned=True) for b in activations.block_input_bytes[:n_on_host] if b)


def activation_profile(
    profile: ModelProfile,
    micro_batch_size: int,
    *,
    precision: str = "fp32",
    seq_length: int | None = None,
    image_size: int | None = None,
    attention: str = "sdpa",
    num_choices: int = 4,
    padding_mask: bool = True,
    element_bytes: ElementBytes | None = None,
    weights: str = "fp32",
    lora_r: int = 0,
    lora_dropout: float = LORA_DROPOUT,
    tile_mlp: bool = False,
) -> ActivationProfile:
    """Saved bytes per block for one micro-batch, and each block's backward temporaries.

    BERT-family encoders use :func:`bert_layer_saved_bytes` and
    :func:`bert_layer_backward_bytes` with CUDA element sizes, plus embeddings (token ids,
    LayerNorm, dropout), the task head and the log-softmax of the loss; a checkpointed layer
    keeps its fp32 input (b·s·h·4). Other models are run once on the meta device under
    ``saved_tensors_hooks`` and the saved bytes are counted per block (NOTE [What the meta count
    runs]): in the weights' dtype (``weights``), with LoRA of rank ``lora_r`` on every linear layer
    of the blocks (its dropout ``lora_dropout``), and ``attention`` ``sdpa`` counted as the fused kernel saves it
    where the model runs SDPA; an upper bound under fp16/bf16 autocast (the meta device does not run it). With
    ``tile_mlp`` the gated MLPs the engine tiles run tiled (NOTE [The tiled MLP in the estimate]).

    ``padding_mask``: whether batches of several rows carry padding, as dynamic padding almost always makes
    them (a decoder's fused attention then saves the mask per block: NOTE [Fused kernels on the meta device]).
    ``element_bytes`` (BERT family) replaces the CUDA element sizes of ``precision``, e.g. with those of CPU kernels.

    Raises:
        FlagError: when the input size flag does not match the model (text vs vision).
    """
    vision = profile.task == "image-classification"
    if vision and image_size is None:
        raise FlagError(f"{profile.name} is a vision model: pass --image_size (pixels per side)")
    if not vision and seq_length is None:
        raise FlagError(f"{profile.name} is a text model: pass --seq_length (tokens per example)")
    rows = micro_batch_size * (num_choices if profile.task == "multiple-choice" else 1)
    config = profile.config
    if profile.bert_family:
        e = element_bytes or ElementBytes.cuda(precision)
        layer = bert_layer_saved_bytes(
            rows,
            seq_length,
            config.hidden_size,
            config.num_attention_heads,
            config.intermediate_size,
            element_bytes=e,
            attention=attention,
            attention_dropout=config.attention_probs_dropout_prob > 0,
            hidden_dropout=config.hidden_dropout_prob > 0,
            padding_mask=padding_mask,
        )
        backward = bert_layer_backward_bytes(rows, seq_length, config.hidden_size, config.intermediate_size, element_bytes=e)
        n = config.num_hidden_layers
        return ActivationProfile(
            outside_bytes=_bert_outside_bytes(config, profile.task, rows, seq_length, e),
            block_bytes=(layer,) * n,
            block_input_bytes=(rows * seq_length * config.hidden_size * e.residual,) * n,
            block_backward_bytes=(backward,) * n,
            inputs_saved=(e.input_copies == 1,) * n,
            mlp_tiling=MlpTiling(why_not=_NOT_GATED) if tile_mlp else None,
        )
    inputs = _meta_inputs(profile, micro_batch_size, rows, seq_length, image_size)
    padded = padding_mask and rows > 1 and not vision  # one row pads nothing
    counted, fused, tiling, chunk_bytes = _meta_count(profile, inputs, attention, weights, lora_r, lora_dropout, tile_mlp,
                                                      padded)
    # no formula: the gradients of a block's output and input, each the size of its input; and the larger of what a
    # tiled MLP's backward holds, one chunk's intermediates (NOTE [The tiled MLP in the estimate]), and the fused
    # attention's backward or an adapted projection's (NOTE [Attention and adapter backwards in the estimate]): the
    # MLP's backward has ended when the attention's starts
    extra = attention_and_adapter_backward_bytes(profile.config, rows * (seq_length or 0), weights, lora_r, fused,
                                                 lean=bool(tiling is not None and tiling.tiled_blocks))
    backward = tuple(2 * b + max(c, extra) for b, c in zip(counted.block_input_bytes, chunk_bytes))
    return dataclasses.replace(counted, block_backward_bytes=backward, fused_attention=fused, mlp_tiling=tiling,
                               padded=padded and fused)


def attention_and_adapter_backward_bytes(config: Any, tokens: int, weights: str, lora_r: int, fused: bool, lean: bool) -> int:
    """What a decoder block's backward holds a moment beyond what it saved and the gradients of its input and output:
    the larger of the fused attention's backward and the widest LoRA projection's float32 sum (they run one after
    the other).

    # NOTE [Attention and adapter backwards in the estimate]
    A fused (flash) attention's backward makes the gradients of the query, key and value, the key's and value's at
    the query's width where there are fewer key-value heads (expanded, then summed), and a float32 accumulator of
    the query's gradient: ``tokens x query width x (4 + 3 x element)``. A peft LoRA projection over bf16 weights
    whose adapters are float32 (peft's default) backs its float32 sum (NOTE [Lean inputs in a tiled block],
    tiled_mlp.py): the sum's float32 gradient, its cast and its scaled copy beside the incoming gradient, 12 bytes
    an output element, or 6 where memfit runs the layer lean (a block whose MLP it tiles); the widest projection
    outside the MLP counts (a tiled MLP's run a chunk at a time). Both by formula: the meta count runs no backward.

    Example:
        >>> from transformers import LlamaConfig
        >>> c = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
        >>> attention_and_adapter_backward_bytes(c, 65536, "bf16", 0, True, False) / 2**30  # the attention's
        2.5
        >>> attention_and_adapter_backward_bytes(c, 65536, "bf16", 16, True, False) / 2**30  # q's and o's float32 sum
        3.0
    """
    if tokens <= 0 or not isinstance(getattr(config, "hidden_size", None), int):
        return 0  # a vision model (no sequence of tokens) or a config without one hidden width
    element = 2 if weights == "bf16" else 4
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (config.hidden_size // heads if heads else 0))
    query = heads * head_dim
    attention = tokens * query * (4 + 3 * element) if fused and query else 0
    adapter = 0
    if lora_r and weights == "bf16":  # float32 adapters over bf16 weights: peft's float32 sum
        adapter = tokens * max(query, int(config.hidden_size)) * (6 if lean else 12)
    return max(attention, adapter)


def _meta_inputs(
    profile: ModelProfile, micro: int, rows: int, seq_length: int | None, image_size: int | None
) -> dict[str, torch.Tensor]:
    """Inputs and labels on the meta device shaped as ``profile.task`` takes them."""
    meta = {"device": "meta"}
    if profile.task == "image-classification":
        channels = getattr(profile.config, "num_channels", 3)
        return {
            "pixel_values": torch.empty(rows, channels, image_size, image_size, **meta),
            "labels": torch.zeros(rows, dtype=torch.long, **meta),
        }
    if profile.task == "multiple-choice":
        ids = torch.zeros(micro, rows // micro, seq_length, dtype=torch.long, **meta)
        return {"input_ids": ids, "labels": torch.zeros(micro, dtype=torch.long, **meta)}
    # a mask given (as the tasks' collators give one): a decoder without it looks for packed
    # rows, which reads a value (.item()) that the meta device does not have
    inputs = {"input_ids": torch.zeros(rows, seq_length, dtype=torch.long, **meta),
              "attention_mask": torch.ones(rows, seq_length, dtype=torch.long, **meta)}
    if profile.task == "question-answering":
        inputs["start_positions"] = inputs["end_positions"] = torch.zeros(rows, dtype=torch.long, **meta)
    elif profile.task in ("token-classification", "causal-lm"):
        inputs["labels"] = torch.zeros(rows, seq_length, dtype=torch.long, **meta)
    else:
        inputs["labels"] = torch.zeros(rows, dtype=torch.long, **meta)
    return inputs


def _storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, told apart from others on the meta device.

    NOTE [Storage identity on meta]: meta storages have no address (data_ptr() is 0), so
    storages are told apart by their StorageImpl handle (``_cdata``), shared by all views. A
    handle is an address too: once its storage is freed, a later one may get it, and would be
    taken for one already counted. So the count holds every tensor it counts to its end.
    """
    return t.untyped_storage()._cdata


def _count_on_meta(model: nn.Module, inputs: dict[str, torch.Tensor]) -> ActivationProfile:
    """Run ``model`` on the meta device and count the bytes saved for backward per block.

    A block's input is its hidden states (its first tensor argument); the other tensors it is given
    (a mask, position embeddings) are every block's: those no saved tensor holds are counted once as
    :attr:`ActivationProfile.shared_input_bytes` (those a block saves are in its bytes).
    """
    from memfit.engine.parts.blocks import find_blocks
    from memfit.engine.shapes import first_tensor

    key = _storage_key
    blocks = [m for _, m in find_blocks(model)]
    skip = {key(t) for t in [*model.parameters(), *model.buffers()]}
    seen: set[int] = set()
    held: list[torch.Tensor] = []
    saved = [0] * (len(blocks) + 1)  # last slot: outside any block
    inputs_bytes = [0] * len(blocks)
    input_keys: list[int | None] = [None] * len(blocks)
    input_saved = [False] * len(blocks)
    shared: dict[int, int] = {}
    current = [len(blocks)]
    after = [False, 0]  # past the last block's forward; what is saved there

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] < len(blocks) and key(t) == input_keys[current[0]]:
            input_saved[current[0]] = True
        if key(t) not in skip and key(t) not in seen:
            seen.add(key(t))
            held.append(t)  # NOTE [Storage identity on meta]
            if after[0] and current[0] == len(blocks):
                after[1] += t.untyped_storage().nbytes()
            else:
                saved[current[0]] += t.untyped_storage().nbytes()
        return t

    def enter(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            current[0] = index
            hidden = first_tensor(args, kwargs)
            if hidden is not None:
                inputs_bytes[index], input_keys[index] = hidden.untyped_storage().nbytes(), key(hidden)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t is not hidden and t.is_floating_point() and key(t) not in skip:
                    shared[key(t)] = t.untyped_storage().nbytes()

        return hook

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        after[0] = after[0] or current[0] == len(blocks) - 1
        current[0] = len(blocks)

    handles = [b.register_forward_pre_hook(enter(k), with_kwargs=True) for k, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave, with_kwargs=True) for b in blocks]
    was_training = model.training
    try:
        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return ActivationProfile(saved[-1] + after[1], tuple(saved[:-1]), tuple(inputs_bytes),
                             shared_input_bytes=sum(n for k, n in shared.items() if k not in seen),
                             outside_after_bytes=after[1], inputs_saved=tuple(input_saved))


def _with_lora(model: nn.Module, r: int, dropout: float = LORA_DROPOUT) -> nn.Module:
    """``model`` (a meta copy) with peft's LoRA of rank ``r`` and dropout ``dropout`` (memfit train's
    ``--lora_dropout``, :data:`~memfit.tasks.causal_lm.LORA_DROPOUT` by default) on every linear layer of the blocks,
    as ``memfit train --use_peft --lora_target_modules all-linear`` puts it: the base frozen (its linear layers save
    no input), each adapter's input (dropped out where ``dropout`` > 0) in float32 (peft casts it to the adapter's dtype)."""
    import peft

    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    with torch.device("meta"):
        return peft.get_peft_model(model, config)


#: why a model's MLPs are not tiled when its blocks have no gated MLP (NOTE [Tiled MLP], tiled_mlp.py)
_NOT_GATED = ("an MLP that is not gated (memfit tiles gate_proj, up_proj, down_proj and act_fn, or gate_up_proj, "
              "down_proj and activation_fn)")


#: why a model's gated MLPs are counted untiled where their input has another use (NOTE [Tiled MLP], tiled_mlp.py)
_REORDERED = ("an MLP whose input another op uses too (a post-norm residual, a router): tiled, its gradient would be "
              "summed in another order, so memfit tiles it only where warm-up finds keep's gradients bit for bit")


def _meta_count(profile: ModelProfile, inputs: dict[str, torch.Tensor], attention: str, weights: str, lora_r: int,
                lora_dropout: float = LORA_DROPOUT, tile_mlp: bool = False, padded: bool = False,
                ) -> tuple[ActivationProfile, bool, MlpTiling | None, tuple[int, ...]]:
    """Count a meta copy of ``profile.model`` as a CUDA step runs it (NOTE [What the meta count runs]).

    # NOTE [What the meta count runs]
    A copy of the model on the meta device, in the weights' dtype (bf16 weights: bf16 activations, as
    ``--torch_dtype bfloat16`` runs; fp32 otherwise, an upper bound under autocast, which the meta
    device does not run), with LoRA where it is asked (:func:`_with_lora`, its dropout ``--lora_dropout``), the
    fused kernels' saved tensors (NOTE [Fused kernels on the meta device], meta_kernels.py): flash attention for
    ``sdpa`` where the model runs it, CUDA's dropout mask; and with ``tile_mlp`` the gated MLPs the engine tiles
    run tiled (NOTE [The tiled MLP in the estimate]); ``padded``, the batch's padding mask as the fused attention
    saves it per call and the boolean mask every block reads once (NOTE [Fused kernels on the meta device]). The
    profile's own model is left as it is.

    # NOTE [The tiled MLP in the estimate]
    Where the setup's blocks re-run with their MLP tiled (``--checkpoint host``: ``host_checkpoint_tiled``, the
    engine's floor treatment where it tiles; ``--checkpoint tiled``: ``recompute_tiled``), the count runs the
    engine's own tiled MLP (:func:`~memfit.engine.parts.treatments.tiled_mlp.tiled`, in the chunks the engine's
    ``Chunking`` gives at this shape) on the MLPs the engine tiles
    (:func:`~memfit.engine.parts.treatments.tiled_mlp.tileable_mlps`: gated, with no dropout of p > 0 inside, so
    none under peft's LoRA dropout; a meta copy is neither sharded nor compiled) and tiles for sure: those whose
    input's gradient a tiled run sums in the untiled order, read from a plain meta forward's autograd graph
    (:func:`~memfit.engine.parts.treatments.tiled_mlp.keeps_sum_order`; the others, which the engine tiles only
    where warm-up's comparison finds keep's gradients, are counted untiled: NOTE [Tiled MLP]). So what the block saves is
    measured as the rest of the count measures it: its MLP keeps only its input. The MLP's backward runs it
    again a chunk at a time, which the count does not run (it runs no backward): the block's backward
    temporaries get what the plain MLP saves on the longest chunk's tokens, counted on the meta device (the
    chunk's gradients, like an untiled MLP's, not counted), and where it runs in several chunks the float32 sums of
    its parameters' gradients where those are not float32 (full fine-tuning in bf16: 4 B a parameter). Elsewhere, and where the engine
    would not tile, the MLP runs on every token at once, and the estimate's note says why (:class:`MlpTiling`).

    Returns:
        The counted profile, whether attention was counted as the fused kernel, how the MLPs were tiled (None
        without ``tile_mlp``) and per block what its tiled MLP's backward holds (zeros where none is tiled).
    """
    from memfit.engine.parts.blocks import find_blocks

    model = copy.deepcopy(profile.model)
    if weights == "bf16":
        model.to(torch.bfloat16)
    if lora_r:
        model = _with_lora(model, lora_r, lora_dropout)
    blocks = [b for _, b in find_blocks(model)]
    mlps = [tileable_mlps(b) if tile_mlp else [] for b in blocks]
    gated = any(mlps)
    if gated:  # those the engine tiles for sure: the order of their input's gradient sums kept (NOTE [Tiled MLP])
        mlps = _in_order(model, inputs, mlps)
    chunking = Chunking.rerun()  # every block re-run tiled
    ran_on: dict[nn.Module, torch.Tensor] = {}  # each tiled MLP's input (a meta tensor)

    def seen(mlp: nn.Module, args: tuple) -> None:
        ran_on[mlp] = args[0]

    handles = [m.register_forward_pre_hook(seen) for ms in mlps for m in ms]
    try:
        lean = [m for b, ms in zip(blocks, mlps) if ms for m in lean_parts(b, ms)]  # NOTE [Lean inputs in a tiled block]
        with cuda_kernels(model, attention, padded) as ran, tiled([m for ms in mlps for m in ms], chunking, lean):
            counted = _count_on_meta(model, inputs)
    finally:
        for h in handles:
            h.remove()
    if padded and ran.attention_calls:  # the boolean mask every block reads, one byte an element, held once
        ids = inputs["input_ids"]  # rows x length, or examples x choices x length
        mask = ids.numel() * ids.shape[-1]
        counted = dataclasses.replace(counted, shared_input_bytes=counted.shared_input_bytes + mask)
    held = tuple(sum(_tiled_backward_bytes(m, ran_on[m], chunking) for m in ms if m in ran_on) for ms in mlps)
    tiling = _mlp_tiling(blocks, [[m for m in ms if m in ran_on] for ms in mlps], ran_on, chunking,
                         lora_dropout if lora_r else 0.0, reordered=gated) if tile_mlp else None
    return counted, ran.attention_calls > 0, tiling, held


def _in_order(model: nn.Module, inputs: dict[str, torch.Tensor], mlps: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """Of each block's tileable ``mlps``, those whose input's gradient a tiled run sums in the untiled order, read from a
    plain meta forward's autograd graph (:func:`~memfit.engine.parts.treatments.tiled_mlp.keeps_sum_order`). The
    others the engine tiles only where warm-up's comparison finds keep's gradients (NOTE [Tiled MLP]): counted
    untiled, a floor as high as it can be."""
    seen: dict[int, tuple[Any, Any]] = {}
    hooks = noting_mlps([m for ms in mlps for m in ms], seen)
    try:
        with torch.enable_grad():
            out = model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    edges = graph_edges(list(out.values()) if isinstance(out, dict) else tree_leaves(out))
    return [[m for m in ms if id(m) in seen and keeps_sum_order(*seen[id(m)], edges)] for ms in mlps]


def _tiled_backward_bytes(mlp: nn.Module, x: torch.Tensor, chunking: Chunking) -> int:
    """What ``mlp``'s tiled backward holds besides what the block saved, at input ``x`` (NOTE [The tiled MLP in the
    estimate]): what the plain MLP saves on the longest chunk (its input, a view of the saved ``x``, not counted)
    and, in several chunks, the float32 sums of its gradients where its trainable parameters are not float32 (one
    chunk's gradients are returned as they come: NOTE [Tiled MLP])."""
    chunks = mlp_chunks(mlp, x, chunking)
    rows = -(-(x.numel() // x.shape[-1]) // chunks)  # the longest chunk: the first ones are a row longer
    chunk = torch.empty(rows, x.shape[-1], dtype=x.dtype, device=x.device, requires_grad=True)
    skip = {_storage_key(t) for t in [chunk, *mlp.parameters(), *mlp.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage_key(t) not in skip:
            saved[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(chunk)
    sums = 4 * sum(p.numel() for p in mlp.parameters() if p.requires_grad and p.dtype != torch.float32) if chunks > 1 else 0
    return sum(saved.values()) + sums


def _mlp_tiling(blocks: list[nn.Module], tiled_mlps: list[list[nn.Module]], ran_on: dict[nn.Module, torch.Tensor],
                chunking: Chunking, lora_dropout: float, reordered: bool = False) -> MlpTiling:
    """How the count tiled the blocks' MLPs, or why the engine would not (NOTE [The tiled MLP in the estimate];
    ``reordered``: tileable MLPs were found, none of which keeps its input's gradient sums in order)."""
    if any(tiled_mlps):
        chunks, tokens = max((mlp_chunks(m, ran_on[m], chunking), ran_on[m].numel() // ran_on[m].shape[-1])
                             for ms in tiled_mlps for m in ms)
        return MlpTiling(sum(1 for ms in tiled_mlps if ms), chunks, -(-tokens // chunks))
    if not any(elementwise_parts(b)[1] for b in blocks):
        return MlpTiling(why_not=_NOT_GATED)
    if reordered:
        return MlpTiling(why_not=_REORDERED)
    lora = f": peft's LoRA dropout {lora_dropout:g}, --lora_dropout 0 tiles it" if lora_dropout else ""
    return MlpTiling(why_not=f"an MLP with a dropout of p > 0 inside{lora}", dropout_inside=True)


@dataclass(frozen=True)
class TrainingSetup:
    """One way to run a training step: precision, optimizer, batch split, checkpoint plan."""

    precision: str = "fp32"
    """``fp32``, or mixed precision ``bf16`` / ``fp16`` (autocast, fp32 master weights)."""
    optimizer: str = "adamw"
    """A key of :data:`OPTIMIZERS`."""
    micro_batch_size: int = 8
    """Examples per forward/backward (``--per_device_train_batch_size``)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (``--gradient_accumulation_steps``)."""
    checkpoint: str = "none"
    """``none``, ``full`` (every block), a number of blocks to checkpoint, ``tiled`` (every block on
    ``recompute_tiled``: recomputed, its gated MLP in chunks of tokens) or ``host`` (every block on
    ``host_checkpoint_tiled``: its input in pinned host memory until its recompute, its MLP in chunks; NOTE
    [Checkpoints on the host in the estimate]). Where the engine tiles no MLP of the model, ``tiled`` is
    ``recompute`` and ``host`` ``host_checkpoint`` (NOTE [The tiled MLP in the estimate])."""
    weights: str = "fp32"
    """dtype the weights are stored in: ``fp32``, or ``bf16`` (``--torch_dtype bfloat16``: no fp32
    master copy; gradients and optimizer state in bf16 too). ``bf16`` needs precision ``bf16``."""
    lora_r: int = 0
    """LoRA rank on every linear layer of the blocks (``--use_peft --lora_r R --lora_target_modules
    all-linear``); 0: full fine-tuning."""
    head: str = "keep"
    """The LM head of a causal LM: ``keep`` (the model's own loss) or ``chunked`` (memfit's chunked
    logits and loss, NOTE [The head in the estimate]); other tasks keep theirs."""
    head_chunks: int = 0
    """The chunked head's chunk count; 0: the count a step whose plan names no head runs (NOTE [The head in
    the estimate]). The floor (floor.py) gives the most the planner offers."""
    lora_dropout: float = LORA_DROPOUT
    """peft's LoRA dropout with ``lora_r`` (``--lora_dropout``; memfit train's default): its masks are counted,
    and an MLP with a dropout inside is not tiled (NOTE [The tiled MLP in the estimate])."""
    optimizer_step: str = KEEP
    """The optimizer step's treatment (parts/optimizer_step.py): ``keep`` (as torch makes it: foreach AdamW on
    CUDA) or ``per_tensor`` (torch's for-loop step, its temporaries one tensor's: what memfit runs where
    foreach's do not fit); an optimizer without a per-tensor step (:attr:`_Optimizer.per_tensor`) runs as made."""
    shards: int = 1
    """Ranks FSDP2 shards the weights, gradients and optimizer state over (the Trainer's ``--fsdp``, every rank of
    every node); the estimate is then one rank's (NOTE [Sharded ranks in the estimate], sharded.py)."""

    def __post_init__(self) -> None:
        _check_choice("head", self.head, HEAD_CHOICES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("weights", self.weights, ("fp32", "bf16"))
        if self.weights == "bf16" and self.precision != "bf16":
            raise FlagError("bf16 weights compute in bf16: give --precision bf16 with them")
        if self.lora_r < 0:
            raise FlagError(f"--lora_r {self.lora_r}: give a rank of at least 1 (or 0 for full fine-tuning)")
        _check_choice("optimizer", self.optimizer, tuple(OPTIMIZERS))
        if self.micro_batch_size < 1 or self.accumulation_steps < 1:
            raise FlagError("--batch_size and --gradient_accumulation_steps must be at least 1")
        if self.checkpoint not in CHECKPOINT_WORDS and not str(self.checkpoint).isdigit():
            raise FlagError(f"--checkpoint {self.checkpoint!r}: write none, full, tiled, host or a number of blocks")
        if self.head_chunks < 0:
            raise FlagError(f"head_chunks {self.head_chunks}: give a chunk count of at least 1, or 0")
        check_lora_dropout(self.lora_dropout)
        _check_choice("optimizer_step", self.optimizer_step, (KEEP, PER_TENSOR))
        if self.shards < 1:
            raise FlagError(f"--shards {self.shards}: give the number of ranks FSDP shards over (1: one GPU, unsharded)")

    @property
    def batch_size(self) -> int:
        """Examples per optimizer step."""
        return self.micro_batch_size * self.accumulation_steps

    def checkpointed_blocks(self, n_blocks: int) -> int:
        """Blocks checkpointed out of ``n_blocks``.

        Raises:
            FlagError: when a number larger than ``n_blocks`` was given.
        """
        if self.checkpoint == "none":
            return 0
        if self.checkpoint in ("full", "tiled", "host"):
            return n_blocks
        if int(self.checkpoint) > n_blocks:
            raise FlagError(f"--checkpoint {self.checkpoint}: the model has only {n_blocks} blocks")
        return int(self.checkpoint)

    @property
    def on_host(self) -> bool:
        """Every block on ``host_checkpoint`` (NOTE [Checkpoints on the host in the estimate])."""
        return self.checkpoint == "host"

    @property
    def tiles_mlp(self) -> bool:
        """Every block re-run with its gated MLP tiled where the engine tiles it (NOTE [The tiled MLP in the estimate])."""
        return self.checkpoint in ("tiled", "host")


#: the words ``--checkpoint`` takes besides a number of blocks
CHECKPOINT_WORDS = ("none", "full", "tiled", "host")
#: what ``--head`` takes (NOTE [The head in the estimate])
HEAD_CHOICES = ("keep", "chunked")


@dataclass(frozen=True)
class LmHead:
    """The LM head's bytes for one micro-batch, kept and chunked (NOTE [The head in the estimate]).

    Attributes:
        tokens: tokens of the micro-batch (``micro-batch x seq_length``).
        kept: :class:`~memfit.engine.parts.head.HeadBytes` of the head as the model computes it.
        chunked: the same with memfit's chunked head in ``n_chunks`` chunks.
        n_chunks: the chunk count estimated.
    """

    tokens: int
    kept: HeadBytes
    chunked: HeadBytes
    n_chunks: int

    def bytes(self, treatment: str) -> int:
        """Saved + transient bytes of ``treatment`` (``keep`` or ``chunked``): its peak at the head."""
        b = self.kept if treatment == "keep" else self.chunked
        return b.saved_bytes + b.transient_bytes


def lm_head_bytes(profile: "ModelProfile", tokens: int, precision: str = "fp32", weights: str = "fp32",
                  n_chunks: int = 0) -> LmHead | None:
    """The head's bytes of a causal LM at ``tokens`` tokens per micro-batch, chunked in ``n_chunks`` (0: the
    count a plan without a head runs); None for another task.

    # NOTE [The head in the estimate]
    The head's bytes come from :func:`memfit.engine.parts.head.head_saved_bytes` (the formula memfit plans
    with, NOTE [Head bytes]): its saved bytes replace, in the activations counted on the meta device,
    what the kept head saved there, and its transient (the logits in the model's dtype and their
    float32 copy, or one chunk's) is added at the end of the forward, when the loss runs. The logits'
    dtype is the weights' (bf16 weights), else autocast's (fp16/bf16), else float32. ``chunked`` is
    estimated at the count a step whose plan names no head runs on CUDA (NOTE [A plan without a head],
    :func:`memfit.engine.parts.treatments.chunked_head.head_without_a_plan`, ``pure``): what ``none`` and
    ``full`` run with ``--memfit_head plan``, and more than ``dynamic`` chunks in where fewer fit. The
    floor takes the most chunks the planner offers (:func:`most_head_chunks`).
    """
    if profile.task != "causal-lm":
        return None
    vocab, hidden, dtype, softcap = _head_shape(profile, precision, weights)
    kept = head_saved_bytes(tokens, vocab, hidden, dtype, "keep", softcap=softcap)
    n_chunks = n_chunks or head_without_a_plan(head_options(tokens, vocab, hidden, dtype, 0.0, 0.0, softcap=softcap))[1]
    return LmHead(tokens, kept, head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", n_chunks, softcap), n_chunks)


def most_head_chunks(profile: "ModelProfile", tokens: int, precision: str = "fp32", weights: str = "fp32") -> int:
    """The most chunks the planner offers a causal LM's head at ``tokens`` tokens (the last of
    :func:`memfit.engine.parts.treatments.chunked_head.head_options`: a doubling past it saves too little); 0 for
    another task."""
    if profile.task != "causal-lm":
        return 0
    vocab, hidden, dtype, softcap = _head_shape(profile, precision, weights)
    return head_options(tokens, vocab, hidden, dtype, 0.0, 0.0, softcap=softcap)[-1][1]


def _head_shape(profile: "ModelProfile", precision: str, weights: str) -> tuple[int, int, torch.dtype, bool]:
    """Vocabulary, hidden size, the logits' dtype and whether they are soft-capped (NOTE [The head in the estimate])."""
    config = profile.config
    dtype = torch.bfloat16 if weights == "bf16" else {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return int(config.vocab_size), int(config.hidden_size), dtype, getattr(config, "final_logit_softcapping", None) is not None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step on the GPU, by part (see NOTE [What each part assumes])."""

    setup: TrainingSetup
    """The setup estimated."""
    n_params: int
    """Trainable parameters."""
    n_blocks: int
    """Checkpointable blocks of the model."""
    checkpointed_blocks: int
    """Blocks checkpointed in this setup."""
    weights_bytes: int
    """fp32 weights (master weights under fp16/bf16)."""
    autocast_copies_bytes: int
    """Half copies of the matmul weights under fp16/bf16 autocast (forward and backward only)."""
    gradients_bytes: int
    """fp32 gradients."""
    optimizer_state_bytes: int
    """Optimizer state."""
    activations_bytes: int
    """Peak bytes saved for backward by one micro-batch (recomputed blocks included)."""
    backward_bytes: int
    """Peak over forward and backward, above weights and optimizer state: autocast copies,
    saved activations, the gradients made so far and backward temporaries
    (NOTE [Phases of a step])."""
    optimizer_step_bytes: int
    """Temporaries inside ``optimizer.step()`` (after activations are freed)."""
    step_per_tensor: bool = False
    """Whether those are the step's run per tensor (``TrainingSetup.optimizer_step``, where fewer than as made)."""
    workspace_bytes: int = LIBRARY_WORKSPACE_BYTES
    """cuBLAS/cuBLASLt workspaces: inside the caching allocator and the cap."""
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    """CUDA context: outside the caching allocator and outside the budget cap."""
    notes: tuple[str, ...] = field(default=())
    """Caveats that apply to this estimate."""
    lm_head: LmHead | None = None
    """A causal LM's head, kept and chunked (NOTE [The head in the estimate]); None for other tasks."""
    recompute_bytes: int = 0
    """The most one checkpointed block holds while it is recomputed and runs its backward: what it saves,
    its input, the stash fetched ahead (on the host), its backward's temporaries; 0 with none checkpointed."""
    host_bytes: int = 0
    """Pinned host memory the blocks on ``host_checkpoint`` hold (NOTE [Checkpoints on the host in the
    estimate]); outside the GPU and its budget, bounded by ``--memfit_host_budget``."""
    mlp_tiling: MlpTiling | None = None
    """How the blocks' gated MLPs were counted where the setup tiles them; None where it does not (NOTE [The
    tiled MLP in the estimate])."""
    gathered_bytes: int = 0
    """Under FSDP2 (``setup.shards`` > 1): the unsharded parameters and gradients a rank holds at once in forward
    and backward beside its shares (NOTE [Sharded ranks in the estimate], sharded.py); 0 on one GPU."""

    @property
    def block_treatment(self) -> str:
        """The treatment every checkpointed block is counted on: ``recompute``, ``recompute_tiled``,
        ``host_checkpoint`` or ``host_checkpoint_tiled`` (the tiled ones where the count tiled the MLP)."""
        tiled = self.mlp_tiling is not None and self.mlp_tiling.tiled_blocks > 0
        if self.setup.on_host:
            return HOST_CHECKPOINT_TILED if tiled else HOST_CHECKPOINT
        return RECOMPUTE_TILED if tiled else RECOMPUTE

    @property
    def static_bytes(self) -> int:
        """Weights + gradients + optimizer state: what no checkpointing can shrink."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes

    @property
    def backward_peak_bytes(self) -> int:
        """Allocator peak of forward and backward (workspaces and, under FSDP2, the gathered parameters included)."""
        return self.workspace_bytes + self.weights_bytes + self.optimizer_state_bytes + self.backward_bytes + self.gathered_bytes

    @property
    def step_peak_bytes(self) -> int:
        """Allocator peak of ``optimizer.step()`` (workspaces included)."""
        return self.workspace_bytes + self.static_bytes + self.optimizer_step_bytes

    @property
    def total_bytes(self) -> int:
        """Peak of the caching allocator: what a budget caps (CUDA context excluded)."""
        return max(self.backward_peak_bytes, self.step_peak_bytes)

    @property
    def device_bytes(self) -> int:
        """Total on the GPU: :attr:`total_bytes` plus the CUDA context."""
        return self.total_bytes + self.cuda_context_bytes

    def fits(self, budget_bytes: int) -> bool:
        """Whether :attr:`total_bytes` fits ``budget_bytes`` (the cap excludes the context)."""
        return self.total_bytes <= budget_bytes


def backward_phase_bytes(
    profile: ModelProfile, activations: ActivationProfile, n_checkpointed: int, half: bool, grad_bytes: int = 4,
    head_transient_bytes: int = 0, on_host: bool = False, shards: int = 1,
) -> int:
    """Peak over forward and backward above weights and optimizer state (NOTE [Phases of a step]).

    Args:
        profile: the model (its per-block parameters).
        activations: saved and backward-temporary bytes per block for the micro-batch.
        n_checkpointed: the first blocks checkpointed.
        half: fp16/bf16 autocast (2 B copies of the matmul weights).
        grad_bytes: bytes of each parameter's gradient (4; 2 for bf16 weights; 0 when the
            parameters are frozen, as under LoRA, whose own small gradients are left out).
        head_transient_bytes: what the LM head's loss holds while it runs, at the end of the
            forward (NOTE [The head in the estimate]).
        on_host: the checkpointed blocks are on ``host_checkpoint`` (NOTE [Checkpoints on the host in the
            estimate]).
        shards: ranks the gradients are sharded over (NOTE [Sharded ranks in the estimate], sharded.py: the
            gathered parameters are counted apart).

    Returns:
        The largest of: the end of the forward, and each block's backward.
    """
    n = profile.n_blocks
    half_bytes = 2 if half else 0
    block_params = profile.block_params or (0,) * n
    block_copies = [half_bytes * m for m in (profile.block_matmul_params or (0,) * n)]
    head_copies = half_bytes * profile.matmul_weight_params - sum(block_copies)
    grads = [per_rank(grad_bytes * p, shards) for p in block_params]
    head_grads = per_rank(grad_bytes * (profile.n_params - sum(block_params) - profile.embedding_params), shards)
    kept = activations.kept_bytes(n_checkpointed, on_host)
    outside = activations.outside_bytes + activations.shared_bytes(n_checkpointed)
    # end of forward: the autocast cache holds every copy, checkpointed blocks' too
    peak = outside + sum(kept) + activations.in_flight_bytes(on_host) + sum(block_copies) + head_copies + head_transient_bytes
    # block j's backward: blocks before it keep theirs (copies of un-checkpointed ones), it
    # holds all it saves and its temporaries, the head and blocks after it have gradients
    before = [0]
    for j in range(n - 1):
        before.append(before[-1] + kept[j] + (block_copies[j] if j >= n_checkpointed else 0))
    grads_after = head_grads
    for j in reversed(range(n)):
        current = block_backward_moment(profile, activations, j, n_checkpointed, half, on_host)
        peak = max(peak, outside - activations.outside_after_bytes + before[j] + current + grads_after)
        grads_after += grads[j]
    return peak


def block_backward_moment(profile: ModelProfile, activations: ActivationProfile, index: int, n_checkpointed: int,
                          half: bool, on_host: bool = False) -> int:
    """What block ``index`` holds while its backward runs (NOTE [Phases of a step]): all it saves (recomputed,
    with its input and on the host the stash fetched ahead, when checkpointed), its autocast copies and its
    backward's temporaries."""
    saved = activations.recompute_bytes(index, on_host) if index < n_checkpointed else activations.block_bytes[index]
    copies = 2 * profile.block_matmul_params[index] if half and profile.block_matmul_params else 0
    temps = activations.block_backward_bytes[index] if activations.block_backward_bytes else 0
    return saved + copies + temps


def estimate(
    profile: ModelProfile,
    setup: TrainingSetup,
    *,
    seq_length: int | None = None,
    image_size: int | None = None,
    attention: str = "sdpa",
    num_choices: int = 4,
    padding_mask: bool = True,
    activations: ActivationProfile | None = None,
) -> MemoryEstimate:
    """Estimate the memory of one training step.

    Args:
        profile: the model (``ModelProfile.from_config``).
        setup: precision, optimizer, batch split, checkpoint plan.
        seq_length: tokens per example of the longest batch (text models).
        image_size: pixels per side (vision models).
        attention: ``sdpa`` (fused, the transformers default) or ``eager``.
        num_choices: choices per example for ``multiple-choice``.
        padding_mask: whether batches of several rows carry padding (dynamic padding: yes).
        activations: a precomputed :func:`activation_profile` for this micro-batch and
            precision (the advisor reuses them); computed when ``None``.

    Returns:
        The :class:`MemoryEstimate`.

    Example:
        >>> from transformers import BertConfig
        >>> p = ModelProfile.from_config(BertConfig(num_hidden_layers=2), name="bert-2")  # doctest: +SKIP
        >>> estimate(p, TrainingSetup("bf16", "adamw", 8), seq_length=128).total_bytes  # doctest: +SKIP
    """
    if activations is None:
        activations = activation_profile(
            profile,
            setup.micro_batch_size,
            precision=setup.precision,
            seq_length=seq_length,
            image_size=image_size,
            attention=attention,
            num_choices=num_choices,
            padding_mask=padding_mask,
            weights=setup.weights,
            lora_r=setup.lora_r,
            lora_dropout=setup.lora_dropout,
            tile_mlp=setup.tiles_mlp,
        )
    shapes = profile.param_shapes
    optimizer = OPTIMIZERS[setup.optimizer]
    k = setup.checkpointed_blocks(profile.n_blocks)
    half = setup.precision != "fp32"
    notes = []
    if not optimizer_available(setup.optimizer):
        notes.append(f"{optimizer.needs} is not installed here: `memfit train {' '.join(optimizer.train_flags)}` needs it")
    if not profile.bert_family:
        notes.append(_meta_count_note(profile, setup, activations, attention))
    # NOTE [Weights dtype and LoRA in the estimate]
    # bf16 weights (--torch_dtype bfloat16) halve weights, gradients and the optimizer's
    # per-parameter state (kept in the parameters' dtype) and need no autocast copies. LoRA
    # freezes every weight: gradients and optimizer state are those of its A and B matrices,
    # kept in fp32 (peft's default for adapters), and the frozen weights get no gradient.
    width = 2 if setup.weights == "bf16" else 4
    if setup.lora_r:
        trained = profile.lora_shapes(setup.lora_r)
        n_trained = sum(_numel(s) for s in trained)
        state, step_temp, grads, grad_bytes = optimizer.state(trained), optimizer.step_temp(trained), 4 * n_trained, 0
    else:
        n_trained = 0
        state = optimizer.state(shapes) * width // 4
        step_temp = optimizer.step_temp(shapes) * width // 4
        grads, grad_bytes = width * profile.n_params, width
    step_per_tensor = False
    if setup.optimizer_step == PER_TENSOR and optimizer.per_tensor:
        per_tensor = _per_tensor_step_bytes(optimizer.per_tensor, trained if setup.lora_r else shapes, 4 if setup.lora_r else width)
        # the engine offers it only where its temporaries are fewer (parts/optimizer_step.py)
        step_per_tensor, step_temp = per_tensor < step_temp, min(step_temp, per_tensor)
    # NOTE [Sharded ranks in the estimate] (sharded.py): a rank's shares, the gathered parameters apart, which
    # FSDP2 gathers in the half precision (no autocast copy of them is made)
    copies = half and setup.weights == "fp32" and setup.shards == 1
    gathered = 0
    if setup.shards > 1:
        shards = setup.shards
        state, step_temp, grads = per_rank(state, shards), per_rank(step_temp, shards), per_rank(grads, shards)
        blocks = profile.block_params or (0,)
        gathered = gathered_bytes(blocks, profile.n_params - sum(profile.block_params), 2 if half else width,
                                  0 if setup.lora_r else width)
        notes.append(f"one rank's bytes of {shards} FSDP2 ranks: weights, gradients and optimizer state a 1/{shards} "
                     "share each, the parameters gathered for the blocks and the root apart (NOTE [Sharded ranks in "
                     "the estimate])")
    head = lm_head_bytes(profile, setup.micro_batch_size * (seq_length or 0), setup.precision, setup.weights,
                         setup.head_chunks)
    head_transient = 0
    if head is not None:  # NOTE [The head in the estimate]
        now = head.kept if setup.head == "keep" else head.chunked
        counted = _meta_head_saved(profile, head.tokens, setup.weights, bool(setup.lora_r))
        activations = dataclasses.replace(
            activations, outside_bytes=max(0, activations.outside_bytes - counted + now.saved_bytes),
            outside_after_bytes=max(0, activations.outside_after_bytes - counted + now.saved_bytes) if activations.outside_after_bytes else 0)
        head_transient = now.transient_bytes
    elif setup.head != "keep":
        raise FlagError(f"--head {setup.head}: only a causal LM has an LM head memfit chunks; give --head keep")
    return MemoryEstimate(
        setup=setup,
        n_params=profile.n_params,
        n_blocks=profile.n_blocks,
        checkpointed_blocks=k,
        weights_bytes=per_rank(width * profile.n_params + 4 * n_trained, setup.shards),
        autocast_copies_bytes=2 * profile.matmul_weight_params if copies else 0,
        gradients_bytes=grads,
        optimizer_state_bytes=state,
        activations_bytes=activations.total_bytes(k, setup.on_host),
        backward_bytes=backward_phase_bytes(profile, activations, k, copies, grad_bytes, head_transient, setup.on_host,
                                            setup.shards),
        optimizer_step_bytes=step_temp,
        step_per_tensor=step_per_tensor,
        notes=tuple(notes),
        lm_head=head,
        recompute_bytes=max((block_backward_moment(profile, activations, j, k, copies, setup.on_host) for j in range(k)),
                            default=0),
        host_bytes=pinned_host_bytes(activations, k) if setup.on_host else 0,
        mlp_tiling=activations.mlp_tiling,
        gathered_bytes=gathered,
    )


def _meta_count_note(profile: ModelProfile, setup: TrainingSetup, activations: ActivationProfile, attention: str) -> str:
    """What the activations counted on the meta device assume (NOTE [What the meta count runs])."""
    kernel = ("attention as SDPA's fused (flash) kernel saves it: query, key, value, output, a float32 log-sum-exp"
              + ("; a padded batch (several rows): the memory-efficient kernel, its padding mask's bias (b x s x s, "
                 "the query's dtype) and key and value at the query's heads saved per block, the boolean mask once"
                 if activations.padded else
                 "; no s x s matrix, no padding mask") if activations.fused_attention else
              f"eager attention ({'asked' if attention == 'eager' else 'the model does not run SDPA'}): its s x s "
              "weights counted")
    dtype = ("bf16 as the bf16 weights run" if setup.weights == "bf16" else
             "fp32: an upper bound under fp16/bf16 autocast" if setup.precision != "fp32" else "fp32")
    lora = f", peft's LoRA r {setup.lora_r} with dropout {setup.lora_dropout:g} on every linear layer" if setup.lora_r else ""
    return (f"activations counted on the meta device (no analytic formula for {profile.config.model_type}) in {dtype}{lora}; "
            f"{kernel}; {_mlp_words(activations.mlp_tiling, setup)}; a block's backward holds two block inputs "
            "besides what it saved and the larger of the fused attention's backward and the widest LoRA projection's "
            "float32 sum's (the MLP's own gradient temporaries not counted)")


def _mlp_words(tiling: MlpTiling | None, setup: TrainingSetup) -> str:
    """How the count ran the MLP, in words (NOTE [The tiled MLP in the estimate])."""
    if tiling is None:
        return "the MLP on every token at once (--checkpoint tiled or host count it tiled)"
    if not tiling.tiled_blocks:
        return f"the MLP on every token at once: not tiled, as memfit does not tile {tiling.why_not}"
    treatment = HOST_CHECKPOINT_TILED if setup.on_host else RECOMPUTE_TILED
    return (f"the MLP tiled as {treatment} runs it, in {tiling.chunks} chunk{'s' * (tiling.chunks > 1)} of at most "
            f"{tiling.chunk_tokens:,} tokens (the engine's chunking at this shape): it saves its input only, and its "
            "backward holds one chunk's intermediates (and, in several chunks, the float32 sums of its gradients where "
            "its weights are trained in bf16); its norms and LoRA adapters save their bf16 input, not a float32 copy")


def _meta_head_saved(profile: ModelProfile, tokens: int, weights: str = "fp32", lora: bool = False) -> int:
    """What the kept head saved in the activations counted on the meta device (NOTE [What the meta count runs]):
    in the count's dtype; under LoRA the frozen ``lm_head`` saves no input rows."""
    vocab, hidden, dtype, softcap = _head_shape(profile, "fp32", weights)  # the count's dtype: fp32 but for bf16 weights
    saved = head_saved_bytes(tokens, vocab, hidden, dtype, "keep", softcap=softcap).saved_bytes
    return saved - (tokens * hidden * dtype.itemsize if lora else 0)


def table_unit(budget: Budget | None) -> tuple[str, int]:
    """The unit of the tables' size columns, (name, bytes): the budget's
    :attr:`~memfit.engine.budget.Budget.column_unit` (NOTE [A budget as typed]), GiB without one."""
    return budget.column_unit if budget is not None else ("GiB", GIB)


def _in(n: int, unit: tuple[str, int]) -> str:
    return f"{n / unit[1]:.2f}"


def _head_rows(est: MemoryEstimate) -> list[tuple[str, int, str]]:
    """The LM head's rows of :func:`format_table` (inside forward + backward), the estimated treatment first."""
    head = est.lm_head
    if head is None:
        return []
    rows = {
        "keep": ("LM head, kept", head.bytes("keep"), "in forward + backward: cross-entropy's float32 log_softmax saved, "
                 "and while the loss runs the logits and their float32 copy"),
        "chunked": (f"LM head, chunked in {head.n_chunks}", head.bytes("chunked"), "in forward + backward: the hidden rows "
                    "saved and one chunk's logits at a time (memfit's chunked head)"),
    }
    chosen = est.setup.head
    return [(f"{rows[chosen][0]} (estimated)", *rows[chosen][1:]), *(row for name, row in rows.items() if name != chosen)]


def format_head_table(profile: ModelProfile, setup: TrainingSetup, seq_length: int,
                      unit: tuple[str, int] = ("GiB", GIB)) -> str:
    """The LM head's bytes per sequence length up to ``seq_length``, kept and chunked (NOTE [The head in
    the estimate]), as a markdown table in ``unit`` (name, bytes: :func:`table_unit`); empty for a model that
    is no causal LM.

    Example:
        >>> print(format_head_table(profile, TrainingSetup("bf16", weights="bf16"), 2048))  # doctest: +SKIP
    """
    lengths = sorted({*(2**k for k in range(8, max(8, seq_length.bit_length())) if 2**k < seq_length), seq_length})
    heads = [lm_head_bytes(profile, setup.micro_batch_size * length, setup.precision, setup.weights) for length in lengths]
    if heads[-1] is None:
        return ""
    lines = [
        f"LM head per sequence length (micro-batch {setup.micro_batch_size}, vocabulary {profile.config.vocab_size:,}): "
        "kept as the model computes it, and memfit's chunked head (peak at the head: saved + while the loss runs)",
        "",
        f"| seq_length | tokens | kept {unit[0]} | chunked {unit[0]} | chunks |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {length} | {h.tokens:,} | {_in(h.bytes('keep'), unit)} | {_in(h.bytes('chunked'), unit)} | {h.n_chunks} |"
              for length, h in zip(lengths, heads)]
    return "\n".join(lines)


def format_table(est: MemoryEstimate, budget: Budget | None = None, *, title: str = "") -> str:
    """The breakdown as a markdown table, with a verdict for ``budget``; sizes in the budget's
    :attr:`~memfit.engine.budget.Budget.column_unit` (MB for a budget typed in MB), else GiB.

    Args:
        est: the estimate.
        budget: the budget to check, as the user gave it, or ``None``.
        title: first line (model, task, input size).

    Returns:
        Multi-line text.
    """
    s = est.setup
    opt = OPTIMIZERS[s.optimizer]
    unit = table_unit(budget)
    rows = [
        ("weights", est.weights_bytes, "2 B/param bf16 (--torch_dtype bfloat16)" if s.weights == "bf16" else
         "4 B/param fp32" + ("" if s.precision == "fp32" else " (master weights)")),
        ("autocast copies", est.autocast_copies_bytes,
         "none in fp32" if s.precision == "fp32" else "2 B per matmul weight, freed by backward"),
        ("gradients", est.gradients_bytes, "2 B/param bf16" if s.weights == "bf16" and not s.lora_r else "4 B/param fp32"),
        ("optimizer state", est.optimizer_state_bytes, f"{s.optimizer} (fp32 state)"),
        ("activations", est.activations_bytes,
         f"saved for backward, every block on {est.block_treatment}: on the device one block at a time, the inputs on the host"
         if s.on_host else f"saved for backward, {est.checkpointed_blocks} of {est.n_blocks} blocks checkpointed"
         + (f" (every block on {est.block_treatment})" if s.tiles_mlp else "")),
        ("forward + backward", est.backward_bytes,
         "above weights + state: copies + activations + gradients made so far + backward temporaries"),
        *([("gathered by FSDP2", est.gathered_bytes, "the root's parameters and up to three blocks' (two and their "
            "unsharded gradients in backward) at once, unsharded")] if s.shards > 1 else []),
        *_head_rows(est),
        ("optimizer step temporaries", est.optimizer_step_bytes, "with all gradients, after activations are freed"
         + (", the step run per tensor (memfit's where foreach's do not fit)" if est.step_per_tensor else "")),
        ("CUDA library workspaces", est.workspace_bytes, "cuBLAS/cuBLASLt, inside the allocator"),
        ("peak of forward + backward", est.backward_peak_bytes, "workspaces + weights + state + forward + backward"
         + (" + gathered" if s.shards > 1 else "")),
        ("peak of optimizer step", est.step_peak_bytes, "workspaces + weights + gradients + state + step temporaries"),
        ("total (what the budget caps)", est.total_bytes, "the larger peak"),
        ("CUDA context", est.cuda_context_bytes, "outside the caching allocator and the budget cap"),
        ("total on the GPU", est.device_bytes, "total + CUDA context"),
        *([("pinned host memory", est.host_bytes, "every block's input in the host pool's power-of-two buffers: not on "
            "the GPU, within --memfit_host_budget")] if s.on_host else []),
    ]
    lines = [title] if title else []
    lines += [
        f"setup: {s.precision}, {s.optimizer} ({' '.join(opt.train_flags)}), micro-batch {s.micro_batch_size} "
        f"x {s.accumulation_steps} accumulation step(s), {est.n_params:,} parameters"
        + (f"; one rank's bytes of {s.shards} FSDP2 ranks" if s.shards > 1 else ""),
        "",
        f"| part | {unit[0]} | bytes | assumption |",
        "| --- | ---: | ---: | --- |",
    ]
    lines += [f"| {name} | {_in(n, unit)} | {n:,} | {note} |" for name, n, note in rows]
    if budget is not None:
        margin = budget.bytes - est.total_bytes
        verdict, rest = ("fits", "to spare") if margin >= 0 else ("does NOT fit", "short")
        lines += ["", f"{verdict} the budget of {budget}: {budget.size(abs(margin))} {rest}"]
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)
