"""The synchronization reordered as exchange-then-commit, and the bugs of the earlier order: bases broadcast from
rank 0 with the moments averaged in the shared old basis, seeds independent of per-parameter step counts, a peer
that hangs between syncs named as such, the outer step as torch's SGD, and a CPU anchor."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer
from torch import nn

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.projection import rotate_moments
from lightning_lordo.sync.synchronizer import Synchronizer

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


class FlipRank1Bases(L.Callback):
    """Rank 1 computes bases of the right subspace with every sign flipped (as another BLAS may); with
    ``broadcast_bases`` rank 0's are used everywhere, so the averaged moments must survive the sync."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.checked = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
        if trainer.global_rank == 1:
            compute = optimizer.compute_bases
            optimizer.compute_bases = lambda *a, **kw: {p: -q for p, q in compute(*a, **kw).items()}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        optimizer: LoRDO = sync.optimizer
        if sync.steps_since_sync == self.k - 1:  # the step before a sync: the moments the sync will average
            self.before = {p: optimizer.state[p]["exp_avg"].norm() for p in optimizer.lowrank_params()}
        if sync.steps_since_sync == 0 and sync.optimizer_steps:
            for p in optimizer.lowrank_params():
                state = optimizer.state[p]
                assert torch.equal(*gather(state["basis"])), "the bases differ between ranks"
                assert torch.equal(*gather(state["exp_avg"])), (sync.optimizer_steps, tuple(p.shape))
                assert torch.equal(*gather(state["exp_avg_sq"])), (sync.optimizer_steps, tuple(p.shape))
                # averaged in the shared old basis, then rotated into rank 0's basis on both ranks: the first
                # moment keeps its size (averaging moments rotated with opposite signs would cancel them)
                assert state["exp_avg"].norm() > 0.5 * self.before[p], (state["exp_avg"].norm(), self.before[p])
            self.checked += 1

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.checked >= 2


def test_broadcast_bases_keeps_the_averaged_moments_when_a_rank_computes_flipped_signs() -> None:
    checker = FlipRank1Bases(4)
    trainer(lordo(sync_every=4, broadcast_bases=True), callbacks=[checker], max_steps=12).fit(TinyRegressor(),
                                                                                           loader())


class BranchOnRank0(TinyRegressor):
    """A second head used on rank 0 only: its weight gets gradients there, never on rank 1 (a conditional branch,
    as in a mixture of experts), so its step counter differs between the ranks."""

    def __init__(self) -> None:
        super().__init__()
        net = self.net  # registered after the extra layer, so that it is not taken for the model's output head
        del self.net
        self.extra, self.net = nn.Linear(16, 8), net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[:5](x)
        loss = nn.functional.mse_loss(self.net[5](hidden), y)
        if dist.get_rank() == 0:
            loss = loss + self.extra(hidden).square().mean()
        return loss


