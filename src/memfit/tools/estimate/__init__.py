"""Memory anatomy of a training step from a model config, and advice for a budget.

* :mod:`memfit.tools.estimate.anatomy`: weights, gradients, optimizer state, activations and the
  CUDA context of one step (:func:`estimate`), nothing allocated;
* :mod:`memfit.tools.estimate.meta_kernels`: what CUDA's fused kernels save, for the count on the meta device;
* :mod:`memfit.tools.estimate.advise`: the fastest setups (precision, optimizer, accumulation,
  method) that fit a budget (:func:`advise`);
* :mod:`memfit.tools.estimate.sharded`: one rank's share under FSDP2 and the parameters it gathers (``--shards``);
* :mod:`memfit.tools.estimate.floor`: the floor of a shape, the smallest cap memfit's treatments reach
  (:func:`floor_estimate`), per length and the longest a budget admits (:class:`Floors`);
* :mod:`memfit.tools.estimate.cli`: ``memfit estimate``.

Example:
    >>> from memfit.tools.estimate import ModelProfile, TrainingSetup, estimate, load_config  # doctest: +SKIP
    >>> profile = ModelProfile.from_config(load_config("bert-base-uncased"), "text-classification")  # doctest: +SKIP
    >>> estimate(profile, TrainingSetup(), seq_length=128).total_bytes  # doctest: +SKIP
"""

from memfit.tools.estimate.advise import DEFAULT_MARGIN, Advice, NothingFitsError, advise, format_advice, only_chunked_head_fits
from memfit.tools.estimate.floor import FloorTooHighError, Floors, floor_estimate
from memfit.tools.estimate.anatomy import (
    CUDA_CONTEXT_BYTES,
    GIB,
    HEAD_CHOICES,
    LIBRARY_WORKSPACE_BYTES,
    OPTIMIZERS,
    PRECISIONS,
    TASKS,
    ActivationProfile,
    ElementBytes,
    LmHead,
    MemoryEstimate,
    ModelProfile,
    TrainingSetup,
    activation_profile,
    backward_phase_bytes,
    bert_layer_backward_bytes,
    bert_layer_saved_bytes,
    estimate,
    format_head_table,
    format_table,
    lm_head_bytes,
    load_config,
    optimizer_available,
)

__all__ = [
    "TASKS", "PRECISIONS", "OPTIMIZERS", "GIB", "CUDA_CONTEXT_BYTES", "LIBRARY_WORKSPACE_BYTES", "optimizer_available",
    "ElementBytes", "bert_layer_saved_bytes", "bert_layer_backward_bytes", "load_config", "ModelProfile",
    "ActivationProfile", "activation_profile", "TrainingSetup", "MemoryEstimate", "backward_phase_bytes", "estimate",
    "format_table", "DEFAULT_MARGIN", "NothingFitsError", "Advice", "advise", "format_advice",
    "HEAD_CHOICES", "LmHead", "lm_head_bytes", "format_head_table", "only_chunked_head_fits",
    "FloorTooHighError", "Floors", "floor_estimate",
]
