"""Resuming with changes: knobs passed now win (one warning lists them), another preset, a changed set of
trainable parameters, and what is refused before training starts."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer
from test_resume import FIXED_DATA, BatchNormRegressor, K, epoch_loader
from torch import nn

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.strategy_knobs import strategy_kwargs

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


def _first_fit(tmp_path: Path, module: L.LightningModule, strategy: Any, steps: int = 12) -> Path:
    """A run with checkpoints at steps 3, 6, 9, 12 (K = 4: step 6 is mid-round, 12 at a sync)."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_epochs=1, save_top_k=-1)
    torch.manual_seed(0)
    trainer(strategy, callbacks=[checkpoints], max_steps=steps, **FIXED_DATA, enable_checkpointing=True).fit(
        module, epoch_loader())
    return tmp_path / "ckpt"


class Record(L.Callback):
    """What the resumed run ended with (rank 0): its parameters, its optimizer's knobs and bases, and the warnings
    the resume gave (recorded in the worker, from setup on)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._recorder = warnings.catch_warnings(record=True)
        self.caught = self._recorder.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._recorder.__exit__(None, None, None)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        out: dict[str, Any] = {"params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
                               "warnings": [str(w.message) for w in self.caught]}
        if isinstance(optimizer, LoRDO):
            out["groups"] = [{k: g[k] for k in ("rank", "omega", "normalizer", "error_feedback")}
                             for g in optimizer.param_groups]
            out["ranks"] = [optimizer.state[p]["basis"].shape[1] for p in optimizer.lowrank_params()]
            out["ef"] = all("error_feedback" in optimizer.state[p] for p in optimizer.lowrank_params())
        if trainer.global_rank == 0:
            torch.save(out, self.path)


def _resume(tmp_path: Path, ckpt: Path, module: L.LightningModule, strategy: Any, tag: str,
            steps: int = 16) -> tuple[dict[str, Any], list[str]]:
    path = tmp_path / f"{tag}.pt"
    torch.manual_seed(0)
    trainer(strategy, callbacks=[Record(path)], max_steps=steps, **FIXED_DATA).fit(module, epoch_loader(),
                                                                                  ckpt_path=str(ckpt))
    out = torch.load(path, weights_only=True)
    return out, [m for m in out["warnings"] if "LoRDO resumed a checkpoint" in m]


def test_knobs_changed_on_resume_win_and_one_warning_lists_them(tmp_path: Path) -> None:
    """rank 4 -> 8, omega 0.7 -> 0.3, normalizer col_rms -> factored, error feedback off -> on, at a mid-round
    checkpoint: the resumed run uses the new knobs (a different trajectory from an unchanged resume), the state is
    converted (bases of rank 8, error-feedback buffers), and one warning lists all four."""
    lean = {"omega": 0.7, "error_feedback": False}  # the first run without the default's buffer
    ckpt = _first_fit(tmp_path, BatchNormRegressor(scheduler=True), lordo(sync_every=K, **lean)) / "step=6.ckpt"
    same, none = _resume(tmp_path, ckpt, BatchNormRegressor(scheduler=True), lordo(sync_every=K, **lean), "same")
    assert none == []  # nothing changed: no warning
    changed = {"rank": 8, "omega": 0.3, "normalizer": "factored", "error_feedback": True}
    new, messages = _resume(tmp_path, ckpt, BatchNormRegressor(scheduler=True), lordo(sync_every=K, **changed), "new")
    assert len(messages) == 1, messages
    for text in ("rank: 4 -> 8", "omega: 0.7 -> 0.3", "normalizer: 'col_rms' -> 'factored'",
                 "error_feedback: False -> True", "moments restarted"):
        assert text in messages[0], (text, messages[0])
    assert all(g["rank"] == 8 and g["omega"] == 0.3 and g["normalizer"] == "factored" and g["error_feedback"]
               for g in new["groups"])
    assert new["ranks"] == [8, 8] and new["ef"]
    assert not torch.equal(new["params"], same["params"])


@pytest.mark.parametrize(("first", "then"), [("lordo", "diloco"), ("diloco", "lordo")])
def test_a_checkpoint_of_one_preset_resumes_under_the_other(tmp_path: Path, first: str, then: str) -> None:
    """lordo <-> diloco: the same AdamW state for the full-rank parameters; LoRDO's low-rank moments become AdamW
    moments (expanded through the basis) for diloco, and restart for lordo from diloco's."""
    def strategy(preset: str) -> Any:
        return lordo(sync_every=K) if preset == "lordo" else \
            LoRDOStrategy(preset="diloco", sync_every=K, start_method="fork")
    ckpt = _first_fit(tmp_path, TinyRegressor(scheduler=True), strategy(first)) / "step=12.ckpt"
    out, messages = _resume(tmp_path, ckpt, TinyRegressor(scheduler=True), strategy(then), "other")
    assert len(messages) == 1 and f"preset {first} -> {then}" in messages[0], messages
    if then == "diloco":
        assert "expanded through their bases" in messages[0]
    else:
        assert messages[0].count("moments restarted") == 2
    assert torch.isfinite(out["params"]).all()


