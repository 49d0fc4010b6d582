"""llm: decoder-LLM fine-tuning under a cap, memfit's methods against every peer, in one plain loop."""

from pathlib import Path

from suites import Call, Context, Suite, script

#: Peers whose OOM at a cap leaves memory behind: they run once per budget, in a call of their own.
LAST = ("hf-every-2", "trl-offload")
#: Methods and peers every repeat runs, in this order (plain and none uncapped, the rest per budget).
METHODS = ("plain", "none", "full", "static", "dynamic", "dynamic+all", "reactive", "hf-every-1", "hf-offload",
           "compile-0.5")

#: the head call's methods (issue 39), every repeat at each cap: memfit with the head planned (--head on)
#: and the fixed policies it is compared with (Hugging Face's checkpointing of every layer alone, with
#: Liger's fused linear cross-entropy, with the pure chunked loss in 8 chunks as TRL's chunked_nll)
HEAD_METHODS = ("dynamic", "full", "hf-every-1", "hf-every-1+liger", "hf-every-1+chunked-8")
#: and once per cap after every repeat (its compilation is long): dynamic compiled
HEAD_LAST = ("dynamic+compile",)
#: the head call's caps in GB: 22 GiB (a 24 GB card) and half of an 80 GB H100 (79.6 GiB usable / 2)
HEAD_BUDGETS_GB = (round(22 * 2**30 / 1e9, 2), round(79.6 / 2 * 2**30 / 1e9, 2))
#: the head job on one GPU (520 s in all): the SmolLM call (head auto against off), then the Qwen call.
#: Per call: no configuration starts after its time limit, a configuration stops starting steps after
#: its own, and `timeout` ends the call at its timeout (SIGTERM: loop_bench still writes <call>.vs_fixed.md)
HEAD_JOB_S = {"head-smollm": 95, "head-qwen15": 320}
HEAD_CONFIG_S = {"head-smollm": 20, "head-qwen15": 40}
HEAD_TIMEOUT_S = {"head-smollm": 130, "head-qwen15": 375}

