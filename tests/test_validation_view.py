"""Validation during ``fit`` sees the synchronized model (the anchor), identical on every rank, in the middle of a
round; each worker's own replica comes back afterwards (README, "Which model you validate"). 2 processes."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, gather, loader, lordo, trainer

pytestmark = pytest.mark.slow  # multi-process; CI runs it, -m 'not slow' skips it

K = 4


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


class Seen(TinyRegressor):
    """Records the weights each validation step runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.validated: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(flat(self.parameters()))
        super().validation_step(batch, batch_idx)


class Around(L.Callback):
    """Before the strategy's validation hooks (callbacks run first): the replica and the anchor; at the next training
    batch: the weights, which must be the replica again; at the end, the checks."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_validation_start(self, trainer: L.Trainer, module: Seen) -> None:
        sync = trainer.strategy.synchronizer
        self.records.append({"steps_since_sync": sync.steps_since_sync, "replica": flat(module.parameters()),
                             "anchor": flat(sync.anchor.tensors), "first": len(module.validated)})

    def on_train_batch_start(self, trainer: L.Trainer, module: Seen, *args: Any) -> None:
        for record in self.records:
            record.setdefault("after", flat(module.parameters()))

    def on_train_end(self, trainer: L.Trainer, module: Seen) -> None:
        mid_round = [r for r in self.records if r["steps_since_sync"] > 0]
        assert len(mid_round) >= 1, [r["steps_since_sync"] for r in self.records]
        for record in mid_round:
            assert "after" in record, "no training batch after the validation"
            assert not torch.equal(record["replica"], record["anchor"]), "mid-round, the replica should differ"
            seen = module.validated[record["first"]]
            assert torch.equal(seen, record["anchor"]), "validation did not run on the synchronized model"
            copies = gather(seen)
            assert all(torch.equal(copies[0], c) for c in copies[1:]), "the ranks validated different models"
            assert torch.equal(record["after"], record["replica"]), "the replica did not come back after validation"


def test_validation_in_the_middle_of_a_round_sees_the_synchronized_model() -> None:
    torch.manual_seed(0)
    around = Around()
    trainer(lordo(sync_every=K), callbacks=[around], max_steps=2 * K, val_check_interval=K // 2 + 1,
            check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0
            ).fit(Seen(), loader(), loader(n=32))
