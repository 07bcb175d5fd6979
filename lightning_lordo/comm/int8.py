"""Symmetric int8 quantization with one float32 scale per row: the pure codec under the int8 payloads
(:mod:`lightning_lordo.comm.quantization`'s all-gather and :mod:`lightning_lordo.comm.reduce_scatter`)."""

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
    return x.reshape(x.shape[0], -1)


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
    finite = torch.isfinite(rows).all(dim=1)
    scales = torch.where(finite, rows.abs().amax(dim=1) / INT8_LEVELS, torch.full_like(finite, math.nan,
                                                                                        dtype=torch.float32))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero rows (and NaN scales): divide by 1
    scaled = torch.where(finite[:, None], rows / safe[:, None], torch.zeros((), device=rows.device))
    q = scaled.round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor, shape: Optional[Sequence[int]] = None) -> Tensor:
    """float32 ``q * scale`` per row, reshaped to ``shape`` when given (the inverse of :func:`quantize_int8`)."""
    out = q.float() * scales[:, None]
    return out.reshape(tuple(shape)) if shape is not None else out
