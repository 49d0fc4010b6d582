"""What CUDA's fused kernels save for backward, for counting a model on the meta device.

# NOTE [Fused kernels on the meta device]
The meta device runs PyTorch's reference code: ``scaled_dot_product_attention`` takes its math
path there (it saves the ``s x s`` attention weights, as eager attention does) and dropout its
unfused one (it saves its scaled noise in the input's dtype). On CUDA a training step runs fused
kernels that save far less, and at long lengths the difference is the whole estimate (an 8B
decoder's eager attention saves 550 GB a block at 64k tokens). So :func:`cuda_kernels` runs a
count with two stand-ins that save what the CUDA kernels save:

* attention: a flash-attention kernel (``F.scaled_dot_product_attention`` on CUDA, with
  ``is_causal`` and no mask) saves its query, key and value (key and value at the key-value heads:
  the kernel takes grouped-query attention natively), its output, and a float32 log-sum-exp per
  query and head; no ``s x s`` matrix. The stand-in is an attention function registered, for the
  count only, under :data:`FUSED_ATTENTION` in transformers' attention interface; transformers
  builds no causal mask for an implementation it has no mask function for, as for a batch without
  padding. A padded batch (``padded``: several rows, as dynamic padding makes them) rules out flash:
  transformers makes a boolean ``b x 1 x s x s`` mask every block reads, and each attention call runs
  the memory-efficient kernel, which takes the mask as a bias in the query's dtype, made per call and
  saved for backward (``b x 1 x s x s`` rounded up to 16 in its last dimension); and where the model's
  key and value have fewer heads than its query (grouped-query attention), transformers repeats them to
  the query's heads before the call (SDPA's own grouped-query path is flash's, without a mask), so the
  kernel saves them at the query's heads. The stand-in saves both so per call, and the boolean mask is
  the count's caller's to add once. A mask the model makes itself (a vision model's window mask) is
  saved too, as the memory-efficient kernel, which takes one, saves it;
* dropout: CUDA's fused dropout saves a bool mask (1 B an element; peft's LoRA dropout is the one
  that matters: every adapted layer's input, in float32).

Models whose attention cannot run SDPA (``_supports_sdpa`` false, e.g. Gemma 2's soft-capped
attention) keep eager attention in the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["FUSED_ATTENTION", "cuda_kernels", "runs_fused_attention"]

#: the attention implementation the count runs, registered only while :func:`cuda_kernels` is open
FUSED_ATTENTION = "memfit_meta_fused"  # no "flash" in it: transformers would look for a flash-attention package


class _FlashStandIn(torch.autograd.Function):
    """Saves what a flash-attention kernel saves: query, key, value, output and a float32 log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, heads, s, d = query.shape
        # the kernel writes its output as (b, s, heads, d) and returns it transposed, so the caller's
        # transpose back and .contiguous() (transformers' attention functions) make no copy
        out = query.new_empty(b, s, heads, value.shape[-1]).transpose(1, 2)
        logsumexp = query.new_empty(b, heads, s, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        raise RuntimeError("a stand-in for counting saved bytes on the meta device; it has no backward")


class _Counted:
    """What a count ran: how many attention calls the stand-in answered; ``padded``: each call saves the padding
    mask's bias and key and value at the query's heads (NOTE [Fused kernels on the meta device])."""

    def __init__(self, padded: bool = False) -> None:
        self.attention_calls, self.padded = 0, padded

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """An attention function of transformers' interface: (b, heads, s, d) in, (b, s, heads, d) out."""
        self.attention_calls += 1
        if attention_mask is None and self.padded:  # the memory-efficient kernel's bias, its rows aligned to 16,
            attention_mask = query.new_empty(query.shape[0], 1, query.shape[2], -(-key.shape[2] // 16) * 16)
            heads = query.shape[1]  # and key and value repeated to the query's heads
            key, value = (t.new_empty(t.shape[0], heads, *t.shape[2:]) if t.shape[1] != heads else t for t in (key, value))
        return _FlashStandIn.apply(query, key, value, attention_mask).transpose(1, 2), None


class _FusedDropout(TorchFunctionMode):
    """``F.dropout`` in training as CUDA runs it: ``native_dropout``, which saves a bool mask."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.dropout:
            x, p, training = _dropout_args(*args, **kwargs)
            if training and 0 < p < 1:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def _dropout_args(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> tuple:
    return input, p, training


def runs_fused_attention(model: nn.Module) -> bool:
    """Whether ``model``'s attention can run as SDPA's fused kernels (transformers' ``_supports_sdpa``)."""
    return bool(getattr(model, "_supports_sdpa", False))


@contextlib.contextmanager
def cuda_kernels(model: nn.Module, attention: str = "sdpa", padded: bool = False) -> Iterator[_Counted]:
    """Count ``model`` (a meta copy the caller owns) with the CUDA kernels' saved tensors (NOTE [Fused kernels
    on the meta device]): fused dropout always, flash attention where ``attention`` is ``sdpa`` and the
    model runs SDPA (``padded``: the memory-efficient kernel with the padding mask's bias). Sets the model's
    attention implementation; leaves transformers' registry as it found it.

    Yields:
        What the count ran: its ``attention_calls`` (0: attention was counted as the model's own code ran it).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    counted = _Counted(padded)
    fused = attention == "sdpa" and runs_fused_attention(model)
    if fused:
        ALL_ATTENTION_FUNCTIONS[FUSED_ATTENTION] = counted.attention
    try:
        if fused:
            model.set_attn_implementation(FUSED_ATTENTION)
        with _FusedDropout():
            yield counted
    finally:
        if fused:
            del ALL_ATTENTION_FUNCTIONS[FUSED_ATTENTION]
