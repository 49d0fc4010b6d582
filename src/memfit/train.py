"""``memfit train <task>``: fine-tune a task recipe with the memfit Trainer under a memory budget.

The flags are those of the Hugging Face example scripts (``run_glue.py``, ``run_qa.py``, ...):
the model flags (:class:`~memfit.tasks.ModelArguments`), the data flags
(:class:`~memfit.tasks.DataTrainingArguments`) and :class:`memfit.hf.TrainingArguments`
(``transformers.TrainingArguments`` plus ``--memory_budget``, ``--memfit_method``, ...).

Example:
    memfit train text-classification --task_name mrpc --train_file train.tsv \\
        --validation_file dev.tsv --do_train --do_eval --memory_budget 6GiB --output_dir out
"""

from __future__ import annotations

import contextlib
import logging
import sys

from memfit.bench import oracle
from memfit.bench.peers import PeerArguments, make_peer
from memfit.tasks import TASKS, DataTrainingArguments, ModelArguments, get_task

__all__ = ["main", "run"]

logger = logging.getLogger(__name__)


def _usage() -> str:
    return (
        "usage: memfit train <task> [flags]\n\ntasks:\n"
        + "\n".join(f"  {name}" for name in TASKS)
        + "\n\n`memfit train <task> --help` lists the flags."
    )


def run(task: str, argv: list[str]) -> dict[str, float]:
    """Build the task, train if ``--do_train``, evaluate if ``--do_eval``; return the metrics.

    The metrics (``train_*`` from training, ``eval_*`` from evaluation) are also written to
    ``<output_dir>/all_results.json`` (and ``train_results.json`` / ``eval_results.json``), and
    the memfit Trainer writes ``memfit_steps.jsonl`` and ``memfit_summary.json`` there; a peer
    (:mod:`memfit.bench.peers`) writes ``memfit_peer.json``.

    Args:
        task: a task name of :data:`memfit.tasks.TASKS`.
        argv: the flags, e.g. ``["--synthetic", "64", "--do_train", "--max_steps", "4"]``.

    Raises:
        ValueError: unknown task, ``--do_train``/``--do_eval`` without data for it, or a peer
            with a memfit method other than ``none``.
        PeerUnavailableError: the peer asked for cannot run here (see :mod:`memfit.bench.peers`).

    Example:
        >>> metrics = run("token-classification", ["--synthetic", "32", "--do_train",
        ...     "--max_steps", "2", "--output_dir", "/tmp/out", "--report_to", "none"])  # doctest: +SKIP
    """
    recipe = get_task(task)
    from transformers import HfArgumentParser, set_seed
    from transformers import Trainer as PlainTrainer

    from memfit.hf import Trainer, TrainingArguments

    # A recipe may have flags of its own (causal-lm: dtype, LoRA): ``ARGUMENTS``, dataclasses
    # whose parsed values follow the seed in its ``build``.
    task_types = tuple(getattr(recipe, "ARGUMENTS", ()))
    parser = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, TrainingArguments, PeerArguments, *task_types), prog=f"memfit train {task}"
    )
    model_args, data_args, training_args, peer_args, *task_args = parser.parse_args_into_dataclasses(args=argv)
    peer = make_peer(peer_args, training_args.memfit_method)  # fails before the data is built
    set_seed(training_args.seed)
    bundle = recipe.build(model_args, data_args, training_args.seed, *task_args)
    for wanted, dataset, split in (
        (training_args.do_train, bundle.train_dataset, "train"),
        (training_args.do_eval, bundle.eval_dataset, "validation"),
    ):
        if wanted and not dataset:
            flag = "--do_train" if split == "train" else "--do_eval"
            files = f"--{split}_dir/--{split}_annotations" if task == "object-detection" else f"--{split}_file"
            raise ValueError(f"{flag} needs {files}, --dataset_name (with that split) or --synthetic N")
    for name, value in bundle.training_overrides.items():
        if getattr(training_args, name) != value:
            logger.info("%s: setting %s=%r (the task needs it)", task, name, value)
            setattr(training_args, name, value)

    metrics: dict[str, float] = {}
    # A peer stays active while the Trainer trains and evaluates (the compile peer's knob
    # is read at each compilation), and restores what it changed after.
    with peer or contextlib.nullcontext():
        plan_method = peer.prepare(bundle, training_args) if peer is not None else None
        if peer_args.oracle and training_args.do_train:
            if training_args.memfit_budget_bytes is None:
                raise ValueError("--oracle needs a budget: set --memory_threshold GB (or --memory_budget)")
            if peer_args.oracle_plans_file and not peer_args.oracle_sweep_only:
                plan_method = oracle.Oracle(peer_args.oracle_plans_file)  # an earlier sweep's plans
            else:
                plan_method = oracle.prepare(bundle, training_args)  # before the Trainer hooks the model
                if peer_args.oracle_sweep_only:
                    return {}
        # the `plain` peer trains without memfit at all
        memfit_on = peer is None or peer.uses_memfit
        trainer = (Trainer if memfit_on else PlainTrainer)(
            model=bundle.model,
            args=training_args,
            train_dataset=bundle.train_dataset if training_args.do_train else None,
            eval_dataset=bundle.eval_dataset if training_args.do_eval else None,
            data_collator=bundle.data_collator,
            processing_class=bundle.tokenizer,
            compute_metrics=bundle.compute_metrics,
            preprocess_logits_for_metrics=bundle.preprocess_logits_for_metrics,
            **({"memfit_method": plan_method} if memfit_on else {}),
        )
        if training_args.do_train:
            train_metrics = trainer.train().metrics
            trainer.log_metrics("train", train_metrics)
            trainer.save_metrics("train", train_metrics)
            metrics.update(train_metrics)
        if training_args.do_eval:
            eval_metrics = trainer.evaluate()
            trainer.log_metrics("eval", eval_metrics)
            trainer.save_metrics("eval", eval_metrics)
            metrics.update(eval_metrics)
    if peer is not None and trainer.is_world_process_zero():
        peer.write(training_args.output_dir)
    return metrics


def main(argv: list[str]) -> int:
    """``memfit train <task> [flags]``: run the task (the Trainer prints and saves the metrics)."""
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if argv[0] not in TASKS:
        print(f"memfit train: unknown task {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    run(argv[0], argv[1:])
    return 0
