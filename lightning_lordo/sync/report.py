"""What a synchronization did, per worker: the value the synchronizer returns and the monitor reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: The breakdown's categories: every part of these goes into the category; any other purpose is its own.
CATEGORIES = {
    "pseudo_gradients:lowrank": "lowrank_pseudo_gradients",
    "pseudo_gradients:fullrank": "fullrank_pseudo_gradients",
    "moments": "moments",
    "error_feedback": "moments",
    "fault_flags": "control",
    "lightning_sigterm_check": "control",
    "lightning_collectives": "control",
    "step_count_check": "control",
    "checkpoint": "control",
}


def breakdown(parts: dict[str, int]) -> dict[str, int]:
    """Bytes by category (:data:`CATEGORIES`): low-rank and full-rank pseudo-gradients, moments (with the averaged
    error feedback), control flags (the plugin's and Lightning's), and any other purpose (buffers, bases, gradients,
    initial gradients) under its own name."""
    out: dict[str, int] = {}
    for part, nbytes in parts.items():
        category = CATEGORIES.get(part, part.partition(":")[0])
        out[category] = out.get(category, 0) + nbytes
    return out


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
    # since the previous report, by part (``pseudo_gradients:lowrank``, ``fault_flags``, Lightning's flags, ...)
    bytes_by_part: dict[str, int] = field(default_factory=dict)
    wire_by_part: dict[str, int] = field(default_factory=dict)
    # the accountant's totals when the round ended (payload and wire, all purposes), so that two reports logged in
    # one batch (an overlapped landing and the final sync) each show their own; None: read the current totals
    total_bytes: Optional[int] = None
    total_wire_bytes: Optional[int] = None
    taken_at: Optional[int] = None  # the optimizer step the round took the replicas at (overlapped); None: ``step``

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_purpose.values())