SUITE = Suite(
    name="llm",
    about="fine-tuning Llama- and Qwen-architecture decoders (0.36B, 0.5B) in bf16 under caps at half and 0.7 of "
          "uncapped none's peak: time over plain PyTorch, peak vs cap, OOMs, lost steps; full fine-tuning, LoRA and "
          "long context",
    model="SmolLM-360M's config (Llama architecture, 32 layers) and Qwen2.5-0.5B's (24 layers), random weights, "
          "bf16 weights, SDPA, AdamW; LoRA: r 16 on every linear layer (peft)",
    data="token ids with SFT-like lengths (memfit.tasks.causal_lm's SFT table: chat turns, long-tailed up to 2,048 "
         "tokens, seed 0), batch 8, dynamic padding; long: batch 1 of 8,192 and 16,384 tokens alternating (steady "
         "time: the mean of the two lengths' median steps); the same batches in every run",
    methods=("none", "full", "static", "dynamic", "dynamic+all", "reactive"),
    peers=("plain", "hf-every-1", "hf-offload", "compile-0.5", "hf-every-2", "trl-offload", "selective-static"),
    budgets={"ft": (0.5, 0.7), "lora": (0.5, 0.7), "qwen": (0.5, 0.7), "long": (0.5,)},
    repeats=3,
    steps=40,
    quick_needs_cuda=True,
    carry=("wheels",),
    keep=("head-*.vs_fixed.md",),  # the head calls' memfit-against-the-fastest-fixed-policy tables (loop_bench)
    notes="budgets are shares of uncapped none's peak, measured in each call; plain and none run uncapped; steady "
          "time is the median step from step 8 on; memfit methods run through run_step (an OOM replays the step); "
          "dynamic+all may also choose selective recompute and offload; one call per repeat (estimated 4-8 minutes "
          "each on an H100 from the 24-step runs), repeats interleaved across calls; hf-every-2 and TRL offload run in a call of their own (an OOM "
          "of theirs leaves memory allocated); overhead-*: 60 steps, 3 interleaved repeats in one call, none against "
          "plain step by step in turn (alt), dynamic against its own plans with nothing else step by step in turn "
          "under one cap (alt-dynamic) (until 2026-11-24 also plain, dynamic-plans and reactive in runs of their own); replay-rate: reactive for 600 steps "
          "(its OOM replays per 1,000 steps); compile: memfit with compiled blocks (none+compile, dynamic+compile, "
          "full+compile) against the compile peer, repeats in one call until its 520 s limit; compile-sel-*: "
          "the same with compiled selective (dynamic+sel+compile) and eager static, for full FT and LoRA (until "
          "2026-11-24 without static); compile-sel-lora-half: its LoRA cells at 0.5 without static; compile-loss: compiled selective with the model's loss function compiled "
          "and left eager, full FT at half of none's peak; room-long, room-qwen: dynamic (its slack grown by allocator "
          "retries) against dynamic with a 15% margin, long context and Qwen at 0.7; room-reactive: reactive (the same rule) on Qwen at 0.7; long, long-compile: the long-context row, eager methods and peers, then "
          "memfit's compiled methods against the compile peer, each beside uncapped none and full recompute; "
          "head-qwen15: Qwen2.5-1.5B's shape (151,936-token vocabulary), 12 steps, 3 interleaved repeats in one call, at "
          "22 GiB and half of an 80 GB card, dynamic and full with the LM head planned (--head on), HF checkpointing alone "
          "and with a chunked loss fixed for the run (Liger's fused linear cross-entropy, skipped where not importable; "
          "the pure chunked loss in 8 chunks), then dynamic compiled once per cap; each memfit line against the fastest "
          "fixed policy that fits the same cap, step by step (head-qwen15.vs_fixed.md); cuDNN attention off (until 2026-11-27: 24 "
          "steps, 2 repeats, none uncapped, the head left to fit's default); head-smollm: the SmolLM full-FT cells at 0.5 "
          "and 0.7 of none's peak, dynamic with the head auto against off, 20 steps, 3 repeats; benchmarks/loop_bench.py",
)
QUICK = SUITE.replace(repeats=1, steps=6)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    common = ("--steps", suite.steps, "--steady_from", 2 if ctx.quick else 8)
    sft = ("--lengths", "sft", "--batch", 8)
    setups = {
        "ft": ("--model", "SmolLM-360M", *sft),
        "lora": ("--model", "SmolLM-360M", "--lora", *sft),
        "qwen": ("--model", "Qwen2.5-0.5B", *sft),
    }
    out = []
    for r in range(suite.repeats):
        for name, setup in setups.items():
            out.append(Call(f"{name}-r{r}", [script(
                ctx, "loop_bench.py", *setup, *common, "--budgets", *suite.budgets[name], "--repeats", 1,
                "--first_repeat", r, "--methods", *METHODS, "--output_dir", ctx.folder(name))], folder=name))
    out.append(Call("ft-last", [script(
        ctx, "loop_bench.py", *setups["ft"], *common, "--budgets", *suite.budgets["ft"], "--repeats", 1,
        "--first_repeat", suite.repeats, "--methods", "none", "--last", *LAST, "--output_dir", ctx.folder("ft-last"))],
        folder="ft-last"))
    # What memfit costs beyond what it does: none against the same loop step by step in turn
    # (alt), dynamic against its own plans run bare (dynamic-plans), and reactive's OOMs.
    for name in ("ft", "lora"):
        out.append(Call(f"overhead-{name}", [script(
            ctx, "loop_bench.py", *setups[name], "--steps", 12 if ctx.quick else 60, "--steady_from", 2 if ctx.quick else 10,
            "--budgets", 0.5, "--repeats", suite.repeats, "--methods", "none", "alt", "dynamic", "alt-dynamic", "--time_limit_s",
            540, "--output_dir", ctx.folder(f"overhead-{name}"))],
            folder=f"overhead-{name}"))
    # memfit with every block's body compiled against the compile peer (NOTE [Compiled blocks])
    out.append(Call("compile", [script(
        ctx, "loop_bench.py", *setups["ft"], *common, "--budgets", *suite.budgets["ft"], "--repeats", suite.repeats,
        "--methods", "plain", "none", "none+compile", "dynamic", "dynamic+compile", "full+compile", "compile-0.5",
        "--time_limit_s", 520, "--output_dir", ctx.folder("compile"))], folder="compile"))
    # compiled selective (the body compiled again under an activation budget, a treatment the
    # planner prices) against compiled dynamic without it and the compile peer
    for name in ("ft", "lora"):
        out.append(Call(f"compile-sel-{name}", [script(
            ctx, "loop_bench.py", *setups[name], *common, "--budgets", *suite.budgets[name], "--repeats", suite.repeats,
            "--methods", "none", "none+compile", "static", "dynamic+compile", "dynamic+sel+compile",
            "compile-0.5",
            "--time_limit_s", 520, "--output_dir", ctx.folder(f"compile-sel-{name}"))], folder=f"compile-sel-{name}"))
    # LoRA at half of none's peak alone, without static: a shorter rerun of compile-sel-lora's 0.5 cells
    out.append(Call("compile-sel-lora-half", [script(
        ctx, "loop_bench.py", *setups["lora"], *common, "--budgets", 0.5, "--repeats", suite.repeats, "--methods",
        "none", "none+compile", "dynamic+compile", "dynamic+sel+compile", "compile-0.5", "--time_limit_s", 420,
        "--output_dir", ctx.folder("compile-sel-lora-half"))], folder="compile-sel-lora-half"))
    # what compiling the model's loss function is worth: compiled selective with and without it
    out.append(Call("compile-loss", [script(
        ctx, "loop_bench.py", *setups["ft"], *common, "--budgets", 0.5, "--repeats", suite.repeats,
        "--methods", "none", "none+compile", "dynamic+sel+compile", "dynamic+sel+compile+eager-loss",
        "--time_limit_s", 520, "--output_dir", ctx.folder("compile-loss"))], folder="compile-loss"))
    # reactive's OOM replays per 1,000 steps: one long run at half of none's peak
    out.append(Call("replay-rate", [script(
        ctx, "loop_bench.py", *setups["ft"], "--steps", 12 if ctx.quick else 600, "--steady_from", 2 if ctx.quick else 10,
        "--budgets", 0.5, "--repeats", 1, "--methods", "reactive", "--time_limit_s", 560,
        "--output_dir", ctx.folder("replay-rate"))], folder="replay-rate"))
    # long context, eager and compiled (two calls: both within a call's 10 minutes); the steady
    # time averages the two lengths' medians (loop_bench's _steady)
    long_data = ("--model", "SmolLM-360M", "--lengths", "fixed:8192,16384", "--batch", 1, "--steps", 12 if ctx.quick else 28,
                 "--steady_from", 2 if ctx.quick else 8, "--budgets", *suite.budgets["long"])
    long = (*long_data, "--repeats", suite.repeats, "--time_limit_s", 520)
    out.append(Call("long", [script(
        ctx, "loop_bench.py", *long, "--methods", "plain", "none", "full", "dynamic", "dynamic+all", "hf-every-1",
        "hf-offload", "selective-static", "--output_dir", ctx.folder("long"))], folder="long"))
    # room for the allocator (NOTE [Room], planning.py): dynamic, whose slack grows after steps
    # the allocator served only by releasing its cache, against dynamic with a wide margin
    out.append(Call("room-long", [script(
        ctx, "loop_bench.py", *long_data, "--repeats", suite.repeats, "--methods", "none", "full", "dynamic",
        "dynamic@0.15", "--time_limit_s", 400, "--output_dir", ctx.folder("room-long"))], folder="room-long"))
    out.append(Call("room-qwen", [script(
        ctx, "loop_bench.py", *setups["qwen"], *common, "--budgets", 0.7, "--repeats", suite.repeats, "--methods",
        "none", "static", "dynamic", "dynamic@0.15", "--time_limit_s", 400, "--output_dir", ctx.folder("room-qwen"))],
        folder="room-qwen"))
    out.append(Call("room-reactive", [script(
        ctx, "loop_bench.py", *setups["qwen"], *common, "--budgets", 0.7, "--repeats", suite.repeats, "--methods",
        "none", "dynamic", "reactive", "--time_limit_s", 400, "--output_dir", ctx.folder("room-reactive"))],
        folder="room-reactive"))
    out += head_calls(suite, ctx)
    out.append(head_compile_call(suite, ctx))
    out += head_default_calls(suite, ctx)
    out.append(Call("long-compile", [script(
        ctx, "loop_bench.py", *long, "--methods", "none", "none+compile", "full", "dynamic+compile",
        "dynamic+sel+compile", "compile-0.5", "--output_dir", ctx.folder("long-compile"))], folder="long-compile"))
    out += offload_calls(suite, ctx)
    out.extend(_room_calls(ctx))
    out.append(optimizer_call(ctx))
    return out


