"""The strategy's lifecycle on Lightning's hooks: side process groups made once per strategy, a failed fit with a
round in flight ending with the user's exception (``on_exception``), ``teardown``, the final sync before the user's
``on_train_end`` hooks, and a checkpoint restored after setup (the tuner's callbacks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import TinyRegressor, flat_params, free_port, gather, loader, lordo, trainer

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    script = Path(__file__).with_name("lifecycle_script.py")
    return subprocess.run([sys.executable, str(script), *args], env={**env, "MASTER_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=240)


def test_two_fits_make_one_side_group_and_a_failed_fit_ends_with_the_users_exception() -> None:
    done = _run("fail")
    counts = re.findall(r"rank (\d): side groups made (\d+) then (\d+)", done.stderr)
    assert sorted(counts) == [("0", "2", "2"), ("1", "2", "2")], done.stderr[-3000:]  # checks' and the rounds'
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])  # not -6 / 134: an abort
    assert "ValueError: the user's own error" in done.stderr and "terminate called" not in done.stderr


def test_teardown_keeps_what_a_checkpoint_after_fit_needs(tmp_path: Path) -> None:
    """After ``fit`` (and its teardown) the synchronized model is still there to save, and resumes."""
    strategy = lordo(sync_every=4, start_method="popen", synchronous=False)  # rounds and their anchor on one device
    fitted = trainer(strategy, devices=1, max_steps=8)
    fitted.fit(TinyRegressor(), loader())
    anchor = strategy.synchronizer.anchor.tensors
    assert anchor and all(t.device.type == "cpu" for t in anchor)
    fitted.save_checkpoint(tmp_path / "after.ckpt")
    resumed = trainer(lordo(sync_every=4, start_method="popen"), devices=1, max_steps=12)
    resumed.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "after.ckpt")
    assert resumed.global_step == 12


class Finals(L.Callback):
    """Each rank's model in ``on_train_end`` (a user's hook: it runs before the strategy's) and at ``on_fit_end``,
    the optimizer steps the synchronizer counted and the steps of its sync reports, saved for the test process."""

    def __init__(self, directory: Path, tag: str) -> None:
        self.directory, self.tag, self.at_train_end = directory, tag, None

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.at_train_end = flat_params(module).clone()

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        reports = [r.step for r in trainer.strategy.sync_reports]
        torch.save({"train_end": self.at_train_end, "fit_end": flat_params(module).clone(),
                    "optimizer_steps": sync.optimizer_steps, "reports": reports,
                    "lightning_bytes": trainer.strategy.accountant.totals.get("lightning_collectives", 0)},
                   self.directory / f"{self.tag}_rank{trainer.global_rank}.pt")


def _finals(directory: Path, tag: str) -> list[dict]:
    return [torch.load(directory / f"{tag}_rank{r}.pt", weights_only=True) for r in (0, 1)]


def test_the_learning_rate_finders_search_leaves_no_trace_in_the_rounds(tmp_path: Path) -> None:
    """Lightning's LearningRateFinder trains a search and restores its checkpoint after the strategy's setup: the
    strategy's state (anchor, step counts, rounds) must come back too, so the run is the run without the search."""
    from lightning.pytorch.callbacks import LearningRateFinder

    for tag, extra in (("plain", []), ("finder", [LearningRateFinder(min_lr=1e-4, max_lr=10.0, num_training_steps=8,
                                                                      early_stop_threshold=None, update_attr=False)])):
        torch.manual_seed(0)
        csv = CSVLogger(tmp_path, name=tag, version=0)
        trainer(lordo(sync_every=4), callbacks=[*extra, Finals(tmp_path, tag)], max_steps=6, logger=csv,
                log_every_n_steps=1).fit(TinyRegressor(), loader())
    plain, finder = _finals(tmp_path, "plain"), _finals(tmp_path, "finder")
    for rank in (0, 1):
        assert finder[rank]["optimizer_steps"] == 6 and finder[rank]["reports"] == plain[rank]["reports"] == [4, 6]
        assert torch.equal(finder[rank]["fit_end"], plain[rank]["fit_end"]), "the search changed the training"
    logged: dict[str, dict[str, dict[str, str]]] = {}
    for tag in ("plain", "finder"):
        header, *rows = (tmp_path / tag / "version_0" / "metrics.csv").read_text().splitlines()
        names = header.split(",")
        logged[tag] = {}
        for name in ("lordo/bytes_sent_total", "lordo/bytes_sent_sync"):
            column, step = names.index(name), names.index("step")
            logged[tag][name] = {r.split(",")[step]: r.split(",")[column] for r in rows if r.split(",")[column]}
    total, sync = "lordo/bytes_sent_total", "lordo/bytes_sent_sync"
    assert sorted(logged["finder"][total]) == sorted(logged["plain"][total]) == ["3", "5"], logged  # Lightning's steps
    assert logged["finder"][sync] == logged["plain"][sync], logged  # the same rounds' bytes
    # the search's own traffic on top, the same at both: its save's two agreements on the shards (16 B) and
    # Lightning's collectives of the search (rank 0's, which the logger writes)
    search = finder[0]["lightning_bytes"] - plain[0]["lightning_bytes"]
    extra = {float(logged["finder"][total][k]) - float(logged["plain"][total][k]) for k in ("3", "5")}
    assert search > 0 and extra == {16.0 + search}, (logged, search)


