"""``memfit estimate``: the command line of the memory anatomy (anatomy.py) and its advice (advise.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from memfit.engine.budget import Budget, format_bytes, parse_bytes
from memfit.errors import ArgumentParser, FlagError
from memfit.tools.estimate.advise import DEFAULT_MARGIN, NothingFitsError, advise, format_advice
from memfit.tools.estimate.floor import (
    FloorTooHighError,
    Floors,
    floor_lengths,
    floor_too_high,
    floor_words,
    format_floor,
    plan_words,
)
from memfit.tasks import TASKS as TRAIN_TASKS
from memfit.tasks._common import bundled_config
from memfit.tasks.causal_lm import LORA_DROPOUT, check_lora_dropout
from memfit.tools.estimate.anatomy import (
    HEAD_CHOICES,
    OPTIMIZERS,
    PRECISIONS,
    TASKS,
    ModelProfile,
    TrainingSetup,
    estimate,
    format_head_table,
    format_table,
    load_config,
    optimizer_available,
    table_unit,
)

__all__ = ["main"]


#: the tasks ``memfit train`` can train (the estimate also knows image-classification, which it cannot)
_TRAIN_TASKS = tuple(t for t in TASKS if t in TRAIN_TASKS)


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="memfit estimate",
        description="Memory anatomy of one training step (weights, gradients, optimizer state, activations, "
        "CUDA context) from a model config; --advise lists the fastest setups that fit --memory_budget. "
        "GiB = 2**30 bytes, GB = 10**9 bytes.",
    )
    p.add_argument("--model", help="model name (shipped config, HF cache or Hub) or a local folder")
    p.add_argument("--config", help="path to a config.json (wins over --model)")
    p.add_argument("--task", choices=tuple(TASKS), help="head on the model (default: causal-lm for a decoder "
                   "config, whose architectures name a ...ForCausalLM, else text-classification)")
    p.add_argument("--num_choices", type=int, default=4, help="choices per example for multiple-choice (SWAG: 4)")
    p.add_argument("--batch_size", type=int, required=True, help="examples per optimizer step")
    p.add_argument("--seq_length", type=int, help="tokens per example of the longest batch (text models)")
    p.add_argument("--image_size", type=int, help="pixels per side (vision models)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="fp32, or mixed precision bf16/fp16")
    p.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS))
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--checkpoint", default="none", help="none, full, tiled (every block on recompute_tiled: recomputed, its "
                   "gated MLP in chunks of tokens), host (every block on host_checkpoint_tiled: its input in pinned host "
                   "memory until its recompute, its MLP in chunks; host_checkpoint where memfit tiles no MLP of the model), "
                   "or a number of blocks to checkpoint")
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16"),
                   help="dtype of the stored weights (bf16: causal-lm's --torch_dtype bfloat16; needs --precision bf16)")
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank on every linear layer of the blocks (causal-lm's "
                   "--use_peft); 0: full fine-tuning")
    p.add_argument("--lora_dropout", type=float, help=f"with --lora_r: peft's LoRA dropout, as memfit train's flag "
                   f"(default {LORA_DROPOUT}); memfit tiles no MLP with a dropout inside, so the floor and --checkpoint "
                   "host and tiled count the MLP tiled only with 0")
    p.add_argument("--head", default="keep", choices=HEAD_CHOICES, help="a causal LM's head: keep (the model's own "
                   "loss: float32 logits and cross-entropy's copy) or chunked (memfit's chunked logits and loss); "
                   "--advise tries both")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help="attention kernel (sdpa: fused, its "
                   "saved tensors counted as flash attention saves them where the model runs SDPA; eager: the s x s weights)")
    p.add_argument("--memory_budget", help="budget to check: '6GiB' (6*2**30), '6GB' (6*10**9) or bytes; sizes are "
                   "then shown in its unit family (MB/GB, or MiB/GiB)")
    p.add_argument("--advise", action="store_true", help="list the fastest setups that fit --memory_budget")
    p.add_argument("--floor", action="store_true", help="the floor per sequence length (text models): the smallest cap "
                   "memfit's treatments reach, every block on host_checkpoint_tiled (host_checkpoint where the MLP is not "
                   "tiled) and the LM head chunked the most, from 1k tokens up to --seq_length (or the model's positions), "
                   "and with --memory_budget the longest it admits")
    p.add_argument("--shards", type=int, default=1, help="ranks FSDP2 shards the model over (the Trainer's --fsdp "
                   "full_shard on that many GPUs, every node's): the estimate, the advice and the floor are then one "
                   "rank's, its share of weights, gradients and optimizer state and the parameters it gathers "
                   "(default 1: one GPU)")
    p.add_argument("--memfit_host_budget", help="pinned host memory host_checkpoint may hold, as memfit train's flag "
                   "('16GiB', '16GB' or bytes): the floor's pinned bytes are checked against it")
    p.add_argument("--top", type=int, default=10, help="setups listed by --advise")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help="share of --memory_budget that --advise keeps free (allocator fragmentation, estimate error)")
    return p


def train_command(model: str | None, config: str | None, task: str, seq_length: int | None) -> list[str]:
    """The start of the ``memfit train`` command that trains what was estimated: the task, the model
    (pretrained weights for ``--model``, random weights from ``--config`` or from a config memfit
    bundles, which needs no hub) and the input length.

    Returns:
        The words after ``memfit``, or an empty list when ``memfit train`` has no such task.
    """
    if task not in _TRAIN_TASKS:
        return []
    words = ["train", task]
    if config or (model and bundled_config(model)):  # random weights: a bundled config runs offline
        words += ["--config_name", str(config or model)]
    else:
        words += ["--model_name_or_path", str(model)]
    return words + (["--max_seq_length", str(seq_length)] if seq_length else [])


def what_would_fit(profile: ModelProfile, args: Any, budget: Budget, options: dict, inputs: dict) -> str:
    """When nothing fits: the smallest single change that would, among LoRA (causal-lm), a shorter
    --seq_length (halved, then halved again) and a smaller --batch_size (halved down to 1).

    Returns:
        ``". The smallest change that fits: ..."``, or a sentence that no single change does.
    """
    tries: list[tuple[str, dict, dict]] = []
    if args.task == "causal-lm" and not args.lora_r:
        tries.append(("--lora_r 16 (LoRA on every linear layer)", {"lora_r": 16}, {}))
    length = args.seq_length
    while length and length > 1 and len(tries) < 6:
        length //= 2
        tries.append((f"--seq_length {length}", {"lora_r": args.lora_r}, {"seq_length": length}))
    batch = args.batch_size
    while batch > 1:
        batch //= 2
        tries.append((f"--batch_size {batch}", {"lora_r": args.lora_r, "batch_size": batch}, {}))
    fits = []
    for words, extra, changed in tries:
        if any(f.split()[0] == words.split()[0] for f in fits):  # values shrink: the first that fits is the largest
            continue  # said already: no need to count the smaller values on the meta device
        batch_size = extra.pop("batch_size", args.batch_size)
        try:
            advise(profile, batch_size, budget, **options, **extra, **{**inputs, **changed})
        except NothingFitsError:
            continue
        fits.append(words)
    if not fits:
        return ". No single change of batch size, length or LoRA fits either; else pick a smaller model."
    return ". The smallest change that fits: " + ", or ".join(fits) + "."


def main(argv: list[str] | None = None) -> int:
    """``memfit estimate``: print the breakdown and the floor at its shape (or, with ``--advise``, the ranked
    setups; with ``--floor``, the floor per length).

    Raises:
        FlagError: a flag value or combination that cannot work.
        NothingFitsError: ``--advise`` and no setup fits the budget (the ``memfit`` command
            prints it in one line and exits 2).
        FloorTooHighError: ``--floor`` and even the floor of ``--seq_length`` does not fit the budget
            (NOTE [The floor] in floor.py), after the table; a NothingFitsError too.
    """
    args = _parser().parse_args(argv)
    try:
        budget = None if args.memory_budget is None else Budget.parse(args.memory_budget, "--memory_budget")
        host_budget = None if args.memfit_host_budget is None else parse_bytes(args.memfit_host_budget, _HOST_FLAG)
    except ValueError as err:
        raise FlagError(str(err)) from None
    if args.advise and budget is None:
        raise FlagError("--advise needs --memory_budget (e.g. 6GiB)")
    if not 0 <= args.margin < 1:
        raise FlagError(f"--margin {args.margin}: give a share of the budget in [0, 1)")
    if args.advise and args.floor:
        raise FlagError("--advise and --floor: run them apart (--floor prints the floor per length of the setup flags)")
    if args.floor and args.image_size:
        raise FlagError("--floor is per sequence length: a text model's (give --seq_length, not --image_size)")
    for flag in ("batch_size", "gradient_accumulation_steps", "seq_length", "num_choices", "image_size", "shards"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise FlagError(f"--{flag} {getattr(args, flag)}: give a whole number of at least 1")
    if args.batch_size % args.gradient_accumulation_steps:
        raise FlagError(
            f"--batch_size {args.batch_size} is not a multiple of --gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}"
        )
    if args.lora_dropout is not None and not args.lora_r:  # as memfit train's, without --use_peft
        raise FlagError("--lora_dropout configures LoRA: give --lora_r (or drop it for full fine-tuning)")
    args.lora_dropout = LORA_DROPOUT if args.lora_dropout is None else args.lora_dropout
    check_lora_dropout(args.lora_dropout)
    config = load_config(args.model, args.config)
    if args.task is None:
        decoder = any(a.endswith("ForCausalLM") for a in getattr(config, "architectures", None) or ())
        args.task = "causal-lm" if decoder else "text-classification"
    profile = ModelProfile.from_config(config, args.task, name=args.model or str(args.config))
    inputs = {"seq_length": args.seq_length, "image_size": args.image_size, "attention": args.attention,
              "num_choices": args.num_choices}
    title = f"memfit estimate: {profile.name}, {args.task}, " + (
        f"{args.image_size}x{args.image_size} pixels" if args.image_size else f"{args.seq_length} tokens"
    ) + f", batch {args.batch_size}" + (f", {args.attention} attention" if profile.bert_family else "") + (
        f", one rank of {args.shards} FSDP2 ranks" if args.shards > 1 else "")
    if args.lora_r < 0:
        raise FlagError(f"--lora_r {args.lora_r}: give a rank of at least 1 (or 0 for full fine-tuning)")
    if (args.lora_r or args.weights != "fp32") and args.task != "causal-lm":
        raise FlagError("--lora_r and --weights bf16 are causal-lm's (memfit train's --use_peft, --torch_dtype): "
                        "drop them, or give --task causal-lm")
    if args.advise:
        half = "fp16" if args.precision == "fp16" else "bf16"
        optimizers = [args.optimizer] + [o for o in ("adamw", "adafactor", "adamw-8bit") if o != args.optimizer]
        # NOTE [Advice options]: bf16 weights are a causal-lm option (--torch_dtype bfloat16) tried beside
        # the others; LoRA changes what is trained, so it is advised only when asked (--lora_r) or
        # named as the change that would fit when nothing does.
        weights = ("fp32", "bf16") if args.task == "causal-lm" else ("fp32",)
        heads = HEAD_CHOICES if args.task == "causal-lm" else ("keep",)  # NOTE [The head in the estimate]
        options = dict(precisions=("fp32", half), optimizers=optimizers, margin=args.margin, weights=weights, heads=heads,
                       lora_dropout=args.lora_dropout, shards=args.shards)
        try:
            ranked = advise(profile, args.batch_size, budget, lora_r=args.lora_r, **options, **inputs)
        except NothingFitsError as err:
            raise NothingFitsError(f"{err}{what_would_fit(profile, args, budget, options, inputs)}") from None
        command = train_command(args.model, args.config, args.task, args.seq_length)
        print(format_advice(ranked, budget, top=args.top, title=title, margin=args.margin, command=command))
        used = {a.estimate.setup.optimizer for a in ranked[: args.top]}
        if args.optimizer not in used:
            print(f"note: no setup with --optimizer {args.optimizer} fits, so every row uses another optimizer "
                  "(the optimizer column)")
        if args.shards > 1:
            print(f"note: every row is one rank's of {args.shards}: launch the command on {args.shards} ranks under torchrun "
                  "with --fsdp (docs/distributed.md), --memory_budget then caps each rank")
        for name in optimizers:
            if not optimizer_available(name):
                print(f"note: {name} not considered: {OPTIMIZERS[name].needs} is not installed")
        return 0
    setup = TrainingSetup(
        precision=args.precision,
        optimizer=args.optimizer,
        micro_batch_size=args.batch_size // args.gradient_accumulation_steps,
        accumulation_steps=args.gradient_accumulation_steps,
        checkpoint=args.checkpoint,
        weights=args.weights,
        lora_r=args.lora_r,
        head=args.head,
        lora_dropout=args.lora_dropout,
        shards=args.shards,
    )
    if not args.floor or args.seq_length:  # without a length the estimate asks for one (--floor: up to the model's)
        print(format_table(estimate(profile, setup, **inputs), budget, title=title))
        if args.task == "causal-lm" and args.seq_length:
            print("\n" + format_head_table(profile, setup, args.seq_length, table_unit(budget)))
    else:
        print(f"memfit estimate: {profile.name}, {args.task}, batch {args.batch_size}")
    usable = None if budget is None else int(budget.bytes * (1 - args.margin))
    floors = Floors(profile, setup, usable, host_budget, **{k: v for k, v in inputs.items() if k != "seq_length"})
    if args.floor:
        return _floor(floors, args, budget)
    if args.seq_length:
        print("\n" + _floor_line(floors, args, budget))
    return 0


def _floor(floors: Floors, args: Any, budget: Budget | None) -> int:
    """``--floor``: the floor per length, the longest the budget admits (at the micro-batch asked, else one row at a
    time), and the error when even the floor of ``--seq_length`` does not fit (NOTE [The floor] in floor.py)."""
    limit = _positions(floors.profile) or args.seq_length
    if not limit:
        raise FlagError(f"--floor: {floors.profile.name}'s config names no max_position_embeddings; give --seq_length")
    longest = None
    for micro in dict.fromkeys((floors.setup.micro_batch_size, 1) if budget is not None else ()):
        if (n := floors.longest(limit, micro)) is not None:
            longest = (n, micro)
            break
    print("\n" + format_floor(floors, floor_lengths(args.seq_length or limit), budget, longest, args.margin))
    why = None if budget is None or not args.seq_length else floor_too_high(
        floors, args.seq_length, budget, args.margin, limit, _with_lora(args, floors.setup), _HOST_FLAG)
    if why:
        raise FloorTooHighError(why)
    return 0


_HOST_FLAG = "--memfit_host_budget"


def _positions(profile: ModelProfile) -> int | None:
    """The longest sequence the model's position embeddings take (``max_position_embeddings``), if it says."""
    n = getattr(profile.config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _with_lora(args: Any, setup: TrainingSetup) -> TrainingSetup | None:
    """The setup with LoRA r 16, to name in a floor that does not fit; None where LoRA is on or not the task's."""
    return None if args.lora_r or args.task != "causal-lm" else dataclasses.replace(setup, lora_r=16)


def _floor_line(floors: Floors, args: Any, budget: Budget | None) -> str:
    """The floor at the shape estimated, in one line under its table (NOTE [The floor] in floor.py)."""
    est = floors.at(args.seq_length)
    size = budget.size if budget is not None else format_bytes
    line = (f"floor at this shape ({plan_words(est)}; {size(est.host_bytes)} pinned): {floor_words(est, size)}; "
            "--floor for the floor per length")
    if budget is None:
        return line
    why = floor_too_high(floors, args.seq_length, budget, args.margin, _positions(floors.profile) or args.seq_length,
                         _with_lora(args, floors.setup), _HOST_FLAG)
    return line + (f"\nthe floor fits the budget of {budget} less {100 * args.margin:g}%" if why is None else f"\n{why}")


if __name__ == "__main__":
    sys.exit(main())
