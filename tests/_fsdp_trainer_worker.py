"""One rank of the 2-process CPU test of the memfit Trainer under FSDP2 through Accelerate
(torchrun, gloo): see test_distributed.py.

Accelerate enables FSDP only on accelerators; on CPU ranks this worker lets its state take the
FSDP plugin as it would on GPUs (``_fsdp_on_cpu``), so the Trainer's own path runs: Accelerate
shards the model (``fully_shard`` on every BertLayer and the root) and memfit hooks it after.

argv: OUT_DIR MODE. MODE ``runs`` trains the scenarios of ``SCENARIOS`` one after the other and
saves each rank's final weights (gathered) and step records; MODE ``backward`` makes rank 1 run
out of memory in a backward, which cannot be replayed in step (a clear error, no hang).
"""

import json
import sys

import torch
import transformers

import memfit
from _ddp_common import leave
from _ddp_oom_worker import BATCH, BUDGET, dataset
from _models import build
from test_hf import _collate

# name: (gradient accumulation, optimizer step (0-based) in which rank 1 runs out of memory in
# block 1's forward, on the last micro-step of its window)
SCENARIOS = {"clean-1": (1, None), "forward-1": (1, 6), "clean-2": (2, None), "forward-2": (2, 3)}  # after warm-up (6 micro-steps)


def _fsdp_on_cpu() -> None:
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = patched


class Inject(transformers.TrainerCallback):
    """On rank 1, raise torch.OutOfMemoryError in the next training forward (or backward) of
    ``module`` once optimizer step ``at`` reaches its last micro-step."""

    def __init__(self, module, at, accumulation, where="forward"):
        self.at, self.accumulation, self.where = at, accumulation, where
        self.armed, self.fired = False, 0
        module.register_forward_pre_hook(self.pre)
        module.register_forward_hook(self.post)

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = self.accumulation == 1 and state.global_step == self.at

    def on_substep_end(self, args, state, control, **kwargs):
        self.armed = state.global_step == self.at

    def pre(self, module, args):
        if self.where == "forward" and self.armed and module.training and torch.is_grad_enabled():
            self.armed, self.fired = False, self.fired + 1
            raise torch.OutOfMemoryError("injected in forward: CUDA out of memory")

    def post(self, module, args, output):
        if self.where == "backward" and self.armed and module.training and torch.is_grad_enabled():
            self.armed = False

            def fail(grad):
                self.fired += 1
                raise torch.OutOfMemoryError("injected in backward: CUDA out of memory")

            output.register_hook(fail)


def train(out, name, accumulation, at, where="forward"):
    torch.manual_seed(0)
    model, _ = build("bert")
    args = memfit.TrainingArguments(
        output_dir=f"{out}/{name}", per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation,
        max_steps=8 // accumulation, learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True,
        ddp_backend="gloo", seed=0, memory_budget=BUDGET, memfit_method="dynamic", train_sampling_strategy="sequential",
        logging_steps=1, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]},
    )
    rank = args.process_index
    trainer = memfit.Trainer(model=model, args=args, train_dataset=dataset(), data_collator=_collate)
    inject = None
    if at is not None and rank == 1:
        # inside block 1's body: FSDP has all-gathered its parameters when this raises
        inject = Inject(model.bert.encoder.layer[1].intermediate, at, accumulation, where)
        trainer.add_callback(inject)
    trainer.train()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    torch.save(state, f"{out}/{name}.rank{rank}.pt")
    with open(f"{out}/{name}.rank{rank}.json", "w") as fh:
        json.dump({
            "fired": inject.fired if inject else 0,
            "blocks": [type(b.module).__name__ for b in trainer.memfit.blocks],
            "records": [r.to_dict() for r in trainer.memfit.records],
        }, fh)


if __name__ == "__main__":
    _fsdp_on_cpu()
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "runs":
        for name, (accumulation, at) in SCENARIOS.items():
            train(out, name, accumulation, at)
        leave()
    else:
        train(out, "backward", 1, 6, where="backward")
