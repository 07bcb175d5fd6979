"""The end of the process groups: destroyed by one ``atexit`` handler, while the interpreter is still whole.

A gloo process group still alive when the interpreter finalizes can abort the process after a successful run
("terminate called without an active exception", SIGABRT): its threads still hold work whose tensors reference
Python objects (pytorch/pytorch#190489). Lightning destroys the default group at exit for NCCL only. The LoRDO
strategies run gloo groups of their own (the per-batch checks', the overlapped rounds'), and gloo is the default
group's backend on the CPU. So, at exit, each strategy that registered lets its round in flight end, then its side
groups are destroyed, then the default group.
"""

from __future__ import annotations

import atexit
import weakref
from contextlib import suppress
from typing import Any, Optional, Protocol

import torch.distributed as dist


class ReleasesGroups(Protocol):
    def groups_to_release(self) -> Optional[list[Any]]:
        """Its side process groups, once nothing of it is in a collective; ``None`` when a thread of it still is
        (past its timeout): destroying a group under it would abort the process, so nothing is destroyed."""


_owners: weakref.WeakSet[Any] = weakref.WeakSet()  # weak: a strategy is not kept alive until the exit
_registered = False


def destroy_at_exit(owner: ReleasesGroups) -> None:
    """Destroy ``owner``'s side groups, and then the default group, when the interpreter exits (once per owner)."""
    global _registered
    _owners.add(owner)
    if not _registered:
        atexit.register(_destroy_all)
        _registered = True


def _destroy_all() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    groups: list[Any] = []
    for owner in list(_owners):
        owned = owner.groups_to_release()
        if owned is None:
            return
        groups += [g for g in owned if g is not None]
    for group in groups:
        with suppress(ValueError, RuntimeError):  # destroyed already (the groups were made anew since)
            dist.destroy_process_group(group)
    with suppress(ValueError, RuntimeError):
        dist.destroy_process_group()
