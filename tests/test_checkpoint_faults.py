"""A checkpoint that is not what it claims (issue 31): shards swapped between ranks, copied from another run, or
contradicted by a hand-edited file are refused; a truncated shard or file names itself, the rank and the fix;
files are written with the permissions the umask gives; a stall in ModelCheckpoint's collective names it."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TinyRegressor, loader, lordo, trainer

from lightning_lordo import LoRDOStrategy
from lightning_lordo.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_lordo.lightning.shards import load_full

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

REFUSED = "Copy the checkpoint file together with its shard directory"


def _fit(directory: Path, seed: int) -> None:
    """K = 4, 2 workers, a checkpoint every 3 steps, all kept: step=3 and step=6 are both mid-round (the fit's
    last step, 7, ends with a sync)."""
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    torch.manual_seed(seed)
    trainer(lordo(sync_every=4), callbacks=[checkpoints], max_steps=7, enable_checkpointing=True).fit(
        TinyRegressor(), loader())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {name: tmp_path_factory.mktemp(name) for name in ("a", "b")}
    for seed, directory in enumerate(out.values()):
        _fit(directory, seed)
    return out


def _folder(checkpoint: Path) -> Path:
    meta = torch.load(checkpoint, weights_only=True)["lordo"]["shards"]
    return checkpoint.parent / meta["dir"]


def _copy(source: Path, target_dir: Path) -> Path:
    """``source`` and its shard directory, copied into ``target_dir``."""
    target_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target_dir / source.name)
    shutil.copytree(_folder(source), target_dir / _folder(source).name)
    return target_dir / source.name


def _resume(checkpoint: Path, devices: int = 2) -> None:
    strategy = lordo(sync_every=4) if devices == 2 else lordo(sync_every=4, start_method="popen")
    trainer(strategy, devices=devices, max_steps=8).fit(TinyRegressor(), loader(), ckpt_path=str(checkpoint))


# ---------------------------------------------------------------------------------------------------------------
# 4: shards that are not this checkpoint's
# ---------------------------------------------------------------------------------------------------------------
def test_shards_swapped_between_ranks_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = _copy(runs["a"] / "step=6.ckpt", tmp_path)
    folder = _folder(checkpoint)
    os.rename(folder / "rank-0.pt", folder / "tmp.pt")
    os.rename(folder / "rank-1.pt", folder / "rank-0.pt")
    os.rename(folder / "tmp.pt", folder / "rank-1.pt")
    with pytest.raises(Exception, match=r"rank-[01]\.pt") as info:
        _resume(checkpoint)
    text = str(info.value)
    assert "holds rank 1's state, not rank 0's" in text or "holds rank 0's state, not rank 1's" in text, text
    assert REFUSED in text, text
    with pytest.raises(ValueError, match=r"rank 0's shard .*rank-0\.pt.* holds rank 1's state, not rank 0's"):
        load_full(checkpoint)  # the inspection and export path refuses it too


def test_shards_swapped_between_ranks_with_a_round_in_flight_are_refused(tmp_path: Path) -> None:
    """``overlap_steps``: the checkpoint of step 5 holds the round launched at step 4 on every rank; its shards,
    swapped between the ranks, are refused before anything is redone."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, overlap_steps=2), callbacks=[checkpoints], max_steps=7, enable_checkpointing=True
            ).fit(TinyRegressor(), loader())
    checkpoint = tmp_path / "step=5.ckpt"
    assert all("overlap" in rank for rank in load_full(checkpoint)["lordo"]["ranks"])
    folder = _folder(checkpoint)
    os.rename(folder / "rank-0.pt", folder / "tmp.pt")
    os.rename(folder / "rank-1.pt", folder / "rank-0.pt")
    os.rename(folder / "tmp.pt", folder / "rank-1.pt")
    with pytest.raises(Exception, match=r"rank-[01]\.pt") as info:
        trainer(lordo(sync_every=4, overlap_steps=2), max_steps=8).fit(TinyRegressor(), loader(),
                                                                        ckpt_path=str(checkpoint))
    text = str(info.value)
    assert "holds rank 1's state, not rank 0's" in text or "holds rank 0's state, not rank 1's" in text, text
    assert REFUSED in text, text


def test_a_shard_copied_from_another_run_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = _copy(runs["a"] / "step=6.ckpt", tmp_path)
    other = _folder(runs["b"] / "step=6.ckpt")
    shutil.copy(other / "rank-1.pt", _folder(checkpoint) / "rank-1.pt")
    other_id = other.name.rsplit("-", 1)[-1]
    with pytest.raises(Exception, match=r"rank 1's shard .*rank-1\.pt") as info:
        _resume(checkpoint)
    text = str(info.value)
    assert f"was written by another save (save id {other_id}" in text and REFUSED in text, text


def test_a_hand_edited_steps_since_sync_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = _copy(runs["a"] / "step=6.ckpt", tmp_path)
    raw = torch.load(checkpoint, weights_only=True)
    assert raw["lordo"]["sync"]["steps_since_sync"] == 2  # step 6 of K = 4
    raw["lordo"]["sync"]["steps_since_sync"] = 1
    torch.save(raw, checkpoint)
    with pytest.raises(Exception, match=r"steps_since_sync=2, but the checkpoint file says steps_since_sync=1") as info:
        _resume(checkpoint)
    assert str(checkpoint) in str(info.value) and REFUSED in str(info.value)
    with pytest.raises(ValueError, match="steps_since_sync"):  # rank 0's shard, read by another world size
        _resume(checkpoint, devices=1)


