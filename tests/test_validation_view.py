"""Validation during ``fit`` sees the synchronized model (the anchor and the buffers of the last sync), identical on
every rank, in the middle of a round, and so do checkpoints; each worker's own replica comes back afterwards (README,
"Which model you validate"). 2 processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, gather, loader, lordo, trainer
from torch import nn

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
    """The replica and the anchor at the training batch before each validation; at the validation's start (this
    callback's hook runs before the strategy's, after the strategy's first callback's), the weights, which must already
    be the anchor there; at the next training batch, the weights, which must be the replica again; then the checks."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.replica: Any = None
        self.anchor: Any = None

    def on_train_batch_end(self, trainer: L.Trainer, module: Seen, *args: Any) -> None:
        self.replica = flat(module.parameters())
        self.anchor = flat(trainer.strategy.synchronizer.anchor.tensors)  # (validation swaps the two)

    def on_validation_start(self, trainer: L.Trainer, module: Seen) -> None:
        sync = trainer.strategy.synchronizer
        self.records.append({"steps_since_sync": sync.steps_since_sync, "replica": self.replica,
                             "at_start": flat(module.parameters()), "anchor": self.anchor,
                             "first": len(module.validated)})

    def on_train_batch_start(self, trainer: L.Trainer, module: Seen, *args: Any) -> None:
        for record in self.records:
            record.setdefault("after", flat(module.parameters()))

    def on_train_end(self, trainer: L.Trainer, module: Seen) -> None:
        mid_round = [r for r in self.records if r["steps_since_sync"] > 0]
        assert len(mid_round) >= 1, [r["steps_since_sync"] for r in self.records]
        for record in mid_round:
            assert "after" in record, "no training batch after the validation"
            assert not torch.equal(record["replica"], record["anchor"]), "mid-round, the replica should differ"
            assert torch.equal(record["at_start"], record["anchor"]), "on_validation_start saw the replica"
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


