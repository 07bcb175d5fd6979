"""The compressed payloads (SPEC §5) inside the strategy: 2 processes, fork, assertions in the workers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer

from lightning_lordo import LoRDOStrategy

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


class SaveFinal(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert torch.equal(*gather(flat_params(module)))
        if trainer.global_rank == 0:
            torch.save(flat_params(module), self.path)


def test_lowrank_payload_at_full_rank_reproduces_the_full_payload(tmp_path: Path) -> None:
    """With r = min(m, n) for every matrix the low-rank payload sends the exact average. (omega = 0 with the
    factored normalizer makes the update independent of which orthonormal basis each payload installs.)"""
    results = {}
    for payload in ("full", "lowrank"):
        torch.manual_seed(0)
        path = tmp_path / f"{payload}.pt"
        trainer(lordo(sync_every=3, rank=1.0, omega=0.0, normalizer="factored", payload=payload),
                callbacks=[SaveFinal(path)], max_steps=12).fit(TinyRegressor(), loader())
        results[payload] = torch.load(path)
    torch.testing.assert_close(results["lowrank"], results["full"], rtol=1e-4, atol=1e-5)


class PayloadBytes(L.Callback):
    """Bytes of pseudo-gradients per sync: r(a+b) numbers per low-rank matrix, everything else in full."""

    def __init__(self, dtype: str, syncs: int) -> None:
        self.dtype, self.syncs = dtype, syncs

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        optimizer = strategy.synchronizer.optimizer
        lowrank = {id(p) for p in optimizer.lowrank_params()}
        size = {"float32": 4, "bfloat16": 2, "int8": 1}[self.dtype]
        per_sync_lowrank, per_sync_rest, lowrank_rows, rest_rows = 0, 0, 0, 0
        for p in module.parameters():
            if id(p) in lowrank:
                r, (a, b) = optimizer.lowrank_rank(p, optimizer.param_groups[0]), sorted(p.shape)
                per_sync_lowrank += r * (a + b)
                lowrank_rows += 2 * r  # P travels as r rows of a, B as r rows of b (one scale per row)
            else:
                per_sync_rest += p.numel()
                rest_rows += p.shape[0] if p.ndim >= 2 else 1
        expected = (per_sync_lowrank + per_sync_rest) * size
        if self.dtype == "int8":  # one float32 scale per row of each message
            expected += 4 * (lowrank_rows + rest_rows)
        assert strategy.accountant.totals["pseudo_gradients"] == self.syncs * expected
        # the averaged moments travel in bfloat16 with a reduced payload (never int8), else in float32
        moment_numbers = sum(optimizer.state[p][k].numel() for p in optimizer.lowrank_params()
                             for k in ("exp_avg", "exp_avg_sq"))
        moment_size = 4 if self.dtype == "float32" else 2
        assert strategy.accountant.totals["moments"] == self.syncs * moment_numbers * moment_size
        for p in optimizer.lowrank_params():  # averaged, so bitwise identical on both ranks
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(*gather(optimizer.state[p][key]))
        reports = strategy.sync_reports
        assert all(r.extra["sync_error_feedback_norm"] > 0 for r in reports)
        memory = strategy.synchronizer.memory_report()
        assert memory["sync_error_feedback"] == sum(p.numel() * 4 for p in module.parameters() if id(p) in lowrank)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_lowrank_payload_sends_what_it_counts_and_keeps_error_feedback(dtype: str) -> None:
    trainer(lordo(sync_every=4, payload="lowrank", payload_dtype=dtype), callbacks=[PayloadBytes(dtype, 3)],
            max_steps=12).fit(TinyRegressor(), loader())


class LowRankSyncChecker(L.Callback):
    """After every sync: each low-rank matrix's basis is bitwise identical on both ranks, and the averaged update
    applied to the anchor (outer step "average") lies in the span of that basis: the optimizer's new basis spans
    the payload's Q, computed from the averaged P."""

    def __init__(self) -> None:
        self.syncs_seen, self.anchor, self.checked = 0, None, 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.syncs_done == self.syncs_seen:
            return
        self.syncs_seen = sync.syncs_done
        anchor = {p: a.clone() for p, a in zip(sync.params, sync.anchor.tensors)}
        if self.anchor is not None:
            for p in sync.optimizer.lowrank_params():
                basis = sync.optimizer.state[p]["basis"]
                assert torch.equal(*gather(basis))
                update = self.anchor[p] - anchor[p]
                update = update.mT if p.shape[0] > p.shape[1] else update
                outside = update - basis @ (basis.mT @ update)
                assert outside.norm() <= 1e-5 * update.norm(), (outside.norm(), update.norm())
                self.checked += 1
        self.anchor = anchor

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert self.checked >= 4  # two matrices at two syncs at least


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_lowrank_payload_installs_the_averaged_basis_on_every_rank(tmp_path: Path, dtype: str) -> None:
    from lightning.pytorch.loggers import CSVLogger

    csv = CSVLogger(tmp_path, name="csv", version=0)
    trainer(lordo(sync_every=3, payload="lowrank", payload_dtype=dtype), callbacks=[LowRankSyncChecker()],
            logger=csv, max_steps=12).fit(TinyRegressor(), loader())
    header, *rows = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("lordo/sync_error_feedback_norm")
    norms = [float(r.split(",")[column]) for r in rows if r.split(",")[column]]
    assert len(norms) == 4 and all(n > 0 for n in norms)  # 3 syncs + the final one, each with something kept


