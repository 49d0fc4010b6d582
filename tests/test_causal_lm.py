"""causal-lm: the JSON-lines layouts, labels (prompts and non-assistant chat turns masked with
--completion_only_loss), dynamic padding, the model (SDPA, bf16 weights, LoRA inside which memfit
still finds the decoder layers), synthetic SFT lengths, metrics, the bundled LLM configs,
`memfit train causal-lm` end to end, and the error messages."""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from _models import FIXTURES
from memfit.engine.parts.blocks import find_blocks
from memfit.tasks import DataFileError, DataTrainingArguments, ModelArguments, get_task
from memfit.tasks import causal_lm as clm
from memfit.tasks._common import QUANTILE_LEVELS, SyntheticText, load_config, minilm_path
from memfit.cli.train import run

SFT = FIXTURES / "sft"
TRAIN_FLAGS = [
    "--do_train", "--max_steps", "3", "--per_device_train_batch_size", "4", "--report_to", "none",
    "--save_strategy", "no", "--use_cpu", "--memory_budget", "1GB", "--memfit_method", "dynamic",
]


@pytest.fixture(scope="module")
def tokenizer():
    return clm.lm_tokenizer(ModelArguments(tokenizer_name=str(minilm_path())))


def _trained_tokens(tokenizer, example, **kwargs):
    (feature,) = clm.tokenize_examples([example], tokenizer, completion_only=True, **kwargs)
    return tokenizer.convert_ids_to_tokens([t for t in feature["labels"] if t != clm.IGNORE_INDEX])


# --- data layouts and labels ----------------------------------------------------------------


def test_fixture_layouts(tokenizer):
    chat = clm.read_lm_file(SFT / "chat.jsonl", tokenizer)
    pairs = clm.read_lm_file(SFT / "prompt_completion.jsonl", tokenizer)
    texts = clm.read_lm_file(SFT / "text.jsonl", tokenizer)
    assert (len(chat), len(pairs), len(texts)) == (20, 12, 8)
    assert all(ex.chat and ex.text.startswith("<|im_start|>") for ex in chat)
    first = json.loads((SFT / "prompt_completion.jsonl").read_text().splitlines()[0])
    assert pairs[0].text == first["prompt"] + first["completion"] and not pairs[0].chat
    assert pairs[0].completion == ((len(first["prompt"]), len(pairs[0].text)),)
    assert texts[0].completion == ((0, len(texts[0].text)),)


