"""``CommunicationMonitor``: what went over the wire and what the optimizer holds, in the user's logger.

The strategy adds one automatically unless the Trainer already has one. After every synchronization it
logs, under ``lordo/`` (per worker; Lightning's loggers write from rank 0):

* ``bytes_sent_sync``, ``bytes_sent_total``: bytes passed to collectives (all purposes, Lightning's own
  per-batch SIGTERM broadcast included); ``ddp_equivalent_bytes``: what DDP's gradient all-reduce would
  have passed for the same optimizer steps; ``bytes_saving_vs_ddp``: their ratio (DDP / LoRDO);
* ``sync_seconds``, ``basis_seconds``, ``subspace_movement``, ``pseudo_gradient_norm``, ``skipped_syncs``;
* from the optimizer: ``term_ratio`` (SPEC §6), ``error_feedback_norm``;
* memory (SPEC §8, three separate lines): ``optimizer_state_bytes`` vs ``adamw_state_bytes``,
  ``error_feedback_bytes``, ``sync_buffer_bytes``.

Cumulative totals live in the strategy and are saved in checkpoints. At the end of ``fit`` rank 0 prints
a rich table of the same figures.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from rich.console import Console
from rich.table import Table

from lightning_lordo.sync.synchronizer import SyncReport


class CommunicationMonitor(Callback):
    """Logs LoRDO's communication and memory figures after each synchronization.

    Args:
        prefix: prefix of every logged name.
        summary: print a rich table on rank 0 at the end of ``fit``.
    """

    def __init__(self, prefix: str = "lordo/", summary: bool = True) -> None:
        self.prefix = prefix
        self.summary = summary
        self._logged = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged = len(_lordo_strategy(trainer).sync_reports)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._log_new_reports(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log_new_reports(trainer)  # the final synchronization happens after the last batch
        for logger in trainer.loggers:
            logger.save()
        if self.summary and trainer.is_global_zero:
            Console().print(summary_table(trainer.strategy))

    def _log_new_reports(self, trainer: Trainer) -> None:
        strategy = _lordo_strategy(trainer)
        for report in strategy.sync_reports[self._logged :]:
            metrics = {self.prefix + k: v for k, v in figures(strategy, report).items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=report.step)
        self._logged = len(strategy.sync_reports)


def _lordo_strategy(trainer: Trainer) -> Any:
    """The Trainer's strategy if it synchronizes like LoRDO's (it has a synchronizer and an accountant)."""
    if not all(hasattr(trainer.strategy, name) for name in ("synchronizer", "accountant", "sync_reports")):
        raise RuntimeError(
            f"CommunicationMonitor needs strategy='lordo' (or 'lordo_local', 'diloco'); this Trainer uses "
            f"{type(trainer.strategy).__name__}. Remove the callback or switch the strategy."
        )
    return trainer.strategy


def figures(strategy: Any, report: Optional[SyncReport] = None) -> dict[str, float]:
    """The monitor's figures for ``strategy`` after ``report`` (or the current totals without one)."""
    total = strategy.accountant.total_bytes
    ddp = strategy.ddp_equivalent_bytes
    out: dict[str, float] = {
        "bytes_sent_total": total,
        "ddp_equivalent_bytes": ddp,
        "bytes_saving_vs_ddp": ddp / total if total else float("nan"),
        "skipped_syncs": strategy.synchronizer.skipped_syncs,
    }
    if report is not None:
        out.update({
            "bytes_sent_sync": report.bytes_sent,
            "sync_seconds": report.seconds,
            "basis_seconds": report.basis_seconds,
            "pseudo_gradient_norm": report.pseudo_gradient_norm,
        })
        if report.subspace_movement is not None:
            out["subspace_movement"] = report.subspace_movement
        out.update(report.extra)  # e.g. sync_error_feedback_norm (compressed payloads), reset counts
    optimizer = strategy.synchronizer.optimizer
    if hasattr(optimizer, "diagnostics"):
        out.update(optimizer.diagnostics())
    out.update(memory_figures(strategy))
    return out


def memory_figures(strategy: Any) -> dict[str, float]:
    """SPEC §8's three memory lines (bytes per worker), and AdamW's state for the same parameters."""
    optimizer = strategy.synchronizer.optimizer
    sync_memory = strategy.synchronizer.memory_report()
    out = {"sync_buffer_bytes": sum(sync_memory.values())}
    if hasattr(optimizer, "memory_report"):
        memory = optimizer.memory_report()
        out["optimizer_state_bytes"] = (memory["lowrank_moments"] + memory["bases"] + memory["fullrank_moments"]
                                        + memory["other"])
        out["error_feedback_bytes"] = memory["error_feedback"]
        out["adamw_state_bytes"] = memory["adamw_equivalent"]
    return out


def summary_table(strategy: Any) -> Table:
    """A rich table of communication and memory for the run so far."""
    reports: list[SyncReport] = strategy.sync_reports
    table = Table(title="LoRDO: communication and memory per worker")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("synchronizations (skipped)", f"{len(reports)} ({strategy.synchronizer.skipped_syncs})")
    for purpose, nbytes in sorted(strategy.accountant.totals.items()):
        table.add_row(f"  bytes sent: {purpose}", _human(nbytes))
    figs = figures(strategy)
    table.add_row("bytes sent, total", _human(figs["bytes_sent_total"]))
    table.add_row("DDP would have sent", _human(figs["ddp_equivalent_bytes"]))
    table.add_row("saving vs DDP", f"{figs['bytes_saving_vs_ddp']:.1f}x")
    if reports:
        table.add_row("mean sync time", f"{sum(r.seconds for r in reports) / len(reports) * 1e3:.1f} ms")
        table.add_row("  of which bases", f"{sum(r.basis_seconds for r in reports) / len(reports) * 1e3:.1f} ms")
    if "optimizer_state_bytes" in figs:
        table.add_row("optimizer state", _human(figs["optimizer_state_bytes"]))
        table.add_row("  AdamW's for the same parameters", _human(figs["adamw_state_bytes"]))
        table.add_row("error-feedback buffers", _human(figs["error_feedback_bytes"]))
    table.add_row("sync buffers (anchor, outer momentum)", _human(figs["sync_buffer_bytes"]))
    return table


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"
