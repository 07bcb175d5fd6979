"""``LoRDOStrategy``: Lightning's DDP strategy without the per-step gradient all-reduce.

Each rank trains its own replica with local LoRDO steps; every ``sync_every`` optimizer steps (and at the end
of ``fit``) the ranks synchronize (``lightning_lordo.sync``). The model is never wrapped in
``DistributedDataParallel``: parameters and buffers are broadcast from rank 0 once at setup, and each rank
draws its own data through Lightning's usual distributed sampler.

Validation during ``fit`` and every checkpoint see the *synchronized* model (the anchor), identical on all
ranks and free to produce; it lags the local replicas by the steps since the last sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lordo._tensors import nbytes
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import (
    OPTIMIZER_DEFAULTS,
    SyncConfig,
    check_choice,
    check_knob_combinations,
    check_optimizer_knobs,
    split_knobs,
)
from lightning_lordo.lightning import resume
from lightning_lordo.lightning.callbacks import CommunicationMonitor
from lightning_lordo.lightning.checkpoint import AtomicCheckpointIO
from lightning_lordo.lightning.collectives import GuardedCollectives
from lightning_lordo.lightning.convert import (
    DEFAULT_FULL_RANK_PARAMS,
    compile_patterns,
    convert_optimizer,
    full_rank_params,
    repoint_schedulers,
)
from lightning_lordo.lightning.lightning_optimizer import LoRDOLightningOptimizer
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.sync.synchronizer import Synchronizer, SyncReport

# Keys of torch.optim.Adam/AdamW param groups that LoRDO does not take (checked or dropped on conversion).


class LoRDOStrategy(GuardedCollectives, DDPStrategy):
    """Local LoRDO steps with a low-rank synchronization every ``sync_every`` optimizer steps.

    Args:
        sync_every: K, optimizer steps between synchronizations.
        lowrank: convert the user's Adam/AdamW into :class:`~lightning_lordo.LoRDO` (``True``), or keep the
            user's optimizer, whatever it is, and only synchronize (``False``: DiLoCo).
        full_rank_params: regular expressions on parameter names that run AdamW (embeddings always do).
        monitor: add a :class:`~lightning_lordo.CommunicationMonitor` unless the Trainer already has one.
        start_method: how processes are launched (``"popen"``, ``"spawn"``, ``"fork"``), as in DDP.
        **knobs: optimizer knobs of :class:`~lightning_lordo.LoRDO` (``rank``, ``omega``, ``mu``,
            ``normalizer``, ``projection``, ``transition``, ``error_feedback``, ...) used as defaults when the
            user's Adam/AdamW is converted, and synchronization knobs of
            :class:`~lightning_lordo.config.SyncConfig` (``outer_optimizer``, ``average_moments``,
            ``basis_scope``, ``initial_basis``, ``timeout``, ...). Remaining DDP arguments (``accelerator``,
            ``cluster_environment``, ``process_group_backend``, ...) are passed to ``DDPStrategy``.
    """

    strategy_name = "lordo"

    def __init__(
        self,
        sync_every: int = 16,
        *,
        lowrank: bool = True,
        full_rank_params: Sequence[str] = DEFAULT_FULL_RANK_PARAMS,
        monitor: bool = True,
        start_method: str = "popen",
        **knobs: Any,
    ) -> None:
        optimizer_knobs, sync_knobs, ddp_kwargs = split_knobs(knobs)
        ddp_allowed = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                       "precision_plugin", "process_group_backend"}
        unknown = set(ddp_kwargs) - ddp_allowed
        if unknown:
            raise TypeError(
                f"LoRDOStrategy got unknown arguments {sorted(unknown)}. Optimizer knobs: "
                f"{sorted(OPTIMIZER_DEFAULTS)}; sync knobs: {sorted(SyncConfig.__dataclass_fields__)}; "
                f"DDP arguments: {sorted(ddp_allowed)}."
            )
        from_user = sorted(set(optimizer_knobs) & {"lr", "betas", "eps", "weight_decay"})
        if from_user:
            raise ValueError(
                f"LoRDOStrategy got {from_user}: these come from the optimizer your configure_optimizers returns "
                "(and your LR schedulers keep driving lr). Set them there."
            )
        check_optimizer_knobs(optimizer_knobs, in_group=False)
        check_knob_combinations(optimizer_knobs, {**OPTIMIZER_DEFAULTS, **optimizer_knobs})
        self.sync_config = SyncConfig(sync_every=sync_every, **sync_knobs)
        if self.sync_config.payload == "lowrank" and lowrank is False:
            raise ValueError("Invalid payload='lowrank' with lowrank=False ('diloco'): the low-rank payload sends the "
                             "low-rank matrices of the LoRDO optimizer. Use payload='full' (payload_dtype may be "
                             "'bfloat16' or 'int8'), or a LoRDO preset.")
        for name, flag in (("lowrank", lowrank), ("monitor", monitor)):
            if not isinstance(flag, bool):
                raise ValueError(f"Invalid {name}={flag!r}: it must be True or False.")
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        self._full_rank_patterns = compile_patterns(full_rank_params)
        self.optimizer_knobs = optimizer_knobs
        self.lowrank = lowrank
        self.monitor = monitor
        ddp_kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())  # a failed save keeps the previous file
        super().__init__(timeout=self.sync_config.timeout, start_method=start_method, **ddp_kwargs)
        self.accountant = CommAccountant()
        self.communicator: Optional[Communicator] = None
        self.synchronizer: Optional[Synchronizer] = None
        self.sync_reports: list[SyncReport] = []
        self.parameter_names: dict[Tensor, str] = {}
        self._ddp_bytes_per_step = 0
        self._swapped_for_eval = False
        self._restored: Optional[dict[str, Any]] = None
        self._restored_optimizer: Optional[dict[str, Any]] = None
        self._restored_names: Optional[list[str]] = None
        self._resume_notes: list[str] = []
        self._sigterm_pending = False  # a SIGTERM arrived; the next per-batch check tells every rank
        self._lordo_checkpoint = False
        self._reset_on_load = False

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets = {
            "lordo": ({}, "LoRDO: global basis from the averaged pseudo-gradient + full-rank QHM term"),
            "lordo_local": ({"basis_scope": "local", "average_moments": False},
                            "LoRDO-Local: each worker computes its own basis"),
            "diloco": ({"lowrank": False}, "DiLoCo: the user's optimizer locally, averaged every K steps"),
            "lowrank_ddp": ({"synchronous": True}, "low-rank DDP: gradients averaged every step, LoRDO's low-rank "
                                                   "moments, bases from the averaged gradient every K steps"),
        }
        for name, (preset, description) in presets.items():
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                if name + suffix not in strategy_registry:
                    strategy_registry.register(name + suffix, cls, description=f"{description} ({start_method})",
                                               start_method=start_method, **preset)

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

        if self.monitor and not any(isinstance(c, CommunicationMonitor) for c in trainer.callbacks):
            trainer.callbacks.append(CommunicationMonitor())
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # lightning >= 2.5.2 runs it before every batch
            epoch_loop._broadcast_sigterm_tensor = self._sigterm_check
            # registered after Strategy.setup (Trainer._run), so the instance attribute is what gets registered
            trainer._signal_connector._sigterm_notifier_fn = self._sigterm_notifier
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: replicas start identical (broadcast from rank 0), then run free."""
        assert isinstance(self.model, LightningModule)
        if not self.model.automatic_optimization:
            raise RuntimeError(
                "LoRDOStrategy supports automatic optimization only (it synchronizes after each "
                "optimizer.step() Lightning makes). Set `self.automatic_optimization = True`, or use "
                "strategy='ddp' for manual optimization."
            )
        self.accountant, self.sync_reports = CommAccountant(), []  # each fit counts its own traffic
        self.communicator = Communicator(self.accountant, self.sync_config.timeout)
        state = list(self.model.parameters()) + list(self.model.buffers())
        self.communicator.broadcast([t.data for t in state], "setup_broadcast")

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # One optimizer: Lightning already refuses several under automatic optimization, and configure_ddp
        # refuses manual optimization.
        super().setup_optimizers(trainer)
        module = self.lightning_module
        assert module is not None and self.communicator is not None
        self.parameter_names = {p: n for n, p in module.named_parameters()}
        user_optimizer = self.optimizers[0]
        optimizer = self._convert(user_optimizer, module) if self.lowrank else user_optimizer
        if optimizer is not user_optimizer:
            repoint_schedulers(self.lr_scheduler_configs, user_optimizer, optimizer)
            self.optimizers = [optimizer]
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._ddp_bytes_per_step = nbytes(trainable)
        self.synchronizer = Synchronizer(trainable, list(module.buffers()), optimizer, self.sync_config,
                                         self.communicator)
        self.synchronizer.switch_callbacks.append(self._scale_schedulers)
        if self._restored is not None:
            self._apply_restored_state()
        if isinstance(optimizer, LoRDO):
            lowrank = sum(1 for row in optimizer.describe() if row["step"] == "lowrank")
            rank_zero_info(f"LoRDO: {lowrank} weight matrices take the low-rank step, "
                           f"{len(optimizer.describe()) - lowrank} tensors take AdamW "
                           "(strategy.parameter_plan() lists them).")

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
        self.synchronizer.before_optimizer_step()

    def _scale_schedulers(self) -> None:
        """At the switch: the LR schedulers' base LRs follow ``switch_lr_scale`` (the synchronizer scaled the
        param groups' learning rates)."""
        scale = self.sync_config.switch_lr_scale

        def scale_base_lrs(scheduler: Any) -> None:
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
            for inner in getattr(scheduler, "_schedulers", ()):
                scale_base_lrs(inner)

        if scale != 1.0:
            for config in self.lr_scheduler_configs:
                scale_base_lrs(config.scheduler)

    def after_optimizer_step(self) -> None:
        """Called by the LightningOptimizer after each optimizer step."""
        assert self.synchronizer is not None
        if self.synchronizer.steps_since_sync + 1 >= self.sync_config.sync_every:
            self._check_synchronized_set()
        report = self.synchronizer.on_optimizer_step()
        if report is not None:
            self.sync_reports.append(report)

    def _check_synchronized_set(self) -> None:
        """Refuse parameters that became trainable after setup (e.g. unfrozen by a callback): they would train
        locally on every rank and never be averaged."""
        assert self.synchronizer is not None and self.lightning_module is not None
        known = {id(p) for p in self.synchronizer.params}
        new = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad and id(p) not in known]
        if new:
            raise RuntimeError(
                f"LoRDO synchronizes the parameters that were trainable when fit started, but {new[:5]} became "
                "trainable later (unfrozen during fit); they would drift apart on every rank. Unfreeze them "
                "before trainer.fit, or save a checkpoint and resume to include them."
            )

    @override
    def on_train_end(self) -> None:
        """The final synchronization: training ends with one model, identical on all ranks (after checking that
        every rank ended: one that still has batches is at its per-batch check, which this pairs with)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.world_size > 1 and trainer is not None and self.communicator is not None \
                and self.communicator.failure is None and not trainer.received_sigterm:
            self._sigterm_check(finished=True)
        if self.synchronizer is not None and self.synchronizer.steps_since_sync > 0:
            self.sync_reports.append(self.synchronizer.sync())
        super().on_train_end()

    @property
    def ddp_equivalent_bytes(self) -> int:
        """Bytes DDP's gradient all-reduce would have passed for the optimizer steps taken so far."""
        steps = self.synchronizer.optimizer_steps if self.synchronizer is not None else 0
        return self._ddp_bytes_per_step * steps

    # ------------------------------------------------------------------ one model for evaluation and checkpoints
    def _mid_round(self) -> bool:
        return self.synchronizer is not None and self.synchronizer.steps_since_sync > 0

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._mid_round():
            assert self.synchronizer is not None
            self.synchronizer.anchor.swap_in()  # validate the synchronized model: identical on all ranks
            self._swapped_for_eval = True

    @override
    def on_validation_end(self) -> None:
        if self._swapped_for_eval:
            assert self.synchronizer is not None
            self.synchronizer.anchor.swap_out()
            self._swapped_for_eval = False
        super().on_validation_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self._mid_round() and not self._swapped_for_eval:
            assert self.synchronizer is not None
            anchor = {id(p): a for p, a in zip(self.synchronizer.params, self.synchronizer.anchor.tensors)}
            module = self.lightning_module
            assert module is not None
            for name, p in module.named_parameters(remove_duplicate=False):  # tied weights: every name
                if id(p) in anchor and name in state:
                    state[name] = anchor[id(p)].detach().clone()
        return state

    # ------------------------------------------------------------------ checkpoint state (see checkpoint.py)
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every rank gathers its local state to rank 0, which writes one file (a collective: all ranks call it)."""
        if self.synchronizer is not None and "optimizer_states" in checkpoint:  # not for save_weights_only
            swapped = self._swapped_for_eval
            if swapped:  # saved from within validation: put the local replica back while gathering it
                self.synchronizer.anchor.swap_out()
            # after a failed or interrupted collective (an emergency save) no rank can be waited for: rank 0 writes
            # what it has, and a resume starts every rank from it
            healthy = self.communicator is None or self.communicator.failure is None
            checkpoint["lordo"] = resume.gather_state(self, collective=healthy)
            if swapped:
                self.synchronizer.anchor.swap_in()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # applied after setup, when the synchronizer exists; validate/test/predict only need the model
        self._restored = checkpoint.get("lordo") if fitting else None
        self._restored_optimizer, self._lordo_checkpoint = None, False
        return checkpoint

    def _apply_restored_state(self) -> None:
        """The checkpoint's LoRDO state, after setup (the synchronizer exists): see ``resume.apply_restored``."""
        assert self._restored is not None and self.synchronizer is not None
        restored, self._restored = self._restored, None
        self._resume_notes = resume.apply_restored(self, restored)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        optimizer = self.optimizers[0]
        saved = self._restored_optimizer if self._restored_optimizer is not None else checkpoint["optimizer_states"][0]
        notes = list(self._resume_notes)
        if not self._lordo_checkpoint and isinstance(optimizer, LoRDO):
            notes.append("a checkpoint of another strategy (no LoRDO state): the full-rank parameters keep their Adam "
                         "moments, the low-rank matrices' moments restart in their new subspace")
        notes += resume.load_optimizer(optimizer, saved, self._restored_names, self.parameter_names)
        if self._reset_on_load:
            resume.reset_error_feedback(optimizer)
        resume.warn(notes, self.global_rank)
        self._restored_optimizer, self._restored_names, self._resume_notes = None, None, []
        self._lordo_checkpoint = self._reset_on_load = False
