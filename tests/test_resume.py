"""Checkpoint and resume: bit-identical continuation with the same world size, and the fallbacks."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import TinyRegressor, assert_identical, lordo, regression_data, trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_lordo.lightning.shards import load_full

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

K = 4  # step 6 is mid-round (2 steps after a sync) and step 12 is exactly at a sync
# The resume tests' data: 80 samples, 40 a rank, batches of 8, so epochs end at steps 5, 10 and 15, and the checkpoints
# (every 3 steps: 3, 6, 9, 12) all fall mid-epoch. A resume must continue at the batch where the run stopped.
CHECKPOINT_EVERY = 3
MAX_STEPS = 14


class ShuffledData(L.LightningDataModule):
    """Each rank's half of 80 samples, in a new order every epoch, through torchdata's ``StatefulDataLoader`` with its
    ``StatefulDistributedSampler``: Lightning saves the loader's position in every checkpoint and restores it, and the
    sampler draws the epoch's order when the first batch is read (after Lightning's ``set_epoch``), so a run resumed
    mid-epoch reads the batches the uninterrupted run read.

    What does not resume exactly mid-epoch, with any strategy (DDP too, Lightning 2.6.6): a plain ``DataLoader``
    re-reads the epoch from its start; a ``StatefulDataLoader`` with torch's ``DistributedSampler`` continues at the
    right batch but in the first epoch's order (the loader is restored, and fast-forwarded, before ``set_epoch``);
    and ``StatefulDataLoader(shuffle=True)`` left to Lightning's sampler wrapper draws another order.
    """

    def train_dataloader(self) -> StatefulDataLoader:
        data = regression_data(n=80)
        return StatefulDataLoader(data, batch_size=8, sampler=StatefulDistributedSampler(data, shuffle=True, seed=0))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(n=16, seed=1), batch_size=8)


STEPS_PER_EPOCH = 3  # RankBatch: 3 batches per epoch


class RankBatch(Dataset):
    """Each rank sees one fixed batch of its own (the ranks' batches differ), whatever the step or epoch: data with
    no position, for the tests of conversions and changed settings (which are not bit-exact continuations).
    (Used with ``use_distributed_sampler=False``.)
    """

    def __init__(self) -> None:
        self.base = regression_data(n=16)

    def __len__(self) -> int:
        return STEPS_PER_EPOCH * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = 8 * dist.get_rank() + i % 8 if dist.is_initialized() else i % 8
        return self.base[row]


FIXED_DATA: dict[str, Any] = {"max_epochs": -1, "use_distributed_sampler": False}


def epoch_loader() -> DataLoader:
    return DataLoader(RankBatch(), batch_size=8, shuffle=False)


class BatchNormRegressor(TinyRegressor):
    """TinyRegressor with a BatchNorm after the first layer: its running statistics are each rank's own between
    syncs, so a mid-round resume must restore every rank's buffers too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.GELU(), nn.LayerNorm(24),
                                 nn.Linear(24, 16), nn.GELU(), nn.Linear(16, 3))


class Snapshot(L.Callback):
    """Each rank saves its local state before the final sync, its totals after it, and the inputs of every batch
    it trained on, by the optimizer step the batch made."""

    def __init__(self, directory: Path, tag: str) -> None:
        self.directory, self.tag = directory, tag
        self.batches: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches[trainer.global_step + 1] = batch[0].clone()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:  # before the final sync
        strategy = trainer.strategy
        torch.save({"params": [p.detach().clone() for p in module.parameters()],
                    "buffers": [b.detach().clone() for b in module.buffers()],
                    "optimizer": strategy.optimizers[0].state_dict(),
                    "sync": strategy.synchronizer.state_dict()},
                   self.directory / f"{self.tag}_local_rank{trainer.global_rank}.pt")

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.save({"params": [p.detach().clone() for p in module.parameters()],
                    "buffers": [b.detach().clone() for b in module.buffers()],
                    # the plugin's traffic; Lightning's own collectives are counted too, and a resumed run's setup
                    # sends them again (its log_dir broadcast, its loaders' lengths): real bytes, not training state
                    "totals": {k: v for k, v in trainer.strategy.accountant.totals.items()
                               if k != "lightning_collectives"},
                    "ddp_equivalent": trainer.strategy.ddp_equivalent_bytes},
                   self.directory / f"{self.tag}_final_rank{trainer.global_rank}.pt")
        torch.save(self.batches, self.directory / f"{self.tag}_batches_rank{trainer.global_rank}.pt")


