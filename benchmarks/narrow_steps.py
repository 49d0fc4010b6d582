"""Time (a)'s narrow steps in place and replayed alone, a device sync and the host clock per step (reach SOURCE s36-8:
whether the records' step_ms of a narrow step after a wide one is its own time). Diagnostic, not a suite: it prints.

Usage (repository root; DEVICE cuda or cpu, BUDGET as memfit.fit takes it, STEPS of the reach suite's (a) batches):

    python benchmarks/narrow_steps.py cuda 28.6GiB 40
"""
import sys, time, torch, transformers
sys.path.insert(0, 'benchmarks')
import memfit, loop_bench as lb
from memfit.tasks._common import CONFIGS_DIR
dev = sys.argv[1]; budget = sys.argv[2]; n = int(sys.argv[3])
cfg = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / "Llama-3.2-1B.json")); cfg.use_cache = False
if dev == 'cpu':
    for k, v in dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=500, head_dim=16).items(): setattr(cfg, k, v)
if dev == 'cuda': torch.backends.cuda.enable_cudnn_sdp(False)
torch.manual_seed(0)
with torch.device(dev):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").train()
class A: pass
args = A(); args.seed = 0; args.model = 'x'
lengths = lb._lengths('sft:4096', n, 8, 0)
if dev == 'cpu': lengths = [[max(1, x // 40) for x in r] for r in lengths]
batches = [{k: v.to(dev) for k, v in b.items()} for b in lb._batches(args, model, lengths)]
ctl = memfit.fit(model, budget=budget, announce=False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
def step(b):
    if dev == 'cuda': torch.cuda.synchronize()
    t = time.perf_counter()
    ctl.run_step(lambda: model(**b).loss.backward())
    t1 = time.perf_counter()
    opt.step(); opt.zero_grad(set_to_none=True)
    if dev == 'cuda': torch.cuda.synchronize()
    t2 = time.perf_counter()
    r = ctl.records[-1]
    mix = {k: len(v) for k, v in r.treatments.items() if isinstance(v, list)}
    return dict(shape=r.shape[:2], ms=round((t2 - t) * 1e3, 1), fb_ms=round((t1 - t) * 1e3, 1), rec_ms=round(r.step_ms, 1), counted=r.counted,
                mix=mix, head=r.implementations.get("head"), retries=r.alloc_retries, planner_us=round(r.planner_us))
for i, b in enumerate(batches):
    out = step(b)
    if max(lengths[i]) < 1100 or i < 5 or i % 10 == 0: print(i, out, flush=True)
short = [i for i, r in enumerate(lengths) if max(r) < 1100 and max(r) >= (0 if dev == 'cpu' else 600)]
print('again, each narrow batch three times, a wide one between', flush=True)
wide = max(range(len(lengths)), key=lambda i: max(lengths[i]))
for i in short[:3]:
    for k in range(3): print(i, k, step(batches[i]), flush=True)
    print('wide', step(batches[wide]), flush=True)
if dev == 'cuda':
    from torch.profiler import profile, ProfilerActivity
    i = short[0]
    step(batches[wide])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        print('profiled', step(batches[i]), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
