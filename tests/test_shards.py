"""Per-rank checkpoint shards (``lightning/shards.py``): each rank writes its own state next to Lightning's file,
no rank holds another's, stale and removed checkpoints take their shards with them, a copied checkpoint resumes
with its directory and names the missing shard without it; ``checkpoint_shards=False`` keeps the single file."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint
from strategy_helpers import TinyRegressor, loader, lordo, trainer

from lightning_lordo.lightning.shards import load_full


class Steps(L.Callback):
    """Rank 0: the first and the last optimizer step of the run (the workers are forked: a file tells)."""

    def __init__(self, path: Path) -> None:
        self.path, self.first = path, None

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.first = self.first or trainer.global_step

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save({"first": self.first, "last": trainer.global_step}, self.path)


class SaveAtEnd(L.Callback):
    """``trainer.save_checkpoint(path)`` (a collective: every rank) after the last training batch."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 9:
            trainer.save_checkpoint(str(self.path))


def _fit(directory: Path, max_steps: int = 6, **knobs: object) -> None:
    """K = 4, 2 workers; ``step=N.ckpt`` every 3 steps with only the latest kept, ``last.ckpt`` overwritten."""
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=3, save_top_k=1,
                                  monitor="step", mode="max", save_last=True)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, error_feedback=True, **knobs), callbacks=[checkpoints], max_steps=max_steps,
            enable_checkpointing=True).fit(TinyRegressor(), loader())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    _fit(directory, max_steps=10)  # saves at 3, 6 and 9 (last.ckpt overwritten each time): step=3 and step=6 removed
    return directory


def test_each_rank_writes_its_own_shard_and_removed_or_stale_saves_take_theirs(sharded: Path) -> None:
    files = sorted(p.name for p in sharded.iterdir())
    main = [f for f in files if f.endswith(".ckpt")]
    assert main == ["last.ckpt", "step=9.ckpt"], files
    for name in main:
        raw = torch.load(sharded / name, weights_only=True)
        assert "ranks" not in raw["lordo"] and raw["lordo"]["shards"]["ranks"] == 2  # nothing gathered to rank 0
        folder = f"{name}.lordo-{raw['lordo']['shards']['id']}"
        assert sorted(p.name for p in (sharded / folder).iterdir()) == ["rank-0.pt", "rank-1.pt"]
        rank0 = torch.load(sharded / folder / "rank-0.pt", weights_only=True)
        rank1 = torch.load(sharded / folder / "rank-1.pt", weights_only=True)
        for shard in (rank0, rank1):  # LoRDO's state; rank 0's is also Lightning's optimizer entry, AdamW-shaped
            assert any("error_feedback" in s for s in shard["optimizer"]["state"].values())
        assert not any("error_feedback" in s for s in raw["optimizer_states"][0]["state"].values())
        assert rank0["comm"]["totals"]["checkpoint"] > 0  # a save's broadcast and agreements are counted
    assert len(files) == 4, files  # one shard directory per kept checkpoint: the stale and removed ones are gone


def test_a_checkpoint_copied_with_its_directory_resumes_and_without_it_names_the_missing_shard(
        sharded: Path, tmp_path: Path) -> None:
    raw = torch.load(sharded / "step=9.ckpt", weights_only=True)
    folder = f"step=9.ckpt.lordo-{raw['lordo']['shards']['id']}"
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(sharded / "step=9.ckpt", alone / "step=9.ckpt")
    with pytest.raises(Exception, match="rank [01]'s shard") as info:
        trainer(lordo(sync_every=4, error_feedback=True), max_steps=12).fit(TinyRegressor(), loader(),
                                                                            ckpt_path=str(alone / "step=9.ckpt"))
    assert "Copy that directory with the checkpoint" in str(info.value) and folder in str(info.value)
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copy(sharded / "step=9.ckpt", copied / "step=9.ckpt")
    shutil.copytree(sharded / folder, copied / folder)
    trainer(lordo(sync_every=4, error_feedback=True), max_steps=12, callbacks=[Steps(tmp_path / "steps.pt")]).fit(
        TinyRegressor(), loader(), ckpt_path=str(copied / "step=9.ckpt"))
    assert torch.load(tmp_path / "steps.pt") == {"first": 10, "last": 12}  # resumed at step 9, trained to 12
    full = load_full(copied / "step=9.ckpt")
    assert [r["comm"]["totals"]["pseudo_gradients"] for r in full["lordo"]["ranks"]] == \
        [torch.load(copied / folder / f"rank-{r}.pt", weights_only=True)["comm"]["totals"]["pseudo_gradients"]
         for r in range(2)]


