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
innermost pair runs (NOTE [Who sees a checkpointed block's tensors] in memfit/engine/accounting.py):
TRL would offload nothing, silently. So ``SFTConfig`` refuses the flag; the benchmark's
``offload`` peer runs TRL's offloading inside memfit's counter instead (memfit/tools/bench/peers.py).

# NOTE [TRL's loss and memfit's head]
TRL's ``SFTTrainer`` computes the loss itself: it calls the model with ``fused_lm_head=True`` (its
own head, chunked or through Liger) and reads log-probabilities, not the model's loss. memfit must
not chunk the head a second time, so it leaves the head to TRL (``fit(head=False)``), counts the
head's bytes with the rest of the step as for any model, and the start line says so.
``--memfit_head plan`` is refused here.

Importing this module imports TRL: ``pip install 'memfit[llm]'`` (or ``pip install trl``).

Example:
    >>> from memfit.trl import SFTConfig, SFTTrainer  # doctest: +SKIP
    >>> args = SFTConfig(output_dir="out", memory_budget="6GiB", memfit_method="dynamic")  # doctest: +SKIP
    >>> SFTTrainer(model=model, args=args, train_dataset=dataset).train()  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    import trl
except ImportError:
    raise ImportError(
        "memfit.trl needs TRL: pip install 'memfit[llm]' (or pip install trl); memfit.Trainer works without it"
    ) from None

from memfit.errors import FlagError
from memfit.integrations.hf import MemfitArguments, with_memfit

__all__ = ["SFTConfig", "SFTTrainer"]


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
        if self.memfit_head == "plan":
            raise FlagError(
                "--memfit_head plan: TRL's SFTTrainer computes the loss through its own head (NOTE [TRL's loss and "
                "memfit's head] in memfit/trl.py); give --memfit_head auto or keep"
            )
        if self.activation_offloading:
            raise ValueError(
                "--activation_offloading: memfit's saved-tensor counter runs inside TRL's offloading hooks, which then "
                "never run (NOTE [TRL's activation offloading under memfit] in memfit/trl.py); drop it, or train "
                "with trl.SFTTrainer without memfit"
            )
        super().__post_init__()


#: ``trl.SFTTrainer`` with memfit (:class:`memfit.integrations.hf.MemfitTrainerMixin`); pass an :class:`SFTConfig`.
SFTTrainer = with_memfit(trl.SFTTrainer)
SFTTrainer.__module__ = __name__
SFTTrainer.memfit_head_owner = "TRL (its SFTTrainer computes the loss: NOTE [TRL's loss and memfit's head])"
