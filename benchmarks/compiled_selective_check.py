"""Gradients of compiled ``selective`` on every block against compiled ``none`` on a GPU (inductor).

SmolLM-360M's shape cut to 4 layers, random weights, bf16 then fp32, attention dropout 0 then
0.1, batches of 4 × 300, 517 and 300 tokens (the second length recompiles with a dynamic
dimension): per step, whether the gradients are bitwise equal, the largest difference, the
largest gradient, and the activation bytes compiled ``selective`` saved. Writes
``$OUT/sel_grad.json`` (or /tmp), rewritten as each setting ends. Run from the repository root with ``PYTHONPATH=src``:

    python benchmarks/compiled_selective_check.py
"""
import copy
import json
import os

import torch
import transformers

import memfit
from loop_bench import _replay
from memfit.engine.plan.planner import Plan
from memfit.tasks._common import CONFIGS_DIR

out = {}
for dtype in ("bfloat16", "float32"):
    for drop in (0.0, 0.1):
        torch._dynamo.reset()
        cfg = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / "SmolLM-360M.json"))
        cfg.num_hidden_layers = 4; cfg.use_cache = False; cfg.attention_dropout = drop
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa").cuda().train()
        ref = copy.deepcopy(model)
        rc = memfit.fit(ref, budget=None, method="none", compile=True, announce=False)
        n = len(rc.blocks)
        ctl = memfit.fit(model, budget=None, method=_replay([Plan(tuple(range(n)), kinds=("selective",) * n)], count=True),
                         treatments=("recompute", "selective"), compile=True, announce=False)
        res = []
        for seed, L in enumerate((300, 517, 300)):
            ids = torch.randint(10, cfg.vocab_size, (4, L), device="cuda")
            saved = []
            for m, c in ((model, ctl), (ref, rc)):
                torch.manual_seed(seed)
                m(input_ids=ids, labels=ids).loss.backward()
                saved.append(c.records[-1].saved_activation_bytes)
            diffs = [float((p.grad.float() - q.grad.float()).abs().max()) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
            scale = max(float(q.grad.float().abs().max()) for q in ref.parameters() if q.grad is not None)
            res.append({"len": L, "bitwise": all(d == 0 for d in diffs), "max_abs_diff": max(diffs), "grad_scale": scale,
                        "saved_sel": saved[0], "saved_none": saved[1]})
            model.zero_grad(set_to_none=True); ref.zero_grad(set_to_none=True)
        ctl.remove(); rc.remove()
        out[f"{dtype}-dropout{drop}"] = res
        print(dtype, drop, res, flush=True)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "sel_grad.json"), "w") as fh:  # each setting as it ends
            json.dump(out, fh, indent=1)
