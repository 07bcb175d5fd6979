"""Every use of a private attribute of Lightning, in one place.

The plugin supports ``lightning>=2.5,<2.7`` (pyproject). Each function below names what it touches; where a
release may lack it, it checks the attribute and says what is lost without it. A Lightning upgrade that moves one of
these should need changes here only (``tests/test_compat.py`` checks each against the installed version).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer

LIGHTNING_VERSION = lightning.__version__
#: Fabric's hook for ``fabric.no_backward_sync`` (its base class is private).
BackwardSyncControl = _BackwardSyncControl


def install_sigterm_hooks(trainer: Trainer, check: Callable[[], None], notifier: Callable[[int, Any], None]) -> bool:
    """Replace the per-batch SIGTERM broadcast of ``trainer.fit_loop.epoch_loop`` (``_broadcast_sigterm_tensor``,
    lightning >= 2.5.2) and the handler the signal connector registers (``_sigterm_notifier_fn``, registered after
    ``Strategy.setup``, so the instance attribute is what gets registered). ``False`` where the loop has no such
    check (lightning < 2.5.2): Lightning's own SIGTERM handling then applies."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = check
    trainer._signal_connector._sigterm_notifier_fn = notifier
    return True


def note_sigterm(trainer: Trainer) -> None:
    """Set the flag Lightning's loops read to stop at the end of the batch (``_signal_connector.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = True


def batches_that_stepped(trainer: Trainer) -> int:
    """The step Lightning's logger connector gives the rows of ``self.log`` during training (it counts the batches
    that took an optimizer step, and is saved in checkpoints): ``epoch_loop._batches_that_stepped``."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def logs_this_batch(trainer: Trainer) -> bool:
    """Whether Lightning writes its step metrics to the loggers after this batch (``log_every_n_steps``), from the
    logger connector (``trainer._logger_connector``)."""
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def logged_results(trainer: Trainer) -> dict[str, Any]:
    """The values ``self.log`` holds for the running loop (``trainer._results``; empty outside a loop)."""
    return getattr(trainer, "_results", None) or {}


def wrap_optimizers(strategy: Any, cls: type[LightningOptimizer]) -> list[LightningOptimizer]:
    """The strategy's optimizers in the LightningOptimizer subclass ``cls``, bound as Lightning binds its own
    (``LightningOptimizer._to_lightning_optimizer``), installed where Lightning keeps its wrappers
    (``strategy._lightning_optimizers``); returns them."""
    wrappers = [cls._to_lightning_optimizer(o, strategy) for o in strategy.optimizers]
    strategy._lightning_optimizers = wrappers
    return wrappers


def nccl_backstop(strategy: Any, timeout: timedelta) -> None:
    """Before the process group is made: on CUDA (NCCL) its timeout becomes twice the plugin's plus a minute.
    PyTorch's NCCL watchdog tears the process down at the group's timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s
    default, 3), which would race the plugin's own ``CollectiveTimeout`` at ``timeout`` and the user's exception
    and emergency checkpoint after it; the group's timeout stays the backstop. Lightning keeps it in ``_timeout``
    (Trainer and Fabric ``DDPStrategy`` alike)."""
    if strategy.root_device.type == "cuda":
        strategy._timeout = 2 * timeout + timedelta(minutes=1)


def is_last_batch(trainer: Trainer) -> bool:
    """Whether the training batch just run is its epoch's last (``fit_loop.epoch_loop.batch_progress``; a
    ``dataloader_iter`` step learns it only after the step)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def can_stop_early(trainer: Trainer) -> bool:
    """Whether Lightning honours ``trainer.should_stop`` now (``fit_loop._can_stop_early``: ``min_epochs`` and
    ``min_steps`` met); it trains on otherwise."""
    return bool(trainer.fit_loop._can_stop_early)


def save_last_again(callback: Any, trainer: Trainer) -> None:
    """A ``ModelCheckpoint`` with ``save_last`` that saved at this step (``_last_global_step_saved``) writes ``last``
    again now (``_save_last_checkpoint``, with ``_monitor_candidates``; a file, not a link to the save before: its
    ``_last_checkpoint_saved`` cleared): the model changed after that save."""
    if isinstance(callback, ModelCheckpoint) and callback.save_last and \
            getattr(callback, "_last_global_step_saved", None) == trainer.global_step:
        callback._last_checkpoint_saved = ""
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