class Tied(TinyRegressor):
    """Two square layers sharing one weight (``tie=True``), or not."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3))
        if tie:
            self.net[2].weight = self.net[0].weight


def test_an_untied_layer_resumes_from_a_checkpoint_at_a_sync_and_is_refused_mid_round(tmp_path: Path) -> None:
    ckpt_dir = _first_fit(tmp_path, Tied(tie=True), lordo(sync_every=K))
    out, messages = _resume(tmp_path, ckpt_dir / "step=12.ckpt", Tied(tie=False), lordo(sync_every=K), "untied")
    assert len(messages) == 1 and "trainable parameters changed" in messages[0], messages
    assert "1 parameter(s) without saved state start fresh (net.2.weight)" in messages[0], messages[0]
    assert torch.isfinite(out["params"]).all()
    with pytest.raises(Exception, match="trainable parameters differ from the checkpoint's"):
        _resume(tmp_path, ckpt_dir / "step=6.ckpt", Tied(tie=False), lordo(sync_every=K), "refused")


class FrozenFirst(BatchNormRegressor):
    def __init__(self) -> None:
        super().__init__(scheduler=True)
        self.net[0].requires_grad_(False)


def test_a_parameter_frozen_on_resume_keeps_the_others_state(tmp_path: Path) -> None:
    ckpt = _first_fit(tmp_path, BatchNormRegressor(scheduler=True), lordo(sync_every=K)) / "step=12.ckpt"
    out, messages = _resume(tmp_path, ckpt, FrozenFirst(), lordo(sync_every=K), "frozen")
    assert len(messages) == 1 and "trainable parameters changed" in messages[0], messages
    assert torch.isfinite(out["params"]).all()


@pytest.mark.parametrize(("knobs", "match"), [
    ({"warmup_steps": 20}, r"warmup_steps=20 .*after the switch to local steps"),
    ({"warmup_steps": 4, "switch_lr_scale": 0.5}, r"Cannot change switch_lr_scale from 1.0 to 0.5"),
])
def test_what_cannot_be_converted_is_refused_before_training(tmp_path: Path, knobs: dict[str, Any],
                                                             match: str) -> None:
    ckpt = _first_fit(tmp_path, TinyRegressor(scheduler=True), lordo(sync_every=K, warmup_steps=4)) / "step=12.ckpt"
    with pytest.raises(Exception, match=match):
        _resume(tmp_path, ckpt, TinyRegressor(scheduler=True), lordo(sync_every=K, **knobs), "refused")


def test_synchronous_steps_from_a_mid_round_checkpoint_are_refused_naming_the_knob(tmp_path: Path) -> None:
    """Mid-round the replicas differ, so synchronous steps cannot start there; the message names the knob passed,
    not a warm-up the run never had."""
    ckpt = _first_fit(tmp_path, TinyRegressor(), lordo(sync_every=K)) / "step=6.ckpt"
    with pytest.raises(Exception, match=r"Cannot resume with synchronous steps \(synchronous=True\) at optimizer "
                                        r"step 7: the checkpoint was written mid-round"):
        _resume(tmp_path, ckpt, TinyRegressor(), lordo(sync_every=K, synchronous=True), "refused")


def test_an_overlapped_runs_checkpoints_name_the_one_synchronous_steps_can_resume(tmp_path: Path) -> None:
    """With ``overlap_steps`` a round is in flight or landing at every step, so no checkpoint mid-fit is at a sync:
    the refusal names the end of fit's (after the final sync), which resumes with synchronous steps."""
    ckpt = _first_fit(tmp_path, TinyRegressor(), lordo(sync_every=K, overlap_steps=1))
    with pytest.raises(Exception, match=r"mid-round \(2 local steps since the last sync\), when the replicas "
                                        r"differ\. Resume from the checkpoint of the end of fit \(after its final "
                                        r"sync; with overlap_steps=1"):
        _resume(tmp_path, ckpt / "step=6.ckpt", TinyRegressor(), lordo(sync_every=K, synchronous=True), "refused")
    out, _ = _resume(tmp_path, ckpt / "step=12.ckpt", TinyRegressor(), lordo(sync_every=K, synchronous=True), "end")
    assert torch.isfinite(out["params"]).all()


