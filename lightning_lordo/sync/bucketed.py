"""A blocking sync bucket by bucket (SPEC §4): the pseudo-gradient is never held whole.

The pseudo-gradient ``anchor - params`` is computed a bucket at a time (at most ``bucket_cap_mb`` of float32, the
low-rank matrices of one shape together, so that their bases are still one stacked computation). Each bucket is
averaged across the workers where it is, its norms kept, its bases computed, and the bucket is freed.

* **One process** (M = 1): the average is the worker's own, and plain averaging leaves the replica where it is. The
  sync only takes the replica as the new anchor and refreshes the bases. Nothing is compressed, averaged or
  broadcast (:meth:`~lightning_lordo.config.SyncConfig.alone`).
* **Several processes**, with a payload that is the exact float32 average (``payload="full"``, ``"float32"``; no
  error feedback to keep): the bucket's new synchronized point ``anchor - mean(delta)`` is computed in place and
  *staged* in the gradients of the step that syncs, which that step's update has consumed (the next backward
  zeroes them). The parameters, the anchor and the optimizer state change only at the commit, as on the general
  path, so a failed or interrupted round still leaves the worker as it was. The gradients of a step that syncs are
  released (``None``) after the round, failed or not; a parameter without a usable gradient (none, sparse, another
  dtype) stages its bucket's values in a tensor of its own.
* **Several processes with low-rank messages** (``payload="lowrank"``, bases from the average), when those matrices
  pass one bucket (:func:`streams`): each low-rank payload streams its round
  (:meth:`~lightning_lordo.comm.lowrank.LowRankPayload.phases`). The work ``delta + e`` (the pseudo-gradient plus the
  message's error feedback) is made a bucket at a time for the P message, again for the B message, and again at the
  commit, which writes the new error feedback and the new point ``anchor - Q B`` in place, bucket by bucket (the
  averaged update ``Q B`` is also made a bucket at a time here, for the norms and the new bases). The parameters sent
  in full (norms, biases; without ``fullrank_rank`` the embeddings and heads; low-rank matrices that their rank does
  not compress) take the general path's messages, whole. Three passes over the low-rank matrices instead of one:
  more dispatched ops (on GPT-2-small's shape, per bucket and matrix shape rather than per tensor) for a transient of
  two buckets plus the messages instead of about two models of float32; a ``bucket_cap_mb`` above the matrices'
  size keeps the round whole.

So the transient memory of a sync is at most two buckets (the bucket and the communicator's flat message) plus the
low-rank messages and, streamed, the parameters sent whole with their averages; at the commit, in the stacked
layout, the fold of unfolded error-feedback buffers holds one stack of products (at most ``STACK_BYTES``, 64 MB,
whatever ``bucket_cap_mb``). The result is an
:class:`~lightning_lordo.sync.exchange.Exchange` like the general path's (its ``averaged`` holds only the averages
made whole), committed by the same :meth:`Synchronizer.land`. On the CPU it is bit for bit the general path's
trajectory (tested, with 1 and 2 processes; with 3 or more, a ring all-reduce's order of summation follows an
element's place in the message, so other bucket boundaries change the last bits); on an accelerator a shape split
over several buckets is stacked in smaller batches, whose kernels may round differently in the last bits. Used
when the outer step is averaging, bases are refreshed at every sync (``basis_every=1``) and the sync blocks; with
several processes also only when the bases are computed everywhere (not ``broadcast_bases``) and the payload is the
float32 average (staged) or low-rank (streamed, whatever ``payload_dtype`` and ``fullrank_rank``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import are_finite, finite_flags, math_dtype, norm_list
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.config import SyncConfig
from lightning_lordo.sync import exchange as ex
from lightning_lordo.sync.payloads import FULLRANK_PART, LOWRANK_PART


def cap_applies(config: SyncConfig) -> bool:
    """Whether ``bucket_cap_mb`` shapes the blocking rounds of several processes under these knobs (the strategies
    refuse it otherwise): plain averaging, a refresh at every sync, no broadcast bases, and a low-rank payload (the
    cap says when it streams) or a float32 full payload without ``fullrank_rank``."""
    if config.outer_optimizer != "average" or config.basis_every != 1 or config.broadcast_bases:
        return False
    if config.payload == "lowrank":
        return config.basis_scope == "global"
    return config.payload_dtype == "float32" and config.fullrank_rank == 0


def applies(sync: Any) -> bool:
    """Whether ``sync`` (a :class:`~lightning_lordo.sync.synchronizer.Synchronizer`) takes this path now."""
    config = sync.config
    if not (config.outer_optimizer == "average" and config.basis_every == 1 and sync.params):
        return False
    return sync.comm.world_size == 1 or (cap_applies(config) and (config.payload == "full" or streams(sync)))


def streams(sync: Any) -> bool:
    """Whether this path streams the low-rank messages: several processes, ``payload="lowrank"``, bases computed
    everywhere from the average, and matrices with low-rank messages of more than one bucket of float32 (in one
    bucket, the general path's round holds no more than the two buckets that streaming would)."""
    config = sync.config
    if not (sync.comm.world_size > 1 and config.payload == "lowrank" and config.basis_scope == "global"
            and not config.broadcast_bases):
        return False
    size = sum(sync.params[i].numel() * 4 for _, positions, message, _ in sync.payloads.groups
               if isinstance(message, LowRankPayload) for i in positions)
    return size > config.bucket_cap_mb * 2**20


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


def first_bucket(sync: Any) -> list[int]:
    """The positions whose pseudo-gradients this path makes first, for :meth:`Anchor.prefetch` to stage during the
    syncing step's update: a bucket (none when streamed, whose first pseudo-gradients, taken whole, are no bucket)."""
    if streams(sync):
        return []
    lowrank = set(sync.lordo.lowrank_params()) if sync.lordo is not None else set()
    return buckets(sync.params, lowrank, sync.config.bucket_cap_mb * 2**20)[0]


def _eager(sync: Any) -> list[int]:
    """Streamed: the positions whose messages take their pseudo-gradients whole (not streamed)."""
    streamed = {i for _, positions, message, _ in sync.payloads.groups if isinstance(message, LowRankPayload)
                for i in positions}
    return [i for i in range(len(sync.params)) if i not in streamed]


@torch.no_grad()
def exchange(sync: Any) -> ex.Exchange:
    """The round, bucket by bucket (module docstring); one host read before the commit (whether it is finite). With
    several processes a failure releases the gradients that staged the round and propagates: nothing else changed."""
    if streams(sync):
        return _exchange_streamed(sync)
    try:
        return _exchange(sync)
    except BaseException:
        if sync.comm.world_size > 1:
            release_gradients(sync.params)
        raise


def _exchange(sync: Any) -> ex.Exchange:
    lordo, params, comm, config = sync.lordo, sync.params, sync.comm, sync.config
    several, local_bases = comm.world_size > 1, config.basis_scope == "local"
    lowrank = set(lordo.lowrank_params()) if lordo is not None else set()
    magnitudes: list[Any] = [None] * len(params)  # each parameter's norm, in the parameters' order
    staged: list[Optional[Tensor]] = [None] * len(params)  # several processes: each parameter's new point
    bases, seconds, failed = {}, 0.0, []
    order = buckets(params, lowrank, config.bucket_cap_mb * 2**20)
    for n, bucket in enumerate(order):
        # an anchor in host memory: the next bucket's copy runs while this one is worked on, staged once the device
        # holds one bucket besides it (several processes: after the average, whose flat message is another bucket)
        following = order[n + 1] if n + 1 < len(order) else []
        deltas = sync.anchor.deltas(indices=bucket)
        if not several:
            sync.anchor.prefetch(following)
        sources = {params[i]: d for i, d in zip(bucket, deltas) if params[i] in lowrank}
        if sources and (local_bases or not several):  # from this worker's own pseudo-gradient
            seconds += _add_bases(sync, bases, sources, failed)
        if several:
            comm.average_temporaries(deltas, LOWRANK_PART if params[bucket[0]] in lowrank else FULLRANK_PART)
            if sources and not local_bases:  # from the average
                seconds += _add_bases(sync, bases, sources, failed)
        for i, n in zip(bucket, norm_list(deltas)):
            magnitudes[i] = n
        if several:
            _stage(staged, bucket, params, sync.anchor.new_point(bucket, deltas))
            sync.anchor.prefetch(following)
        del deltas, sources
    magnitudes_all = torch.stack([m.to(magnitudes[0].device) for m in magnitudes])  # summed as the general path
    floating, others = ex.average_buffers(comm, sync.buffers)
    entries = sync.averaged_entries()
    finite = are_finite(magnitudes_all).all()
    buffers_finite = finite_flags(floating).all() if floating else torch.ones_like(finite)
    ok, buffers_ok, shares = ex.round_read(finite, buffers_finite, ex.holder_shares(comm, entries))  # the one read
    if not buffers_ok:  # identical on all workers: all repair them together
        floating = ex.repair_buffers(comm, sync.buffers)
    if not ok:  # identical on all workers: they all discard the round
        if several:
            release_gradients(params)
        return ex.Exchange([], [], (floating, others), finite=False)
    if failed:  # a finite round whose bases failed, as the general path's would: nothing has changed
        raise failed[0]
    state, checked, state_finite = ex.average_state(comm, entries, config, shares)
    order = [p for p in lordo.lowrank_params() if p in bases] if lordo is not None else []
    return ex.Exchange([], [], (floating, others), state, {p: bases[p] for p in order}, checked, state_finite,
                       torch.linalg.vector_norm(magnitudes_all), seconds,
                       staged=[s for s in staged if s is not None] if several else None)


def _exchange_streamed(sync: Any) -> ex.Exchange:
    """Several processes with low-rank messages: each low-rank payload streams its round
    (:meth:`~lightning_lordo.comm.lowrank.LowRankPayload.phases`), and the averaged updates ``Q B`` are made a bucket
    at a time here for their norms and the new bases, and again at the commit (:func:`commit_streamed`). The other
    messages (norms, biases) take their pseudo-gradients whole, as the general path does."""
    lordo, params, comm, config = sync.lordo, sync.params, sync.comm, sync.config
    lowrank = set(lordo.lowrank_params()) if lordo is not None else set()
    eager = _eager(sync)
    local: list[Optional[Tensor]] = [None] * len(params)
    for i, d in zip(eager, sync.anchor.deltas(indices=eager) if eager else []):
        local[i] = d
    # a bucket: the cap, or the largest of these matrices, which is a bucket of its own anyway (fewer, larger stacks)
    cap = max(config.bucket_cap_mb * 2**20, max(params[i].numel() for i in range(len(params)) if i not in eager) * 4)
    stream = (params, lambda idx: sync.anchor.deltas(indices=idx), cap)
    averaged, rounds, payload_finite = sync.payloads.reduce(comm, local, in_place=True, stream=stream)
    magnitudes_all = sync.payloads.norms(averaged, rounds)  # the streamed matrices' from their rounds, not Q B
    held = {params[i]: averaged[i] for i in eager if params[i] in lowrank}  # low-rank matrices sent in full
    bases, seconds, failed = {}, 0.0, []
    if lordo is not None:  # the payload's Q where it is the new basis, else (bucket by bucket) from Q B
        seconds += _add_bases(sync, bases, held, failed, sync.payloads.spans(params, rounds))
    for positions, phases in _streamed(sync, rounds):
        for bucket in phases.buckets:
            if not any(params[positions[j]] in lowrank and params[positions[j]] not in bases
                       for n in bucket for j in phases.units[n]):
                continue
            matrices, updates = phases.matrix_updates(bucket)
            sources = {params[positions[j]]: u for j, u in zip(matrices, updates)
                       if params[positions[j]] in lowrank and params[positions[j]] not in bases}
            seconds += _add_bases(sync, bases, sources, failed)
            del updates, sources
    floating, others = ex.average_buffers(comm, sync.buffers)
    entries = sync.averaged_entries()
    finite = are_finite(magnitudes_all).all()
    if payload_finite is not None:
        finite = finite & payload_finite.to(finite.device)
    buffers_finite = finite_flags(floating).all() if floating else torch.ones_like(finite)
    ok, buffers_ok, shares = ex.round_read(finite, buffers_finite, ex.holder_shares(comm, entries))  # the one read
    if not buffers_ok:  # identical on all workers: all repair them together
        floating = ex.repair_buffers(comm, sync.buffers)
    if not ok:  # identical on all workers: they all discard the round
        return ex.Exchange(averaged, rounds, (floating, others), finite=False)
    if failed:  # a finite round whose bases failed, as the general path's would: nothing has changed
        raise failed[0]
    sync.payloads.resolve(rounds, True)
    state, checked, state_finite = ex.average_state(comm, entries, config, shares)
    order = [p for p in lordo.lowrank_params() if p in bases] if lordo is not None else []
    return ex.Exchange(averaged, rounds, (floating, others), state, {p: bases[p] for p in order}, checked,
                       state_finite, torch.linalg.vector_norm(magnitudes_all), seconds, streamed=True)


def _streamed(sync: Any, rounds: Sequence[tuple[Any, Any]]) -> list[tuple[list[int], Any]]:
    """``(the group's parameter positions, its streamed phases)`` for each streamed round of ``rounds``."""
    positions = {id(message): at for _, at, message, _ in sync.payloads.groups}
    return [(positions[id(message)], result.streamed) for message, result in rounds
            if getattr(result, "streamed", None) is not None]


@torch.no_grad()
def commit_streamed(sync: Any, round_: ex.Exchange) -> None:
    """The commit of a streamed round (local, no collective): bucket by bucket, the payloads' error feedback and the
    new synchronized point ``anchor - Q B`` into the parameters and the anchor; then the other parameters'. It makes
    each bucket's work again: out of memory here, after earlier buckets are written, the round is half committed (as
    it is on every path if the rotation of the moments, which allocates too, runs out)."""
    pending: list[int] = []  # parameters that take their anchor's new values, in one copy at the end
    for positions, phases in _streamed(sync, round_.payload_rounds):
        for bucket in phases.buckets:
            matrices, updates = phases.commit_bucket(bucket)
            pending += _move(sync, [positions[j] for j in matrices], updates)
            del updates
    eager = [i for i, a in enumerate(round_.averaged) if a is not None]
    if eager:
        pending += _move(sync, eager, [round_.averaged[i] for i in eager])
    if pending:
        torch._foreach_copy_([sync.params[i] for i in pending], [sync.anchor.tensors[i] for i in pending])


def _move(sync: Any, at: list[int], updates: list[Tensor]) -> list[int]:
    """The anchor at positions ``at`` becomes ``anchor - update``: in place where it sits beside the parameters
    (``a - u`` is :func:`averaged_point`'s ``-(u - a)`` bit for bit), whose positions are returned for the caller to
    copy; else the anchor and the parameters are set as the general path sets them."""
    anchor = sync.anchor
    if not anchor.on_side:
        anchors, params = [anchor.tensors[i] for i in at], [sync.params[i] for i in at]
        if all(a.device == u.device == p.device and a.dtype == u.dtype for a, u, p in zip(anchors, updates, params)):
            torch._foreach_sub_(anchors, updates)
            return at
    anchor.set(anchor.new_point(at, updates), indices=at)
    return []


def _add_bases(sync: Any, bases: dict[Tensor, Tensor], sources: dict[Tensor, Tensor], failed: list[Exception],
               spans: Optional[dict[Tensor, Tensor]] = None) -> float:
    """New bases from ``sources`` (and ``spans``: :meth:`~lightning_lordo.optim.lordo.LoRDO.compute_bases`') into
    ``bases``; the seconds taken. They come before the round is known to be finite: an SVD of a non-finite source
    raises, which goes into ``failed``, for the caller to raise only if the round is kept (the general path computes
    its bases after that read)."""
    begin = time.perf_counter()
    try:
        bases.update(sync.lordo.compute_bases(sources, generation=sync.optimizer_steps, spans=spans))
    except torch.linalg.LinAlgError as error:
        failed.append(error)
    return time.perf_counter() - begin


def _stage(staged: list[Optional[Tensor]], bucket: list[int], params: Sequence[Tensor], new: list[Tensor]) -> None:
    """Keep the bucket's new points until the commit: in the parameters' gradients where they can hold them (one
    copy for the bucket), else as they are."""
    into, values = [], []
    for i, value in zip(bucket, new):
        grad = params[i].grad
        if grad is not None and grad.layout == torch.strided and grad.shape == params[i].shape \
                and grad.dtype == params[i].dtype and grad.device == params[i].device:
            into.append(grad)
            values.append(value)
            staged[i] = grad
        else:
            staged[i] = value
    if into:
        torch._foreach_copy_(into, values)


def release_gradients(params: Sequence[Tensor]) -> None:
    """The gradients of the step that synced staged its round (or hold part of a failed one): released."""
    for p in params:
        p.grad = None
