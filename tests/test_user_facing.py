"""What a Lightning user sees: the saving in the progress bar, an honest one-device summary (no NaN), the
``lordo/`` figures in the same logger rows as ``self.log``'s, and an error that says what to do when
``configure_optimizers`` returns two optimizers."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from strategy_helpers import TinyRegressor, loader, lordo, trainer

from lightning_lordo import CommunicationMonitor
from lightning_lordo.core import saving_ratio

BAR = "lordo/saving_vs_ddp"


def _rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


# ---------------------------------------------------------------------------------------------------------------
# the progress bar
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bar", "strategy_knob", "callbacks", "shown"), [
    (True, None, [], True),  # on by default with a progress bar
    (False, None, [], False),  # and off without one
    (True, False, [], False),  # the strategy's knob turns the monitor it adds off...
    (False, True, [], True),  # ...or on
    (False, None, [CommunicationMonitor(summary=False, progress_bar=True)], True),  # the user's own monitor
    (True, None, [CommunicationMonitor(summary=False, progress_bar=False)], False),
], ids=["default-bar", "default-no-bar", "knob-off", "knob-on", "own-monitor-on", "own-monitor-off"])
def test_the_progress_bar_shows_the_saving(bar: bool, strategy_knob: Any, callbacks: list[Any], shown: bool) -> None:
    fit = trainer(lordo(sync_every=2, start_method="popen", monitor_progress_bar=strategy_knob), devices=1,
                  max_steps=4, enable_progress_bar=bar, callbacks=callbacks)
    fit.fit(TinyRegressor(), loader())
    assert (BAR in fit.progress_bar_metrics) is shown, fit.progress_bar_metrics
    if shown:
        assert fit.progress_bar_metrics[BAR] == 1.0  # one device: neither DDP nor LoRDO sends anything
    assert BAR not in fit.logged_metrics  # the bar only: the loggers get bytes_saving_vs_ddp


class BarChecker(L.Callback):
    """In each worker: the bar shows DDP's bytes per byte sent, the figure logged as bytes_saving_vs_ddp, and follows
    it at every batch, between syncs too (DDP's equivalent grows at each step, LoRDO's bytes only at a sync)."""

    def __init__(self) -> None:
        self.between_syncs: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if 1 <= trainer.global_step < 4:  # after steps 1-3, before the first sync (sync_every=4)
            self.between_syncs.append(trainer.progress_bar_metrics[BAR])
        if trainer.global_step >= 1:
            # the last batch's figure reached Lightning as a host tensor: a float would become a tensor on the
            # module's device (float32), uploaded and read back by the bar at every batch, two stalls of a GPU
            from lightning_lordo.lightning._compat import logged_results

            held = [m.value for m in logged_results(trainer).values() if m.meta.name == BAR]
            assert len(held) == 1 and held[0].dtype == torch.float64 and held[0].device.type == "cpu", held

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        expected = strategy.ddp_equivalent_bytes / strategy.accountant.total_bytes
        assert expected > 1
        assert trainer.progress_bar_metrics[BAR] == pytest.approx(expected, rel=1e-6)
        values = self.between_syncs
        assert len(values) == 3 and all(a < b for a, b in zip(values, values[1:])), values


def test_the_progress_bar_shows_the_saving_on_two_processes() -> None:
    trainer(lordo(sync_every=4), max_steps=8, enable_progress_bar=True, callbacks=[BarChecker()]).fit(
        TinyRegressor(), loader())


def test_progress_bar_knobs_that_would_be_ignored_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid experimental monitor_progress_bar=True with monitor=False"):
        lordo(monitor=False, monitor_progress_bar=True)
    with pytest.raises(ValueError, match=r"Invalid experimental monitor_progress_bar='yes'"):
        lordo(monitor_progress_bar="yes")
    with pytest.raises(ValueError, match=r"Invalid progress_bar=1: it must be True, False or None"):
        CommunicationMonitor(progress_bar=1)  # type: ignore[arg-type]
    fit = trainer(lordo(start_method="popen", monitor_progress_bar=False), devices=1, max_steps=2,
                  callbacks=[CommunicationMonitor(summary=False)])
    with pytest.raises(ValueError, match=r"Pass CommunicationMonitor\(progress_bar=False\) to the Trainer"):
        fit.fit(TinyRegressor(), loader())


def test_the_strategy_knob_survives_a_second_fit() -> None:
    fit = trainer(lordo(sync_every=2, start_method="popen", monitor_progress_bar=True), devices=1, max_steps=2)
    module = TinyRegressor()
    fit.fit(module, loader())
    fit.fit_loop.epoch_loop.max_steps = 4
    fit.fit(module, loader())  # the monitor the first fit added is the strategy's own: no error
    assert sum(isinstance(c, CommunicationMonitor) for c in fit.callbacks) == 1
    assert BAR in fit.progress_bar_metrics


# ---------------------------------------------------------------------------------------------------------------
# one device: DDP sends nothing, and nothing is NaN
# ---------------------------------------------------------------------------------------------------------------
def test_one_device_summary_says_ddp_sends_nothing_and_logs_no_nan(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    logger = CSVLogger(tmp_path, name="one", version=0)
    fit = trainer(lordo(sync_every=2, start_method="popen"), devices=1, max_steps=6, logger=logger,
                  enable_progress_bar=True)
    fit.fit(TinyRegressor(), loader())
    printed = capsys.readouterr().out
    assert "DDP would have sent" in printed and "nothing (one device)" in printed
    assert "none (one device)" in printed
    assert "nan" not in printed.lower()
    assert fit.strategy.ddp_bytes_per_step > 0  # the payload DDP would all-reduce with more devices...
    summary = fit.strategy.core.summary(1)  # one convention with Fabric's communication_summary()
    assert summary["ddp_equivalent_bytes"] == 0 and summary["bytes_saving_vs_ddp"] is None
    rows = [r for r in _rows(logger) if r["lordo/bytes_sent_total"]]
    assert len(rows) == 3
    for row in rows:  # ...but on one device DDP sends nothing: 0 bytes, a ratio of 1, never NaN
        values = {k: float(v) for k, v in row.items() if k.startswith("lordo/") and v}
        assert all(math.isfinite(v) for v in values.values()), values
        assert values["lordo/ddp_equivalent_bytes"] == 0 and values["lordo/bytes_sent_total"] == 0
        assert values["lordo/bytes_saving_vs_ddp"] == 1.0
    assert all(math.isfinite(float(v)) for v in fit.callback_metrics.values())


def test_the_saving_ratio_is_always_finite() -> None:
    assert saving_ratio(0, 0) == 1.0  # nothing sent by either (one device)
    assert saving_ratio(400, 100) == 4.0
    assert saving_ratio(0, 100) == 0.0
    assert saving_ratio(400, 0) == 400.0  # counted against one byte: finite


# ---------------------------------------------------------------------------------------------------------------
# the lordo/ figures at Lightning's step, in Lightning's rows
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "every", "steps", "shared", "own"), [
    (2, 2, 8, [1, 3, 5, 7], []),  # every sync in the row of its batch
    (4, 2, 8, [3, 7], []),  # rows 1 and 5 have train_loss only: a sync's figures do not repeat in later rows
    (3, 2, 7, [5], [2, 6]),  # rows of their own, at Lightning's step, where Lightning writes none
], ids=["aligned", "every-other-row", "not-aligned"])
def test_lordo_figures_share_lightnings_rows(tmp_path: Path, k: int, every: int, steps: int, shared: list[int],
                                             own: list[int]) -> None:
    logger = CSVLogger(tmp_path, name="rows", version=0)
    fit = trainer(lordo(sync_every=k, start_method="popen", synchronous=False), devices=1, max_steps=steps,
                  logger=logger, log_every_n_steps=every)
    fit.fit(TinyRegressor(), loader())
    rows = _rows(logger)
    with_loss = [int(r["step"]) for r in rows if r["train_loss"]]
    assert with_loss == list(range(every - 1, steps, every))  # Lightning's own rows, unchanged
    lordo_rows = [r for r in rows if r["lordo/bytes_sent_total"]]
    assert [int(r["step"]) for r in lordo_rows if r["train_loss"]] == shared
    assert [int(r["step"]) for r in lordo_rows if not r["train_loss"]] == own
    assert len(rows) == len(with_loss) + len(own)
    assert all(r["epoch"] == "0" for r in rows)
    assert len(lordo_rows) == len(fit.strategy.sync_reports)


class TotalsAtTheEnd(TinyRegressor):
    """Writes rank 0's byte totals as the fit ends (the module's ``on_fit_end`` runs after every callback's)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero:
            totals = self.trainer.strategy.core.summary(self.trainer.world_size)
            self.out.write_text(f"{totals['bytes_sent_total']} {totals['ddp_equivalent_bytes']}")


