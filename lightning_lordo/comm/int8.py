"""Symmetric int8 quantization with one float32 scale per row: the pure codec under the int8 payloads
(:mod:`lightning_lordo.comm.quantization`'s all-gather and :mod:`lightning_lordo.comm.reduce_scatter`).

:func:`pack_rows` and :func:`mean_of_packed` code a list of tensors as one byte message. Scales being per row, the
values of every tensor are coded in one pass over one flat buffer (a row's largest magnitude by one segmented
reduction, its scale spread over its values by one gather): a message costs a fixed number of dispatched ops, whatever
its tensors and their row lengths, and every value is the one a tensor-by-tensor codec gives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import FlatLayout, are_finite

INT8_LEVELS = 127  # symmetric: q in [-127, 127]


def rows_view(x: Tensor) -> Tensor:
    """``x`` as a 2-D matrix of rows, each row getting its own int8 scale.

    0-D and 1-D tensors are one row; higher-dimensional ones are ``x.shape[0]`` rows (e.g. one per output unit of
    a weight, one per token of an embedding)."""
    if x.dim() <= 1:
        return x.reshape(1, -1)
    # the width spelt out: with no rows, -1 could be any width (a tensor shaped (0, 3, 4))
    return x if x.dim() == 2 else x.reshape(x.shape[0], math.prod(x.shape[1:]))


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantization with one float32 scale per row (:func:`rows_view`).

    ``scale = max|row| / 127`` (0 for a zero row), ``q = round(row / scale)`` clamped to ``[-127, 127]``, so the
    round-trip error of every element is at most ``scale / 2`` (plus float32 rounding). A row holding NaN or Inf
    gets a NaN scale and zeros in ``q``: int8 cannot carry non-finite values, the scale keeps them detectable.

    Returns:
        ``q`` (int8, ``rows x cols``) and ``scales`` (float32, ``rows``).
    """
    rows = rows_view(x.float())
    if rows.shape[1] == 0:
        return torch.zeros(rows.shape, dtype=torch.int8, device=x.device), torch.zeros(rows.shape[0],
                                                                                      device=x.device)
    amax = rows.abs().amax(dim=1, keepdim=True)
    finite = are_finite(amax)  # a row holding NaN or Inf has a non-finite largest magnitude
    scales = torch.where(finite, amax / INT8_LEVELS, math.nan)
    safe = torch.where(scales > 0, scales, 1.0)  # zero rows (and NaN scales): divide by 1
    q = torch.where(finite, rows / safe, 0.0).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q, scales.view(-1)


def dequantize_int8(q: Tensor, scales: Tensor, shape: Optional[Sequence[int]] = None) -> Tensor:
    """float32 ``q * scale`` per row, reshaped to ``shape`` when given (the inverse of :func:`quantize_int8`)."""
    out = q.float() * scales[:, None]
    return out.reshape(tuple(shape)) if shape is not None else out


class RowLayout:
    """How :func:`pack_rows` laid a message out: the tensors in a :class:`~lightning_lordo._tensors.FlatLayout`'s
    order (``flat``), the length of every row (:func:`rows_view`) in that order, and per value the index of its row
    (``row_of``, int32, on the tensors' device), by which a row's scale is spread over its values."""

    def __init__(self, shapes: Sequence[torch.Size], device: torch.device) -> None:
        self.flat = FlatLayout(shapes)
        self.rows = sum(1 if len(s) <= 1 else s[0] for s in self.flat.shapes)
        self.numel = sum(s.numel() for s in self.flat.shapes)
        self.lengths = _row_lengths(self.flat, torch.device(device))
        self.row_of = torch.repeat_interleave(self.lengths, output_size=self.numel)  # no host read for the size

    def part_bytes(self, counts: Sequence[int]) -> list[int]:
        """The bytes (4 per scale, 1 per value) of consecutive parts of the packed list, ``counts`` tensors each."""
        out, start = [], 0
        for count in counts:
            shapes = self.flat.shapes[start: start + count]
            out.append(sum(s.numel() + 4 * (1 if len(s) <= 1 else s[0]) for s in shapes))
            start += count
        return out