# (layout, record): each is the same conversation, as people's chat data writes it (NOTE [Chat roles])
SAME_CONVERSATION = [
    ("messages", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                               {"role": "assistant", "content": "Hello."}]}),
    ("messages, ShareGPT roles", {"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "human", "content": "Hi?"}, {"role": "gpt", "content": "Hello."}]}),
    ("messages, bot", {"messages": [{"role": "System", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                                    {"role": "bot", "content": "Hello."}]}),
    ("ShareGPT conversations", {"conversations": [{"from": "system", "value": "Be brief."},
                                                  {"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}),
]


@pytest.mark.parametrize("layout,record", SAME_CONVERSATION, ids=[c[0] for c in SAME_CONVERSATION])
def test_chat_layouts_and_role_aliases_read_alike(tokenizer, layout, record):
    reference = clm.example_from_record(SAME_CONVERSATION[0][1], tokenizer, find_turns=True)
    example = clm.example_from_record(record, tokenizer, find_turns=True)
    assert example == reference
    assert "<|im_start|>assistant\nHello.<|im_end|>" in example.text
    assert _trained_tokens(tokenizer, example) == tokenizer.tokenize("Hello.") + ["<|im_end|>"]


def test_sharegpt_fixture_is_read(tokenizer):
    examples = clm.read_lm_file(SFT / "sharegpt.jsonl", tokenizer, find_turns=True)
    assert len(examples) == 4 and all(ex.chat for ex in examples)
    assert [len(ex.completion) for ex in examples] == [1, 2, 1, 1]  # the assistant turns of each
    assert "<|im_start|>user\nName a prime" in examples[1].text


@pytest.mark.parametrize("record,message", [
    ({"messages": [{"role": "narrator", "content": "x"}]}, r'"messages"\[0\] has the unknown role \'narrator\''),
    ({"conversations": [{"role": "user"}]}, r'"conversations"\[0\] must be an object with string "from" and "value"'),
    ({"conversations": []}, r'"conversations" must be a non-empty list of \{"from", "value"\} messages'),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"assistant turns and this conversation has none \(roles: user\)"),
    ({"text": "plain"}, r'plain \{"text"\} has no completion for --completion_only_loss'),
])
def test_records_refused_with_completion_only_loss(tokenizer, record, message):
    with pytest.raises(ValueError, match=message):
        clm.example_from_record(record, tokenizer, find_turns=True)


def test_plain_text_and_roleless_chat_train_without_completion_only_loss(tokenizer):
    assert clm.example_from_record({"text": "plain"}, tokenizer).text == "plain"
    assert clm.example_from_record({"messages": [{"role": "user", "content": "hi"}]}, tokenizer).chat


def test_prompt_completion_masks_the_prompt(tokenizer):
    example = clm.example_from_record({"prompt": "Question: What is 2+2?\nAnswer:", "completion": " 4."}, tokenizer)
    assert _trained_tokens(tokenizer, example) == ["4", ".", "[SEP]"]  # the EOS the model learns to end with
    (full,) = clm.tokenize_examples([example], tokenizer)
    assert full["labels"] == full["input_ids"] and full["input_ids"][0] == tokenizer.bos_token_id


def test_chat_completion_only_trains_the_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    ]
    example = clm.example_from_record({"messages": messages}, tokenizer, find_turns=True)
    expected = tokenizer.tokenize("Paris.") + ["<|im_end|>"] + tokenizer.tokenize("Rome, since 1871.") + ["<|im_end|>"]
    assert _trained_tokens(tokenizer, example) == expected
    # TRL's conversational prompt-completion: the completion messages are the trained part
    pc = clm.example_from_record({"prompt": messages[:4], "completion": messages[4:]}, tokenizer, find_turns=True)
    assert _trained_tokens(tokenizer, pc) == tokenizer.tokenize("Rome, since 1871.") + ["<|im_end|>"]
    # a chat text gets no BOS and no EOS from the tokenizer: the template wrote its own tokens
    (feature,) = clm.tokenize_examples([example], tokenizer)
    assert tokenizer.convert_ids_to_tokens(feature["input_ids"][:1] + feature["input_ids"][-1:]) == ["<|im_start|>", "<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    reversing = copy.deepcopy(tokenizer)
    reversing.chat_template = "{% for m in messages | reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(ValueError, match="does not render a conversation's first turns"):
        clm.example_from_record(record, reversing, find_turns=True)
    assert clm.example_from_record(record, reversing).chat  # without --completion_only_loss it is fine


def test_eos_is_appended_and_truncation_happens_only_when_asked(tokenizer):
    example = clm.LMExample(" ".join(["word"] * 600), ((0, 2999),))
    (whole,) = clm.tokenize_examples([example], tokenizer)
    assert len(whole["input_ids"]) == 602 and whole["input_ids"][-1] == tokenizer.eos_token_id  # BOS + 600 + EOS
    (cut,) = clm.tokenize_examples([example], tokenizer, max_length=5)
    assert cut["input_ids"] == whole["input_ids"][:5] and len(cut["labels"]) == 5


def test_collator_pads_to_the_longest_with_ignored_labels():
    batch = clm.CausalLMCollator(pad_token_id=0)([
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8], "labels": [8]},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_collator_rounds_the_length_up_to_its_multiple():
    batch = clm.CausalLMCollator(pad_token_id=0, pad_to_multiple_of=4)([
        {"input_ids": [5, 6, 7, 9, 9], "labels": [-100, 6, 7, 9, 9]},
        {"input_ids": [8], "labels": [8]},
    ])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum().item() == 6 and (batch["labels"] != -100).sum().item() == 5
    assert batch["labels"][:, 5:].eq(-100).all() and batch["attention_mask"][:, 5:].eq(0).all()


@pytest.mark.parametrize(
    "line, message",
    [
        ({"question": "x"}, 'expected a "text" field, "prompt" and "completion", "messages" or ShareGPT "conversations"'),
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, '"prompt" and "completion" must both be strings'),
        ({"messages": [{"role": "user"}]}, r'"messages"\[0\] must be an object with string "role" and "content"'),
        ({"text": 3}, '"text" must be a string'),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, tokenizer, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataFileError, match=rf"bad\.jsonl:2: {message}"):
        clm.read_lm_file(bad, tokenizer)


def test_chat_data_and_a_tokenizer_without_template(tmp_path):
    plain = tmp_path / "plain-tokenizer"
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(plain)  # not the MiniLM path: no template added
    flags = ["--tokenizer_name", str(plain), "--train_file", str(SFT / "chat.jsonl"), *TRAIN_FLAGS, "--output_dir", str(tmp_path / "out")]
    with pytest.raises(DataFileError, match=r"chat\.jsonl:1: chat messages need a chat template .*--chat_template_path"):
        run("causal-lm", flags)
    template = tmp_path / "chatml.jinja"
    template.write_text(clm.CHAT_TEMPLATE)
    tokenizer = clm.lm_tokenizer(ModelArguments(tokenizer_name=str(plain)), clm.CausalLMArguments(chat_template_path=str(template)))
    assert len(clm.read_lm_file(SFT / "chat.jsonl", tokenizer)) == 20


def test_dataset_name_reads_hub_rows(monkeypatch, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in (SFT / "chat.jsonl").read_text().splitlines()]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:8]), "validation": datasets.Dataset.from_list(rows[8:12])}
    ))
    bundle = clm.build(ModelArguments(), DataTrainingArguments(dataset_name="some/chat"), lm_args=clm.CausalLMArguments())
    assert (len(bundle.train_dataset), len(bundle.eval_dataset)) == (8, 4)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        clm.build(ModelArguments(), DataTrainingArguments(dataset_name="some/chat"))