class SameBases(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
        for p in optimizer.lowrank_params():
            if "basis" in optimizer.state[p]:
                assert torch.equal(*gather(optimizer.state[p]["basis"])), "bases differ between ranks"
        steps = gather(optimizer.state[module.extra.weight]["step"].reshape(1))
        self.differ = not torch.equal(*steps)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.differ, "the test needs step counters that differ between the ranks"


@pytest.mark.parametrize("projection", ["randomized", "power"])
def test_a_parameter_with_gradients_on_some_ranks_gets_the_same_bases_everywhere(projection: str) -> None:
    """Seeds of randomized bases come from the synchronizer's step count (identical on every rank), not from each
    parameter's own step counter."""
    trainer(lordo(sync_every=3, projection=projection), callbacks=[SameBases()], max_steps=10).fit(BranchOnRank0(),
                                                                                                loader())


class SleepOnRank1(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if dist.get_rank() == 1 and self.trainer.global_step == 2:
            import time

            time.sleep(6)  # hangs between syncs, longer than the timeout
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_a_peer_that_hangs_between_syncs_is_named_with_the_check_that_noticed() -> None:
    """Lightning checks for SIGTERM with a broadcast before every batch and swallows its failure; the plugin's
    version of that check raises, naming it, the step and the timeout (not "failed after 0.0 s" at the next sync)."""
    strategy = LoRDOStrategy(sync_every=8, start_method="fork", timeout=timedelta(seconds=2), optimizer={"rank": 4})
    with pytest.raises(Exception) as info:
        trainer(strategy, max_steps=10).fit(SleepOnRank1(), loader())
    message = str(info.value)
    # the check posted before step 4, which rank 1 (asleep in that batch) never posted, read before step 5
    assert "SIGTERM check before optimizer step 4 (between syncs; read before optimizer step 5)" in message, message
    assert "timeout of 2 s" in message and "another worker died, hangs" in message


def _one_process_sync(**knobs: Any) -> tuple[nn.Module, Synchronizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = Synchronizer(list(model.parameters()), [], opt, SyncConfig(sync_every=1, **knobs),
                        Communicator(CommAccountant(), timedelta(seconds=5)))
    return model, sync


def test_nesterov_outer_step_is_torch_sgd_on_the_anchor() -> None:
    """Three rounds of the outer step against torch.optim.SGD(nesterov=True) fed the same pseudo-gradients, and
    its momentum survives state_dict / load_state_dict."""
    model, sync = _one_process_sync(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    twin = [a.clone() for a in sync.anchor.tensors]
    sgd = torch.optim.SGD(twin, lr=0.7, momentum=0.9, nesterov=True)
    generator = torch.Generator().manual_seed(1)
    for round_ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
        deltas = [a - p.detach() for a, p in zip(sync.anchor.tensors, model.parameters())]
        for t, d in zip(twin, deltas):
            t.grad = d
        sgd.step()
        sync.sync()
        for a, t, p in zip(sync.anchor.tensors, twin, model.parameters()):
            assert torch.equal(a, t) and torch.equal(p.detach(), t), f"round {round_ + 1}"
        if round_ == 1:
            saved = sync.state_dict()
            _, fresh = _one_process_sync(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
            fresh.load_state_dict(saved)
            assert all(torch.equal(m, n) for m, n in zip(fresh.outer.momentum_buffers(), sync.outer.momentum_buffers()))
    assert len(sync.outer.momentum_buffers()) == len(list(model.parameters()))


class RecordAnchor(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        assert all(a.device.type == "cpu" for a in sync.anchor.tensors)
        if trainer.global_rank == 0:
            torch.save(flat_params(module), self.path)


def test_a_cpu_anchor_trains_as_the_default_one(tmp_path: Path) -> None:
    """``anchor_device="cpu"``: the same trajectory (on a CPU machine both live in host memory; on a GPU the CPU one
    is pinned and saves one model copy of device memory)."""
    finals = {}
    for device in ("param", "cpu"):
        torch.manual_seed(0)
        trainer(lordo(sync_every=3, anchor_device=device), callbacks=[RecordAnchor(tmp_path / f"{device}.pt")],
                max_steps=8, val_check_interval=4, limit_val_batches=2).fit(TinyRegressor(), loader(), loader(32))
        finals[device] = torch.load(tmp_path / f"{device}.pt")
    assert torch.equal(finals["param"], finals["cpu"])


def test_the_second_moment_is_averaged_in_the_old_basis_then_rotated() -> None:
    """One process, LoRDO moments set by hand: after a sync the moments are the rotation (LDAdam's rule) of the
    moments the exchange averaged in the old basis; alone, the average is the moments themselves."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 10))
    opt = LoRDO([w], rank=2, lr=0.1)
    sync = Synchronizer([w], [], opt, SyncConfig(sync_every=1, synchronous=False),  # rounds on one process
                        Communicator(CommAccountant(), timedelta(seconds=5)))
    w.grad = torch.randn(6, 10)
    sync.before_optimizer_step()
    opt.step()
    state = opt.state[w]
    u, v, old, t = state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["basis"].clone(), state["step"].item()
    with torch.no_grad():
        w.add_(torch.randn(6, 10))  # a pseudo-gradient with another dominant subspace
    sync.on_optimizer_step()
    new = state["basis"]
    assert (new.mT @ old).abs().max() < 0.999  # the basis moved
    beta1, beta2 = opt.param_groups[0]["betas"]
    ref_u, ref_v = rotate_moments(u, v, new.mT @ old, 1 - beta1**t, 1 - beta2**t)
    torch.testing.assert_close(state["exp_avg"], ref_u, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"], ref_v, rtol=1e-6, atol=1e-9)
