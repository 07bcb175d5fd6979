r"""Reduced-precision averaging across workers (the payload dtypes of SPEC §5), with per-worker error feedback.

Pure tensor code and collectives, no Lightning. Every collective goes through a communicator passed in (a
:class:`~lightning_lordo.comm.communicator.Communicator`: its ``all_reduce_mean``, ``all_reduce_sum``,
``all_gather`` and ``all_to_all``), so it is counted (numel x itemsize of what this worker passes, per purpose,
and the wire bytes of the collective's algorithm) and bounded by the communicator's timeout. With one process
nothing travels and nothing is counted, but the numerics are the same as with many (a payload is quantized
whatever the world size; ``"auto"`` int8 alone is the all-gather's single rounding).

Two pieces (the ``lowrank`` payload, :mod:`lightning_lordo.comm.lowrank`, sends its messages with the first):

* :func:`quantized_mean` — stateless: the float32 mean across workers of a list of tensors sent as ``float32``,
  ``bfloat16`` or ``int8`` (per-row scales), plus what this worker effectively contributed (its dequantized
  message), from which a caller keeps its own error feedback.
* :class:`QuantizedAverager` — :func:`quantized_mean` with per-worker error feedback per tensor (for the ``full``
  payload and for the full-rank parameters): ``x = t + e``; send ``quantize(x)``; ``e <- x - dequantize(...)``.

Error feedback identity. Write ``s_m`` for what worker m effectively sent (its dequantized message). If the
reduction averages the ``s_m`` exactly (float32 all-reduce, any all-gather, or the int8 reduce-scatter, whose
``s_m`` carries the owner's requantization residual: proof in :mod:`lightning_lordo.comm.reduce_scatter`), the
applied update is
``mean_m s_m = mean_m (D_m + e_m^old - e_m^new)``, so after T rounds::

    sum_t (true average of D) - sum_t (applied) = mean_m e_m      (the current error feedback, exactly)

Nothing is dropped for good: the gap is bounded by the error-feedback norm, not by T. A ``bfloat16`` all-reduce
breaks exactness slightly: the backend returns the *sum* in bfloat16, rounded (checked on gloo, torch 2.13, where a
bfloat16 all-reduce works; NCCL also keeps its partial sums in the payload dtype, not checked here), and that
rounding (at most ``2^-8`` of the partial sums per addition, ``M - 1`` additions in a ring) belongs to no worker,
so no error feedback can return it. It is small and, rounding to nearest, typically without bias, but it adds up
like a random walk over the rounds. ``reduction="all_gather"`` makes bfloat16 exact again (each worker sums the
gathered bfloat16 payloads in float32, in rank order), at the all-gather's cost (below).

Transactions. ``QuantizedAverager.reduce`` never changes the averager's state: it returns a round (the averages,
the new error feedback pending), and ``commit(round)`` installs it once the caller's whole synchronization
succeeded. A round whose averages are not finite (NaN/Inf on any worker makes every worker's average non-finite,
so all ranks agree without a message) has ``finite=False`` and its ``commit`` is a no-op. ``int8`` cannot carry
NaN/Inf: a row with a non-finite element is sent with a NaN scale, so it stays detectable.

Traffic model (bytes counted = bytes of the tensors this worker passes to the collective; M workers)::

    mode                      counted per worker          on the wire per worker (ring)      collectives
    float32 all-reduce        4 n                         2 (M-1)/M * 4 n                     1
    bfloat16 all-reduce       2 n                         2 (M-1)/M * 2 n                     1
    bfloat16 all-gather       2 n                         (M-1) * 2 n   (sent and received)   1
    int8 all-gather           n + 4 rows                  (M-1) * (n + 4 rows)                1
    int8 reduce-scatter       ~ n (1 + 4/b)               ~ 2 (M-1)/M * n (1 + 4/b)           2   (b: 129-256)
    lowrank                   r (a + b) per matrix x the above                                2

An all-gather's volume grows with M: summing int8 across workers would overflow, so every worker receives every
other worker's message. Against a float32 all-reduce (``8 (M-1)/M`` bytes per number on the wire), the int8
all-gather wins for ``M < 8`` (about; ``(1 + 4/cols) < 8/M``) and a bfloat16 all-gather for ``M < 4``; at M = 2 a
bfloat16 all-gather costs the same as a bfloat16 all-reduce. The int8 reduce-scatter
(:mod:`lightning_lordo.comm.reduce_scatter`: each worker sums one chunk, requantizes it, and the int8 chunks are
all-gathered) costs about a quarter of the float32 all-reduce at every M, and is ``"auto"``'s int8 reduction for
M > 2. The communicator counts both figures (payload and wire, :mod:`lightning_lordo.comm.accounting`); each round also
reports its payload bytes by collective kind (``traffic``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_lordo._tensors import finite_flags, flat_cat, math_dtype, total_norm
from lightning_lordo._tensors import nbytes as tensor_bytes
from lightning_lordo.comm.int8 import dequantize_int8, mean_of_packed, pack_rows, quantize_int8
from lightning_lordo.comm.reduce_scatter import int8_reduce_scatter_mean
from lightning_lordo.config import PAYLOAD_DTYPES

REDUCTIONS = ("auto", "all_reduce", "all_gather", "reduce_scatter")


# ---------------------------------------------------------------------------------------------------------------
# Round trips (pure; the int8 codec is lightning_lordo.comm.int8)
# ---------------------------------------------------------------------------------------------------------------
def round_trip(x: Tensor, payload_dtype: str) -> Tensor:
    """What a receiver reconstructs (float32) from ``x`` sent as ``payload_dtype``."""
    _check_dtype(payload_dtype)
    if payload_dtype == "float32":
        return x.float()
    if payload_dtype == "bfloat16":
        return x.to(torch.bfloat16).float()
    q, scales = quantize_int8(x)
    return dequantize_int8(q, scales, x.shape)


# ---------------------------------------------------------------------------------------------------------------
# Stateless quantized mean
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class QuantizedMean:
    """Result of :func:`quantized_mean`.

    Attributes:
        means: float32 averages across workers, shaped as the inputs; identical on all ranks.
        sent: float32, what this worker effectively contributed (its dequantized message), shaped as the inputs.
        traffic: bytes counted, by collective kind (``"all_reduce"``, ``"all_gather"``); empty alone.
    """

    means: list[Tensor]
    sent: list[Tensor]
    traffic: dict[str, int] = field(default_factory=dict)


def resolve_reduction(payload_dtype: str, reduction: str, world_size: Optional[int] = None) -> str:
    """The collective a ``payload_dtype`` uses among ``world_size`` workers (``None``: not known yet, e.g. when
    validating arguments at construction). ``auto`` is an all-reduce for float32 and bfloat16; for int8 the
    all-gather up to 2 workers and the reduce-scatter (:mod:`lightning_lordo.comm.reduce_scatter`, bytes per worker
    flat in M) above. An int8 sum overflows, so ``int8`` with ``all_reduce`` is refused; ``reduce_scatter`` is the
    int8 reduction only (it requantizes the averaged chunks to int8)."""
    _check_dtype(payload_dtype)
    if reduction not in REDUCTIONS:
        raise ValueError(f"Invalid reduction={reduction!r}: choose one of {', '.join(REDUCTIONS)}.")
    if reduction == "auto":
        if payload_dtype != "int8":
            return "all_reduce"
        return "reduce_scatter" if world_size is not None and world_size > 2 else "all_gather"
    if payload_dtype == "int8" and reduction == "all_reduce":
        raise ValueError("Invalid reduction='all_reduce' with payload_dtype='int8': an int8 sum across workers "
                         "overflows. Use reduction='reduce_scatter', 'all_gather' or 'auto'.")
    if payload_dtype != "int8" and reduction == "reduce_scatter":
        raise ValueError(f"Invalid reduction='reduce_scatter' with payload_dtype={payload_dtype!r}: the "
                         "reduce-scatter is the int8 reduction. Use payload_dtype='int8', or reduction='all_reduce' "
                         "(or 'auto') for float32 and bfloat16.")
    return reduction


def quantized_mean(comm: Any, tensors: Sequence[Tensor], purpose: str, payload_dtype: str = "float32",
                   reduction: str = "auto", in_place: bool = False) -> QuantizedMean:
    """The float32 mean across workers of ``tensors`` sent as ``payload_dtype``, in one flattened collective.

    The inputs are not modified, unless ``in_place`` (temporaries of the caller's): a float32 all-reduce then
    averages them where they are, a bucket at a time. All ranks must pass tensors of the same shapes, in the same
    order.

    * ``float32`` all-reduce: ``comm.mean`` (exact mean of the float32 inputs), or ``in_place``
      ``comm.average_temporaries``.
    * ``bfloat16`` all-reduce: the inputs rounded to bfloat16, summed by the backend in bfloat16, divided by the
      world size in float32. The sum's own rounding is in no worker's ``sent`` (module docstring).
    * any all-gather (``bfloat16``, ``int8``: per-row float32 scales and int8 values in one byte buffer;
      ``float32``): every worker dequantizes every worker's message and sums them in float32 in rank order, so
      ``means`` is exactly (up to float32 summation) ``mean_k sent_k`` and bitwise identical on all ranks.
    * ``int8`` reduce-scatter (per-block scales; :mod:`lightning_lordo.comm.reduce_scatter`): an all-to-all of
      chunks, each summed in float32 by its owner and requantized, then an all-gather of the int8 chunks; ``means``
      is bitwise identical on all ranks and ``mean_k sent_k`` (the owner's requantization residual is in its
      ``sent``, times M), so error feedback built on ``sent`` loses nothing.

    Args:
        comm: the communicator (counted, timeout-bounded collectives).
        tensors: the local tensors (any floating dtype; used as float32).
        purpose: the accounting purpose (e.g. ``"pseudo_gradients"``).
        payload_dtype: ``"float32"``, ``"bfloat16"`` or ``"int8"``.
        reduction: ``"auto"``, ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (:func:`resolve_reduction`,
            resolved with the communicator's world size).

    Raises:
        CollectiveTimeout: from the communicator, when a collective fails or times out.
    """
    how = resolve_reduction(payload_dtype, reduction, comm.world_size)
    full = payload_dtype == "float32" and how == "all_reduce"  # no compression: float64 stays float64
    xs = [_as(t, math_dtype(t.dtype) if full else torch.float32) for t in tensors]
    shapes = [x.shape for x in xs]
    if not xs:
        return QuantizedMean([], [], {})
    world = comm.world_size
    if full and world == 1:  # nothing travels and nothing is rounded: the mean is the input
        return QuantizedMean(xs, xs, {})
    if full and in_place and all(x is t for x, t in zip(xs, tensors)):
        comm.average_temporaries(xs, purpose)
        return QuantizedMean(xs, xs, {"all_reduce": tensor_bytes(xs)})
    if full:
        means = comm.mean(xs, purpose)
        traffic = {"all_reduce": tensor_bytes(xs)} if world > 1 else {}
        return QuantizedMean(means, xs, traffic)

    if how == "reduce_scatter":

        means_flat, sent_flat, traffic = int8_reduce_scatter_mean(comm, flat_cat(xs),
                                                                  purpose)
        return QuantizedMean(_split(means_flat, shapes), _split(sent_flat, shapes), traffic)
    if payload_dtype == "int8":  # one byte buffer: the scales of every row, then the values
        message, sent, layout = pack_rows(xs)
        gathered, nbytes = comm.all_gather(message, purpose)
        means = mean_of_packed(gathered, layout) if world > 1 else sent
        return QuantizedMean(means, sent, {"all_gather": nbytes} if nbytes else {})

    wire_dtype = torch.bfloat16 if payload_dtype == "bfloat16" else torch.float32
    flat = flat_cat(xs).to(wire_dtype)
    sent = _split(flat.float(), shapes)
    if world == 1:
        return QuantizedMean(sent, sent, {})
    if how == "all_reduce":
        nbytes = comm.all_reduce_sum(flat, purpose)
        means = _split(flat.float().div_(world), shapes)
        return QuantizedMean(means, sent, {"all_reduce": nbytes})
    gathered, nbytes = comm.all_gather(flat, purpose)
    acc = gathered[0].float()
    for k in range(1, world):
        acc.add_(gathered[k].float())
    return QuantizedMean(_split(acc.div_(world), shapes), sent, {"all_gather": nbytes})


def quantized_means(comm: Any, messages: Sequence[tuple[Sequence[Tensor], str]], payload_dtype: str = "float32",
                    reduction: str = "auto") -> list[QuantizedMean]:
    """:func:`quantized_mean` of several messages ``(tensors, purpose)`` at once, each result what its own call
    gives. An int8 all-gather codes every row on its own (its scale is its own largest magnitude), so the messages
    travel as one: one pass of the codec and one collective, whose bytes each message counts under its own purpose
    (the same bytes as its own collective). Any other payload (a float all-reduce, the int8 reduce-scatter's blocks
    that would span messages) sends each message by itself, in order."""
    how = resolve_reduction(payload_dtype, reduction, comm.world_size)
    if payload_dtype != "int8" or how != "all_gather":
        return [quantized_mean(comm, tensors, purpose, payload_dtype, reduction) for tensors, purpose in messages]
    xs = [_as(t, torch.float32) for tensors, _ in messages for t in tensors]
    if not xs:
        return [QuantizedMean([], [], {}) for _ in messages]
    message, sent, layout = pack_rows(xs)
    counts = [len(tensors) for tensors, _ in messages]
    sizes = layout.part_bytes(counts)
    parts = [(purpose, n) for (_, purpose), n in zip(messages, sizes) if n]
    gathered, nbytes = comm.all_gather(message, parts[0][0] if parts else messages[0][1], parts=parts)
    means = mean_of_packed(gathered, layout) if comm.world_size > 1 else sent
    out, start = [], 0
    for count, size in zip(counts, sizes):
        traffic = {"all_gather": size} if nbytes and size else {}
        out.append(QuantizedMean(means[start: start + count], sent[start: start + count], traffic))
        start += count
    return out


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` detached, in ``dtype``: itself when it already is (no op dispatched), else a copy."""
    t = t.detach() if t.requires_grad else t
    return t if t.dtype == dtype else t.to(dtype)


def _split(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        out.append(flat[offset : offset + numel].reshape(shape))
        offset += numel
    return out


# ---------------------------------------------------------------------------------------------------------------
# Error feedback on a list of tensors
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class AverageRound:
    """One round of :class:`QuantizedAverager` (nothing of the averager changed yet: see ``commit``).

    Attributes:
        finite: whether every average is finite (identical on all ranks): a 0-d bool tensor, not read (a
            synchronizer combines it with its other checks into one host read); if not, ``commit`` is a no-op.
        averaged: the float32 averages, shaped as the inputs.
        traffic: bytes counted, by collective kind.
        errors: the error feedback ``commit`` installs (``None``: none kept, float32 payloads).
    """

    finite: Union[bool, Tensor]
    averaged: list[Tensor]
    traffic: dict[str, int]
    errors: Optional[list[Tensor]]
    version: int = -1


class QuantizedAverager:
    """The mean across workers of a list of tensors, sent as ``payload_dtype``, with per-worker error feedback.

    Each round: ``x_i = t_i + e_i``; send ``x_i`` quantized; ``e_i <- x_i - dequantize(quantize(x_i))``. The error
    feedback is kept per tensor (by position in the list, float32, same shape) for ``bfloat16`` and ``int8``; a
    ``float32`` payload is exact and keeps none.

    Args:
        payload_dtype: ``"float32"``, ``"bfloat16"`` or ``"int8"``.
        reduction: ``"auto"``, ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (:func:`resolve_reduction`).
    """

    def __init__(self, payload_dtype: str = "float32", reduction: str = "auto") -> None:
        resolve_reduction(payload_dtype, reduction)
        self.payload_dtype = payload_dtype
        self.reduction = reduction
        self._errors: Optional[list[Tensor]] = None
        self._version = 0

    def reduce(self, comm: Any, tensors: Sequence[Tensor], purpose: str, in_place: bool = False) -> AverageRound:
        """Average ``tensors`` (with this worker's error feedback added) across workers; change nothing here
        (``in_place``: the caller's temporaries may hold the averages, :func:`quantized_mean`).

        Raises:
            ValueError: the tensors do not match the shapes of the error feedback kept so far.
            CollectiveTimeout: from the communicator.
        """
        xs = self.message(tensors)
        result = quantized_mean(comm, xs, purpose, self.payload_dtype, self.reduction,
                                in_place=in_place and self._exact)
        return self.finish(xs, result)

    def message(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """What :meth:`reduce` sends: ``tensors`` with this worker's error feedback added (new tensors, unless a
        float32 payload keeps none), for a caller that sends it with other messages (then :meth:`finish`).

        Raises:
            ValueError: the tensors do not match the shapes of the error feedback kept so far.
        """
        xs = [_as(t, math_dtype(t.dtype)) for t in tensors]
        if self._errors is not None:
            if [e.shape for e in self._errors] != [x.shape for x in xs]:
                raise ValueError("QuantizedAverager.reduce: the tensors' shapes "
                                 f"{[tuple(x.shape) for x in xs]} differ from those of the error feedback "
                                 f"{[tuple(e.shape) for e in self._errors]}; pass the same list every round.")
            xs = list(torch._foreach_add(xs, [e.to(x.device) for e, x in zip(self._errors, xs)])) if xs else xs
        elif not self._exact:  # the error feedback below is computed in a copy (``_as`` copied only for the dtype)
            xs = [x.clone() if x.dtype == t.dtype else x for x, t in zip(xs, tensors)]
        return xs

    @property
    def _exact(self) -> bool:
        """Whether a message is the tensors themselves: a float32 payload adds and keeps no error feedback."""
        return self.payload_dtype == "float32" and self._errors is None

    def finish(self, xs: list[Tensor], result: QuantizedMean, finite: Optional[Tensor] = None) -> AverageRound:
        """The round of the message ``xs`` (:meth:`message`) from its mean ``result``; changes nothing here.
        ``finite``: whether the means are finite, as the caller checked them."""
        errors = None
        if self.payload_dtype != "float32":
            if xs:
                torch._foreach_sub_(xs, list(result.sent))
            errors = xs
        finite = finite_flags(result.means).all() if finite is None else finite
        return AverageRound(finite, result.means, result.traffic, errors, self._version)

    def commit(self, result: AverageRound) -> None:
        """Install the round's error feedback (a no-op for a non-finite round).

        Raises:
            RuntimeError: ``result`` is not this averager's latest round (stale, or already committed).
        """
        check_latest_round(result.version, self._version, "QuantizedAverager")
        self._version += 1
        if result.finite:
            self._errors = result.errors

    def error_tensors(self) -> list[Tensor]:
        """This worker's error feedback (empty when none is kept)."""
        return list(self._errors or [])

    def error_norm(self) -> float:
        """The L2 norm of this worker's error feedback, over all tensors (0 when none)."""
        return total_norm(self._errors or [])

    def state_dict(self) -> dict[str, list[Tensor]]:
        """Tensors only: ``{"errors": [...]}`` (empty when none is kept)."""
        return {"errors": [e.clone() for e in self._errors or []]}

    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """Restore :meth:`state_dict` (the shapes are checked at the next :meth:`reduce`)."""
        errors = state["errors"]
        self._errors = [e.detach().float().clone() for e in errors] if errors else None
        self._version += 1  # a round reduced before loading must not be committed over the loaded state

    def memory_report(self) -> dict[str, int]:
        """Bytes of this worker's error feedback (a synchronization buffer, SPEC §8)."""
        return {"payload_error_feedback": tensor_bytes(self._errors or [])}


# ---------------------------------------------------------------------------------------------------------------
# helpers (shared with the low-rank payload)
# ---------------------------------------------------------------------------------------------------------------
def _check_dtype(payload_dtype: str) -> None:
    if payload_dtype not in PAYLOAD_DTYPES:
        raise ValueError(f"Invalid payload_dtype={payload_dtype!r}: choose one of {', '.join(PAYLOAD_DTYPES)}.")


def check_latest_round(got: int, expected: int, owner: str) -> None:
    """Refuse to commit a round that is not ``owner``'s latest (``got`` is the round's version)."""
    if got != expected:
        raise RuntimeError(f"{owner}.commit: this round is not the latest one reduced (already committed, or "
                           "reduced before a later round or a load_state_dict); reduce again.")
