"""Every user error of the ``memfit`` command: one line on stderr that names what to change, exit
status 2, no traceback, and nothing written (NOTE [User errors] in memfit/errors.py).

The table runs each bad input through ``memfit.cli.main`` in this process; two cases also run
the real console process, with and without ``--debug``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import BertConfig, BertForSequenceClassification

from _models import FIXTURES, TINY_BERT
from memfit import cli
from memfit.tasks._common import minilm_path

MRPC = FIXTURES / "glue" / "MRPC"
MRPC_HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


@dataclass
class Case:
    """One bad input: the command line, what the one-line message must say, files made first."""

    name: str
    argv: Callable[[Path, Path], list[str]]
    """``(tmp, out) -> argv``: ``tmp`` holds the files, ``out`` is the run's --output_dir."""
    message: str
    """Regex the error line must match (after ``memfit <command>: error: ``)."""
    files: dict[str, str] = field(default_factory=dict)
    """Files written under ``tmp`` before the run (name -> text)."""


def tiny(tmp: Path) -> list[str]:
    return ["--config_name", str(tmp / "tiny.json"), "--tokenizer_name", str(minilm_path())]


def mrpc(
    tmp: Path, out: Path, *flags: str, train: str | None = None, task_name: str = "mrpc", config: str | None = None
) -> list[str]:
    """A ``memfit train text-classification`` command on the MRPC fixture with a tiny BERT."""
    model = ["--config_name", config, "--tokenizer_name", str(minilm_path())] if config else tiny(tmp)
    return [
        "train", "text-classification", *model, "--task_name", task_name, "--train_file", train or str(MRPC / "train.tsv"),
        "--do_train", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no", "--output_dir", str(out),
        *flags,
    ]


SFT = FIXTURES / "sft"


def sft(tmp: Path, out: Path, *flags: str, train: str | None = None) -> list[str]:
    """A ``memfit train causal-lm`` command on the prompt/completion fixture (llama-tiny, offline)."""
    return [
        "train", "causal-lm", "--train_file", train or str(SFT / "prompt_completion.jsonl"), "--do_train",
        "--max_steps", "1", "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--output_dir", str(out),
        *flags,
    ]


EARLIER_RUN = {"out/memfit_steps.jsonl": '{"step": 1}\n', "out/memfit_summary.json": "{}"}
EMPTY_COCO = json.dumps({"images": [], "annotations": [], "categories": [{"id": 1, "name": "box"}]})