def head_calls(suite: Suite, ctx: Context, tiny: bool = False) -> list[Call]:
    """The LM head's calls (issue 39), one GPU, in turn: ``head-qwen15`` (Qwen2.5-1.5B's shape, 151,936-token
    vocabulary, whose float32 logits are the step's floor, at 22 GiB and half of an 80 GB card, in GB as
    --budget_gb takes them; memfit with the head planned against the fixed policies, step by step: <call>.vs_fixed.md)
    and ``head-smollm`` (the SmolLM cells, whose head fits unchunked, at their caps: head auto against off).
    cuDNN attention is off (an OOM inside it poisons later cuDNN calls). ``tiny``: a 2-layer model of 8,000
    tokens' vocabulary on CPU (a dry run of the same commands; tests/test_run_suite.py)."""
    short = ctx.quick or tiny
    dry = ("--device", "cpu", "--config_overrides", "num_hidden_layers=2", "hidden_size=64", "intermediate_size=128",
           "num_attention_heads=2", "num_key_value_heads=1", "vocab_size=8000") if tiny else ()
    data = ("--lengths", "uniform:16:64", "--batch", 2) if tiny else ("--lengths", "sft", "--batch", 8)
    gb = (0.006, 0.008) if tiny else HEAD_BUDGETS_GB
    repeats = 1 if short else suite.repeats
    qwen = script(
        ctx, "loop_bench.py", "--model", "Qwen2.5-1.5B", *dry, *data, "--steps", 4 if short else 12,
        "--steady_from", 2 if short else 5, "--budgets", "--budget_gb", *gb, "--repeats", repeats, "--head", "on",
        "--no_cudnn_sdpa", "--time_limit_s", HEAD_JOB_S["head-qwen15"], "--config_time_limit_s",
        HEAD_CONFIG_S["head-qwen15"], "--methods", *HEAD_METHODS, "--last", *(() if tiny else HEAD_LAST),
        "--output_dir", ctx.folder("head-qwen15"))
    smollm = script(
        ctx, "loop_bench.py", "--model", "SmolLM-360M", *dry, *data, "--steps", 4 if short else 20,
        "--steady_from", 2 if short else 6, "--budgets", *suite.budgets["ft"], "--repeats", repeats,
        "--no_cudnn_sdpa", "--time_limit_s", HEAD_JOB_S["head-smollm"], "--config_time_limit_s",
        HEAD_CONFIG_S["head-smollm"], "--methods", "none", "dynamic+head-auto", "dynamic+head-off",
        "--output_dir", ctx.folder("head-smollm"))
    return [Call(name, [command], folder=name, timeout_s=HEAD_TIMEOUT_S[name])
            for name, command in (("head-smollm", smollm), ("head-qwen15", qwen))]


