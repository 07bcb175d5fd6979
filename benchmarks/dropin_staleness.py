"""How stale is LoRDO's validation at step 50 in ``dropin.py``? (issue 30, one-off, printed)

Mid-round, the strategy validates the synchronized model, the anchor of the last sync: at step 50 with K = 16 that is
step 48's model, while DDP's is step 50's. Each run is ``dropin.run_one`` on one of its families (the demo
Transformer by default; 2 processes, the user's LR) with one change:

* ``ddp48``: DDP validated at steps 48 and 96 (the steps LoRDO's step-50 and step-100 validations show);
* ``anchor``: LoRDO validated as the strategy does, at steps 50, 100 and 150 (the last: the fit's final sync has
  run); mid-round that is the anchor, the model of the last sync (steps 48 and 96);
* ``mean``: the same run validated on the mean of the workers' replicas (a callback all-reduces the parameters and
  floating-point buffers before validation and restores each replica's after; the anchor swap is turned off).

    cd benchmarks && python dropin_staleness.py MODE SEED LR [FAMILY]   # prints one RESULT line (FAMILY: transformer)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import dropin
import lightning as L
import torch.distributed as dist

from lightning_lordo.lightning import saving

DATA = str(dropin.ROOT.parent.parent / "shared" / "data" / "wikitext2-valid.txt")


class ReplicaMean(L.Callback):
    """At validation: the mean of the workers' replicas in the model, parameters and floating-point buffers (BatchNorm
    statistics, which a sync averages too), each worker's own restored after."""

    @staticmethod
    def _tensors(module: L.LightningModule) -> list[Any]:
        return [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.saved = [t.detach().clone() for t in self._tensors(module)]
        for t in self._tensors(module):
            dist.all_reduce(t.data)
            t.data.div_(dist.get_world_size())

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for t, mine in zip(self._tensors(module), self.saved):
            t.data.copy_(mine)


def main(mode: str, seed: int, lr: float, family: str = "transformer") -> dict[str, Any]:
    if mode not in ("ddp48", "anchor", "mean"):
        raise SystemExit(f"MODE is ddp48, anchor or mean, not {mode!r}")
    dropin.SHORT, dropin.STEPS = (48, 96) if mode == "ddp48" else (50, 150)
    method = "ddp" if mode == "ddp48" else "lordo"
    if mode == "mean":
        saving.SynchronizedState._mid_round = lambda self: False  # validate the replica, which the callback averages
        trainer = L.Trainer
        dropin.L.Trainer = lambda *a, callbacks=(), **kw: trainer(*a, callbacks=[ReplicaMean(), *callbacks], **kw)
    out = dropin.run_one({"family": family, "method": method, "lr": lr, "seed": seed}, DATA)
    return {"mode": mode, "family": family, "seed": seed, "lr": lr, "losses": out["losses"]}


if __name__ == "__main__":
    print("RESULT", json.dumps(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])))