class BranchyBatchNormRegressor(BatchNormRegressor):
    """A second branch (a low-rank matrix and a head) that only rank 1 runs: its moments are held by rank 1 alone."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.branch = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x) + (self.branch(x) if self.global_rank == 1 else 0)
        return nn.functional.mse_loss(out, y)


def _fit(tmp_path: Path, tag: str, ckpt: Any = None, checkpoints: bool = False,
         module: type = BatchNormRegressor, in_validation: bool = False, precision: str = "32-true",
         **knobs: Any) -> None:
    """MAX_STEPS steps (or the rest of them, from ``ckpt``); ``checkpoints`` every 3 steps, the full run's in
    ``ckpt/``, a resumed run's in ``ckpt_<tag>/`` (it writes those the full run wrote after its start, as an
    interrupted run would). ``in_validation``: validation every 3 steps, and the checkpoints written from it (what
    ``ModelCheckpoint(monitor=...)`` does with a step-based ``val_check_interval``)."""
    callbacks: list[L.Callback] = [Snapshot(tmp_path, tag)]
    every = {"monitor": "val_loss"} if in_validation else {"every_n_train_steps": CHECKPOINT_EVERY}
    validation = {"val_check_interval": CHECKPOINT_EVERY, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0} \
        if in_validation else {"limit_val_batches": 0}
    if checkpoints:
        directory = tmp_path / ("ckpt" if ckpt is None else f"ckpt_{tag}")
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1, **every))
    torch.manual_seed(0)
    trainer(lordo(sync_every=K, **knobs), callbacks=callbacks, max_steps=MAX_STEPS, max_epochs=-1,
            enable_checkpointing=checkpoints, precision=precision, **validation).fit(
                module(scheduler=True), datamodule=ShuffledData(), ckpt_path=ckpt)


def _position(checkpoint: Path) -> tuple[int, int]:
    """(epoch, batches read in it) of the data loader state Lightning saved in ``checkpoint``."""
    saved = torch.load(checkpoint, weights_only=True)
    return saved["epoch"], saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_num_yielded"]


def _assert_resumed_exactly(tmp_path: Path, tag: str, first_step: int) -> None:
    """The resumed run read the batches the full run read from ``first_step`` on, and ended in its exact state."""
    for rank in (0, 1):
        full = torch.load(tmp_path / f"full_batches_rank{rank}.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"{tag}_batches_rank{rank}.pt", weights_only=True)
        assert sorted(resumed) == list(range(first_step, MAX_STEPS + 1)), f"{tag}/rank{rank}: steps {sorted(resumed)}"
        for step, batch in resumed.items():
            assert torch.equal(batch, full[step]), f"{tag}/rank{rank}: step {step} read another batch (data position)"
        for kind in ("local", "final"):
            expected = torch.load(tmp_path / f"full_{kind}_rank{rank}.pt", weights_only=True)
            got = torch.load(tmp_path / f"{tag}_{kind}_rank{rank}.pt", weights_only=True)
            assert_identical(got, expected, f"{tag}/{kind}/rank{rank}")


@pytest.mark.parametrize("knobs", [{}, {"error_feedback": True, "outer_optimizer": "nesterov",
                                         "normalizer": "factored"}, {"payload": "lowrank", "payload_dtype": "int8"},
                                   {"payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 2,
                                    "moments_every": 2, "full_rank_params": [r"net\.0\.weight$"]},
                                   {"payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 2,
                                    "bucket_cap_mb": 0.001},
                                   {"overlap_steps": 2, "payload": "lowrank", "payload_dtype": "int8"},
                                   {"basis_every": 2}, {"basis_every": 2, "overlap_steps": 2}],
                         ids=["default", "ef-nesterov-factored", "lowrank-int8-payload", "everything-compressed",
                              "everything-compressed-streamed", "overlapped", "basis-window",
                              "basis-window-overlapped"])
def test_resume_mid_round_and_at_a_sync_is_bit_identical(tmp_path: Path, knobs: dict[str, Any]) -> None:
    _fit(tmp_path, "full", checkpoints=True, **knobs)
    ckpt_dir = tmp_path / "ckpt"
    mid_round, at_sync = ckpt_dir / "step=6.ckpt", ckpt_dir / "step=12.ckpt"
    saved_mid = load_full(mid_round)["lordo"]  # the file and its per-rank shards
    assert saved_mid["sync"]["steps_since_sync"] == 2 and "params" in saved_mid["ranks"][1]
    assert torch.load(at_sync, weights_only=True)["lordo"]["sync"]["steps_since_sync"] == 0
    assert _position(mid_round) == (1, 1) and _position(at_sync) == (2, 2)  # both mid-epoch
    if knobs.get("overlap_steps"):  # launched at step 12, in flight at its save: the resume redoes it
        assert [r["overlap"]["step"] for r in load_full(at_sync)["lordo"]["ranks"]] == [12, 12]
    for tag, ckpt, step in (("mid", mid_round, 6), ("sync", at_sync, 12)):
        _fit(tmp_path, tag, ckpt=str(ckpt), checkpoints=True, **knobs)
        _assert_resumed_exactly(tmp_path, tag, first_step=step + 1)


def test_a_float64_resume_mid_round_is_bit_identical(tmp_path: Path) -> None:
    """Lightning loads a checkpoint's weights before "64-true" converts the module, so they arrive rounded through
    float32: that was taken for a model edited after the save (each rank's progress dropped, the synchronized model
    rounded to float32, a warning)."""
    _fit(tmp_path, "full", checkpoints=True, precision="64-true")
    _fit(tmp_path, "mid", ckpt=str(tmp_path / "ckpt" / "step=6.ckpt"), checkpoints=True, precision="64-true")
    _assert_resumed_exactly(tmp_path, "mid", first_step=7)


@pytest.mark.parametrize("knobs", [{}, {"overlap_steps": 2}], ids=["blocking", "overlapped"])
def test_a_checkpoint_written_from_validation_mid_round_resumes_bit_identical(tmp_path: Path,
                                                                            knobs: dict[str, Any]) -> None:
    """Validation swaps the synchronized model in; a checkpoint written from it (``ModelCheckpoint(monitor=...)``)
    must still hold the anchor as the synchronized model and each rank's own replica as its shard."""
    _fit(tmp_path, "full", checkpoints=True, in_validation=True, **knobs)
    saved = load_full(tmp_path / "ckpt" / "step=6.ckpt")
    assert saved["lordo"]["sync"]["steps_since_sync"] == 2
    names = saved["lordo"]["layout"]["sync_names"]
    for name, a in zip(names, saved["lordo"]["sync"]["anchor"]):
        assert torch.equal(a, saved["state_dict"][name]), f"the saved anchor's {name} is not the synchronized model"
    _fit(tmp_path, "mid", ckpt=str(tmp_path / "ckpt" / "step=6.ckpt"), checkpoints=True, in_validation=True, **knobs)
    _assert_resumed_exactly(tmp_path, "mid", first_step=7)


