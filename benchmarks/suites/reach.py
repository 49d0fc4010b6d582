"""reach: the tight end, where nothing else fits: memfit's host checkpoints and planner against the peers at
caps near the floor, host memory watched (issue 59's reach suite): cells at fixed caps, and per workload the
smallest cap of each method by bisection (``reach-<workload>``: benchmarks/bisect_caps.py)."""

from suites import Call, Context, Suite, script

#: 22 GiB and 24 GiB in GB (loop_bench's --budget_gb): a 24 GB card's usable memory, and the issue's 24 GiB cap
GIB22, GIB24 = round(22 * 2**30 / 1e9, 2), round(24 * 2**30 / 1e9, 2)

SUITE = Suite(
    name="reach",
    about="decoder LLMs at the tight end: does memfit train where the fixed policies stop, at what time per step, "
          "with its host memory flat (resident memory per step) and its planner bounded",
    model="gemma-2-2b's shape (26 layers alternating sliding-window and global attention, 256,000-token vocabulary, "
          "soft-capped logits) and Llama-3.1-8B's, random weights, bf16, SDPA, AdamW; LoRA r 16 on every linear layer",
    data="gemma: token ids with SFT-like lengths up to 2,048 (seed 0), batch 8; llama8b: batch 1 of 16,384 and 32,768 "
         "tokens alternating; the same batches in every run",
    methods=("dynamic+auto", "dynamic", "dynamic+host", "static+auto"),
    peers=("hf-every-1+liger", "hf-offload"),
    budgets={"gemma2-lora": (GIB22,), "llama8b-long": (GIB24,)},
    repeats=1,
    steps=60,
    carry=("wheels",),
    keep=("*.reach.jsonl", "*.reach.md"),
    notes="caps in GB (22 and 24 GiB); dynamic+auto is what a user gets (recompute, elementwise, host_checkpoint, the "
          "head planned); dynamic recompute alone; dynamic+host recompute and host_checkpoint; the peers are Hugging "
          "Face's checkpointing of every layer with Liger's fused loss, and with its offload; rss_mib per step and "
          "rss_growth_mib over the steady steps in every line",
)
QUICK = SUITE.replace(steps=4)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    steps = 4 if ctx.quick else suite.steps
    gemma = Call("gemma2-lora", [script(
        ctx, "loop_bench.py", "--model", "gemma-2-2b", "--lora", "--lengths", "sft", "--batch", 8, "--steps", steps,
        "--steady_from", 2 if ctx.quick else 10, "--budgets", "--budget_gb", GIB22, "--repeats", suite.repeats,
        "--no_cudnn_sdpa", "--time_limit_s", 330, "--config_time_limit_s", 150,
        "--methods", "dynamic+auto", "hf-every-1+liger", "--output_dir", ctx.folder("gemma2-lora"))],
        folder="gemma2-lora", timeout_s=420)
    # the same, 30 steps, so that the peer runs inside a GPU session's ten-minute command beside memfit
    gemma30 = Call("gemma2-lora-30", [script(
        ctx, "loop_bench.py", "--model", "gemma-2-2b", "--lora", "--lengths", "sft", "--batch", 8,
        "--steps", 4 if ctx.quick else 30, "--steady_from", 2 if ctx.quick else 8, "--budgets", "--budget_gb", GIB22,
        "--repeats", suite.repeats, "--no_cudnn_sdpa", "--time_limit_s", 450, "--config_time_limit_s", 150,
        "--methods", "dynamic+auto", "hf-every-1+liger", "--output_dir", ctx.folder("gemma2-lora-30"))],
        folder="gemma2-lora-30", timeout_s=540)
    long = Call("llama8b-long", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.1-8B", "--lora", "--lengths", "fixed:16384,32768", "--batch", 1,
        "--steps", 4 if ctx.quick else 8, "--steady_from", 2, "--budgets", "--budget_gb", GIB24,
        "--repeats", suite.repeats, "--no_cudnn_sdpa", "--time_limit_s", 500, "--config_time_limit_s", 120,
        "--methods", "dynamic+auto", "hf-every-1+liger", "hf-offload",
        "--output_dir", ctx.folder("llama8b-long"))],
        folder="llama8b-long", timeout_s=560)
    # issue 59's (c) at its caps: 64k tokens in 24 GiB, 128k under 40 GiB (memfit alone: both peers OOM at 16k in 24 GiB);
    # with the blocks' frozen weights on the host (NOTE [Weights on the host]): 16k in 6 GiB, 64k in 12, 128k in 24
    at_caps = [Call(name, [script(
        ctx, "loop_bench.py", "--model", "Llama-3.1-8B", "--lora", "--lengths", f"fixed:{k * 1024}", "--batch", 1,
        "--steps", 2 if ctx.quick else steps, "--steady_from", 1, "--budgets", "--budget_gb", round(cap * 2**30 / 1e9, 2),
        "--repeats", 1, "--no_cudnn_sdpa", "--no_untimed", "--time_limit_s", 480, "--config_time_limit_s", 480,
        "--methods", "dynamic+auto", "--output_dir", ctx.folder(name))], folder=name, timeout_s=560)
        for name, k, cap, steps in (("llama8b-64k", 64, 24, 6), ("llama8b-128k", 128, 40, 3), ("llama8b-16k-6gib", 16, 6, 6),
                                    ("llama8b-64k-12gib", 64, 12, 4), ("llama8b-128k-24gib", 128, 24, 2))]
    # issue 59's (c) at mixed lengths: SFT lengths up to 32k in 24 GiB, memfit against the one plan of the longest batch
    # for every batch (the static recipe that makes it fit: every block on the host and tiled, the head chunked)
    mixed = Call("llama8b-mixed-32k", [script(
        ctx, "loop_bench.py", "--model", "Llama-3.1-8B", "--lora", "--lengths", "sft:32768", "--batch", 1,
        "--steps", 4 if ctx.quick else 40, "--steady_from", 2 if ctx.quick else 6, "--budgets", "--budget_gb", GIB24,
        "--repeats", 1, "--no_cudnn_sdpa", "--time_limit_s", 500, "--config_time_limit_s", 240,
        "--methods", "dynamic+auto", "static+auto", "--output_dir", ctx.folder("llama8b-mixed-32k"))],
        folder="llama8b-mixed-32k", timeout_s=580)
    return [gemma, gemma30, long, *at_caps, mixed, *_bisections(ctx), *_split(ctx), *_shares(ctx), *_families(ctx), *_at_peer(ctx)]


