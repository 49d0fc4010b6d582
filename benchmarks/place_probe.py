"""A LoRA model larger than its cap, handed to memfit on the CPU (NOTE [A model larger than its card], host_weights.py).

The model (a config of src/memfit/configs, bf16, sdpa, LoRA r16 on every linear layer) is built on the device (random
weights: seconds there, minutes on the host) and moved to the CPU, as a checkpoint loaded there would be; then
``memfit.fit(model, budget=CAP, device="cuda")`` places it, ``STEPS`` steps of batch 1 x ``TOKENS`` train under
``dynamic``, and one forward without autograd evaluates the same batch (the weights passing through). One JSON line
per step and one for the evaluation: time, allocated peak, resident host memory, what the start left on the host.

    PYTHONPATH=src python benchmarks/place_probe.py       # CFG=Llama-3.1-8B CAP=8GiB TOKENS=16384 STEPS=4
"""
import json, os, sys, time

import torch, transformers, peft
import memfit


def rss_gib() -> float:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return round(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)


cfg_name, cap = os.environ.get("CFG", "Llama-3.1-8B"), os.environ.get("CAP", "8GiB")
tokens, steps = int(os.environ.get("TOKENS", "16384")), int(os.environ.get("STEPS", "4"))
cfg = transformers.AutoConfig.from_pretrained(f"src/memfit/configs/{cfg_name}.json")
cfg.use_cache = False
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
model = peft.get_peft_model(model.cpu(), peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
torch.cuda.empty_cache()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"what": "built", "cfg": cfg_name, "weights_gib": round(weights / 2**30, 2), "cap": cap,
                  "on_device_gib": round(torch.cuda.memory_allocated() / 2**30, 2), "rss_gib": rss_gib()}), flush=True)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
t0 = time.perf_counter()
ctl = memfit.fit(model, budget=cap, method="dynamic", optimizer=optimizer, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"what": "placed", "fit_s": round(time.perf_counter() - t0, 2),
                  "on_device_gib": round(torch.cuda.memory_allocated() / 2**30, 2), "rss_gib": rss_gib(),
                  "allocator_settings": getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: None)()}), flush=True)
ids = torch.randint(10, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)).cuda()
for i in range(steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ctl.run_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    r = ctl.records[-1]
    print(json.dumps({"what": "step", "step": i, "s": round(time.perf_counter() - t0, 2), "oom_retries": r.oom_retries,
                      "peak_gib": round((r.peak_allocated_bytes or 0) / 2**30, 2), "rss_gib": rss_gib(),
                      "treatments": {k: (v if isinstance(v, str) else len(v)) for k, v in (r.treatments or {}).items()}}),
          flush=True)
model.eval()
torch.cuda.reset_peak_memory_stats()
torch.cuda.synchronize()
t0 = time.perf_counter()
with torch.no_grad():
    loss = model(input_ids=ids, labels=ids).loss.item()
torch.cuda.synchronize()
print(json.dumps({"what": "eval", "s": round(time.perf_counter() - t0, 2), "loss": round(loss, 4),
                  "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  "on_device_gib": round(torch.cuda.memory_allocated() / 2**30, 2), "rss_gib": rss_gib()}), flush=True)
ctl.remove()
sys.exit(0)
