"""The process groups end at the interpreter's exit, while it is whole (``lightning_lordo.comm.groups``): a gloo
group left to the interpreter's finalization can abort a process that trained successfully (SIGABRT, "terminate
called without an active exception"; seen once in CI, in ``test_launch.py``'s torchrun run)."""

from __future__ import annotations

import functools
import gc
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from lightning_lordo.comm import groups
from tests.strategy_helpers import gloo_worker, run_fork_job


class _Owner:
    def __init__(self, owned: Optional[list[Any]]) -> None:
        self.owned = owned
        self.asked = 0

    def groups_to_release(self) -> Optional[list[Any]]:
        self.asked += 1
        return self.owned


def _body(busy: bool, rank: int, world: int) -> dict[str, Any]:
    side = dist.new_group(backend="gloo")
    owner = _Owner(None if busy else [side, None])
    groups.destroy_at_exit(owner)
    groups.destroy_at_exit(owner)  # once per owner
    gone = _Owner([])
    groups.destroy_at_exit(gone)
    del gone
    gc.collect()  # the registry does not keep a strategy (and its model) alive until the exit
    owners = len(groups._owners)
    destroyed: list[str] = []
    real = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        destroyed.append("side" if group is side else "default" if group is None else "other")
        real(group)

    dist.destroy_process_group = destroy
    try:
        groups._destroy_all()  # what the atexit handler runs
    finally:
        dist.destroy_process_group = real
    out: dict[str, Any] = {"owners": owners, "asked": owner.asked, "registered": groups._registered,
                           "initialized": dist.is_initialized(), "destroyed": destroyed}
    if busy:  # nothing destroyed: both groups still carry collectives
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t, group=side)
        out["side_sum"] = float(t)
        dist.all_reduce(t)
        out["default_sum"] = float(t)
    return out


@pytest.mark.parametrize("busy", [False, True], ids=["released", "thread-in-collective"])
def test_groups_destroyed_at_exit(tmp_path: Path, busy: bool) -> None:
    results = run_fork_job(functools.partial(gloo_worker, body=functools.partial(_body, busy)), 2, tmp_path, 60)
    for r in results:
        assert r["owners"] == 1 and r["asked"] == 1 and r["registered"]
        if busy:
            assert r["initialized"] and r["destroyed"] == [] and r["side_sum"] == 3.0 and r["default_sum"] == 6.0
        else:  # the side group first, then the default group
            assert not r["initialized"] and r["destroyed"] == ["side", "default"]
