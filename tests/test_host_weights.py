"""The blocks' frozen weights on the host (parts/host_weights.py, NOTE [Weights on the host]) and the room they give the
plans (NOTE [The weights' room], plan/search.py): exact gradients, where the weights are during a step, what brings them
back, what is streamed, and what the plans choose; on CPU (a CUDA check at the end)."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from _models import VOCAB, FixedPlan, _text_batch, step_both_and_compare
from memfit.engine.budget import BudgetTooSmallError
from memfit.engine.parts.host_weights import WINDOW, HostWeights, frozen_storages, streamable_saving
from memfit.engine.plan.planner import Plan


def _frozen_llama(layers: int = 6, lora: bool = False, hidden: int = 32, intermediate: int = 37):
    """A tiny Llama (dropout on) whose linear layers' weights are frozen, as LoRA's base weights are (``lora``: a peft
    LoRA over it, adapters random and with dropout)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=intermediate, vocab_size=VOCAB, attention_dropout=0.1, max_position_embeddings=2000)
    model = tf.LlamaForCausalLM(cfg).train()
    if lora:
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", init_lora_weights=False)
        return peft.get_peft_model(model, config)
    for name, p in model.named_parameters():
        if "proj" in name:
            p.requires_grad_(False)
    return model


def _streaming(model, treated=(), kinds=(), count=None, treatments=("recompute", "elementwise", "host_checkpoint")):
    n = model.config.num_hidden_layers
    plan = Plan(tuple(treated), kinds=tuple(kinds), parts=(("weights", "host", n if count is None else count),))
    return memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=treatments, host_weights=True, announce=False)


@pytest.mark.parametrize("plan", [
    ((), ()), ((0, 1, 2, 3, 4, 5), ()), ((1, 2, 4), ("elementwise", "recompute", "host_checkpoint")),
])
@pytest.mark.parametrize("lora", [False, True])
def test_gradients_are_bit_for_bit_with_every_block_streamed(plan, lora):
    model = _frozen_llama(lora=lora)
    reference = copy.deepcopy(model)
    ctl = _streaming(model, *plan)
    weights: HostWeights = ctl._weights
    for step, length in enumerate((9, 30, 17)):
        step_both_and_compare(model, reference, _text_batch(2, length, "lm"), seed=step, context=f"{plan} step {step}")
        # between steps only the bottom block's weights are on the device: the others left after their backward
        assert [b.on_device for b in weights.blocks] == [True] + [False] * 5
    assert ctl.records[-1].treatments["weights"] == "host:6"
    ctl.remove()


def test_at_most_a_window_of_blocks_holds_its_weights_during_a_step():
    model = _frozen_llama(8)
    ctl = _streaming(model, count=8)
    weights: HostWeights = ctl._weights
    on, fetch, free = [], weights._fetch, weights._free

    def counted(move):
        def run(b):
            move(b)
            on.append(sum(x.on_device for x in weights.blocks))
        return run

    weights._fetch, weights._free = counted(fetch), counted(free)
    for step in range(3):  # the first starts with every block's weights on the device, and frees them as it decides
        on.clear()
        torch.manual_seed(step)
        model(**_text_batch(2, 20, "lm")).loss.backward()
        assert step == 0 or (max(on) <= WINDOW and len(on) > 8), on  # every block fetched and freed, never 3 on at once
    ctl.remove()


def test_a_short_count_streams_the_lowest_blocks_only_and_the_rest_come_back():
    model = _frozen_llama(8)
    ctl = _streaming(model, count=8)
    weights: HostWeights = ctl._weights
    torch.manual_seed(0)
    model(**_text_batch(2, 20, "lm")).loss.backward()
    assert weights.off_bytes() == sum(b.nbytes for b in weights.blocks[1:])
    ctl.method.plan = Plan((), parts=(("weights", "host", 4),))
    torch.manual_seed(1)
    model(**_text_batch(2, 20, "lm")).loss.backward()
    assert [b.on_device for b in weights.blocks] == [True, False, False, False] + [True] * 4
    assert weights.streamed_bytes() == sum(b.nbytes for b in weights.blocks[:4])
    ctl.remove()


