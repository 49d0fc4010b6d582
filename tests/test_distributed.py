"""memfit under DDP: 2 CPU processes (torchrun, gloo), ranks checkpointing different blocks."""

import json
import os
import signal
import statistics
import subprocess
import sys

import pytest
import torch

import memfit
from _ddp_common import LENGTHS, STEPS, batch, build_model

HERE = os.path.dirname(__file__)


def _torchrun(script, args, port, timeout_s=240, nodes=1):
    """Run ``script`` on 2 CPU ranks; a run past ``timeout_s`` (a hang) kills every rank and fails. With ``nodes=2``
    the two ranks are two node ranks on this host (two torchrun agents, one rank each, meeting at a c10d rendezvous on
    localhost, as several machines would: docs/distributed.md); the return code is the first non-zero of the two."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    if nodes == 1:
        launches = [["--nproc_per_node", "2", "--master_port", str(port)]]
    else:
        launches = [["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                     f"127.0.0.1:{port}", "--rdzv_id", f"memfit-{port}"]] * 2
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, os.path.join(HERE, script),
                               *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for launch in launches]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        output = "".join(proc.communicate()[0] or "" for proc in procs)
        pytest.fail(f"{script} {args} hung for {timeout_s} s:\n{output[-3000:]}")
    return next((p.returncode for p in procs if p.returncode), 0), "".join(outputs)


def _budget():
    """A logical budget that rank 1's long inputs exceed without checkpointing, rank 0's do not."""
    model = build_model()
    ctl = memfit.fit(model, budget=None, method="none")
    model(**batch(0, 1, max(LENGTHS[1]))).loss.backward()
    peak_long = ctl.records[-1].peak_allocated_bytes
    model.zero_grad(set_to_none=True)
    model(**batch(0, 0, max(LENGTHS[0]))).loss.backward()
    peak_short = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return (peak_short + peak_long) // 2


def _saved_run(folder, name: str, rank: int):
    """A worker's saved weights and its info (``<name>.rank<rank>.pt`` and ``.json``)."""
    return torch.load(folder / f"{name}.rank{rank}.pt"), json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sharding, port", [("ddp", 29517), ("fsdp", 29521)])