#: the compiled head call's methods (issue 39): compiled dynamic with compiled selective (what
#: --torch_compile gives) against the compile peer and Hugging Face's checkpointing, both with the 8-chunk loss
HEAD_COMPILE_METHODS = ("dynamic+sel+compile", "compile-0.1+chunked-8", "hf-every-1+chunked-8")


def head_compile_call(suite: Suite, ctx: Context) -> Call:
    """``head-compile``: Qwen2.5-1.5B's shape at 22 GiB with compiled blocks, one call within a
    device command's 10 minutes (each compiled configuration compiles again after a reset: 50-65 s
    the first time, 5-60 s later; the compile peer recompiles at new lengths' guard sides)."""
    return Call("head-compile", [script(
        ctx, "loop_bench.py", "--model", "Qwen2.5-1.5B", "--lengths", "sft", "--batch", 8,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
        HEAD_BUDGETS_GB[0], "--repeats", 1 if ctx.quick else suite.repeats, "--head", "on", "--no_cudnn_sdpa",
        "--time_limit_s", 420, "--config_time_limit_s", 150, "--methods", *HEAD_COMPILE_METHODS,
        "--output_dir", ctx.folder("head-compile"))], folder="head-compile", timeout_s=500)


#: the default-treatment head calls' methods: what a run that names no treatments gets, recompute
#: alone, and the fixed policies (Hugging Face's checkpointing of every layer with each fixed loss)
HEAD_DEFAULT_METHODS = ("dynamic+auto", "dynamic", "hf-every-1+chunked-8", "hf-every-1+liger")