def test_bringing_weights_back_is_priced_by_the_copies_the_blocks_below_do_not_hide():
    """NOTE [Bringing the weights back]: after a step that streamed every block (the bottom one's weights stay), the
    copies go bottom first and each block waits for its own, so what stays exposed is the copies' time beyond the
    forward of the blocks below; nothing where the option streams them, or where no link was measured."""
    model = _frozen_llama(8)
    ctl = _streaming(model, count=8)
    weights: HostWeights = ctl._weights
    model(**_text_batch(2, 20, "lm")).loss.backward()
    assert [b.on_device for b in weights.blocks] == [True] + [False] * 7
    nbytes = {b.nbytes for b in weights.blocks}
    assert len(nbytes) == 1
    weights.h2d = nbytes.pop() / 10.0  # 10 ms a block's copy
    assert weights.back_ms(0, [4.0] * 8) == pytest.approx(7 * 10 + 4 - 32)  # the last copy ends at 70 ms, its block runs
    assert weights.back_ms(4, [4.0] * 8) == pytest.approx(12.0)  # blocks 4-7 back: the last copy ends at 40 ms, 16 below
    assert weights.back_ms(8, [4.0] * 8) == 0.0 and weights.back_ms(0, [20.0] * 8) == 0.0  # streamed, or hidden
    assert weights.last == ("host", 8)
    weights.h2d = None
    assert weights.back_ms(0, [4.0] * 8) == 0.0
    ctl.remove()


def test_the_search_adds_bringing_the_weights_back_to_the_options_that_do():
    """NOTE [Bringing the weights back]: keeping the weights costs the copies back where the last step streamed them,
    so a short batch keeps streaming where that is cheaper, and keeps its weights where nothing is to bring back."""
    from types import SimpleNamespace

    from memfit.engine.plan.search import _weights

    def search(back_ms: float, stream_ms: float):
        part = SimpleNamespace(streamable=True, priced=lambda forward: [("host", 8, 1000, stream_ms)],
                               back_ms=lambda count, forward: 0.0 if count >= 8 else back_ms)
        planning = SimpleNamespace(weights=part, model=SimpleNamespace(ready=True, costs=lambda k: [1.0] * 8), budget_bytes=10**9)
        return SimpleNamespace(planning=planning, cost_with_room=lambda k, extra=0: 10.0 if extra == 0 else 0.0)

    assert _weights(search(30.0, 5.0), (1, 64)) == ("host", 8, 1000, 5.0)  # 5 against 10 + 30
    assert _weights(search(30.0, 35.0), (1, 64)) == ("host", 8, 1000, 35.0)  # 35 against 40
    assert _weights(search(0.0, 35.0), (1, 64)) is None  # nothing to bring back: 10 against 35
    assert _weights(search(20.0, 35.0), (1, 64)) is None  # 30 against 35