def test_two_ranks_match_single_process(tmp_path, sharding, port):
    budget = _budget()
    returncode, output = _torchrun("_ddp_worker.py", [tmp_path, budget, sharding], port=port)
    assert returncode == 0, output[-3000:]

    # Per-rank records: each rank planned for its own shapes.
    records = {r: [json.loads(x) for x in open(tmp_path / f"steps.rank{r}.jsonl")] for r in (0, 1)}
    assert all(rec["rank"] == r for r in (0, 1) for rec in records[r])
    steady = [(a["n_checkpointed"], b["n_checkpointed"]) for a, b in zip(records[0], records[1]) if a["phase"] == b["phase"] == "steady"]
    assert steady and all(a == 0 for a, _ in steady) and any(b > 0 for _, b in steady), "the ranks should checkpoint differently"
    assert all(rec["peak_allocated_bytes"] <= budget for r in (0, 1) for rec in records[r])
    unsharded = sum(memfit.engine.parts.accounting.static_bytes_logical(build_model(), None).values())
    statics = {rec["static_bytes"] for r in (0, 1) for rec in records[r]}
    # Under FSDP each rank counts its shards of the parameters and gradients: about half.
    assert statics == {unsharded} if sharding == "ddp" else max(statics) < 0.6 * unsharded

    # The same global batches in one process: average the two ranks' gradients, then step.
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for rank in (0, 1):
            torch.manual_seed(1000 * step + rank)
            (model(**batch(step, rank, LENGTHS[rank][step])).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    final = torch.load(tmp_path / "final.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_trainer_under_torchrun_writes_per_rank_records(tmp_path):
    returncode, output = _torchrun("_ddp_trainer_worker.py", [tmp_path], port=29518)
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):
        lines = [json.loads(x) for x in open(tmp_path / f"memfit_steps.rank{rank}.jsonl")]
        assert len(lines) == 4 and {x["rank"] for x in lines} == {rank}
    summary = json.loads((tmp_path / "memfit_summary.json").read_text())
    assert summary["steps"] == 8 and set(summary["per_rank"]) == {"0", "1"}
    assert summary["max_peak_allocated_bytes"] == max(s["max_peak_allocated_bytes"] for s in summary["per_rank"].values())


@pytest.mark.slow
def test_oom_on_one_rank_is_replayed_in_lockstep(tmp_path):
    """Rank 1 runs out of memory in a forward or a backward (accumulation 1 and 2): no hang,
    and both ranks end with the weights of the run without the OOM (NOTE [Lockstep under DDP])."""
    from _ddp_oom_worker import SCENARIOS

    returncode, output = _torchrun("_ddp_oom_worker.py", [tmp_path, "runs"], port=29519)
    assert returncode == 0, output[-3000:]

    def load(name, rank):
        return _saved_run(tmp_path, name, rank)

    def assert_same(a, b, context):
        for key, value in a.items():
            torch.testing.assert_close(b[key], value, rtol=0, atol=0, msg=lambda m: f"{context} {key}: {m}")

    clean = {acc: [load(f"clean-{acc}", rank) for rank in (0, 1)] for acc in (1, 2)}
    steady = [(a["n_checkpointed"], b["n_checkpointed"]) for a, b in zip(clean[1][0][1]["records"], clean[1][1][1]["records"])
              if a["phase"] == b["phase"] == "steady"]
    assert steady and all(a == 0 for a, _ in steady) and any(b > 0 for _, b in steady), "the ranks should checkpoint differently"
    for name, (accumulation, where, _, lockstep) in SCENARIOS.items():
        runs = [load(name, rank) for rank in (0, 1)]
        assert [info["lockstep"] for _, info in runs] == [lockstep, lockstep], name
        assert_same(runs[0][0], runs[1][0], f"{name}: rank 1 vs rank 0")
        assert_same(clean[accumulation][1][0], runs[1][0], f"{name} vs clean-{accumulation}")  # DDP's own sync included
        if where is None:
            continue
        assert runs[1][1]["fired"] == 1, name
        for rank, (_, info) in enumerate(runs):
            records, reference = info["records"], clean[accumulation][rank][1]["records"]
            assert [r["shape"] for r in records] == [r["shape"] for r in reference], f"{name}: a batch was lost or double-counted on rank {rank}"
            assert sum(r["oom_retries"] for r in records) == rank, name


@pytest.mark.slow
def test_a_rank_that_cannot_recover_stops_every_rank(tmp_path):
    """Rank 1 runs out of memory at every forward: it raises, rank 0 (waiting at the
    gradient sync) is stopped by torchrun, and the job ends instead of hanging."""
    returncode, output = _torchrun("_ddp_oom_worker.py", [tmp_path, "fail"], port=29520, timeout_s=120)
    assert returncode != 0
    assert "BudgetTooSmallError: still out of memory after 8 replays" in output


def test_gradient_sync_packs_buckets_and_restores_every_gradient(tmp_path):
    """One rank: the sync must give every gradient back unchanged, through full and partial
    buckets, in place for gradients larger than a bucket, and zeros where there was none."""
    import torch.distributed as dist

    from memfit.integrations.distributed import GradientSync

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 40, 2, 7)] + [torch.nn.Parameter(torch.randn(4, 4).double())]
        frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        for p in params[:3] + params[4:]:
            p.grad = torch.randn_like(p)
        expected = [None if p.grad is None else p.grad.clone() for p in params]
        buffer = torch.arange(4.0)
        sync = GradientSync(params + [frozen], buffers=[buffer], bucket_bytes=8 * 4)  # 8 float32 per bucket
        sync.sync()
        for p, want in zip(params, expected):
            torch.testing.assert_close(p.grad, torch.zeros_like(p) if want is None else want, rtol=0, atol=0)
        assert frozen.grad is None
        torch.testing.assert_close(buffer, torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_on_the_host_over_a_gloo_group_of_their_own(tmp_path):
    """NOTE [The ranks' agreement on the host]: where the default group's backend reduces no host tensors, the flag
    is reduced over one gloo group made at the first agreement (a device flag would need CUDA here), with it the ranks'
    largest step shape (NOTE [A retry beside no clean step of its bucket])."""
    returncode, output = _torchrun("_agreement_worker.py", [tmp_path], port=29541)
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"agreement.rank{rank}.json").read_text())
        assert got == {"results": [True, False, True], "made": ["gloo"], "keys": [None, [3, 300], [4, 50]]}