class OneCycleSGD(BatchNormRegressor):
    """SGD with momentum under OneCycleLR, which sets each group's ``momentum`` at every step: the saved value must
    come back on resume (another optimizer's group keys are its own, as torch restores them)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-2, total_steps=MAX_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_diloco_resume_with_sgd_under_one_cycle_is_bit_identical(tmp_path: Path) -> None:
    _fit(tmp_path, "full", checkpoints=True, module=OneCycleSGD, lowrank=False, preset="diloco")
    _fit(tmp_path, "mid", ckpt=str(tmp_path / "ckpt" / "step=6.ckpt"), checkpoints=True, module=OneCycleSGD,
         lowrank=False, preset="diloco")
    _assert_resumed_exactly(tmp_path, "mid", first_step=7)


def test_a_mid_round_resume_keeps_which_parameters_each_worker_stepped(tmp_path: Path) -> None:
    """A branch only rank 1 runs: each rank's checkpoint keeps the parameters it stepped in the round, so the next
    sync averages the branch's moments over rank 1 alone, as the uninterrupted run does (bit for bit)."""
    _fit(tmp_path, "full", checkpoints=True, module=BranchyBatchNormRegressor)
    saved = load_full(tmp_path / "ckpt" / "step=6.ckpt")["lordo"]
    stepped = [set(rank["stepped"]) for rank in saved["ranks"]]
    assert stepped[0] < stepped[1], stepped  # rank 0 never stepped the branch
    _fit(tmp_path, "mid", ckpt=str(tmp_path / "ckpt" / "step=6.ckpt"), checkpoints=True,
         module=BranchyBatchNormRegressor)
    _assert_resumed_exactly(tmp_path, "mid", first_step=7)


