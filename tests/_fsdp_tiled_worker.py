"""One rank of the 2-process CPU FSDP2 test of the tiled treatments (torchrun, gloo): see
test_distributed.py. Each rank trains its own batches of a tiny Llama (dropout on in its attention), every
decoder layer and the root sharded by ``fully_shard``, first without memfit, then with every block on
TREATMENT (its MLP in CHUNKS chunks, its norms and adapters lean); rank 0 saves both runs' final weights
(``plain.pt``, ``tiled.pt``) and how many MLP calls ran tiled.

argv: OUT_DIR TREATMENT CHUNKS [lora]
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memfit
from _ddp_common import leave
from _models import FixedPlan, build_decoder
from memfit.engine.parts.treatments import tiled_mlp as tiled_module
from memfit.engine.parts.treatments.tiled_mlp import Chunking
from memfit.engine.plan.planner import Plan

out, name, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3])
lora = len(sys.argv) > 4 and sys.argv[4] == "lora"
dist.init_process_group("gloo")
rank = dist.get_rank()
LENGTHS = {0: (9, 23, 17), 1: (31, 12, 26)}


def train(treated: bool) -> tuple[dict, int]:
    torch.manual_seed(0)
    model, make = build_decoder("llama")
    if lora:  # dropout 0 in the adapters: an adapter that draws a mask is never tiled (NOTE [Tiled MLP])
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    model.train()
    layers = model.base_model.model.model.layers if lora else model.model.layers
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ctl = None
    if treated:
        n = len(layers)
        ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=(name,) * n)), treatments=(name,),
                         announce=False)
        ctl.treatments[name].chunking = Chunking(at_least=chunks)
        if hasattr(ctl.treatments[name], "min_bytes"):
            ctl.treatments[name].min_bytes = 0  # tiny test tensors move too
    calls = {"n": 0}
    run = tiled_module._TiledMlpFunction.forward

    def counted(ctx, *args):
        calls["n"] += 1
        return run(ctx, *args)

    tiled_module._TiledMlpFunction.forward = staticmethod(counted)
    try:
        for step, length in enumerate(LENGTHS[rank]):
            torch.manual_seed(1000 * step + rank)
            batch = make(2, length)
            if ctl is None:
                model(**batch).loss.backward()
            else:
                ctl.run_step(lambda: model(**batch).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        tiled_module._TiledMlpFunction.forward = staticmethod(run)
    if ctl is not None:  # NOTE [Warm-up on the floor]: a block's parameters as FSDP2 gathers them, not this rank's shards
        whole = max(sum(p.full_tensor().numel() * p.element_size() for p in layer.parameters()) for layer in layers)
        assert ctl.planning.gathered_block_bytes == whole > 0, (ctl.planning.gathered_block_bytes, whole)
        ctl.remove()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    return state, calls["n"]


plain, _ = train(False)
tiled, calls = train(True)
if rank == 0:
    torch.save(plain, f"{out}/plain.pt")
    torch.save(tiled, f"{out}/tiled.pt")
with open(f"{out}/calls.rank{rank}.json", "w") as fh:
    json.dump({"tiled_calls": calls}, fh)
leave()
