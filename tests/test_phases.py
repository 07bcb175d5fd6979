"""Synchronous phases (``warmup_steps``, the ``lowrank_ddp`` preset), the switch to local steps, and what else a
sync may average (full-rank moments, error feedback). 2 processes launched by fork, assertions in the workers."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.convert import full_rank_params, track_step_calls
from lightning_lordo.strategy_knobs import strategy_kwargs

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


def _flags_and_grads(module: L.LightningModule) -> int:
    """Bytes of one synchronous step: every trainable gradient in float32 and one float32 flag per parameter."""
    params = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() * 4 for p in params) + 4 * len(params)


class PhaseChecker(L.Callback):
    """Replicas identical after every synchronous step, different between syncs afterwards; the switch happens
    once, at the end of the warm-up, with its knobs; bytes by purpose are what travels in each phase."""

    def __init__(self, warmup: int, k: int, steps: int, lr_scale: float = 1.0, betas: Any = None) -> None:
        self.warmup, self.k, self.steps, self.lr_scale, self.betas = warmup, k, steps, lr_scale, betas
        self.lrs: list[float] = []
        self.bases: dict[int, torch.Tensor] = {}
        self.checked = {"synchronous": 0, "local": 0}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        step = sync.optimizer_steps
        copies = gather(flat_params(module))
        optimizer: LoRDO = sync.optimizer
        first = optimizer.lowrank_params()[0]
        self.bases[step] = optimizer.state[first]["basis"].clone()
        assert torch.equal(*gather(self.bases[step]))
        self.lrs.append(optimizer.param_groups[0]["lr"])
        if step <= self.warmup:  # synchronous: no drift, no anchor until the switch at the end of the warm-up
            assert torch.equal(copies[0], copies[1]), f"replicas differ at synchronous step {step}"
            assert sync.steps_since_sync == 0
            assert (not sync.anchor) == (step < self.warmup)
            self.checked["synchronous"] += 1
        else:
            local = step - self.warmup
            assert sync.steps_since_sync == local % self.k
            assert torch.equal(copies[0], copies[1]) == (local % self.k == 0)
            self.checked["local"] += 1
        group = optimizer.param_groups[0]
        if step == self.warmup and self.betas is not None:
            assert tuple(group["betas"]) == self.betas
            assert optimizer.state[first]["step"].item() == 0  # moments zeroed at the switch, basis kept
            assert optimizer.state[first]["exp_avg"].abs().max() == 0
        if step == self.warmup + 1 and self.betas is not None:
            assert optimizer.state[first]["step"].item() == 1

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        assert self.checked["synchronous"] == self.warmup and self.checked["local"] == self.steps - self.warmup
        # a refresh every K synchronous steps (before steps K+1, 2K+1, ...), none at the other steps
        for step in range(2, self.warmup + 1):
            moved = not torch.equal(self.bases[step], self.bases[step - 1])
            assert moved == ((step - 1) % self.k == 0), f"basis refresh before step {step}: {moved}"
        # the reports: every K synchronous steps and at the switch, then every K local steps and the final sync
        synchronous = sorted({*range(self.k, self.warmup + 1, self.k), self.warmup})
        local = sorted({*range(self.warmup + self.k, self.steps + 1, self.k), self.steps})
        assert [r.step for r in strategy.sync_reports] == synchronous + local
        assert all(r.extra.get("synchronous") == 1.0 for r in strategy.sync_reports[: len(synchronous)])
        totals = dict(strategy.accountant.totals)
        assert totals["gradients"] == self.warmup * _flags_and_grads(module)
        assert "initial_gradients" not in totals  # the first gradient was already the average: no extra message
        params = [p for p in module.parameters() if p.requires_grad]
        assert totals["pseudo_gradients"] == len(local) * sum(p.numel() * 4 for p in params)
        assert totals["holders"] == len(local) * 4 * len(trainer.optimizers[0].lowrank_params())  # a flag a moment
        assert math.isclose(sum(r.bytes_sent for r in strategy.sync_reports),
                            totals["gradients"] + totals["pseudo_gradients"] + totals["moments"] + totals["holders"])
        # the learning rate follows the schedule, scaled from the first local step on. Lightning steps the scheduler
        # before on_train_batch_end, so the LR seen after step s is the one of step s + 1.
        lam = [min(1.0, (s + 1) / 5) * 0.9**s for s in range(1, self.steps + 1)]  # the LambdaLR of TinyRegressor
        expected = [1e-2 * f * (self.lr_scale if s >= self.warmup else 1.0) for s, f in zip(range(1, 99), lam)]
        assert self.lrs == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("switch", [False, True], ids=["no switch", "switch"])
def test_warmup_is_synchronous_then_local(switch: bool) -> None:
    knobs: dict[str, Any] = {"warmup_steps": 6}
    if switch:
        knobs.update(switch_betas=(0.95, 0.99), switch_reset_moments=True, switch_lr_scale=0.5)
    checker = PhaseChecker(warmup=6, k=4, steps=14, lr_scale=0.5 if switch else 1.0,
                           betas=(0.95, 0.99) if switch else None)
    trainer(lordo(sync_every=4, **knobs), callbacks=[checker], max_steps=14).fit(TinyRegressor(scheduler=True),
                                                                                 loader())


class SaveFinal(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert torch.equal(*gather(flat_params(module)))
        if trainer.global_rank == 0:
            torch.save(flat_params(module), self.path)


class LoRDOUnderDDP(TinyRegressor):
    """TinyRegressor whose optimizer is LoRDO itself (rank 4, as the strategy would build it), for plain DDP."""

    def configure_optimizers(self) -> Any:
        adamw = super().configure_optimizers()
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                  for g in adamw.param_groups]
        optimizer = LoRDO(groups, rank=4, full_rank=full_rank_params(self))
        track_step_calls(optimizer)
        return optimizer


class RefreshFromGradient(L.Callback):
    """Low-rank DDP by hand: bases from the (DDP-averaged) gradient every ``k`` steps, before the step."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        lordo: LoRDO = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if trainer.global_step and trainer.global_step % self.k == 0:
            lordo.install_bases({p: p.grad for p in lordo.lowrank_params()})


