"""One node of two (``NODE_RANK=0``, ``num_nodes=2``) whose peer never joins, with a 2 s timeout: for
tests/test_state_faults.py, run as a user's script (never inside pytest); ``fabric``: Fabric's setup instead."""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lordo import LoRDOFabricStrategy, LoRDOStrategy


class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def training_step(self, batch, i):
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


if sys.argv[1:] == ["fabric"]:
    fabric = L.Fabric(strategy=LoRDOFabricStrategy(timeout=2), accelerator="cpu", devices=1, num_nodes=2)
    fabric.launch()
    model = M()
    fabric.setup(model, torch.optim.AdamW(model.parameters()))
else:
    L.Trainer(strategy=LoRDOStrategy(timeout=2), accelerator="cpu", devices=1, num_nodes=2, max_steps=1,
              logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(
        M(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
