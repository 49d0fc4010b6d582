"""Decision time per step on the CPU, on a GPU run's own memory models: each steady step decided again
(``method.decide``, the call the step records' ``planner_us`` times) on the model that planned it.

The planner is Python on the host (NOTE [Plan is fixed before forward], engine/run/controller.py), so its time on
a run's models can be measured here. ``loop_bench.py --models_every_step`` writes the model after every step
(``*.models.jsonl.gz``): step ``s`` was planned by line ``s - 2``. Each steady step is replayed in order (the
planning keeps what a run keeps between steps: the longest shape of each bucket) on a fresh copy of that model
(its curves refit inside the decision, as after a step that taught them), with the step's static bytes, the
run's LM head (Llama-shaped, on the meta device; chunked by the implementation the record names, priced free:
the probes' price lines are not in the files), the optimizer step as a part (AdamW over the config's parameters,
foreach) and a host link of ``--link_gb_s`` for the treatments it prices. Prints the median and mean µs of a
decision over ``--repeats`` passes, and how many steps' blocks and parts match their records (the head's price
and the room's learnt state are not in the files, so a few may not). ``--json`` writes every plan; ``--same_as``
checks the plans and their estimates against such a file (a change to the planner passes with 0 differing plans).

    python benchmarks/decide_replay.py STEPS.jsonl.gz MODELS.jsonl.gz --model Llama-3.2-1B --repeats 20
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

#: the treatments ``dynamic+auto`` offers a bf16 decoder with gated MLPs on a GPU (Treatment.by_default)
AUTO_ON_GPU = ("elementwise", "host_checkpoint", "tiled_mlp", "recompute_tiled", "host_checkpoint_tiled", "lean")


def _planning(config_name: str, budget_bytes: int, treatments: tuple[str, ...], link_gb_s: float):
    import torch
    import transformers as tf

    from memfit.engine.parts.head import attach_head
    from memfit.engine.parts.optimizer_step import OptimizerStepPart
    from memfit.engine.parts.probe import LinkPrice
    from memfit.engine.parts.treatments.chunked_head import HeadPart
    from memfit.engine.plan.planning import Planning
    from memfit.tasks._common import CONFIGS_DIR

    config = tf.AutoConfig.from_pretrained(CONFIGS_DIR / f"{config_name}.json")
    config.use_cache = False
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    n_blocks = int(config.num_hidden_layers)
    planning = Planning(n_blocks, [0] * n_blocks, budget_bytes, 0, 8, treatments=treatments)
    head = HeadPart(attach_head(model))
    planning.add_part(head)
    planning.add_part(OptimizerStepPart(torch.optim.AdamW(model.parameters(), foreach=True)))
    planning.price_offload(LinkPrice(link_gb_s * 1e6, link_gb_s * 1e6))
    return planning, head


def _curves(model) -> dict[tuple, Any]:
    """Every curve of a memory model by its path (``Planning.apply``'s names)."""
    out = {(name,): getattr(model, name) for name in ("outside", "transient_full", "transient_partial", "transient_parts")}
    for g, group in model.group_models.items():
        out.update({("bytes", g, name): c for name, c in group.bytes.items()})
        out.update({("ms", g, name): c for name, c in group.ms.items()})
    return out


def _as_found(model) -> Callable[[], None]:
    """What puts back the caches a decision fills, as they are now: each curve's fit and memo, the plans' layouts
    the model keeps (where it keeps them); each repeat of a decision then finds what the run's step found."""
    fitted = [(c, list(c.coef), c.shift, c._quadratic, dict(c._memo)) for c in _curves(model).values()]
    layouts = getattr(model, "layouts", None)
    made = dict(layouts._made) if layouts is not None else None

    def restore() -> None:
        for c, coef, shift, quadratic, memo in fitted:
            c.coef, c.shift, c._quadratic, c._memo = list(coef), shift, quadratic, dict(memo)
        if layouts is not None:
            layouts._made = dict(made)
    return restore


def _teach(planning, state: dict) -> None:
    """Bring the planning's model to ``state`` as the run's steps did: the new samples added to the curves that
    learnt them (the others keep their fit and memo), the optimizer's peak, the longest shape, margin and slack."""
    from memfit.engine.plan.model import MemoryModel
    from memfit.engine.plan.planning import ModelUpdate

    model, target = planning.model, MemoryModel.from_dict(state["model"], planning.registry)
    samples = []
    for path, curve in _curves(target).items():
        had = planning._curve(path)
        if curve.xs[: len(had.xs)] != had.xs:
            raise ValueError(f"{path}: the next model's samples do not extend this one's")
        samples += [(path, k, y) for k, y in zip(curve.xs[len(had.xs):], curve.ys[len(had.ys):])]
    planning.apply(ModelUpdate(samples=samples))
    room = planning.room
    now = (model.optimizer_bytes, model.max_key, room.margin_bytes, room.slack_bytes)
    model.optimizer_bytes, model.max_key = target.optimizer_bytes, target.max_key
    room.margin_bytes, room.slack_bytes = int(state["margin_bytes"]), int(state["slack_bytes"])
    if now != (model.optimizer_bytes, model.max_key, room.margin_bytes, room.slack_bytes):
        planning.cache.clear()
    if model.to_dict() != target.to_dict():
        raise ValueError("the replayed model differs from the run's")


def replay(steps: Path, models: Path, config: str, treatments: tuple[str, ...], link_gb_s: float,
           repeats: int, sweep: int = 0) -> tuple[list[float], list[dict]]:
    """Each steady step's decision, ``repeats`` times from the same state (each a cache miss): the µs of every
    decision, and per step its plan and its record's; with ``sweep``, the plans of that many other lengths of the
    step's batch size on its model too (untimed; the planning's longest shape per bucket as before them)."""
    from memfit.engine.methods import Dynamic
    from memfit.engine.parts.treatments.chunked_head import head_options

    records = [json.loads(line) for line in gzip.open(steps, "rt") if line.strip()]
    planned_by = [json.loads(line) for line in gzip.open(models, "rt") if line.strip()]
    if models.name.endswith(".model.json.gz"):  # one model (loop_bench's last): every step planned on it
        planned_by = planned_by * (max(r["step"] for r in records) - 1)
    planning, head = _planning(config, records[0]["budget_bytes"], treatments, link_gb_s)
    planning.load_state_dict(planned_by[0])
    method = Dynamic()
    method.resume()
    times, plans = [], []
    for r in records:
        if r.get("phase", "steady") != "steady" or not 0 <= r["step"] - 2 < len(planned_by):
            continue
        _teach(planning, planned_by[r["step"] - 2])
        planning.begin_step(r["static_bytes"])
        head.switch.implementation = (r.get("implementations") or {}).get("head") or r.get("head_implementation") or "pure"
        key = (r["shape"][0], r["shape"][1])
        as_found = _as_found(planning.model)
        for _ in range(repeats):
            as_found()
            planning.cache.clear()
            head_options.cache_clear()
            t0 = time.perf_counter()
            decision = method.decide(planning, key)
            times.append((time.perf_counter() - t0) * 1e6)
        plan = decision.plan
        treated = {kind: blocks for kind, blocks in plan.by_treatment().items()}
        treated.update(plan.part_labels())
        ran = {kind: value for kind, value in r["treatments"].items() if kind != "optimizer_step"}
        plans.append({"step": r["step"], "plan": treated, "cost_ms": plan.cost_ms, "saved_bytes": plan.saved_bytes,
                      "recorded": ran, "same_as_record": treated == ran})
        longest, as_decided = dict(planning.longest_in_bucket), _as_found(planning.model)
        for t in range(1, sweep + 1):
            planning.cache.clear()
            length = t * 2 * max(k[1] for k in planning.longest_in_bucket) // sweep
            swept = planning.plan_for((key[0], length))
            plans.append({"step": r["step"], "length": length, "plan": {**swept.by_treatment(), **swept.part_labels()},
                          "cost_ms": swept.cost_ms, "saved_bytes": swept.saved_bytes})
        planning.longest_in_bucket = longest
        as_decided()  # what the run's next step finds: its decision's caches, not the other lengths'
        planning.room.learn_pools(r.get("stream_pool_bytes"))  # what the step read of other streams' pools, as learnt
    return times, plans


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", type=Path, help="a run's step records (.jsonl.gz)")
    p.add_argument("models", type=Path, help="the same run's models after every step (.models.jsonl.gz), or its last "
                   "model (.model.json.gz: every step planned on it, the curves as the run ended)")
    p.add_argument("--model_config", "--model", dest="config", default="Llama-3.2-1B", help="the bundled config the run trained")
    p.add_argument("--treatments", nargs="+", default=list(AUTO_ON_GPU))
    p.add_argument("--link_gb_s", type=float, default=50.0, help="the host link's bandwidth each way, GB/s")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", type=int, default=0, help="also plan this many other lengths on each step's model "
                   "(up to twice the longest seen; untimed, for --same_as)")
    p.add_argument("--json", type=Path, help="write the times and every step's plan here")
    p.add_argument("--same_as", type=Path, help="a --json file of an earlier replay: the plans must equal its")
    args = p.parse_args(argv)
    times, plans = replay(args.steps, args.models, args.config, tuple(args.treatments), args.link_gb_s, args.repeats, args.sweep)
    stepped = [p for p in plans if "recorded" in p]
    same = sum(p["same_as_record"] for p in stepped)
    print(f"{len(stepped)} steady steps x {args.repeats}: decide() median {statistics.median(times):.0f} µs, "
          f"mean {statistics.mean(times):.0f} µs; {same} of {len(stepped)} plans as recorded"
          + (f"; {len(plans) - len(stepped)} other lengths planned" if args.sweep else ""))
    if args.json:
        args.json.write_text(json.dumps({"times_us": times, "plans": plans}, indent=1))
    if args.same_as:
        before = json.loads(args.same_as.read_text())["plans"]
        fields = ("plan", "cost_ms", "saved_bytes")  # the estimates too: the same arithmetic, the same ties
        differ = [a["step"] for a, b in zip(plans, before) if [a.get(f) for f in fields] != [b.get(f) for f in fields]]
        print(f"plans against {args.same_as}: {len(differ)} differ {differ}")
        return 1 if differ or len(before) != len(plans) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
