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

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lordo._tensors import nbytes
from lightning_lordo.checks import check_choice
from lightning_lordo.comm.communicator import CommAccountant, Communicator, joining, side_communicator
from lightning_lordo.config import OPTIMIZER_DEFAULTS, SyncConfig
from lightning_lordo.lightning.callbacks import add_monitor
from lightning_lordo.lightning.checkpoint import AtomicCheckpointIO
from lightning_lordo.lightning.collectives import GuardedCollectives
from lightning_lordo.lightning.convert import (
    DEFAULT_FULL_RANK_PARAMS,
    check_initialized,
    compile_patterns,
    convert_optimizer,
    full_rank_params,
    plan_message,
    repoint_schedulers,
    scale_base_lrs,
    several_optimizers_message,
)
from lightning_lordo.lightning.lightning_optimizer import LoRDOLightningOptimizer
from lightning_lordo.lightning.saving import SynchronizedState
from lightning_lordo.lightning.user_warnings import PluginWarnings
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.strategy_knobs import LAUNCH_SUFFIXES, PRESETS, split_strategy_knobs
from lightning_lordo.sync.report import SyncReport
from lightning_lordo.sync.synchronizer import Synchronizer

DEFAULT_TIMEOUT = SyncConfig().timeout.total_seconds()


class LoRDOStrategy(SynchronizedState, GuardedCollectives, DDPStrategy):
    """Local LoRDO steps with a low-rank synchronization every ``sync_every`` optimizer steps.

    Every knob is a named argument (LightningCLI and YAML configs set them by name). The optimizer knobs are the
    defaults of :class:`~lightning_lordo.LoRDO` for the user's converted Adam/AdamW; the synchronization knobs
    are :class:`~lightning_lordo.SyncConfig`'s. A knob left at its default that the others make meaningless is
    fine; one set to another value is refused (nothing is silently ignored).

    Args:
        sync_every: K, optimizer steps between synchronizations.
        lowrank: convert the user's Adam/AdamW into LoRDO, or (``False``: DiLoCo) keep any optimizer and sync.
        full_rank_params: regexes on parameter names to run AdamW, besides the embeddings and heads found.
        monitor: add a :class:`~lightning_lordo.CommunicationMonitor` unless the Trainer already has one.
        monitor_progress_bar: that monitor shows ``lordo/saving_vs_ddp`` in the progress bar (``null``: if shown).
        checkpoint_shards: each rank writes its state beside the checkpoint (``<file>.lordo-<id>/rank-<r>.pt``).
        start_method: how processes are launched: ``popen``, ``spawn``, ``fork`` or ``forkserver``, as in DDP.
        rank: rank r per matrix: an int >= 1, or a float in (0, 1] (a fraction of each matrix's smaller side).
        omega: weight of the low-rank term; 1 - omega weights the full-rank normalized term.
        update: ``lordo``, ``subspace_qh`` (no full-rank term) or ``unnormalized_lowrank`` (ablation).
        mu: scale of the full-rank term, or ``auto`` (both terms the same RMS every step).
        normalizer: full-rank normalizer: ``col_rms``, ``factored``, ``scalar``, ``lifted`` or ``mean_denom``.
        lifted_floor: for ``lifted``: the floor of S as a fraction of sqrt(mean(v_hat)).
        full_rank_input: ``gradient``, or ``accumulated`` (gradient + error feedback).
        projection: new bases by ``power`` iteration (warm-started), ``randomized`` SVD or exact ``svd``.
        power_iters, oversample: power steps of ``power`` and ``randomized``; the latter's extra columns.
        transition: moments on a basis change: ``rotate`` (LDAdam), ``reset`` or ``keep`` (ablation).
        variance_clamp: clamp the variance v_hat - u_hat^2 at 0 before rotating.
        error_feedback: keep what the projection drops in a full-size buffer per matrix.
        ef_dtype: dtype of that buffer: ``auto`` (bfloat16 on an accelerator), ``float32`` or ``bfloat16``.
        ef_decay, update_scale: ``"auto"`` (beta1; AdamW's LR carries over) or a number (see LoRDO).
        outer_optimizer: ``average`` or ``nesterov`` (DiLoCo's outer SGD).
        outer_lr, outer_momentum: learning rate and momentum of the Nesterov outer step.
        average_moments: average the low-rank moments at each sync.
        basis_scope: ``global`` (bases from the averaged pseudo-gradient) or ``local`` (each worker's own).
        initial_basis: first bases from the averaged first ``gradient``, or seeded ``random`` ones.
        payload, payload_dtype: ``full`` or ``lowrank`` (PowerSGD-style); ``float32``, ``bfloat16`` or ``int8``.
        broadcast_bases: compute the bases on rank 0 only and broadcast them.
        timeout: timeout of every collective, in seconds (1 s to one year) or a timedelta.
        seed: seed of random bases and randomized projections.
        average_fullrank_moments, average_error_feedback: also average the full-rank moments, or the EF buffers.
        warmup_steps: the first N optimizer steps synchronous (low-rank DDP), local steps after.
        synchronous: every step synchronous (``lowrank_ddp``); unset: the optimizer alone on one device.
        switch_betas: at the end of the warm-up, the optimizer's new betas (``null``: keep them).
        switch_reset_moments, switch_lr_scale: at the warm-up's end, zero the moments, or multiply the LR.
        anchor_device: where the anchor lives: ``auto`` (host memory on an accelerator), ``param`` or ``cpu``.
        fullrank_rank: rank of the full-rank 2-D parameters' pseudo-gradient messages (0: sent in full).
        moments_every: average the moments at every n-th sync only.
        basis_every: recompute the bases at every n-th sync only, from the pseudo-gradients summed since.
        overlap_steps: 0 (blocking syncs), or tau < sync_every: a round's collectives overlap tau local steps.
        max_skipped_syncs: consecutive non-finite rounds after which the run stops.
        bucket_cap_mb: the most pseudo-gradient (MB) a one-process sync holds at once.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend: as
            in Lightning's ``DDPStrategy`` (the checkpoint IO defaults to an atomic one).
    """

    strategy_name = "lordo"

    def __init__(
        self,
        sync_every: int = SyncConfig.sync_every,
        *,
        lowrank: bool = True,
        full_rank_params: Sequence[str] = DEFAULT_FULL_RANK_PARAMS,
        monitor: bool = True,
        monitor_progress_bar: Optional[bool] = None,
        checkpoint_shards: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        rank: Union[int, float] = OPTIMIZER_DEFAULTS["rank"],
        omega: float = OPTIMIZER_DEFAULTS["omega"],
        update: Literal["lordo", "subspace_qh", "unnormalized_lowrank"] = OPTIMIZER_DEFAULTS["update"],
        mu: Union[float, Literal["auto"]] = OPTIMIZER_DEFAULTS["mu"],
        normalizer: Literal["col_rms", "factored", "scalar", "lifted", "mean_denom"] = OPTIMIZER_DEFAULTS["normalizer"],
        lifted_floor: float = OPTIMIZER_DEFAULTS["lifted_floor"],
        full_rank_input: Literal["gradient", "accumulated"] = OPTIMIZER_DEFAULTS["full_rank_input"],
        projection: Literal["power", "randomized", "svd"] = OPTIMIZER_DEFAULTS["projection"],
        power_iters: int = OPTIMIZER_DEFAULTS["power_iters"],
        oversample: int = OPTIMIZER_DEFAULTS["oversample"],
        transition: Literal["rotate", "reset", "keep"] = OPTIMIZER_DEFAULTS["transition"],
        variance_clamp: bool = OPTIMIZER_DEFAULTS["variance_clamp"],
        error_feedback: bool = OPTIMIZER_DEFAULTS["error_feedback"],
        ef_dtype: Literal["auto", "float32", "bfloat16"] = OPTIMIZER_DEFAULTS["ef_dtype"],
        ef_decay: Union[float, Literal["auto"]] = OPTIMIZER_DEFAULTS["ef_decay"],
        update_scale: Union[float, Literal["auto"]] = OPTIMIZER_DEFAULTS["update_scale"],
        outer_optimizer: Literal["average", "nesterov"] = SyncConfig.outer_optimizer,
        outer_lr: float = SyncConfig.outer_lr,
        outer_momentum: float = SyncConfig.outer_momentum,
        average_moments: bool = SyncConfig.average_moments,
        basis_scope: Literal["global", "local"] = SyncConfig.basis_scope,
        initial_basis: Literal["gradient", "random"] = SyncConfig.initial_basis,
        payload: Literal["full", "lowrank"] = SyncConfig.payload,
        payload_dtype: Literal["float32", "bfloat16", "int8"] = SyncConfig.payload_dtype,
        broadcast_bases: bool = SyncConfig.broadcast_bases,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT,
        seed: int = SyncConfig.seed,
        average_fullrank_moments: bool = SyncConfig.average_fullrank_moments,
        average_error_feedback: bool = SyncConfig.average_error_feedback,
        warmup_steps: int = SyncConfig.warmup_steps,
        synchronous: Optional[bool] = SyncConfig.synchronous,
        switch_betas: Optional[tuple[float, float]] = SyncConfig.switch_betas,
        switch_reset_moments: bool = SyncConfig.switch_reset_moments,
        switch_lr_scale: float = SyncConfig.switch_lr_scale,
        anchor_device: Literal["auto", "param", "cpu"] = SyncConfig.anchor_device,
        fullrank_rank: int = SyncConfig.fullrank_rank,
        moments_every: int = SyncConfig.moments_every,
        basis_every: int = SyncConfig.basis_every,
        overlap_steps: int = SyncConfig.overlap_steps,
        max_skipped_syncs: int = SyncConfig.max_skipped_syncs,
        bucket_cap_mb: float = SyncConfig.bucket_cap_mb,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[Any]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        **unknown: Any,
    ) -> None:
        given = dict(locals())
        known = [k for k in given if k not in ("self", "unknown", "__class__")]
        self.sync_config, optimizer_knobs = split_strategy_knobs(
            "LoRDOStrategy", {**{k: given[k] for k in known}, **unknown}, known, lowrank=lowrank,
            optimizer_source="the optimizer your configure_optimizers returns (and your LR schedulers keep driving lr)")
        for name, flag in (("lowrank", lowrank), ("monitor", monitor), ("checkpoint_shards", checkpoint_shards)):
            if not isinstance(flag, bool):
                raise ValueError(f"Invalid {name}={flag!r}: it must be True or False.")
        if monitor_progress_bar is not None and (not isinstance(monitor_progress_bar, bool) or not monitor):
            raise ValueError(f"Invalid monitor_progress_bar={monitor_progress_bar!r} with monitor={monitor!r}: it must "
                             "be None, True or False, and it configures the monitor the strategy adds (monitor=True).")
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        self._full_rank_patterns = compile_patterns(full_rank_params)
        self.optimizer_knobs = optimizer_knobs
        self.lowrank = lowrank
        self.monitor = monitor
        self.monitor_progress_bar = monitor_progress_bar
        self.checkpoint_shards = checkpoint_shards
        super().__init__(timeout=self.sync_config.timeout, start_method=start_method, accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend)
        self.accountant = CommAccountant()
        self.communicator: Optional[Communicator] = None
        self.synchronizer: Optional[Synchronizer] = None
        self.sync_reports: list[SyncReport] = []
        self.parameter_names: dict[Tensor, str] = {}
        self.ddp_bytes_per_step = 0  # what DDP's gradient all-reduce passes per worker and optimizer step
        self._swapped_for_eval = False
        self._restored: Optional[dict[str, Any]] = None
        self._restored_optimizer: Optional[dict[str, Any]] = None
        self._restored_names: Optional[list[str]] = None
        self._resume_notes: list[str] = []
        self._sigterm_pending = False  # a SIGTERM arrived; the next per-batch check tells every rank
        self._finished = False  # the final synchronization of this fit ran
        self._lordo_checkpoint = False
        self._reset_on_load = False
        self._plugin_warnings = PluginWarnings(lambda: self.global_rank)  # once, on rank 0, at the user's line

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (preset, description) in PRESETS.items():
            for suffix, start_method in LAUNCH_SUFFIXES:
                if name + suffix not in strategy_registry:
                    strategy_registry.register(name + suffix, cls, description=f"{description} ({start_method})",
                                               start_method=start_method, **preset)

    @override
    def setup_distributed(self) -> None:
        with joining(self.sync_config.timeout, "LoRDOStrategy"):  # a late worker's error names the knob
            super().setup_distributed()

    # ------------------------------------------------------------------ optimizers
    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        # Lightning wraps optimizers in LightningOptimizer here; ours counts steps and synchronizes.
        self._optimizers = optimizers
        self._lightning_optimizers = [LoRDOLightningOptimizer._to_lightning_optimizer(o, self) for o in optimizers]

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
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # lightning >= 2.5.2 runs it before every batch
            epoch_loop._broadcast_sigterm_tensor = self._sigterm_check
            # registered after Strategy.setup (Trainer._run), so the instance attribute is what gets registered
            trainer._signal_connector._sigterm_notifier_fn = self._sigterm_notifier
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
        self.accountant, self.sync_reports = CommAccountant(), []  # each fit counts its own traffic
        self.communicator = Communicator(self.accountant, self.sync_config.timeout)
        self._overlap_comm = side_communicator(self.accountant, self.sync_config.timeout) \
            if self.sync_config.overlap_steps and self.world_size > 1 else None
        self._setup_control()
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
        assert module is not None and self.communicator is not None
        self.parameter_names = {p: n for n, p in module.named_parameters()}
        user_optimizer = self.optimizers[0]
        optimizer = self._convert(user_optimizer, module) if self.lowrank else user_optimizer
        if optimizer is not user_optimizer:
            repoint_schedulers(self.lr_scheduler_configs, user_optimizer, optimizer)
            self.optimizers = [optimizer]
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.ddp_bytes_per_step = nbytes(trainable)
        self.synchronizer = Synchronizer(trainable, list(module.buffers()), optimizer, self.sync_config,
                                         self.communicator, self._overlap_comm)
        self.synchronizer.switch_callbacks.append(self._scale_schedulers)
        if self._restored is not None:
            self._apply_restored_state()
        if isinstance(optimizer, LoRDO):
            rank_zero_info(plan_message(optimizer, self.parameter_names))

    def _convert(self, optimizer: Optimizer, module: nn.Module) -> LoRDO:
        return convert_optimizer(optimizer, full_rank_params(module, self._full_rank_patterns), self.optimizer_knobs,
                                 self.sync_config.seed, self.parameter_names)

    def parameter_plan(self) -> list[dict[str, Any]]:
        """Which parameter takes the low-rank step and which takes AdamW, with names and reasons."""
        optimizer = self.optimizers[0] if self.optimizers else None
        if not isinstance(optimizer, LoRDO):
            return []
        return optimizer.describe(self.parameter_names)

    # ------------------------------------------------------------------ synchronization
    def before_optimizer_step(self) -> None:
        """Called by the LightningOptimizer after the backward pass of each optimizer step."""
        assert self.synchronizer is not None
        with self._plugin_warnings:
            self.synchronizer.before_optimizer_step()

    def _scale_schedulers(self) -> None:
        """At the switch: the LR schedulers' base LRs follow ``switch_lr_scale`` (the synchronizer scaled the
        param groups' learning rates)."""
        for config in self.lr_scheduler_configs:
            scale_base_lrs(config.scheduler, self.sync_config.switch_lr_scale)

    def after_optimizer_step(self) -> None:
        """Called by the LightningOptimizer after each optimizer step; the last one of ``fit`` runs the final sync,
        so the checkpoints Lightning writes at the end of ``fit`` hold the final synchronized model and buffers."""
        assert self.synchronizer is not None
        with self._plugin_warnings:
            last = self._is_last_step()
            if self.synchronizer.steps_since_sync + 1 >= self.sync_config.sync_every or last:
                self._check_synchronized_set()
            report = self.synchronizer.on_optimizer_step()
            if report is not None:
                self.sync_reports.append(report)
            if last:
                self._finish_training()

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
            return True
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs > 0
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def _finish_training(self) -> None:
        """Once per fit: check that every rank ended (one that still has batches is at its per-batch check, which
        this pairs with), then the final synchronization: training ends with one model, identical on all ranks."""
        if self._finished or self.synchronizer is None:
            return
        self._finished = True
        trainer = self._trainer
        if self.world_size > 1 and trainer is not None and self.communicator is not None \
                and self.communicator.failure is None and not trainer.received_sigterm:
            self._sigterm_check(finished=True)
        self.sync_reports += self.synchronizer.finish()

    def _check_synchronized_set(self) -> None:
        """Refuse parameters that became trainable after setup (e.g. unfrozen by a callback): they would train
        locally on every rank and never be averaged."""
        assert self.synchronizer is not None and self.lightning_module is not None
        known = {id(p) for p in self.synchronizer.params}
        new = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad and id(p) not in known]
        if new:
            raise RuntimeError(f"LoRDO synchronizes the parameters that were trainable when fit started, but {new[:5]} "
                               "became trainable later (unfrozen during fit); they would drift apart on every rank. "
                               "Unfreeze them before trainer.fit, or save a checkpoint and resume to include them.")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._finished = False

    @override
    def on_train_end(self) -> None:
        """The final synchronization, if the last step did not run it (a fit that ended otherwise)."""
        with self._plugin_warnings:
            self._finish_training()
        super().on_train_end()

    @property
    def ddp_equivalent_bytes(self) -> int:
        """Bytes DDP's gradient all-reduce would pass per worker for the optimizer steps taken so far, with more than
        one device (the monitor's ``lordo/ddp_equivalent_bytes`` and the summary count 0 on one device)."""
        steps = self.synchronizer.optimizer_steps if self.synchronizer is not None else 0
        return self.ddp_bytes_per_step * steps