CASES = [
    # NOTE [A budget as typed] in memfit/engine/budget.py: quoted as typed, sizes in its unit family, its flag named
    Case("budget too small", lambda t, o: mrpc(t, o, "--memory_budget", "1MB"),
         r"memory budget 1MB \(1000000 bytes\) is below what training needs before any activation: [\d.]+ MB \(\d+ "
         r"bytes: parameters [\d.]+ MB, gradients [\d.]+ MB, optimizer state \(adamw_torch\w*, expected\) [\d.]+ MB\)\. "
         r"Raise --memory_budget above that"),
    Case("budget too small, as --memory_threshold", lambda t, o: mrpc(t, o, "--memory_threshold", "0.001"),
         r"memory budget 0\.001 GB \(1000000 bytes\) is below what training needs before any activation: [\d.]+ MB "
         r".*Raise --memory_threshold above that"),
    Case("negative budget", lambda t, o: mrpc(t, o, "--memory_budget", "-3GB"),
         r"error: --memory_budget -3GB: a memory size cannot be negative; write e\.g\. 3GB$"),
    # NOTE [A value that starts with a minus] in memfit/errors.py: not argparse's "expected one argument"
    Case("negative learning rate in e-notation", lambda t, o: mrpc(t, o, "--learning_rate", "-1e-3"),
         r"error: --learning_rate -0\.001: give a rate of 0 or more$"),
    Case("negative budget after =", lambda t, o: mrpc(t, o, "--memory_budget=-3GB"),
         r"error: --memory_budget -3GB: a memory size cannot be negative; write e\.g\. 3GB$"),
    Case("budget of 0", lambda t, o: mrpc(t, o, "--memory_budget", "0"),
         r"error: --memory_budget 0: a budget of 0 bytes holds nothing; give e\.g\. 6GB$"),
    Case("budget in lower case", lambda t, o: mrpc(t, o, "--memory_budget", "5gb"),
         r"error: --memory_budget 5gb: the unit 'gb' is not one memfit reads \(units are read as written, case "
         r"included\): write 5GB \(5\*10\*\*9 = 5000000000 bytes\) or 5GiB \(5\*2\*\*30 = 5368709120 bytes\)$"),
    Case("bad --memfit_host_weights", lambda t, o: mrpc(t, o, "--memfit_host_weights", "sometimes"),
         r"--memfit_host_weights 'sometimes': give auto, on or off"),
    Case("unknown method", lambda t, o: mrpc(t, o, "--memfit_method", "fastest"),
         r"--memfit_method 'fastest' is unknown; choose one of none, full, dynamic"),
    Case("bad --task_name", lambda t, o: mrpc(t, o, task_name="mprc"),
         r"--task_name mprc: not a GLUE task; choose one of: cola, sst2, mrpc"),
    Case("missing data file", lambda t, o: mrpc(t, o, train=str(t / "nowhere.tsv")),
         r"--train_file .*nowhere\.tsv: no such file"),
    Case("empty data file", lambda t, o: mrpc(t, o, train=str(t / "empty.tsv")),
         r"--train_file .*empty\.tsv has no examples \(empty, or a header without rows\)", {"empty.tsv": ""}),
    Case("data file without examples", lambda t, o: mrpc(t, o, train=str(t / "header.tsv")),
         r"--train_file .*header\.tsv has no examples", {"header.tsv": MRPC_HEADER}),
    Case("malformed data file", lambda t, o: mrpc(t, o, train=str(t / "bad.tsv")),
         r"bad\.tsv:3: expected 5 fields, found 2", {"bad.tsv": MRPC_HEADER + "1\t1\t2\ta b\tc d\n0\t3\n"}),
    Case("unsupported data file", lambda t, o: mrpc(t, o, train=str(t / "notes.txt")),
         r"notes\.txt: unsupported file type '\.txt'; use \.csv, \.tsv, \.json or \.jsonl", {"notes.txt": "a b\n"}),
    Case("budget flags disagree", lambda t, o: mrpc(t, o, "--memory_budget", "1GB", "--memory_threshold", "2"),
         r"--memory_budget 1GB and --memory_threshold 2 \(GB\) disagree; give only one of them"),
    Case("malformed budget", lambda t, o: mrpc(t, o, "--memory_budget", "6XB"),
         r"--memory_budget 6XB: not a memory size: '6XB'; write e\.g\. '6GiB'"),
    Case("both checkpoint", lambda t, o: mrpc(t, o, "--gradient_checkpointing"),
         r"--gradient_checkpointing and memfit both checkpoint: drop --gradient_checkpointing"),
    Case("precomputed without plans", lambda t, o: mrpc(t, o, "--memfit_method", "precomputed"),
         r"--memfit_method precomputed needs --memfit_plans_file"),
    Case("plans file missing", lambda t, o: mrpc(t, o, "--memfit_method", "precomputed", "--memfit_plans_file", str(t / "p.json")),
         r"--memfit_plans_file .*p\.json: no such file; give the memfit_plans\.json"),
    Case("plans file malformed", lambda t, o: mrpc(t, o, "--memfit_method", "precomputed", "--memfit_plans_file", str(t / "p.json")),
         r"plans file .*p\.json is malformed .*; expected JSON with a 'plans' list", {"p.json": '{"not": "plans"}'}),
    Case("max shape 8x128", lambda t, o: mrpc(t, o, "--memfit_method", "static", "--memfit_max_shape", "8x128"),
         r"--memfit_max_shape 8x128: write the largest input as N,T \(rows, tokens per row\), e\.g\. 8,128"),
    Case("output dir is a file", lambda t, o: mrpc(t, t / "afile"),
         r"--output_dir .*afile is a file; name a folder", {"afile": "x"}),
    Case("output dir holds an earlier run", lambda t, o: mrpc(t, o),
         r"--output_dir .*out holds an earlier run \(memfit_steps\.jsonl, memfit_summary\.json\); pass "
         r"--resume_from_checkpoint to continue it, --overwrite_output_dir to replace it, or another --output_dir",
         EARLIER_RUN),
    Case("resume from no checkpoint", lambda t, o: mrpc(t, o, "--resume_from_checkpoint", str(t / "checkpoint-9")),
         r"--resume_from_checkpoint .*checkpoint-9: not a checkpoint folder"),
    Case("training without data", lambda t, o: ["train", "token-classification", *tiny(t), "--do_train", "--output_dir", str(o)],
         r"--do_train needs --train_file, --dataset_name \(with that split\) or --synthetic N"),
    Case("transformers' conflicting flags", lambda t, o: mrpc(t, o, "--load_best_model_at_end", "--eval_strategy", "steps"),
         r"--load_best_model_at_end requires the save and eval strategy to match"),
    Case("synthetic zero", lambda t, o: ["train", "token-classification", "--synthetic", "0", "--output_dir", str(o)],
         r"--synthetic 0: give a positive number of examples"),
    Case("synthetic and a file", lambda t, o: mrpc(t, o, "--synthetic", "8"),
         r"--synthetic replaces the data: drop --dataset_name/--train_file/--validation_file or drop --synthetic"),
    Case("sequences too long", lambda t, o: mrpc(t, o, "--max_seq_length", "100000"),
         r"--max_seq_length 100000 exceeds the model's limit of 512 tokens; lower it"),
    Case("unknown config", lambda t, o: mrpc(t, o, config="no-such-config"),
         r"--config_name no-such-config: cannot load it .* memfit bundles no config of that name .*; pass a config\.json"),
    # NOTE [Closest flags] in memfit/errors.py
    Case("unknown flag", lambda t, o: mrpc(t, o, "--budget", "1GB"),
         r"unknown flag --budget; did you mean --memory_budget\? `memfit train text-classification --help-all` lists "
         r"every flag$"),
    Case("misspelled flag", lambda t, o: mrpc(t, o, "--memory_bugdet", "5GB"),
         r"unknown flag --memory_bugdet; did you mean --memory_budget\? `memfit train"),
    Case("two unknown flags", lambda t, o: sft(t, o, "--lora_rank", "8", "--memory-bugdet=5GB", "--no_such_flag"),
         r"unknown flags --lora_rank \(did you mean --lora_r\?\), --memory-bugdet \(did you mean "
         r"--memory_budget\?\), --no_such_flag; `memfit train causal-lm --help-all` lists every flag$"),
    Case("a flag cut short", lambda t, o: mrpc(t, o, "--memory_budg", "5GB"),  # no abbreviation is read silently
         r"unknown flag --memory_budg; did you mean --memory_budget\?"),
    Case("not an integer", lambda t, o: mrpc(t, o, "--max_steps", "ten"),
         r"argument --max_steps/--max-steps: invalid int value: 'ten'; `memfit train text-classification --help`"),
    Case("margin out of range", lambda t, o: mrpc(t, o, "--memfit_margin", "2"),
         r"--memfit_margin 2\.0: give a share of the budget in \[0, 1\)"),
    Case("unknown treatment", lambda t, o: mrpc(t, o, "--memfit_treatments", "recompute,swap"),
         r"--memfit_treatments 'recompute,swap': unknown treatment 'swap'; give auto or one or more of recompute, selective, offload"),
    Case("causal-lm data not JSON lines", lambda t, o: sft(t, o, train=str(MRPC / "train.tsv")),
         r"train\.tsv: causal-lm reads JSON lines"),
    Case("chat template file missing", lambda t, o: sft(t, o, "--chat_template_path", str(t / "nowhere.jinja")),
         r"--chat_template_path .*nowhere\.jinja: no such file; give a Jinja template file or a tokenizer folder"),
    Case("LoRA on modules the model lacks", lambda t, o: sft(t, o, "--use_peft", "--lora_target_modules", "foo_proj"),
         r"--lora_target_modules foo_proj: LlamaForCausalLM has no module named foo_proj; its linear layers are "
         r"down_proj gate_proj k_proj o_proj q_proj up_proj v_proj \(or give all-linear\)"),
    Case("LoRA target typo, --validation_file unread", lambda t, o: sft(
        t, o, "--use_peft", "--lora_target_modules", "foo_proj", "--validation_file", str(SFT / "prompt_completion.jsonl")),
         r"^memfit train: error: --lora_target_modules foo_proj: "),  # the notice that it is unread is not said
    Case("LoRA target typo beside a good one", lambda t, o: sft(t, o, "--use_peft", "--lora_target_modules", "q_prj", "v_proj"),
         r"--lora_target_modules q_prj v_proj: LlamaForCausalLM has no module named q_prj; its linear layers are "),
    Case("completions cut away", lambda t, o: sft(t, o, "--completion_only_loss", "--max_seq_length", "2"),
         r"no training example has a completion token to learn within --max_seq_length 2: raise it, or drop "
         r"--completion_only_loss"),
    # NOTE [Nothing to do] in memfit/cli/train.py
    Case("nothing to do", lambda t, o: [a for a in sft(t, o) if a != "--do_train"],
         r"nothing to do: add --do_train to train \(and --do_eval to evaluate\)"),
    # NOTE [Flag ranges] in memfit/cli/flags.py
    *(Case(f"--{flag} {value}", lambda t, o, flag=flag, value=value: sft(t, o, f"--{flag}", value),
           rf"--{flag} {re.escape(value)}: {give}" if "Expected" not in give else give)
      for flag, value, give in (
          ("per_device_train_batch_size", "0", "give at least 1 example per device"),
          ("per_device_eval_batch_size", "0", "give at least 1 example per device"),
          ("gradient_accumulation_steps", "0", "give at least 1 step"),
          ("max_steps", "0", "give at least 1 step, or -1 to train --num_train_epochs"),
          ("num_train_epochs", "0", "give a positive number of epochs"),
          ("learning_rate", "-0.1", "give a rate of 0 or more"),
          ("warmup_steps", "-1", "Expected value warmup_steps >= 0"),  # transformers' own check
          ("max_seq_length", "0", "give a length of at least 1 token$"),
          ("max_train_samples", "-1", "give 0 or more examples"),
      )),
    Case("--lora_alpha 0", lambda t, o: sft(t, o, "--use_peft", "--lora_alpha", "0"), r"--lora_alpha 0: give a positive alpha"),
    Case("--lora_r 0", lambda t, o: sft(t, o, "--use_peft", "--lora_r", "0"), r"--lora_r 0: the rank must be at least 1"),
    Case("--lora_dropout 1.5", lambda t, o: sft(t, o, "--use_peft", "--lora_dropout", "1.5"),
         r"--lora_dropout 1\.5: give a probability, 0 <= p < 1"),
    Case("completion-only loss on plain text", lambda t, o: sft(t, o, "--completion_only_loss", train=str(SFT / "text.jsonl")),
         r"text\.jsonl:1: plain \{\"text\"\} has no completion for --completion_only_loss to train on: drop the flag"),
    Case("example longer than the model", lambda t, o: sft(t, o, train=str(t / "long.jsonl")),
         r"training example 2 has 2,\d{3} tokens, more than the model's 2,048 positions: pass --max_seq_length 2048 "
         r"\(or less\) to truncate", {"long.jsonl": '{"text": "short"}\n' + json.dumps({"text": "word " * 2100}) + "\n"}),
    Case("--max_seq_length above the positions", lambda t, o: sft(t, o, "--max_seq_length", "4096"),
         r"--max_seq_length 4096 exceeds the model's 2,048 positions; lower it"),
    Case("unknown chat role", lambda t, o: sft(t, o, train=str(t / "chat.jsonl")),
         r"chat\.jsonl:2: \"conversations\"\[1\] has the unknown role 'narrator'; use user \(or human\), assistant",
         {"chat.jsonl": json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
          + "\n" + json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}]})}),
    Case("no assistant turn to learn", lambda t, o: sft(t, o, "--completion_only_loss", train=str(t / "chat.jsonl")),
         r"chat\.jsonl:1: --completion_only_loss trains on the assistant turns and this conversation has none "
         r"\(roles: system, user\); add one, or drop --completion_only_loss",
         {"chat.jsonl": json.dumps({"messages": [{"role": "system", "content": "be kind"}, {"role": "human", "content": "hi"}]})}),
    Case("missing local model path", lambda t, o: sft(t, o, "--model_name_or_path", str(t / "models" / "mine")),
         r"--model_name_or_path .*models/mine: no such file or folder; give a path that exists, or a hub name"),
    Case("missing local tokenizer path", lambda t, o: sft(t, o, "--tokenizer_name", "./no/such/tokenizer"),
         r"--tokenizer_name \./no/such/tokenizer: no such file or folder"),
    Case("a folder as the data file", lambda t, o: sft(t, o, train=str(t / "data")),
         r"--train_file .*data is a folder; give a data file in it", {"data/train.jsonl": '{"text": "a"}\n'}),
    Case("peer with a memfit method", lambda t, o: mrpc(t, o, "--hf_checkpoint_every_n_layers", "2"),
         r"--hf_checkpoint_every_n_layers is a peer of memfit: run it with --memfit_method none"),
    Case("oracle without budget", lambda t, o: mrpc(t, o, "--oracle"),
         r"--oracle needs a budget: set --memory_threshold GB \(or --memory_budget\)"),
    Case("unknown task", lambda t, o: ["train", "text-classfication", "--do_train"],
         r"unknown task 'text-classfication'; choose one of: multiple-choice, question-answering"),
    Case("COCO file without images", lambda t, o: [
        "train", "object-detection", "--config_name", "conditional-detr-swin-micro", "--train_dir", str(t),
        "--train_annotations", str(t / "coco.json"), "--do_train", "--output_dir", str(o), "--use_cpu"],
        r"--train_annotations .*coco\.json has no train examples for object-detection", {"coco.json": EMPTY_COCO}),
    Case("unknown command", lambda t, o: ["trian", "text-classification"],
         r"unknown command 'trian'; choose one of train, bench, report, estimate"),
    Case("report of no folder", lambda t, o: ["report", str(t / "nowhere")],
         r"nowhere is not a folder; pass the folder that holds the JSONL results"),
    Case("report of a malformed file", lambda t, o: ["report", str(t / "bench")],
         r"results\.jsonl:1: not valid JSON", {"bench/results.jsonl": "{not json\n"}),
    Case("estimate: nothing fits", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--memory_budget",
        "1000", "--advise"], r"nothing fits the budget of 1000 bytes with .*Raise --memory_budget to at least"),
    Case("estimate: nothing fits a budget in MB", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--memory_budget",
        "1MB", "--advise"], r"nothing fits the budget of 1MB \(1000000 bytes\) with .* needs [\d.]+ MB \([\d,]+ bytes\).*"
        r"Raise --memory_budget to at least [\d.]+ MB"),
    Case("estimate: malformed budget", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--memory_budget", "6XB"],
        r"--memory_budget 6XB: not a memory size"),
    Case("estimate: missing config file", lambda t, o: [
        "estimate", "--config", str(t / "none.json"), "--batch_size", "8", "--seq_length", "32"],
         r"--config .*none\.json: no such file; give the path of a config\.json"),
    Case("estimate: config not JSON", lambda t, o: [
        "estimate", "--config", str(t / "bad.json"), "--batch_size", "8", "--seq_length", "32"],
         r"--config .*bad\.json: not JSON", {"bad.json": "{model_type"}),
    Case("estimate: negative budget", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--memory_budget", "-3GB"],
         r"error: --memory_budget -3GB: a memory size cannot be negative; write e\.g\. 3GB$"),
    Case("estimate: budget in lower case", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--memory_budget", "2gib"],
         r"error: --memory_budget 2gib: the unit 'gib' is not one memfit reads .*: write 2GiB \(2\*2\*\*30 = 2147483648 bytes\)$"),
    Case("estimate: unknown flag", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "32", "--lora_rank", "8"],
         r"unknown flag --lora_rank; did you mean --lora_r\? `memfit estimate --help` lists the flags$"),
    Case("estimate: a flag cut short", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch", "8", "--seq_length", "32"],
         r"unknown flag --batch; did you mean --batch_size\?"),
    Case("report: unknown flag", lambda t, o: ["report", str(t), "--outdir", str(o)],
         r"unknown flag --outdir; did you mean --output_dir\? `memfit report --help` lists the flags$"),
    Case("estimate: zero tokens", lambda t, o: [
        "estimate", "--config", str(t / "tiny.json"), "--batch_size", "8", "--seq_length", "0"],
         r"--seq_length 0: give a whole number of at least 1"),
    Case("bench: unknown method", lambda t, o: ["bench", "--methods", "fastest", "--output_dir", str(o)],
         r"unknown method 'fastest'; choose from none, full, dynamic"),
    Case("bench: malformed budgets", lambda t, o: ["bench", "--budgets", "x", "--output_dir", str(o)],
         r"--budgets x: write GB as a number \(6\) or a range start:stop:step \(3:8:1\)"),
]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes (and every folder, as '<dir>')."""
    return {
        str(p.relative_to(folder)): "<dir>" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def _prepare(tmp: Path, case: Case) -> None:
    (tmp / "tiny.json").write_text(json.dumps(TINY_BERT))
    for name, text in case.files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)


def test_at_least_fifteen_bad_inputs():
    assert len(CASES) >= 15 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_user_error_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    _prepare(tmp_path, case)
    before = _snapshot(tmp_path)
    assert cli.main(case.argv(tmp_path, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # the one error line and nothing else: no INFO line, no warning (NOTE [Quiet until asked] in memfit/cli/__init__.py)
    errors = err.splitlines()
    assert len(errors) == 1 and re.match(r"memfit( \w+)*( [\w-]+)?: error: ", errors[0]), err
    assert re.search(case.message, errors[0]), errors[0]
    assert _snapshot(tmp_path) == before  # no records, no summary, no --output_dir, earlier files untouched


def test_first_budget_error_states_the_whole_need(tmp_path, capsys):
    """Weights and gradients fit, AdamW's two states do not: the first error says so, with every byte."""
    model = BertForSequenceClassification(BertConfig(**TINY_BERT, num_labels=2))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    case = CASES[0]
    _prepare(tmp_path, case)
    argv = mrpc(tmp_path, tmp_path / "out", "--memory_budget", str(3 * weights), "--optim", "adamw_torch")
    assert cli.main(argv) == 2
    message = capsys.readouterr().err
    from memfit.engine.parts.optim_state import expected_step_transient_bytes

    transient = expected_step_transient_bytes("adamw_torch", model.parameters())  # its step's temporaries too
    assert f"({4 * weights + transient} bytes: parameters" in message
    assert f"optimizer state (adamw_torch, expected) {2 * weights / 2**20:.1f} MiB" in message
    assert f"optimizer step temporaries {transient / 2**20:.1f} MiB" in message
    assert not (tmp_path / "out").exists()