def test_resume_while_an_overlapped_round_averaging_the_error_feedback_is_in_flight_is_bit_identical(
        tmp_path: Path) -> None:
    """Saved at step 9, a step after the round launched at step 8: the steps since keep the error feedback unfolded,
    and the resumed run redoes the round from the saved copies without folding the live buffers."""
    knobs = {"overlap_steps": 2, "average_error_feedback": True}
    _fit(tmp_path, "full", checkpoints=True, **knobs)
    saved = tmp_path / "ckpt" / "step=9.ckpt"
    assert [r["overlap"]["step"] for r in load_full(saved)["lordo"]["ranks"]] == [8, 8]
    _fit(tmp_path, "flight", ckpt=str(saved), checkpoints=True, **knobs)
    _assert_resumed_exactly(tmp_path, "flight", first_step=10)


def test_mid_round_checkpoint_differs_per_rank_and_holds_the_synchronized_model(tmp_path: Path) -> None:
    _fit(tmp_path, "full", checkpoints=True)
    checkpoint = load_full(tmp_path / "ckpt" / "step=6.ckpt")
    ranks = checkpoint["lordo"]["ranks"]
    assert not torch.equal(ranks[0]["params"][0], ranks[1]["params"][0])  # local replicas differ mid-round
    # every rank's LoRDO state in the LoRDO part; Lightning's own entry holds rank 0's in AdamW's shape
    assert all(any("basis" in s for s in r["optimizer"]["state"].values()) for r in ranks)
    params = dict(BatchNormRegressor().named_parameters())
    names = checkpoint["lordo"]["layout"]["param_names"]
    assert [s["exp_avg"].shape for s in checkpoint["optimizer_states"][0]["state"].values()] == [
        params[n].shape for n in names]
    anchor = checkpoint["lordo"]["sync"]["anchor"]
    names = [n for n, _ in BatchNormRegressor().named_parameters()]
    for name, a in zip(names, anchor):
        assert torch.equal(checkpoint["state_dict"][name], a)