class BatchNormSeen(Seen):
    """With a BatchNorm, whose running statistics are each rank's own between syncs: records the floating buffers
    each validation step runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.GELU(), nn.Linear(24, 3))
        self.validated_buffers: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated_buffers.append(flat(b for b in self.buffers() if b.is_floating_point()))
        super().validation_step(batch, batch_idx)


class Buffers(L.Callback):
    """The floating buffers at the start and after each sync (identical on every rank), at the training batch before
    each validation (the rank's own), at the validation's start (the synchronized ones already) and at the next
    training batch; a checkpoint written mid-round (step K + 2)."""

    def __init__(self, path: Path) -> None:
        self.path, self.synced, self.records, self.last_own = path, None, [], None

    @staticmethod
    def own(module: L.LightningModule) -> torch.Tensor:
        return flat(b for b in module.buffers() if b.is_floating_point())

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.synced = self.own(module)  # the first synchronized model: the one every rank starts from

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        self.last_own = self.own(module)
        if sync.steps_since_sync == 0:
            self.synced = self.own(module)
            assert all(torch.equal(self.synced, c) for c in gather(self.synced)), "buffers differ after a sync"
        if trainer.global_step == K + 2:
            trainer.save_checkpoint(self.path)
            assert self.synced is not None and not torch.equal(self.own(module), self.synced), "not mid-round"
            if trainer.global_rank == 0:
                saved = torch.load(self.path, weights_only=True)["state_dict"]
                names = [n for n, b in module.named_buffers() if b.is_floating_point()]
                assert torch.equal(flat(saved[n] for n in names), self.synced), "the checkpoint holds rank 0's own"

    def on_validation_start(self, trainer: L.Trainer, module: BatchNormSeen) -> None:
        if trainer.strategy.synchronizer.steps_since_sync > 0:
            self.records.append({"own": self.last_own, "at_start": self.own(module), "synced": self.synced,
                                 "first": len(module.validated_buffers)})

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        for record in self.records:
            record.setdefault("after", self.own(module))

    def on_train_end(self, trainer: L.Trainer, module: BatchNormSeen) -> None:
        assert self.records
        for record in self.records:
            seen = module.validated_buffers[record["first"]]
            assert not torch.equal(record["own"], record["synced"]), "mid-round, a rank's own buffers should differ"
            assert torch.equal(seen, record["synced"]), "validation did not run with the synchronized buffers"
            assert torch.equal(record["at_start"], record["synced"]), "on_validation_start saw a rank's own buffers"
            assert torch.equal(record["after"], record["own"]), "the rank's own buffers did not come back"


def test_between_syncs_validation_and_checkpoints_see_the_synchronized_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=K), callbacks=[Buffers(tmp_path / "mid.ckpt")], max_steps=2 * K,
            val_check_interval=K // 2 + 1, check_val_every_n_epoch=None, limit_val_batches=2,
            num_sanity_val_steps=0).fit(BatchNormSeen(), loader(), loader(n=32))


class WiderBatchNorm(BatchNormSeen):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 3))


def test_a_second_fit_keeps_no_copy_of_the_first_fits_buffers(tmp_path: Path) -> None:
    """One Trainer, two fits of different models (one process, rounds after a warm-up of 2 steps): the first fit's
    copy of its buffers is not the second's (it was kept across fits, and a mid-round checkpoint of the second model
    could take the first model's statistics); after the second fit's first round, its own model's are copied."""
    class Check(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            copy, steps = trainer.strategy._synced_buffers, trainer.strategy.synchronizer.optimizer_steps
            if isinstance(module, WiderBatchNorm) and steps < 2 + K:
                assert copy is None, steps
            if isinstance(module, WiderBatchNorm) and steps >= 2 + K:
                assert copy is not None and copy[0].shape == (32,), steps

    fit = trainer(lordo(sync_every=K, start_method="popen", synchronous=False, warmup_steps=2), devices=1,
                  max_steps=2 + K + 1, callbacks=[Check()])
    fit.fit(BatchNormSeen(), loader())
    assert fit.strategy._synced_buffers is not None and fit.strategy._synced_buffers[0].shape == (24,)
    fit.fit_loop.epoch_loop.max_steps = 2 * (2 + K + 1)  # the same Trainer goes on with another model
    fit.fit(WiderBatchNorm(), loader())


@pytest.mark.parametrize("knobs", [{"overlap_steps": 1}, {"warmup_steps": K}], ids=["overlap", "after-warm-up"])
def test_where_no_copy_is_one_models_each_rank_keeps_its_own_buffers(knobs: dict[str, Any]) -> None:
    """With ``overlap_steps`` (a landing adds each rank's own change since the launch) and after the warm-up's
    switch until the first sync (the buffers were never averaged), there is no synchronized copy of the buffers:
    the strategy keeps none rather than a rank's own (README, "Which model you validate"); after a blocking sync
    the copy is identical on every rank."""

    class Snapshots(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            copy, step = trainer.strategy._synced_buffers, trainer.global_step
            if "overlap_steps" in knobs or step < 2 * K:  # warm-up K steps, the first sync after it at 2K
                assert copy is None, step
            else:
                assert copy is not None and all(torch.equal(flat(copy), c) for c in gather(flat(copy))), step

    torch.manual_seed(0)
    trainer(lordo(sync_every=K, **knobs), callbacks=[Snapshots()], max_steps=3 * K).fit(BatchNormSeen(), loader())


class FailingOnce(Seen):
    """Its first mid-round validation raises (the first fit fails there); later ones run."""

    failed = False

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not FailingOnce.failed and self.trainer.strategy.synchronizer.steps_since_sync > 0:
            FailingOnce.failed = True
            raise RuntimeError("validation failed")
        super().validation_step(batch, batch_idx)


def test_a_fit_that_fails_in_validation_gives_the_replicas_back_and_the_next_fit_validates_the_anchor() -> None:
    """The swap for validation was left in place by a failure (and its flag set): the next fit on the same Trainer
    validated the replica, then its swap back put the anchor in as the training weights."""
    torch.manual_seed(0)
    strategy = lordo(sync_every=K, start_method="popen", synchronous=False)
    around, model = Around(), FailingOnce()
    fit = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2 * K, val_check_interval=K // 2 + 1,
                    check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[around])
    with pytest.raises(RuntimeError, match="validation failed"):
        fit.fit(model, loader(), loader(n=32))
    sync = strategy.synchronizer
    assert not strategy._swapped_for_eval and torch.equal(flat(sync.params), around.replica)  # the replica is back
    around.records.clear()
    fit.fit_loop.epoch_loop.max_steps = 4 * K
    fit.fit(model, loader(), loader(n=32))  # Around's on_train_end checks every mid-round validation of this fit
