"""Collectives that count what they send, and the communication model of SPEC §8.

Every byte the plugin puts on the wire goes through :class:`Communicator`, which counts the tensors it
passes to ``torch.distributed`` (numel x itemsize, per worker) under a *purpose* (``pseudo_gradients``,
``moments``, ``bases``, ``buffers``, ``setup_broadcast``, ...). With one process nothing travels, so
nothing is sent and nothing is counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_BUCKET_ELEMENTS = 32 * 1024 * 1024  # at most 128 MB of float32 per flattened all-reduce


class CommAccountant:
    """Bytes sent by this worker, by purpose: the current round and the running totals."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = defaultdict(int)
        self.round: dict[str, int] = defaultdict(int)

    def add(self, purpose: str, nbytes: int) -> None:
        self.totals[purpose] += nbytes
        self.round[purpose] += nbytes

    def start_round(self) -> None:
        """Start counting a new round (bytes sent between rounds stay in the totals only)."""
        self.round = defaultdict(int)

    def end_round(self) -> dict[str, int]:
        """Return the bytes of the round that just ended, by purpose, and start a new round."""
        finished = dict(self.round)
        self.round = defaultdict(int)
        return finished

    @property
    def total_bytes(self) -> int:
        return sum(self.totals.values())

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = defaultdict(int, state["totals"])


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: another worker died, hangs, or the network is down."""


class Communicator:
    """``all_reduce`` (mean) and ``broadcast`` over a process group, counted and bounded by a timeout.

    Args:
        accountant: where the bytes are counted.
        timeout: how long one collective may take before :class:`CollectiveTimeout` is raised.
        group: the process group (``None``: the default group).
    """

    def __init__(self, accountant: CommAccountant, timeout: timedelta, group: Optional[Any] = None) -> None:
        self.accountant = accountant
        self.timeout = timeout
        self.group = group
        self.context = "setup"  # named in timeout errors, e.g. "sync 12"

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def all_reduce_mean(self, tensors: Sequence[Tensor], purpose: str) -> None:
        """Average ``tensors`` across workers in place (flattened into buckets of one dtype and device)."""
        if self.world_size == 1 or not tensors:
            return
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._run(dist.all_reduce(flat, group=self.group, async_op=True), purpose, "all_reduce")
            self.accountant.add(purpose, flat.numel() * flat.element_size())
            flat.div_(self.world_size)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast(self, tensors: Sequence[Tensor], purpose: str, src: int = 0) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values. Counted on the sender only (it is what it sends)."""
        if self.world_size == 1:
            return
        for t in tensors:
            buffer = t if t.is_contiguous() else t.contiguous()
            self._run(dist.broadcast(buffer, src=src, group=self.group, async_op=True), purpose, "broadcast")
            if buffer is not t:
                t.copy_(buffer)
            if self.rank == src:
                self.accountant.add(purpose, t.numel() * t.element_size())

    def _run(self, work: Any, purpose: str, op: str) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as err:  # gloo and NCCL raise on timeout or when a peer is gone
            raise CollectiveTimeout(self._message(purpose, op, err)) from err
        if completed is False:
            raise CollectiveTimeout(self._message(purpose, op, None))

    def _message(self, purpose: str, op: str, err: Optional[BaseException]) -> str:
        why = f": {err}" if err is not None else ""
        return (
            f"LoRDO {self.context}: the {op} of {purpose} did not complete within the timeout of "
            f"{self.timeout} (another worker died, hangs or cannot be reached){why}. Raise it with "
            "LoRDOStrategy(timeout=...) if your syncs are legitimately slower."
        )


def _buckets(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each at most ``_BUCKET_ELEMENTS`` elements."""
    buckets: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (t.dtype, t.device)
        if not same_kind or size + t.numel() > _BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    return buckets


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Time of one ring all-reduce of ``nbytes`` (SPEC §8): ``2(M-1)/M * bytes/B + 2(M-1) * alpha``."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth_bytes_per_s + 2 * (workers - 1) * latency_s