def test_checkpoint_shards_false_gathers_every_rank_into_the_file(tmp_path: Path) -> None:
    _fit(tmp_path, max_steps=8, checkpoint_shards=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=6.ckpt"]
    raw = torch.load(tmp_path / "step=6.ckpt", weights_only=True)
    assert "shards" not in raw["lordo"] and len(raw["lordo"]["ranks"]) == 2
    assert "params" in raw["lordo"]["ranks"][1]  # step 6 is mid-round (K = 4)


def test_checkpoint_shards_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="Invalid checkpoint_shards='yes'"):
        lordo(checkpoint_shards="yes")


def test_a_linked_last_checkpoint_resumes_with_the_shards_of_the_file_it_points_to(tmp_path: Path) -> None:
    """``save_last="link"``: ``last.ckpt`` is a symbolic link to ``step=N.ckpt``; the file records its shard
    directory's name, so a resume from the link (or from a copy that follows it) finds the shards."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=1,
                                  monitor="step", mode="max", save_last="link")
    torch.manual_seed(0)
    trainer(lordo(sync_every=4), callbacks=[checkpoints], max_steps=8, enable_checkpointing=True).fit(
        TinyRegressor(), loader())
    link = tmp_path / "ckpt" / "last.ckpt"
    assert link.is_symlink() and link.resolve().name == "step=6.ckpt"
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(link, copy / "last.ckpt")  # follows the link: a regular file that names step=6.ckpt's shards
    folder = f"step=6.ckpt.lordo-{torch.load(link, weights_only=True)['lordo']['shards']['id']}"
    shutil.copytree(tmp_path / "ckpt" / folder, copy / folder)
    trainer(lordo(sync_every=4), max_steps=10, callbacks=[Steps(tmp_path / "steps.pt")]).fit(
        TinyRegressor(), loader(), ckpt_path=str(copy / "last.ckpt"))
    assert torch.load(tmp_path / "steps.pt") == {"first": 7, "last": 10}
    # a resume from the link that saves over it (trainer.save_checkpoint("last.ckpt")): the link becomes a file
    # with shards of its own, and the next resume finds them
    trainer(lordo(sync_every=4), max_steps=10, callbacks=[SaveAtEnd(link)]).fit(TinyRegressor(), loader(),
                                                                            ckpt_path=str(link))
    assert not link.is_symlink() and torch.load(link, weights_only=True)["global_step"] == 9
    trainer(lordo(sync_every=4), max_steps=12, callbacks=[Steps(tmp_path / "steps.pt")]).fit(
        TinyRegressor(), loader(), ckpt_path=str(link))
    assert torch.load(tmp_path / "steps.pt") == {"first": 10, "last": 12}


def test_an_asynchronous_checkpoint_io_is_refused_with_the_fix(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    strategy = lordo(sync_every=4, start_method="popen", checkpoint_io=AsyncCheckpointIO(TorchCheckpointIO()))
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO.*LoRDOStrategy\(experimental=\{'checkpoint_shards': "
                                         r"False\}\)"):
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)]).fit(TinyRegressor(), loader())


def test_a_checkpoint_io_plugin_is_taken_as_with_ddp_and_the_default_writes_atomically() -> None:
    """A CheckpointIO given as a Trainer plugin beside a LoRDOStrategy instance was refused by Lightning as "set
    through both strategy class and plugins" (the strategy passed its default to DDPStrategy): it is taken, as
    DDPStrategy takes it; without one, the strategy's is the atomic one."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_lordo.lightning.checkpoint_io import AtomicCheckpointIO

    plugin = TorchCheckpointIO()
    given = L.Trainer(accelerator="cpu", devices=1, strategy=lordo(sync_every=4), plugins=[plugin], logger=False)
    assert given.strategy.checkpoint_io is plugin
    steps = []  # an asynchronous plugin is refused at setup, before any step (not at the first save)
    asynchronous = L.Trainer(accelerator="cpu", devices=1, strategy=lordo(sync_every=4, start_method="popen"),
                             logger=False,
                             plugins=[AsyncCheckpointIO()], enable_progress_bar=False, max_steps=4,
                             callbacks=[LambdaCallback(on_train_batch_end=lambda *a: steps.append(1))])
    with pytest.raises(ValueError, match=r"checkpoint_shards=True with an AsyncCheckpointIO"):
        asynchronous.fit(TinyRegressor(), loader())
    assert steps == []
    evaluate = L.Trainer(accelerator="cpu", devices=1, strategy=lordo(sync_every=4, start_method="popen"),
                         logger=False, plugins=[AsyncCheckpointIO()], enable_progress_bar=False)
    assert evaluate.validate(TinyRegressor(), loader(n=16))  # saves nothing: not refused
    for strategy in (lordo(sync_every=4), "lordo"):
        default = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        assert type(default.strategy.checkpoint_io) is AtomicCheckpointIO
