"""``CommunicationMonitor``: what went over the wire and what the optimizer holds, in the user's logger.

The strategy adds one automatically unless the Trainer already has one. After every synchronization it
logs, under ``lordo/`` (per worker; Lightning's loggers write from rank 0):

* ``bytes_sent_sync``, ``bytes_sent_total``: bytes passed to collectives (all purposes, Lightning's own
  per-batch SIGTERM broadcast included), the total as it was when that sync ended (so an overlapped landing and
  the final sync logged in one batch each show their own); ``ddp_equivalent_bytes``: what DDP's gradient
  all-reduce would have passed for the same optimizer steps (0 on one device: DDP sends nothing there);
  ``bytes_saving_vs_ddp``: their ratio (DDP / LoRDO), 1.0 while neither has sent anything (one device), never NaN;
* ``wire_bytes_sync``, ``wire_bytes_total``, ``ddp_equivalent_wire_bytes``, ``wire_saving_vs_ddp``: what a worker
  puts on the network by each collective's algorithm (ring all-reduce 2(M-1)/M x the tensor, all-gather (M-1) x
  its chunk; :mod:`lightning_lordo.comm.accounting`), DDP priced by the same ring model;
* ``bytes_sync/<category>`` and ``wire_bytes_sync/<category>``: the bytes since the previous sync by category
  (``lowrank_pseudo_gradients``, ``fullrank_pseudo_gradients``, ``moments``, ``control`` flags, ``buffers``, ...:
  :func:`lightning_lordo.sync.report.breakdown`), so what dominates on a model is visible;
* ``sync_seconds``, ``basis_seconds``, ``subspace_movement``, ``pseudo_gradient_norm`` (not for a discarded,
  non-finite round), ``skipped_syncs``;
* from the optimizer: ``term_ratio`` (SPEC §6), ``error_feedback_norm``;
* memory (SPEC §8, three separate lines): ``optimizer_state_bytes`` vs ``adamw_state_bytes``,
  ``error_feedback_bytes``, ``sync_buffer_bytes``.

The figures are logged at Lightning's own step (the ``step`` of ``self.log``'s rows): in the row Lightning writes
for that batch when it writes one (``log_every_n_steps``), in a row of their own at that step otherwise. With a
progress bar, ``lordo/saving_vs_ddp`` (the current ``bytes_saving_vs_ddp``) is shown in it.

Cumulative totals live in the strategy and are saved in checkpoints. At the end of ``fit`` rank 0 prints
a rich table of the same figures.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from lightning_lordo.lightning._compat import (
    batches_that_stepped,
    can_stop_early,
    is_last_batch,
    logged_results,
    logs_this_batch,
    save_last_again,
)
from lightning_lordo.sync.report import SyncReport


class CommunicationMonitor(Callback):
    """Logs LoRDO's communication and memory figures after each synchronization.

    Args:
        prefix: prefix of every logged name.
        summary: print a rich table on rank 0 at the end of ``fit``.
        progress_bar: show ``<prefix>saving_vs_ddp`` (bytes DDP would have sent per byte sent) in the progress bar:
            ``None`` when the Trainer has one, ``True`` or ``False``.
    """

    def __init__(self, prefix: str = "lordo/", summary: bool = True, progress_bar: Optional[bool] = None) -> None:
        if not isinstance(prefix, str):
            raise ValueError(f"Invalid prefix={prefix!r}: it must be a string, e.g. 'lordo/'.")
        if not isinstance(summary, bool):
            raise ValueError(f"Invalid summary={summary!r}: it must be True or False.")
        if progress_bar is not None and not isinstance(progress_bar, bool):
            raise ValueError(f"Invalid progress_bar={progress_bar!r}: it must be True, False or None (on when the "
                             "Trainer has a progress bar).")
        self.prefix = prefix
        self.summary = summary
        self.progress_bar = progress_bar
        self._logged = 0
        self._show_progress = False
        self._added_by_strategy = False
        self._joined_row = False  # figures went into Lightning's row of the last batch: forget them at the next
        self._epoch, self._ran = 0, False  # the last training batch's epoch (on_fit_end is past it); any batch?
        self._totals: Optional[tuple[float, float]] = None  # the byte totals of the last row written

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged, self._joined_row = len(_lordo_strategy(trainer).sync_reports), False
        self._epoch, self._totals, self._ran = trainer.current_epoch, None, False
        has_bar = trainer.progress_bar_callback is not None
        self._show_progress = has_bar if self.progress_bar is None else self.progress_bar

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._joined_row:
            self._joined_row = False
            _forget_logged(trainer, self.prefix, keep=self.prefix + "saving_vs_ddp")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        strategy = _lordo_strategy(trainer)
        new = strategy.sync_reports[self._logged :]
        self._logged = len(strategy.sync_reports)
        joins_row = bool(new) and bool(trainer.loggers) and _lightning_writes_this_batch(trainer)
        self._epoch, self._ran = trainer.current_epoch, True
        for i, report in enumerate(new):
            metrics = self._noted({self.prefix + k: v for k, v in figures(strategy, report).items()})
            if joins_row and i == len(new) - 1:  # into Lightning's own row for this batch, exactly (float64)
                for name, value in metrics.items():
                    pl_module.log(name, torch.tensor(float(value), dtype=torch.float64), on_step=True,
                                  on_epoch=False, logger=True, batch_size=1)
                self._joined_row = True
            else:
                _write(trainer, metrics, _lightning_step(trainer), self._epoch)
        if self._show_progress:
            saving = figures(strategy, totals_only=True)["bytes_saving_vs_ddp"]  # a host tensor: a float would be
            # copied to the device and read back every batch (two GPU stalls)
            pl_module.log(self.prefix + "saving_vs_ddp", torch.tensor(saving, dtype=torch.float64), on_step=True,
                          on_epoch=False, prog_bar=True, logger=False, batch_size=1)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a final synchronization after the last batch (a fit that ended otherwise than at its last step): at the
        # last batch's step and epoch, where Lightning writes its epoch-end metrics too
        strategy = _lordo_strategy(trainer)  # a fit that ran no batch (resumed at max_steps): where it was restored
        step, epoch = (max(_lightning_step(trainer) - 1, 0), self._epoch) if self._ran else \
            (_lightning_step(trainer), trainer.current_epoch)
        for report in strategy.sync_reports[self._logged :]:
            _write(trainer, self._noted({self.prefix + k: v for k, v in figures(strategy, report).items()}), step,
                   epoch)
        self._logged = len(strategy.sync_reports)
        # the totals as the fit ends, where they moved since the last row (the synchronous steps since the last
        # basis refresh; Lightning's collectives after the last sync: epoch-end metrics, checkpoint agreements)
        totals = {self.prefix + k: v for k, v in figures(strategy, totals_only=True).items()}
        sync = strategy.synchronizer
        partial = sync is not None and sync.synchronous_now and sync.optimizer_steps % sync.config.sync_every
        if partial or (self._totals is not None and self._key(totals) != self._totals):
            _write(trainer, self._noted(totals), step, epoch)
        for logger in trainer.loggers:
            logger.save()
        if self.summary and trainer.is_global_zero:
            Console().print(summary_table(trainer.strategy))

    def _key(self, metrics: dict[str, float]) -> tuple[float, float]:
        return metrics[self.prefix + "bytes_sent_total"], metrics[self.prefix + "ddp_equivalent_bytes"]

    def _noted(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics``, about to be logged: their byte totals are the last logged ones."""
        self._totals = self._key(metrics)
        return metrics


