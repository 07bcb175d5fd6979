"""``basis_every``: the bases are recomputed at every n-th sync only, from the averaged pseudo-gradients summed over
the window; between, they stay (2 processes launched by fork, assertions inside the workers)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, gather, loader, lordo, trainer

from lightning_lordo import LoRDOStrategy
from lightning_lordo._tensors import canonical
from lightning_lordo.optim.projection import power_basis
from lightning_lordo.strategy_knobs import strategy_kwargs


@pytest.mark.parametrize(("knobs", "message"), [
    ({"basis_every": 0}, r"basis_every=0"),
    ({"basis_every": 1.5}, r"basis_every=1\.5"),
    ({"basis_every": 2, "basis_scope": "local"}, r"basis_every=2.*basis_scope='local'"),
    ({"basis_every": 2, "synchronous": True}, r"basis_every=2.*synchronous=True"),
    ({"basis_every": 2, "lowrank": False}, r"basis_every=2: with lowrank=False it would be ignored"),
])
def test_bad_basis_every_is_refused_with_the_argument_named(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRDOStrategy(**strategy_kwargs(**knobs))


class WindowChecker(L.Callback):
    """At every sync (K = 2, basis_every = 3): the bases change at syncs 3 and 6 only, and then equal a warm-started
    power step on the sum of the window's averaged pseudo-gradients (the anchor's change over the window, with
    plain averaging as the outer step), not on the last round's alone."""

    def __init__(self) -> None:
        self.anchors: list[list[torch.Tensor]] = []
        self.bases: list[dict[torch.Tensor, torch.Tensor]] = []
        self.refreshes = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.steps_since_sync:
            return
        lordo = sync.optimizer
        self.anchors.append([a.clone() for a in sync.anchor.tensors])
        self.bases.append({p: lordo.state[p]["basis"].clone() for p in lordo.lowrank_params()})
        index = sync.syncs_done
        assert index == len(self.bases)
        if index == 1:
            return
        before, now = self.bases[-2], self.bases[-1]
        changed = [not torch.equal(before[p], now[p]) for p in now]
        assert all(changed) == (index % 3 == 0) and (any(changed) == all(changed)), (index, changed)
        window_sums = {p: float(sync.window.sums[p].abs().sum()) for p in now}
        if index % 3:  # the window holds the rounds since the refresh
            assert all(s > 0 for s in window_sums.values())
            return
        assert all(s == 0 for s in window_sums.values()), "the window starts empty after a refresh"
        self.refreshes += 1
        start, end, last = self.anchors[-4] if len(self.anchors) >= 4 else None, self.anchors[-1], self.anchors[-2]
        for i, p in enumerate(sync.params):
            if p not in now:
                continue
            group = next(g for g in lordo.param_groups if any(q is p for q in g["params"]))
            # the anchor before the window (the first bases came from the first gradient: window 1 starts at 0)
            origin = start[i] if start is not None else self.initial[i]
            expected = power_basis(canonical(origin - end[i], p), before[p], group["power_iters"])
            torch.testing.assert_close(now[p], expected, atol=2e-4, rtol=0)
            last_round_only = power_basis(canonical(last[i] - end[i], p), before[p], group["power_iters"])
            assert not torch.allclose(now[p], last_round_only, atol=2e-3), "the basis saw the last round only"
        assert torch.equal(*gather(torch.cat([b.reshape(-1) for b in now.values()])))

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.initial = [a.clone() for a in trainer.strategy.synchronizer.anchor.tensors]

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.refreshes == 2
        memory = trainer.strategy.synchronizer.memory_report()
        lowrank = trainer.strategy.synchronizer.optimizer.lowrank_params()
        assert memory["basis_window"] == sum(p.numel() * 4 for p in lowrank) > 0


def test_bases_refresh_every_nth_sync_from_the_window_sum() -> None:
    trainer(lordo(sync_every=2, basis_every=3), callbacks=[WindowChecker()], max_steps=12).fit(TinyRegressor(),
                                                                                                loader())


class NoWindow(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        assert not sync.window and "basis_window" not in sync.memory_report()
        assert sync.state_dict()["basis_window"] == []


def test_basis_every_one_keeps_no_window() -> None:
    trainer(lordo(sync_every=2), callbacks=[NoWindow()], max_steps=4).fit(TinyRegressor(), loader())


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
def test_nesterov_outer_step_leaves_the_averages_as_they_are(foreach: bool) -> None:
    """The window adds the round's averages after the outer step: torch's foreach Nesterov SGD (its default on a
    GPU) adds the momentum into the gradient in place, so the outer step must hand it a copy."""
    from lightning_lordo.sync.outer import Anchor, OuterStep

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    anchor = Anchor(params)
    anchor.take()
    outer = OuterStep("nesterov", lr=0.7, momentum=0.9)
    outer._optimizer(anchor).param_groups[0]["foreach"] = foreach
    for _ in range(3):  # from the second step on there is momentum to add
        delta = [torch.randn(p.shape) for p in params]
        kept = [d.clone() for d in delta]
        anchor.set(outer.apply(anchor, delta))
        assert all(torch.equal(d, k) for d, k in zip(delta, kept))
    assert outer.momentum_buffers() and all(b.abs().sum() > 0 for b in outer.momentum_buffers())

