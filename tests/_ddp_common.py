"""Shared by the DDP worker and test: model, batches and per-rank length schedules."""

import torch

from _models import VOCAB, build

STEPS = 6
# Rank 0 sees short inputs, rank 1 long ones: under one budget they plan differently.
LENGTHS = {0: [8, 12, 10, 16, 9, 14], 1: [96, 40, 88, 64, 92, 80]}


def build_model():
    torch.manual_seed(0)
    model, _ = build("bert")
    return model.train()


def batch(step: int, rank: int, length: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(3, VOCAB, (4, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (4,), generator=g)}
