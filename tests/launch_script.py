"""A user's training script, for tests/test_launch.py: ``Trainer(strategy="lordo")`` launched from outside.

Run it as a user does (``torchrun --nproc_per_node=2 launch_script.py OUT --devices 2``, or once per node with
``NODE_RANK`` set and ``--num-nodes 2 --devices 1``), never from inside pytest: Lightning's default launcher
re-executes the command line. Each rank writes what the test checks to ``OUT/rank<global rank>.pt``: how it joined
(world size, global, local and node rank, the cluster environment), the data indices it trained on, its local
parameters mid-round, the synchronizations (``strategy.sync_reports``, the accountant's byte totals) and its final
``state_dict``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDOStrategy

MAX_STEPS = 40  # "lordo" syncs every 16 steps: syncs at steps 16 and 32, the final one at step 40
MID_ROUND_STEP = 8  # local replicas have trained apart by then


class Indexed(Dataset):
    """A synthetic regression whose samples carry their index, so each rank can report what it trained on."""

    def __init__(self, n: int = 160) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = torch.tanh(self.x @ torch.randn(8, 2, generator=generator))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Tiny(L.LightningModule):
    """The 48 x 32 weight takes LoRDO's low-rank step at the default rank 16; the others take AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 48), nn.GELU(), nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 2))
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen += index.tolist()
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Report(L.Callback):
    """Each rank's mid-round parameters, then everything the test checks, written at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.mid_round: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == MID_ROUND_STEP:
            self.mid_round = [p.detach().clone() for p in module.parameters()]

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, LoRDOStrategy), type(strategy)
        torch.save({
            "world_size": trainer.world_size, "global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank, "num_nodes": trainer.num_nodes,
            "environment": type(strategy.cluster_environment).__name__,
            "dist_world_size": torch.distributed.get_world_size(), "dist_rank": torch.distributed.get_rank(),
            "global_step": trainer.global_step, "seen": module.seen, "mid_round": self.mid_round,
            "syncs": [{"step": r.step, "bytes": r.bytes_sent, "by_purpose": r.bytes_by_purpose, "skipped": r.skipped}
                      for r in strategy.sync_reports],
            "totals": dict(strategy.accountant.totals), "final_sync_done": strategy.final_sync_done,
            "lowrank": [row["name"] for row in strategy.parameter_plan() if row["step"] == "lowrank"],
            "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
        }, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(7 + int(os.environ.get("RANK", os.environ.get("NODE_RANK", "0"))))  # replicas start apart
    trainer = L.Trainer(strategy="lordo", accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                        max_steps=MAX_STEPS, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report(args.out)])
    trainer.fit(Tiny(), DataLoader(Indexed(), batch_size=4, shuffle=True))


if __name__ == "__main__":
    main()
