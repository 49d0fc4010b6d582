"""Offloaded blocks spread apart against a run of them (NOTE [Spread stashes], src/memfit/engine/plan/model.py).

Llama-3.2-1B's shape (bf16, sdpa, random weights), batch 8 x L tokens, one forward and backward a step under memfit
with fixed plans (keep every block; 2 and 4 blocks recomputed, offloaded in a run at the top, or offloaded spread
from the bottom; 3 spread), interleaved repeats, the median step of each; the host link measured first (256 MiB,
pinned). On CUDA; ``DEV=cpu CFG=llama-tiny LENGTHS=64 REPEATS=1`` runs it through on a CPU.

    PYTHONPATH=src:tests python benchmarks/spread_probe.py     # LENGTHS=4096,2048 REPEATS=3 OUT=. by default
"""
import json, os, statistics as st, sys, time
import torch, transformers, memfit
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _models import FixedPlan
from memfit.engine.plan.planner import Plan
from memfit.engine.parts.probe import measure_link

out = os.environ.get("OUT", ".")
dev = torch.device(os.environ.get("DEV", "cuda"))
CFG = os.environ.get("CFG", "Llama-3.2-1B")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
link = measure_link(dev, 256 * 2**20)
print(f"link d2h {link.d2h / 1e6:.1f} GB/s h2d {link.h2d / 1e6:.1f} GB/s (256 MiB, pinned)", flush=True)
cfg = transformers.AutoConfig.from_pretrained(f"src/memfit/configs/{CFG}.json"); cfg.use_cache = False
torch.manual_seed(0)
with torch.device(dev):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").train()
n = cfg.num_hidden_layers

def plan(kind, idx):
    idx = tuple(sorted(idx))
    return Plan(idx, kinds=(kind,) * len(idx)) if idx else Plan(())

sp = lambda k: [i * n // k for i in range(k)]
co = lambda k: list(range(n - k, n))
PLANS = {
    "keep": plan("recompute", ()),
    "rec-2": plan("recompute", sp(2)),
    "off-2-consec": plan("offload", co(2)),
    "off-2-spaced": plan("offload", sp(2)),
    "rec-4": plan("recompute", sp(4)),
    "off-4-consec": plan("offload", co(4)),
    "off-4-spaced": plan("offload", sp(4)),
    "off-3-spaced": plan("offload", sp(3)),
}
results = {}
for L in [int(x) for x in os.environ.get("LENGTHS", "4096,2048").split(",")]:
    ids = torch.randint(0, cfg.vocab_size, (8, L), device=dev)
    for rep in range(int(os.environ.get("REPEATS", "3"))):
        for name, p in PLANS.items():
            ctl = memfit.fit(model, budget=None, method=FixedPlan(p), treatments=("recompute", "offload"), announce=False)
            times = []
            for i in range(4):
                sync(); dev.type == "cuda" and torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
                sync()
                if i >= 1:
                    times.append((time.perf_counter() - t0) * 1e3)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
            off = [t for t in ctl.treatments.values()] if hasattr(ctl, "treatments") else []
            stats = None
            for t in off:
                if getattr(t, "name", "") == "offload":
                    s = t.exposed(); stats = (round(s.exposed_out_ms / max(1, s.steps), 1), round(s.exposed_back_ms / max(1, s.steps), 1), s.steps)
            ctl.remove()
            r = results.setdefault(f"{L}:{name}", {"ms": [], "peak": peak, "exposed": stats})
            r["ms"] += times; r["exposed"] = stats
            print(f"L={L} rep={rep} {name:14s} {st.median(times):8.1f} ms  peak {peak:6.2f} GiB  exposed(out,back,steps) {stats}", flush=True)
    dev.type == "cuda" and torch.cuda.empty_cache()
print("\nsummary: median ms over repeats")
for k, r in results.items():
    print(f"{k:20s} {st.median(r['ms']):8.1f}  peak {r['peak']:6.2f}")
with open(os.path.join(out, "spread_probe.json"), "w") as fh:
    json.dump({"link_gbps": [link.d2h / 1e6, link.h2d / 1e6], "results": results}, fh, indent=1)