def test_the_plans_are_cached_per_where_the_weights_are():
    """NOTE [Bringing the weights back]: the same shape is planned anew once the weights moved (its price moved)."""
    model = _frozen_llama(8, hidden=64, intermediate=256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ctl = memfit.fit(model, budget=int(2.0 * params), method="dynamic", host_weights=True, announce=False)
    for step, n in enumerate((40, 400) * 4):
        torch.manual_seed(step)
        model(**_text_batch(2, n, "lm")).loss.backward()
        model.zero_grad(set_to_none=True)
    states = {(key[0][1], key[1][1]) for key, _ in ctl.planning.cache.items()}
    assert len(states) > len({shape for shape, _ in states}) and ("keep", 1) in {state for _, state in states}, states
    ctl.remove()


def _after_a_streamed_step():
    """A tiny frozen Llama, its copy, its controller streaming every block, and the batch of the one step both ran."""
    model = _frozen_llama()
    reference = copy.deepcopy(model)
    ctl = _streaming(model)
    batch = _text_batch(2, 12, "lm")
    step_both_and_compare(model, reference, batch, seed=0, context="the first step")
    return model, reference, ctl, batch


def test_evaluation_and_remove_bring_the_weights_back_and_a_state_dict_reads_them_on_the_host():
    model, reference, ctl, batch = _after_a_streamed_step()
    off = ctl._weights.off_bytes()
    assert off > 0
    state = model.state_dict()  # read on the host copies: nothing comes back onto the device
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items()) and ctl._weights.off_bytes() == off
    held = ctl._weights.blocks[3].held[0]
    name = next(n for n, p in model.model.layers[3].named_parameters() if p is held.params[0])
    assert state[f"model.layers.3.{name}"].untyped_storage().data_ptr() == held.host.data_ptr()
    step_both_and_compare(model, reference, batch, seed=1, context="train again")
    model.eval(), reference.eval()
    weights, on = ctl._weights, []
    hooks = [layer.register_forward_hook(lambda *_: on.append(sum(b.on_device for b in weights.blocks)))
             for layer in model.model.layers]
    with torch.no_grad():  # the weights pass through: back one block ahead, gone after their block
        assert torch.equal(model(**batch).logits, reference(**batch).logits)
    assert ctl._weights.off_bytes() == off and max(on) <= WINDOW + 1  # and the bottom block's, which stay between steps
    for h in hooks:
        h.remove()
    model.train(), reference.train()
    step_both_and_compare(model, reference, batch, seed=2, context="after eval")
    weights = ctl._weights
    ctl.remove()
    assert weights.off_bytes() == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert not any(m._forward_pre_hooks or m._forward_hooks or m._state_dict_hooks for m in model.model.layers)


def test_weights_the_cap_cannot_take_back_at_remove_stay_on_the_host_as_they_were(monkeypatch, caplog):
    model, reference, ctl, _ = _after_a_streamed_step()
    weights = ctl._weights
    fetch = weights._fetch

    def over_the_cap(b):
        if b.index >= 3:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        fetch(b)

    monkeypatch.setattr(weights, "_fetch", over_the_cap)
    ctl.remove()
    assert "stay in host memory after remove()" in caplog.text
    on_host = {p.untyped_storage().data_ptr() for b in weights.blocks[3:] for h in b.held for p in h.params}
    assert on_host == {h.host.data_ptr() for b in weights.blocks[3:] for h in b.held}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.model.layers)


def test_a_frozen_weight_changed_in_place_is_streamed_as_changed():
    model, reference, ctl, batch = _after_a_streamed_step()
    ctl._weights.apply(("keep", 1))  # every block's weights back on the device, as a plan that keeps them brings them
    for m in (model, reference):
        with torch.no_grad():
            m.model.layers[3].mlp.up_proj.weight.mul_(1.5)
    for seed in (1, 2):  # the host copy is made again once, where its version moved
        step_both_and_compare(model, reference, batch, seed=seed, context=f"after the change {seed}")
    ctl.remove()


def test_what_is_streamed_is_a_block_s_own_frozen_plain_weights():
    model = _frozen_llama(4)
    layers = list(model.model.layers)
    layers[0].mlp.up_proj.weight.requires_grad_(True)  # trained: stays
    layers[1].mlp.down_proj.weight = layers[2].mlp.down_proj.weight  # shared by two blocks: stays
    layers[3].self_attn.o_proj.weight = model.lm_head.weight  # shared with the model outside the blocks: stays
    found = frozen_storages(layers, model)
    names = [{n for n, p in layer.named_parameters() if any(p is q for _, ps in found[i] for q in ps)}
             for i, layer in enumerate(layers)]
    assert "mlp.up_proj.weight" not in names[0] and "mlp.gate_proj.weight" in names[0]
    assert "mlp.down_proj.weight" not in names[1] | names[2]
    assert "self_attn.o_proj.weight" not in names[3] and "self_attn.q_proj.weight" in names[3]
    assert not any("norm" in n for ns in names for n in ns)  # trained norms stay
    sizes = [sum(s.nbytes() for s, _ in f) for f in found]
    assert streamable_saving(layers, model) == sum(sizes) - WINDOW * max(sizes)