# --- the model ------------------------------------------------------------------------------


def test_default_model_is_the_tiny_llama_in_fp32_with_sdpa():
    bundle = get_task("causal-lm").build(ModelArguments(), DataTrainingArguments(train_file=str(SFT / "text.jsonl")))
    model = bundle.model
    assert type(model).__name__ == "LlamaForCausalLM" and model.config._attn_implementation == "sdpa"
    assert {p.dtype for p in model.parameters()} == {torch.float32} and all(p.requires_grad for p in model.parameters())
    assert model.get_input_embeddings().weight.shape[0] >= len(bundle.tokenizer)
    batch = bundle.data_collator(bundle.train_dataset[:3])
    longest = max(len(f["input_ids"]) for f in bundle.train_dataset[:3])
    assert batch["input_ids"].shape[1] == -(-longest // clm.PAD_TO_MULTIPLE_OF) * clm.PAD_TO_MULTIPLE_OF
    assert torch.isfinite(model(**batch).loss)


def test_lora_in_bf16_keeps_the_decoder_layers_as_blocks():
    pytest.importorskip("peft")
    lm_args = clm.CausalLMArguments(
        use_peft=True, lora_r=4, lora_target_modules=["all-linear"], torch_dtype="bfloat16", completion_only_loss=True,
    )
    bundle = clm.build(ModelArguments(), DataTrainingArguments(train_file=str(SFT / "chat.jsonl")), lm_args=lm_args)
    model = bundle.model
    blocks = find_blocks(model)
    assert [type(m).__name__ for _, m in blocks] == ["LlamaDecoderLayer"] * 4
    assert blocks[0][0] == "base_model.model.model.layers.0"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".mlp.down_proj.lora_A" in n for n in trainable)  # all-linear: the MLP too
    assert model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    loss = model(**bundle.data_collator(bundle.train_dataset[:2])).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_lora_argument_errors():
    with pytest.raises(ValueError, match="--lora_r --lora_alpha configure LoRA: add --use_peft"):
        clm.CausalLMArguments(lora_r=8, lora_alpha=16)
    with pytest.raises(ValueError, match="--lora_dropout 1.0"):
        clm.CausalLMArguments(use_peft=True, lora_dropout=1.0)
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match="--lora_target_modules not_a_module: LlamaForCausalLM has no module named not_a_module; its linear layers are .*q_proj up_proj v_proj"):
        clm.build(ModelArguments(), DataTrainingArguments(train_file=str(SFT / "text.jsonl")),
                  lm_args=clm.CausalLMArguments(use_peft=True, lora_target_modules=["not_a_module"]))


