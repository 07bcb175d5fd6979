"""A user's script for tests/test_round_trip.py: fit with ``--strategy`` (``lordo`` or ``ddp``), optionally resuming
``--resume``, then save ``OUT/last.ckpt``. Run it as a user does (Lightning's launcher re-executes the command line),
never from inside pytest. ``--no-plugin`` makes ``lightning_lordo`` unimportable, as on a machine without it.

Each rank writes ``OUT/rank<r>.pt``: the parameters and the optimizer's state as training starts (after the resume)
and as it ends, and the warnings the resume gave.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    """The 48 x 32 weight takes LoRDO's low-rank step at the default rank 16; the others take AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 48), nn.GELU(), nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.start = out, {}

    @staticmethod
    def _snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        optimizer = trainer.optimizers[0]
        return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                "optimizer": type(optimizer).__name__,
                "state": {n: {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
                          for n, p in module.named_parameters() if optimizer.state.get(p)},
                "global_step": trainer.global_step}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = self._snapshot(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.save({"start": self.start, "end": self._snapshot(trainer, module),
                    "warnings": [str(w.message) for w in caught], "world_size": trainer.world_size},
                   self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--no-plugin", action="store_true")
    args = parser.parse_args()
    if args.no_plugin:
        sys.modules["lightning_lordo"] = None  # type: ignore[assignment]  # `import lightning_lordo` now fails
    else:
        import lightning_lordo  # noqa: F401  (registers the strategy names)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    data = DataLoader(TensorDataset(x, torch.tanh(x @ torch.randn(8, 2, generator=generator))), batch_size=8)
    torch.manual_seed(0)
    trainer = L.Trainer(strategy=args.strategy, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record(args.out)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(), data, ckpt_path=args.resume)
    trainer.save_checkpoint(args.out / "last.ckpt")
