"""What a synchronization did, per worker: the value the synchronizer returns and the monitor reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SyncReport:
    """What one synchronization (or one synchronous round of ``sync_every`` steps) did, per worker."""

    index: int
    step: int
    bytes_by_purpose: dict[str, int]
    seconds: float
    basis_seconds: float
    subspace_movement: Optional[float]
    pseudo_gradient_norm: Optional[float]
    skipped: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    wire_by_purpose: dict[str, int] = field(default_factory=dict)  # on the network, by the collectives' algorithms

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_purpose.values())