class MomentumAtStart(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        state = trainer.strategy.optimizers[0].state
        if trainer.global_rank == 0:
            torch.save([s["momentum_buffer"].clone() for s in state.values()], self.path)


def test_diloco_resumes_any_optimizers_state_as_it_is(tmp_path: Path) -> None:
    """``diloco`` keeps the user's optimizer: SGD's momentum comes back from the checkpoint unchanged (only a
    LoRDO state is converted into AdamW's)."""
    diloco = LoRDOStrategy(preset="diloco", sync_every=K, start_method="fork")
    ckpt = _first_fit(tmp_path, TinyRegressor(optimizer="sgd"), diloco) / "step=12.ckpt"
    saved = [s["momentum_buffer"] for s in torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"].values()]
    trainer(LoRDOStrategy(preset="diloco", sync_every=K, start_method="fork"), max_steps=14, **FIXED_DATA,
            callbacks=[MomentumAtStart(tmp_path / "m.pt")]).fit(TinyRegressor(optimizer="sgd"), epoch_loader(),
                                                                 ckpt_path=str(ckpt))
    resumed = torch.load(tmp_path / "m.pt", weights_only=True)
    assert len(resumed) == len(saved) > 0 and all(torch.equal(a, b) for a, b in zip(resumed, saved))


class ReplicasMeetAtSyncs(L.Callback):
    """After the resumed run's first step the synchronized model is the loaded one (step 6), the switch knobs apply
    (betas, and the scheduler's base LR halved once), and the replicas are identical after every sync: the anchor was
    taken before the first local step, on every rank alike."""

    def __init__(self) -> None:
        self.synchronized: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        self.synchronized.append(sync.synchronized_step)
        group = trainer.optimizers[0].param_groups[0]
        assert tuple(group["betas"]) == (0.8, 0.9), group["betas"]
        assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == pytest.approx([5e-3] * len(
            trainer.optimizers[0].param_groups))
        if sync.steps_since_sync == 0:
            assert torch.equal(*gather(flat_params(module))), f"replicas differ after step {sync.optimizer_steps}"

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.synchronized == [6] * 3 + [10] * 4 + [14, 15], self.synchronized
        assert torch.equal(*gather(flat_params(module)))


@pytest.mark.parametrize("frozen", [False, True], ids=["same-parameters", "a-parameter-frozen"])
def test_a_warmup_checkpoint_resumed_with_local_steps_switches_before_the_first_one(tmp_path: Path,
                                                                                      frozen: bool) -> None:
    """Written in the synchronous warm-up (no anchor yet), resumed without it: the switch to local steps happens at
    the resume, before any local step (taking the anchor after one, each rank its own, kept the replicas apart),
    also when the trainable parameters changed."""
    first = _first_fit(tmp_path, BatchNormRegressor(scheduler=True), lordo(sync_every=K, warmup_steps=20))
    torch.manual_seed(0)
    switch = {"switch_lr_scale": 0.5, "switch_betas": (0.8, 0.9)}
    strategy = lordo(sync_every=K, warmup_steps=2, **switch)  # past the checkpoint's step 6
    trainer(strategy, callbacks=[ReplicasMeetAtSyncs()], max_steps=15, **FIXED_DATA).fit(
        FrozenFirst() if frozen else BatchNormRegressor(scheduler=True), epoch_loader(),
        ckpt_path=str(first / "step=6.ckpt"))


def test_changed_parameters_are_refused_with_an_overlapped_round_in_flight(tmp_path: Path) -> None:
    """Saved at step 12, where a round launched (0 steps since the sync, but the replicas differ from the saved
    model until it lands): a changed set of trainable parameters is refused, as mid-round."""
    first = _first_fit(tmp_path, BatchNormRegressor(scheduler=True), lordo(sync_every=K, overlap_steps=2), steps=16)
    ckpt = first / "step=12.ckpt"
    with pytest.raises(Exception, match=r"trainable parameters differ.*overlapped round in\s+flight"):
        _resume(tmp_path, ckpt, FrozenFirst(), lordo(sync_every=K, overlap_steps=2), "frozen")


def _fabric_resume(tmp_path: Path, saved_knobs: dict[str, Any], knobs: dict[str, Any]) -> tuple[Any, list[str]]:
    import os

    from lightning.fabric import Fabric

    from lightning_lordo import LoRDOFabricStrategy

    environment = dict(os.environ)
    try:
        def fabric(**k: Any) -> Fabric:
            strategy = LoRDOFabricStrategy(sync_every=K, start_method="popen", timeout=30,
                                           **strategy_kwargs(**{"rank": 4, **k}))
            launched = Fabric(accelerator="cpu", devices=1, strategy=strategy)
            launched.launch()
            return launched

        def model_and_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            net = TinyRegressor().net
            return net, torch.optim.AdamW(net.parameters(), lr=1e-2)

        first = fabric(**saved_knobs)
        net, optimizer = first.setup(*model_and_adamw())
        for x, y in list(epoch_loader())[:K]:
            first.backward(nn.functional.mse_loss(net(x), y))
            optimizer.step()
            optimizer.zero_grad()
        first.save(tmp_path / "fabric.ckpt", {"model": net, "optimizer": optimizer})
        second = fabric(**knobs)
        net2, optimizer2 = second.setup(*model_and_adamw())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second.load(tmp_path / "fabric.ckpt", {"model": net2, "optimizer": optimizer2})
        return optimizer2.optimizer, [str(w.message) for w in caught if "LoRDO resumed a checkpoint" in str(w.message)]
    finally:
        os.environ.clear()
        os.environ.update(environment)


def _trainer_resume(tmp_path: Path, saved_knobs: dict[str, Any], knobs: dict[str, Any]) -> tuple[Any, list[str]]:
    ckpt = _first_fit(tmp_path, TinyRegressor(), lordo(sync_every=K, **saved_knobs)) / "step=12.ckpt"
    out, messages = _resume(tmp_path, ckpt, TinyRegressor(), lordo(sync_every=K, **knobs), "resumed")

    class Groups:  # what the resumed run's optimizer has, as Record saved it
        param_groups = out["groups"]
    return Groups(), messages


@pytest.mark.parametrize("driver", ["trainer", "fabric"])
def test_the_knobs_passed_at_a_resume_win_with_the_trainer_and_with_fabric(tmp_path: Path, driver: str) -> None:
    """Saved with the defaults at omega 0.9, resumed with the lean preset's knobs at omega 0.5: the optimizer has the
    knobs passed now (none reverted to the checkpoint's) and one warning lists them."""
    lean = {"omega": 0.5, "full_rank_input": "gradient", "error_feedback": False, "power_iters": 1}
    resume = _fabric_resume if driver == "fabric" else _trainer_resume
    optimizer, messages = resume(tmp_path, {"omega": 0.9}, lean)
    for group in optimizer.param_groups:
        assert group["omega"] == 0.5 and group["error_feedback"] is False, group
    assert len(messages) == 1, messages
    for text in ("omega: 0.9 -> 0.5", "error_feedback: True -> False"):
        assert text in messages[0], (text, messages[0])


@pytest.fixture(scope="module")
def in_flight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint at step 9 with the round launched at step 8 in flight (overlap_steps=2, K=4)."""
    from test_resume import _fit

    directory = tmp_path_factory.mktemp("flight")
    _fit(directory, "full", checkpoints=True, overlap_steps=2)
    return directory / "ckpt" / "step=9.ckpt"


@pytest.mark.parametrize(("knobs", "named"), [
    ({"rank": 8}, "rank"), ({"average_moments": False}, "average_moments"),
    ({"basis_scope": "local", "average_moments": False}, "basis_scope"), ({"lowrank": False}, "lowrank"),
    ({"average_fullrank_moments": True}, "average_fullrank_moments"),
], ids=["rank", "average_moments", "basis_scope", "diloco", "fullrank_moments"])
def test_a_knob_that_shapes_a_round_in_flight_is_refused_by_name(in_flight: Path, tmp_path: Path,
                                                                  knobs: dict[str, Any], named: str) -> None:
    from test_resume import _fit

    with pytest.raises(Exception, match=f"Cannot change .*{named} from .*round in flight") as caught:
        _fit(tmp_path, "changed", ckpt=str(in_flight), overlap_steps=2, **knobs)
    assert "zip()" not in str(caught.value)


@pytest.mark.parametrize(("saved", "now"), [("adamw", "factored"), ("factored", "adamw")])
def test_a_changed_fullrank_state_is_refused_when_the_round_in_flight_averages_fullrank_moments(
        tmp_path: Path, saved: str, now: str) -> None:
    """With ``average_fullrank_moments`` the round in flight copied the full-rank moments in the checkpoint's form
    (AdamW's two, or the factored three): redone from those copies, a changed ``fullrank_state`` is refused by name,
    not met by a zip() of the copies against the converted state."""
    from test_resume import _fit

    _fit(tmp_path, "full", checkpoints=True, overlap_steps=2, average_fullrank_moments=True, fullrank_state=saved)
    with pytest.raises(Exception, match=r"Cannot change .*fullrank_state from .*round in flight") as caught:
        _fit(tmp_path, "changed", ckpt=str(tmp_path / "ckpt" / "step=9.ckpt"), overlap_steps=2,
             average_fullrank_moments=True, fullrank_state=now)
    assert "zip()" not in str(caught.value)


class LoRDOWithoutTheStrategy(TinyRegressor):
    def configure_optimizers(self) -> Any:
        return LoRDO(self.parameters(), lr=1e-2, rank=4)


class StateAtStart(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.state = {i: {k: v.clone() for k, v in e.items() if torch.is_tensor(v)}
                      for i, e in trainer.optimizers[0].state_dict()["state"].items()}


def test_a_lordo_state_saved_by_another_strategy_keeps_its_moments(tmp_path: Path) -> None:
    """``LoRDO`` from ``configure_optimizers`` under a plain strategy (no ``checkpoint["lordo"]``), resumed under
    ``"lordo"``: bases and moments come back as saved, and no warning says they restart."""
    torch.manual_seed(0)
    first = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    first.fit(LoRDOWithoutTheStrategy(), loader())
    first.save_checkpoint(tmp_path / "plain.ckpt")
    checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert "lordo" not in checkpoint
    saved = checkpoint["optimizer_states"][0]["state"]
    assert sum("basis" in e for e in saved.values()) == 2
    start = StateAtStart()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(LoRDOStrategy(start_method="popen"), devices=1, max_steps=6, callbacks=[start]).fit(
            LoRDOWithoutTheStrategy(), loader(), ckpt_path=str(tmp_path / "plain.ckpt"))
    said = [str(w.message) for w in caught]
    assert not any("moments restart" in m for m in said), said
    assert start.state.keys() == saved.keys()
    for index, entry in saved.items():
        for key in ("basis", "exp_avg", "exp_avg_sq"):
            if key in entry:
                assert torch.equal(start.state[index][key], entry[key]), (index, key)


class ReplicasEqualEveryStep(L.Callback):
    """In the synchronous steps the replicas are one model after every step (and after the final sync)."""

    def __init__(self, synchronous_until: int) -> None:
        self.synchronous_until = synchronous_until

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step <= self.synchronous_until:
            assert torch.equal(*gather(flat_params(module))), f"replicas differ after step {trainer.global_step}"

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert torch.equal(*gather(flat_params(module)))


@pytest.mark.parametrize("knobs", [{"synchronous": True}, {"warmup_steps": 14}], ids=["synchronous", "warm-up"])
def test_synchronous_steps_resumed_after_local_ones_keep_one_model(tmp_path: Path, knobs: dict[str, Any]) -> None:
    """A checkpoint of local rounds written at a sync (step 12) holds each rank's own moments: resumed with
    synchronous steps, which average only the gradients, every rank takes rank 0's optimizer state (each its own
    kept the replicas apart for good: 6e-2 after 6 steps)."""
    first = _first_fit(tmp_path, TinyRegressor(), lordo(sync_every=K))
    synchronous_until = 16 if "synchronous" in knobs else 14
    torch.manual_seed(0)
    trainer(lordo(sync_every=K, **knobs), callbacks=[ReplicasEqualEveryStep(synchronous_until)], max_steps=16,
            **FIXED_DATA).fit(TinyRegressor(), epoch_loader(), ckpt_path=str(first / "step=12.ckpt"))
