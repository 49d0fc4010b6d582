"""Where ``dynamic``'s extra time under FSDP2 goes: one variant per ``torchrun`` launch, the same
batches each (Llama-3.2-3B's shape cut to LAYERS layers, batch 3, lengths 512-3,072 per rank).

Variants: ``none`` (uncapped; writes the budget's base), ``full``, ``full+count`` (every step
counts its saved tensors), ``dynamic``, ``dynamic-nobackstop``, ``dynamic-slack8`` (the allocator's
slack started at an eighth of the budget). Each step also records the allocator's counters over
the step (retries, device mallocs and frees, syncs of all streams) and its reserved bytes. The cap is STATIC_BYTES plus
SHARE (0.5) of what ``none`` peaked above it. Rank 0 writes ``OUT/<variant>.json`` (step times,
per-step record fields) and a profiler table of step PROF_STEP. On 2 GPUs:

    for v in none full full+count dynamic dynamic-nobackstop; do
      OUT=... LAYERS=14 STATIC_BYTES=9016888320 PROF_STEP=9 torchrun --nproc_per_node 2 benchmarks/fsdp_overhead.py $v
    done

CPU (gloo, a tiny width) runs the same code as a check.
"""
import os, sys, time, json, random, statistics, datetime
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import memfit
from transformers import AutoConfig, AutoModelForCausalLM
from torch.profiler import profile, ProfilerActivity
import dataclasses
CUDA = torch.cuda.is_available()
dist.init_process_group("nccl" if CUDA else "gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
if CUDA: torch.cuda.set_device(rank)
dev = torch.device("cuda", rank) if CUDA else torch.device("cpu")
if not CUDA:
    torch.cuda.synchronize = lambda *a: None; torch.cuda.max_memory_allocated = lambda *a: 50 * 2**20; torch.cuda.empty_cache = lambda: None
out = os.environ.get("OUT", "/tmp"); layers = int(os.environ.get("LAYERS", "12"))
cfg = AutoConfig.from_pretrained("src/memfit/configs/Llama-3.2-3B.json"); cfg.num_hidden_layers = layers
cfg._attn_implementation = "sdpa"
if not CUDA: cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.head_dim = 64, 128, 2, 1, 1000, 32
def build():
    torch.manual_seed(0)
    with torch.device(dev):
        m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    for l in m.model.layers: fully_shard(l)
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True)
rng = random.Random(rank)
lengths = [rng.randint(512, 3072) if CUDA else rng.randint(16, 64) for _ in range(int(os.environ.get("STEPS", "14")))]
def batches():
    g = torch.Generator().manual_seed(rank)
    for t in lengths:
        ids = torch.randint(0, cfg.vocab_size, (3, t), generator=g).to(dev)
        yield dict(input_ids=ids, labels=ids)
ALLOC_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
def counters():
    stats = torch.cuda.memory_stats(dev) if CUDA else {}
    return {k: int(stats.get(k, 0)) for k in ALLOC_COUNTERS}
def run(method, budget, force_count=None, backstop="auto", prof_step=None, slack_share=None):
    model, opt = build()
    kw = {} if method in ("none", "full") else {"backstop": backstop}
    ctl = memfit.fit(model, budget, method, optimizer=opt, **kw)
    if slack_share is not None and budget:
        room = ctl.planning.room
        room.slack_bytes = room.start_slack_bytes = int(slack_share * budget)
    if force_count is not None:
        decide = ctl.method.decide
        def forced(*a, **k):
            return dataclasses.replace(decide(*a, **k), count=force_count)
        ctl.method.decide = forced
    times, peak, alloc = [], 0, []
    for i, b in enumerate(batches()):
        torch.cuda.synchronize(); dist.barrier(); before = counters(); t0 = time.perf_counter()
        if i == prof_step:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])) as p:
                ctl.run_step(lambda: model(**b).loss.backward()); opt.step(); opt.zero_grad(set_to_none=True); torch.cuda.synchronize()
            if rank == 0:
                table = p.key_averages()
                with open(f"{out}/prof-{sys.argv[1]}.txt", "w") as f:
                    f.write(table.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
                    f.write(table.table(sort_by="self_cuda_time_total" if CUDA else "cpu_time_total", row_limit=25))
        else:
            ctl.run_step(lambda: model(**b).loss.backward()); opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); times.append((time.perf_counter() - t0) * 1e3)
        after = counters()
        alloc.append({**{k: after[k] - before[k] for k in ALLOC_COUNTERS},
                      "reserved": torch.cuda.memory_reserved(dev) if CUDA else 0,
                      "max_reserved": torch.cuda.max_memory_reserved(dev) if CUDA else 0})
        peak = max(peak, torch.cuda.max_memory_allocated(dev))
    peak = max([peak] + [r.peak_allocated_bytes for r in ctl.records])
    recs = [dict(step=r.step, counted=r.counted, armed=r.backstop_armed, n=r.n_checkpointed, retries=r.alloc_retries,
                 ms=round(r.step_ms, 1), predicted=r.predicted_peak_bytes, peak=r.peak_allocated_bytes,
                 reserved=r.peak_reserved_bytes, slack=ctl.planning.room.slack_bytes) for r in ctl.records]
    for rec, a in zip(recs, alloc):
        rec.update(a)
    ctl.remove(); del model, opt; torch.cuda.empty_cache()
    return times, peak, recs
variant = sys.argv[1]
bfile = f"{out}/budget.txt"
if variant == "none":
    t, peak, recs = run("none", None)
    if rank == 0:
        open(bfile, "w").write(str(peak))
else:
    peak = int(open(bfile).read())
    static = int(os.environ.get("STATIC_BYTES", "0"))
    budget = int(static + float(os.environ.get("SHARE", "0.5")) * (peak - static))
    args = {"full": ("full", budget, False), "full+count": ("full", budget, True), "dynamic": ("dynamic", budget),
            "dynamic-nobackstop": ("dynamic", budget, None, False),
            "dynamic-slack8": ("dynamic", budget, None, "auto", None, 1 / 8)}[variant]
    prof_step = int(os.environ.get("PROF_STEP", "-1"))
    t, p, recs = run(*args[:4], prof_step=prof_step, slack_share=args[5] if len(args) > 5 else None)
if rank == 0:
    print(variant, "steady median", round(statistics.median(t[5:]), 1), "ms", [round(x) for x in t], flush=True)
    print(json.dumps(recs))
    json.dump({"times": t, "records": recs, "lengths": lengths}, open(f"{out}/{variant}.json", "w"))
dist.destroy_process_group()
