"""``memfit train <task>``: fine-tune a task recipe with the memfit Trainer under a memory budget.

The flags are those of the Hugging Face example scripts (``run_glue.py``, ``run_qa.py``, ...):
the model flags (:class:`~memfit.tasks.ModelArguments`), the data flags
(:class:`~memfit.tasks.DataTrainingArguments`) and :class:`memfit.integrations.hf.TrainingArguments`
(``transformers.TrainingArguments`` plus ``--memory_budget``, ``--memfit_method``, ...).

Example:
    memfit train text-classification --task_name mrpc --train_file train.tsv \\
        --validation_file dev.tsv --do_train --do_eval --memory_budget 6GiB --output_dir out
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from memfit.tools.bench import oracle
from memfit.tools.bench.peers import make_peer
from memfit.errors import DataError, FlagError, MissingFileError
from memfit.tasks import TASKS, DataTrainingArguments, TaskBundle, get_task
from memfit.cli.said import setup_done
from memfit.cli.start_floor import say_floor_at_start
from memfit.tasks._hub import hub_names, hub_or_offline

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

    After training, the model (or LoRA adapter) and tokenizer are saved to ``--output_dir``
    unless ``--save_strategy no`` (NOTE [The model at the end]).

    The metrics (``train_*`` from training, ``eval_*`` from evaluation) are also written to
    ``<output_dir>/all_results.json`` (and ``train_results.json`` / ``eval_results.json``), and
    the memfit Trainer writes ``memfit_steps.jsonl`` and ``memfit_summary.json`` there; a peer
    (:mod:`memfit.tools.bench.peers`) writes ``memfit_peer.json``.

    Args:
        task: a task name of :data:`memfit.tasks.TASKS`.
        argv: the flags, e.g. ``["--synthetic", "64", "--do_train", "--max_steps", "4"]``.

    Raises:
        FlagError: unknown task or flag, a flag value the checks refuse, neither ``--do_train`` nor
            ``--do_eval`` (NOTE [Nothing to do]), ``--do_train``/``--do_eval``
            without data for it, or a peer with a memfit method other than ``none``.
        DataError: a data file that is malformed or has no examples.
        BudgetTooSmallError: the budget cannot hold weights, gradients and optimizer state.
        PeerUnavailableError: the peer asked for cannot run here (see :mod:`memfit.tools.bench.peers`).

        Every error above is a user error (:mod:`memfit.errors`); one raised before the first
        training step leaves no step records, and no ``--output_dir`` this run created.

    Example:
        >>> metrics = run("token-classification", ["--synthetic", "32", "--do_train",
        ...     "--max_steps", "2", "--output_dir", "/tmp/out", "--report_to", "none"])  # doctest: +SKIP
    """
    recipe = get_task(task)
    from transformers import Trainer as PlainTrainer
    from transformers import set_seed

    from memfit.cli.flags import TrainFlagParser
    from memfit.integrations.hf import Trainer

    # A recipe may have flags of its own (causal-lm: dtype, LoRA): ``ARGUMENTS``, dataclasses
    # whose parsed values follow the seed in its ``build``.
    parser = TrainFlagParser(task, tuple(getattr(recipe, "ARGUMENTS", ())))
    model_args, data_args, training_args, peer_args, *task_args = parser.parse(argv)
    if not (training_args.do_train or training_args.do_eval):  # NOTE [Nothing to do]
        raise FlagError("nothing to do: add --do_train to train (and --do_eval to evaluate)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size == 1:  # N copies writing one set of files: nothing silent
        raise FlagError(f"the launcher started {launched} processes, but each would train alone on a copy of the model "
                        "(transformers runs them as one job only on accelerators or with --use_cpu): add --use_cpu to "
                        "train on CPU processes together, or launch one process")
    if getattr(data_args, "validation_file", None) and not training_args.do_eval:  # nothing silent, nothing before an error
        logger.warning("--validation_file %s is not read without --do_eval (add it to evaluate)", data_args.validation_file)
    with _removed_if_left_empty(training_args.output_dir):
        peer = make_peer(peer_args, training_args.memfit_method)  # fails before the data is built
        if peer_args.oracle and training_args.do_train and training_args.memfit_budget_bytes is None:
            raise FlagError("--oracle needs a budget: set --memory_threshold GB (or --memory_budget)")
        resume = _resume_from(training_args)
        set_seed(training_args.seed)
        with hub_or_offline(hub_names(model_args, data_args, tokenizer=getattr(recipe, "TOKENIZER", True))):
            bundle = recipe.build(model_args, data_args, training_args.seed, *task_args)
        _check_data(task, data_args, training_args, bundle)
        if task == "causal-lm" and training_args.do_train and (peer is None or peer.uses_memfit):  # NOTE [The floor at start]
            say_floor_at_start(bundle.model, bundle.train_dataset, training_args, on_cuda=_on_cuda(training_args))
        if training_args.dataloader_pin_memory and (training_args.use_cpu or not _has_accelerator()):
            # pinned host memory only speeds copies to an accelerator; without one torch warns at every loader
            training_args.dataloader_pin_memory = False
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
            trainer.add_callback(_setup_done_when_training_starts())  # NOTE [Quiet until asked] in said.py
            if training_args.do_train:
                train_metrics = trainer.train(resume_from_checkpoint=resume).metrics
                trainer.log_metrics("train", train_metrics)
                trainer.save_metrics("train", train_metrics)
                metrics.update(train_metrics)
                if str(training_args.save_strategy) not in ("no", "SaveStrategy.NO"):
                    _save_final_model(trainer, bundle)
            if training_args.do_eval:
                setup_done()  # an evaluation alone: what was held back is said now
                eval_metrics = trainer.evaluate()
                trainer.log_metrics("eval", eval_metrics)
                trainer.save_metrics("eval", eval_metrics)
                metrics.update(eval_metrics)
        if peer is not None and trainer.is_world_process_zero():
            peer.write(training_args.output_dir)
        return metrics


# NOTE [Nothing to do]
# Without --do_train or --do_eval a run would build the model and exit 0 with nothing done, as
# Hugging Face's example scripts do. memfit train refuses instead, before loading anything: the
# flags keep the example scripts' meaning (--do_eval alone evaluates), and a forgotten flag costs
# one line, not a silent run.


#: where a LoRA run saves a base model that has no name to load it by (NOTE [The model at the end])
_BASE_FOLDER = "base"


# NOTE [The model at the end]
# As Hugging Face's example scripts do (trainer.save_model() after training), the trained model
# and its tokenizer are written to --output_dir when training ends, unless --save_strategy no:
# every weight for full fine-tuning, or the LoRA adapter and its adapter_config.json for a peft
# model (its save_pretrained writes only those), loadable with from_pretrained /
# peft.PeftModel.from_pretrained. One line says where.
# An adapter is only half a model: its adapter_config.json names the base to load it on
# (base_model_name_or_path), which a base from the hub or a local folder has. A base built from a
# config with random weights (--config_name, the bundled llama-tiny) has no name (load_model
# clears it) and exists nowhere else, so its weights, config and tokenizer are saved in
# <output_dir>/base/ and the adapter names that folder by absolute path: peft and transformers
# read base_model_name_or_path as given, relative to the working directory, never to the
# adapter's folder. Moved elsewhere, the folder still loads with
# PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<folder>/base), <folder>).
def _save_final_model(trainer: Any, bundle: TaskBundle) -> None:
    base = _unnamed_base(bundle.model)
    if base is not None and (getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)):
        logger.warning("the LoRA adapter's base model (random weights) is sharded across ranks and is not saved: to load "
                       "the adapter later, train it on a saved base (--model_name_or_path)")
        base = None
    folder = os.path.abspath(os.path.join(trainer.args.output_dir, _BASE_FOLDER))
    if base is not None:
        if trainer.is_world_process_zero():
            _save_base(base, bundle.tokenizer, folder)
        for config in bundle.model.peft_config.values():
            config.base_model_name_or_path = folder
    trainer.save_model()
    if trainer.is_world_process_zero():
        kind = "LoRA adapter" if hasattr(bundle.model, "peft_config") else "model"
        what = f"{kind} and tokenizer" if bundle.tokenizer is not None else kind
        where = f", and the base model it adapts (random weights) to {folder}" if base is not None else ""
        print(f"memfit: saved the trained {what} to {trainer.args.output_dir}{where} (--save_strategy no skips it)",
              file=sys.stderr, flush=True)