#: issue 59's reach workloads: loop_bench's model and data flags, the caps bisected (GiB), steps
WORKLOADS = {
    "a-1b-full": (("--model", "Llama-3.2-1B", "--lengths", "sft:4096", "--batch", 8), (4, 48), 30),
    "b-8b-lora": (("--model", "Llama-3.1-8B", "--lora", "--lengths", "sft:8192", "--batch", 4), (16, 64), 30),
    "c-8b-16k": (("--model", "Llama-3.1-8B", "--lora", "--lengths", "fixed:16384", "--batch", 1), (4, 64), 6),
    "c-8b-32k": (("--model", "Llama-3.1-8B", "--lora", "--lengths", "fixed:32768", "--batch", 1), (4, 64), 6),
    "c-8b-64k": (("--model", "Llama-3.1-8B", "--lora", "--lengths", "fixed:65536", "--batch", 1), (8, 80), 6),
    "d-gemma2-lora": (("--model", "gemma-2-2b", "--lora", "--lengths", "sft", "--batch", 8), (6, 40), 30),
}
#: what each workload's smallest cap is bisected for: what a user gets, and the peers a user would configure (Hugging
#: Face's checkpointing with Liger's fused loss, and with its checkpoints on the host too: the static floor)
REACH_METHODS = ("dynamic+auto", "hf-every-1+liger", "hf-offload+liger")


def _bisections(ctx: Context) -> list[Call]:
    """One call per workload, every method in it: the peers first (each from its peak's guess), then memfit from the
    best peer's smallest cap, its steps there compared with that peer's (NOTE [Fewer trials, the same certificate])."""
    calls = []
    for workload, (flags, (lo, hi), steps) in WORKLOADS.items():
        name = f"reach-{workload}"
        calls.append(Call(name, [script(
            ctx, "loop_bench.py", *flags, "--steps", 3 if ctx.quick else steps, "--steady_from", 1 if ctx.quick else 2,
            "--reach_gib", lo, hi, "--reach_step_gib", 1, "--repeats", 1, "--no_cudnn_sdpa", "--no_untimed",
            "--time_limit_s", 540, "--config_time_limit_s", 200, "--methods", *REACH_METHODS,
            "--output_dir", ctx.folder(name))], folder=name, timeout_s=580))
    return calls


#: (b)'s best peer's smallest cap, GiB (s34-3: ``hf-offload+liger``): memfit's first trial where its bisection runs apart
#: (a fitting trial of (b) takes about two minutes: the three methods do not fit one ten-minute call)
B_BEST_PEER_GIB = 30


def _split(ctx: Context) -> list[Call]:
    """(b)'s memfit bisection in a call of its own, from the best peer's smallest cap measured apart."""
    flags, (lo, hi), steps = WORKLOADS["b-8b-lora"]
    name = "reach-b-8b-lora-memfit"
    return [Call(name, [script(
        ctx, "loop_bench.py", *flags, "--steps", 3 if ctx.quick else steps, "--steady_from", 1 if ctx.quick else 2,
        "--reach_gib", lo, hi, "--reach_step_gib", 1, "--reach_start_gib", B_BEST_PEER_GIB, "--repeats", 1,
        "--no_cudnn_sdpa", "--no_untimed", "--time_limit_s", 540, "--config_time_limit_s", 200,
        "--methods", "dynamic+auto", "--output_dir", ctx.folder(name))], folder=name, timeout_s=580)]