def _run(model, budget: int, host_weights, lengths=(40, 400) * 6):
    ctl = memfit.fit(model, budget=budget, method="dynamic", host_weights=host_weights, announce=False)
    for step, n in enumerate(lengths):
        batch = _text_batch(2, n, "lm")
        torch.manual_seed(step)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    records = [r for r in ctl.records if r.phase == "steady"]
    ctl.remove()
    return records


def test_the_plans_stream_weights_for_the_batches_that_need_the_room_and_keep_them_for_the_others():
    model = _frozen_llama(8, hidden=64, intermediate=256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(2.0 * params)
    without = _run(model, budget, False)
    assert any(r.peak_allocated_bytes > budget for r in without)  # nothing the blocks do fits the long batches
    records = _run(model, budget, True)
    long = [r for r in records if r.tokens == 800]
    # (on a CPU no link is measured: bringing the weights back is free, and the short batches keep them)
    short = [r for r in records if r.tokens == 80]
    assert long and short
    assert all(r.treatments["weights"].startswith("host:") for r in long)
    assert all(r.treatments["weights"] == "keep" for r in short)
    assert all(r.peak_allocated_bytes <= budget for r in records)
    # exact on the logical meter, but for a bucket's correction learnt from another plan there (NOTE [Bias per bucket])
    assert all(r.predicted_peak_bytes >= r.peak_allocated_bytes - 0.01 * budget for r in records)


def test_the_static_check_counts_the_weights_the_host_can_hold():
    model = _frozen_llama(8, hidden=64, intermediate=256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(0.6 * params)
    with pytest.raises(BudgetTooSmallError, match="before any activation"):
        memfit.fit(model, budget=budget, method="dynamic", host_weights=False, announce=False)
    memfit.fit(model, budget=budget, method="dynamic", host_weights=True, announce=False).remove()


@pytest.mark.parametrize("kwargs, match", [
    ({"host_weights": "yes"}, "host_weights='yes'"),
    ({"host_weights": True, "compile": True}, "compiled blocks keep their weights"),
])
def test_a_rejected_host_weights_leaves_the_model_untouched(kwargs, match):
    model = _frozen_llama(4)
    with pytest.raises(ValueError, match=match):
        memfit.fit(model, budget="1GiB", **kwargs)
    assert not any(m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__ for m in model.model.layers)
    memfit.fit(model, budget="1GiB", host_weights=True, announce=False).remove()


def test_a_model_without_frozen_weights_plans_no_weights_part():
    model = _frozen_llama(4)
    for p in model.parameters():
        p.requires_grad_(True)
    ctl = memfit.fit(model, budget="1GiB", host_weights=True, announce=False)
    assert ctl._weights is None and "weights" not in ctl.planning.parts
    ctl.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_weights_come_back_on_a_side_stream_bit_for_bit_and_leave_the_device():
    model = _frozen_llama(8, lora=True).cuda()
    reference = copy.deepcopy(model)
    batch = {k: v.cuda() for k, v in _text_batch(2, 64, "lm").items()}
    ctl = _streaming(model, treated=range(8), count=8)
    for step in range(3):
        step_both_and_compare(model, reference, batch, seed=step, context=f"cuda step {step}")
    weights = ctl._weights
    off = weights.off_bytes()
    assert off == sum(b.nbytes for b in weights.blocks[1:]) > 0 and weights._side is not None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ctl.remove()  # every block's weights back: the allocator holds them again (each storage rounded up to 512 bytes)
    storages = sum(len(b.held) for b in weights.blocks[1:])
    assert off <= torch.cuda.memory_allocated() - before < off + 512 * storages


def test_static_bytes_over_the_budget_leave_the_device_at_fit(capsys):
    model = _frozen_llama(8, hidden=64, intermediate=256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    memfit.fit(model, budget=int(4 * params), method="dynamic", host_weights=True, announce=True).remove()
    assert "frozen weights start in pinned host memory" not in capsys.readouterr().err
    ctl = memfit.fit(model, budget=int(0.6 * params), method="dynamic", host_weights=True, announce=True)
    assert ctl._weights.off_bytes() == sum(b.nbytes for b in ctl._weights.blocks)
    assert "of the blocks' frozen weights start in pinned host memory" in capsys.readouterr().err  # the start line says so
    torch.manual_seed(0)
    model(**_text_batch(2, 40, "lm")).loss.backward()
    ctl.remove()
    assert ctl._weights.off_bytes() == 0


def test_a_plan_made_without_the_weights_runs_them_where_the_last_plan_left_them():
    """A replay's or warm-up's plan names no option of the weights: after a step that streamed them it streams them too,
    never bringing back what the step that ran out of memory had sent to the host."""
    from memfit.engine.parts.kind import with_untreated

    model = _frozen_llama(8)
    ctl = _streaming(model, count=4)
    weights: HostWeights = ctl._weights
    torch.manual_seed(0)
    model(**_text_batch(2, 20, "lm")).loss.backward()
    assert with_untreated(Plan(ctl.planning.all_blocks), [weights], 40).option("weights") == ("host", 4)
    weights.apply(("keep", 1))
    assert with_untreated(Plan(()), [weights], 40).option("weights") == ("keep", 1)
    weights.leave()
    assert weights.untreated(40) == ("host", 8) and weights.off_bytes() == sum(b.nbytes for b in weights.blocks)
    ctl.remove()


def test_the_weights_take_no_more_blocks_than_their_share_of_the_host_budget_holds():
    model = _frozen_llama(8, hidden=64, intermediate=256)
    layers = list(model.model.layers)
    found = frozen_storages(layers, model)
    from memfit.engine.parts.treatments.offload import size_class

    pinned = [sum(size_class(s.nbytes(), pinned=True) for s, _ in f) for f in found]
    host = sum(pinned[:5])  # five blocks' pinned copies
    weights = HostWeights(layers, model, take=lambda n: torch.empty(n, dtype=torch.uint8), host_bytes=host)
    assert [o[1] for o in weights.options(0)[1:]] == [4]  # the shares of 8 blocks that fit: 1, 2, 4 (over 2), not 6 or 8
    sizes = [sum(s.nbytes() for s, _ in f) for f in found]
    assert streamable_saving(layers, model, host) == sum(sizes[:5]) - WINDOW * max(sizes[:5])
    assert streamable_saving(layers, model, 0) == 0
    weights.remove()
    ctl = memfit.fit(model, budget="1GiB", host_weights=True, host_budget=2 * host, announce=False)  # half of it
    assert ctl._weights.options(0)[-1][1] == 4
    ctl.remove()


def test_the_trainer_flag_plans_the_weights_or_not_and_trains_as_a_plain_trainer(tmp_path):
    import transformers as tf

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(3, VOCAB, (8, 40), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    flags = dict(per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3, report_to="none", save_strategy="no",
                 use_cpu=True, seed=0)
    plain = tf.Trainer(model=_frozen_llama(), args=tf.TrainingArguments(output_dir=str(tmp_path / "plain"), **flags),
                       train_dataset=Rows())
    plain.train()
    weights = {}
    for flag in ("on", "off"):
        args = memfit.TrainingArguments(output_dir=str(tmp_path / flag), memory_budget="1GB", memfit_host_weights=flag, **flags)
        trainer = memfit.Trainer(model=_frozen_llama(), args=args, train_dataset=Rows())
        weights[flag] = trainer.memfit._weights
        trainer.train()
        for (name, p), q in zip(plain.model.named_parameters(), trainer.model.parameters()):
            torch.testing.assert_close(q, p, msg=lambda m: f"{flag} {name}: {m}")
    assert weights["on"] is not None and weights["off"] is None
    with pytest.raises(Exception, match="--memfit_host_weights 'sometimes': give auto, on or off"):
        memfit.TrainingArguments(output_dir=str(tmp_path / "bad"), memfit_host_weights="sometimes", **flags)


def test_a_setup_that_fails_after_the_weights_left_at_fit_puts_them_back():
    """Static bytes over the budget send the weights to the host at fit; a rejected argument after that leaves the model
    as it was (NOTE [Setup is all or nothing]): every weight back on the device, no hook."""
    model = _frozen_llama(8, hidden=64, intermediate=256)
    reference = copy.deepcopy(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(TypeError, match="memfit.PartKind"):
        memfit.fit(model, budget=int(0.6 * params), method="dynamic", host_weights=True, announce=False, parts=["not a part"])
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert not any(m._forward_pre_hooks or m._forward_hooks or m._state_dict_hooks or "forward" in m.__dict__
                   for m in model.model.layers)


# ---------------------------------------------------------------- a model larger than its card (NOTE [A model larger than its card])
def test_weights_that_arrive_from_the_cpu_train_bit_for_bit_and_come_back_in_place():
    """A block's weights taken from where they are into their host copies, its parameters on empty storages (what a
    placed model's blocks start with on the device): the plans bring them back, the gradients are those of the weights
    kept bit for bit, a state dict reads them on the host, and ``remove()`` fills the parameters again with their
    values and layouts (a view into a shared storage included)."""
    model = _frozen_llama(6, lora=True)
    reference = copy.deepcopy(model)
    ctl = _streaming(model, treated=(1, 3), kinds=("recompute", "elementwise"), count=4)
    weights: HostWeights = ctl._weights
    names = {id(p): n for n, p in model.named_parameters()}
    before = {names[id(p)]: (p.detach().clone(), p.stride(), p.storage_offset()) for b in weights.blocks for h in b.held for p in h.params}
    for b in weights.blocks:
        weights._arrive(b, torch.device("cpu"))
    assert all(not b.on_device and all(h.storage.nbytes() == 0 for h in b.held) for b in weights.blocks)
    state = model.state_dict()
    for name, (value, _, _) in before.items():
        assert torch.equal(state[name], value), name  # read on the host copies
    for step, length in enumerate((9, 30, 17)):
        step_both_and_compare(model, reference, _text_batch(2, length, "lm"), seed=step, context=f"arrived step {step}")
    ctl.remove()
    for name, p in model.named_parameters():
        if name in before:
            value, stride, offset = before[name]
            assert torch.equal(p, value) and p.stride() == stride and p.storage_offset() == offset, name


def test_place_moves_all_but_the_streamed_frozen_weights_within_the_host_share():
    from memfit.engine.parts.host_weights import _fitting, place
    from memfit.engine.parts.treatments.offload import size_class

    model = _frozen_llama(6, lora=True)
    layers = list(model.base_model.model.model.layers)
    found = frozen_storages(layers, model)
    host = sum(size_class(s.nbytes(), pinned=True) for s, _ in found[0] + found[1] + found[2])
    assert _fitting(found, host) == 3
    place(model, layers, torch.device("meta"), host)
    streamed = {id(p) for f in found[:3] for _, ps in f for p in ps}
    for name, p in model.named_parameters():
        assert p.device.type == ("cpu" if id(p) in streamed else "meta"), name  # adapters, norms, embeddings, later blocks
    assert all(b.device.type == "meta" for b in model.buffers())


def test_fit_on_a_device_the_model_is_not_on_says_what_to_give():
    model = _frozen_llama(2).to("meta")
    with pytest.raises(ValueError, match="give a model on the CPU"):
        memfit.fit(model, budget=None, method="none", device="cuda", announce=False)
    with pytest.raises(ValueError, match="give a torch device, such as 'cuda'"):
        memfit.fit(_frozen_llama(2), budget=None, method="none", device="gpu", announce=False)


def test_a_memfit_trainer_leaves_the_move_to_fit_only_for_an_eager_unsharded_cuda_run_with_the_part_on(monkeypatch):
    """NOTE [A model larger than its card]: the Trainer's own move is skipped (``fit`` places the model) where the run is
    on CUDA, the model on the CPU, the blocks eager, not sharded, the weights part not off, and the weights over the
    budget or the card's free memory; else the Trainer moves it as always."""
    from types import SimpleNamespace

    from memfit.engine.budget import Budget
    from memfit.integrations import hf

    model = _frozen_llama(2)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * weights, 20 * weights))
    cuda = torch.device("cuda", 0)

    def args(**kw):
        return SimpleNamespace(**{"memfit_host_weights": "auto", "memfit_budget": Budget.parse(weights // 2, "b"), "fsdp": "", **kw})

    assert hf._memfit_places(args(), model, cuda)
    assert not hf._memfit_places(args(memfit_budget=Budget.parse(2 * weights, "b")), model, cuda)  # fits: the Trainer moves it
    assert hf._memfit_places(args(memfit_budget=None), model, cuda) is False  # fits the card's free memory
    assert not hf._memfit_places(args(memfit_host_weights="off"), model, cuda)
    assert not hf._memfit_places(args(memfit_compile=True), model, cuda)
    assert not hf._memfit_places(args(fsdp="full_shard"), model, cuda)
    assert not hf._memfit_places(args(), model, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_model_on_the_cpu_is_placed_with_its_frozen_weights_on_the_host():
    """``fit(device="cuda")`` on a model on the CPU: the blocks' frozen weights go to the host, not the device, the steps
    (every block's weights streamed) train bit for bit against the same model kept on the device, and a setup that fails
    moves the model back to the CPU."""
    model = _frozen_llama(8, lora=True, hidden=256, intermediate=1024)
    reference = copy.deepcopy(model).cuda()
    frozen = sum(s.nbytes() for f in frozen_storages(list(model.base_model.model.model.layers), model) for s, _ in f)
    with pytest.raises(ValueError, match="unknown treatment 'bogus'"):
        memfit.fit(model, budget="1GiB", method="dynamic", device="cuda", treatments=["bogus"], announce=False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(8)), parts=(("weights", "host", 8),))),
                     device="cuda", announce=False)
    assert torch.cuda.memory_allocated() - base < frozen / 2  # the blocks' weights arrived on the host, not the device
    batch = {k: v.cuda() for k, v in _text_batch(2, 64, "lm").items()}
    for step in range(3):
        step_both_and_compare(model, reference, batch, seed=step, context=f"placed step {step}")
    ctl.remove()


def test_a_trainer_over_its_weights_trains_and_evaluates_with_them_passing_through(tmp_path):
    """A memfit Trainer whose budget is under the model's weights: they leave the device at setup, training streams them,
    and ``evaluate()`` passes them through (a forward without autograd) to the plain model's loss, leaving them on the
    host after."""
    import transformers as tf

    class Rows(torch.utils.data.Dataset):
        def __init__(self, seed):
            self.ids = torch.randint(3, VOCAB, (8, 40), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = _frozen_llama(8, hidden=64, intermediate=256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    flags = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=4, max_steps=2,
                 learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True, seed=0)
    args = memfit.TrainingArguments(**flags, memory_budget=f"{int(0.8 * params)}B", memfit_method="dynamic",
                                    memfit_host_weights="on")
    trainer = memfit.Trainer(model=model, args=args, train_dataset=Rows(0), eval_dataset=Rows(1))
    weights: HostWeights = trainer.memfit._weights
    assert weights.off_bytes() == sum(b.nbytes for b in weights.blocks)  # over the budget: on the host from setup
    trainer.train()
    off = weights.off_bytes()
    assert off > 0
    reference = _frozen_llama(8, hidden=64, intermediate=256)
    reference.load_state_dict(model.state_dict())  # the trained weights, read on the host
    metrics = trainer.evaluate()
    assert weights.off_bytes() == off  # they passed through
    plain = tf.Trainer(model=reference, args=tf.TrainingArguments(**flags), eval_dataset=Rows(1))
    assert metrics["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
