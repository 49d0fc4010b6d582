"""One rank of the 2-process CPU FSDP2 tests of the planned LM head (torchrun, gloo): see
test_distributed.py. Each rank trains its own lengths under a logical budget that only a chunked
head meets on the long ones.

argv: OUT_DIR BUDGET_BYTES [plain|oom] [unit]

``plain``: a plain loop; rank 0 saves the final weights (``final.pt``) and each rank its records.
``unit``: the final norm and ``lm_head`` sharded as one FSDP unit of their own, as Accelerate
does (NOTE [The head as its own FSDP unit] in memfit/engine/parts/head.py).
``oom``: ``ctl.run_step``, once clean and once with an OOM raised in rank 1's ``lm_head`` at its
loss's first cross-entropy in step OOM_STEP (``clean.pt`` / ``oom.pt``, records ``steps-<run>.rank<r>.jsonl``).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memfit
from _ddp_common import leave
from _head_common import HEAD_LENGTHS, head_batch, head_model

OOM_STEP = 3

out, budget = sys.argv[1], int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "plain"
unit = len(sys.argv) > 4 and sys.argv[4] == "unit"
dist.init_process_group("gloo")
rank = dist.get_rank()


def train(log: str, inject: bool) -> dict:
    model = head_model()
    for layer in model.model.layers:
        fully_shard(layer)
    if unit:  # as Accelerate's FSDP2 wrapping does: the embeddings, then the final norm and lm_head, units of their own
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=opt, log=log, warmup_steps=2, warmup_keys=2, announce=False)
    now = {"step": -1, "fired": False}
    cross_entropy = torch.nn.functional.cross_entropy

    def oom(*args, **kwargs):  # the loss's first cross-entropy of step OOM_STEP, whichever way the head computes it
        if inject and now["step"] == OOM_STEP and not now["fired"]:
            now["fired"] = True
            raise torch.OutOfMemoryError("injected: CUDA out of memory in the LM head")
        return cross_entropy(*args, **kwargs)

    torch.nn.functional.cross_entropy = oom
    for step, length in enumerate(HEAD_LENGTHS[rank]):
        now["step"] = step
        torch.manual_seed(1000 * step + rank)
        b = head_batch(step, rank, length)
        if mode == "plain":
            model(**b).loss.backward()
        else:
            ctl.run_step(lambda: model(**b).loss.backward())
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy = cross_entropy
    ctl.remove()
    assert now["fired"] == inject, now
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


if mode == "plain":
    state = train(f"{out}/steps.rank{rank}.jsonl", False)
    if rank == 0:
        torch.save(state, f"{out}/final.pt")
else:
    for run in ("clean", "oom"):
        state = train(f"{out}/steps-{run}.rank{rank}.jsonl", run == "oom" and rank == 1)
        if rank == 0:
            torch.save(state, f"{out}/{run}.pt")
leave()