def _shares(ctx: Context) -> list[Call]:
    """Issue 59's cells at 0.18 and 0.25 of plain's peak: (a)'s workload, 200 steps, memfit against Hugging Face's
    checkpointing with Liger's loss on the same batches, warm-up included (``--steady_from 0``: every step paired).
    Uncapped ``none`` sets the cap from the longest batch alone (``--reference_longest``): its 200 steps beside the
    two methods' did not fit a ten-minute call (s35-3). The fused losses' kernels are compiled first, untimed, on three
    batches (``--untimed_fused``): memfit's first step would otherwise compile Liger's for the peer too (s36-2); and
    memfit's warm-up runs untimed on three batches (``--untimed_memfit``): a fresh machine's first one compiles the
    kernels at its probe's shapes, which the peer never runs (s43-2, s44-2; s43-3 ran a prewarm call by hand)."""
    flags, _, _ = WORKLOADS["a-1b-full"]
    calls = []
    for share in (0.18, 0.25):
        name = f"reach-a-share-{share}"
        calls.append(Call(name, [script(
            ctx, "loop_bench.py", *flags, "--steps", 4 if ctx.quick else 200, "--steady_from", 0, "--budgets", share,
            "--reference_longest", "--repeats", 1, "--no_cudnn_sdpa", "--no_untimed", "--untimed_fused", 3, "--untimed_memfit", 3,
            "--time_limit_s", 560,
            "--config_time_limit_s", 270, "--methods", "dynamic+auto", "hf-every-1+liger", "--output_dir", ctx.folder(name))],
            folder=name, timeout_s=590))
    return calls


#: families beside Llama at the 0.25 share cell's flags: a post-norm block whose tiled MLP would reorder its input's
#: gradient sums (NOTE [Tiled MLP]: never tiled), and one with norms on its queries and keys, a 151,936-token vocabulary
#: and tied embeddings
FAMILIES = ("OLMo-2-0425-1B", "Qwen3-1.7B")


def _families(ctx: Context) -> list[Call]:
    """The 0.25 share cell's workload on other families' shapes (SFT lengths to 4k, batch 8, full fine-tuning), 60 steps
    each: memfit against Hugging Face's checkpointing with Liger's loss on the same batches, every step paired."""
    calls = []
    for model in FAMILIES:
        name = f"reach-share-0.25-{model}"
        calls.append(Call(name, [script(
            ctx, "loop_bench.py", "--model", model, "--lengths", "sft:4096", "--batch", 8, "--steps", 4 if ctx.quick else 60,
            "--steady_from", 0, "--budgets", 0.25, "--reference_longest", "--repeats", 1, "--no_cudnn_sdpa", "--no_untimed",
            "--untimed_fused", 3, "--untimed_memfit", 3, "--time_limit_s", 280, "--config_time_limit_s", 130, "--methods", "dynamic+auto",
            "hf-every-1+liger", "--output_dir", ctx.folder(name))], folder=name, timeout_s=290))
    return calls


#: per workload, its best peer and that peer's smallest cap (GiB) from the bisections (s34-2), the steps and the first
#: steady step of the side-by-side runs there (a run of one length warms up for four steps: twelve, compared from six)
AT_PEER = {
    "a-1b-full": ("hf-every-1+liger", 15, 30, 4),
    "c-8b-16k": ("hf-offload+liger", 23, 12, 6),
    "d-gemma2-lora": ("hf-offload+liger", 10, 30, 4),
}


def _at_peer(ctx: Context) -> list[Call]:
    """memfit against the best peer at that peer's smallest cap, three repeats interleaved (the same batches, the
    methods alternating within each repeat; the first repeat pays the fused kernels' compiles, the median of the
    repeats' ratios does not): the issue's per-step target at the tight end, by the protocol."""
    calls = []
    for workload, (peer, cap, steps, steady) in AT_PEER.items():
        flags, _, _ = WORKLOADS[workload]
        name = f"at-peer-{workload}"
        calls.append(Call(name, [script(
            ctx, "loop_bench.py", *flags, "--steps", 3 if ctx.quick else steps, "--steady_from", 1 if ctx.quick else steady,
            "--budgets", "--budget_gb", round(cap * 2**30 / 1e9, 2), "--repeats", 3, "--no_cudnn_sdpa", "--no_untimed",
            "--time_limit_s", 540, "--config_time_limit_s", 200, "--methods", "dynamic+auto", peer,
            "--output_dir", ctx.folder(name))], folder=name, timeout_s=580))
    return calls
