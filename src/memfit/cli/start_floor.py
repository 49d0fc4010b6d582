"""The floor of the data's longest batch, said when ``memfit train`` starts a causal-LM run under a budget.

# NOTE [The floor at start]
Users hit the wall on their longest samples. Before the first step, ``memfit train`` knows the model, the
setup (weights' dtype, LoRA's rank and dropout, the optimizer, the micro-batch, under ``--fsdp`` the ranks it
shards over: the floor is then a rank's, NOTE [Sharded ranks in the estimate]) and every training example's
length, so it asks ``memfit estimate``'s floor (NOTE [The floor], tools/estimate/floor.py) of the longest batch
the data can make (the micro-batch x its longest example): one line at INFO where it fits the budget less its
margin, and a WARNING where it does not, naming the longest length that fits at that micro-batch (a
``--max_seq_length`` to truncate to), a smaller micro-batch, or a larger budget. A warning, not an error: the
floor is an estimate (it errs a few percent above a measured peak at 64k tokens), and memfit's own error
names the shape at the step that cannot fit. Said on CUDA only, where the budget is a hard cap and the floor's
treatments (checkpoints on the host) run; an estimate that cannot be made (a model the meta count does not
run) says nothing beyond a DEBUG line: it never stops a run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from memfit.engine.budget import format_bytes

__all__ = ["say_floor_at_start"]

logger = logging.getLogger("memfit")


def _optimizer(training_args: Any) -> str:
    """The estimate's optimizer of ``--optim`` (and ``--optim_args``): the one whose ``memfit train`` flags are these, or
    whose ``--optim`` the flag's name begins with (``adamw_torch_fused``: ``adamw``'s state).

    Raises:
        ValueError: for an optimizer the estimate does not know (no floor is said).
    """
    from memfit.tools.estimate.anatomy import OPTIMIZERS

    optim = str(getattr(training_args.optim, "value", training_args.optim))
    given = ("--optim", optim) + (("--optim_args", training_args.optim_args) if getattr(training_args, "optim_args", None) else ())
    known = {o.train_flags: name for name, o in OPTIMIZERS.items()}
    if given in known:
        return known[given]
    prefixes = [(len(flags[1]), name) for flags, name in known.items() if len(flags) == 2 and optim.startswith(flags[1])]
    if not prefixes:
        raise ValueError(f"--optim {optim}: not an optimizer memfit estimate knows")
    return max(prefixes)[1]


def _setup(model: Any, training_args: Any) -> Any:
    """The estimate's setup of this run: weights' dtype, precision, LoRA, optimizer, micro-batch."""
    from memfit.tools.estimate.anatomy import TrainingSetup

    dtype = next(model.parameters()).dtype
    weights = "bf16" if dtype == torch.bfloat16 else "fp32"
    precision = "bf16" if weights == "bf16" or training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    lora = next(iter(getattr(model, "peft_config", {}).values()), None)
    optimizer = _optimizer(training_args)
    return TrainingSetup(precision=precision, optimizer=optimizer, micro_batch_size=training_args.per_device_train_batch_size,
                         weights=weights, lora_r=int(getattr(lora, "r", 0) or 0),
                         lora_dropout=float(getattr(lora, "lora_dropout", 0.0) or 0.0), shards=_shards(training_args))


def _shards(training_args: Any) -> int:
    """The ranks the run's FSDP shards the model over (NOTE [Sharded ranks in the estimate]): every rank under
    full sharding, a node's under hybrid sharding; 1 without ``--fsdp``. Read from ``--fsdp``'s words (transformers
    up to 5.2x: a list of options) or, where the Trainer has moved them there (later: ``fsdp`` is then True), from
    ``fsdp_config``'s ``reshard_after_forward``.

    Raises:
        ValueError: for sharding the estimate does not count (``shard_grad_op``, or the parameters offloaded to the
            host: no floor is said).
    """
    fsdp = getattr(training_args, "fsdp", None)
    if not fsdp:
        return 1
    config = getattr(training_args, "fsdp_config", None) or {}
    words = {str(getattr(o, "value", o)) for o in (fsdp.split() if isinstance(fsdp, str) else fsdp)} if fsdp is not True else set()
    words.add(str(config.get("reshard_after_forward", "")).lower())
    if words & {"shard_grad_op", "false", "no_shard"}:
        raise ValueError("--fsdp shard_grad_op: the estimate counts full sharding only")
    if "offload" in words or config.get("cpu_offload") or config.get("offload_params"):
        raise ValueError("--fsdp offload: the estimate counts parameters on the GPU only")
    if words & {"hybrid_shard", "hybrid_shard_zero2"}:
        return int(os.environ.get("LOCAL_WORLD_SIZE", training_args.world_size))
    return int(training_args.world_size)


def say_floor_at_start(model: Any, train_dataset: Any, training_args: Any, on_cuda: bool) -> str | None:
    """Say the floor of the data's longest batch against the budget (NOTE [The floor at start]); return the line said.

    Args:
        model: the model to train (a peft model for LoRA).
        train_dataset: the training features (``input_ids`` each).
        training_args: the run's ``TrainingArguments`` (its budget, margin, host budget, batch size, precision, optimizer).
        on_cuda: whether the run trains on a CUDA device.
    """
    budget = training_args.memfit_budget_bytes
    if not on_cuda or budget is None or not train_dataset:
        return None
    try:
        from memfit.engine.budget import parse_bytes
        from memfit.tools.estimate.anatomy import ModelProfile
        from memfit.tools.estimate.advise import DEFAULT_MARGIN  # memfit estimate's --margin
        from memfit.tools.estimate.floor import Floors, floor_words

        longest = max(len(f["input_ids"]) for f in train_dataset)
        setup = _setup(model, training_args)
        profile = ModelProfile.from_config(model.config, "causal-lm", name=getattr(model.config, "_name_or_path", None) or "the model")
        margin = training_args.memfit_margin if training_args.memfit_margin is not None else DEFAULT_MARGIN
        host = training_args.memfit_host_budget
        host_bytes = None if host is None else parse_bytes(host, argument="--memfit_host_budget")
        floors = Floors(profile, setup, int(budget * (1 - margin)), host_bytes)
        est = floors.at(longest)
        shape = f"{setup.micro_batch_size} x {longest:,} tokens"
        if floors.admits(est):
            line = f"memfit: the floor of the data's longest batch ({shape}) is {format_bytes(est.total_bytes)}, within the budget"
            logger.info("%s (memfit estimate --floor)", line)
            return line
        fits = floors.longest(longest)
        instead = (f"--max_seq_length {fits:,} fits at this micro-batch" if fits else "no length fits at this micro-batch")
        line = (f"memfit: the data's longest batch ({shape}) has a floor of {floor_words(est)}, over the budget less its "
                f"{100 * margin:g}% margin ({format_bytes(int(budget * (1 - margin)))}): no plan of memfit's is expected to fit "
                f"it, and training stops with one error at the first such batch; {instead}, or lower "
                "--per_device_train_batch_size, or raise --memory_budget (memfit estimate --floor)")
        logger.warning("%s", line)
        return line
    except Exception as err:  # an estimate never stops a run (NOTE [The floor at start])
        logger.debug("memfit: no floor estimate at start (%s)", str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        return None