def add_monitor(trainer: Trainer, progress_bar: Optional[bool]) -> None:
    """The strategy's monitor (``monitor=True``), unless the Trainer already has a monitor of the user's."""
    theirs = [c for c in trainer.callbacks if isinstance(c, CommunicationMonitor) and not c._added_by_strategy]
    if theirs and progress_bar is not None:
        raise ValueError(
            f"Invalid monitor_progress_bar={progress_bar!r}: it configures the CommunicationMonitor the strategy adds, "
            f"but this Trainer has its own. Pass CommunicationMonitor(progress_bar={progress_bar!r}) to the Trainer "
            "instead and leave monitor_progress_bar unset."
        )
    if not any(isinstance(c, CommunicationMonitor) for c in trainer.callbacks):
        monitor = CommunicationMonitor(progress_bar=progress_bar)
        monitor._added_by_strategy = True
        trainer.callbacks.append(monitor)


class FinalSync(Callback):
    """The strategy puts this first among the callbacks, because Lightning calls the strategy's hooks after the
    callbacks' and the module's: a fit whose end no step, batch or validation told (EarlyStopping at an epoch's end,
    after ModelCheckpoint's saves) runs its final sync before the other ``on_train_end`` hooks (``final_sync`` has a
    ``last`` saved before it saved again); validation mid-round has the synchronized model in before the other
    ``on_validation_start`` hooks. As with DDP they see one model."""

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        final_sync(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # stopped by the module's on_train_batch_end: the validation Lightning runs then sees the model fit returns
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and _stopping(trainer):
            final_sync(trainer)
        trainer.strategy.swap_in_for_validation()


def final_sync(trainer: Trainer) -> None:
    """The final sync from a callback (from ``on_validation_end`` too: the replicas come back from the anchor
    validated first). Where it moves the model, a ModelCheckpoint that saved ``last`` at this step, before it, saves
    it again at once: with the model ``fit`` returns, and the loops' state of that save (a resume continues there)."""
    strategy = trainer.strategy
    moves = not strategy.final_sync_done and getattr(strategy.synchronizer, "mid_round", False)
    strategy.leave_validation_view()
    strategy.on_train_end_sync()
    if moves:
        for callback in trainer.checkpoint_callbacks:
            save_last_again(callback, trainer)


def reports_undone(trainer: Trainer, kept: int) -> None:
    """A restore after setup undid the reports after the first ``kept``: the monitors log from there on."""
    for monitor in trainer.callbacks:
        if isinstance(monitor, CommunicationMonitor):
            monitor._logged = min(monitor._logged, kept)


def refuse_weight_averaging(trainer: Trainer, local_rounds: bool) -> None:
    """Lightning's weight averaging and pruning work on each rank's own replica, which local steps keep apart between
    syncs."""
    kinds = tuple(k for k in (getattr(lightning_callbacks, "WeightAveraging", None),
                                lightning_callbacks.StochasticWeightAveraging) if k)
    found = [type(c).__name__ for c in trainer.callbacks if isinstance(c, kinds)]
    if found and local_rounds:
        raise ValueError(
            f"{found[0]} is not supported with LoRDO's local rounds on several processes: it averages each rank's "
            "own replica, which differ between syncs, so the ranks would end with different models and checkpoints "
            "would hold rank 0's average. Use it with devices=1 or strategy='lowrank_ddp' (synchronous steps), or "
            "average the synchronized model yourself (trainer.strategy.synchronizer.steps_since_sync == 0 after a "
            "sync).")
    pruning = [type(c).__name__ for c in trainer.callbacks if isinstance(c, lightning_callbacks.ModelPruning)]
    if pruning and local_rounds:  # its masks are buffers made after setup: no sync ever sees them
        raise ValueError(
            f"{pruning[0]} is not supported with LoRDO's local rounds on several processes: it prunes each rank's "
            "own replica, which differ between syncs, so each rank keeps another mask and the ranks end with "
            "different models. Use it with devices=1 or strategy='lowrank_ddp' (synchronous steps, identical "
            "replicas), or prune before or after the distributed fit.")


class SyncBeforeSaves(Callback):
    """The final sync of a fit that ends otherwise than at a step known to be its last, run as soon as the end is
    known, so that the validation Lightning runs then and ``ModelCheckpoint``'s saves hold the model ``fit``
    returns, as with DDP: ``should_stop`` that Lightning honours, set by a batch (``max_time``, the user's code), the
    last batch of the last epoch when only the batch's end knows it (a ``dataloader_iter`` step), the last epoch cut
    short, a stop decided at a validation's end (EarlyStopping mid-epoch: that validation saw the anchor). The
    strategy puts it right before the checkpoint callbacks, which Lightning keeps last (after the Timer and
    EarlyStopping; at an epoch's end Lightning calls those two after the others, so ``FinalSync`` syncs there)."""

    @override
    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        synchronizer = trainer.strategy.synchronizer
        self._steps = (trainer.global_step, synchronizer.optimizer_steps if synchronizer is not None else 0)

    @override
    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        strategy, synchronizer = trainer.strategy, trainer.strategy.synchronizer
        skipped = synchronizer is not None and trainer.global_step > self._steps[0] and \
            synchronizer.optimizer_steps == self._steps[1]
        if skipped and strategy.world_size > 1 and strategy.core.round_due():  # the others check before their round
            strategy._check_steps_before_round(taken=False)
        if _stopping(trainer) or (last_epoch(trainer) and is_last_batch(trainer)):
            final_sync(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after EarlyStopping's decision there (a validation mid-epoch), before ModelCheckpoint's save: the save has
        # the model fit returns, with the scores of the validation, which saw the anchor
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and _stopping(trainer):
            final_sync(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # before EarlyStopping's and ModelCheckpoint's (Lightning calls those after the module's hook)
        if _stopping(trainer) or last_epoch(trainer):
            final_sync(trainer)


def _stopping(trainer: Trainer) -> bool:
    return trainer.should_stop and can_stop_early(trainer)


def last_epoch(trainer: Trainer) -> bool:
    """Whether the epoch running is ``max_epochs``' last."""
    return trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0


def add_final_sync(trainer: Trainer) -> None:
    if not any(isinstance(c, FinalSync) for c in trainer.callbacks):
        trainer.callbacks.insert(0, FinalSync())
    if not any(isinstance(c, SyncBeforeSaves) for c in trainer.callbacks):
        saves = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, Checkpoint)]
        trainer.callbacks.insert(saves[0] if saves else len(trainer.callbacks), SyncBeforeSaves())


def _lightning_step(trainer: Trainer) -> int:
    """The step Lightning's logger connector gives the rows of ``self.log`` during training (it counts the batches
    that took an optimizer step, and is saved in checkpoints)."""
    return batches_that_stepped(trainer)


def _lightning_writes_this_batch(trainer: Trainer) -> bool:
    """Whether Lightning writes its step metrics to the loggers after this batch (``log_every_n_steps``)."""
    return logs_this_batch(trainer)


def _write(trainer: Trainer, metrics: dict[str, float], step: int, epoch: int) -> None:
    """A row of its own at Lightning's ``step`` (with the ``epoch`` column Lightning's rows have)."""
    for logger in trainer.loggers:
        logger.log_metrics({**{k: float(v) for k, v in metrics.items()}, "epoch": epoch}, step=step)


def _forget_logged(trainer: Trainer, prefix: str, keep: str) -> None:
    """Lightning keeps writing a value logged with ``self.log(on_step=True)`` into every later row until it is
    logged again; a synchronization's figures belong to its own row only, so they are dropped after it."""
    for result in logged_results(trainer).values():
        meta = getattr(result, "meta", None)
        if meta is not None and meta.fx == "on_train_batch_end" and meta.name.startswith(prefix) \
                and meta.name != keep and not getattr(result, "has_reset", True):
            result.reset()


def _lordo_strategy(trainer: Trainer) -> Any:
    """The Trainer's strategy if it synchronizes like LoRDO's (it has a synchronizer and an accountant)."""
    if not all(hasattr(trainer.strategy, name) for name in ("synchronizer", "accountant", "sync_reports")):
        raise RuntimeError(
            f"CommunicationMonitor needs strategy='lordo' (or 'lordo_local', 'diloco'); this Trainer uses "
            f"{type(trainer.strategy).__name__}. Remove the callback or switch the strategy."
        )
    return trainer.strategy


def figures(strategy: Any, report: Optional[SyncReport] = None, totals_only: bool = False) -> dict[str, float]:
    """The monitor's figures for ``strategy`` after ``report`` (:meth:`~lightning_lordo.core.LoRDOCore.figures`)."""
    return strategy.core.figures(strategy.world_size, report, totals_only)


def summary_table(strategy: Any) -> Table:
    """A rich table of :meth:`~lightning_lordo.core.LoRDOCore.summary`, the figures of the run so far."""
    s = strategy.core.summary(strategy.world_size)
    table = Table(title="LoRDO: communication and memory per worker")
    table.add_column("figure")
    table.add_column("value", justify="right")
    sync = strategy.synchronizer  # one device, synchronous: a sync is a basis refresh (and its time the refresh's)
    refreshes = sync is not None and bool(sync.config.synchronous) and strategy.world_size == 1
    if refreshes:  # before optimizer steps K + 1, 2K + 1, ...: not at a report (every K steps)
        done = max(s["optimizer_steps"] - 1, 0) // sync.config.sync_every if sync.lordo is not None else 0
        table.add_row("basis refreshes (skipped)", f"{done} ({s['skipped_syncs']})")
    else:
        table.add_row("synchronizations (skipped)", f"{s['syncs']} ({s['skipped_syncs']})")
    for purpose, nbytes in s["bytes_by_purpose"].items():
        table.add_row(f"  bytes sent: {purpose}", _human(nbytes))
    table.add_row("bytes sent, total", _human(s["bytes_sent_total"]))
    if s["bytes_saving_vs_ddp"] is not None:
        table.add_row("DDP would have sent", _human(s["ddp_equivalent_bytes"]))
        table.add_row("saving vs DDP", f"{s['bytes_saving_vs_ddp']:.1f}x")
    else:
        table.add_row("DDP would have sent", "nothing (one device)")
        table.add_row("saving vs DDP", "none (one device)")
    if s["mean_sync_seconds"] is not None and not (refreshes and sync.lordo is None):  # alone, no bases: no time
        table.add_row(f"mean {'refresh' if refreshes else 'sync'} time", f"{s['mean_sync_seconds'] * 1e3:.1f} ms")
        table.add_row("  of which bases", f"{s['mean_basis_seconds'] * 1e3:.1f} ms")
    if "optimizer_state_bytes" in s:
        table.add_row("optimizer state", _human(s["optimizer_state_bytes"]))
        table.add_row("  AdamW's for the same parameters", _human(s["adamw_state_bytes"]))
        table.add_row("error-feedback buffers", _human(s["error_feedback_bytes"]))
    if "sync_buffer_bytes" in s:
        table.add_row("sync buffers (anchor, momentum, payload state)", _human(s["sync_buffer_bytes"]))
    return table


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"
