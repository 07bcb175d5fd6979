"""A param group's basis-refresh counters, which ``ef_decay="auto"`` reads
(:func:`~lightning_lordo.optim.functional.auto_ef_decay`; the knobs one step reads are
:class:`~lightning_lordo.optim.functional.Hyper`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A param group's counters (Python ints, saved with its knobs): its steps since its low-rank bases last changed,
#: and the steps between its last two changes (0: fewer than two seen), which ``ef_decay="auto"`` reads.
REFRESH_COUNTERS = ("since_refresh", "refresh_interval")


def start_counting(group: dict[str, Any]) -> None:
    """Give ``group`` its :data:`REFRESH_COUNTERS` (a new group, or one from a checkpoint older than them)."""
    for key in REFRESH_COUNTERS:
        group.setdefault(key, 0)


def record_refresh(groups: Sequence[dict[str, Any]]) -> None:
    """New bases in ``groups`` (each group once): the steps since the previous ones become its refresh interval."""
    for group in {id(g): g for g in groups}.values():
        if group["since_refresh"]:
            group["refresh_interval"], group["since_refresh"] = group["since_refresh"], 0
