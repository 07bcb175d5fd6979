"""One process's sync: the basis refresh alone, bucket by bucket (SPEC §4 with M = 1).

With one worker the average of the pseudo-gradients is the worker's own, and plain averaging leaves the replica where
it is: the sync only takes the replica as the new anchor and refreshes the low-rank bases from ``anchor - params``.
Nothing is compressed, averaged or broadcast (:meth:`~lightning_lordo.config.SyncConfig.alone`). So the
pseudo-gradient is never held whole: it is computed a bucket at a time (at most ``bucket_cap_mb``, the low-rank
matrices of one shape together, so that their bases are still one stacked computation), its norms kept and its bases
computed, and the bucket is freed. The transient memory of a sync is one bucket plus the bases.

The result is an :class:`~lightning_lordo.sync.exchange.Exchange` like the general path's, committed by the same
:meth:`Synchronizer.land` (its ``averaged`` is empty: with the anchor taken as is, nothing reads it). On the CPU it is
bit for bit the general path's trajectory (tested); on an accelerator a shape split over several buckets is stacked
in smaller batches, whose kernels may round differently in the last bits. Used when the world size is 1, the outer
step is averaging, bases are refreshed at every sync (``basis_every=1``) and the sync blocks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_lordo._tensors import math_dtype, norms
from lightning_lordo.sync import exchange as ex


def applies(sync: Any) -> bool:
    """Whether ``sync`` (a :class:`~lightning_lordo.sync.synchronizer.Synchronizer`) takes this path now."""
    config = sync.config
    return (sync.comm.world_size == 1 and config.outer_optimizer == "average" and config.basis_every == 1
            and bool(sync.params))


def buckets(params: Sequence[Tensor], lowrank: set[Tensor], cap_bytes: float) -> list[list[int]]:
    """Positions of ``params`` in buckets of at most ``cap_bytes`` of float32 pseudo-gradient (a larger tensor is a
    bucket of its own): the low-rank matrices first, grouped by shape, dtype and device, then the others."""
    kinds: dict[Any, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        kinds[(p in lowrank, tuple(p.shape) if p in lowrank else (), p.dtype, p.device)].append(i)
    out: list[list[int]] = []
    for key in sorted(kinds, key=lambda k: not k[0]):  # the low-rank kinds first, in the parameters' order
        out.append([])  # a new bucket for every kind
        size = 0
        for i in kinds[key]:
            nbytes = params[i].numel() * torch.finfo(math_dtype(params[i].dtype)).bits // 8
            if out[-1] and size + nbytes > cap_bytes:
                out.append([])
                size = 0
            out[-1].append(i)
            size += nbytes
    return out


@torch.no_grad()
def exchange(sync: Any) -> ex.Exchange:
    """The round of one process, bucket by bucket (module docstring); one host read (whether it is finite)."""
    lordo, params = sync.lordo, sync.params
    lowrank = set(lordo.lowrank_params()) if lordo is not None else set()
    magnitudes: list[Any] = [None] * len(params)  # each parameter's norm, in the parameters' order
    bases, seconds = {}, 0.0
    for bucket in buckets(params, lowrank, sync.config.bucket_cap_mb * 2**20):
        deltas = sync.anchor.deltas(indices=bucket)
        for i, n in zip(bucket, norms(deltas).unbind(0)):
            magnitudes[i] = n
        sources = {params[i]: d for i, d in zip(bucket, deltas) if params[i] in lowrank}
        if sources:
            begin = time.perf_counter()
            bases.update(lordo.compute_bases(sources, generation=sync.optimizer_steps))
            seconds += time.perf_counter() - begin
        del deltas, sources
    magnitudes_all = torch.stack([m.to(magnitudes[0].device) for m in magnitudes])  # summed as the general path
    if not bool(magnitudes_all.isfinite().all()):  # the one read before the commit
        return ex.Exchange([], [], ([], []), finite=False)
    _, checked, state_finite = ex.average_state(sync.comm, sync.averaged_entries(), sync.config)
    order = [p for p in lordo.lowrank_params() if p in bases] if lordo is not None else []
    return ex.Exchange([], [], ([], []), {}, {p: bases[p] for p in order}, checked, state_finite,
                       torch.linalg.vector_norm(magnitudes_all), seconds)