def test_untouched_checkpoints_still_load_and_resume_with_another_world_size(runs: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    full = load_full(runs["a"] / "step=3.ckpt")
    assert len(full["lordo"]["ranks"]) == 2 and all("identity" not in r for r in full["lordo"]["ranks"])
    _resume(runs["a"] / "step=3.ckpt", devices=1)  # rank 0's shard, checked against the file
    checkpoint = _copy(runs["a"] / "step=3.ckpt", tmp_path)  # a shard stripped of its identity: refused
    shard = _folder(checkpoint) / "rank-1.pt"
    torch.save({k: v for k, v in torch.load(shard, weights_only=True).items() if k != "identity"}, shard)
    with pytest.raises(ValueError, match=r"Rank 1's LoRDO shard .*rank-1\.pt.* records no identity.*edited or "
                                         r"replaced\. Restore"):
        load_full(checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# 7, 10: truncated shards and files
# ---------------------------------------------------------------------------------------------------------------
def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])


def test_a_truncated_shard_names_the_file_the_rank_and_the_fix(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = _copy(runs["a"] / "step=6.ckpt", tmp_path)
    shard = _folder(checkpoint) / "rank-1.pt"
    _truncate(shard, -30)  # torch: "OSError: [Errno 22] Invalid argument"
    with pytest.raises(Exception, match="truncated or corrupt") as info:
        _resume(checkpoint)
    text = str(info.value)
    assert "Rank 1's LoRDO shard" in text and str(shard) in text and "resume from an earlier checkpoint" in text, text
    _truncate(_folder(checkpoint) / "rank-0.pt", 200)  # another cut: torch's zip reader fails
    with pytest.raises(OSError, match=r"Rank 0's LoRDO shard .*rank-0\.pt.* truncated or corrupt") as caught:
        _resume(checkpoint, devices=1)
    assert caught.value.__cause__ is not None  # torch's own error, chained


@pytest.mark.parametrize("keep", [-30, 200, 0])
def test_a_truncated_checkpoint_file_names_the_file_and_the_fix(runs: dict[str, Path], tmp_path: Path,
                                                                keep: int) -> None:
    checkpoint = _copy(runs["a"] / "step=6.ckpt", tmp_path)
    _truncate(checkpoint, keep)
    with pytest.raises(OSError, match="truncated or corrupt") as info:
        _resume(checkpoint, devices=1)
    text = str(info.value)
    assert str(checkpoint) in text and "Resume from an earlier checkpoint" in text, text
    assert info.value.__cause__ is not None and "truncated" not in str(info.value.__cause__)
    with pytest.raises(OSError, match="truncated or corrupt"):
        load_full(checkpoint)


# ---------------------------------------------------------------------------------------------------------------
# 11: permissions follow the umask
# ---------------------------------------------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600)], ids=["022", "077"])
def test_checkpoints_and_shards_follow_the_umask(tmp_path: Path, umask: int, expected: int) -> None:
    previous = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"x": torch.zeros(2)}, tmp_path / "direct.ckpt")
        assert _mode(tmp_path / "direct.ckpt") == expected, oct(_mode(tmp_path / "direct.ckpt"))
        if umask == 0o022:  # a fit's files: Lightning's file and every rank's shard (forked workers inherit it)
            ckpt = tmp_path / "fit"
            trainer(lordo(sync_every=4), max_steps=3, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3)]).fit(TinyRegressor(), loader())
            files = [p for p in ckpt.rglob("*") if p.is_file()]
            assert len(files) == 3 and {p.name for p in files} >= {"rank-0.pt", "rank-1.pt"}, files
            assert {p.name: oct(_mode(p)) for p in files} == {p.name: oct(expected) for p in files}
    finally:
        os.umask(previous)


# ---------------------------------------------------------------------------------------------------------------
# 13: a stall in ModelCheckpoint's collective is named as such
# ---------------------------------------------------------------------------------------------------------------
class StallingCheckpoint(ModelCheckpoint):
    """Rank 1 stalls (longer than the timeout) before ModelCheckpoint's all-ranks check whether the file exists,
    where rank 0 waits."""

    def file_exists(self, filepath: Any, trainer: L.Trainer) -> bool:
        if trainer.global_rank == 1:
            time.sleep(5)  # past the 3 s timeout
        return super().file_exists(filepath, trainer)


@pytest.mark.timeout(60)
def test_a_stall_in_model_checkpoint_names_model_checkpoint(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        trainer(LoRDOStrategy(sync_every=4, start_method="fork", timeout=3, optimizer={"rank": 4}), max_steps=6,
                enable_checkpointing=True,
                callbacks=[StallingCheckpoint(dirpath=tmp_path, every_n_train_steps=2)]).fit(TinyRegressor(), loader())
    text = str(info.value)
    assert "ModelCheckpoint" in text and "sync_dist" not in text and "timeout 3 s" in text, text
    assert time.monotonic() - start < 30