@pytest.mark.parametrize("synchronous", [False, True], ids=["local-steps", "lowrank_ddp"])
def test_the_last_row_has_the_totals_of_the_summary_and_the_epoch_of_the_last_batch(tmp_path: Path,
                                                                                    synchronous: bool) -> None:
    """Two epochs of 5 steps, syncs (or basis refreshes) every 4, validation with a ``sync_dist`` metric at each
    epoch's end: the rows written as the fit ends (the last sync's, or the synchronous steps' since the last refresh)
    are in epoch 1 (the fit loop has moved on to 2 by then), and the totals the summary prints, with the traffic after
    the last sync, are the last ones logged."""
    logger = CSVLogger(tmp_path, name="rows", version=0)
    fit = trainer(lordo(sync_every=4, synchronous=synchronous), logger=logger, log_every_n_steps=3, max_steps=-1,
                  max_epochs=2, limit_train_batches=5, limit_val_batches=2)
    fit.fit(TotalsAtTheEnd(tmp_path / "totals.txt"), loader(), loader(32))
    rows = _rows(logger)
    lordo_rows = [r for r in rows if r["lordo/bytes_sent_total"]]
    epochs = {r["step"]: r["epoch"] for r in rows if r["train_loss"]}  # Lightning's rows: its epoch at each step
    assert all(r["epoch"] == epochs.get(r["step"], r["epoch"]) for r in lordo_rows)
    assert [(r["step"], r["epoch"]) for r in lordo_rows][-1] == ("9", "1"), lordo_rows
    # one type per column: the rows of their own as floats, as the rows merged into Lightning's (float64)
    assert all("." in r["lordo/bytes_sent_total"] for r in lordo_rows), lordo_rows
    total, ddp = map(float, (tmp_path / "totals.txt").read_text().split())
    last = lordo_rows[-1]
    assert (float(last["lordo/bytes_sent_total"]), float(last["lordo/ddp_equivalent_bytes"])) == (total, ddp)


