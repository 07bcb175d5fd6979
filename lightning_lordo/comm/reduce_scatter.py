r"""The int8 mean across workers by reduce-scatter: bytes per worker that do not grow with the number of workers.

Pure tensor code and collectives, no Lightning; both collectives go through the communicator (counted, bounded by
its timeout), as everything in :mod:`lightning_lordo.comm.quantization`, whose :func:`quantized_mean` calls this
module for ``payload_dtype="int8"`` with ``reduction="reduce_scatter"`` (the ``"auto"`` choice for M > 2 workers).

One round on a flat float32 message of ``n`` numbers, M workers, ``rank`` the worker's index::

    layout   c = ceil(n / M); k = ceil(c / 256) blocks a chunk; block b = ceil(c / k); chunk L = k b numbers
             the message, zero-padded to M L numbers, is M chunks (chunk j belongs to rank j), each k blocks
    1  quantize x to int8, one float32 scale per block of b numbers:  s_m = dequantize(quantize(x_m))
    2  all-to-all: worker m sends chunk j of its int8 message (k scales, L values) to rank j, for j != m
    3  the owner of chunk j dequantizes the M copies and sums them in float32 in rank order:
       a_j = (sum_m s_m[j]) / M
    4  it requantizes a_j (per block): â_j = dequantize(quantize(a_j)); residual r_j = a_j - â_j
    5  all-gather of the int8 chunks â: every worker dequantizes the same bytes, so the result ``â`` is
       bitwise identical on every rank

Why per-block scales, not per-row: the chunk boundaries fall anywhere in a row, so with per-row scales the owner of
a chunk would need the scales of every row it overlaps (an all-gather of every scale: ``4 (M-1) rows`` wire bytes,
growing with M, or splits of varying size). Blocks aligned to the chunks keep each chunk self-contained at a
constant ``4 / b`` bytes per number (1.6 % at b = 256; b is between 129 and 256 once a chunk exceeds 256 numbers,
sized so that the chunk is split evenly: under k numbers of padding), and are at least as fine as per-row scales
wherever rows hold 256 numbers or more; a block may span the end of one tensor and the start of the next (one
scale for both).

Error feedback. ``sent_m`` (what worker m effectively contributed, returned to the caller, which keeps
``e_m <- x_m - sent_m``) is its first quantization with M times the requantization residual of the chunk it owns
taken out::

    sent_m = s_m - M r[chunk m]      (r[chunk m]: r_m on worker m's chunk, zero elsewhere)

Then ``mean_m sent_m = mean_m s_m - r = a - r = â`` (the chunks' residuals tile the message), so the applied
update is exactly the mean of what the workers sent, as with an all-gather, and the error-feedback identity of
:mod:`lightning_lordo.comm.quantization` holds unchanged: with ``x_m = D_m + e_m^old`` and
``e_m^new = x_m - sent_m``, the applied update is ``mean_m (D_m + e_m^old - e_m^new)`` and after T rounds (from
``e = 0``) ``sum_t (true average of D) - sum_t (applied) = mean_m e_m``, exactly up to float32 arithmetic
(``a`` is summed in float32; ``M r`` and ``s - M r`` are rounded once each). Only the owner knows ``r_j`` (the
float32 ``a_j`` never travels), hence the factor M: the owner returns the whole residual through its own message,
which the next round divides by M again. The second quantization is therefore not lost, only delayed a round.

Bound. Per element, ``|x - s| <= max|x_block| / 254`` and ``|r| <= max|a_block| / 254 <= X / 254`` with
``X = max_m ||x_m||_inf`` (``|s| <= |x|`` element-wise up to rounding, so ``||a||_inf <= X``). Hence
``||e_m^new||_inf <= (M + 1) X / 254``, and with ``X <= G + E`` (``G = max ||D||_inf`` over the rounds, ``E``
the largest error feedback), by induction over the rounds::

    ||e_m||_inf <= (M + 1) / (253 - M) * G      for M <= 252 (about 0.037 G at M = 8, 0.15 G at M = 32)

The identity holds for any M; the bound on the error feedback needs M <= 252 (the residual an owner returns grows
with M). The applied average differs from the float32 mean of the ``x_m`` by at most
``mean_m max|x_m,block| / 254 + max|a_block| / 254`` per element of each block (two roundings of half a step).

Non-finite values: a block holding NaN/Inf gets a NaN scale (:func:`~lightning_lordo.comm.quantization.quantize_int8`);
its owner's sum is NaN, the requantized block has a NaN scale again, and every worker's average has NaN there, so
all ranks see a non-finite round without a message.

Bytes (counted = what the worker passes; C = 4 k + L bytes, one chunk with its scales)::

    collective     payload bytes per worker        wire bytes per worker (lightning_lordo.comm.accounting)
    all-to-all     (M - 1) C  (foreign chunks)     (M - 1) C
    all-gather     C          (its own chunk)      (M - 1) C
    total          M C  ~ n (1 + 4 / b)            2 (M - 1) C  ~ 2 (M-1)/M * n (1 + 4 / b)

flat in M (the zero padding, under M (k + 1) numbers, aside), against ``(M - 1) (n + 4 rows)`` wire bytes for the
int8 all-gather and ``2 (M-1)/M * 4 n`` for a float32 all-reduce. At M = 2 the wire bytes equal the all-gather's,
with a second rounding, so ``"auto"`` keeps the all-gather there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_lordo.comm.int8 import dequantize_int8, quantize_int8

BLOCK = 256  #: numbers per int8 scale (at most; smaller when a chunk is shorter)


@dataclass(frozen=True)
class ChunkLayout:
    """How a flat message of ``numel`` numbers is cut for ``world`` workers (module docstring): ``world`` chunks of
    ``blocks`` blocks of ``block`` numbers each, zero-padded at the end."""

    numel: int
    world: int
    block: int
    blocks: int

    @property
    def chunk_numel(self) -> int:
        return self.blocks * self.block

    @property
    def padded_numel(self) -> int:
        return self.world * self.chunk_numel

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one encoded chunk: its float32 scales, then its int8 values."""
        return 4 * self.blocks + self.chunk_numel