class FinderAtEpochStart:
    """Lightning's documented pattern (LearningRateFinder's docstring): the search runs at an epoch's start, inside
    the fit's loop, after the strategy's ``on_train_start``."""

    def __new__(cls, milestone: int) -> L.Callback:
        from lightning.pytorch.callbacks import LearningRateFinder

        class FineTune(LearningRateFinder):
            def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
                return

            def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
                if trainer.current_epoch == milestone:
                    self.lr_find(trainer, module)

        return FineTune(min_lr=1e-4, max_lr=1e-1, num_training_steps=6, early_stop_threshold=None, update_attr=False)


@pytest.mark.parametrize("milestone", [0, 1])
def test_a_search_inside_the_fit_leaves_its_final_sync_to_the_fit(tmp_path: Path, milestone: int) -> None:
    """The search ends with a final sync of its own; restored, the fit must still run its final sync (epochs of 4
    steps, rounds of 5: the fit ends mid-round): one model. From the first epoch's start the fit is the fit without
    the search, bit for bit; from a later one Lightning's restore does not continue a fit exactly (DDP's neither)."""
    for tag, extra in (("plain", []), ("finder", [FinderAtEpochStart(milestone)])):
        torch.manual_seed(0)
        trainer(lordo(sync_every=5), callbacks=[*extra, Finals(tmp_path, tag)], max_steps=-1, max_epochs=3,
                default_root_dir=tmp_path).fit(TinyRegressor(), loader(n=64))
    plain, finder = _finals(tmp_path, "plain"), _finals(tmp_path, "finder")
    assert plain[0]["reports"] == [5, 10, 12]
    assert torch.equal(finder[0]["fit_end"], finder[1]["fit_end"]), "the ranks ended apart"
    for rank in (0, 1):
        assert finder[rank]["reports"] == plain[rank]["reports"]
        if milestone == 0:
            assert torch.equal(finder[rank]["fit_end"], plain[rank]["fit_end"]), "the search changed the training"


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_fit_stopped_mid_round_is_one_model_in_the_users_on_train_end(tmp_path: Path) -> None:
    """Stopped at step 6 of rounds of 4 (EarlyStopping, max_time, should_stop): the final sync runs before the
    user's ``on_train_end`` hooks (and ModelCheckpoint's last save there), as with DDP they see one model."""
    trainer(lordo(sync_every=4), callbacks=[StopAt(6), Finals(tmp_path, "stopped")], max_steps=20).fit(
        TinyRegressor(), loader())
    ranks = _finals(tmp_path, "stopped")
    assert ranks[0]["reports"] == [4, 6]
    for rank in ranks:
        assert torch.equal(rank["train_end"], rank["fit_end"])
    assert torch.equal(ranks[0]["train_end"], ranks[1]["train_end"])


