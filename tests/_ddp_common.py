"""Shared by the DDP worker and test: model, batches, per-rank length schedules, the workers' exit."""

import os
import sys

import torch
import torch.distributed as dist

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


def leave() -> None:
    """End a gloo worker: both ranks reach the end together, then leave without gloo's
    teardown, which can abort a rank ("terminate called without an active exception") when the
    host is loaded; what the test compares is written by then."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