# ---------------------------------------------------------------------------------------------------------------
# two optimizers
# ---------------------------------------------------------------------------------------------------------------
class TwoOptimizers(TinyRegressor):
    def configure_optimizers(self) -> Any:
        return [torch.optim.AdamW(self.net[:3].parameters(), lr=1e-3),
                torch.optim.SGD(self.net[3:].parameters(), lr=1e-2)]


class OptimizerIdx(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int = 0) -> torch.Tensor:
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("module", "says"), [
    (TwoOptimizers, r"configure_optimizers returned 2 optimizers \(AdamW, SGD\)"),
    (OptimizerIdx, r"training_step takes `optimizer_idx`.*returned 1 optimizer \(AdamW\)"),
], ids=["two-optimizers", "optimizer_idx"])
def test_two_optimizers_get_an_error_that_says_what_to_do(module: type, says: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        trainer(lordo(start_method="popen"), devices=1, max_steps=2).fit(module(), loader())
    message = str(caught.value)
    assert caught.match(says)
    assert "manual optimization, does not work with LoRDO" in message  # the circle, named
    assert "one Adam/AdamW with a parameter group per part of the model" in message
    assert "'betas': (0.9, 0.95)" in message and "strategy='ddp'" in message
    assert ("remove `optimizer_idx` from training_step" in message) is (module is OptimizerIdx)
    assert "Training with multiple optimizers is only supported" in str(caught.value.__cause__)


class WireCheck(L.Callback):
    """At the end of fit (4 workers would need more cores: 2 here, where a ring all-reduce puts 2 (M-1)/M = 1x the
    tensor on the wire and a broadcast (M-1)/M = 0.5x on every worker): the monitor's wire figures are the
    accountant's, and each sync's wire bytes are its collectives' by the ring models."""

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from lightning_lordo.lightning.callbacks import figures

        strategy = trainer.strategy
        last = strategy.sync_reports[-1]
        out = figures(strategy, last)
        # a sync's row holds the totals at the end of that sync; the end-of-training check after the last one (an
        # all-reduce of four float64 flags: 32 bytes, also on the wire at M = 2) only the current totals hold
        assert out["wire_bytes_total"] == last.total_wire_bytes > 0 and out["bytes_sent_total"] == last.total_bytes
        current = figures(strategy)
        assert current["wire_bytes_total"] == strategy.accountant.total_wire_bytes == last.total_wire_bytes + 32
        assert current["bytes_sent_total"] == strategy.accountant.total_bytes == last.total_bytes + 32
        assert out["ddp_equivalent_wire_bytes"] == out["ddp_equivalent_bytes"] > 0  # M = 2: the ring sends 1x
        assert out["wire_saving_vs_ddp"] == saving_ratio(out["ddp_equivalent_wire_bytes"], out["wire_bytes_total"])
        for report in strategy.sync_reports:  # all-reduces only in a round at M = 2: wire = payload
            assert report.wire_by_purpose == report.bytes_by_purpose, report
        # the forked replicas are identical: the setup sends only the 32-byte digest (an all-gather: at M = 2 its wire
        # bytes are its payload); test_strategy's ByteChecker covers the broadcast's wire bytes
        accountant = strategy.accountant
        assert accountant.wire_totals["setup_broadcast"] == accountant.totals["setup_broadcast"] == 32


def test_wire_bytes_are_logged_beside_the_payload_bytes() -> None:
    trainer(lordo(sync_every=4), callbacks=[WireCheck()], max_steps=8).fit(TinyRegressor(), loader())


# ---------------------------------------------------------------------------------------------------------------
# float16 with a gradient scaler: refused (README, "Use")
def test_float16_with_a_gradient_scaler_is_refused_with_the_fix() -> None:
    """A scaler skips the optimizer step on the ranks whose own gradients overflow, so the workers' step counts would
    drift apart. The CPU has no float16 AMP, so the precision plugins are given a CPU scaler by hand."""
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_lordo import LoRDOFabricStrategy, LoRDOStrategy

    strategy = LoRDOStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match=r"precision='16-mixed'.*Use precision='bf16-mixed'"):
        strategy.setup(L.Trainer(accelerator="cpu", devices=1, logger=False))
    fabric = LoRDOFabricStrategy()
    fabric.precision = FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"precision='16-mixed'.*Use precision='bf16-mixed'"):
        fabric._attach(model, torch.optim.AdamW(model.parameters()), None, "fabric.setup got")
