"""What a Lightning user would pick instead of LoRDO: DDP with PyTorch's PowerSGD or fp16 communication hook.

Lightning's ``DDPStrategy`` registers a ``ddp_comm_hook`` on CUDA only (on CPU it is silently ignored), so
:class:`HookedDDP` registers the hook itself once the model is wrapped. Everything the gradients need goes into one
bucket (``bucket_cap_mb`` large): with several buckets PowerSGD on gloo may issue its all-reduces in a different
order per rank (pytorch/pytorch#58467).

Bytes are counted the way the plugin counts its own: the tensors handed to ``torch.distributed.all_reduce``
(numel x itemsize, per worker), summed over the training batches. The hooks call ``dist.all_reduce`` from
Python (PowerSGD: the uncompressed tensors, then P, then Q; fp16: the bucket in float16), partly from future
callbacks on another thread, so :class:`AllReduceCounter` wraps ``dist.all_reduce`` itself while a training batch
runs, rather than the hook function. Validation's metric reductions fall outside the training batches.
"""

from __future__ import annotations

import threading
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

HOOKS = ("powersgd", "fp16")


class AllReduceCounter(L.Callback):
    """Counts the bytes this worker hands to ``dist.all_reduce`` during training batches."""

    def __init__(self) -> None:
        self.total = 0
        self._active = False
        self._lock = threading.Lock()
        self._original = None

    def _count(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if self._active:
            with self._lock:
                self.total += tensor.numel() * tensor.element_size()
        return self._original(tensor, *args, **kwargs)

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._original = dist.all_reduce
        dist.all_reduce = self._count  # the hooks look it up at call time: ``dist.all_reduce(...)``

    def on_train_batch_start(self, *args: Any) -> None:
        self._active = True

    def on_train_batch_end(self, *args: Any) -> None:
        self._active = False

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        dist.all_reduce = self._original


class HookedDDP(DDPStrategy):
    """Lightning's DDP (fork launcher, one gradient bucket) with PowerSGD (``hook="powersgd"``, rank ``rank``,
    error feedback and warm start, compressing from the second step) or the fp16 compression hook."""

    def __init__(self, hook: str, rank: int = 4, **kwargs: Any) -> None:
        if hook not in HOOKS:
            raise ValueError(f"hook={hook!r}: choose one of {HOOKS}")
        super().__init__(start_method="fork", bucket_cap_mb=1024, **kwargs)
        self.hook, self.rank = hook, rank
        self.counter = AllReduceCounter()

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.hook == "powersgd":
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=self.rank,
                                           start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            self.model.register_comm_hook(state, powersgd.powerSGD_hook)
        else:
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
