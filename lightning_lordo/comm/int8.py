"""Symmetric int8 quantization with one float32 scale per row: the pure codec under the int8 payloads
(:mod:`lightning_lordo.comm.quantization`'s all-gather and :mod:`lightning_lordo.comm.reduce_scatter`).

:func:`pack_rows` and :func:`mean_of_packed` code a list of tensors as one byte message. Scales being per row, the
rows of every tensor with the same row length are stacked and coded in one pass: a message costs a few dispatched
ops per row length, not a dozen per tensor, and every value is the one a tensor-by-tensor codec gives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

INT8_LEVELS = 127  # symmetric: q in [-127, 127]


def rows_view(x: Tensor) -> Tensor:
    """``x`` as a 2-D matrix of rows, each row getting its own int8 scale.

    0-D and 1-D tensors are one row; higher-dimensional ones are ``x.shape[0]`` rows (e.g. one per output unit of
    a weight, one per token of an embedding)."""
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x if x.dim() == 2 else x.reshape(x.shape[0], -1)  # no op for a matrix


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
    finite = amax.isfinite()  # a row holding NaN or Inf has a non-finite largest magnitude
    scales = torch.where(finite, amax / INT8_LEVELS, math.nan)
    safe = torch.where(scales > 0, scales, 1.0)  # zero rows (and NaN scales): divide by 1
    q = torch.where(finite, rows / safe, 0.0).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q, scales.view(-1)


def dequantize_int8(q: Tensor, scales: Tensor, shape: Optional[Sequence[int]] = None) -> Tensor:
    """float32 ``q * scale`` per row, reshaped to ``shape`` when given (the inverse of :func:`quantize_int8`)."""
    out = q.float() * scales[:, None]
    return out.reshape(tuple(shape)) if shape is not None else out


#: How :func:`pack_rows` laid a message out: per row length, the tensors' indices, their row counts and shapes.
Layout = list[tuple[int, list[int], list[int], list[torch.Size]]]


def pack_rows(xs: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], Layout]:
    """``xs`` coded with one scale per row (:func:`rows_view`), stacked by row length: the byte message (every
    scale as 4 bytes, then every value), what it carries dequantized (float32, shaped as ``xs``), and its layout."""
    by_length: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        by_length.setdefault(_row_length(x), []).append(i)
    layout: Layout = [(n, idx, [1 if xs[i].dim() <= 1 else xs[i].shape[0] for i in idx], [xs[i].shape for i in idx])
                      for n, idx in by_length.items()]
    packed = [quantize_int8(_stack_rows([xs[i] for i in idx])) for _, idx, _, _ in layout]
    message = torch.cat([s.view(torch.int8) for _, s in packed] + [q.reshape(-1) for q, _ in packed])
    sent = _unstack([dequantize_int8(q, s) for q, s in packed], layout, len(xs))
    return message, sent, layout


def mean_of_packed(messages: Tensor, layout: Layout, count: int) -> list[Tensor]:
    """The float32 mean of the workers' messages (``messages``: one row per worker, from :func:`pack_rows` with
    ``layout``), summed in worker order, shaped as the ``count`` tensors packed."""
    world, n_scales = messages.shape[0], sum(sum(counts) for _, _, counts, _ in layout)
    scales = messages[:, : 4 * n_scales].reshape(-1).view(torch.float32).view(world, n_scales)  # a copy
    at_scale, at_value, total = 0, 4 * n_scales, []
    for n, _, counts, _ in layout:  # the rows of one length, worker by worker: one decoded copy at a time
        k = sum(counts)
        values = messages[:, at_value: at_value + k * n].view(world, k, n)
        acc = values[0].float() * scales[0, at_scale: at_scale + k, None]
        for w in range(1, world):  # summed in worker order
            acc.add_(values[w].float() * scales[w, at_scale: at_scale + k, None])
        total.append(acc)
        at_scale, at_value = at_scale + k, at_value + k * n
    if world > 1:
        torch._foreach_div_(total, world)
    return _unstack(total, layout, count)


def _row_length(x: Tensor) -> int:
    """The length of ``x``'s rows in :func:`rows_view`, without making the view."""
    return x.numel() if x.dim() <= 1 else math.prod(x.shape[1:])


def _stack_rows(xs: Sequence[Tensor]) -> Tensor:
    """The rows (:func:`rows_view`) of ``xs``, all of one row length, one after another in one matrix: one op for
    1-D tensors (``stack``), none for a single matrix."""
    if len(xs) == 1:
        return rows_view(xs[0])
    if all(x.dim() == 1 for x in xs):
        return torch.stack(list(xs))
    return torch.cat([rows_view(x) for x in xs])


def _unstack(stacks: Sequence[Tensor], layout: Layout, count: int) -> list[Tensor]:
    """The tensors (shaped as packed) in their original order, as views of the per-length ``stacks``."""
    out: list[Optional[Tensor]] = [None] * count
    for stack, (_, idx, counts, shapes) in zip(stacks, layout):
        if len(idx) > 1 and all(len(shape) == 1 for shape in shapes):  # 1-D tensors, a row each: no view per row
            parts = stack.unbind(0)
        else:
            parts = stack.split(counts) if len(idx) > 1 else (stack,)
        for i, part, shape in zip(idx, parts, shapes):
            out[i] = part if part.shape == shape else part.reshape(shape)
    return out  # type: ignore[return-value]
