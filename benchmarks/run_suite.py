"""Run a benchmark suite on this machine and publish ``benchmarks/results/<device>/<suite>/``.

A suite is one small file in ``benchmarks/suites/`` (its format: ``benchmarks/suites/__init__.py``).
The runner runs the suite's calls into a scratch folder (``--raw``, never committed: logs, run
folders, plans, model state), then publishes the canonical folder (``--out``):

* ``results.jsonl``: every line of every call's ``results.jsonl``, one per method × budget ×
  repeat (the schema ``memfit report`` reads), each ``steps_file`` pointing into ``runs/``;
* ``runs/<call>.<config>.steps.jsonl.gz``: the step records those lines name, compacted
  (``compact_steps``: what ``memfit report`` and ``step_sums.py`` read, times to 10 µs);
  records no line names (a DDP run's second rank, whose numbers its
  line and ``summary.md`` carry) stay in the raw folder;
* the driver outputs the suite's ``keep`` names (tables ``memfit report`` does not draw);
* ``SOURCE.md``: what ran, when, at which commit, on which device;
* ``report/``: ``memfit report``'s tables and plots of the folder.

The device folder is the CUDA device's name (``NVIDIA H200`` -> ``nvidia-h200``; memory size
and type dropped), ``-x2`` appended for a suite of two GPUs, and ``cpu`` without CUDA or for a
suite that never uses the GPU (``gpus=0``).

Usage (repository root):
    python benchmarks/run_suite.py --list
    python benchmarks/run_suite.py SUITE [--quick] [--repeats N] [--methods M ...] [--budgets B ...] [--calls NAME ...]
        [--fresh] [--out DIR] [--raw DIR]
    python benchmarks/run_suite.py SUITE --publish RAW [RAW ...] [--out DIR]

``--calls`` runs some of the suite's calls (``--list`` names them), adding to the raw folder:
a GPU session whose commands are limited in time runs a suite call by call. ``--publish``
runs nothing and publishes raw folders, merged (calls that ran on several machines).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path[:0] = [str(ROOT / "src"), str(BENCHMARKS)]

from suites import Call, Context, Suite  # noqa: E402

# Folders whose results are no measurement: memfit bench's untimed first run (NOTE [First
# process]) and the oracle's sweep.
_UNPUBLISHED_DIRS = {"prime", "sweep"}
# Folder names left out of a published step file's name (every run folder has one).
_FLATTENED_DIRS = {"runs", "steps"}


# ---------------------------------------------------------------------------------- suites


def suite_names() -> list[str]:
    return sorted(p.stem.replace("_", "-") for p in (BENCHMARKS / "suites").glob("*.py") if p.stem != "__init__")


def load(name: str):
    """The suite module ``benchmarks/suites/<name>.py`` (``-`` written ``_``)."""
    if name not in suite_names():
        raise SystemExit(f"run_suite: no suite {name!r}; suites: {', '.join(suite_names())}")
    return importlib.import_module(f"suites.{name.replace('-', '_')}")


def _cpu_quick() -> list[str]:
    """The suites whose ``--quick`` runs without CUDA."""
    return [n for n in suite_names() if not load(n).SUITE.quick_needs_cuda]


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100``: the device's name without memory size and type."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and not re.fullmatch(r"\d+gb|hbm\w*", w)]
    return "-".join(words) or "unknown"


def _machine(suite: Suite) -> dict:
    """What this machine is: CUDA or not, the device name and the folder name."""
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else _cpu_name()
    if suite.gpus == 0 or not cuda:
        slug = "cpu"
    else:
        slug = device_slug(name) + (f"-x{suite.gpus}" if suite.gpus > 1 else "")
    return {"cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0, "device": name, "slug": slug,
            "torch": torch.__version__, "python": platform.python_version()}


def _cpu_name() -> str:
    model = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def _versions() -> dict:
    try:
        import transformers

        return {"transformers": transformers.__version__}
    except ImportError:
        return {}


def _commit() -> str:
    """The code as a call starts it, for SOURCE.md (NOTE [What tree_clean counts], provenance.py)."""
    from memfit.tools.bench.provenance import code_version

    version = code_version(ROOT)
    return (version["commit"] or "unknown") + (" with uncommitted changes" if version["tree_clean"] is False else "")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------------------------- running


def _environment(raw: Path, suite: Suite) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(BENCHMARKS)]
    wheels = sorted((ROOT / ".carry" / "wheels").glob("*.whl")) if "wheels" in suite.carry else []
    if wheels:  # an offline machine: the carried peers, installed apart (benchmarks/carry.sh wheels)
        site = raw / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                        *map(str, wheels)], check=False)
        paths.append(str(site))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # As `memfit train` and `memfit bench` set it: a hard cap is otherwise partly lost to fragmentation.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _run_call(call: Call, raw: Path, env: dict[str, str]) -> dict:
    from memfit.tools.bench.provenance import CALL_ENV

    folder = raw / call.out
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{call.name}.log"
    started, t0, rc = _now(), time.perf_counter(), 0
    with open(log_path, "a", encoding="utf-8") as log:
        for command in call.commands:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            print(f"[{call.name}] {' '.join(command)}", flush=True)
            # the drivers write the call's name into each line (memfit.tools.bench.provenance)
            proc = subprocess.Popen(command, cwd=ROOT, env={**env, **call.env, CALL_ENV: call.name},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
            timer = threading.Timer(call.timeout_s, proc.kill) if call.timeout_s else None
            if timer:
                timer.start()
            for line in proc.stdout:  # the driver's output, to the terminal and the call's log
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
            if timer:
                timer.cancel()
            if rc != 0:
                log.write(f"exit {rc}\n")
                break
    info = {"name": call.name, "folder": call.out, "commands": [list(c) for c in call.commands], "exit": rc,
            "started": started, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"[{call.name}] exit {rc} after {info['seconds']:.0f} s (log: {log_path})", flush=True)
    return info


def run(module, suite: Suite, machine: dict, raw: Path, names: list[str] | None, quick: bool, fresh: bool) -> None:
    ctx = Context(raw=raw, quick=quick, cuda=machine["cuda"])
    if fresh and raw.exists():
        shutil.rmtree(raw)
    raw.mkdir(parents=True, exist_ok=True)
    calls = module.calls(suite, ctx)
    known = [c.name for c in calls]
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"run_suite: {suite.name} has no call {', '.join(unknown)}; its calls: {', '.join(known)}")
        calls = [c for c in calls if c.name in names]
    markers = raw / ".calls"
    done = [c.name for c in calls if (markers / f"{c.name}.json").exists()]
    if done:
        raise SystemExit(f"run_suite: {', '.join(done)} already ran into {raw}; pass --fresh to start over, "
                         "or another --raw")
    env = _environment(raw, suite)
    markers.mkdir(exist_ok=True)
    for call in calls:
        commit = _commit()  # the code as the call starts it
        info = {**_run_call(call, raw, env), "commit": commit, **machine, **_versions()}
        (markers / f"{call.name}.json").write_text(json.dumps(info, indent=1), encoding="utf-8")


# ---------------------------------------------------------------------------------- publishing


def _step_defaults() -> dict:
    from memfit.engine.records import StepRecord

    out = {}
    for f in dataclasses.fields(StepRecord):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


#: Step-record fields that neither memfit report, step_sums.py nor model_replay.py (which reads ``static_bytes``)
#: reads: left out when published.
UNREAD_STEP_FIELDS = ("saved_activation_bytes", "planned", "backstop_input_bytes")
#: Decimals kept of the step records' times: 10 µs of a step (report prints 100 µs), 0.1 µs of the planner.
STEP_DECIMALS = {"step_ms": 2, "recompute_ms_est": 2, "planner_us": 1}


def compact_steps(src: Path, dst: Path) -> int:
    """Copy step records from ``src`` (JSONL, gzipped or not) to ``dst`` (gzipped); returns their number.

    Left out: every field equal to its ``StepRecord`` default (``StepRecord.from_dict`` fills it
    back in) and :data:`UNREAD_STEP_FIELDS`; times are rounded to :data:`STEP_DECIMALS`. What
    ``memfit report`` draws from the result is the same but for the last printed digit of a
    median at a rounding edge. The gzip header carries no time: the same records give the same bytes.
    """
    from memfit.engine.records import read_jsonl

    defaults = _step_defaults()
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(dst, "wb") as raw_fh, gzip.GzipFile(filename="", mode="wb", fileobj=raw_fh, mtime=0) as fh:
        for record in read_jsonl(src):
            kept = {k: v for k, v in record.items()
                    if k not in UNREAD_STEP_FIELDS and (k not in defaults or v != defaults[k])}
            for k, decimals in STEP_DECIMALS.items():
                if isinstance(kept.get(k), float):
                    kept[k] = round(kept[k], decimals)
            fh.write((json.dumps(kept, separators=(",", ":")) + "\n").encode("utf-8"))
            n += 1
    return n


def _published_name(step_file: Path, root: Path, prefix: tuple[str, ...]) -> Path:
    """``runs/<call>.<config>.steps.jsonl.gz`` for a raw step file: its folders under the raw
    folder joined by dots (one flat folder: each folder costs a disk block)."""
    parts = step_file.relative_to(root).parts
    dirs, name = [d for d in parts[:-1]], parts[-1]
    name = re.sub(r"\.jsonl(\.gz)?$", "", name)
    if name.startswith("memfit_steps"):  # memfit train's layout: the run's folder names it
        name = dirs.pop() + name[len("memfit_steps"):]
    dirs = [d for d in dirs if d not in _FLATTENED_DIRS]
    return Path("runs", ".".join([*prefix, *dirs, name]) + ".steps.jsonl.gz")


def _is_unpublished(path: Path, root: Path) -> bool:
    return bool(_UNPUBLISHED_DIRS & set(path.relative_to(root).parts[:-1]))


def _resolve(path: Path) -> Path | None:
    """The step file a result names, gzipped after the run or not."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def publish(suite: Suite, raws: list[Path], out: Path) -> dict:
    """Publish the raw folders ``raws`` (merged) as the canonical folder ``out``; returns counts."""
    if out.exists():
        if any(out.iterdir()) and not ((out / "results.jsonl").exists() or (out / "SOURCE.md").exists()):
            raise SystemExit(f"run_suite: {out} holds files that no publish wrote; give an empty or a results folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    labels = [()] if len(raws) == 1 else [(raw.name if [r.name for r in raws].count(raw.name) == 1 else f"{raw.name}-{i}",)
                                           for i, raw in enumerate(raws)]
    lines, published, names = [], {}, set()

    def place(step_file: Path, root: Path, prefix: tuple[str, ...]) -> str:
        name = _published_name(step_file, root, prefix)
        stem, n = name.name.removesuffix(".steps.jsonl.gz"), 2
        while name in names:  # never expected; a collision must not overwrite a run
            name, n = name.with_name(f"{stem}-{n}.steps.jsonl.gz"), n + 1
        names.add(name)
        compact_steps(step_file, out / name)
        published[step_file.resolve()] = name.as_posix()
        return name.as_posix()

    for raw, prefix in zip(raws, labels):
        for results in sorted(raw.rglob("results.jsonl")):
            if _is_unpublished(results, raw):
                continue
            for text in results.read_text(encoding="utf-8").splitlines():
                if not text.strip():
                    continue
                line = json.loads(text)
                target = _resolve(results.parent / line["steps_file"]) if line.get("steps_file") else None
                line.pop("steps_file", None)
                if target is not None:
                    line["steps_file"] = published.get(target.resolve()) or place(target, raw, prefix)
                lines.append(line)
        for pattern in suite.keep:
            for call_dir in sorted(p for p in raw.iterdir() if p.is_dir() and p.name not in {".calls", "site"}):
                for kept in sorted(call_dir.glob(pattern)):
                    target = out / prefix[0] / kept.relative_to(call_dir) if prefix else out / kept.relative_to(call_dir)
                    if target.exists():
                        raise SystemExit(f"run_suite: two calls write {kept.relative_to(call_dir)}; make the names distinct")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(kept, target)
    if lines:
        with open(out / "results.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in lines)
    return {"results": len(lines), "step_files": len(names)}


def _source(suite: Suite, raws: list[Path], out: Path, argv: list[str]) -> None:
    """``SOURCE.md``: what ran, when, at which commit, on which device (from each call's marker)."""
    calls = sorted((json.loads(p.read_text()) for raw in raws for p in (raw / ".calls").glob("*.json")),
                   key=lambda c: (c["started"], c["name"]))
    lines = [f"# {suite.name}", "", f"{suite.about}.", "",
             f"Suite: `benchmarks/suites/{suite.name.replace('-', '_')}.py`. Published by "
             f"`python benchmarks/run_suite.py {' '.join(argv)}` on {_now()}.", ""]
    if calls:
        lines += ["| call | started | seconds | exit | commit | device | torch | transformers |",
                  "| --- | --- | ---: | ---: | --- | --- | --- | --- |"]
        lines += [f"| {c['name']} | {c['started']} | {c['seconds']:.0f} | {c['exit']} | {c.get('commit', '?')} | "
                  f"{c.get('device', '?')} | {c.get('torch', '?')} | {c.get('transformers', '?')} |" for c in calls]
        lines += ["", "Commands, per call:", ""]
        for c in calls:
            lines += [f"- {c['name']}:", *(f"  `{' '.join(map(str, command))}`" for command in c.get("commands", []))]
    else:
        lines.append("No call markers in the raw folders: say here what ran, when, at which commit and where.")
    lines += ["", "Raw outputs (logs, run folders, plans, model state) stayed in "
              + ", ".join(f"`{os.path.relpath(r, ROOT)}`" for r in raws) + "; they are not committed."]
    (out / "SOURCE.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def report(out: Path) -> int:
    """``memfit report out --output_dir out/report``."""
    from memfit.tools.report import main as report_main

    return report_main([str(out), "--output_dir", str(out / "report")])


# ---------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="?", help="suite name (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the suites and their calls")
    p.add_argument("--quick", action="store_true", help="the suite's tiny QUICK version: checks the path (CPU where "
                   "its drivers allow), measures nothing; default --out and --raw under runs/quick")
    p.add_argument("--repeats", type=int, help="override the suite's repeats")
    p.add_argument("--methods", nargs="+", help="override the suite's methods (a rerun of some of them)")
    p.add_argument("--budgets", nargs="+", type=float, help="override the suite's budgets (a suite with one list of "
                   "budgets for all its calls)")
    p.add_argument("--calls", nargs="+", metavar="NAME", help="run only these calls, adding to --raw")
    p.add_argument("--fresh", action="store_true", help="empty --raw first")
    p.add_argument("--out", type=Path, help="published folder (default benchmarks/results/<device>/<suite>)")
    p.add_argument("--raw", type=Path, help="scratch folder of the calls (default runs/raw/<device>/<suite>)")
    p.add_argument("--publish", type=Path, nargs="+", metavar="RAW", help="run nothing: publish these raw folders, merged")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.list:
        for name in suite_names():
            module = load(name)
            ctx = Context(raw=ROOT / "runs" / "raw" / "list", quick=False, cuda=True)  # the calls of a GPU run
            print(f"{name}: {module.SUITE.about}\n  calls: {', '.join(c.name for c in module.calls(module.SUITE, ctx))}")
        return 0
    if not args.suite:
        _parser().error("give a suite name (--list shows them)")
    module = load(args.suite)
    suite = module.SUITE
    if args.quick:
        suite = getattr(module, "QUICK", suite)
    if args.repeats:
        suite = suite.replace(repeats=args.repeats)
    if args.methods:
        suite = suite.replace(methods=tuple(args.methods))
    if args.budgets:
        if isinstance(suite.budgets, dict):
            raise SystemExit(f"run_suite: {suite.name} has budgets per call; choose its calls with --calls")
        suite = suite.replace(budgets=tuple(args.budgets))
    quick = ROOT / "runs" / "quick"
    raws = args.publish
    if raws:  # the device is the one the calls ran on
        slugs = {json.loads(m.read_text())["slug"] for raw in raws for m in (raw / ".calls").glob("*.json")}
        if len(slugs) != 1 and not args.out:
            raise SystemExit(f"run_suite: the raw folders ran on {', '.join(sorted(slugs)) or 'unknown devices'}; give --out")
        slug = slugs.pop() if len(slugs) == 1 else None
    else:
        machine = _machine(suite)
        slug = machine["slug"]
        if suite.needs_cuda and not machine["cuda"] and (not args.quick or suite.quick_needs_cuda):
            raise SystemExit(f"run_suite: {suite.name} needs CUDA" + (
                f" (its scripts run on a CUDA device only, --quick too; on CPU, --quick checks {', '.join(_cpu_quick())})"
                if suite.quick_needs_cuda else " (--quick checks its path here)"))
        if suite.gpus > 1 and machine["gpus"] < suite.gpus and not args.quick:
            raise SystemExit(f"run_suite: {suite.name} needs {suite.gpus} GPUs, this machine has {machine['gpus']}")
        raw = args.raw or (quick / "raw" if args.quick else ROOT / "runs" / "raw") / slug / suite.name
        run(module, suite, machine, raw.resolve(), args.calls, args.quick, args.fresh)
        raws = [raw]
    out = args.out or (quick if args.quick else BENCHMARKS / "results") / slug / suite.name
    raws = [r.resolve() for r in raws]
    counts = publish(suite, raws, out)
    _source(suite, raws, out, argv)
    print(f"published {counts['results']} results and {counts['step_files']} step files to {out}", flush=True)
    if suite.report and (counts["results"] or counts["step_files"]):
        return report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
