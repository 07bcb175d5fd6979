"""One round of the ``lowrank`` payload between its messages (:class:`~lightning_lordo.comm.lowrank.LowRankPayload`
holds the payload's state and its docstring the math): the work ``D_m + e_m`` per unit of matrices, the P and B
messages, and the round that the payload commits. A streamed round makes the work again, a bucket at a time, for
each message and at the caller's commit, and never holds it whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_lordo._tensors import canonical, finite_flags, is_tall, math_dtype, matmul, orthonormalize_each
from lightning_lordo.comm.quantization import QuantizedMean

#: A streamed round's pseudo-gradients: ``source(indices)`` makes those matrices' deltas (original orientation).
Source = Callable[[list[int]], list[Tensor]]


@dataclass
class LowRankRound:
    """One round of :class:`LowRankPayload` (nothing of the payload changed yet: see ``commit``).

    Attributes:
        finite: whether the averaged P and B are finite (identical on all ranks): a 0-d bool tensor, not read
            (a synchronizer combines it with its other checks into one host read and may set a ``bool``). If not, the
            round must be discarded (its ``averaged`` may still look finite, e.g. after an overflow of P) and
            ``commit`` is a no-op.
        averaged: per matrix, the applied averaged update ``Q B`` (float32, original orientation).
        bases: per matrix, ``Q`` (float32, ``a x r``, canonical orientation), bitwise identical on all ranks.
        traffic: bytes counted, by collective kind (two collectives).
        errors: per matrix, the sync-level error feedback ``commit`` installs (canonical; empty without error
            feedback).
        right: per matrix, the right factor ``R = orth(B^T)`` (``b x r``) ``commit`` installs.
        streamed: a streamed round's phases (:meth:`LowRankPayload.phases`): ``averaged`` and ``errors`` are empty,
            and :meth:`LowRankPhases.commit_bucket` makes them, bucket by bucket, before ``commit``.
        norms: per matrix, the norm of its applied update, ``|Q B| = |B|`` (``Q`` orthonormal): float32 0-d
            tensors, not read, and made without ``Q B``.
    """

    finite: Union[bool, Tensor]
    averaged: list[Tensor]
    bases: list[Tensor]
    traffic: dict[str, int]
    errors: list[Tensor] = field(default_factory=list)
    right: list[Tensor] = field(default_factory=list)
    version: int = -1
    streamed: Optional[LowRankPhases] = None
    norms: list[Tensor] = field(default_factory=list)


class LowRankPhases:
    """One round of a :class:`LowRankPayload` between its messages (:meth:`LowRankPayload.phases`). Streamed, the
    work ``D_m + e_m`` is made again bucket by bucket for each message and at the commit, never held whole."""

    def __init__(self, payload: Any, deltas: Sequence[Tensor], source: Optional[Source] = None,
                 cap_bytes: Optional[float] = None) -> None:
        # the deltas' orientations and count, not the deltas: with error feedback they are free once the work is made
        self.payload, self.tall, self.count, self.source = payload, [is_tall(d) for d in deltas], len(deltas), source
        self.units = make_units(payload, deltas, cap_bytes)
        self.shapes = [(len(idx), *sorted(deltas[idx[0]].shape)) if idx.stacked
                       else tuple(sorted(deltas[idx[0]].shape)) for idx in self.units]  # canonical
        self.buckets = _buckets(self.units, deltas, cap_bytes) if source is not None \
            else [list(range(len(self.units)))]
        self.work = make_work(payload, deltas, self.units) if source is None else None
        rights = [_take(payload._right, idx, payload._right[idx[0]].device) for idx in self.units]
        # message 1: P_m^T = (D_m R)^T, r x a (so that each int8 scale covers one of the r directions)
        self.message: list[Tensor] = [None] * len(self.units)  # type: ignore[list-item]
        for bucket, work in self._each_bucket():
            messages = [_rows(_p_transposed(w, rights[n].to(w.device))) for n, w in zip(bucket, work)]
            for n, m in zip(bucket, messages):
                self.message[n] = m
            del work  # before the next bucket's is made

    def _each_bucket(self) -> Iterator[tuple[list[int], list[Tensor]]]:
        """``(unit numbers, their work)`` per bucket: the held work, or (streamed) made again from the source (the
        caller drops each bucket's work before the next)."""
        for bucket in self.buckets:
            yield bucket, [self.work[n] for n in bucket] if self.work is not None else self._bucket_work(bucket)

    def _bucket_work(self, bucket: Sequence[int]) -> list[Tensor]:
        """Streamed: the work of the units of ``bucket``, from their deltas made again (freed on return)."""
        indices = [i for n in bucket for i in self.units[n]]
        return make_work(self.payload, dict(zip(indices, self.source(indices))), [self.units[n] for n in bucket])

    @torch.no_grad()
    def take_p(self, p_msg: QuantizedMean, check: bool = True) -> None:
        """The bases from the averaged P; ``message`` becomes the B message. ``check=False``: the caller checks that
        P is finite (``finish``'s ``finite``)."""
        self.traffic = dict(p_msg.traffic)
        # no host read here: a non-finite P (identical on all ranks) is zeroed for the QR and flags the round
        self.p_finite = finite_flags(p_msg.means).all() if check else True
        self.bases = orthonormalize_each([torch.nan_to_num(_unrows(p, s), 0.0, 0.0, 0.0).mT
                                          for p, s in zip(p_msg.means, self.shapes)])
        # message 2: B_m = Q^T D_m, r x b
        for bucket, work in self._each_bucket():
            messages = [_rows(matmul(self.bases[n].mT, w)) for n, w in zip(bucket, work)]
            for n, m in zip(bucket, messages):
                self.message[n] = m
            del work  # before the next bucket's is made

    @torch.no_grad()
    def finish(self, b_msg: QuantizedMean, finite: Optional[Tensor] = None) -> LowRankRound:
        """The round, from the averaged B; ``finite``: whether P and B are finite, as the caller checked them.
        Streamed, the round holds no averages or error feedback (:meth:`commit_bucket`)."""
        payload, count, units, bases = self.payload, self.count, self.units, self.bases
        traffic = self.traffic
        for kind, sent in b_msg.traffic.items():
            traffic[kind] = traffic.get(kind, 0) + sent
        finite = self.p_finite & finite_flags(b_msg.means).all() if finite is None else finite
        self.b_means = [_unrows(b, s) for b, s in zip(b_msg.means, self.shapes)]
        self.sent = [_unrows(b, s) for b, s in zip(b_msg.sent, self.shapes)]
        right = _per_matrix(orthonormalize_each([b.mT for b in self.b_means]), units, count)
        norms = torch._foreach_norm(_per_matrix(self.b_means, units, count), 2, torch.float32) if count else []
        if self.work is None:
            return LowRankRound(finite, [], _per_matrix(bases, units, count), traffic, [], right, payload._version,
                                streamed=self, norms=list(norms))
        averaged = self.updates(range(len(units)))
        errors = []
        if payload.error_feedback and self.work:  # e_m = D_m + e_m - Q B_m, in place
            errors = self._fold(range(len(units)), self.work)
        return LowRankRound(finite, _per_matrix(averaged, units, count), _per_matrix(bases, units, count), traffic,
                            _per_matrix(errors, units, count), right, payload._version, norms=list(norms))

    def updates(self, bucket: Sequence[int]) -> list[Tensor]:
        """The applied averaged update ``Q B`` of each unit of ``bucket`` (float32, original orientation)."""
        out = []
        for n in bucket:
            q, b, idx = self.bases[n], self.b_means[n], self.units[n]
            tall = self.tall[idx[0]]
            if idx.stacked and tall:  # (Q B)^T as B^T Q^T: the original orientation with no transposed copy
                out.append(torch.bmm(b.mT, q.mT))
                continue
            update = matmul(q, b)
            out.append((update.mT if tall else update).contiguous())
        return out

    def _fold(self, bucket: Sequence[int], work: list[Tensor]) -> list[Tensor]:
        """``work`` (the units' ``D_m + e_m``) becomes the new error feedback ``D_m + e_m - Q B_m``, in place."""
        torch._foreach_sub_(work, [matmul(self.bases[n], self.sent[n]) for n in bucket])
        return work

    def matrix_updates(self, bucket: Sequence[int]) -> tuple[list[int], list[Tensor]]:
        """``(the matrices of the units of bucket, their applied averaged updates)``, one tensor per matrix."""
        return ([i for n in bucket for i in self.units[n]],
                [m for u, n in zip(self.updates(bucket), bucket) for m in _split(u, self.units[n])])

    @torch.no_grad()
    def commit_bucket(self, bucket: Sequence[int]) -> tuple[list[int], list[Tensor]]:
        """Streamed, at the caller's commit (the deltas still as the exchange saw them): the error feedback of the
        units of ``bucket`` written in place, then :meth:`matrix_updates`."""
        if self.payload.error_feedback:
            work = self._fold(bucket, self._bucket_work(bucket))
            torch._foreach_copy_([self.payload._errors[i] for n in bucket for i in self.units[n]],
                                 [m for w, n in zip(work, bucket) for m in _split(w, self.units[n])])
            del work
        return self.matrix_updates(bucket)


class Unit(list):
    """The positions of the matrices worked on together; ``stacked``: as one stack (``n x a x b``), even of one
    matrix (a piece of a shape's group split by the cap, whose products must round as the whole group's do)."""

    def __init__(self, positions: Sequence[int], stacked: bool) -> None:
        super().__init__(positions)
        self.stacked = stacked


def make_units(payload: Any, deltas: Sequence[Tensor], cap_bytes: Optional[float] = None) -> list[Unit]:
    """The matrices of ``payload`` worked on together: each alone, or (``batched``) those of one shape, rank, dtype
    and device stacked (at most ``cap_bytes`` of float32 each, or one matrix more rather than a stack of one, which
    costs ops; a matrix larger than half of it is a stack of its own). Held, with error feedback, a stack is no bound
    on memory: it is the round's ``D_m + e_m``, which becomes the error feedback, as the matrices' own tensors do
    (without, it is a copy of the deltas that the matrix-by-matrix path only views)."""
    if not payload.batched:
        return [Unit([i], False) for i in range(len(deltas))]
    groups: dict[tuple, list[int]] = {}
    for i, (d, r) in enumerate(zip(deltas, payload.ranks)):
        groups.setdefault((tuple(d.shape), r, math_dtype(d.dtype), d.device), []).append(i)
    units = []
    for idx in groups.values():
        fits = len(idx) if cap_bytes is None else max(1, int(cap_bytes // (deltas[idx[0]].numel() * 4)))
        pieces = [idx[k:k + fits] for k in range(0, len(idx), fits)]
        if fits > 1 and len(pieces) > 1 and len(pieces[-1]) == 1:
            last = pieces.pop()
            pieces[-1] = pieces[-1] + last
        units += [Unit(piece, len(idx) > 1) for piece in pieces]
    return units


def make_work(payload: Any, deltas: Any, units: list[Unit]) -> list[Tensor]:
    """Per unit of ``payload``, ``D_m + e_m`` (canonical orientation, float32): new tensors, which only the error
    feedback writes to; without error feedback a float32 matrix alone is a view of its delta. ``deltas[i]``: matrix
    ``i``'s (a list, or a mapping that holds the units' matrices only)."""
    work = [canonical(torch.stack([deltas[i] for i in idx]), deltas[idx[0]]).float() if idx.stacked
            else canonical(deltas[idx[0]], deltas[idx[0]]).float() for idx in units]
    if not payload.error_feedback:
        return work
    alone = [n for n, idx in enumerate(units) if not idx.stacked]
    if alone:  # new tensors D_m + e_m, in one op
        summed = torch._foreach_add([work[n] for n in alone], [payload._errors[units[n][0]].to(work[n].device)
                                                                 for n in alone])
        for n, w in zip(alone, summed):
            work[n] = w
    stacked = [(w, idx) for w, idx in zip(work, units) if idx.stacked]
    if stacked:  # the stacks are new: add e_m in place, through one view per matrix
        torch._foreach_add_([m for w, _ in stacked for m in w.unbind(0)],
                            [payload._errors[i].to(w.device) for w, idx in stacked for i in idx])
    return work


def _take(tensors: Sequence[Tensor], idx: Unit, device: torch.device) -> Tensor:
    """``tensors[i]`` for a matrix alone, else those of ``idx`` stacked; on ``device``."""
    return torch.stack([tensors[i] for i in idx]).to(device) if idx.stacked else tensors[idx[0]].to(device)


def _p_transposed(w: Tensor, r: Tensor) -> Tensor:
    """``(W R)^T`` of a matrix, or of each matrix of a stack (computed as ``R^T W^T``: contiguous, so that its rows
    are a view)."""
    return (w @ r).mT if w.dim() == 2 else torch.bmm(r.mT, w.mT)


def _rows(m: Tensor) -> Tensor:
    """A message as the matrix of its rows (each int8 scale covers one row): a stack's matrices one under another."""
    return m if m.dim() == 2 else m.reshape(-1, m.shape[-1])


def _unrows(m: Tensor, shape: Sequence[int]) -> Tensor:
    """The inverse of :func:`_rows` for a unit shaped ``shape``."""
    return m if len(shape) == 2 else m.view(shape[0], -1, m.shape[-1])


def _per_matrix(units: Sequence[Tensor], groups: list[Unit], count: int) -> list[Tensor]:
    """Per-unit tensors as one tensor per matrix, in the matrices' order (a stack's matrices are views of it)."""
    if not units:
        return []
    out: list[Tensor] = [units[0]] * count
    for u, idx in zip(units, groups):
        for i, m in zip(idx, u.unbind(0) if idx.stacked else (u,)):
            out[i] = m
    return out


def _split(unit: Tensor, idx: Unit) -> list[Tensor]:
    """A unit's tensor as one per matrix (a stack's matrices are views of it)."""
    return list(unit.unbind(0)) if idx.stacked else [unit]


def _buckets(units: list[Unit], deltas: Sequence[Tensor], cap_bytes: Optional[float]) -> list[list[int]]:
    """Consecutive units in buckets of at most ``cap_bytes`` of float32 (a larger unit is a bucket of its own)."""
    out: list[list[int]] = [[]]
    size = 0
    for n, idx in enumerate(units):
        nbytes = sum(deltas[i].numel() for i in idx) * 4
        if out[-1] and cap_bytes is not None and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(n)
        size += nbytes
    return [b for b in out if b]
