"""object-detection: a DETR-family detector with a Swin backbone, trained at multiple scales.

The model is a Conditional DETR (``AutoModelForObjectDetection``; any DETR-family config
works) whose backbone is a Swin transformer built from its config
(``backbone_config={"model_type": "swin", ..., "out_features": ["stage4"]}``), with random
weights unless ``--model_name_or_path`` names a trained detector. Conditional DETR is the
DETR variant whose pure-PyTorch code converges fastest; Deformable DETR's attention loads
a kernel from the hub, which an offline GPU machine cannot reach.

Multi-scale training, as DETR and Swin's detection recipes do it: each training image is
resized so that its shorter side is drawn from ``--shortest_edge`` (``480-800``: a multiple
of 32 in that range, per image) and its longer side is at most ``--longest_edge`` (1333);
evaluation uses the largest shorter side. ``--multi_scale_per batch`` draws the shorter side
once per batch instead (YOLOX's recipe, mmdet's ``BatchSyncRandomResize``): a batch of 16
images drawn per image is nearly always padded to about the largest scale, one drawn per
batch spans the whole range. A batch is padded to its largest height and width
rounded up to 32 (Swin's total stride), and ``pixel_mask`` marks the real pixels. Labels are
one dict per image: ``class_labels`` and ``boxes`` as (cx, cy, w, h) relative to the image
before padding, as in the original DETR (the sine position embedding is normalised by the
mask, so the model sees that frame too).

Memory follows the padded pixel count. The first block, a Swin layer, receives
``(N, H/4 · W/4, C)``, so the shape key is ``(N, H·W/16)``: patches of 4×4 pixels, linear in
pixels. Swin's window attention is linear in pixels too (windows of 7×7 patches), so the
quadratic term of the memory model only has to carry the detector's own encoder, which
attends over the stride-32 map (``H·W/1024`` tokens). See NOTE [Pad to whole windows].

# NOTE [Pad to whole windows]
Each Swin layer pads its map to whole windows, so with batches padded to 32 pixels a layer
of stage 3 (stride 16, windows of 7) holds up to 20% more per side than ``H·W`` says, and
two batches with one key but other sides (160×256, 192×224) differ by 12%: the memory model
under-predicted such a key by 5% on CPU. So batches are padded to whole windows of the
second-to-last stage, ``patch · window · 2**(stages-2)`` pixels (112 for window 7): stages
1-3 then pad nothing and their memory is a function of the key; only the last stage, a few
small layers, still pads. Swin pads to that size inside anyway, so the cost is a few more
pixels through stages 1-2. Batches are also at least one pixel-window of the last stage
plus that unit on each side (``min_size``): a smaller map makes HF Swin shrink the layer's
window and drop its shift for good (``SwinLayer.set_shift_and_window_size``).

# NOTE [Swin patch bias]
Built from a config (random weights), transformers initialises every Conv2d/Linear bias and
LayerNorm shift of Swin to zero. A patch of padding pixels (0 after normalisation) then embeds
to the exact zero vector, and windows made only of padding stay exactly zero through every
block (zero q/k/v, zero MLP output) until a shifted window or a patch merge mixes them with
the image. Each LayerNorm over such a token has variance 0, so its backward scales the
gradient by ``1/sqrt(layer_norm_eps)`` (316): over the 12 or more LayerNorms of stages 1-3 the
first backward reaches 1e18-1e38 in the patch embedding's gradient, the fp32 norm of the
gradients overflows (Swin-B at 480-800 pixels, Swin-S/T at 800) and clipping zeroes or
NaNs the whole step. The original Swin (and timm) leave the patch conv at PyTorch's default
init, whose bias is uniform in ``±1/sqrt(fan_in)``; so does :func:`_load_detector`: padding
patches embed to that bias, whose variance keeps every LayerNorm's gain bounded.

Data: a COCO-format folder (``--train_dir`` with the images, ``--train_annotations`` the
instances JSON; ``--validation_dir``/``--validation_annotations`` likewise). Crowd boxes
(``iscrowd: 1``) and boxes without area are dropped, as DETR does; categories are renumbered
0..C-1 in id order, keeping their names.

Synthetic (``--synthetic N``): rectangles, ellipses and triangles (one class each, each with
its own hue) on a grey background with coarse noise, 1-6 objects covering 8-45% of the shorter side.
Native image sizes imitate COCO's common 640-pixel-wide layouts (4:3, 3:2, 3:4, 16:9, in
proportions picked by hand: no COCO copy was at hand to measure). Images are drawn at the
target scale, so no resize blurs them.

Metric: COCO mAP (``map``, ``map_50``, ``map_75``) when ``pycocotools`` is installed; always
``mean_best_iou`` and ``precision_iou50`` (see :func:`box_match_scores`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import DataError, FlagError, LoadError, MissingFileError
from memfit.tasks._common import CONFIGS_DIR, DataFileError, DataTrainingArguments, ModelArguments, TaskBundle, load_config

__all__ = [
    "DEFAULT_CONFIG",
    "SIZE_DIVISOR",
    "SYNTHETIC_CLASSES",
    "SyntheticImage",
    "DetectionExample",
    "DetectionFeature",
    "DetectionCollator",
    "read_coco",
    "synthetic_examples",
    "shortest_edges",
    "resized_size",
    "padding_geometry",
    "box_match_scores",
    "coco_map",
    "build",
]

logger = logging.getLogger(__name__)

#: The bundled config used without a model flag (memfit/configs; Swin-T-sized backbone).
DEFAULT_CONFIG = "conditional-detr-swin-tiny"
#: The recipe loads no tokenizer (memfit.tasks: a recipe without this attribute loads one).
TOKENIZER = False
#: Step of the multi-scale shorter sides, and batch padding for backbones other than Swin.
SIZE_DIVISOR = 32
SYNTHETIC_CLASSES = ("rectangle", "ellipse", "triangle")

_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# (width, height, probability) of the synthetic native sizes (module docstring).
_NATIVE_SIZES = ((640, 480, 0.5), (640, 427, 0.2), (480, 640, 0.2), (640, 360, 0.1))
_CLASS_HUES = ((0.85, 0.2, 0.15), (0.2, 0.75, 0.25), (0.2, 0.3, 0.85))


@dataclass
class SyntheticImage:
    """A drawable synthetic image: background and shapes, rendered at any size."""

    seed: int
    """Seeds the background noise (the same pixels every time the image is drawn at a size)."""
    background: float
    """Grey level of the background, 0-1."""
    colors: list[tuple[float, float, float]]
    """RGB (0-1) of each shape, in drawing order (the example's boxes and labels)."""

    def render(self, boxes: np.ndarray, labels: np.ndarray, native: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
        """``(height, width, 3)`` float32 image in 0-1 at ``size``, boxes given at ``native`` size."""
        h, w = size
        # Noise in 4x4-pixel cells: drawing it per pixel would cost most of a step's data time.
        rng = np.random.default_rng([self.seed, h, w])
        cells = rng.uniform(-0.08, 0.08, size=(-(-h // 4), -(-w // 4), 3)).astype(np.float32)
        image = self.background + cells.repeat(4, axis=0).repeat(4, axis=1)[:h, :w]
        sy, sx = h / native[0], w / native[1]
        for (x, y, bw, bh), label, color in zip(boxes, labels, self.colors):
            x0, y0 = int(round(x * sx)), int(round(y * sy))
            x1, y1 = max(x0 + 1, int(round((x + bw) * sx))), max(y0 + 1, int(round((y + bh) * sy)))
            yy, xx = np.meshgrid(np.linspace(-1, 1, y1 - y0), np.linspace(-1, 1, x1 - x0), indexing="ij")
            if label == 1:
                inside = xx**2 + yy**2 <= 1
            elif label == 2:
                inside = np.abs(xx) <= (yy + 1) / 2  # apex at the top centre
            else:
                inside = np.ones_like(xx, dtype=bool)
            image[y0:y1, x0:x1][inside] = color
        return image


@dataclass
class DetectionExample:
    """One image with its boxes, in the COCO layout."""

    image: Path | SyntheticImage
    """The image file, or a synthetic image drawn on demand."""
    height: int
    """Native height in pixels (the boxes' frame)."""
    width: int
    """Native width in pixels."""
    boxes: np.ndarray
    """``(k, 4)`` float boxes as COCO ``[x, y, width, height]`` in native pixels."""
    labels: np.ndarray
    """``(k,)`` class ids, 0..C-1."""
    image_id: int
    """Position in its split (the COCO image id is kept in ``coco_id``)."""
    coco_id: int | None = None
    """The image's id in the annotations file, if it came from one."""

    def pixels(self, size: tuple[int, int]) -> np.ndarray:
        """``(height, width, 3)`` float32 image in 0-1, resized to ``size``.

        Raises:
            DataFileError: the file's size differs from the annotations' (the boxes would not fit).
        """
        if isinstance(self.image, SyntheticImage):
            return self.image.render(self.boxes, self.labels, (self.height, self.width), size)
        from PIL import Image

        with Image.open(self.image) as img:
            if img.size != (self.width, self.height):
                raise DataFileError(
                    self.image, "size",
                    f"{img.size[0]}x{img.size[1]} pixels, but the annotations say {self.width}x{self.height}",
                )
            rgb = img.convert("RGB").resize((size[1], size[0]), Image.BILINEAR)
        return np.asarray(rgb, dtype=np.float32) / 255.0


@dataclass
class DetectionFeature:
    """One item of a detection data set as the Trainer sees it; the collator draws its size."""

    example: DetectionExample
    multi_scale: bool
    """Draw the shorter side per image (training); else use the largest (evaluation)."""


def shortest_edges(spec: str) -> tuple[int, ...]:
    """The candidate shorter sides of ``--shortest_edge``.

    Example:
        >>> shortest_edges("480-800")[:3], shortest_edges("480-800")[-1], shortest_edges("800")
        ((480, 512, 544), 800, (800,))

    Raises:
        FlagError: not ``N`` or ``LO-HI`` with ``0 < LO <= HI``.
    """
    try:
        parts = [int(p) for p in spec.split("-")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or parts[0] <= 0 or parts[-1] < parts[0]:
        raise FlagError(f"--shortest_edge {spec!r}: give pixels as N or LO-HI (e.g. 480-800)")
    lo, hi = parts[0], parts[-1]
    return tuple(range(lo, hi + 1, SIZE_DIVISOR)) if hi > lo else (lo,)


def resized_size(height: int, width: int, shortest: int, longest: int) -> tuple[int, int]:
    """``(height, width)`` with the shorter side ``shortest``, the longer at most ``longest``.

    Example:
        >>> resized_size(480, 640, 800, 1333), resized_size(360, 640, 800, 1333)
        ((800, 1067), (750, 1333))
    """
    scale = shortest / min(height, width)
    if max(height, width) * scale > longest:
        scale = longest / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass
class DetectionCollator:
    """Resize each image (multi-scale for training), normalise, and pad the batch.

    Returns ``pixel_values`` ``(N, 3, H, W)`` (ImageNet mean/std), ``pixel_mask`` ``(N, H, W)``
    (bool, True on image pixels) and ``labels``: per image ``class_labels``, ``boxes`` (cx, cy, w, h
    relative to the image before padding), ``image_id`` and ``orig_size``/``size`` (h, w).
    ``H`` and ``W`` are the batch's largest, rounded up to ``size_divisor`` and at least
    ``min_size`` (NOTE [Pad to whole windows]).

    The shorter sides come from one seeded generator (one per DataLoader worker), so two runs
    with the same seed and workers see the same sizes in the same order.
    """

    shortest_edges: tuple[int, ...]
    """Candidate shorter sides; evaluation uses the largest."""
    longest_edge: int
    """Cap on the longer side."""
    size_divisor: int = SIZE_DIVISOR
    """Batches are padded to multiples of this."""
    min_size: int = 0
    """Batches are padded to at least this in both dimensions."""
    seed: int = 0
    per_batch: bool = False
    """Draw one shorter side for the whole batch instead of one per image."""
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self._worker: int | None = None

    def _generator(self) -> np.random.Generator:
        # Each DataLoader worker holds a copy of the collator: seed each copy apart, or every
        # worker would draw the same sizes.
        info = torch.utils.data.get_worker_info()
        if info is not None and self._worker != info.id:
            self._worker = info.id
            self.rng = np.random.default_rng([self.seed, info.id])
        return self.rng

    def __call__(self, features: list[DetectionFeature]) -> dict[str, Any]:
        rng = self._generator()
        batch_edge = int(rng.choice(self.shortest_edges)) if self.per_batch else None
        images, labels = [], []
        for feature in features:
            ex = feature.example
            if not feature.multi_scale:
                edge = max(self.shortest_edges)
            else:
                edge = batch_edge if batch_edge is not None else int(rng.choice(self.shortest_edges))
            size = resized_size(ex.height, ex.width, edge, self.longest_edge)
            images.append(ex.pixels(size))
            labels.append(_target(ex, size))
        unit = self.size_divisor
        height = -(-max(self.min_size, *(im.shape[0] for im in images)) // unit) * unit
        width = -(-max(self.min_size, *(im.shape[1] for im in images)) // unit) * unit
        pixel_values = torch.empty(len(images), 3, height, width)  # each element written once
        # bool, not the int64 of HF's image processors: the DETR family only reads it through
        # `.float()`, and at 16 images of up to 1344 x 1344 pixels int64 is 230 MB to zero,
        # pin and copy to the device per batch, bool 29 MB
        pixel_mask = torch.zeros(len(images), height, width, dtype=torch.bool)
        mean, std = torch.from_numpy(_IMAGENET_MEAN)[:, None, None], torch.from_numpy(_IMAGENET_STD)[:, None, None]
        for i, im in enumerate(images):
            h, w = im.shape[:2]
            pixel_values[i, :, :h, :w] = (torch.from_numpy(im).permute(2, 0, 1) - mean) / std
            pixel_values[i, :, h:] = 0
            pixel_values[i, :, :h, w:] = 0
            pixel_mask[i, :h, :w] = True
        return {"pixel_values": pixel_values, "pixel_mask": pixel_mask, "labels": labels}


def _target(ex: DetectionExample, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    boxes = np.asarray(ex.boxes, dtype=np.float32).reshape(-1, 4)
    scale = np.array([ex.width, ex.height, ex.width, ex.height], dtype=np.float32)
    x, y, w, h = (boxes / scale).T
    return {
        "class_labels": torch.as_tensor(ex.labels, dtype=torch.long).reshape(-1),
        "boxes": torch.from_numpy(np.stack([x + w / 2, y + h / 2, w, h], axis=-1).reshape(-1, 4)),
        "image_id": torch.tensor(ex.image_id),
        "orig_size": torch.tensor([ex.height, ex.width]),
        "size": torch.tensor(size),
    }


# --- data ---------------------------------------------------------------------------------


def read_coco(image_dir: str | Path, annotations: str | Path) -> tuple[list[DetectionExample], list[str]]:
    """Read a COCO instances file whose ``file_name``\\ s live in ``image_dir``.

    Returns:
        ``(examples, class names)``; labels are positions in the names (categories by id).

    Raises:
        MissingFileError: the folder, the file or an image is missing (the first few named).
        DataFileError: the JSON is malformed or an annotation is inconsistent (names the entry).
    """
    image_dir, annotations = Path(image_dir), Path(annotations)
    if not image_dir.is_dir():
        raise MissingFileError(f"{image_dir}: no such image folder")
    if not annotations.is_file():
        raise MissingFileError(f"{annotations}: no such annotations file")
    try:
        data = json.loads(annotations.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFileError(annotations, err.lineno, f"not JSON ({err.msg})") from None
    for key in ("images", "annotations", "categories"):
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise DataFileError(
                annotations, key, "expected a COCO instances file with 'images', 'annotations' and 'categories' lists"
            )
    try:
        categories = sorted(data["categories"], key=lambda c: c["id"])
        label_of = {c["id"]: i for i, c in enumerate(categories)}
        names = [str(c.get("name", c["id"])) for c in categories]
        images = {im["id"]: im for im in data["images"]}
    except (KeyError, TypeError) as err:
        raise DataFileError(annotations, "categories/images", f"an entry lacks {err}") from None
    boxes: dict[Any, list] = {i: [] for i in images}
    for n, ann in enumerate(data["annotations"]):
        where = f"annotations[{n}]"
        try:
            image_id, category, bbox = ann["image_id"], ann["category_id"], [float(v) for v in ann["bbox"]]
        except (KeyError, TypeError, ValueError) as err:
            raise DataFileError(annotations, where, f"needs image_id, category_id and bbox [x, y, w, h] ({err})") from None
        if image_id not in images:
            raise DataFileError(annotations, where, f"image_id {image_id} is not in 'images'")
        if category not in label_of:
            raise DataFileError(annotations, where, f"category_id {category} is not in 'categories'")
        if len(bbox) != 4:
            raise DataFileError(annotations, where, f"bbox has {len(bbox)} numbers, expected [x, y, w, h]")
        if ann.get("iscrowd", 0) or bbox[2] <= 0 or bbox[3] <= 0:
            continue
        boxes[image_id].append((bbox, label_of[category]))
    examples, missing = [], []
    for position, (coco_id, im) in enumerate(images.items()):
        try:
            path, height, width = image_dir / im["file_name"], int(im["height"]), int(im["width"])
        except (KeyError, TypeError, ValueError) as err:
            raise DataFileError(annotations, f"images[{position}]", f"needs file_name, height and width ({err})") from None
        if not path.is_file():
            missing.append(str(path))
            continue
        found = boxes[coco_id]
        examples.append(DetectionExample(
            image=path, height=height, width=width,
            boxes=np.array([b for b, _ in found], dtype=np.float32).reshape(-1, 4),
            labels=np.array([c for _, c in found], dtype=np.int64),
            image_id=len(examples), coco_id=coco_id,
        ))
    if missing:
        raise MissingFileError(
            f"{len(missing)} of {len(images)} images listed in {annotations} are not in {image_dir}: "
            + ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        )
    return examples, names


def synthetic_examples(n: int, seed: int) -> list[DetectionExample]:
    """``n`` synthetic images (module docstring); the same ``seed`` gives the same images."""
    rng = np.random.default_rng(seed)
    sizes = [(h, w) for w, h, _ in _NATIVE_SIZES]
    weights = np.array([p for *_, p in _NATIVE_SIZES])
    examples = []
    for i in range(n):
        height, width = sizes[rng.choice(len(sizes), p=weights / weights.sum())]
        k = int(rng.integers(1, 7))
        short = min(height, width)
        sides = rng.uniform(0.08, 0.45, size=(k, 2)) * short
        x = rng.uniform(0, 1, size=k) * (width - sides[:, 0])
        y = rng.uniform(0, 1, size=k) * (height - sides[:, 1])
        labels = rng.integers(len(SYNTHETIC_CLASSES), size=k)
        hues = np.clip(np.array([_CLASS_HUES[c] for c in labels]) + rng.uniform(-0.1, 0.1, (k, 3)), 0, 1)
        colors = [tuple(float(v) for v in hue) for hue in hues]
        image = SyntheticImage(seed=int(rng.integers(2**31)), background=float(rng.uniform(0.3, 0.7)), colors=colors)
        boxes = np.stack([x, y, sides[:, 0], sides[:, 1]], axis=-1).astype(np.float32)
        examples.append(DetectionExample(image, height, width, boxes, labels.astype(np.int64), image_id=i))
    return examples


def _splits(
    data_args: DataTrainingArguments, seed: int
) -> tuple[list[DetectionExample] | None, list[DetectionExample] | None, list[str]]:
    if data_args.dataset_name:
        raise FlagError(
            "object-detection reads COCO-format folders: pass --train_dir/--train_annotations "
            "(and --validation_dir/--validation_annotations) or --synthetic N instead of --dataset_name"
        )
    if data_args.train_file or data_args.validation_file:
        raise FlagError("object-detection takes --train_dir/--train_annotations, not --train_file/--validation_file")
    if data_args.synthetic:
        n = data_args.synthetic
        train, evals = synthetic_examples(n, seed), synthetic_examples(max(8, n // 10), seed + 1)
        names = list(SYNTHETIC_CLASSES)
    else:
        train = evals = None
        names: list[str] = []
        if data_args.train_dir:
            train, names = read_coco(data_args.train_dir, data_args.train_annotations)
        if data_args.validation_dir:
            evals, eval_names = read_coco(data_args.validation_dir, data_args.validation_annotations)
            if names and eval_names != names:
                raise DataError(
                    f"the categories of --validation_annotations ({', '.join(eval_names)}) differ from "
                    f"those of --train_annotations ({', '.join(names)})"
                )
            names = names or eval_names
    cut = lambda xs, k: xs if xs is None or k is None else xs[:k]  # noqa: E731
    return cut(train, data_args.max_train_samples), cut(evals, data_args.max_eval_samples), names


# --- model --------------------------------------------------------------------------------


def _load_detector(model_args: ModelArguments, names: list[str]) -> Any:
    from transformers import AutoModelForObjectDetection

    labels = {"num_labels": len(names), "id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
    if model_args.model_name_or_path:
        try:
            return AutoModelForObjectDetection.from_pretrained(
                model_args.model_name_or_path, ignore_mismatched_sizes=True, **labels
            )
        except OSError as err:
            raise LoadError(
                f"--model_name_or_path {model_args.model_name_or_path}: cannot load it ({err}). Offline, pass a "
                f"local directory, or --config_name (e.g. the bundled {DEFAULT_CONFIG}) for random weights"
            ) from err
    name = model_args.config_name or str(CONFIGS_DIR / f"{DEFAULT_CONFIG}.json")
    config = load_config(name, **labels)
    logger.info("building %s from config %s with random weights", type(config).__name__, name)
    model = AutoModelForObjectDetection.from_config(config)
    _init_swin_patch_bias(model)
    return model


def _init_swin_patch_bias(model: Any) -> None:
    """Give each Swin patch-embedding conv PyTorch's default bias (NOTE [Swin patch bias])."""
    from transformers.models.swin.modeling_swin import SwinPatchEmbeddings

    for module in model.modules():
        conv = module.projection if isinstance(module, SwinPatchEmbeddings) else None
        if conv is not None and conv.bias is not None:
            bound = 1 / math.sqrt(conv.weight[0].numel())
            with torch.no_grad():
                conv.bias.uniform_(-bound, bound)


def padding_geometry(config: Any) -> tuple[int, int]:
    """``(size_divisor, min_size)`` of batches for a detector's backbone.

    Swin (NOTE [Pad to whole windows]): ``patch · window · 2**(stages-2)`` and the smallest
    multiple of it above ``patch · window · 2**(stages-1)``; other backbones:
    ``(SIZE_DIVISOR, 0)``.
    """
    backbone = getattr(config, "backbone_config", None)
    if getattr(backbone, "model_type", None) != "swin":
        return SIZE_DIVISOR, 0
    stages = len(backbone.depths)
    pixel_window = backbone.patch_size * backbone.window_size
    unit = pixel_window * 2 ** max(0, stages - 2)
    last = pixel_window * 2 ** (stages - 1)
    return unit, (last // unit + 1) * unit


# --- metrics ------------------------------------------------------------------------------


def _logits_and_boxes(outputs: Any, labels: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only the class logits and boxes of the model's outputs (for the Trainer's eval loop).

    The Trainer passes the output fields but the loss, in field order: ``loss_dict`` (with
    labels), ``logits``, ``pred_boxes``, then hidden states that are not kept.
    """
    tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,)) if isinstance(t, torch.Tensor)]
    logits, boxes = tensors[0], tensors[1]
    if boxes.shape[-1] != 4 or boxes.shape[:2] != logits.shape[:2]:
        raise ValueError(f"expected (logits, pred_boxes) first in the outputs, got shapes {logits.shape}, {boxes.shape}")
    return logits.float(), boxes.float()


def _detections(
    logits: np.ndarray, boxes: np.ndarray, num_labels: int, top: int = 100
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(scores, labels, boxes cx,cy,w,h)`` of one image's ``top`` (query, class) pairs."""
    if logits.shape[-1] == num_labels:  # sigmoid (focal loss: Conditional/Deformable DETR)
        probs = 1 / (1 + np.exp(-logits))
    else:  # softmax with a last "no object" class (DETR)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        probs = (e / e.sum(-1, keepdims=True))[:, :num_labels]
    flat = probs.reshape(-1)
    order = np.argsort(-flat, kind="stable")[: min(top, flat.size)]
    return flat[order], order % num_labels, boxes[order // num_labels]


def _xyxy(cxcywh: np.ndarray) -> np.ndarray:
    cx, cy, w, h = np.asarray(cxcywh, dtype=np.float64).reshape(-1, 4).T
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=-1)


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of ``(n, 4)`` and ``(m, 4)`` boxes given as (x0, y0, x1, y1)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def box_match_scores(images: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Two small box-matching scores, threshold-free, for a quick read of a detector.

    For an image with ``g`` ground-truth boxes, its ``g`` highest-scoring detections are kept.
    ``mean_best_iou``: over all ground-truth boxes, the best IoU with a kept detection of its
    class (0 without one). ``precision_iou50``: kept detections matched one-to-one (by score)
    to a ground-truth box of their class with IoU >= 0.5, over all kept detections (it equals
    the recall, as as many are kept as there are boxes).

    Args:
        images: per image ``(scores, labels, boxes, true labels, true boxes)``, boxes as
            (cx, cy, w, h) in any common frame; detections sorted by score, highest first.

    Example:
        >>> box = np.array([[0.5, 0.5, 0.2, 0.2]])
        >>> box_match_scores([(np.array([0.9]), np.array([1]), box, np.array([1]), box)])
        {'mean_best_iou': 1.0, 'precision_iou50': 1.0}
    """
    best, matched, kept = [], 0, 0
    for scores, labels, boxes, true_labels, true_boxes in images:
        g = len(true_labels)
        if g == 0:
            continue
        labels, boxes = labels[:g], _xyxy(boxes[:g])
        iou = _iou(boxes, _xyxy(true_boxes)) * (labels[:, None] == true_labels[None, :])
        best += list(iou.max(axis=0)) if len(labels) else [0.0] * g
        free = np.ones(g, dtype=bool)
        for row in iou:  # detections in score order
            j = int(np.argmax(np.where(free, row, -1)))
            if free[j] and row[j] >= 0.5:
                free[j] = False
                matched += 1
        kept += g
    return {
        "mean_best_iou": float(np.mean(best)) if best else 0.0,
        "precision_iou50": matched / kept if kept else 0.0,
    }


def coco_map(
    detections: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], examples: list[DetectionExample], num_labels: int
) -> dict[str, float] | None:
    """COCO box mAP by ``pycocotools``; ``None`` when it is not installed.

    Args:
        detections: per image ``(image_id, scores, labels, boxes)``, boxes (cx, cy, w, h)
            relative to the image.
        examples: the evaluated examples (ground truth in native pixels), by ``image_id``.
        num_labels: number of classes.

    Returns:
        ``map`` (IoU 0.50:0.95), ``map_50``, ``map_75``.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        return None
    by_id = {ex.image_id: ex for ex in examples}
    seen = [by_id[i] for i, *_ in detections]
    truth = {
        "images": [{"id": ex.image_id, "height": ex.height, "width": ex.width} for ex in seen],
        "categories": [{"id": c} for c in range(num_labels)],
        "annotations": [
            {"id": k + 1, "image_id": ex.image_id, "category_id": int(c), "bbox": [float(v) for v in b],
             "area": float(b[2] * b[3]), "iscrowd": 0}
            for k, (ex, b, c) in enumerate((ex, b, c) for ex in seen for b, c in zip(ex.boxes, ex.labels))
        ],
    }
    results = []
    for image_id, scores, labels, boxes in detections:
        ex = by_id[image_id]
        xyxy = _xyxy(boxes) * [ex.width, ex.height, ex.width, ex.height]
        for s, c, (x0, y0, x1, y1) in zip(scores, labels, xyxy):
            box = [x0, y0, x1 - x0, y1 - y0]
            results.append({"image_id": image_id, "category_id": int(c), "bbox": box, "score": float(s)})
    if not truth["annotations"] or not results:
        return {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    gt = COCO()
    gt.dataset = truth
    gt.createIndex()
    evaluation = COCOeval(gt, gt.loadRes(results), iouType="bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    stats = evaluation.stats
    return {"map": float(stats[0]), "map_50": float(stats[1]), "map_75": float(stats[2])}


def _metrics(examples: list[DetectionExample], num_labels: int):
    note_logged = []

    def compute_metrics(p: Any) -> dict[str, float]:
        # eval_do_concat_batches=False: one entry per batch, in the eval set's order.
        batches = p.predictions if isinstance(p.predictions, list) else [p.predictions]
        label_batches = p.label_ids if isinstance(p.label_ids, list) else [p.label_ids]
        detections, matches = [], []
        for (logits, boxes), targets in zip(batches, label_batches):
            for lg, bx, target in zip(np.asarray(logits), np.asarray(boxes), targets):
                scores, labels, pred = _detections(lg, bx, num_labels)
                image_id = int(np.asarray(target["image_id"]))
                detections.append((image_id, scores, labels, pred))
                matches.append((scores, labels, pred, np.asarray(target["class_labels"]), np.asarray(target["boxes"])))
        metrics = box_match_scores(matches)
        coco = coco_map(detections, examples, num_labels)
        if coco is None and not note_logged:
            note_logged.append(True)
            logger.warning("pycocotools is not installed: COCO mAP skipped (pip install pycocotools); "
                           "reporting mean_best_iou and precision_iou50 only")
        return {**(coco or {}), **metrics}

    return compute_metrics


def build(model_args: ModelArguments, data_args: DataTrainingArguments, seed: int = 42) -> TaskBundle:
    """Load COCO-format or synthetic data and a Swin-backbone detector (module docstring)."""
    edges = shortest_edges(data_args.shortest_edge)
    train, evals, names = _splits(data_args, seed)
    model = _load_detector(model_args, names)
    return TaskBundle(
        model=model,
        tokenizer=None,
        train_dataset=None if train is None else [DetectionFeature(ex, multi_scale=True) for ex in train],
        eval_dataset=None if evals is None else [DetectionFeature(ex, multi_scale=False) for ex in evals],
        data_collator=DetectionCollator(
            edges, data_args.longest_edge, *padding_geometry(model.config), seed=seed,
            per_batch=data_args.multi_scale_per == "batch",
        ),
        compute_metrics=_metrics(evals or [], len(names)),
        preprocess_logits_for_metrics=_logits_and_boxes,
        # Labels are one dict per image: the Trainer's concatenation across batches would
        # zip them image by image, so predictions and labels stay per batch.
        training_overrides={"eval_do_concat_batches": False},
    )