def head_default_calls(suite: Suite, ctx: Context) -> list[Call]:
    """``head-auto-qwen15`` and ``head-auto-llama1b``: the default treatments (``dynamic+auto``) on
    Qwen2.5-1.5B's and Llama-3.2-1B's shapes at both head caps, 30 steps, each a device command of
    its own (on an H100, 3 repeats: Llama's 426 s; Qwen's 414 s without `dynamic`, whose runs take 15 s
    each: its third repeat may stop at the time limit; llm-head s22-1/s22-2)."""
    out = []
    for name, model in (("head-auto-qwen15", "Qwen2.5-1.5B"), ("head-auto-llama1b", "Llama-3.2-1B")):
        out.append(Call(name, [script(
            ctx, "loop_bench.py", "--model", model, "--lengths", "sft", "--batch", 8,
            "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
            *HEAD_BUDGETS_GB, "--repeats", 1 if ctx.quick else suite.repeats, "--head", "on", "--no_cudnn_sdpa",
            "--time_limit_s", 470, "--methods", *HEAD_DEFAULT_METHODS, "--output_dir", ctx.folder(name))],
            folder=name, timeout_s=540))
    # the same plans' head by each fused kernel alone, beside the fastest fixed policy (NOTE [A fused
    # kernel's fixed part]): what the probe's choice between them is worth at 22 GiB
    out.append(Call("head-kernels-llama1b", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.2-1B", "--lengths", "sft", "--batch", 8,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
        HEAD_BUDGETS_GB[0], "--repeats", 1 if ctx.quick else suite.repeats, "--head", "on", "--no_cudnn_sdpa",
        "--time_limit_s", 400, "--methods", "dynamic+auto", "dynamic+auto+only-cce", "dynamic+auto+only-liger",
        "hf-every-1+liger", "--output_dir", ctx.folder("head-kernels-llama1b"))],
        folder="head-kernels-llama1b", timeout_s=470))
    # plain training with no cap beside memfit at 22 GiB and both fixed policies: the floor the model's
    # own kernels set under every eager ratio (llm-head s23-4: 275 s on an H200, 3 repeats)
    out.append(Call("head-floor-llama1b", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.2-1B", "--lengths", "sft", "--batch", 8,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
        HEAD_BUDGETS_GB[0], "--repeats", 1 if ctx.quick else suite.repeats, "--head", "on", "--no_cudnn_sdpa",
        "--time_limit_s", 300, "--methods", "plain", "dynamic+auto", "dynamic+auto+only-cce", "hf-every-1+liger",
        "hf-every-1+chunked-8", "--output_dir", ctx.folder("head-floor-llama1b"))],
        folder="head-floor-llama1b", timeout_s=400))
    # the same steps under torch.profiler, one repeat: each step's GPU busy time and its waits for the host
    # (llm-head s23-2: 220 s on an H200); its times are for anatomy, not ratios
    out.append(Call("head-anatomy-llama1b", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.2-1B", "--lengths", "sft", "--batch", 8,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
        HEAD_BUDGETS_GB[0], 120, "--repeats", 1, "--head", "on", "--no_cudnn_sdpa", "--gpu_busy",
        "--time_limit_s", 400, "--methods", "dynamic+auto", "hf-every-1+liger", "plain",
        "--output_dir", ctx.folder("head-anatomy-llama1b"))],
        folder="head-anatomy-llama1b", timeout_s=470))
    return out


