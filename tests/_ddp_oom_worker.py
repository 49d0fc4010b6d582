"""One rank of the 2-process CPU OOM-lockstep test (torchrun, gloo): see test_distributed.py.

argv: OUT_DIR MODE. MODE ``runs`` trains the scenarios of ``SCENARIOS`` one after the other
in this process group and saves each rank's final weights and step records; MODE ``fail``
makes every training forward on rank 1 run out of memory, which memfit cannot survive.
"""

import json
import sys

import torch
from torch.utils._pytree import tree_leaves

import memfit
from _models import VOCAB, build
from _ddp_common import leave
from test_hf import _collate

BUDGET = "5MB"  # rank 1 (long rows) must checkpoint to fit, rank 0 need not
BATCH = 4
# name: (gradient accumulation, where rank 1 runs out of memory, its training forward
# number (1-based) where it does, memfit_lockstep)
SCENARIOS = {
    "clean-1": (1, None, 0, True),
    "forward-1": (1, "forward", 5, True),
    "backward-1": (1, "backward", 3, True),
    "clean-2": (2, None, 0, True),
    "forward-2": (2, "forward", 6, True),  # the second micro-batch of the third window
    "backward-2": (2, "backward", 4, True),  # the second micro-batch of the second window
    "ddp-sync-1": (1, None, 0, False),  # DDP's own overlapped sync, for reference
}


def dataset(n_batches: int = 16):
    """Read in order, batch b goes to rank b % 2: short rows for rank 0, long ones for rank 1."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in range(2 * n_batches):
        low, high = (6, 16) if b % 2 == 0 else (60, 120)
        for i in range(BATCH):
            length = int(torch.randint(low, high, (1,), generator=g))
            rows.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=g), "labels": i % 2})
    return rows


class InjectOOM:
    """Raise torch.OutOfMemoryError in the ``at``-th training forward of ``module``, or in its backward."""

    def __init__(self, module, at, where):
        self.calls, self.at, self.where, self.fired = 0, at, where, 0
        module.register_forward_pre_hook(self.pre)
        module.register_forward_hook(self.post)

    def _hit(self, module):
        if not module.training or not torch.is_grad_enabled():
            return False
        if self.where == "forward":
            self.calls += 1
        return self.calls == self.at or self.at == "always"

    def pre(self, module, args):
        if self.where == "forward" and self._hit(module):
            self.fired += 1
            raise torch.OutOfMemoryError("injected in forward: CUDA out of memory")

    def post(self, module, args, output):
        if self.where != "backward" or not module.training or not torch.is_grad_enabled():
            return
        self.calls += 1
        if self.calls == self.at:
            def fail(grad):
                self.fired += 1
                raise torch.OutOfMemoryError("injected in backward: CUDA out of memory")

            next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad).register_hook(fail)


def train(out, name, accumulation, where, at, lockstep, method="dynamic", max_steps=None):
    torch.manual_seed(0)
    model, _ = build("bert")
    args = memfit.TrainingArguments(
        output_dir=f"{out}/{name}", per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation,
        max_steps=max_steps or 8 // accumulation, learning_rate=1e-3, report_to="none", save_strategy="no",
        use_cpu=True, ddp_backend="gloo", seed=0, memory_budget=BUDGET, memfit_method=method,
        memfit_lockstep=lockstep, train_sampling_strategy="sequential", logging_steps=1,
    )
    trainer = memfit.Trainer(model=model, args=args, train_dataset=dataset(), data_collator=_collate)
    injector = InjectOOM(trainer.memfit.blocks[1].module, at, where) if where and args.process_index == 1 else None
    trainer.train()
    rank = args.process_index
    torch.save(trainer.model.state_dict(), f"{out}/{name}.rank{rank}.pt")
    with open(f"{out}/{name}.rank{rank}.json", "w") as fh:
        json.dump({
            "fired": injector.fired if injector else 0,
            "lockstep": trainer._grad_sync is not None,
            "records": [r.to_dict() for r in trainer.memfit.records],
        }, fh)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "runs":
        for name, (accumulation, where, at, lockstep) in SCENARIOS.items():
            train(out, name, accumulation, where, at, lockstep)
        leave()  # gloo's teardown can abort a rank at exit (_ddp_common.leave)
    else:
        train(out, "fail", 1, "forward", "always", True, max_steps=2)
