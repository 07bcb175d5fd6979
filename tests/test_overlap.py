"""Overlapped syncs (``overlap_steps``): the round's collectives on a thread, landing tau steps later with each
worker's local progress kept. 2 processes (fork), assertions in the workers."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer
from test_optim import _ef

from lightning_lordo import LoRDOFabricStrategy, LoRDOStrategy
from lightning_lordo.optim.functional import Hyper

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

K, TAU = 4, 2


def test_overlap_steps_is_validated() -> None:
    with pytest.raises(ValueError, match=r"overlap_steps=4.*below sync_every=4"):
        LoRDOStrategy(sync_every=4, overlap_steps=4)
    with pytest.raises(ValueError, match=r"overlap_steps=-1"):
        LoRDOStrategy(overlap_steps=-1)
    with pytest.raises(ValueError, match=r"overlap_steps=2.*synchronous=True"):
        LoRDOStrategy(overlap_steps=2, experimental={"synchronous": True})
    with pytest.raises(ValueError, match=r"overlap_steps=4.*below sync_every=4"):
        LoRDOFabricStrategy(sync_every=4, overlap_steps=4)  # Fabric takes the knob, with the same checks


class CheckLandings(L.Callback):
    """At every landing: the new anchor, the averages and the bases are bitwise identical on both ranks, and each
    rank's parameters are the new anchor plus its own local progress since the launch. Rounds launch every K steps
    and land TAU steps later; the thread really ran beside local steps."""

    def __init__(self) -> None:
        self.landings: list[int] = []
        self.launches: list[int] = []
        self.synchronized: list[int] = []  # synchronized_step after each step

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        original = sync._land_in_flight

        def checked() -> Any:
            launched = sync.in_flight
            before = [p.detach().clone() for p in sync.params]
            at_launch = [t.clone() for t in launched.params]
            feedback = {p: _ef(sync.optimizer, p).clone() for p, _ in launched.live.get("error_feedback", [])}
            groups = {p: g for g in sync.optimizer.param_groups for p in g["params"]}
            decays = {p: Hyper.of(groups[p]).ef_decay ** TAU for p in feedback}  # the steps' own, before new bases
            report = original()
            result = launched.result
            self.landings.append(sync.optimizer_steps)
            assert launched.thread is not None and launched.step == sync.optimizer_steps - TAU
            for a in sync.anchor.tensors:
                assert torch.equal(*gather(a)), "the new anchor differs between ranks"
            for q in result.bases.values():
                assert torch.equal(*gather(q.contiguous())), "the new bases differ between ranks"
            for entries in result.state.values():
                for _, _, means in entries:
                    for m in means:
                        assert torch.equal(*gather(m)), "the averaged moments differ between ranks"
            for (p, (snap,)), (_, _, (mean,)) in zip(launched.copies.get("error_feedback", []),
                                                      result.state.get("error_feedback", [])):
                # the average as if in place at the launch, decayed by the steps since, plus the local progress of E
                # itself (which the steps since the launch may unfold)
                assert decays[p] < 1.0
                torch.testing.assert_close(sync.optimizer.state[p]["error_feedback"],
                                           decays[p] * mean + feedback[p] - decays[p] * snap)
            for p, a, b, t in zip(sync.params, sync.anchor.tensors, before, at_launch):
                torch.testing.assert_close(p.detach(), a + (b - t), rtol=1e-6, atol=1e-7)
            assert not torch.equal(*gather(flat_params(module))), "local progress must be kept (it differs)"
            return report

        sync._land_in_flight = checked

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.in_flight is not None and sync.in_flight.step == sync.optimizer_steps:
            self.launches.append(sync.optimizer_steps)
        self.synchronized.append(sync.synchronized_step)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        assert self.launches == [4, 8, 12] and self.landings == [6, 10, 14], (self.launches, self.landings)
        # the anchor holds the average of a launch's step from its landing on; the last step lands and syncs
        assert self.synchronized == [0] * 5 + [4] * 4 + [8] * 4 + [14], self.synchronized
        assert sync.in_flight is None and sync.steps_since_sync == 0
        assert torch.equal(*gather(flat_params(module))), "training ends with one model"
        reports = trainer.strategy.sync_reports
        assert [r.step for r in reports] == [6, 10, 14, 14]  # the last landing, then the final blocking sync
        assert all(r.bytes_by_purpose.get("pseudo_gradients", 0) > 0 for r in reports)
        assert all(math.isfinite(r.pseudo_gradient_norm) for r in reports)


@pytest.mark.parametrize("knobs", [{}, {"payload": "lowrank", "payload_dtype": "int8", "error_feedback": True},
                                   {"average_error_feedback": True}],
                         ids=["default", "lowrank-int8-ef", "averaged-error-feedback"])
def test_overlapped_rounds_land_identically_and_keep_local_progress(knobs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    strategy = lordo(sync_every=K, overlap_steps=TAU, **knobs)
    trainer(strategy, callbacks=[CheckLandings()], max_steps=14).fit(TinyRegressor(), loader())


class CheckMomentumLandings(L.Callback):
    """DiLoCo with SGD's momentum averaged: at a landing each buffer is ``mu^s mean + (buf - mu^s buf_at_launch)``,
    the buffer as if the average had been in place at the launch and the s local steps since applied to it."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        original = sync._land_in_flight

        def checked() -> Any:
            launched = sync.in_flight
            steps = sync.optimizer_steps - launched.step
            live = {p: [t.clone() for t in ts] for p, ts in launched.live["moments"]}
            report = original()
            for (p, (snap,)), (_, _, (mean,)) in zip(launched.copies["moments"], launched.result.state["moments"]):
                decay = sync.optimizer.param_groups[0]["momentum"] ** steps
                torch.testing.assert_close(sync.optimizer.state[p]["momentum_buffer"],
                                           decay * mean + live[p][0] - decay * snap)
                self.checked += 1
            return report

        sync._land_in_flight = checked

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.checked > 0