class ReducedPrecision(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        params = list(module.parameters())
        assert strategy.accountant.totals["pseudo_gradients"] == 3 * sum(p.numel() * 2 for p in params)
        assert strategy.synchronizer.payloads.error_norm() > 0
        assert torch.equal(*gather(flat_params(module)))
        assert math.isfinite(float(flat_params(module).sum()))


def test_bfloat16_full_payload_on_diloco() -> None:
    trainer(LoRDOStrategy(preset="diloco", sync_every=4, payload_dtype="bfloat16", start_method="fork"),
            callbacks=[ReducedPrecision()], max_steps=12).fit(TinyRegressor(), loader())


def test_lowrank_payload_is_refused_for_diloco_before_launch() -> None:
    with pytest.raises(ValueError, match="payload='lowrank'"):
        LoRDOStrategy(preset="diloco", payload="lowrank")


def test_compressed_payloads_train(tmp_path: Path) -> None:
    losses: dict[str, Any] = {}
    for payload, dtype in (("full", "float32"), ("lowrank", "int8")):
        torch.manual_seed(0)
        fit = trainer(lordo(sync_every=4, payload=payload, payload_dtype=dtype), max_steps=40, devices=2,
                      callbacks=[SaveFinal(tmp_path / f"{payload}.pt")])
        fit.fit(TinyRegressor(), loader())
        module = TinyRegressor()
        vector = torch.load(tmp_path / f"{payload}.pt")
        torch.nn.utils.vector_to_parameters(vector, module.parameters())
        x, y = loader().dataset.tensors
        losses[payload] = torch.nn.functional.mse_loss(module.net(x), y).item()
    start = torch.nn.functional.mse_loss(TinyRegressor().net(loader().dataset.tensors[0]),
                                         loader().dataset.tensors[1]).item()
    assert losses["lowrank"] < 0.7 * start and losses["full"] < 0.7 * start, (start, losses)


class InfiniteMomentOnRank1(L.Callback):
    """Rank 1's second moment of one matrix overflows just before sync 2 (step 8, K = 4): the averaged moments,
    sent in bfloat16, are not finite on both ranks, so both reset that matrix and keep the round."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        optimizer = sync.optimizer
        first, second = optimizer.lowrank_params()[:2]
        if trainer.global_step == 7 and trainer.global_rank == 1:
            optimizer.state[first]["exp_avg_sq"][0, 0] = float("inf")
        if trainer.global_step == 8:
            report = trainer.strategy.sync_reports[-1]
            assert report.index == 2 and not report.skipped and report.extra["reset_moments"] == 1
            assert optimizer.state[first]["step"].item() == 0 and not optimizer.state[first]["exp_avg_sq"].any()
            assert optimizer.state[second]["step"].item() == 8
            assert trainer.strategy.accountant.totals["moments"] > 0
            assert torch.equal(*gather(flat_params(module))) and torch.isfinite(flat_params(module)).all()


def test_non_finite_bfloat16_moments_reset_the_matrix_on_every_rank() -> None:
    trainer(lordo(sync_every=4, payload_dtype="int8"), callbacks=[InfiniteMomentOnRank1()],
            max_steps=12).fit(TinyRegressor(), loader())
