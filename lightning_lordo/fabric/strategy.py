"""``LoRDOFabricStrategy``: ``Fabric(strategy="lordo")`` for loops you write yourself.

The same local steps and periodic synchronization as the Trainer's :class:`~lightning_lordo.LoRDOStrategy`, built
on the same pieces (the knobs of :mod:`lightning_lordo.config`, the Adam/AdamW conversion, the
:class:`~lightning_lordo.comm.communicator.Communicator` and the :class:`~lightning_lordo.sync.synchronizer.
Synchronizer`). Fabric's own ``DDPStrategy`` keeps the launchers, the process group and the distributed sampler.

* ``fabric.setup(model, optimizer)`` broadcasts rank 0's parameters and buffers to every rank (unless a digest shows
  they are already identical) and returns the model
  *unwrapped*: there is no ``DistributedDataParallel``, so ``fabric.backward`` all-reduces nothing
  (``fabric.no_backward_sync`` is accepted and has nothing to skip). The user's Adam/AdamW becomes
  :class:`~lightning_lordo.LoRDO` (``lowrank=False``, the ``"diloco"`` preset: any optimizer, kept as it is), and
  an LR scheduler passed as ``scheduler=`` is re-pointed to it.
* every ``optimizer.step()`` of the optimizer ``fabric.setup`` returned goes through :meth:`optimizer_step`: the
  synchronizer's preparation after the backward pass (the gradient average in the synchronous phase, the first
  bases), the local step, then the step count and, every ``sync_every`` steps, the synchronization. A
  ``fabric.clip_gradients`` before the step sees what the step will use, as in the Trainer.
* the final synchronization is **the user's call**: ``fabric.strategy.finish()`` on every rank after the loop.
  Fabric has no end-of-training hook (it never calls ``Strategy.teardown``), so nothing runs it for you.
* ``overlap_steps``: the rounds overlap with local steps as under the Trainer (:mod:`lightning_lordo.sync.overlap`);
  ``finish()`` lands the round in flight first.
* :meth:`communication_summary` returns the byte figures of the Trainer's ``CommunicationMonitor``.

Only the plugin's collectives are counted; ``fabric.all_reduce``/``fabric.barrier`` calls of your own loop are not.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lordo.checks import check_choice
from lightning_lordo.comm.communicator import Communicator, joining, side_communicator
from lightning_lordo.comm.groups import destroy_at_exit
from lightning_lordo.config import SyncConfig
from lightning_lordo.convert import (
    check_initialized,
)
from lightning_lordo.core import HoldsCore, InCore, LoRDOCore
from lightning_lordo.fabric.checkpoint import SynchronizedCheckpoints
from lightning_lordo.lightning._compat import BackwardSyncControl, nccl_backstop
from lightning_lordo.strategy_knobs import (
    LAUNCH_SUFFIXES,
    NAMED_SYNC_KNOBS,
    NO_EXPERIMENTS,
    PRESETS,
    Experimental,
    resolve_knobs,
)
from lightning_lordo.sync.faults import guarded
from lightning_lordo.sync.report import SyncReport
from lightning_lordo.sync.synchronizer import Synchronizer

DEFAULT_TIMEOUT = SyncConfig().timeout.total_seconds()
#: The arguments of Fabric's ``DDPStrategy`` this strategy passes on (through ``**ddp``).
DDP_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision",
                 "process_group_backend")


class _NothingToSkip(BackwardSyncControl):
    """``fabric.no_backward_sync``: the backward pass never all-reduces here, so there is nothing to skip."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class LoRDOFabricStrategy(HoldsCore, SynchronizedCheckpoints, DDPStrategy):
    """Local steps with a low-rank synchronization every ``sync_every`` optimizer steps, for Lightning Fabric.

    It takes the arguments of :class:`~lightning_lordo.LoRDOStrategy`, with the same homes, meanings and checks,
    except ``monitor`` (Fabric has no callbacks: read ``strategy.accountant``) and the Trainer-only experimental
    knobs; ``**ddp`` holds Fabric's ``DDPStrategy`` arguments (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision``, ``process_group_backend``). The optimizer given to
    ``fabric.setup`` is converted (Adam/AdamW) or kept (a LoRDO; any optimizer with ``preset="diloco"``).
    """

    strategy_name = "lordo"
    module = InCore()  # the model whose optimizer is synchronized
    optimizer = InCore()  # LoRDO (or, with lowrank=False, the user's optimizer)

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
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        experimental: Experimental = NO_EXPERIMENTS,
        **ddp: Any,
    ) -> None:
        named = {k: v for k, v in locals().items() if k in NAMED_SYNC_KNOBS}  # the distribution knobs, by name
        knobs = resolve_knobs(
            "LoRDOFabricStrategy", preset=preset, named=named, optimizer=optimizer, experimental=experimental,
            misplaced={k: v for k, v in ddp.items() if k not in DDP_ARGUMENTS}, trainer_only=False,
            optimizer_source="the optimizer you pass to fabric.setup (and your LR scheduler keeps driving lr)")
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        self.preset = preset
        self.core = LoRDOCore(knobs, "Fabric(strategy='lordo')")
        super().__init__(accelerator=ddp.get("accelerator"), parallel_devices=ddp.get("parallel_devices"),
                         cluster_environment=ddp.get("cluster_environment"), checkpoint_io=ddp.get("checkpoint_io"),
                         precision=ddp.get("precision"), process_group_backend=ddp.get("process_group_backend"),
                         timeout=self.sync_config.timeout, start_method=start_method)
        self._backward_sync_control = _NothingToSkip()
        self.scheduler: Optional[Any] = None
        self._modules: list[nn.Module] = []  # set up by setup_module, in order
        self._prepared = False  # the synchronizer's preparation ran for the coming step (e.g. before clipping)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (_, description) in PRESETS.items():
            for suffix, start_method in LAUNCH_SUFFIXES:
                if name + suffix not in strategy_registry:
                    strategy_registry.register(name + suffix, cls, description=f"{description} ({start_method})",
                                               start_method=start_method, preset=name)

    # ------------------------------------------------------------------ Fabric's own collectives
    # bounded by the process group's timeout, a failure named as the strategy's own are (``core.guarded``)
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        guarded(self.communicator, "fabric.barrier", self.sync_config.timeout, lambda: super(
            LoRDOFabricStrategy, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return guarded(self.communicator, "fabric.broadcast", self.sync_config.timeout, lambda: super(
            LoRDOFabricStrategy, self).broadcast(obj, src))

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return guarded(self.communicator, "fabric.all_reduce", self.sync_config.timeout, lambda: super(
            LoRDOFabricStrategy, self).all_reduce(tensor, group, reduce_op))

    @override
    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        return guarded(self.communicator, "fabric.all_gather", self.sync_config.timeout, lambda: super(
            LoRDOFabricStrategy, self).all_gather(tensor, group, sync_grads))

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        nccl_backstop(self, self.sync_config.timeout)
        with joining(self.sync_config.timeout, "LoRDOFabricStrategy"):  # a late worker's error names the knob
            super().setup_environment()  # the process group, with the collectives' timeout
        self.communicator = Communicator(self.accountant, self.sync_config.timeout)
        if self.sync_config.overlap_steps and self.world_size > 1:  # every rank creates the side group together
            self.core.overlap_comm = side_communicator(self.accountant, self.sync_config.timeout)
        destroy_at_exit(self)  # the groups end while the interpreter is whole (comm.groups)

    def groups_to_release(self) -> Optional[list[Any]]:
        """At the exit (:mod:`lightning_lordo.comm.groups`): the side group, once the round in flight's thread has
        ended (a loop that failed leaves it in a collective)."""
        if not self.core.round_ended():
            return None
        return [self.core.overlap_comm.group] if self.core.overlap_comm is not None else []

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """No DistributedDataParallel: every rank starts from rank 0's parameters and buffers, then runs free."""
        assert self.communicator is not None, "setup_environment runs first (fabric.launch())"
        self.communicator.context = "setup"
        check_initialized(module)
        state = list(module.parameters()) + list(module.buffers())
        self.communicator.broadcast_unless_identical([t.data for t in state], "setup_broadcast")
        self._modules.append(module)
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            names = ", ".join(type(o).__name__ for o in optimizers)
            raise ValueError(
                f"Fabric(strategy='lordo') synchronizes one optimizer, but fabric.setup got {len(optimizers)} "
                f"({names}). Put every parameter into one optimizer (param groups may each set their own lr, "
                "weight_decay and rank), or use strategy='ddp'.")
        module = self.setup_module(module)
        return module, [self._attach(module, optimizers[0], scheduler, "fabric.setup got")], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers`` after ``fabric.setup_module``: the optimizer of the model that holds its
        parameters (a frozen teacher set up beside it is left alone)."""
        if not self._modules:
            raise RuntimeError("Fabric(strategy='lordo') synchronizes the optimizer with its model: set the model up "
                               "first (model = fabric.setup_module(model), then fabric.setup_optimizers(optimizer)), "
                               "or both at once with fabric.setup(model, optimizer).")
        held = {p for g in optimizer.param_groups for p in g["params"]}
        owner = next((m for m in reversed(self._modules) if held <= set(m.parameters())), self._modules[-1])
        return self._attach(owner, optimizer, None,  # no owner: the core's check names the strays
                            f"fabric.setup_optimizers got (for the last of the {len(self._modules)} model(s) set up)")

    def _attach(self, module: nn.Module, user_optimizer: Optimizer, scheduler: Optional[Any],
                source: str) -> Optimizer:
        """The optimizer LoRDO steps (converted) and the synchronizer over the module's trainable parameters."""
        if self.synchronizer is not None:
            raise ValueError("Fabric(strategy='lordo') synchronizes one model with one optimizer, and one is set up "
                             "already. Put every parameter into that optimizer (one model, several param groups), "
                             "or use strategy='ddp'.")
        if getattr(self.precision, "scaler", None) is not None:
            raise RuntimeError("Fabric(strategy='lordo') does not support precision='16-mixed': its gradient scaler "
                               "skips optimizer steps on the ranks whose own gradients overflow, so the workers' step "
                               "counts would diverge. Use precision='bf16-mixed' (no scaler) or '32-true'.")
        configs = [SimpleNamespace(scheduler=scheduler)] if scheduler is not None else []
        if scheduler is None and self.sync_config.switch_lr_scale != 1.0:  # the scale would last one step
            rank_zero_warn(f"switch_lr_scale={self.sync_config.switch_lr_scale} scales the learning rate at the end "
                           "of the warm-up; an LR scheduler of yours would set it back at its next step. Pass it: "
                           "fabric.setup(model, optimizer, scheduler=scheduler) (setup_optimizers takes none), and "
                           "its base LRs are scaled too.")
        optimizer = self.core.attach(module, user_optimizer, configs, source, self._scale_scheduler)
        self.scheduler = scheduler
        message = self.core.plan_message()
        if message:
            rank_zero_info(message)
        return optimizer

    def _scale_scheduler(self) -> None:
        self.core.scale_schedulers([self.scheduler] if self.scheduler is not None else [],
                                   self.sync_config.switch_lr_scale)

    # ------------------------------------------------------------------ the step
    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self._prepared = False  # new gradients: the next clip or step prepares them (a skipped step's did not count)
        super().backward(tensor, module, *args, **kwargs)

    def _prepare(self) -> None:
        """Once per optimizer step, after the backward pass: the gradient average (synchronous phase), first bases."""
        if not self._prepared:
            self.core.before_step()
            self._prepared = True

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The local step of the synchronized optimizer, then the step count and every ``sync_every`` steps the
        synchronization (every rank takes part). Other optimizers step as in DDP."""
        if self.synchronizer is None or optimizer is not self.optimizer:
            return super().optimizer_step(optimizer, **kwargs)
        closure = kwargs.get("closure")
        if closure is not None:  # the closure runs the backward pass inside step()

            def backward_then_prepare() -> Any:
                output = closure()
                self._prepare()
                return output

            kwargs["closure"] = backward_then_prepare
        else:
            self._prepare()
        output = super().optimizer_step(optimizer, **kwargs)
        self._prepared = False
        self.core.after_step()
        return output

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        if optimizer is self.optimizer:
            self._prepare()  # clip what the step will use (the averaged gradient in the synchronous phase)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        if optimizer is self.optimizer:
            self._prepare()
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ the end, and the figures
    def finish(self) -> Optional[SyncReport]:
        """The final synchronization: call it on every rank after the training loop (Fabric has no hook that would).

        First every rank's optimizer step count is compared (one small counted all-reduce): ranks that took
        different numbers of steps raise here, together, instead of pairing mismatched collectives. Then a round in
        flight (``overlap_steps``) lands, and if any local step was taken since, one more (blocking) round runs.
        Afterwards every rank holds the same model. Training may go on after it (it is a synchronization like the
        others).

        Returns:
            The last round's report, or ``None`` when the ranks were already synchronized.
        """
        synchronizer = self._require_setup("finish()")
        assert self.communicator is not None
        steps = float(synchronizer.optimizer_steps)
        counts = torch.tensor([steps, steps * steps], dtype=torch.float64, device=self.root_device)
        self.communicator.context = "finish(): the step-count check"
        self.communicator.all_reduce_mean([counts], "step_count_check", in_round=False)
        mean, mean_square = counts.tolist()
        # equal counts give a variance of exactly 0; one rank a step off gives (M - 1) / M^2 (float64 holds them)
        if mean_square - mean * mean > 0.5 / self.world_size**2:  # the same decision on every rank
            raise RuntimeError(
                f"LoRDO finish(): the ranks took different numbers of optimizer steps (this rank {int(steps)}, the "
                f"mean {mean:g}). Every rank must call optimizer.step() equally often: give every rank the same "
                "number of batches (fabric.setup_dataloaders adds a DistributedSampler; use drop_last=True).")
        reports = self.core.finish()
        return reports[-1] if reports else None

    def communication_summary(self) -> dict[str, Any]:
        """This rank's figures so far (:meth:`~lightning_lordo.core.LoRDOCore.summary`, the convention of the
        Trainer's end-of-fit table): ``bytes_sent_total``, ``bytes_by_purpose``, ``ddp_equivalent_bytes``,
        ``bytes_saving_vs_ddp`` (``None`` on one device), the wire bytes, ``syncs``, ``skipped_syncs``,
        ``optimizer_steps``, ``steps_since_sync``, ``round_in_flight`` (``overlap_steps``: a round launched and not
        landed yet), the mean sync time, the memory lines and ``world_size``."""
        return self.core.summary(self.world_size)

    def _require_setup(self, what: str) -> Synchronizer:
        if self.synchronizer is None:
            raise RuntimeError(f"LoRDO {what} needs a model and optimizer set up first: "
                               "model, optimizer = fabric.setup(model, optimizer).")
        return self.synchronizer
