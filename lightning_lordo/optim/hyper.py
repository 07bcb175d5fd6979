"""The knobs one LoRDO step reads (:class:`Hyper`), and what ``ef_decay="auto"`` resolves to (:func:`auto_ef_decay`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import Tensor


@dataclass(frozen=True)
class Hyper:
    """The knobs of one param group that one step reads."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    omega: float
    update: str
    mu: Union[float, str]
    normalizer: str
    lifted_floor: float
    full_rank_input: str
    error_feedback: bool
    ef_decay: float  # "auto" resolved: :func:`auto_ef_decay`
    update_scale: Union[float, str]
    fullrank_state: str = "adamw"

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        decay = group["ef_decay"]
        return cls(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                   omega=group["omega"], update=group["update"], mu=group["mu"], normalizer=group["normalizer"],
                   lifted_floor=group["lifted_floor"], full_rank_input=group["full_rank_input"],
                   error_feedback=group["error_feedback"],
                   ef_decay=auto_ef_decay(beta1, group.get("refresh_interval")) if decay == "auto" else decay,
                   update_scale=group["update_scale"], fullrank_state=group["fullrank_state"])

    def scale(self, basis: Tensor) -> float:
        """The factor of this matrix's update (not of its weight decay): ``sqrt(a / r)`` for ``update_scale="auto"``
        (``basis``: ``a x r``, or a stack of them), else the number given."""
        if self.update_scale != "auto":
            return float(self.update_scale)
        a, r = basis.shape[-2:]
        return math.sqrt(a / r)


#: A param group's counters (Python ints, saved with its knobs): its steps since its low-rank bases last changed,
#: and the steps between its last two changes (0: fewer than two seen), which ``ef_decay="auto"`` reads.
REFRESH_COUNTERS = ("since_refresh", "refresh_interval")
#: The longest memory of ``ef_decay="auto"``, and its value while a matrix's basis has not changed yet.
AUTO_EF_DECAY_MAX = 0.99


def auto_ef_decay(beta1: float, refresh_interval: Optional[float]) -> float:
    """``ef_decay="auto"``: ``1 - 1/n`` for bases refreshed every ``n`` steps, clamped to ``[beta1, 0.99]``.

    The buffer then remembers about one basis interval: what the basis dropped during it, which the next basis
    (from that interval's pseudo-gradient) can take in. Remembered across several refreshes, stale directions fight
    each new basis (on a regression with bases every 4 or 8 steps, 0.95-0.99 stalls at 10-20x the optimum); with a
    fixed basis, or refreshes every 32 steps, 0.99 converges and keeps most of what the error feedback is for."""
    if not refresh_interval:
        return AUTO_EF_DECAY_MAX
    return min(AUTO_EF_DECAY_MAX, max(beta1, 1.0 - 1.0 / refresh_interval))


def start_counting(group: dict[str, Any]) -> None:
    """Give ``group`` its :data:`REFRESH_COUNTERS` (a new group, or one from a checkpoint older than them)."""
    for key in REFRESH_COUNTERS:
        group.setdefault(key, 0)


def record_refresh(groups: Sequence[dict[str, Any]]) -> None:
    """New bases in ``groups`` (each group once): the steps since the previous ones become its refresh interval."""
    for group in {id(g): g for g in groups}.values():
        if group["since_refresh"]:
            group["refresh_interval"], group["since_refresh"] = group["since_refresh"], 0