def test_lowrank_ddp_is_ddp_with_the_lowrank_optimizer(tmp_path: Path) -> None:
    """The "lowrank_ddp" preset equals Lightning's DDP running LoRDO with bases refreshed every K steps from the
    averaged gradient, and it sends DDP's bytes (plus one flag per parameter and step)."""
    torch.manual_seed(0)
    module = LoRDOUnderDDP()
    init = {k: v.clone() for k, v in module.state_dict().items()}
    trainer("ddp_fork", callbacks=[SaveFinal(tmp_path / "ddp.pt"), RefreshFromGradient(4)],
            max_steps=12).fit(module, loader())
    reference = torch.load(tmp_path / "ddp.pt")
    plain = TinyRegressor()
    plain.load_state_dict(init)
    strategy = LoRDOStrategy(sync_every=4, start_method="fork", optimizer={"rank": 4},
                             experimental={"synchronous": True})
    trainer(strategy, callbacks=[SaveFinal(tmp_path / "lowrank_ddp.pt")], max_steps=12).fit(plain, loader())
    ours = torch.load(tmp_path / "lowrank_ddp.pt")
    assert not torch.equal(reference, flat_params(LoRDOUnderDDP()))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_lowrank_ddp_name_keeps_no_anchor_and_counts_gradients(tmp_path: Path) -> None:
    class Check(L.Callback):
        def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            strategy: LoRDOStrategy = trainer.strategy
            assert not strategy.synchronizer.anchor and strategy.synchronizer.memory_report()["anchor"] == 0
            assert set(strategy.accountant.totals) - {"setup_broadcast", "lightning_sigterm_check",
                                                      "lightning_collectives"} == {"gradients"}
            assert strategy.accountant.totals["gradients"] == 34 * _flags_and_grads(module)
            assert [r.step for r in strategy.sync_reports] == [16, 32]  # a report at every basis refresh (K = 16)
            if trainer.global_rank == 0:
                (tmp_path / "total.txt").write_text(str(strategy.accountant.total_bytes))

    fit = trainer("lowrank_ddp_fork", callbacks=[Check()], max_steps=34, logger=CSVLogger(tmp_path, name="csv"),
                  log_every_n_steps=1)
    assert isinstance(fit.strategy, LoRDOStrategy) and fit.strategy.sync_config.synchronous
    fit.strategy.optimizer_knobs["rank"] = 4
    fit.fit(TinyRegressor(), loader(n=34 * 16))
    # the monitor logs the totals as they ended (the last 2 steps' bytes were never logged: no report covers them)
    with open(next(tmp_path.glob("csv/*/metrics.csv"))) as f:
        logged = [float(r["lordo/bytes_sent_total"]) for r in csv.DictReader(f) if r.get("lordo/bytes_sent_total")]
    assert logged[-1] == int((tmp_path / "total.txt").read_text()) and len(logged) == 3