class EndsOtherwise(TinyRegressor):
    """Validates every epoch (noting the model it validates); ``how``: ``"earlystop"`` (its val_loss rises, so
    EarlyStopping stops after epoch 2 of 5), ``"earlystop_mid_epoch"`` (validating every 3 batches: it stops at
    the second validation, mid-epoch, at step 8 of rounds of 5), ``"dataloader_iter"`` (a
    ``training_step(dataloader_iter)``, whose last batch Lightning knows only after it), ``"should_stop"`` (set in
    the module's ``on_train_batch_end`` of step 7, in an epoch of 5), ``"should_stop_in_step"`` (set within step 7,
    as a Timer of the batch does)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.validated = how, []
        if how == "dataloader_iter":
            self.training_step = self._training_step_on_iterator  # type: ignore[method-assign]

    def _training_step_on_iterator(self, dataloader_iter: Any) -> torch.Tensor:
        (x, y), *_ = next(dataloader_iter)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.how == "should_stop" and self.trainer.global_step == 7:
            self.trainer.should_stop = True

    def on_before_optimizer_step(self, *args: Any) -> None:
        if self.how == "should_stop_in_step" and self.trainer.global_step == 6:  # as a batch's Timer does
            self.trainer.should_stop = True

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.validated.append(flat_params(self).clone())
        self.log("val_loss", float(self.trainer.global_step), sync_dist=True)  # rises: EarlyStopping stops

    def val_dataloader(self) -> Any:
        return loader(n=32)


class SavedAndValidated(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        checkpoint = torch.load(self.directory / "last.ckpt", weights_only=False)
        saved, final = checkpoint["state_dict"], flat_params(module)
        assert torch.equal(torch.cat([saved[n].reshape(-1) for n, _ in module.named_parameters()]), final)
        epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"]  # where a resume goes on
        torch.save({"validated": module.validated[-1], "final": final, "step": trainer.global_step,
                    "rank": trainer.global_rank, "epochs_completed": epochs},
                   self.directory / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("how", ["earlystop", "earlystop_mid_epoch", "dataloader_iter", "should_stop",
                                 "should_stop_in_step"])
def test_a_fit_that_ends_off_its_known_last_step_saves_last_ckpt_with_the_model_fit_returns(tmp_path: Path,
                                                                                            how: str) -> None:
    """The final sync ran at ``on_train_end``, after ModelCheckpoint's last save (``last.ckpt`` held the model from
    before it, DDP's the model fit returns). Where the batch tells the end (``should_stop`` from a batch, a
    ``dataloader_iter`` step's last batch) the sync now runs then, so the validation after it sees the final model
    as DDP's does; EarlyStopping decides after its validation (which saw the anchor), and ``last`` is written again."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    every = ModelCheckpoint(tmp_path / "every", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    callbacks = [ModelCheckpoint(tmp_path, save_last=True), every, SavedAndValidated(tmp_path)]
    if how.startswith("earlystop"):
        callbacks.append(EarlyStopping("val_loss", patience=0, mode="min"))
    k = 5 if how == "earlystop_mid_epoch" else 4  # its stop at step 8: mid-round
    trainer(lordo(sync_every=k), callbacks=callbacks, max_steps=-1, max_epochs=2 if how == "dataloader_iter" else 5,
            enable_checkpointing=True, num_sanity_val_steps=0,
            val_check_interval=3 if how == "earlystop_mid_epoch" else 1.0).fit(EndsOtherwise(how), loader(n=80))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]  # rank 0 checked last.ckpt
    step = {"earlystop": 10, "earlystop_mid_epoch": 8, "dataloader_iter": 10, "should_stop": 7,
            "should_stop_in_step": 7}[how]
    assert ranks[0]["step"] == step and torch.equal(ranks[0]["final"], ranks[1]["final"])
    if how in ("earlystop_mid_epoch", "should_stop"):  # saved mid-epoch, as DDP's: a resume finishes the epoch
        assert ranks[0]["epochs_completed"] == 1, ranks[0]["epochs_completed"]  # (a save redone at the end: 2)
    if not how.startswith("earlystop"):  # the stop was known before the validation after it
        assert torch.equal(ranks[0]["validated"], ranks[0]["final"]), "the last validation saw the anchor"
    if how in ("dataloader_iter", "should_stop_in_step"):  # and before the batch's saves (the module's hook: after)
        saved = torch.load(tmp_path / "every" / f"step={step}.ckpt", weights_only=True)["state_dict"]
        assert torch.equal(torch.cat([v.reshape(-1) for k, v in saved.items() if k.startswith("net.")]),
                           ranks[0]["final"]), "the save at the last batch held the anchor"


