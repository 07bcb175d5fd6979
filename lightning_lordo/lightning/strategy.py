"""``LoRDOStrategy``: Lightning's DDP strategy without the per-step gradient all-reduce.

Each rank trains its own replica with local LoRDO steps; every ``sync_every`` optimizer steps (and at the end of fit)
the ranks synchronize (``lightning_lordo.sync``). The model is never wrapped in ``DistributedDataParallel``: parameters
and buffers are broadcast from rank 0 once at setup (skipped when a 32-byte digest shows every rank already holds rank
0's, e.g. a seeded model), and each rank draws its own data through Lightning's usual distributed sampler.

Validation during ``fit`` and every checkpoint see the *synchronized* model (the anchor), identical on all
ranks and free to produce; it lags the local replicas by the steps since the last sync (with ``overlap_steps``,
since the launch of the last round that landed). ``strategy.synchronizer.synchronized_step`` is its step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, Literal, Optional, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lordo.checks import check_choice
from lightning_lordo.comm.communicator import Communicator, joining, side_communicator
from lightning_lordo.comm.groups import destroy_at_exit
from lightning_lordo.config import SyncConfig
from lightning_lordo.convert import (
    check_initialized,
    several_optimizers_message,
)
from lightning_lordo.core import HoldsCore, LoRDOCore
from lightning_lordo.lightning._compat import install_sigterm_hooks, nccl_backstop, wrap_optimizers
from lightning_lordo.lightning.callbacks import add_final_sync, add_monitor, refuse_weight_averaging
from lightning_lordo.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_lordo.lightning.collectives import GuardedCollectives
from lightning_lordo.lightning.saving import SynchronizedState
from lightning_lordo.lightning.shards import check_checkpoint_io
from lightning_lordo.lightning.user_warnings import PluginWarnings
from lightning_lordo.strategy_knobs import (
    LAUNCH_SUFFIXES,
    NAMED_SYNC_KNOBS,
    NO_EXPERIMENTS,
    PRESETS,
    Experimental,
    resolve_knobs,
)

DEFAULT_TIMEOUT = SyncConfig().timeout.total_seconds()
#: The arguments of Lightning's ``DDPStrategy`` this strategy passes on (through ``**ddp``).
DDP_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                 "process_group_backend")


class LoRDOLightningOptimizer(LightningOptimizer):
    """The LightningOptimizer the strategy puts around the user's optimizer: it drives LoRDO around each step.

    Lightning calls its ``step`` once per optimizer step (after gradient accumulation, inside
    ``LightningModule.optimizer_step``). The closure it receives runs the forward and backward passes; Lightning's
    precision plugin then calls the ``on_before_optimizer_step`` hooks and clips the gradients. Right after the
    backward pass the strategy's :meth:`~LoRDOStrategy.before_optimizer_step` runs, so clipping and those hooks see
    what the optimizer will use (in the synchronous phase the averaged gradient, as with DDP; the first bases are in
    place before the first update); after the step, :meth:`~LoRDOStrategy.after_optimizer_step` (every K steps the
    sync). ``driver`` is the strategy, set when the strategy wraps the optimizer.
    """

    driver: LoRDOStrategy  # a weak proxy

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        driver = self.driver

        def backward_then_prepare() -> Any:
            output = closure() if closure is not None else None
            driver.before_optimizer_step()  # gradient average (synchronous phase), first bases
            return output

        output = super().step(backward_then_prepare, **kwargs)  # the local step (SPEC §3)
        driver.after_optimizer_step()  # counts the step; every K steps the sync
        return output


class LoRDOStrategy(HoldsCore, SynchronizedState, GuardedCollectives, DDPStrategy):
    """Local LoRDO steps with a low-rank synchronization every ``sync_every`` optimizer steps.

    Each knob has one home: the distribution knobs are named arguments; LoRDO's knobs for converting your
    Adam/AdamW go in ``optimizer``; research and ablation knobs in ``experimental``. ``preset`` starts from a
    registered name, and every knob passed overrides it. A knob that the others make meaningless is refused.

    Args:
        sync_every: K, optimizer steps between synchronizations.
        preset: ``lordo``, ``lordo_local``, ``lordo_lean``, ``lordo_compressed``, ``lowrank_ddp`` or ``diloco``
            (:data:`~lightning_lordo.strategy_knobs.PRESETS`).
        optimizer: LoRDO's knobs for the conversion of your Adam/AdamW (``rank``, ``omega``, ``full_rank_params``,
            ...; see :class:`~lightning_lordo.LoRDO`). Refused when ``configure_optimizers`` returns a LoRDO.
        payload: what a sync sends: ``full`` or ``lowrank`` (PowerSGD-style), in ``payload_dtype`` (``None``: the
            preset's, else ``full``).
        payload_dtype: ``float32``, ``bfloat16`` or ``int8`` (``None``: the preset's, else ``float32``).
        outer_optimizer: ``average`` or ``nesterov`` (DiLoCo's outer SGD).
        outer_lr: the Nesterov outer step's learning rate (DiLoCo's 0.7).
        outer_momentum: the Nesterov outer step's momentum (DiLoCo's 0.9).
        overlap_steps: 0 (blocking syncs), or tau < sync_every: a round's collectives overlap tau local steps.
        anchor_device: where the anchor lives: ``auto`` (host memory on an accelerator), ``param`` or ``cpu``.
        bucket_cap_mb: the most pseudo-gradient (float32 MB) a blocking sync holds at once.
        monitor: add a :class:`~lightning_lordo.CommunicationMonitor` unless the Trainer already has one.
        timeout: timeout of every collective, in seconds (1 s to one year) or a timedelta.
        start_method: how processes are launched: ``popen``, ``spawn``, ``fork`` or ``forkserver``, as in DDP.
        experimental: an :class:`~lightning_lordo.Experimental` (or a mapping of its fields).
        **ddp: ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin`` and ``process_group_backend``, as in Lightning's ``DDPStrategy`` (the Trainer sets
            the first ones; the checkpoint IO defaults to an atomic one).
    """

    strategy_name = "lordo"

    def __init__(
        self,
        sync_every: int = SyncConfig.sync_every,
        *,
        preset: str = "lordo",
        optimizer: Optional[dict[str, Any]] = None,
        payload: Optional[Literal["full", "lowrank"]] = None,
        payload_dtype: Optional[Literal["float32", "bfloat16", "int8"]] = None,
        outer_optimizer: Literal["average", "nesterov"] = SyncConfig.outer_optimizer,
        outer_lr: float = SyncConfig.outer_lr,
        outer_momentum: float = SyncConfig.outer_momentum,
        overlap_steps: int = SyncConfig.overlap_steps,
        anchor_device: Literal["auto", "param", "cpu"] = SyncConfig.anchor_device,
        bucket_cap_mb: float = SyncConfig.bucket_cap_mb,
        monitor: bool = True,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        experimental: Experimental = NO_EXPERIMENTS,
        **ddp: Any,
    ) -> None:
        named = {k: v for k, v in locals().items() if k in NAMED_SYNC_KNOBS}  # the distribution knobs, by name
        knobs = resolve_knobs(
            "LoRDOStrategy", preset=preset, named=named, optimizer=optimizer, experimental=experimental,
            misplaced={k: v for k, v in ddp.items() if k not in DDP_ARGUMENTS}, trainer_only=True,
            optimizer_source="the optimizer your configure_optimizers returns (and your LR schedulers keep driving lr)")
        if not isinstance(monitor, bool):
            raise ValueError(f"Invalid monitor={monitor!r}: it must be True or False.")
        if knobs.monitor_progress_bar is not None and (not isinstance(knobs.monitor_progress_bar, bool) or not monitor):
            raise ValueError(f"Invalid experimental monitor_progress_bar={knobs.monitor_progress_bar!r} with "
                             f"monitor={monitor!r}: it must be None, True or False, and it configures the monitor the "
                             "strategy adds (monitor=True).")
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        self.preset = preset
        self.core = LoRDOCore(knobs, "strategy='lordo'")
        self.monitor = monitor
        self.monitor_progress_bar = knobs.monitor_progress_bar
        self.checkpoint_shards = knobs.checkpoint_shards
        super().__init__(timeout=self.sync_config.timeout, start_method=start_method,
                         accelerator=ddp.get("accelerator"), parallel_devices=ddp.get("parallel_devices"),
                         cluster_environment=ddp.get("cluster_environment"),
                         checkpoint_io=ddp.get("checkpoint_io"),  # None: AtomicCheckpointIO (the property)
                         precision_plugin=ddp.get("precision_plugin"),
                         process_group_backend=ddp.get("process_group_backend"))
        self._swapped_for_eval = False
        self._overlap_group: Any = None  # overlap_steps: the side gloo group of the rounds' thread, kept across fits
        self._restored: Optional[dict[str, Any]] = None
        self._restored_optimizer: Optional[dict[str, Any]] = None
        self._restored_names: Optional[list[str]] = None
        self._resume_notes: list[str] = []
        self._finished = False  # the final synchronization of this fit ran
        self._lordo_checkpoint = self._reset_on_load = False
        self._plugin_warnings = PluginWarnings(partial(getattr, self, "global_rank"))  # rank 0, at the user's line

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> Any:
        """The CheckpointIO given (the strategy's argument, or a Trainer plugin), else one whose writes are atomic.
        Made here, not passed to DDPStrategy, so that a plugin is not taken for a second one."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (_, description) in PRESETS.items():
            for suffix, start_method in LAUNCH_SUFFIXES:
                if name + suffix not in strategy_registry:
                    strategy_registry.register(name + suffix, cls, description=f"{description} ({start_method})",
                                               start_method=start_method, preset=name)

    @override
    def setup_distributed(self) -> None:
        nccl_backstop(self, self.sync_config.timeout)
        with joining(self.sync_config.timeout, "LoRDOStrategy"):  # a late worker's error names the knob
            super().setup_distributed()

    # ------------------------------------------------------------------ optimizers
    def _set_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Lightning's setter, then our LightningOptimizer wrappers in place of its own (they drive LoRDO)."""
        DDPStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        for wrapper in wrap_optimizers(self, LoRDOLightningOptimizer):
            wrapper.driver = weakref.proxy(self)  # as Lightning holds the strategy: no reference cycle

    optimizers = property(DDPStrategy.optimizers.fget, _set_optimizers)  # the getter is Lightning's own

    @override
    def setup(self, trainer: Trainer) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise RuntimeError(
                "LoRDOStrategy does not support precision='16-mixed': its gradient scaler skips optimizer steps on "
                "the ranks whose own gradients overflow, so the workers' step counts would diverge. Use "
                "precision='bf16-mixed' (no scaler) or '32-true'."
            )

        if self.monitor:
            add_monitor(trainer, self.monitor_progress_bar)
        add_final_sync(trainer)
        self._finished = self._finished and trainer.state.fn != TrainerFn.FITTING  # this fit's final sync is to come
        refuse_weight_averaging(trainer, trainer.state.fn == TrainerFn.FITTING and self.world_size > 1
                                and not self.sync_config.synchronous)
        install_sigterm_hooks(trainer, self._sigterm_check, self._sigterm_notifier)  # the per-batch check
        if self.checkpoint_shards and trainer.state.fn == TrainerFn.FITTING:  # here, not at the first save
            check_checkpoint_io(self.checkpoint_io)
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: replicas start identical (rank 0's, broadcast unless
        every rank already holds them), then run free."""
        assert isinstance(self.model, LightningModule)
        if not self.model.automatic_optimization:
            raise RuntimeError(
                "LoRDOStrategy supports automatic optimization only (it synchronizes after each "
                "optimizer.step() Lightning makes). Set `self.automatic_optimization = True`, or use "
                "strategy='ddp' for manual optimization."
            )
        self.core.new_fit()  # each fit counts its own traffic
        self._start_counting()
        self.communicator = Communicator(self.accountant, self.sync_config.timeout)
        self.core.overlap_comm = None
        if self.sync_config.overlap_steps and self.world_size > 1:  # its gloo group made once per strategy
            group = self._overlap_group or side_communicator(self.accountant, self.sync_config.timeout).group
            self._overlap_group = group
            self.core.overlap_comm = Communicator(self.accountant, self.sync_config.timeout, group=group)
        self._setup_control()
        destroy_at_exit(self)  # the groups end while the interpreter is whole (comm.groups)
        check_initialized(self.model)
        state = list(self.model.parameters()) + list(self.model.buffers())
        self.communicator.broadcast_unless_identical([t.data for t in state], "setup_broadcast")

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        with self._plugin_warnings:
            self._setup_optimizers(trainer)

    def _setup_optimizers(self, trainer: Trainer) -> None:
        module = self.lightning_module
        try:  # one optimizer: Lightning refuses several under automatic optimization (configure_ddp refuses manual)
            super().setup_optimizers(trainer)
        except RuntimeError as err:
            if "multiple optimizers" not in str(err):
                raise
            raise RuntimeError(several_optimizers_message(module)) from err
        assert module is not None
        user_optimizer = self.optimizers[0]
        optimizer = self.core.attach(module, user_optimizer, self.lr_scheduler_configs, "configure_optimizers returned",
                                     self._scale_schedulers)
        if optimizer is not user_optimizer:
            self.optimizers = [optimizer]
        self._note_synced_buffers(now=True)
        if self._restored is not None:
            self._apply_restored_state()
        message = self.core.plan_message()
        if message:
            rank_zero_info(message)

    # ------------------------------------------------------------------ synchronization
    def before_optimizer_step(self) -> None:
        """Called by the LightningOptimizer after the backward pass of each optimizer step."""
        with self._plugin_warnings:
            self.core.before_step()

    def _scale_schedulers(self) -> None:
        """At the switch: the LR schedulers' base LRs follow ``switch_lr_scale`` (the synchronizer scaled the
        param groups' learning rates)."""
        self.core.scale_schedulers([c.scheduler for c in self.lr_scheduler_configs], self.sync_config.switch_lr_scale)

    def after_optimizer_step(self) -> None:
        """After each optimizer step (before a round: the step counts); the last one of ``fit`` runs the final sync."""
        with self._plugin_warnings:
            if self.world_size > 1 and self.core.round_due():
                self._check_steps_before_round()
            last = self._is_last_step()
            self.core.after_step(last)
            if last:
                self._finish_training()
            self._note_synced_buffers()

    def _note_synced_buffers(self, now: bool = False) -> None:
        """Copy the floating buffers where they are one model's on every rank: ``now`` (setup, and a resume before
        each rank's own come back) and after a blocking sync. None where no copy is: in the synchronous phase and
        after the switch until the first sync (the gradients are averaged, not the buffers), and with
        ``overlap_steps`` (a landing adds each rank's own change since the launch); each rank keeps its own then."""
        sync, reports = self.synchronizer, self.core.sync_reports
        if sync is None:
            return
        new_reports = reports[self._synced_buffers_reports or 0:]  # empty but after a sync
        if sync.synchronous_now or sync.config.overlap_steps:
            self._synced_buffers = None
        elif now or any(not r.extra.get("synchronous") for r in new_reports):  # a round (not a refresh) averaged
            self._synced_buffers = [b.detach().clone() for b in sync.buffers if b.is_floating_point()]
        self._synced_buffers_reports = len(reports)

    @property
    def _trainer(self) -> Optional[Trainer]:
        """The Trainer of the module being run (``None`` before one is attached, or once Lightning detached it)."""
        try:
            return self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # "not attached to a Trainer"
            return None

    @property
    def final_sync_done(self) -> bool:
        """Whether this fit's final synchronization ran (at its last optimizer step, or at the end of training)."""
        return self._finished

    def _is_last_step(self) -> bool:
        """Whether the optimizer step just taken is ``fit``'s last (``max_steps``, or the last batch of the last
        epoch); Lightning counts the step in ``global_step`` only after it returns."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return False
        if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps:
            return True  # (below, inline, as callbacks.last_epoch and _compat.is_last_batch: this runs every step)
        return trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0 and \
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def _finish_training(self) -> None:
        """Once per fit (again after a step past it: two steps in the last batch): check that every rank ended (one
        with batches left is at its per-batch check, which this pairs with), then the final sync: one model."""
        if self.synchronizer is None or (self._finished and not self.synchronizer.mid_round):
            return
        self._finished = True
        trainer = self._trainer
        if self.world_size > 1 and trainer is not None and self.communicator is not None \
                and self.communicator.failure is None and not trainer.received_sigterm:
            self._sigterm_check(finished=True)
        self.core.finish()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._finished = False

    def on_train_end_sync(self) -> None:
        """The final synchronization, if the last step did not run it (a fit that ended otherwise): from the
        callbacks as soon as the end is known (``callbacks.final_sync``), else from the strategy's hooks."""
        with self._plugin_warnings:
            self._finish_training()

    @override
    def on_train_end(self) -> None:
        self.on_train_end_sync()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A fit that fails with a round in flight: its thread ends before the process tears the groups down (which
        would abort the process and hide the user's exception). One that fails in validation gets its replicas back."""
        if self.synchronizer is not None:
            self.synchronizer.let_in_flight_end()
        if self._swapped_for_eval:  # a validation that failed: the replicas back, so that a next fit swaps anew
            self._swap_model(synchronized=False)
            self._swapped_for_eval = False
        super().on_exception(exception)

    def groups_to_release(self) -> Optional[list[Any]]:
        """At the exit (:mod:`lightning_lordo.comm.groups`): the side groups (the per-batch checks', the overlapped
        rounds'), once the round in flight's thread has ended."""
        if not self.core.round_ended():
            return None
        control = getattr(self, "_control_comm", None)
        return [self._overlap_group, control.group if control is not None else None]

    @override
    def teardown(self) -> None:
        """A fit that ran no training loop (resumed at ``max_steps``, its ``max_time`` spent) has its final sync here,
        before Lightning moves the model to the CPU; an anchor in accelerator memory (``anchor_device="param"``) then
        moves to host memory: a checkpoint saved after ``fit`` still has it."""
        state = self._trainer.state if self._trainer is not None else None
        if state is not None and state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING:
            self.on_train_end_sync()
        if self.synchronizer is not None:
            self.synchronizer.anchor.tensors = [t.cpu() for t in self.synchronizer.anchor.tensors]
        super().teardown()