def test_resume_with_another_world_size_warns_once_and_continues(tmp_path: Path) -> None:
    _fit(tmp_path, "full", checkpoints=True, error_feedback=True)
    fit = trainer(lordo(sync_every=K, start_method="popen", error_feedback=True), devices=1, max_steps=14,
                  max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(BatchNormRegressor(scheduler=True), datamodule=ShuffledData(),
                ckpt_path=str(tmp_path / "ckpt" / "step=6.ckpt"))
    messages = [str(w.message) for w in caught if "written by 2 workers" in str(w.message)]
    assert len(messages) == 1 and "error-feedback" in messages[0]
    assert fit.strategy.synchronizer.optimizer_steps == 14
    assert all(torch.isfinite(p).all() for p in fit.lightning_module.parameters())
    # one device keeps no anchor: the 2-process checkpoint's stale one was kept, saved again and, resumed on 2
    # processes, taken for the synchronized model of a later step
    assert not fit.strategy.synchronizer.anchor.tensors
    fit.save_checkpoint(tmp_path / "alone.ckpt")
    assert load_full(tmp_path / "alone.ckpt")["lordo"]["sync"]["anchor"] == []


class SaveAt(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def test_ddp_checkpoint_resumes_under_lordo_with_converted_optimizer_state(tmp_path: Path) -> None:
    path = tmp_path / "ddp.ckpt"
    trainer("ddp_fork", callbacks=[SaveAt(path)], max_steps=6, **FIXED_DATA).fit(TinyRegressor(), epoch_loader())
    fit = trainer(lordo(sync_every=K, start_method="popen"), devices=1, max_steps=12, **FIXED_DATA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(TinyRegressor(), epoch_loader(), ckpt_path=str(path))
    messages = [str(w.message) for w in caught if "another strategy" in str(w.message)]
    assert len(messages) == 1 and messages[0].count("moments restarted") == 2, messages
    optimizer = fit.strategy.optimizers[0]
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    bias = next(i for i, p in enumerate(fit.lightning_module.parameters()) if p.ndim == 1)
    assert optimizer.state[list(fit.lightning_module.parameters())[bias]]["step"].item() == 12  # 6 + 6 steps
    assert saved[bias]["step"].item() == 6
    assert fit.strategy.synchronizer.optimizer_steps == 6


WARMUP = {"warmup_steps": 7, "switch_betas": (0.95, 0.99), "switch_reset_moments": True, "switch_lr_scale": 0.5}


def test_resume_in_the_warmup_and_after_the_switch_is_bit_identical(tmp_path: Path) -> None:
    """A warm-up of 7 synchronous steps, then local steps with syncs every 4: a checkpoint in the warm-up (step 6)
    and one mid-round after the switch (step 9) both resume bit-identically, the switch applied exactly once."""
    _fit(tmp_path, "full", checkpoints=True, **WARMUP)
    ckpt_dir = tmp_path / "ckpt"
    in_warmup, after = ckpt_dir / "step=6.ckpt", ckpt_dir / "step=9.ckpt"
    saved = torch.load(in_warmup, weights_only=True)
    assert saved["lordo"]["sync"]["optimizer_steps"] == 6 and saved["lordo"]["sync"]["anchor"] == []
    assert saved["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)  # not switched yet
    saved = load_full(after)
    assert saved["lordo"]["sync"]["steps_since_sync"] == 2 and "params" in saved["lordo"]["ranks"][1]
    assert tuple(saved["optimizer_states"][0]["param_groups"][0]["betas"]) == (0.95, 0.99)
    assert _position(in_warmup) == (1, 1) and _position(after) == (1, 4)  # both mid-epoch
    for tag, ckpt, step in (("warmup", in_warmup, 6), ("local", after, 9)):
        _fit(tmp_path, tag, ckpt=str(ckpt), checkpoints=True, **WARMUP)
        _assert_resumed_exactly(tmp_path, tag, first_step=step + 1)


def test_a_resume_that_runs_no_training_step_still_ends_with_one_model(tmp_path: Path) -> None:
    """Resumed from a mid-round checkpoint (step 6) with ``max_steps=6`` already reached, Lightning runs no training
    loop (neither ``on_train_start`` nor ``on_train_end``; a ``max_time`` spent does the same): the replicas each rank
    restored are synchronized at the fit's end all the same, into the model a 6-step fit ends with, bit for bit."""
    _fit(tmp_path, "full", checkpoints=True)
    for tag, ckpt in (("six", None), ("noop", str(tmp_path / "ckpt" / "step=6.ckpt"))):
        torch.manual_seed(0)
        trainer(lordo(sync_every=K), callbacks=[Snapshot(tmp_path, tag)], max_steps=6, max_epochs=-1,
                limit_val_batches=0, logger=CSVLogger(tmp_path, name=tag, version=0)).fit(
                    BatchNormRegressor(scheduler=True), datamodule=ShuffledData(), ckpt_path=ckpt)
    # the final sync's row: where the 6-step fit logged its own (the last batch's step and epoch)
    rows = {tag: [r for r in csv.DictReader((tmp_path / tag / "version_0" / "metrics.csv").read_text().splitlines())
                  if r.get("lordo/bytes_sent_sync")] for tag in ("six", "noop")}
    assert rows["noop"] and (rows["noop"][-1]["step"], rows["noop"][-1]["epoch"]) == (
        rows["six"][-1]["step"], rows["six"][-1]["epoch"]), rows
    finals = [torch.load(tmp_path / f"noop_final_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(finals[0]["params"], finals[1]["params"])), "the ranks differ"
    for rank in (0, 1):
        expected = torch.load(tmp_path / f"six_final_rank{rank}.pt", weights_only=True)
        for kind in ("params", "buffers"):
            assert all(torch.equal(a, b) for a, b in zip(finals[rank][kind], expected[kind])), (rank, kind)


class Reports(L.Callback):
    """Each rank's sync reports as the fit ends: step, bytes by purpose and by part."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        reports = [(r.step, r.bytes_by_purpose, r.bytes_by_part) for r in trainer.strategy.sync_reports]
        torch.save(reports, self.path.with_name(f"{self.path.name}_rank{trainer.global_rank}.pt"))


def test_the_landing_after_a_resume_reports_the_bytes_of_its_round(tmp_path: Path) -> None:
    """A checkpoint written with a round in flight (``overlap_steps=2``, launched at step 12): after the resume it
    lands at step 14 with the bytes it sent, by purpose and part, as in the run that was not interrupted (the report
    said 0 bytes: the accountant saved only its totals)."""
    for tag, ckpt in (("full", None), ("resumed", str(tmp_path / "ckpt" / "step=12.ckpt"))):
        callbacks: list[L.Callback] = [Reports(tmp_path / tag)]
        if ckpt is None:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_top_k=-1,
                                             every_n_train_steps=CHECKPOINT_EVERY))
        torch.manual_seed(0)
        trainer(lordo(sync_every=K, overlap_steps=2), callbacks=callbacks, max_steps=MAX_STEPS, max_epochs=-1,
                enable_checkpointing=ckpt is None, limit_val_batches=0).fit(
                    BatchNormRegressor(scheduler=True), datamodule=ShuffledData(), ckpt_path=ckpt)
    for rank in (0, 1):
        full, resumed = (torch.load(tmp_path / f"{tag}_rank{rank}.pt") for tag in ("full", "resumed"))
        landing = [r for r in resumed if r[0] == 14]
        expected = [r for r in full if r[0] == 14][0]
        assert landing and landing[0][1] and landing[0][1] == expected[1], (expected, landing)
        # the parts since the last report: the round's, Lightning's per-batch checks and the step-12 save's
        # agreements (but Lightning's own setup collectives, which the resumed run's setup sends again)
        training = [{k: v for k, v in parts.items() if k != "lightning_collectives"}
                    for parts in (landing[0][2], expected[2])]
        assert training[0] == training[1], training