@pytest.mark.parametrize("local, expected", [("1", True), ("2", False), ("", False), (None, False)])
def test_the_ranks_agree_on_the_host_only_where_every_rank_is_on_one(monkeypatch, local, expected):
    """NOTE [The ranks' agreement on the host]: a gloo group is made only where torchrun's LOCAL_WORLD_SIZE is the
    world's size (one process here: a world of 1); unset or smaller, the device all-reduce is kept."""
    from memfit.engine import ranks

    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert ranks._one_host() is expected


def test_the_ranks_agreement_uses_the_default_group_where_it_reduces_host_tensors(tmp_path, monkeypatch):
    import torch.distributed as dist

    from memfit.engine.ranks import Agreement

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("a group was made beside gloo's default one"))
        agreement = Agreement()
        assert [agreement.any(True), agreement.any(False)] == [True, False]
    finally:
        dist.destroy_process_group()


def test_the_collective_wait_is_read_only_for_a_model_sharded_over_several_ranks():
    """NOTE [The collective wait]: one process, no process group: nothing is timed and every record says None."""
    from memfit.engine.run.collectives import CollectiveWait

    model = build_model()
    assert CollectiveWait(model, torch.device("cpu")).take(0.0) is None
    ctl = memfit.fit(model, budget="1GB", announce=False)
    b = batch(0, 0, 8)
    ctl.run_step(lambda: model(**b).loss.backward())
    assert [r.collective_wait_ms for r in ctl.records] == [None]
    ctl.remove()