def chunk_layout(numel: int, world: int, block: int = BLOCK) -> ChunkLayout:
    """The layout of a message of ``numel`` numbers for ``world`` workers.

    Raises:
        ValueError: ``numel`` below 0, ``world`` or ``block`` below 1.
    """
    if numel < 0 or world < 1 or block < 1:
        raise ValueError(f"Invalid numel={numel!r}, world={world!r} or block={block!r}: numel must be >= 0, world and "
                         "block >= 1.")
    per_chunk = max(1, math.ceil(numel / world))
    blocks = math.ceil(per_chunk / block)
    return ChunkLayout(numel, world, math.ceil(per_chunk / blocks), blocks)  # even blocks: little padding


def reduce_scatter_bytes(numel: int, world: int) -> dict[str, int]:
    """Payload bytes per worker of one int8 reduce-scatter mean of ``numel`` numbers, by collective kind (what
    :func:`int8_reduce_scatter_mean` reports as ``traffic``); empty alone."""
    if world == 1 or numel == 0:
        return {}
    chunk = chunk_layout(numel, world).chunk_bytes
    return {"all_to_all": (world - 1) * chunk, "all_gather": chunk}


def quantize_blocks(flat: Tensor, layout: ChunkLayout) -> tuple[Tensor, Tensor]:
    """The zero-padded ``flat`` quantized per block: int8 values ``(world * blocks) x block`` and float32 scales
    ``world * blocks`` (block ``i`` is in chunk ``i // blocks``)."""
    padded = torch.zeros(layout.padded_numel, dtype=torch.float32, device=flat.device)
    padded[: layout.numel] = flat
    return quantize_int8(padded.view(-1, layout.block))


def int8_reduce_scatter_mean(comm: Any, flat: Tensor, purpose: str) -> tuple[Tensor, Tensor, dict[str, int]]:
    """The mean across workers of the 1-D float32 ``flat`` (same numel on every worker), in int8 by reduce-scatter
    (module docstring). Every worker calls it together.

    Returns:
        ``means`` (float32, like ``flat``, bitwise identical on every rank), ``sent`` (what this worker effectively
        contributed: ``mean_m sent_m == means`` up to float32 rounding) and the payload bytes counted by collective
        kind (``{"all_to_all": ..., "all_gather": ...}``; empty alone).

    Raises:
        CollectiveTimeout: from the communicator.
    """
    world, rank = comm.world_size, comm.rank
    layout = chunk_layout(flat.numel(), world)
    if flat.numel() == 0:
        return flat.float().clone(), flat.float().clone(), {}
    q, scales = quantize_blocks(flat.float(), layout)
    sent = dequantize_int8(q, scales).reshape(-1)
    k = layout.blocks
    message = torch.cat([scales.view(world, k).view(torch.int8), q.view(world, layout.chunk_numel)], dim=1)
    received, to_all = comm.all_to_all(message, purpose)  # row m: rank m's copy of this worker's chunk
    total = _decode(received[0], k)
    for m in range(1, world):
        total.add_(_decode(received[m], k))
    average = total.div_(world)
    q2, scales2 = quantize_int8(average.view(k, layout.block))
    residual = average.sub_(dequantize_int8(q2, scales2).reshape(-1))
    own = torch.cat([scales2.view(torch.int8), q2.reshape(-1)])
    gathered, to_gather = comm.all_gather(own, purpose)
    means = torch.cat([_decode(gathered[m], k) for m in range(world)])[: layout.numel]
    mine = slice(rank * layout.chunk_numel, (rank + 1) * layout.chunk_numel)
    sent[mine] -= world * residual
    traffic = {"all_to_all": to_all, "all_gather": to_gather} if world > 1 else {}
    return means, sent[: layout.numel], traffic


def _decode(row: Tensor, blocks: int) -> Tensor:
    """float32 values of one encoded chunk (``blocks`` float32 scales as 4 bytes each, then the int8 values)."""
    scales = row[: 4 * blocks].clone().view(torch.float32)
    return dequantize_int8(row[4 * blocks :].view(blocks, -1), scales).reshape(-1)