def head_job(out: str, python: str = "python3") -> str:
    """The head job as one shell line for a GPU session (run from the repository root, one GPU chosen by
    CUDA_VISIBLE_DEVICES): :func:`head_calls` in turn, each under ``timeout``, into ``out/<call>``.

    Example:
        >>> head_job("$OUT/head").startswith("timeout 130 python3 benchmarks/loop_bench.py --model SmolLM-360M")
        True
    """
    import shlex

    from suites import ROOT

    class _Out(Context):
        def folder(self, call_name: str) -> Path:
            return Path(f"{out}/{call_name}")

    ctx = _Out(raw=Path(out), quick=False, cuda=True, python=python)
    words = []
    for call in head_calls(SUITE, ctx):
        command = [w.replace(f"{ROOT}/", "") for w in call.commands[0]]
        words.append(f"timeout {call.timeout_s:g} " + " ".join(w if w.startswith("$") else shlex.quote(w) for w in command))
    return " ; ".join(words)


# ---------------------------------------------------------------------------- offload (issue 40)
#: the offload job's methods at half of uncapped none's peak: dynamic by recompute alone, with offload priced
#: by its exposed copy time, with offload priced at its fixed cost alone (offloading wherever it saves bytes:
#: what the price keeps it from), and Hugging Face's checkpointing of every layer, alone and offloaded
OFFLOAD_METHODS = ("none", "dynamic", "dynamic+offload", "dynamic+offload-free", "hf-every-1", "hf-offload")
#: seconds the offload call may run, and after how many it starts no configuration (the longest, offload
#: everywhere, takes about 15 s at 16k tokens): with run_suite's start and publishing, inside the job's 240 s
OFFLOAD_JOB_S, OFFLOAD_START_S = 215, 160


#: the optimizer-step call's cap in GB: 11.5 GiB, under a 1.24B model's full fine-tuning in bf16 with AdamW whose
#: foreach step (weights, gradients, state and a parameter-sized temporary: 11.57 GiB, memfit estimate) does not fit
OPTIMIZER_BUDGET_GB = round(11.5 * 2**30 / 1e9, 2)


def optimizer_call(ctx: Context) -> Call:
    """``optimizer-llama1b``: a shape whose peak is the optimizer step (issue 60). Llama-3.2-1B's shape, full
    fine-tuning, SFT lengths, batch 4, at 11.5 GiB: memfit (its step per tensor where foreach's temporaries do not
    fit) against Hugging Face's checkpointing with Liger's loss (its AdamW as made), uncapped ``none`` beside."""
    return Call("optimizer-llama1b", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.2-1B", "--lengths", "sft", "--batch", 4,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb",
        OPTIMIZER_BUDGET_GB, "--repeats", 1, "--no_cudnn_sdpa", "--time_limit_s", 300, "--config_time_limit_s", 120,
        "--methods", "none", "dynamic+auto", "hf-every-1+liger", "--output_dir", ctx.folder("optimizer-llama1b"))],
        folder="optimizer-llama1b", timeout_s=360)