def test_fit_before_fully_shard_is_a_clear_error(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_model()
        ctl = memfit.fit(model, budget=None, method="dynamic")
        fully_shard(model)
        with pytest.raises(RuntimeError, match="call memfit.fit after fully_shard"):
            model(**batch(0, 0, 8))
        ctl.remove()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_fsdp_oom_in_a_block_on_one_rank_is_replayed_by_every_rank(tmp_path, nodes):
    """FSDP2, two gloo ranks, plain loop with run_step: rank 1 runs out of memory inside a
    block's forward (accumulation 1 and 2). No hang, one record per micro-step on each rank,
    the failed attempt recorded on rank 1, and both ranks end with the weights of the run
    without the OOM, bitwise (NOTE [Replay under FSDP]). The same with the ranks on two nodes
    (two node ranks on this host, a c10d rendezvous on localhost)."""
    returncode, output = _torchrun("_fsdp_oom_worker.py", [tmp_path, _budget()], port=29523 + 40 * (nodes - 1), nodes=nodes)
    assert returncode == 0, output[-3000:]

    def load(name, rank):
        return _saved_run(tmp_path, name, rank)

    for accumulation in (1, 2):
        for rank in (0, 1):
            clean, clean_info = load(f"clean-{accumulation}", rank)
            failed, info = load(f"forward-{accumulation}", rank)
            assert clean_info["fired"] == 0 and info["fired"] == (rank == 1)
            assert len(info["records"]) == len(clean_info["records"]) == STEPS
            attempts = [r["oom_attempts"] for r in info["records"] if r["oom_attempts"]]
            assert len(attempts) == (rank == 1), attempts  # the other rank replayed without a failed attempt
            # noted when it was raised: in the forward, where the step then ran on under recompute
            assert [a["stage"] for at in attempts for a in at] == ["forward"] * (rank == 1), attempts
            for key, value in clean.items():
                torch.testing.assert_close(failed[key], value, rtol=0, atol=0, msg=lambda m: f"{accumulation} {rank} {key}: {m}")
    # NOTE [The collective wait]: every record holds its step's wait on the all-gathers; where rank 1 sleeps inside a
    # block, rank 0 waits for it at the next gather, about as long
    waits = {rank: [r["collective_wait_ms"] for r in load("slow-1", rank)[1]["records"]] for rank in (0, 1)}
    assert all(w is not None and w >= 0 for ws in waits.values() for w in ws), waits
    slept_ms = 1e3 * 0.05
    assert statistics.median(waits[0]) - statistics.median(waits[1]) >= 0.6 * slept_ms, waits


@pytest.mark.slow
def test_trainer_under_accelerate_fsdp2_hooks_after_sharding_and_replays_an_oom_on_every_rank(tmp_path):
    """The memfit Trainer with --fsdp and fsdp_version 2, two gloo ranks: memfit hooks the blocks
    Accelerate sharded, each rank counts its own shards, and an OOM in a block's forward on rank 1
    (accumulation 1 and 2) is replayed by both ranks to the weights of the run without it, bitwise,
    with one record per micro-step (NOTE [Hooked after sharding] in memfit/integrations/hf.py)."""
    returncode, output = _torchrun("_fsdp_trainer_worker.py", [tmp_path, "runs"], port=29524)
    assert returncode == 0, output[-3000:]
    counted = memfit.engine.parts.accounting.static_bytes_logical(build_model(), None)
    # weights, gradients and AdamW's two moments (the state to come is static: NOTE [Static at the step's peak])
    unsharded = counted["parameters"] + counted["gradients"] + 2 * counted["parameters"]

    def load(name, rank):
        return _saved_run(tmp_path, name, rank)

    for accumulation in (1, 2):
        for rank in (0, 1):
            clean, clean_info = load(f"clean-{accumulation}", rank)
            failed, info = load(f"forward-{accumulation}", rank)
            assert set(info["blocks"]) == {"FSDPBertLayer"}, "memfit hooked the model before Accelerate sharded it"
            assert info["fired"] == (rank == 1)
            assert [r["shape"] for r in info["records"]] == [r["shape"] for r in clean_info["records"]], "a batch was lost or doubled"
            assert sum(r["oom_retries"] for r in info["records"]) == (rank == 1)
            # weights, gradients and optimizer state counted per rank: this rank's shards
            assert info["records"][0]["static_bytes"] < 0.6 * unsharded
            assert all(r["collective_wait_ms"] is not None for r in info["records"])  # NOTE [The collective wait]
            for key, value in clean.items():
                torch.testing.assert_close(failed[key], value, rtol=0, atol=0, msg=lambda m: f"{accumulation} {rank} {key}: {m}")


@pytest.mark.slow
def test_trainer_under_fsdp2_stops_every_rank_with_a_clear_error_for_an_oom_in_a_backward(tmp_path):
    """An OOM in a backward cannot be replayed in step with the other ranks: one clear error on the
    rank that hit it, and torchrun stops the others instead of hanging (NOTE [Replay under FSDP])."""
    returncode, output = _torchrun("_fsdp_trainer_worker.py", [tmp_path, "backward"], port=29525, timeout_s=180)
    assert returncode != 0
    assert "cannot be replayed in step with the other ranks" in output and "raise --memory_budget" in output


@pytest.mark.slow
@pytest.mark.parametrize("wrap, port", [("root", 29526), ("unit", 29528)])
def test_fsdp2_plans_the_lm_head_per_rank_and_matches_one_process(tmp_path, wrap, port):
    """FSDP2, two gloo ranks, ``dynamic`` with the head planned (the default), ``lm_head`` in the
    root's unit or in one of its own (as Accelerate shards it: NOTE [The head as its own FSDP
    unit]): the rank of short batches keeps the head, the rank of long ones chunks it (its logits
    never whole), no rank waits on the other, no step over the budget, and the final weights equal
    one process training on both ranks' batches without memfit within float32 tolerance (chunking
    reorders the loss's additions)."""
    from _head_common import HEAD_LENGTHS, head_batch, head_model

    budget = 6_000_000
    returncode, output = _torchrun("_fsdp_head_worker.py", [tmp_path, budget, "plain", wrap], port=port)
    assert returncode == 0, output[-3000:]
    records = {r: [json.loads(x) for x in open(tmp_path / f"steps.rank{r}.jsonl")] for r in (0, 1)}
    steady = {r: [rec["treatments"]["head"] for rec in records[r] if rec["phase"] == "steady"] for r in (0, 1)}
    assert "keep" in steady[0] and steady[1] and all(h.startswith("chunked:") for h in steady[1]), steady
    assert any(a != b for a, b in zip(steady[0], steady[1])), steady  # the ranks treat the head differently in a step
    assert all(rec["peak_allocated_bytes"] <= budget for r in (0, 1) for rec in records[r])

    model = head_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(len(HEAD_LENGTHS[0])):
        for rank in (0, 1):
            torch.manual_seed(1000 * step + rank)
            (model(**head_batch(step, rank, HEAD_LENGTHS[rank][step])).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    final = torch.load(tmp_path / "final.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("wrap, port", [("root", 29527), ("unit", 29529)])
def test_fsdp2_oom_in_the_planned_head_on_one_rank_is_replayed_by_every_rank(tmp_path, wrap, port):
    """FSDP2, two gloo ranks, ``ctl.run_step``: an OOM in rank 1's LM head (after its last block) no
    longer stops the run: the head's loss is computed again in its most chunks so the step ends in
    step with rank 0, then both replay it (NOTE [Replay under FSDP]). One record per step on each
    rank, the failed attempt on rank 1's, and the final weights those of the run without the OOM
    (within float32 tolerance: the replay may chunk the head differently)."""
    returncode, output = _torchrun("_fsdp_head_worker.py", [tmp_path, 6_000_000, "oom", wrap], port=port)
    assert returncode == 0, output[-3000:]
    assert "out of memory in the LM head" in output
    for rank in (0, 1):
        clean = [json.loads(x) for x in open(tmp_path / f"steps-clean.rank{rank}.jsonl")]
        failed = [json.loads(x) for x in open(tmp_path / f"steps-oom.rank{rank}.jsonl")]
        assert [r["shape"] for r in failed] == [r["shape"] for r in clean], "a batch was lost or doubled"
        assert sum(len(r["oom_attempts"]) for r in failed) == (rank == 1)
    clean, failed = torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "oom.pt")
    for name, value in clean.items():
        torch.testing.assert_close(failed[name], value, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name, chunks, lora, port", [
    ("tiled_mlp", 1, "", 29531), ("recompute_tiled", 3, "", 29532), ("host_checkpoint_tiled", 3, "lora", 29533),
])
def test_fsdp2_blocks_run_tiled_with_the_gradients_of_fsdp_without_memfit(tmp_path, name, chunks, lora, port):
    """FSDP2 (every decoder layer and the root ``fully_shard``-ed), two gloo ranks, every block on a tiled
    treatment: the MLPs run tiled (their parameters are the ones FSDP gathered for the forward, and again for the
    backward's re-runs), and the final weights are those of FSDP without memfit: bit for bit in one chunk, within
    float32 rounding in several (NOTE [Tiled MLP])."""
    from test_tiled_mlp import TOLERANCE

    returncode, output = _torchrun("_fsdp_tiled_worker.py", [tmp_path, name, chunks, lora], port=port)
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"calls.rank{rank}.json").read_text())["tiled_calls"] >= 3 * 3  # 3 blocks, 3 steps
    plain, tiled = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "tiled.pt")
    tolerance = dict(rtol=0, atol=0) if chunks == 1 else TOLERANCE
    assert plain.keys() == tiled.keys()
    for key, value in plain.items():
        torch.testing.assert_close(tiled[key], value, **tolerance, msg=lambda m: f"{name} {key}: {m}")


def test_the_collective_wait_keeps_a_bounded_list_and_waits_for_no_device(monkeypatch):
    """NOTE [The collective wait]: the timed calls a step keeps are at most MAX_EVENTS, whatever the calls between two
    records; a record takes the calls done (on CUDA those the device reached, the rest kept for the next), and the
    calls before a replayed step's start are dropped."""
    from memfit.engine.run import collectives

    class Group:
        def unshard(self):
            return "gathered"

        def wait_for_unshard(self):
            return None

    group = Group()
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(collectives, "is_fsdp", lambda model: True)
    monkeypatch.setattr(collectives, "_param_groups", lambda model: [group])
    waits = collectives.CollectiveWait(torch.nn.Linear(2, 2), torch.device("cpu"))
    for _ in range(collectives.MAX_EVENTS + 50):
        assert group.unshard() == "gathered"
        group.wait_for_unshard()
    assert len(waits._calls) == collectives.MAX_EVENTS
    assert waits.take(0.0) >= 0.0 and waits._calls == []
    group.unshard()
    assert waits.take(float("inf")) == 0.0 and waits._calls == []  # begun before the step: dropped
    waits.remove()
    assert "unshard" not in vars(group) and "wait_for_unshard" not in vars(group)
