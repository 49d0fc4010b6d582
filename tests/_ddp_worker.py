"""One rank of the 2-process CPU DDP test (run by torchrun, gloo): see test_distributed.py."""

import sys

import torch
import torch.distributed as dist

import memfit
from _ddp_common import LENGTHS, STEPS, batch, build_model

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = build_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# Each rank plans for its own shapes under its own (logical) budget.
ctl = memfit.fit(model, budget=int(sys.argv[2]), method="dynamic", optimizer=opt, log=f"{out}/steps.rank{rank}.jsonl", warmup_steps=2, warmup_keys=2)
ddp = torch.nn.parallel.DistributedDataParallel(model)
for step in range(STEPS):
    torch.manual_seed(1000 * step + rank)
    ddp(**batch(step, rank, LENGTHS[rank][step])).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
ctl.remove()
if rank == 0:
    torch.save(model.state_dict(), f"{out}/final.pt")
dist.destroy_process_group()
