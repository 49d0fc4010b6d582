"""Two ranks, one budget each: bert-base under DDP with the memfit Trainer (issue #8).

``run`` (under torchrun, one process per GPU) trains one configuration: bert-base-uncased's
architecture from its config (random weights), fp32, AdamW, synthetic token ids, batch
``--batch_size`` per rank, ``--steps`` optimizer steps. Each batch has one length; rank 0's
lengths are drawn from ``--lengths0``, rank 1's from ``--lengths1`` (fixed seed: every
configuration sees the same batches), so the two ranks plan differently in the same step.
The budget is per rank (each process has its own cap). Batches are read in order and
Accelerate hands batch b to rank b % 2, which is what gives each rank its own distribution.

``summarize`` reads every configuration's files and writes ``results.jsonl`` (one line per
timed configuration, the schema ``memfit report`` reads, with the per-rank numbers beside it)
and ``summary.md`` (time relative to ``none``, per-rank peaks, OOMs, blocks recomputed, and the
``accelerate launch`` check, which times nothing comparable: 5 steps).

Files of one configuration, under ``<output_dir>/<name>/``: ``memfit_steps.rank{r}.jsonl``
(step records), ``memfit_summary.json`` (merged, with ``per_rank``), ``run.json`` (time,
flags, versions).

Usage:
    torchrun --nproc_per_node 2 benchmarks/ddp_bench.py run --output_dir OUT/dynamic-6GB \\
        --method dynamic --budget 6GB
    python benchmarks/ddp_bench.py summarize OUT
(``python benchmarks/run_suite.py ddp`` runs the matrix: benchmarks/suites/ddp.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time


def _lengths(spec: str, n: int, seed: int) -> list[int]:
    low, high = (int(x) for x in spec.split(":"))
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


class _Batches:
    """Rows in reading order: batch b (``batch_size`` rows of one length) goes to rank b % 2."""

    def __init__(self, args: argparse.Namespace, vocab: int):
        n = args.steps * args.accumulation
        self.batch_size = args.batch_size
        self.vocab = vocab
        per_rank = [_lengths(args.lengths0, n, seed=1), _lengths(args.lengths1, n, seed=2)]
        self.lengths = [per_rank[b % 2][b // 2] for b in range(2 * n)]

    def __len__(self) -> int:
        return len(self.lengths) * self.batch_size

    def __getitem__(self, i: int) -> dict:
        import torch

        b = i // self.batch_size
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(1000, self.vocab, (self.lengths[b],), generator=g), "labels": i % 2}


def _collate(rows: list[dict]) -> dict:
    import torch

    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["labels"] for r in rows])}


def _model(tiny: bool):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if tiny:
        config = BertConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128, vocab_size=2000)
    else:
        config = BertConfig()  # the defaults are bert-base-uncased's architecture
    return BertForSequenceClassification(config), config.vocab_size


def run(args: argparse.Namespace) -> None:
    import torch
    import transformers

    import memfit
    from memfit.tools.bench.matrix import warm_gpu

    if not args.tiny:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model, vocab = _model(args.tiny)
    training_args = memfit.TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=2e-5,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=max(1, args.steps // 5),
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        memory_budget=args.budget,
        memfit_method=args.method,
        memfit_lockstep=not args.ddp_sync,
        use_cpu=args.tiny,
        ddp_backend="gloo" if args.tiny else None,
    )
    trainer = memfit.Trainer(model=model, args=training_args, train_dataset=_Batches(args, vocab), data_collator=_collate)
    warm_gpu(args.gpu_warmup_s)
    t0 = time.perf_counter()
    metrics = trainer.train().metrics
    seconds = time.perf_counter() - t0
    if training_args.process_index == 0:
        info = {
            "name": os.path.basename(os.path.normpath(args.output_dir)),
            "model": "tiny BERT (config, random weights)" if args.tiny else "bert-base-uncased (config, random weights)",
            "method": args.method,
            "budget": args.budget,
            "lockstep": trainer._grad_sync is not None,
            "world_size": training_args.world_size,
            "steps": args.steps,
            "accumulation": args.accumulation,
            "batch_size": args.batch_size,
            "lengths": [args.lengths0, args.lengths1],
            "train_seconds": seconds,
            "train_runtime": metrics.get("train_runtime"),
            "train_loss": metrics.get("train_loss"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        with open(os.path.join(args.output_dir, "run.json"), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)


def _steady_step_ms(path: str) -> float | None:
    from memfit.engine.records import read_jsonl

    ms = [r["step_ms"] for r in read_jsonl(path) if r["phase"] == "steady" and r.get("step_ms")]
    return statistics.median(ms) if ms else None


def summarize(out: str) -> list[dict]:
    """One row per configuration folder of ``out``; writes results.jsonl and summary.md."""
    rows = []
    for name in sorted(os.listdir(out)):
        folder = os.path.join(out, name)
        run_path, summary_path = os.path.join(folder, "run.json"), os.path.join(folder, "memfit_summary.json")
        if not os.path.isfile(run_path) or not os.path.isfile(summary_path):
            if os.path.isdir(folder) and name != "preflight":
                rows.append({"name": name, "status": "failed"})
            continue
        with open(run_path, encoding="utf-8") as fh:
            row = json.load(fh)
        with open(summary_path, encoding="utf-8") as fh:
            summary = json.load(fh)
        row["status"] = "ok"
        row["per_rank"] = {
            r: {
                "max_peak_allocated_bytes": s["max_peak_allocated_bytes"],
                "max_peak_reserved_bytes": s["max_peak_reserved_bytes"],
                "mean_checkpointed_fraction": s["mean_checkpointed_fraction"],
                "oom_retries": s["oom_retries"],
                "over_budget_steps": s["over_budget_steps"],
                "median_steady_step_ms": _steady_step_ms(os.path.join(folder, f"memfit_steps.rank{r}.jsonl")),
            }
            for r, s in sorted(summary.get("per_rank", {}).items())
        }
        row["budget_bytes"] = summary["budget_bytes"]
        row["accounting"] = summary["accounting"]
        rows.append(row)
    order = {"none": 0, "full": 1, "static": 2, "dynamic": 3}
    rows.sort(key=lambda r: (r["status"] != "ok", r.get("budget_bytes") or 0, order.get(r.get("method"), 9), not r.get("lockstep"), r["name"]))
    reference = next((r for r in rows if r.get("method") == "none" and not r.get("budget")), None)
    for r in rows:
        if r["status"] == "ok" and reference and r["steps"] == reference["steps"]:
            r["vs_none"] = r["train_seconds"] / reference["train_seconds"]
    like = next((r for r in rows if r["status"] == "ok"), {})
    with open(os.path.join(out, "results.jsonl"), "w", encoding="utf-8") as fh:
        for r in rows:
            if not r["name"].startswith("accelerate"):  # a check that the launcher works, in summary.md
                fh.write(json.dumps({**r, **_result_fields(r, like)}) + "\n")
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(_table(rows))
    return rows


def _result_fields(row: dict, like: dict) -> dict:
    """The fields `memfit report` reads (memfit.tools.report.RESULT_FIELDS) of one configuration: one
    line, both ranks together (the largest peak, the OOMs summed, the mean share recomputed)."""
    ok = row["status"] == "ok"
    src = row if ok else like
    ranks = list(row.get("per_rank", {}).values())
    return {
        "task": f"ddp, {src.get('world_size', 2)} ranks",
        "model": src.get("model", "bert-base-uncased (config, random weights)"),
        # the DDP-sync variant of a method apart: it is another configuration, not a repeat
        "method": row["method"] + ("-ddp-sync" if row["name"].endswith("-ddp-sync") else "") if ok else row["name"],
        "budget_bytes": row.get("budget_bytes"),
        "batch_size": src.get("batch_size", 0) * src.get("world_size", 2) * src.get("accumulation", 1),
        "steps": src.get("steps", 0),
        "total_s": row.get("train_seconds"),
        "max_peak_allocated_bytes": max((p["max_peak_allocated_bytes"] for p in ranks), default=None),
        "oom_count": sum(p["oom_retries"] for p in ranks),
        "recomputed_fraction": statistics.mean(p["mean_checkpointed_fraction"] for p in ranks) if ranks else None,
        "status": "ok" if ok else "error",
        "device": src.get("device"),
        "torch": src.get("torch"),
        "transformers": src.get("transformers"),
        **({"steps_file": f"{row['name']}/memfit_steps.rank0.jsonl"} if ok else {"note": "no run.json: see its log"}),
    }


def _table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "| config | method | budget (per rank) | lockstep | time (s) | vs none | rank 0 peak (GiB) | rank 1 peak (GiB) "
        "| steps over budget (r0/r1) | OOM replays (r0/r1) | blocks recomputed (r0/r1) | steady step ms (r0/r1) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | failed | | | | | | | | | | |")
            continue
        ranks = [r["per_rank"].get(k, {}) for k in ("0", "1")]
        peak = [f"{p['max_peak_allocated_bytes'] / gib:.3f}" if p else "" for p in ranks]
        over = "/".join(str(p.get("over_budget_steps", "")) for p in ranks)
        ooms = "/".join(str(p.get("oom_retries", "")) for p in ranks)
        recomputed = "/".join(f"{100 * p['mean_checkpointed_fraction']:.0f}%" if p else "" for p in ranks)
        step_ms = "/".join(f"{p['median_steady_step_ms']:.1f}" if p and p["median_steady_step_ms"] else "" for p in ranks)
        vs = f"{r['vs_none']:.2f}×" if "vs_none" in r else ""
        lines.append(
            f"| {r['name']} | {r['method']} | {r['budget'] or 'uncapped'} | {'yes' if r['lockstep'] else 'no'} "
            f"| {r['train_seconds']:.1f} | {vs} | {peak[0]} | {peak[1]} | {over} | {ooms} | {recomputed} | {step_ms} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp_bench.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one configuration (under torchrun)")
    r.add_argument("--output_dir", required=True)
    r.add_argument("--method", default="dynamic")
    r.add_argument("--budget", default=None, help="per-rank budget: 6GB (10**9 bytes), 6GiB, ...; none: uncapped")
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--batch_size", type=int, default=32)
    r.add_argument("--accumulation", type=int, default=1)
    r.add_argument("--lengths0", default="32:256", help="rank 0's lengths, uniform in LOW:HIGH")
    r.add_argument("--lengths1", default="256:512", help="rank 1's lengths, uniform in LOW:HIGH")
    r.add_argument("--ddp_sync", action="store_true", help="--memfit_lockstep False: DDP's own overlapped sync")
    r.add_argument("--gpu_warmup_s", type=float, default=2.0)
    r.add_argument("--tiny", action="store_true", help="a tiny BERT on CPU (gloo): checks the script, no timing")
    s = sub.add_parser("summarize", help="results.jsonl and summary.md from the configuration folders")
    s.add_argument("output_dir")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        if args.budget in (None, "none", ""):
            args.budget = None
        run(args)
    else:
        print(_table(summarize(args.output_dir)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