def _console(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cli.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "memfit.cli", *argv], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_console_process_prints_one_line_and_debug_a_traceback(tmp_path):
    _prepare(tmp_path, CASES[0])
    argv = mrpc(tmp_path, tmp_path / "out", "--memory_budget", "1MB")
    plain = _console(argv)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    # the one line, no INFO line before it (NOTE [Quiet until asked] in memfit/cli/said.py)
    (line,) = plain.stderr.strip().splitlines()
    assert line.startswith("memfit train: error: memory budget 1MB (1000000 bytes)")
    debug = _console(["--debug", *argv])
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "BudgetTooSmallError: memory budget" in debug.stderr
    assert not (tmp_path / "out").exists()


def test_debug_flag_among_a_commands_flags():
    assert cli.take_debug_flag(["train", "x", "--debug", "--do_train"]) == (["train", "x", "--do_train"], True)
    # `--debug <option>` is transformers' own flag; after `--` the flags belong to another command
    assert cli.take_debug_flag(["train", "x", "--debug", "underflow_overflow"]) == (["train", "x", "--debug", "underflow_overflow"], False)
    assert cli.take_debug_flag(["bench", "--", "--debug"]) == (["bench", "--", "--debug"], False)


def test_debug_shows_the_traceback_in_process(tmp_path):
    _prepare(tmp_path, CASES[1])
    with pytest.raises(Exception, match="--memfit_method 'fastest' is unknown") as error:
        cli.main(["--debug", *mrpc(tmp_path, tmp_path / "out", "--memfit_method", "fastest")])
    assert type(error.value).__name__ == "UnknownMethodError"


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """A ValueError from inside the code, not raised on purpose for the user, is not caught."""

    def broken(*_: object, **__: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr("memfit.tasks.text_classification.build", broken)
    _prepare(tmp_path, CASES[1])
    with pytest.raises(ValueError, match="a bug"):
        cli.main(mrpc(tmp_path, tmp_path / "out"))


def test_version(capsys):
    import memfit

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memfit {memfit.__version__}"



@pytest.mark.parametrize("flag", ["--model_name_or_path", "--tokenizer_name"])
def test_hub_name_offline_says_so_once(flag, monkeypatch, tmp_path, capsys):
    """A hub name that cannot load offline: one line naming HF_HUB_OFFLINE and a local folder, not the wrong flag."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli.main(sft(tmp_path, tmp_path / "out", flag, "no-such-org/no-such-model")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"{flag} no-such-org/no-such-model: cannot load (it|its tokenizer) offline \(HF_HUB_OFFLINE is set, "
                     r"or the hub is out of reach\) .*give a local folder", err), err
    assert "--tokenizer_name" not in err or flag == "--tokenizer_name"
    assert not (tmp_path / "out").exists()


# NOTE [Quiet until asked] in memfit/cli/said.py
def test_verbose_prints_the_info_lines_that_a_quiet_error_leaves_out(tmp_path, capsys):
    argv = sft(tmp_path, tmp_path / "out", "--use_peft", "--lora_target_modules", "foo_proj")
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("memfit train: error: --lora_target_modules foo_proj")
    assert cli.main([*argv, "--verbose"]) == 2
    *said, error = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("memfit train: error: --lora_target_modules foo_proj")
    assert any(re.search(r" INFO memfit\.tasks\.causal_lm: no model flag: building llama-tiny", line) for line in said), said
    assert not (tmp_path / "out").exists()


def test_a_librarys_future_warning_is_said_with_verbose_only(tmp_path, monkeypatch):
    """A FutureWarning is about how memfit calls a library: nothing a user of the command can change."""
    import warnings

    from memfit.cli import train

    def resume_from(args):
        warnings.warn("a library's API changes in its next version", FutureWarning)
        return None

    monkeypatch.setattr(train, "_resume_from", resume_from)
    argv = sft(tmp_path, tmp_path / "out", "--use_peft", "--lora_target_modules", "foo_proj")
    for flags, said in (((), 0), (("--verbose",), 1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert cli.main([*argv, *flags]) == 2
        assert len([w for w in seen if issubclass(w.category, FutureWarning)]) == said, flags


def test_a_warning_before_the_first_step_is_said_when_training_starts(tmp_path, capsys):
    """Held back while the run is set up (a mistake would drop it), said once training starts."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "word " * 3000}) + "\n" + json.dumps({"text": "short"}) + "\n")
    unread = ["--validation_file", str(SFT / "prompt_completion.jsonl")]  # without --do_eval
    assert cli.main(sft(tmp_path, tmp_path / "out", "--max_seq_length", "64", *unread, train=str(data))) == 0
    err = capsys.readouterr().err
    start = err.index("memfit: method dynamic")
    warning = err.index("WARNING memfit.tasks.causal_lm: 1 of 2 training examples are longer than --max_seq_length")
    notice = err.index(f"WARNING memfit.cli.train: --validation_file {unread[1]} is not read without --do_eval")
    assert start < min(warning, notice) and max(warning, notice) < err.index("memfit: verdict:"), err


def test_said_holds_warnings_back_until_the_setup_is_done_and_drops_them_at_a_mistake(capsys):
    import logging
    import warnings

    from memfit.cli.said import Said, setup_done

    logger = logging.getLogger("memfit.tests")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Said(logging.WARNING):
            logger.warning("the hub is out of reach")
            logger.info("building a model")  # --verbose only
            warnings.warn("a library's UserWarning", UserWarning)
            assert capsys.readouterr().err == "" and not seen
            setup_done()
            assert capsys.readouterr().err.endswith("WARNING memfit.tests: the hub is out of reach\n") and len(seen) == 1
            logger.warning("an OOM replayed")  # from now on as it comes
            assert "an OOM replayed" in capsys.readouterr().err
        with Said(logging.WARNING) as said:
            logger.warning("examples truncated")
            warnings.warn("another UserWarning", UserWarning)
            said.drop()  # a user error: the one error line alone
        assert capsys.readouterr().err == "" and len(seen) == 1
    assert logging.getLogger("memfit").handlers == []  # as it was


def test_long_examples_truncated_with_one_line(tmp_path, caplog):
    """With --max_seq_length an example longer than it is cut, and one warning says how many were."""
    from memfit.cli.train import run

    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "word " * 3000}) + "\n" + json.dumps({"text": "short"}) + "\n")
    run("causal-lm", [*sft(tmp_path, tmp_path / "out", "--max_seq_length", "64", train=str(data))[2:]])
    lines = [r.getMessage() for r in caplog.records if "--max_seq_length" in r.getMessage()]
    assert lines == ["1 of 2 training examples are longer than --max_seq_length 64 tokens: truncated"]
    records = [json.loads(line) for line in (tmp_path / "out" / "memfit_steps.jsonl").read_text().splitlines()]
    assert records[0]["shape"][1] == 64
