"""One rank of the 2-process CPU FSDP2 OOM test (torchrun, gloo): see test_distributed.py.

argv: OUT_DIR. Trains the scenarios of ``SCENARIOS`` one after the other in this process group
(a plain loop, ``ctl.run_step``) and saves each rank's final weights and step records.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memfit
from _ddp_common import LENGTHS, STEPS, batch, build_model, leave
from _models import InjectOOM

# name: (gradient accumulation, rank 1's micro-step (0-based) in whose block 1 it runs out of memory)
SCENARIOS = {"clean-1": (1, None), "forward-1": (1, 3), "clean-2": (2, None), "forward-2": (2, 3), "slow-1": (1, None)}
#: in "slow-1", rank 1 sleeps this long inside block 1's body on every run of it: rank 0 waits for it at a gather
SLOW_S = 0.05


def train(out, rank, name, accumulation, fail_at, budget):
    model = build_model()
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # inside block 1's body: FSDP has all-gathered its parameters when this raises
    inject = InjectOOM(model.bert.encoder.layer[1].intermediate, at=0)
    if name.startswith("slow") and rank == 1:  # NOTE [The collective wait]: the other rank waits at the next gather
        model.bert.encoder.layer[1].intermediate.register_forward_pre_hook(lambda *_: time.sleep(SLOW_S))
    ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=opt, warmup_steps=2, warmup_keys=2, announce=False)
    for step in range(STEPS):
        if rank == 1 and step == fail_at:
            inject.at = inject.calls + 1  # this step's forward
        torch.manual_seed(1000 * step + rank)
        b = batch(step, rank, LENGTHS[rank][step])
        ctl.run_step(lambda b=b: (model(**b).loss / accumulation).backward())
        if (step + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = [r.to_dict() for r in ctl.records]
    ctl.remove()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    torch.save(state, f"{out}/{name}.rank{rank}.pt")
    with open(f"{out}/{name}.rank{rank}.json", "w") as f:
        f.write(json.dumps({"records": records, "fired": inject.fired}))


if __name__ == "__main__":
    out, budget = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, (accumulation, fail_at) in SCENARIOS.items():
        train(out, rank, name, accumulation, fail_at, budget)
    leave()