@pytest.mark.parametrize(
    "name, model_type, params_m",
    [("SmolLM-360M", "llama", 361.8), ("Qwen/Qwen2.5-0.5B", "qwen2", 494.0), ("Qwen/Qwen2.5-1.5B", "qwen2", 1543.7), ("meta-llama/Llama-3.2-1B", "llama", 1235.8),
     ("meta-llama/Llama-3.2-3B", "llama", 3212.7), ("meta-llama/Llama-3.1-8B", "llama", 8030.3)],
)
def test_bundled_llm_configs_have_their_published_sizes(name, model_type, params_m):
    config = load_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.model_type == model_type
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params_m, abs=0.1)


# --- synthetic lengths and metrics ----------------------------------------------------------


def test_synthetic_lengths_follow_the_sft_table(tokenizer):
    n = 400
    examples = clm.synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, 3))
    totals = SyntheticText.for_tokenizer(tokenizer, 3).lengths(clm.SFT_TOKENS, n)  # the same draws
    features = clm.tokenize_examples(examples, tokenizer, completion_only=True)
    lengths = np.array([len(f["input_ids"]) for f in features])
    assert (lengths == totals).all() and lengths.max() <= 2048
    assert np.quantile(lengths, 0.5) == pytest.approx(clm.SFT_TOKENS[QUANTILE_LEVELS.index(0.5)], rel=0.2)
    assert lengths.max() / lengths.min() > 20  # the long tail that makes per-batch plans pay
    # the prompt takes 10-50% of the words, and is masked
    learnt = np.array([sum(t != clm.IGNORE_INDEX for t in f["labels"]) for f in features]) / lengths
    assert 0.45 < learnt.min() and learnt.max() < 0.95


