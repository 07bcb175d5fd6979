"""Small tensor helpers shared by every layer: canonical orientation, orthonormalization, finiteness, byte sizes,
norms and seeds. Pure torch: no distributed, no Lightning, no other module of this package."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

_SEED_MODULUS = 2**63


def canonical(t: Tensor, p: Tensor) -> Tensor:
    """``t`` (shaped like the 2-D ``p``) as an ``a x b`` view with ``a <= b`` (SPEC §2: a tall matrix is worked on
    transposed); applied twice it gives ``t`` back."""
    return t.mT if p.shape[0] > p.shape[1] else t


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for matrices, or for stacks of them as one ``bmm`` (``@`` on stacks dispatches four ops: it expands
    and reshapes its operands around the ``bmm``)."""
    return torch.bmm(a, b) if a.dim() == 3 and b.dim() == 3 else a @ b


def flat_cat(tensors: Sequence[Tensor]) -> Tensor:
    """The values of ``tensors`` (one dtype and device), one after another, in one new 1-D tensor. One dispatched op
    (``_chunk_cat``, as FSDP2 packs its buckets) instead of a view per tensor and a ``cat``; 0-d tensors take the
    general path, as do empty ones (which ``_chunk_cat`` refuses)."""
    if tensors and all(t.dim() > 0 and t.numel() > 0 for t in tensors):
        return torch._chunk_cat(list(tensors), dim=0, num_chunks=1).view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


