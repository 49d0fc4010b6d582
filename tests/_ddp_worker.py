"""One rank of the 2-process CPU DDP / FSDP2 test (run by torchrun, gloo): see test_distributed.py.

argv: OUT_DIR BUDGET_BYTES [ddp|fsdp]
"""

import sys

import torch
import torch.distributed as dist

import memfit
from _ddp_common import LENGTHS, STEPS, batch, build_model, leave

out, budget = sys.argv[1], int(sys.argv[2])
sharding = sys.argv[3] if len(sys.argv) > 3 else "ddp"
dist.init_process_group("gloo")
rank = dist.get_rank()
model = build_model()
if sharding == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    wrapped = model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# Each rank plans for its own shapes under its own (logical) budget; under FSDP, fit after
# fully_shard, so memfit counts this rank's shards.
ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=opt, log=f"{out}/steps.rank{rank}.jsonl", warmup_steps=2, warmup_keys=2)
if sharding == "ddp":
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
for step in range(STEPS):
    torch.manual_seed(1000 * step + rank)
    wrapped(**batch(step, rank, LENGTHS[rank][step])).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
ctl.remove()
state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
if rank == 0:
    torch.save(state, f"{out}/final.pt")
leave()
