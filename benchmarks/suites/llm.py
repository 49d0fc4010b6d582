"""llm: decoder-LLM fine-tuning under a cap, memfit's methods against every peer, in one plain loop."""

from suites import Call, Context, Suite, script

#: Peers whose OOM at a cap leaves memory behind: they run once per budget after every repeat.
LAST = ("hf-every-2", "trl-offload")

SUITE = Suite(
    name="llm",
    about="fine-tuning a Llama-architecture decoder (0.36B) in bf16 under caps at half and 0.7 of uncapped none's "
          "peak: time over plain PyTorch, peak vs cap, OOMs, lost steps; full fine-tuning, LoRA and long context",
    model="SmolLM-360M's config (Llama architecture, 32 layers, random weights), bf16 weights, SDPA, AdamW; "
          "LoRA: r 16 on every linear layer (peft)",
    data="token ids with SFT-like lengths (a chat-length distribution up to 2,048 tokens, seed 0), batch 8, "
         "dynamic padding; long: batch 1 of 8,192 and 16,384 tokens alternating; the same batches in every run",
    methods=("none", "full", "static", "dynamic", "dynamic+all", "reactive"),
    peers=("plain", "hf-every-1", "hf-offload", "hf-every-2", "trl-offload", "selective-static"),
    budgets={"ft": (0.5, 0.7), "lora": (0.5,), "long": (0.5,)},
    repeats=3,
    steps=24,
    carry=("wheels",),
    notes="budgets are shares of uncapped none's peak, measured in the same call; plain and none run uncapped; "
          "steady time is the median step from step 8 on; memfit methods run through run_step (an OOM replays "
          "the step); dynamic+all may also choose selective recompute and offload; hf-every-2 and trl-offload run "
          "once per budget after the repeats (an OOM of theirs leaves memory allocated); benchmarks/loop_bench.py",
)
QUICK = SUITE.replace(repeats=1, steps=6)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    common = ("--model", "SmolLM-360M", "--steps", suite.steps, "--repeats", suite.repeats)
    if ctx.quick:
        common = (*common, "--steady_from", 2)
    else:
        common = (*common, "--steady_from", 8)
    memfit_ft = ("plain", "none", "full", "static", "dynamic", "dynamic+all", "reactive", "hf-every-1", "hf-offload")
    return [
        Call("ft", [script(ctx, "loop_bench.py", *common, "--lengths", "sft", "--batch", 8,
                           "--budgets", *suite.budgets["ft"], "--methods", *memfit_ft, "--last", *LAST,
                           "--output_dir", ctx.folder("ft"))]),
        Call("lora", [script(ctx, "loop_bench.py", *common, "--lora", "--lengths", "sft", "--batch", 8,
                             "--budgets", *suite.budgets["lora"],
                             "--methods", "plain", "none", "full", "static", "dynamic", "reactive", "hf-every-1",
                             "--output_dir", ctx.folder("lora"))]),
        Call("long", [script(ctx, "loop_bench.py", *common, "--lengths", "fixed:8192,16384", "--batch", 1,
                             "--budgets", *suite.budgets["long"],
                             "--methods", "plain", "none", "full", "dynamic", "dynamic+all", "hf-every-1", "hf-offload",
                             "--output_dir", ctx.folder("long"))]),
    ]
