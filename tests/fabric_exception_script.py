"""A user's Fabric loop that fails with a round in flight (``overlap_steps``), for tests/test_state_faults.py: run as a
user runs it (Fabric's launcher re-executes the command line), never inside pytest. The user's exception must be what
the process ends with, not an abort of the round's thread."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_lordo import LoRDOFabricStrategy


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=LoRDOFabricStrategy(sync_every=2, overlap_steps=1,
                                                                               timeout=30))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(1, 4):
        fabric.backward(model(torch.randn(8, 16)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:  # the round launched at this step is in flight
            assert fabric.strategy.synchronizer.in_flight is not None
            raise ValueError(f"the user's own error on rank {fabric.global_rank}")


if __name__ == "__main__":
    main()
