"""tasks: the four NLP recipes at the original batch sizes, every budget from 3 to 8 GB, with peers."""

from suites import Call, Context, Suite, gb, memfit

#: Per task: the budget where the longest batches need about half of the 12 layers
#: checkpointed, the other budgets where uncapped none does not fit, and those where it does.
MATRIX = {
    "multiple-choice": {"half": 3, "capped": (), "fits": (4, 5, 6, 7, 8)},
    "text-classification": {"half": 3, "capped": (), "fits": (4, 5, 6, 7, 8)},
    "question-answering": {"half": 4, "capped": (3, 5), "fits": (6, 7, 8)},
    "token-classification": {"half": 6, "capped": (3, 4, 5, 7, 8), "fits": ()},
}
SHORT = {"multiple-choice": "mc", "text-classification": "tc", "question-answering": "qa", "token-classification": "tok"}

SUITE = Suite(
    name="tasks",
    about="memfit train's recipes under hard caps: dynamic against none, static, full, the oracle, reactive and "
          "the peers, at every budget from 3 to 8 GB",
    model="bert-base-uncased from its config (random weights), fp32, the Trainer's AdamW",
    data="synthetic examples whose lengths follow each dataset's real distribution (SWAG, SQuAD v1.1 with doc "
         "stride 128, GLUE, CoNLL-2003), dynamic padding; batch 16 (MC), 12 (QA), 32 (TC), 64 (TOK); seed 42",
    methods=("none", "dynamic", "oracle", "reactive", "static", "full"),
    peers=("ckptplan-0.75", "hf-every-2", "compile-0.2"),
    budgets={task: (m["half"], *m["capped"], *m["fits"]) for task, m in MATRIX.items()},
    repeats=2,
    steps=200,
    carry=("tokenizer", "wheels"),
    notes="at the half-layers budget none (uncapped), dynamic, the oracle and reactive run `repeats` times "
          "interleaved, static, full and the peers once (and auto-batch, Accelerate's --auto_find_batch_size, on "
          "token-classification: it changes the batch size, read it apart); at the other capped budgets dynamic, "
          "the oracle and static once; where none fits, dynamic once beside an uncapped none",
)
QUICK = SUITE.replace(methods=("none", "dynamic"), peers=(), budgets={"text-classification": (0.05,)}, repeats=1, steps=2)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    if ctx.quick:  # a 2-layer BERT, on CPU without CUDA
        (task, budgets), = suite.budgets.items()
        train = ("--config_name", ctx.tiny_bert(), *(() if ctx.cuda else ("--use_cpu",)))
        return [_call(ctx, "quick", task, suite.methods, budgets, suite.steps, 1, train)]
    train = ("--config_name", "bert-base-uncased", *ctx.tokenizer())
    out = []
    for task, m in MATRIX.items():
        name, half = SHORT[task], (m["half"],)
        peers = (*suite.peers, *(("auto-batch",) if task == "token-classification" else ()))
        repeated = [x for x in ("none", "dynamic", "oracle", "reactive") if x in suite.methods]
        out.append(_call(ctx, f"{name}-half", task, repeated, half, suite.steps, suite.repeats, train))
        out.append(_call(ctx, f"{name}-peers", task, ("static", "full", *peers), half, suite.steps, 1, train))
        # At most three budgets a call, so that a call fits the 10 minutes a GPU session allows.
        for i in range(0, len(m["capped"]), 3):
            chunk = m["capped"][i : i + 3]
            capped = [x for x in ("dynamic", "oracle", "static") if x in suite.methods]
            out.append(_call(ctx, f"{name}-capped-{'-'.join(map(str, chunk))}", task, capped, chunk, suite.steps, 1,
                             train))
        if m["fits"] and "dynamic" in suite.methods:  # with its own uncapped none to compare with
            fits = [x for x in ("none", "dynamic") if x in suite.methods]
            out.append(_call(ctx, f"{name}-fits", task, fits, m["fits"], suite.steps, 1, train))
    return out


def _call(ctx, name, task, methods, budgets, steps, repeats, train) -> Call:
    """One memfit bench invocation; it first primes its machine with an untimed none run (NOTE [First process])."""
    return Call(name, [memfit(ctx, "bench", "--tasks", task, "--methods", *methods, "--uncapped_none_only",
                              "--budgets", *gb(budgets), "--steps", steps, "--repeats", repeats, "--gpu_warmup_s", 2,
                              "--output_dir", ctx.folder(name), "--", *train)])