def test_metrics_read_the_shifted_predictions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, 4, -100, -100], [-100, 7, 1, 2, 9]])
    logits[0, 0, 3] = logits[1, 1, 1] = 50.0  # right at two labelled positions (the next token's)
    out = clm._predictions_and_losses(logits, labels)
    metrics = clm.lm_metrics(out.numpy(), labels.numpy())
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert metrics["perplexity"] == pytest.approx(float(reference.exp()), rel=1e-5)
    argmax_right = int(((logits[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != -100)).sum())
    assert metrics["accuracy"] == pytest.approx(argmax_right / 6) and argmax_right >= 2


# --- memfit train causal-lm -----------------------------------------------------------------


def test_train_lora_completion_only_on_chat_under_a_budget(tmp_path):
    pytest.importorskip("peft")
    metrics = run("causal-lm", [
        "--train_file", str(SFT / "chat.jsonl"), "--validation_file", str(SFT / "prompt_completion.jsonl"),
        "--do_eval", "--use_peft", "--lora_target_modules", "all-linear", "--completion_only_loss",
        *TRAIN_FLAGS, "--output_dir", str(tmp_path),
    ])
    assert {"train_loss", "eval_accuracy", "eval_perplexity"} <= set(metrics)
    records = [json.loads(line) for line in (tmp_path / "memfit_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and {r["n_blocks"] for r in records} == {4}
    assert all(r["peak_allocated_bytes"] <= r["budget_bytes"] == 10**9 for r in records)


def test_train_synthetic_bf16_weights(tmp_path):
    metrics = run("causal-lm", [
        "--synthetic", "12", "--max_seq_length", "96", "--torch_dtype", "bfloat16", *TRAIN_FLAGS,
        "--output_dir", str(tmp_path),
    ])
    assert np.isfinite(metrics["train_loss"])
    records = [json.loads(line) for line in (tmp_path / "memfit_steps.jsonl").read_text().splitlines()]
    assert len(records) == 3 and max(r["shape"][1] for r in records) <= 96


def test_the_floor_of_the_longest_batch_is_said_at_start(tmp_path, monkeypatch, caplog):
    """NOTE [The floor at start]: on CUDA, ``memfit train`` says the floor of the data's longest batch against the
    budget before the first step: one INFO line where it fits; a WARNING where it does not, naming a --max_seq_length
    whose floor fits (and the next length up does not fit); nothing off CUDA or where no estimate can be made."""
    import logging
    from types import SimpleNamespace

    from memfit.cli import start_floor, train
    from memfit.tools.estimate.anatomy import ModelProfile
    from memfit.tools.estimate.floor import Floors

    peft = pytest.importorskip("peft")
    model = get_task("causal-lm").build(ModelArguments(), DataTrainingArguments(train_file=str(SFT / "text.jsonl"))).model
    model = model.to(torch.bfloat16)  # the bundled tiny llama
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    data = [{"input_ids": [1] * n} for n in (100, 3000, 700)]
    args = SimpleNamespace(memfit_budget_bytes=10**9, memfit_margin=None, memfit_host_budget=None, per_device_train_batch_size=2,
                           bf16=False, fp16=False, optim="adamw_torch")
    assert start_floor.say_floor_at_start(model, data, args, on_cuda=False) is None
    with caplog.at_level(logging.INFO, logger="memfit"):
        line = start_floor.say_floor_at_start(model, data, args, on_cuda=True)
    assert line.startswith("memfit: the floor of the data's longest batch (2 x 3,000 tokens) is ") and "within the budget" in line
    # a budget the longest batch's floor is over: the length named fits, the next one up does not
    setup = start_floor._setup(model, args)
    floors = Floors(ModelProfile.from_config(model.config, "causal-lm"), setup)
    need = floors.at(3000).total_bytes
    args.memfit_budget_bytes = int((need + floors.at(1000).total_bytes) / 2 / 0.97)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        line = start_floor.say_floor_at_start(model, data, args, on_cuda=True)
    assert caplog.records and caplog.records[-1].levelno == logging.WARNING
    fits = int(line.split("--max_seq_length ")[1].split(" fits")[0].replace(",", ""))
    usable = int(args.memfit_budget_bytes * 0.97)
    assert floors.at(fits).total_bytes <= usable < floors.at(3000).total_bytes, (fits, usable)
    assert "over the budget less its 3% margin" in line and "--per_device_train_batch_size" in line
    assert start_floor.say_floor_at_start(SimpleNamespace(parameters=lambda: iter([torch.zeros(1)])), data, args, True) is None
    # the optimizer as the estimate names it: by memfit train's flags, or the one whose --optim the name begins with
    for optim, name in (("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"), ("adafactor", "adafactor"),
                        ("adamw_bnb_8bit", "adamw-8bit")):
        assert start_floor._optimizer(SimpleNamespace(optim=optim, optim_args=None)) == name, optim
    assert start_floor.say_floor_at_start(model, data, SimpleNamespace(**{**vars(args), "optim": "lion_32bit"}), True) is None
    # memfit train asks it where a causal-lm run trains on CUDA under a budget
    said = []
    monkeypatch.setattr(train, "_on_cuda", lambda a: True)
    monkeypatch.setattr(train, "say_floor_at_start", lambda *a, **k: said.append(k["on_cuda"]))
    run("causal-lm", ["--synthetic", "8", "--max_seq_length", "64", *TRAIN_FLAGS, "--output_dir", str(tmp_path)])
    assert said == [True]


def test_the_floor_at_start_is_a_ranks_under_fsdp(monkeypatch, tmp_path):
    """NOTE [The floor at start] under ``--fsdp``: the floor said is one rank's of the ranks the model is sharded over
    (every rank under full_shard, a node's under hybrid_shard); shard_grad_op is not counted (no floor said)."""
    from types import SimpleNamespace

    from memfit.cli import start_floor

    def args(*fsdp, world=4):
        return SimpleNamespace(fsdp=list(fsdp), world_size=world)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert start_floor._shards(args()) == 1 and start_floor._shards(SimpleNamespace(world_size=4)) == 1
    assert start_floor._shards(args("full_shard", "auto_wrap")) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert start_floor._shards(args("hybrid_shard", "auto_wrap")) == 2
    with pytest.raises(ValueError, match="shard_grad_op"):
        start_floor._shards(args("shard_grad_op"))
    with pytest.raises(ValueError, match="offload"):
        start_floor._shards(args("full_shard", "offload"))
    # the Trainer's own arguments, as this transformers keeps them (later ones: fsdp True, the strategy in fsdp_config)
    from transformers import TrainingArguments

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    trainer = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard auto_wrap", report_to="none", use_cpu=True,
                                fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    assert start_floor._shards(trainer) == trainer.world_size == 1
    monkeypatch.setattr(type(trainer), "world_size", property(lambda self: 8))
    assert start_floor._shards(trainer) == 8
    grad_op = TrainingArguments(output_dir=str(tmp_path), fsdp="shard_grad_op auto_wrap", report_to="none", use_cpu=True,
                                fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    with pytest.raises(ValueError, match="shard_grad_op"):
        start_floor._shards(grad_op)