class AveragedState(L.Callback):
    """Right after each sync, the state a sync averages is bitwise identical on both ranks; the rest differs."""

    def __init__(self, k: int, fullrank: bool, feedback: bool) -> None:
        self.k, self.fullrank, self.feedback = k, fullrank, feedback
        self.checked = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.steps_since_sync != 0:
            return
        optimizer = sync.optimizer
        lowrank = set(optimizer.lowrank_params()) if isinstance(optimizer, LoRDO) else set()
        for p in module.parameters():
            state = optimizer.state[p]
            moments = [k for k in ("exp_avg", "exp_avg_sq", "factored_row", "factored_col") if k in state]
            assert len(moments) == (3 if "factored_row" in state else 2)
            for key in moments:
                same = torch.equal(*gather(state[key]))
                assert same == (p in lowrank or self.fullrank), f"{key} of {tuple(p.shape)}"
            if "error_feedback" in state:
                assert torch.equal(*gather(state["error_feedback"])) == self.feedback
        self.checked += 1

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.checked >= 2
        strategy = trainer.strategy
        optimizer = strategy.synchronizer.optimizer
        syncs = len(strategy.sync_reports)
        lowrank = set(optimizer.lowrank_params()) if isinstance(optimizer, LoRDO) else set()
        moments = sum(2 * optimizer.state[p]["exp_avg"].numel() * 4 for p in lowrank)
        if self.fullrank:
            moments += sum(t.numel() * t.element_size() for p in module.parameters() if p not in lowrank
                           for k, t in optimizer.state[p].items() if k != "step")  # AdamW's, or factored
        assert strategy.accountant.totals.get("moments", 0) == syncs * moments
        feedback = sum(optimizer.state[p]["error_feedback"].numel() * 4 for p in lowrank) if self.feedback else 0
        assert strategy.accountant.totals.get("error_feedback", 0) == syncs * feedback


@pytest.mark.parametrize(("preset", "knobs"), [
    ("lordo", {"average_fullrank_moments": True}),
    ("lordo", {"average_fullrank_moments": True, "error_feedback": True, "average_error_feedback": True}),
    ("lordo", {"average_fullrank_moments": True, "fullrank_state": "factored"}),
    ("lordo", {"error_feedback": True}),
    ("diloco", {"average_fullrank_moments": True}),
], ids=["fullrank moments", "fullrank moments + error feedback", "factored fullrank moments",
        "error feedback kept local", "diloco moments"])
def test_a_sync_averages_the_optimizer_state_asked_for(preset: str, knobs: dict[str, Any]) -> None:
    checker = AveragedState(4, fullrank=knobs.get("average_fullrank_moments", False),
                            feedback=knobs.get("average_error_feedback", False))
    strategy = lordo(sync_every=4, lowrank=preset == "lordo", **knobs) if preset == "lordo" else \
        LoRDOStrategy(preset="diloco", sync_every=4, start_method="fork", **strategy_kwargs(**knobs))
    trainer(strategy, callbacks=[checker], max_steps=10).fit(TinyRegressor(), loader())


def test_the_switch_scales_every_learning_rate_a_scheduler_keeps() -> None:
    """``switch_lr_scale`` scaled the schedulers' base LRs only: CyclicLR's peaks, the cosine and plateau floors
    stayed, so a CyclicLR after the switch climbed back to its unscaled peak."""
    from lightning_lordo.convert import scale_scheduler_lrs

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)

    cyclic = torch.optim.lr_scheduler.CyclicLR(optimizer(), base_lr=0.01, max_lr=0.1, step_size_up=4)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer(), T_max=10, eta_min=0.02)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer(), min_lr=0.004)
    shared = optimizer()
    chained = torch.optim.lr_scheduler.SequentialLR(shared, [torch.optim.lr_scheduler.CosineAnnealingLR(
        shared, T_max=10, eta_min=0.02)], milestones=[])
    for scheduler in (cyclic, cosine, plateau, chained):
        scale_scheduler_lrs(scheduler, 0.5)
    assert cyclic.base_lrs == [0.005] and cyclic.max_lrs == [0.05]
    assert cosine.base_lrs == [0.05] and cosine.eta_min == 0.01 and plateau.min_lrs == [0.002]
    assert chained._schedulers[0].eta_min == 0.01


def test_switch_betas_beside_a_scheduler_that_cycles_momentum_is_refused() -> None:
    """OneCycleLR and CyclicLR with ``cycle_momentum=True`` set beta1 at every step: switch_betas' beta1 was
    overwritten after the switch without a word."""

    class Cycling(TinyRegressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=20)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}

    class Nested(TinyRegressor):  # inside a SequentialLR: the same
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=20)
            return [optimizer], [torch.optim.lr_scheduler.SequentialLR(optimizer, [cycle], milestones=[])]

    for module in (Cycling(), Nested()):
        fit = trainer(lordo(sync_every=2, start_method="popen", warmup_steps=2, switch_betas=(0.8, 0.9)), devices=1,
                      max_steps=4)
        with pytest.raises(ValueError, match=r"switch_betas=\(0.8, 0.9\): your OneCycleLR cycles the momentum .*"
                                             r"Pass cycle_momentum=False, or drop switch_betas"):
            fit.fit(module, loader())
    trainer(lordo(sync_every=2, start_method="popen", warmup_steps=2, switch_lr_scale=0.5), devices=1,
            max_steps=4).fit(Cycling(), loader())  # the scale alone: OneCycleLR keeps its LRs in the groups
