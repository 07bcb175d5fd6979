"""A user's script under the Trainer (popen launcher, 2 processes), for tests/test_lifecycle.py: run as a user runs it,
never inside pytest. Two fits with ``overlap_steps`` make one side group for the rounds' thread, not one per fit;
then a fit that fails with a round in flight must end with the user's exception, not an abort of that thread."""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lordo import LoRDOStrategy

made = []
_new_group = dist.new_group


def counted_new_group(*args, **kwargs):
    made.append(kwargs.get("backend"))
    return _new_group(*args, **kwargs)


dist.new_group = counted_new_group


class M(L.LightningModule):
    def __init__(self, fail_at: int = -1):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail_at = fail_at

    def training_step(self, batch, i):
        if i == self.fail_at:
            assert self.trainer.strategy.synchronizer.in_flight is not None  # the round launched at step 2
            raise ValueError(f"the user's own error on rank {self.global_rank}")
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


data = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4)
strategy = LoRDOStrategy(sync_every=2, overlap_steps=1, timeout=30, optimizer={"rank": 2})
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(M(), data)
groups_after_one = len(made)
trainer.fit_loop.epoch_loop.max_steps = 8
trainer.fit(M(), data)
print(f"rank {trainer.global_rank}: side groups made {groups_after_one} then {len(made)}", file=sys.stderr)
if sys.argv[1:] == ["fail"]:
    L.Trainer(strategy=LoRDOStrategy(sync_every=2, overlap_steps=1, timeout=30, optimizer={"rank": 2}),
              accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(M(fail_at=2), data)