def offload_calls(suite: Suite, ctx: Context) -> list[Call]:
    """``offload-long``: the long-context cell (SmolLM-360M's config, batch 1, 8,192 and 16,384 tokens
    alternating) at half of uncapped none's peak, 3 repeats interleaved in one call; each line carries what
    offload did (blocks offloaded per length, prefetch depths, the compute stream's waits for copies: loop_bench's
    ``offload`` field)."""
    steps = ("--steps", 8 if ctx.quick else 14, "--steady_from", 2 if ctx.quick else 6)
    return [Call("offload-long", [script(
        ctx, "loop_bench.py", "--model", "SmolLM-360M", "--lengths", "fixed:8192,16384", "--batch", 1, *steps,
        "--budgets", 0.5, "--repeats", 1 if ctx.quick else 3, "--methods", *OFFLOAD_METHODS, "--time_limit_s",
        OFFLOAD_START_S, "--output_dir", ctx.folder("offload-long"))], folder="offload-long", timeout_s=OFFLOAD_JOB_S)]


#: the room-compile call's methods (issue 40): uncapped none, eager dynamic, dynamic with compiled
#: blocks (what --torch_compile now gives), Hugging Face's checkpointing of every layer
ROOM_METHODS = ("none", "dynamic", "dynamic+compile", "hf-every-1")


def _room_calls(ctx: Context) -> list[Call]:
    """Issue 40's room and compile check, one call within its job's 280 s: at half of none's peak,
    per band of lengths the peak against the cap, allocator retries and the prediction's bias
    (``by_length``), and the compiled run's compile time and graphs compiled after its first step;
    3 interleaved repeats (the first compiles; later repeats compile again after a reset)."""
    return [Call("room-compile", [script(
        ctx, "loop_bench.py", "--model", "SmolLM-360M", "--lengths", "sft", "--batch", 8,
        "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", 0.5,
        "--repeats", 1 if ctx.quick else 3, "--methods", *ROOM_METHODS, "--time_limit_s", 60 if ctx.quick else 180,
        "--output_dir", ctx.folder("room-compile"))], folder="room-compile")] + _room_cells(ctx)


def _room_cells(ctx: Context) -> list[Call]:
    """Issue 40's done-when cells for eager ``dynamic`` at half of none's peak, one GPU, each within
    170 s (long context at 32k, 230 s): full fine-tuning and LoRA on SFT lengths (batch 8, 30 steps)
    against Hugging Face's checkpointing, and long context (batch 1, 8k/16k and 16k/32k tokens)
    against it and its offload; compiled blocks on SFT lengths (270 s); 3 interleaved repeats (results:
    nvidia-h100/llm-room, room.jsonl.gz)."""
    sft = ("--lengths", "sft", "--batch", 8, "--steps", 6 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8)
    long = ("--lengths", "fixed:8192,16384", "--batch", 1, "--steps", 6 if ctx.quick else 14,
            "--steady_from", 2 if ctx.quick else 6)
    long32 = ("--lengths", "fixed:16384,32768", *long[2:])
    cells = (("room-ft", (*sft,), ("none", "dynamic", "hf-every-1"), 140),
             ("room-lora", ("--lora", *sft), ("none", "dynamic", "hf-every-1"), 140),
             ("room-long-peers", long, ("none", "dynamic", "hf-every-1", "hf-offload"), 140),
             ("room-long32", long32, ("none", "dynamic", "hf-every-1", "hf-offload"), 200),
             # compiled blocks: graphs compiled after warm-up (NOTE [Guard sides in warm-up]) and the step
             ("compile-sides", (*sft,), ("none", "dynamic+compile", "dynamic+sel+compile"), 270))
    return [Call(name, [script(
        ctx, "loop_bench.py", "--model", "SmolLM-360M", *setup, "--budgets", 0.5, "--repeats", 1 if ctx.quick else 3,
        "--methods", *methods, "--time_limit_s", 60 if ctx.quick else limit, "--output_dir", ctx.folder(name))],
        folder=name, timeout_s=limit + 30) for name, setup, methods, limit in cells]
