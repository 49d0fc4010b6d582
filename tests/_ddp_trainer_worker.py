"""One rank of the 2-process CPU Trainer test (torchrun, gloo): see test_distributed.py."""

import sys

import memfit
from test_hf import _collate, _dataset
from _models import build
from _ddp_common import leave

import torch

torch.manual_seed(0)
model, _ = build("bert")
args = memfit.TrainingArguments(
    output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=4, report_to="none",
    save_strategy="no", use_cpu=True, ddp_backend="gloo", seed=0, memory_budget="40MB", logging_steps=1,
)
memfit.Trainer(model=model, args=args, train_dataset=_dataset(), data_collator=_collate).train()
leave()  # gloo's teardown can abort a rank at exit (_ddp_common.leave)