class FlatLayout:
    """Where each of a list of tensors (one dtype and device) sits in one flat 1-D buffer, laid out so that getting
    them back costs a few dispatched ops per distinct trailing shape (``shape[1:]``) instead of a view per tensor:
    the tensors of one trailing shape are adjacent, so one view of their segment as ``(-1, *trailing)`` and one split
    along the first dimension give them back shaped (0-d tensors take a view each). Elementwise work on the buffer
    gives each element the value it would have in any other layout; an all-reduce too with 2 workers, while with
    more a ring's summation order depends on an element's position (float32 rounding)."""

    def __init__(self, shapes: Sequence[torch.Size]) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        groups: dict[object, list[int]] = defaultdict(list)
        for i, shape in enumerate(self.shapes):
            groups[tuple(shape[1:]) if len(shape) else ("0-d", i)].append(i)
        self.groups = list(groups.items())
        self.order = [i for _, idx in self.groups for i in idx]

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        """The tensors (shaped as ``shapes``) in one new 1-D buffer, in this layout's order."""
        return flat_cat([tensors[i] for i in self.order])

    def unpack(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` (made by :meth:`pack`, or any buffer of the same layout) shaped as ``shapes``, in their
        original order."""
        sizes = [sum(self.shapes[i].numel() for i in idx) for _, idx in self.groups]
        segments = flat.split(sizes) if len(sizes) > 1 else (flat,)
        out: list[Tensor] = [flat] * len(self.shapes)
        for segment, (key, idx) in zip(segments, self.groups):
            if len(idx) == 1:
                shape = self.shapes[idx[0]]
                out[idx[0]] = segment if segment.shape == shape else segment.view(shape)
                continue
            counts = [self.shapes[i][0] for i in idx]
            rows = segment if len(key) == 0 else segment.view(sum(counts), *key)  # type: ignore[arg-type]
            for i, part in zip(idx, rows.split(counts)):
                out[i] = part
        return out


def is_tall(t: Tensor) -> bool:
    return t.shape[0] > t.shape[1]


def orthonormalize(y: Tensor) -> Tensor:
    """Orthonormal columns spanning ``y``'s (Householder QR: orthonormal even when ``y`` is rank-deficient);
    batched over leading dimensions."""
    return torch.linalg.qr(y, mode="reduced").Q


def orthonormalize_each(ys: Sequence[Tensor]) -> list[Tensor]:
    """:func:`orthonormalize` of every matrix of ``ys``, one batched QR per shape (and dtype and device): the same
    factors up to float32 rounding, and on an accelerator one batched kernel instead of a small one per matrix."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, y in enumerate(ys):
        groups[(tuple(y.shape), y.dtype, y.device)].append(i)
    out: list[Tensor] = list(ys)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = orthonormalize(ys[idx[0]])
            continue
        for i, q in zip(idx, orthonormalize(torch.stack([ys[i] for i in idx])).unbind(0)):
            out[i] = q
    return out


def mix_seed(base: int, index: int, generation: int = 0, offset: int = 0) -> int:
    """One seed from a base seed, an index (which matrix), a generation (which round) and an offset (which use),
    identical on every worker that passes the same numbers."""
    return (base * 1_000_003 + offset + index * 7_919 + generation) % _SEED_MODULUS


def seeded_normal(shape: Sequence[int], seed: int, device: torch.device) -> Tensor:
    """Standard normal float32 numbers from a CPU generator seeded with ``seed`` (the same on every machine)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(device)


def random_orthonormal(a: int, r: int, seed: int, device: torch.device) -> Tensor:
    """A seeded random ``a x r`` matrix with orthonormal columns (identical for identical seeds)."""
    return orthonormalize(seeded_normal((a, r), seed, device))


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of every floating tensor is finite (one host synchronization per device)."""
    per_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            per_device[t.device].append(torch.isfinite(t).all())
    return all(bool(torch.stack(flags).all()) for flags in per_device.values())


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """One bool per tensor, whether its L2 norm is finite (NaN or Inf in it, or a norm past the float range), computed
    where the tensors are and not read: a caller combines many such flags into one host read. Empty: ``[]`` on the
    CPU. The norms come from one ``_foreach_norm`` per device; :func:`norms` returns them."""
    return are_finite(norms(tensors))


def are_finite(magnitudes: Tensor) -> Tensor:
    """Whether each of ``magnitudes`` (norms or absolute values: each non-negative, ``+inf`` or NaN) is finite, as
    ``isfinite`` says, in one op where ``isfinite`` dispatches four (it is composite): ``x < inf`` is false exactly
    for ``+inf`` and NaN."""
    return magnitudes < math.inf


def norms(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of each tensor (:func:`norm_list`), stacked on the first tensor's device."""
    if not tensors:
        return torch.zeros(0)
    first = tensors[0].device
    return torch.stack([n.to(first) for n in norm_list(tensors)])


def norm_list(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor, accumulated in float32 at least (a float16 tensor's own norm would overflow at
    65504), as float32 0-d tensors on the tensors' devices: one ``_foreach_norm`` per device and precision, no host
    read (a caller that stacks norms of several calls stacks once)."""
    kinds: dict[tuple[torch.device, bool], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        kinds[(t.device, t.dtype == torch.float64)].append(i)
    found: dict[int, Tensor] = {}
    for (_, wide), index in kinds.items():
        part = [tensors[i] for i in index]  # float64 keeps its own precision (float32 would narrow it)
        found.update(zip(index, [_narrow(n) for n in torch._foreach_norm(part)] if wide
                         else torch._foreach_norm(part, 2, torch.float32)))
    return [found[i] for i in range(len(tensors))]


def _narrow(norm: Tensor) -> Tensor:
    """A float64 norm in float32, a finite one past float32's range held at its largest value (not made infinite)."""
    return torch.where(norm.isfinite(), norm.clamp(max=torch.finfo(torch.float32).max), norm).float()


def nbytes(tensors: Iterable[Tensor]) -> int:
    """numel x itemsize, summed."""
    return sum(t.numel() * t.element_size() for t in tensors)


def digest(tensors: Iterable[Tensor], chunk_bytes: int = 64 * 1024 * 1024) -> bytes:
    """The SHA-256 digest of the tensors' dtypes, shapes and raw bytes, in order (equal digests: bitwise-equal
    tensors). A device tensor is read through host memory ``chunk_bytes`` at a time."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        raw = t.detach().reshape(-1)
        if raw.numel() == 0:
            continue
        raw = raw.contiguous().view(torch.uint8)
        for start in range(0, raw.numel(), chunk_bytes):
            h.update(raw[start : start + chunk_bytes].cpu().numpy().tobytes())
    return h.digest()


def total_norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm of all ``tensors`` together (0 for none)."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRDO computes in for parameters of ``dtype``: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
