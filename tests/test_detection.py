"""object-detection: a tiny Conditional DETR with a Swin backbone (the bundled micro config).

Blocks are the Swin layers (not the stages) and the detector's layers; the shape key counts
patches, linear in pixels; gradients are exact under checkpointing with dropout on; the
synthetic set is learnable; `memfit train object-detection` trains under a logical budget;
COCO folders are read, and bad ones fail with the file named.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers import HfArgumentParser

import memfit
from _models import logical_peak, step_both_and_compare
from memfit.engine.parts.blocks import find_blocks
from memfit.tasks import DataFileError, DataTrainingArguments, ModelArguments, get_task
from memfit.tasks import object_detection as det
from memfit.tasks._common import CONFIGS_DIR, load_config
from memfit.cli.train import run

MICRO = str(CONFIGS_DIR / "conditional-detr-swin-micro.json")
# Sides of 96-192 pixels: the micro backbone's batches are multiples of 32, at least 96.
SMALL = dict(shortest_edge="96-192", longest_edge=256)


def _micro(dropout: float = 0.0):
    """The micro detector (3 classes) with Swin dropout ``dropout`` (DETR's own is 0.1)."""
    from transformers import AutoModelForObjectDetection

    config = load_config(MICRO, num_labels=3)
    config.backbone_config.hidden_dropout_prob = dropout
    config.backbone_config.attention_probs_dropout_prob = dropout
    torch.manual_seed(0)
    return AutoModelForObjectDetection.from_config(config)


def _batches(n_batches: int, batch_size: int = 2, seed: int = 0):
    examples = det.synthetic_examples(n_batches * batch_size, seed)
    collate = det.DetectionCollator(det.shortest_edges(SMALL["shortest_edge"]), SMALL["longest_edge"], 32, 96, seed=seed)
    features = [det.DetectionFeature(ex, multi_scale=True) for ex in examples]
    return [collate(features[i : i + batch_size]) for i in range(0, len(features), batch_size)]


def test_blocks_are_the_swin_layers_then_the_detector_layers():
    from transformers.models.swin.modeling_swin import SwinLayer

    model = _micro()
    names = [name for name, _ in find_blocks(model)]
    swin = [name for name, module in find_blocks(model) if isinstance(module, SwinLayer)]
    depths = model.config.backbone_config.depths
    assert swin == [
        f"model.backbone.model.swin.encoder.layers.{s}.blocks.{b}" for s, depth in enumerate(depths) for b in range(depth)
    ]
    assert names == swin + ["model.encoder.layers.0", "model.decoder.layers.0"]


def test_shape_key_counts_patches_and_swin_memory_is_linear_in_pixels():
    # Sides in whole pixel-windows of stage 3 (NOTE [Pad to whole windows]): every layer of
    # stages 1-3 saves bytes linear in the patches (a few bytes of constant), whatever the
    # aspect ratio: 96x160 and 160x96 save the same.
    model = _micro()
    model.train()
    ctl = memfit.fit(model, budget=None, method="dynamic", warmup_steps=4, warmup_keys=4, max_warmup_steps=4)
    sizes = [(96, 96), (96, 160), (160, 96), (128, 192)]
    labels = [{"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3]])}] * 2
    for h, w in sizes:
        model(pixel_values=torch.randn(2, 3, h, w), pixel_mask=torch.ones(2, h, w, dtype=torch.long), labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    assert [r.shape[:2] for r in records] == [[2, h * w // 16] for h, w in sizes]
    assert [r.tokens for r in records] == [2 * h * w // 16 for h, w in sizes]
    model_ = ctl.planning.model
    first_three_stages = {model_.groups[i] for i in range(sum(model.config.backbone_config.depths[:3]))}
    for group in first_three_stages:
        curve = model_.group_models[group].bytes["keep"]
        patches = np.array([n * t for n, t in curve.xs], dtype=float)
        slope, intercept = np.polyfit(patches, curve.ys, 1)
        assert slope > 0 and abs(intercept) < 1024, (group, slope, intercept)
        assert np.abs(slope * patches + intercept - curve.ys).max() < 1, f"group {group}: {curve.xs} {curve.ys}"
    ctl.remove()


def test_gradients_equal_with_and_without_checkpointing():
    model = _micro(dropout=0.1)
    model.train()
    reference = copy.deepcopy(model)
    batches = _batches(4)
    largest = max(batches, key=lambda b: b["pixel_values"].numel())
    budget = (logical_peak(model, largest, "none") + logical_peak(model, largest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", warmup_steps=2, warmup_keys=2)
    for step, batch in enumerate(batches * 2):
        step_both_and_compare(model, reference, batch, 1000 + step, f"step {step}")
    steady = [r for r in ctl.records if r.phase == "steady"]
    assert any(0 < r.n_checkpointed < r.n_blocks for r in steady), "no partial plan: the test checks nothing"
    ctl.remove()


def test_synthetic_set_is_learnable():
    bundle = get_task("object-detection").build(
        ModelArguments(config_name=MICRO), DataTrainingArguments(synthetic=16, shortest_edge="96-128", longest_edge=160), seed=0
    )
    model = bundle.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    losses = []
    for step in range(30):
        batch = bundle.data_collator(bundle.train_dataset[(2 * step) % 16 :][:2])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.5, losses


@pytest.mark.slow
def test_memfit_train_object_detection_under_a_logical_budget(tmp_path):
    # Peaks of this run, counted: about 37 MB at the largest batch without checkpointing,
    # 15 MB with every block checkpointed.
    metrics = run("object-detection", [
        "--config_name", "conditional-detr-swin-micro", "--synthetic", "16", "--shortest_edge", "96-192",
        "--longest_edge", "256", "--do_train", "--do_eval", "--max_steps", "8", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "4", "--memory_budget", "26MB", "--memfit_method", "dynamic",
        "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path), "--use_cpu",
    ])
    assert {"eval_mean_best_iou", "eval_precision_iou50", "train_loss"} <= set(metrics)
    records = [json.loads(line) for line in (tmp_path / "memfit_steps.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["n_blocks"] for r in records} == {10}
    assert all(r["peak_allocated_bytes"] <= r["budget_bytes"] == 26 * 10**6 for r in records)
    steady = [r for r in records if r["phase"] == "steady"]
    assert steady and any(0 < r["n_checkpointed"] < 10 for r in steady)
    summary = json.loads((tmp_path / "memfit_summary.json").read_text())
    assert sum(e["steps"] for e in summary["memory_count"].values()) == 8


# --- data ---------------------------------------------------------------------------------


def test_random_swin_gradients_stay_bounded_on_padded_batches():
    # NOTE [Swin patch bias]: with transformers' zero patch-conv bias, padding embeds to exact
    # zeros and every LayerNorm over it multiplies the gradient by 1/sqrt(eps); the micro
    # backbone's gradient norm was 1e11 on this batch (Swin-B's overflowed fp32), 32 with the fix.
    torch.manual_seed(0)
    bundle = det.build(ModelArguments(config_name=MICRO), DataTrainingArguments(synthetic=2, shortest_edge="96", longest_edge=1333))
    model = bundle.model
    model.train()
    small = det.DetectionCollator((96,), 1333, *det.padding_geometry(model.config))([bundle.train_dataset[0]])
    large = det.DetectionCollator((288,), 1333, *det.padding_geometry(model.config))([bundle.train_dataset[1]])
    height, width = large["pixel_values"].shape[-2:]
    h, w = small["pixel_values"].shape[-2:]
    pixel_values, pixel_mask = torch.zeros(2, 3, height, width), torch.zeros(2, height, width, dtype=torch.long)
    pixel_values[0, :, :h, :w], pixel_mask[0, :h, :w] = small["pixel_values"][0], small["pixel_mask"][0]
    pixel_values[1], pixel_mask[1] = large["pixel_values"][0], large["pixel_mask"][0]
    assert pixel_mask[0].float().mean() < 0.2  # the small image is mostly padding
    model(pixel_values=pixel_values, pixel_mask=pixel_mask, labels=small["labels"] + large["labels"]).loss.backward()
    backbone = [p.grad for n, p in model.named_parameters() if "backbone" in n and p.grad is not None]
    norm = torch.stack([g.double().norm() for g in backbone]).norm().item()
    assert 0 < norm < 1e4


def test_multi_scale_sizes_and_padding(monkeypatch):
    assert det.shortest_edges("480-800") == tuple(range(480, 801, 32))
    assert det.resized_size(480, 640, 800, 1333) == (800, 1067)
    assert det.resized_size(360, 640, 800, 1333) == (750, 1333)  # the longer side is capped
    with pytest.raises(ValueError, match="--shortest_edge '800-480'"):
        det.shortest_edges("800-480")
    swin_t = load_config(str(CONFIGS_DIR / "conditional-detr-swin-tiny.json"))
    assert det.padding_geometry(swin_t) == (112, 336)  # 4 px patches x 7 windows x stride 4; > 224

    examples = det.synthetic_examples(12, seed=3)
    collate = det.DetectionCollator((96, 128, 160), 200, 32, 96, seed=0)
    empty = torch.empty  # the batch is allocated uninitialised: make that visible
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(7))
    train = collate([det.DetectionFeature(ex, multi_scale=True) for ex in examples])
    monkeypatch.undo()
    sizes = [tuple(t["size"].tolist()) for t in train["labels"]]
    for ex, size in zip(examples, sizes):  # a shorter side drawn per image, the longer capped
        assert size in {det.resized_size(ex.height, ex.width, e, 200) for e in (96, 128, 160)}
    assert len(set(sizes)) > 2
    n, c, h, w = train["pixel_values"].shape
    assert (n, c) == (12, 3) and h % 32 == 0 and w % 32 == 0 and h == -(-max(s[0] for s in sizes) // 32) * 32
    for i, (sh, sw) in enumerate(sizes):
        assert train["pixel_mask"][i].sum() == sh * sw and train["pixel_mask"][i, :sh, :sw].all()
        padding = torch.ones(h, w, dtype=torch.bool)
        padding[:sh, :sw] = False
        assert train["pixel_values"][i][:, padding].eq(0).all()  # zero below and right of the image
    evals = collate([det.DetectionFeature(ex, multi_scale=False) for ex in examples[:2]])
    assert all(min(t["size"].tolist()) == 160 or max(t["size"].tolist()) == 200 for t in evals["labels"])


def test_a_bool_pixel_mask_trains_as_hfs_int64_one():
    """The collator's mask is bool (an eighth of int64's bytes); the DETR family
    reads it through `.float()`, so the loss and gradients are those of HF's int64 mask."""
    batch = _batches(1)[0]
    assert batch["pixel_mask"].dtype == torch.bool and not batch["pixel_mask"].all()  # padding is there
    grads = []
    for mask in (batch["pixel_mask"], batch["pixel_mask"].long()):
        model = _micro()
        model.train()
        torch.manual_seed(0)
        loss = model(pixel_values=batch["pixel_values"], pixel_mask=mask, labels=batch["labels"]).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    (loss_bool, g_bool), (loss_long, g_long) = grads
    assert torch.equal(loss_bool, loss_long) and len(g_bool) == len(g_long)
    assert all(torch.equal(a, b) for a, b in zip(g_bool, g_long))


def test_multi_scale_per_batch_draws_one_shorter_side_per_batch():
    examples = det.synthetic_examples(40, seed=3)
    features = [det.DetectionFeature(ex, multi_scale=True) for ex in examples]
    bundle = det.build(
        ModelArguments(config_name=MICRO),
        DataTrainingArguments(synthetic=2, shortest_edge="96-160", longest_edge=1333, multi_scale_per="batch"),
    )
    collate = bundle.data_collator
    edges_seen = set()
    for i in range(0, 40, 4):
        batch = collate(features[i : i + 4])
        edges = {min(t["size"].tolist()) for t in batch["labels"]}
        assert len(edges) == 1, edges  # every image of the batch at one scale
        edges_seen |= edges
    assert len(edges_seen) > 1  # and batches at several
    with pytest.raises(SystemExit):  # the flag takes image or batch only
        HfArgumentParser(DataTrainingArguments).parse_args_into_dataclasses(["--multi_scale_per", "epoch"])


@pytest.fixture()
def coco_folder(tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (40, 30), (255, 0, 0)).save(images / "a.png")
    Image.new("RGB", (20, 50), (0, 0, 255)).save(images / "b.png")
    annotations = {
        "images": [{"id": 7, "file_name": "a.png", "width": 40, "height": 30},
                   {"id": 9, "file_name": "b.png", "width": 20, "height": 50}],
        "categories": [{"id": 5, "name": "dog"}, {"id": 2, "name": "cat"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 5, "bbox": [10, 0, 20, 15], "iscrowd": 0},
            {"id": 2, "image_id": 7, "category_id": 2, "bbox": [0, 0, 40, 30], "iscrowd": 1},
            {"id": 3, "image_id": 9, "category_id": 2, "bbox": [0, 25, 10, 25]},
        ],
    }
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(annotations))
    return images, path, annotations


def test_coco_folder_is_read_and_collated(coco_folder):
    images, path, _ = coco_folder
    examples, names = det.read_coco(images, path)
    assert names == ["cat", "dog"]  # categories in id order, renumbered 0..C-1
    assert [ex.coco_id for ex in examples] == [7, 9] and [ex.labels.tolist() for ex in examples] == [[1], [0]]
    batch = det.DetectionCollator((60,), 100, 32, 0)([det.DetectionFeature(ex, False) for ex in examples])
    a, b = batch["labels"]
    torch.testing.assert_close(a["boxes"], torch.tensor([[0.5, 0.25, 0.5, 0.5]]))  # crowd box dropped
    torch.testing.assert_close(b["boxes"], torch.tensor([[0.25, 0.75, 0.5, 0.5]]))
    assert a["size"].tolist() == [60, 80] and b["size"].tolist() == [100, 40]
    assert batch["pixel_values"].shape == (2, 3, 128, 96)
    red = (1 - 0.485) / 0.229
    assert batch["pixel_values"][0, 0, :60, :80].allclose(torch.tensor(red)) and batch["pixel_values"][0, :, 60:].eq(0).all()


def test_bad_data_paths_and_files_give_clear_errors(coco_folder, tmp_path):
    images, path, annotations = coco_folder
    with pytest.raises(FileNotFoundError, match="nowhere: no such image folder"):
        det.read_coco(tmp_path / "nowhere", path)
    with pytest.raises(FileNotFoundError, match="missing.json: no such annotations file"):
        det.read_coco(images, tmp_path / "missing.json")
    (images / "b.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 of 2 images listed in .*instances\.json are not in .*b\.png"):
        det.read_coco(images, path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**annotations, "annotations": [{"image_id": 3, "category_id": 5, "bbox": [0, 0, 1, 1]}]}))
    with pytest.raises(DataFileError, match=r"bad\.json:annotations\[0\]: image_id 3 is not in 'images'"):
        det.read_coco(images, bad)
    bad.write_text("{}")
    with pytest.raises(DataFileError, match="expected a COCO instances file"):
        det.read_coco(images, bad)
    with pytest.raises(ValueError, match="--train_dir and --train_annotations go together"):
        DataTrainingArguments(train_dir=str(images))
    with pytest.raises(FileNotFoundError, match="no such image folder"):
        run("object-detection", ["--config_name", MICRO, "--train_dir", str(tmp_path / "nowhere"), "--train_annotations",
                                 str(path), "--do_train", "--output_dir", str(tmp_path / "out"), "--report_to", "none"])


# --- metrics ------------------------------------------------------------------------------


def test_box_match_scores_by_hand():
    truth_labels, truth = np.array([0, 1]), np.array([[0.25, 0.25, 0.5, 0.5], [0.75, 0.75, 0.5, 0.5]])
    # Kept: the 2 best. The first covers truth 0 exactly; the second has class 1 and covers
    # half of truth 1 (IoU 1/2 against the box 0.5 x 0.5: intersection 1/8, union 1/4).
    scores = np.array([0.9, 0.8, 0.7])
    labels = np.array([0, 1, 1])
    boxes = np.array([[0.25, 0.25, 0.5, 0.5], [0.75, 0.625, 0.5, 0.25], [0.75, 0.75, 0.5, 0.5]])
    got = det.box_match_scores([(scores, labels, boxes, truth_labels, truth)])
    assert got == {"mean_best_iou": pytest.approx(0.75), "precision_iou50": 1.0}
    wrong_class = det.box_match_scores([(scores, np.array([1, 0, 1]), boxes, truth_labels, truth)])
    assert wrong_class == {"mean_best_iou": 0.0, "precision_iou50": 0.0}


def test_coco_map_with_pycocotools():
    pytest.importorskip("pycocotools")
    examples = det.synthetic_examples(3, seed=0)
    detections = []
    for ex in examples:
        x, y, w, h = (ex.boxes / [ex.width, ex.height, ex.width, ex.height]).T
        boxes = np.stack([x + w / 2, y + h / 2, w, h], axis=-1)
        detections.append((ex.image_id, np.linspace(0.9, 0.5, len(boxes)), ex.labels, boxes))
    got = det.coco_map(detections, examples, len(det.SYNTHETIC_CLASSES))
    assert got == {"map": pytest.approx(1.0), "map_50": pytest.approx(1.0), "map_75": pytest.approx(1.0)}