def test_weight_averaging_is_refused_with_local_rounds_and_runs_on_one_device() -> None:
    """EMA/SWA average each rank's own replica: with local rounds on 2 processes the ranks would end apart."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    with pytest.raises(Exception, match=r"StochasticWeightAveraging is not supported with LoRDO's local rounds"):
        trainer(lordo(sync_every=4), callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)], max_epochs=2,
                max_steps=-1).fit(TinyRegressor(), loader(n=64))
    validated = trainer(lordo(sync_every=4), callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
    validated.validate(TinyRegressor(), loader(n=64))  # no rounds: nothing to refuse
    one = trainer(lordo(sync_every=4, start_method="popen"), devices=1, max_epochs=2, max_steps=-1,
                  callbacks=[StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)])
    one.fit(TinyRegressor(), loader(n=64))
    assert one.global_step == 16


class MasksAtEnd(L.Callback):
    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        masks = torch.cat([b.reshape(-1) for n, b in module.named_buffers() if n.endswith("weight_mask")])
        assert masks.numel() and torch.equal(*gather(masks)), "the ranks pruned different weights"


def test_pruning_is_refused_with_local_rounds_and_prunes_alike_with_synchronous_steps() -> None:
    """ModelPruning prunes each rank's replica: between syncs they differ, so the masks (buffers made after setup,
    which no sync sees) ended different on each rank, silently."""
    from lightning.pytorch.callbacks import ModelPruning

    def pruning() -> ModelPruning:
        return ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=False)

    with pytest.raises(Exception, match=r"ModelPruning is not supported with LoRDO's local rounds"):
        trainer(lordo(sync_every=4), callbacks=[pruning()], max_epochs=2, max_steps=-1).fit(TinyRegressor(),
                                                                                          loader(n=64))
    trainer(lordo(sync_every=4, synchronous=True), callbacks=[pruning(), MasksAtEnd()], max_epochs=2,
            max_steps=-1).fit(TinyRegressor(), loader(n=64))


class HookOfYourOwn(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.steps = 0
        trainer.optimizers[0].register_step_post_hook(lambda *args: setattr(self, "steps", self.steps + 1))


def test_a_step_hook_of_your_own_runs_beside_the_strategys() -> None:
    """The conversion's first-step hook removed itself while torch looped over the hooks: any hook registered after
    it failed the first step (``OrderedDict mutated during iteration``)."""
    own = HookOfYourOwn()
    fit = trainer(lordo(sync_every=2, start_method="popen"), devices=1, max_steps=4, callbacks=[own])
    fit.fit(TinyRegressor(), loader())
    assert own.steps == 4 and len(fit.optimizers[0]._optimizer_step_post_hooks) == 1  # yours: the strategy's are
    # removed after the first step (the mark) and the final sync (the check of undriven steps)
