"""Nothing silently wrong (issue: resume with changed knobs, buffers, float64, atomic checkpoints, preemption): the
fixes, each with a test that failed before it. 2 processes launched by fork, assertions in the workers."""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TinyRegressor, gather, loader, lordo, trainer

from lightning_lordo import LoRDOStrategy
from lightning_lordo.lightning.shards import load_full

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


class Float64Kept(L.Callback):
    """After every sync the parameters are float64 and not all representable in float32 (a float32 round trip
    anywhere in the synchronization would make every value representable)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.steps_since_sync:
            return
        for a in sync.anchor.tensors:
            assert a.dtype == torch.float64
        params = list(module.parameters())
        assert all(p.dtype == torch.float64 for p in params)
        assert any((p != p.float().double()).any() for p in params), "every value is float32-representable"
        assert torch.equal(*gather(torch.cat([p.detach().reshape(-1) for p in params])))
        self.checked += 1

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.checked == 5


@pytest.mark.parametrize("preset", ["lordo", "diloco"])
def test_float64_parameters_stay_float64_through_every_sync(preset: str) -> None:
    strategy = lordo(sync_every=2) if preset == "lordo" else \
        LoRDOStrategy(preset="diloco", sync_every=2, start_method="fork")
    trainer(strategy, callbacks=[Float64Kept()], max_steps=10, precision="64-true").fit(TinyRegressor(), loader())


# ------------------------------------------------------------------------------------------ atomic checkpoints
class _FullDiskFile(io.FileIO):
    """A file on a full disk: the first 4 KiB are written, then every write fails with ENOSPC."""

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > 4096:
            room = max(0, 4096 - self.tell())
            super().write(bytes(data)[:room])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


class DiskFullFrom(L.Callback):
    """From step ``at`` on, the checkpoint directory's disk is full for rank 0 (the writer): every file opened
    for writing there, however it is opened, accepts 4 KiB and then fails with ENOSPC."""

    def __init__(self, at: int, directory: Path) -> None:
        self.at, self.directory = at, str(directory)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.at or trainer.global_rank != 0:
            return
        real_open = io.open

        def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            path = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.fspath(file)
            if any(c in mode for c in "wax") and os.path.abspath(path).startswith(self.directory):
                raw = _FullDiskFile(file, mode.replace("b", "").replace("t", "") or "w",
                                    closefd=kwargs.get("closefd", True))
                return io.BufferedWriter(raw) if "b" in mode else io.TextIOWrapper(io.BufferedWriter(raw))
            return real_open(file, mode, *args, **kwargs)

        io.open = builtins.open = full_open


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """The strategy's CheckpointIO writes a temporary file next to the target, fsyncs it and renames it over the
    target: a save that fails half-way (the disk is full) leaves the previous ``last.ckpt`` intact and no partial
    file. (Lightning's CheckpointIO writes to the system's temporary directory and moves the file; when that is
    another file system the move copies over ``last.ckpt`` and a full disk leaves it truncated.)"""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_last=True,
                                  save_top_k=-1)
    with pytest.raises(Exception) as info:
        trainer(lordo(sync_every=4), callbacks=[checkpoints, DiskFullFrom(5, tmp_path)], max_steps=12,
                enable_checkpointing=True).fit(TinyRegressor(), loader())
    assert "No space left on device" in str(info.value), str(info.value)
    files = sorted(os.listdir(tmp_path))
    saved = {name: load_full(tmp_path / name) for name in ("last.ckpt", "step=4.ckpt")}
    shard_dirs = sorted(f"{name}.lordo-{ckpt['lordo']['shards']['id']}" for name, ckpt in saved.items())
    assert files == sorted(["last.ckpt", "step=4.ckpt", *shard_dirs]), files  # nothing partial or temporary
    for folder in shard_dirs:  # the failed save's shards were removed on every rank
        assert sorted(os.listdir(tmp_path / folder)) == ["rank-0.pt", "rank-1.pt"]
    assert saved["last.ckpt"]["global_step"] == 4 and saved["last.ckpt"]["lordo"]["sync"]["optimizer_steps"] == 4
    assert len(saved["last.ckpt"]["lordo"]["ranks"]) == 2


class FinalModel(L.Callback):
    """At the end of fit: the model (synchronized, identical on both ranks) and its buffers, for rank 0 to compare
    with the checkpoints Lightning wrote at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        flat = torch.cat([v.reshape(-1).float() for v in state.values()])
        assert torch.equal(*gather(flat)), "one model and one set of buffers on every rank"
        if trainer.global_rank == 0:
            torch.save(state, self.path)


@pytest.mark.parametrize("end", ["max_steps", "max_epochs"])
def test_the_checkpoints_written_at_the_end_of_fit_hold_the_final_synchronized_model(tmp_path: Path,
                                                                                      end: str) -> None:
    """K = 16 and a run of 40 optimizer steps (or one epoch of 40 batches): the final sync runs at the last step,
    before Lightning's end-of-fit checkpoints, so ``last.ckpt`` and the step-40 file hold the model ``fit`` ends
    with, parameters and buffers (BatchNorm statistics averaged), not the step-32 one."""
    from test_resume import BatchNormRegressor

    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_last=True, save_top_k=-1,
                                  **({"every_n_train_steps": 20} if end == "max_steps" else {}))
    length = {"max_steps": 40} if end == "max_steps" else {"max_epochs": 1, "max_steps": -1}
    trainer(lordo(sync_every=16), callbacks=[checkpoints, FinalModel(tmp_path / "final.pt")],
            enable_checkpointing=True, **length).fit(BatchNormRegressor(), loader(n=1280 if end == "max_steps"
                                                                                  else 640))
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name in ("last.ckpt", "step=40.ckpt"):
        saved = torch.load(tmp_path / name, weights_only=True)
        assert saved["global_step"] == 40
        for key, value in final.items():
            assert torch.equal(saved["state_dict"][key], value), f"{name}: {key}"
        assert saved["lordo"]["sync"]["steps_since_sync"] == 0
