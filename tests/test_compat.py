"""The private attributes of Lightning and torch that ``lightning_lordo/lightning/_compat.py`` uses exist in the
installed versions, so that an upgrade that moves one fails here, by name, and not in a user's run."""

from __future__ import annotations

import inspect
import weakref

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from strategy_helpers import TinyRegressor, loader, lordo, trainer

from lightning_lordo.lightning import _compat


def test_the_private_attributes_used_exist() -> None:
    fitted = L.Trainer(logger=False, enable_checkpointing=False)
    assert hasattr(fitted.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")  # lightning >= 2.5.2
    assert hasattr(fitted.fit_loop.epoch_loop, "_batches_that_stepped")
    assert hasattr(fitted._logger_connector, "should_update_logs")
    assert hasattr(fitted._signal_connector, "received_sigterm")
    assert "_sigterm_notifier_fn" in inspect.getsource(_SignalConnector)
    assert callable(LightningOptimizer._to_lightning_optimizer)
    source = inspect.getsource(torch.optim.lr_scheduler)
    assert "_opt_called" in source and "_wrapped_by_lr_sched" in source
    assert _compat.BackwardSyncControl.__name__ == "_BackwardSyncControl"
    assert isinstance(type(fitted.fit_loop)._can_stop_early, property) and _compat.can_stop_early(fitted)
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name in ("_save_last_checkpoint", "_monitor_candidates"):  # what save_last_again calls
        assert callable(getattr(ModelCheckpoint, name))
    source = inspect.getsource(ModelCheckpoint)
    assert "self._last_global_step_saved = trainer.global_step" in source and "_last_checkpoint_saved" in source


def test_the_hooks_are_installed_on_a_fit() -> None:
    strategy = lordo(sync_every=2, start_method="popen")
    fit = trainer(strategy, devices=1, max_steps=2)
    fit.fit(TinyRegressor(), loader())
    assert fit.fit_loop.epoch_loop._broadcast_sigterm_tensor == strategy._sigterm_check
    assert fit._signal_connector._sigterm_notifier_fn == strategy._sigterm_notifier
    wrapper = strategy._lightning_optimizers[0]
    assert wrapper._strategy.sync_config is strategy.sync_config  # Lightning's binding, as for its own wrapper
    assert wrapper.driver.sync_config is strategy.sync_config and isinstance(wrapper.driver, weakref.ProxyType)
    assert _compat.batches_that_stepped(fit) == 2


def test_on_cuda_the_process_groups_timeout_is_a_backstop_behind_the_plugins() -> None:
    """NCCL's watchdog tears the process down at the group's timeout (PyTorch's default error handling): the group
    gets twice the plugin's plus a minute on CUDA, through the attribute Lightning passes to init_process_group."""
    import types
    from datetime import timedelta

    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    assert '"timeout": self._timeout' in inspect.getsource(DDPStrategy.setup_distributed)
    assert '"timeout": self._timeout' in inspect.getsource(FabricDDP._setup_distributed)
    five = timedelta(minutes=5)
    on_gpu = types.SimpleNamespace(root_device=torch.device("cuda", 0), _timeout=five)
    on_cpu = types.SimpleNamespace(root_device=torch.device("cpu"), _timeout=five)
    _compat.nccl_backstop(on_gpu, five)
    _compat.nccl_backstop(on_cpu, five)
    assert on_gpu._timeout == timedelta(minutes=11) and on_cpu._timeout == five