def test_an_overlapped_landing_decays_sgds_averaged_momentum() -> None:
    torch.manual_seed(0)
    strategy = LoRDOStrategy(preset="diloco", sync_every=K, overlap_steps=TAU, start_method="fork",
                             experimental={"average_fullrank_moments": True})
    trainer(strategy, callbacks=[CheckMomentumLandings()], max_steps=12).fit(TinyRegressor(optimizer="sgd"), loader())


class PoisonRankOne(L.Callback):
    """Rank 1's parameters become NaN after step 3: the round launched at step 4 is discarded on both ranks when it
    lands at step 6, and training goes on from the anchor."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if trainer.global_rank == 1 and sync.optimizer_steps == 3:
            next(module.parameters()).data.fill_(float("nan"))
        if sync.optimizer_steps == 6:
            assert sync.skipped_syncs == 1 and sync.in_flight is None
            for p, a in zip(sync.params, sync.anchor.tensors):
                assert torch.equal(p.detach(), a), "a discarded round puts the parameters back to the anchor"
            assert torch.equal(*gather(flat_params(module)))

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert torch.isfinite(flat_params(module)).all() and torch.equal(*gather(flat_params(module)))
        assert trainer.strategy.synchronizer.skipped_syncs == 1


def test_a_non_finite_overlapped_round_is_discarded_on_every_rank() -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=K, overlap_steps=TAU), callbacks=[PoisonRankOne()], max_steps=12).fit(
        TinyRegressor(), loader())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_an_overlapped_fit_fails_instead_of_hanging_when_a_worker_dies_or_hangs(mode: str) -> None:
    """Rank 1 dies or stalls before the step that launches round 1: rank 0's thread and its next collectives time
    out, and the fit fails with the plugin's error instead of hanging."""
    from test_faults import TIMEOUT_S, Misbehave

    start = time.monotonic()
    with pytest.raises(Exception) as info:
        trainer(LoRDOStrategy(sync_every=K, overlap_steps=TAU, start_method="fork", timeout=TIMEOUT_S,
                              optimizer={"rank": 4}),
                callbacks=[Misbehave(mode)], max_steps=12).fit(TinyRegressor(), loader())
    assert time.monotonic() - start < 40
    if mode == "hang":
        assert "CollectiveTimeout" in str(info.value), str(info.value)


def test_exporting_a_checkpoint_with_a_round_in_flight_says_the_round_is_dropped() -> None:
    from lightning_lordo.lightning.export import to_torch_checkpoint

    checkpoint = {"state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}],
                  "lordo": {"sync": {"steps_since_sync": 0, "outer": {}}, "world_size": 1, "layout": {},
                            "in_flight": 12, "ranks": [{"overlap": {"step": 12}}]}}  # as checkpoint.trainer_entry
    notes = to_torch_checkpoint(checkpoint)
    assert any("the overlapped round in flight (launched at optimizer step 12)" in n for n in notes), notes
    assert "lordo" not in checkpoint


@pytest.mark.parametrize("purpose", ["pseudo_gradients", "holders", "moments", "buffers"])
def test_a_failed_overlapped_round_leaves_the_worker_as_it_was_at_its_landing(purpose: str) -> None:
    """Synchronizer level (test_faults' communicator, which fails the first collective of ``purpose``): the round
    launched at step 3 fails in its exchange; at its landing, after step 4, the error is raised and the worker's
    replica, anchor, buffers, optimizer state and counters are exactly as they were before the landing."""
    from test_faults import FlakyCommunicator, _everything, _setup, _step

    from lightning_lordo.comm.communicator import CollectiveTimeout
    from tests.strategy_helpers import assert_identical

    comm = FlakyCommunicator(purpose, CollectiveTimeout("LoRDO sync 1: injected"))
    model, opt, sync = _setup("lordo", comm, sync_every=3, overlap_steps=1)
    comm.armed = True
    for i in range(3):  # step 3 launches sync 1; one process group, so its exchange runs (and fails) at once
        _step(model, opt, sync, i)
    assert sync.in_flight is not None and sync.in_flight.error is not None and comm.seen == 1
    _step(model, opt, sync, 3, sync_after=False)  # step 4, whose landing is called by hand
    sync.optimizer_steps += 1
    sync.steps_since_sync += 1
    before = _everything(model, opt, sync)
    with pytest.raises(CollectiveTimeout, match="injected"):
        sync._land_in_flight()
    assert_identical(_everything(model, opt, sync), before, "state after the failed landing")
