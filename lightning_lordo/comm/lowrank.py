r"""The ``lowrank`` payload of SPEC §5 (PowerSGD-style), with per-worker sync-level error feedback.

Pure tensor code and collectives, no Lightning; every collective goes through a communicator, counted and bounded
by its timeout, as in :mod:`lightning_lordo.comm.quantization` (which also holds the reduced-precision messages this
payload can use). With one process nothing travels and nothing is counted, but the numerics are the same as with
many (a low-rank payload is low-rank, a quantized one quantized, whatever the world size).

:class:`LowRankPayload` works per matrix in the canonical orientation ``a x b`` (``a <= b``; a tall matrix is
transposed), with a warm-started right factor ``R`` (``b x r``) and a per-worker sync-level error feedback ``e``
(``a x b``, float32). One round, for all matrices together::

    D_m <- D_m + e_m;  P_m = D_m R                 collective #1 (flattened, all matrices): P = mean_m P_m
    Q = orth(P)  (QR, float32: identical on all ranks, P being identical)
    B_m = Q^T D_m                                  collective #2 (flattened, all matrices): B = mean_m B_m
    applied update Q B;  e_m <- D_m - Q B_m;  R <- orth(B^T)

The collectives are all-reduces (for ``int8`` all-gathers up to 2 workers and reduce-scatters above, see
:mod:`lightning_lordo.comm.reduce_scatter`; or as ``reduction`` says). Traffic
``r (a + b)`` numbers per matrix instead of ``a b``, each message priced as in the traffic model of
:mod:`lightning_lordo.comm.quantization` for its ``payload_dtype``. ``Q`` is the new basis computed from the averaged
pseudo-gradient (one warm-started subspace iteration), to be installed in the optimizer. With ``r = a`` the applied
update is the exact average. The P and B messages can be quantized too: the B error is absorbed by ``e``
(``e_m = D_m - Q dequantize(B_m)``), the P error only perturbs the basis (``Q`` is still identical on all ranks and
the error-feedback identity still holds for any ``Q``), so P needs no error feedback of its own — and could not
have one: ``R`` changes every round, so last round's P error is not in this round's coordinates.

Error feedback identity (as in :mod:`lightning_lordo.comm.quantization`, with ``s_m = Q B_m`` what worker m effectively
sent): after T rounds, the sum of the true averages of D minus the sum of the applied updates is ``mean_m e_m``,
exactly for float32, all-gathers and the int8 reduce-scatter (whose ``B_m`` carries the owner's requantization
residual, times M), so nothing is dropped for good.

Transactions. ``reduce`` never changes the payload's state: it returns a round (the averages, the bases, the new
state pending), and ``commit(round)`` installs the new state once the caller's whole synchronization succeeded. A
round whose averaged values are not finite (NaN/Inf on any worker makes every worker's average non-finite, so all
ranks agree without a message) has ``finite=False`` and its ``commit`` is a no-op: neither ``e`` nor ``R`` moves.
Both collectives run even when the averaged P is non-finite (its NaN/Inf are zeroed for the QR), so that no value is
read back to the host in the middle of a round; the round's ``finite`` flag is a device tensor.

Typical use by a synchronizer (``deltas``: the low-rank matrices' pseudo-gradients, original orientation)::

    payload = LowRankPayload(ranks=[4, 4, 8], seed=config.seed, payload_dtype="int8")
    result = payload.reduce(comm, deltas, "pseudo_gradients")
    if not result.finite:                 # a 0-d tensor: reading it waits for the device
        ...                               # discard the round on every worker (the state did not move)
    new_anchor = [a - u for a, u in zip(anchor, result.averaged)]
    optimizer.install_bases(...result.averaged...)  # its power step on Q B returns span(Q) = result.bases
    payload.commit(result)                # only after the whole round succeeded
    monitor.log("lordo/sync_error_feedback_norm", payload.error_norm())
    checkpoint["payload"] = payload.state_dict()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import (
    canonical,
    mix_seed,
    nbytes,
    random_orthonormal,
    total_norm,
)
from lightning_lordo.comm.lowrank_phases import LowRankPhases, LowRankRound, Source
from lightning_lordo.comm.quantization import check_latest_round, quantized_mean, resolve_reduction
from lightning_lordo.comm.reduce_scatter import reduce_scatter_bytes


class LowRankPayload:
    """The ``lowrank`` payload of SPEC §5 (PowerSGD-style; module docstring) for a fixed list of matrices.

    The state is created at the first :meth:`reduce` (or by :meth:`load_state_dict`): per matrix, ``R`` a seeded
    random orthonormal ``b x r`` matrix (identical on all ranks for the same ``seed``) and ``e`` zeros (``a x b``).

    Args:
        ranks: the rank ``r`` of each matrix, ``1 <= r <= min(shape)``, in the order of ``reduce``'s ``deltas``.
        seed: seed of the initial right factors (use the same on every worker).
        payload_dtype: dtype of the P and B messages: ``"float32"``, ``"bfloat16"`` or ``"int8"`` (per-row scales;
            a row is one of the r columns of P, or one of the r rows of B).
        reduction: ``"auto"``, ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (:func:`resolve_reduction`).
        error_feedback: keep the sync-level error feedback ``e`` (SPEC §5). Without it, what a round does not
            transmit is dropped for good (saves an ``a x b`` float32 buffer per matrix).
        batched: work on the matrices of one shape and rank as one stack (one batched product and QR per shape, as
            on an accelerator); otherwise matrix by matrix. The same round up to float32 rounding with a float32
            payload (tested); a quantized one may round such differences to another level (its error feedback
            still returns what a round drops).
    """

    def __init__(self, ranks: Sequence[int], seed: int = 0, payload_dtype: str = "float32",
                 reduction: str = "auto", error_feedback: bool = True, batched: bool = False) -> None:
        resolve_reduction(payload_dtype, reduction)
        for i, r in enumerate(ranks):
            if not isinstance(r, int) or isinstance(r, bool) or r < 1:
                raise ValueError(f"Invalid rank {r!r} for matrix {i}: it must be an integer >= 1.")
        self.ranks = list(ranks)
        self.seed = seed
        self.payload_dtype = payload_dtype
        self.reduction = reduction
        self.error_feedback = error_feedback
        self.batched = batched
        self._right: list[Tensor] = []
        self._errors: list[Tensor] = []
        self._version = 0

    # ------------------------------------------------------------------ one round
    @torch.no_grad()
    def reduce(self, comm: Any, deltas: Sequence[Tensor], purpose: str = "pseudo_gradients") -> LowRankRound:
        """One round on this worker's pseudo-gradients ``deltas`` (one 2-D tensor per matrix, original
        orientation); every worker calls it together. Changes nothing of the payload (see :meth:`commit`).

        Raises:
            ValueError: wrong number of matrices, a tensor not 2-D, a rank above ``min(shape)``, or shapes that
                differ from the state's.
            CollectiveTimeout: from the communicator.
        """
        return self.run(comm, self.phases(deltas), purpose)

    @torch.no_grad()
    def run(self, comm: Any, phases: LowRankPhases, purpose: str = "pseudo_gradients") -> LowRankRound:
        """:meth:`reduce`'s collectives on its :meth:`phases` (which no longer hold the deltas)."""
        phases.take_p(quantized_mean(comm, phases.message, purpose, self.payload_dtype, self.reduction))
        return phases.finish(quantized_mean(comm, phases.message, purpose, self.payload_dtype, self.reduction))

    @torch.no_grad()
    def phases(self, deltas: Optional[Sequence[Tensor]] = None, *, like: Optional[Sequence[Tensor]] = None,
               source: Optional[Source] = None, cap_bytes: Optional[float] = None) -> LowRankPhases:
        """:meth:`reduce` in steps, for a caller that sends several payloads' messages together
        (:func:`~lightning_lordo.comm.quantization.quantized_means`): ``message`` is the P message's tensors;
        ``take_p(its mean)`` makes ``message`` the B message's; ``finish(its mean)`` returns the round.

        Streamed (``source`` and ``like`` instead of ``deltas``): the deltas are made again, a bucket at a time,
        whenever they are needed (``source(indices)``: those matrices' deltas), and never held whole; ``like``:
        tensors shaped as the deltas (the parameters); ``cap_bytes``: a bucket's float32 size (a stack is split to
        fit; a larger matrix is a bucket of its own). The round then holds neither the averages nor the new error
        feedback: :meth:`LowRankPhases.commit_bucket` makes them where the caller commits.

        Raises:
            ValueError: as :meth:`reduce`.
        """
        templates = deltas if deltas is not None else like
        if templates is None or (deltas is None) == (source is None):
            raise TypeError("LowRankPayload.phases takes deltas, or like and source (streamed).")
        self._check(templates)
        self._ensure_state(templates)
        return LowRankPhases(self, templates, source, cap_bytes)

    def commit(self, result: LowRankRound) -> None:
        """Install the round's error feedback and right factors (a no-op for a non-finite round).

        Raises:
            RuntimeError: ``result`` is not this payload's latest round (stale, or already committed).
        """
        check_latest_round(result.version, self._version, "LowRankPayload")
        self._version += 1
        if not result.finite:
            return
        self._right = result.right
        if self.error_feedback and result.streamed is None:  # streamed: written in place by commit_bucket
            self._errors = result.errors

    # ------------------------------------------------------------------ state
    def error_tensors(self) -> list[Tensor]:
        """This worker's sync-level error feedback, one tensor per matrix (empty without error feedback)."""
        return list(self._errors)

    def error_norm(self) -> float:
        """The L2 norm of this worker's sync-level error feedback, over all matrices (for the monitor)."""
        return total_norm(self._errors)

    def state_dict(self) -> dict[str, list[Tensor]]:
        """Tensors only: ``{"errors": [e per matrix], "right": [R per matrix]}`` (empty before the first round;
        ``errors`` empty without error feedback). Per worker: the error feedback differs between workers."""
        return {"errors": [e.clone() for e in self._errors], "right": [r.clone() for r in self._right]}

    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """Restore :meth:`state_dict` (shapes checked against ``ranks``; the matrices' sizes at the next round).

        Raises:
            ValueError: the numbers of tensors or the ranks do not match.
        """
        right, errors = list(state["right"]), list(state["errors"])
        if right and len(right) != len(self.ranks):
            raise ValueError(f"LowRankPayload.load_state_dict: {len(right)} right factors for {len(self.ranks)} "
                             "matrices.")
        for i, (r, rank) in enumerate(zip(right, self.ranks)):
            if r.dim() != 2 or r.shape[1] != rank:
                raise ValueError(f"LowRankPayload.load_state_dict: right factor {i} has shape {tuple(r.shape)}, "
                                 f"expected (b, {rank}).")
        if self.error_feedback and right and len(errors) not in (0, len(right)):
            raise ValueError(f"LowRankPayload.load_state_dict: {len(errors)} error buffers for {len(right)} "
                             "matrices.")
        self._right = [r.detach().float().clone() for r in right]
        # without saved error feedback (a checkpoint made without it) the next round starts it from zero
        self._errors = [e.detach().float().clone() for e in errors] if self.error_feedback else []
        self._version += 1

    def memory_report(self) -> dict[str, int]:
        """Bytes of this worker's synchronization buffers of the payload (SPEC §8)."""
        return {
            "sync_error_feedback": nbytes(self._errors),
            "payload_right_factors": nbytes(self._right),
        }

    @staticmethod
    def traffic_bytes(shapes: Sequence[Sequence[int]], ranks: Sequence[int], payload_dtype: str = "float32",
                      world_size: Optional[int] = None, reduction: str = "auto") -> int:
        """Bytes this worker passes to the collectives in one (finite) round among ``world_size`` workers (``None``:
        two or fewer): ``r (a + b)`` numbers per matrix, plus ``2 r`` float32 scales for ``int8`` by all-gather; for
        the int8 reduce-scatter, :func:`~lightning_lordo.comm.reduce_scatter.reduce_scatter_bytes` of the P message
        (``sum r a``) and of the B message (``sum r b``), ``a <= b``."""
        how = resolve_reduction(payload_dtype, reduction, world_size)
        if how == "reduce_scatter":
            p_numel = sum(r * min(shape) for shape, r in zip(shapes, ranks))
            b_numel = sum(r * max(shape) for shape, r in zip(shapes, ranks))
            return sum(sum(reduce_scatter_bytes(n, world_size or 1).values()) for n in (p_numel, b_numel))
        total = 0
        for shape, r in zip(shapes, ranks):
            numbers = r * (shape[0] + shape[1])
            total += {"float32": 4 * numbers, "bfloat16": 2 * numbers, "int8": numbers + 8 * r}[payload_dtype]
        return total

    # ------------------------------------------------------------------ internals
    def _check(self, deltas: Sequence[Tensor]) -> None:
        if len(deltas) != len(self.ranks):
            raise ValueError(f"LowRankPayload.reduce: {len(deltas)} matrices for {len(self.ranks)} ranks.")
        for i, (d, r) in enumerate(zip(deltas, self.ranks)):
            if d.dim() != 2:
                raise ValueError(f"LowRankPayload.reduce: matrix {i} has shape {tuple(d.shape)}; only 2-D tensors "
                                 "have a low-rank payload (average the others with QuantizedAverager).")
            if r > min(d.shape):
                raise ValueError(f"LowRankPayload.reduce: rank {r} of matrix {i} exceeds min{tuple(d.shape)}; use "
                                 f"a rank <= {min(d.shape)}.")
        if self._right:
            for i, (d, rt) in enumerate(zip(deltas, self._right)):
                a, b = sorted(d.shape)
                e_bad = self.error_feedback and self._errors and tuple(self._errors[i].shape) != (a, b)
                if rt.shape[0] != b or e_bad:
                    raise ValueError(f"LowRankPayload.reduce: matrix {i} has shape {tuple(d.shape)}, which does not "
                                     f"match the payload's state (right factor {tuple(rt.shape)}).")

    def _ensure_state(self, deltas: Sequence[Tensor]) -> None:
        if not self._right:
            for i, (d, r) in enumerate(zip(deltas, self.ranks)):
                seed = mix_seed(self.seed, i, offset=15_485_863)
                self._right.append(random_orthonormal(max(d.shape), r, seed, d.device))
        if self.error_feedback and not self._errors:
            # canonical, laid out as a held round's work (a tall matrix's transposed), which a streamed round copies
            # into: the same values then have the same norms
            self._errors = [canonical(torch.zeros(d.shape, device=d.device), d) for d in deltas]