#: The row lengths of the layouts coded so far, by shapes, device and CUDA stream: a sync codes the same layouts every
#: time, and a tensor made from host numbers is a blocking copy to an accelerator (a stream synchronization), made
#: once. Per stream: a tensor is only ever read on the stream it was made on (an overlapped round's side stream, or
#: the training stream), so freeing it (when the cache is cleared) cannot race with another stream's reads.
_LENGTHS: dict[tuple[tuple[torch.Size, ...], torch.device, Optional[int]], Tensor] = {}
_LENGTHS_KEPT = 64


def _row_lengths(flat: FlatLayout, device: torch.device) -> Tensor:
    """The length of every row (:func:`rows_view`) of ``flat``'s tensors in its order, int32 on ``device``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (tuple(flat.shapes), device, stream)
    found = _LENGTHS.get(key)
    if found is None:
        lengths: list[int] = []
        for i in flat.order:
            shape = flat.shapes[i]
            lengths.extend([shape.numel()] if len(shape) <= 1 else [math.prod(shape[1:])] * shape[0])
        found = torch.tensor(lengths, dtype=torch.int32, device=device)
        if len(_LENGTHS) >= _LENGTHS_KEPT:
            _LENGTHS.clear()
        _LENGTHS[key] = found
    return found


def pack_rows(xs: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], RowLayout]:
    """``xs`` coded with one scale per row (:func:`rows_view`) in one pass over all their values: the byte message
    (every scale as 4 bytes, then every value), what it carries dequantized (float32, shaped as ``xs``), and its
    layout. Every scale and value is :func:`quantize_int8`'s for that tensor alone."""
    device = xs[0].device if xs else torch.device("cpu")
    layout = RowLayout([x.shape for x in xs], device)
    flat = layout.flat.pack([x if x.dtype == torch.float32 else x.float() for x in xs]) if xs else torch.zeros(0)
    # per row: max|row| (NaN for a row holding NaN, Inf for one holding Inf but no NaN; 0 for an empty row)
    raw = torch.segment_reduce(flat.abs(), "max", lengths=layout.lengths, unsafe=True, initial=0.0).div_(INT8_LEVELS)
    scales = raw.nan_to_num(nan=math.nan, posinf=math.nan)  # a non-finite row: a NaN scale
    # divided by its row's scale, a value is 0/0 in a zero row, x/0 in a row whose scale underflows to 0 and x/Inf
    # or x/NaN in a non-finite row: each non-finite quotient is sent as 0, as quantize_int8 sends those rows
    spread = raw.index_select(0, layout.row_of)
    q = flat.div_(spread).nan_to_num_(0.0, 0.0, 0.0).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    del flat  # the float32 working copy goes before the dequantized one is made (4 bytes a value off the peak)
    message = torch.cat([scales.view(torch.int8), q])
    return message, layout.flat.unpack(q * spread), layout  # q * scale (0 * Inf is NaN: a non-finite row)


def mean_of_packed(messages: Tensor, layout: RowLayout) -> list[Tensor]:
    """The float32 mean of the workers' messages (``messages``: one row per worker, from :func:`pack_rows` with
    ``layout``), summed in worker order, shaped as the tensors packed. Worker by worker: one decoded copy at a
    time, whatever the number of workers."""
    world, rows = messages.shape[0], layout.rows
    if rows:  # each worker's scales as float32: a copy (its message's rows may start at any byte)
        scales = messages[:, : 4 * rows].clone(memory_format=torch.contiguous_format).view(torch.float32).unbind(0)
    else:
        scales = (messages.new_zeros(0, dtype=torch.float32),) * world
    values = messages[:, 4 * rows:].unbind(0)
    total = values[0] * scales[0].index_select(0, layout.row_of)  # int8 x float32: float32, exactly q * scale
    for w in range(1, world):  # summed in worker order
        total.add_(values[w] * scales[w].index_select(0, layout.row_of))
    if world > 1:
        total.div_(world)
    return layout.flat.unpack(total)
