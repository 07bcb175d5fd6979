"""The LightningOptimizer the strategy puts around the user's optimizer: it drives the synchronizer around each
optimizer step.

Lightning calls ``LightningOptimizer.step`` exactly once per optimizer step (after gradient accumulation,
inside ``LightningModule.optimizer_step``), so counting here counts optimizer steps, not batches. The closure
it receives runs the forward and backward passes; Lightning's precision plugin then calls the
``on_before_optimizer_step`` hooks and clips the gradients. The wrapper runs the synchronizer's
``before_optimizer_step`` right after the backward pass, so clipping and those hooks see what the optimizer
will use: in the synchronous phase the averaged gradient (as with DDP), and the first bases are in place
before the first update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_lordo.lightning._compat import strategy_of


class StepDriver(Protocol):
    """What the wrapper needs of its strategy (``LoRDOStrategy``): a hook after the backward pass, one after the
    optimizer step."""

    def before_optimizer_step(self) -> None: ...

    def after_optimizer_step(self) -> None: ...


class LoRDOLightningOptimizer(LightningOptimizer):
    """A :class:`~lightning.pytorch.core.optimizer.LightningOptimizer` that drives LoRDO's synchronization."""

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        strategy: StepDriver = strategy_of(self)

        def backward_then_prepare() -> Any:
            output = closure() if closure is not None else None
            strategy.before_optimizer_step()  # gradient average (synchronous phase), first bases
            return output

        output = super().step(backward_then_prepare, **kwargs)  # the local step (SPEC §3)
        strategy.after_optimizer_step()  # counts the step; every K steps the sync
        return output
