"""The LightningOptimizer the strategy puts around the user's optimizer: it counts optimizer steps and runs
the synchronization every ``sync_every`` of them.

Lightning calls ``LightningOptimizer.step`` exactly once per optimizer step (after gradient accumulation,
inside ``LightningModule.optimizer_step``), so counting here counts optimizer steps, not batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch.core.optimizer import LightningOptimizer

if TYPE_CHECKING:
    from lightning_lordo.strategy import LoRDOStrategy


class LoRDOLightningOptimizer(LightningOptimizer):
    """A :class:`~lightning.pytorch.core.optimizer.LightningOptimizer` that synchronizes every K steps."""

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        output = super().step(closure, **kwargs)  # the local step (SPEC §3), no communication
        strategy: LoRDOStrategy = self._strategy  # type: ignore[assignment]
        strategy.after_optimizer_step()
        return output