def _unnamed_base(model: Any) -> Any:
    """The base model under a peft ``model`` when it has no name to load it by (random weights), else None."""
    if not hasattr(model, "peft_config"):
        return None
    base = model.get_base_model()
    return None if getattr(base, "name_or_path", "") else base


def _save_base(base: Any, tokenizer: Any, folder: str) -> None:
    """Save ``base`` (with adapter layers injected) as the plain model it was: its weights without the
    adapters' (``lora_*``, ``modules_to_save``), each wrapped layer's own under its original name, and
    ``tokenizer`` beside them: a folder ``from_pretrained`` loads alone."""
    state = {}
    for name, tensor in base.state_dict().items():
        parts = name.split(".")
        if any(p.startswith("lora_") or p == "modules_to_save" for p in parts):
            continue
        state[".".join(p for p in parts if p not in ("base_layer", "original_module"))] = tensor
    base.save_pretrained(folder, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _setup_done_when_training_starts() -> Any:
    """A Trainer callback: the command's setup is done when training starts (after the Trainer's own
    checks, such as the output folder's), so what was held back is said then (NOTE [Quiet until asked])."""
    from transformers import TrainerCallback

    class SetupDone(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            setup_done()

    return SetupDone()


def _on_cuda(training_args: Any) -> bool:
    """Whether the run trains on a CUDA device."""
    import torch

    return not training_args.use_cpu and torch.cuda.is_available()


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; else CUDA is the one asked about
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


@contextlib.contextmanager
def _removed_if_left_empty(folder: str) -> Iterator[None]:
    """On an error, remove ``folder`` if this run created it and left it empty."""
    created = not os.path.exists(folder)
    try:
        yield
    except BaseException:
        if created and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
        raise


def _check_data(task: str, data_args: DataTrainingArguments, training_args: Any, bundle: TaskBundle) -> None:
    """A split asked for (``--do_train``/``--do_eval``) must have examples; name what gave none.

    Raises:
        DataError: its source was given and yielded no examples.
        FlagError: no source for it was given, or ``--max_*_samples 0``.
    """
    for wanted, dataset, split, short in (
        (training_args.do_train, bundle.train_dataset, "train", "train"),
        (training_args.do_eval, bundle.eval_dataset, "validation", "eval"),
    ):
        if not wanted or dataset:
            continue
        flag = f"--do_{short}"
        if getattr(data_args, f"max_{short}_samples") == 0:
            raise FlagError(f"--max_{short}_samples 0 leaves {flag} no examples; raise it or drop it")
        given = ((name, getattr(data_args, name)) for name in (f"{split}_file", f"{split}_annotations", "dataset_name"))
        source = next((f"--{name} {value}" for name, value in given if value), None)
        if source is not None:
            raise DataError(f"{source} has no {split} examples for {task}; give data with at least one")
        files = f"--{split}_dir/--{split}_annotations" if task == "object-detection" else f"--{split}_file"
        raise FlagError(f"{flag} needs {files}, --dataset_name (with that split) or --synthetic N")


def _resume_from(training_args: Any) -> str | bool | None:
    """``--resume_from_checkpoint``: a checkpoint folder, or ``true`` for the last one in ``--output_dir``.

    Raises:
        MissingFileError: the folder is no checkpoint, or ``--output_dir`` holds none.
    """
    value = training_args.resume_from_checkpoint
    if not value:
        return None
    if str(value).lower() == "true":
        from transformers.trainer_utils import get_last_checkpoint

        if not os.path.isdir(training_args.output_dir) or get_last_checkpoint(training_args.output_dir) is None:
            raise MissingFileError(
                f"--resume_from_checkpoint true: --output_dir {training_args.output_dir} holds no checkpoint-* "
                "folder; name a checkpoint folder, or train without --resume_from_checkpoint"
            )
        return True
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise MissingFileError(
            f"--resume_from_checkpoint {value}: not a checkpoint folder (no trainer_state.json); name a "
            "checkpoint-N folder a run saved, or true for the last one in --output_dir"
        )
    return value


def main(argv: list[str]) -> int:
    """``memfit train <task> [flags]``: run the task (the Trainer prints and saves the metrics)."""
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if argv[0] not in TASKS:
        print(f"memfit train: error: unknown task {argv[0]!r}; choose one of: {', '.join(TASKS)}", file=sys.stderr)
        return 2
    run(argv[0], argv[1:])  # what it says on stderr: NOTE [Quiet until asked] in memfit/cli/__init__.py
    return 0
