r"""Bases of rank-r subspaces and the rotation of Adam moments between them (SPEC §4.4-4.5).

All functions are pure tensor math in float32, whatever the dtype of their inputs. A matrix ``M`` is
``a x b`` in the canonical orientation (``a <= b``); a basis ``Q`` is ``a x r`` with orthonormal columns
spanning (an estimate of) the top-r left singular subspace of ``M``.

Random numbers come from a CPU generator seeded explicitly, so every rank that passes the same seed and
the same ``M`` gets the same basis, bit for bit, on the same hardware.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import matmul, orthonormalize, random_orthonormal, seeded_normal

random_basis = random_orthonormal  # a seeded random ``a x r`` orthonormal basis


def power_basis(m: Tensor, warm: Tensor, iters: int) -> Tensor:
    """Block power iteration on ``M M^T`` warm-started from ``warm`` (``iters`` steps, QR after each); batched over
    leading dimensions (a stack of same-shape matrices is one batched matmul and one batched QR per step)."""
    m = m.float()
    q = warm.float()
    for _ in range(iters):
        q = orthonormalize(matmul(m, matmul(m.mT, q)))
    return q


def randomized_basis(m: Tensor, r: int, oversample: int, iters: int, seed: int) -> Tensor:
    """Randomized range finder (Halko et al.) with ``iters`` power steps, truncated to rank ``r`` by SVD."""
    m = m.float()
    k = min(r + oversample, m.shape[0])
    y = orthonormalize(m @ seeded_normal((m.shape[1], k), seed, m.device))
    for _ in range(iters):
        y = orthonormalize(m @ (m.mT @ y))
    u_small = torch.linalg.svd(y.mT @ m, full_matrices=False).U
    return y @ u_small[:, :r]


def svd_basis(m: Tensor, r: int) -> Tensor:
    """The exact top-``r`` left singular vectors of ``M`` (batched over leading dimensions)."""
    return torch.linalg.svd(m.float(), full_matrices=False).U[..., :r].contiguous()


def compute_basis(
    m: Tensor,
    r: int,
    method: str,
    warm: Optional[Tensor] = None,
    power_iters: int = 1,
    oversample: int = 4,
    seed: int = 0,
) -> Tensor:
    """A new rank-``r`` basis of the column space of ``m`` by ``method`` (``power``, ``randomized``, ``svd``).

    ``power`` needs a warm start; without one (the very first basis) it falls back to ``randomized`` with the
    same number of power steps, since one power step from a random start captures little.
    """
    if method == "svd":
        return svd_basis(m, r)
    if method == "power" and warm is not None:
        return power_basis(m, warm, power_iters)
    return randomized_basis(m, r, oversample, power_iters, seed)


def rotate_moments(
    exp_avg: Tensor, exp_avg_sq: Tensor, change: Tensor, bias1: float, bias2: float, clamp: bool = False
) -> tuple[Tensor, Tensor]:
    r"""Express Adam's moments in a new basis (LDAdam's projection-aware update, SPEC §4.5).

    With ``C = Q_new^T Q_old`` (``change``), :math:`b_1 = 1-\beta_1^t`, :math:`b_2 = 1-\beta_2^t`:

    .. math::
        u' = C u, \qquad
        v' = b_2 \left| (C \odot C)\left(\frac{v}{b_2} - \frac{u \odot u}{b_1^2}\right)
             + \frac{u' \odot u'}{b_1^2} \right|

    The second line treats each old coordinate as independent with mean :math:`\hat u` and variance
    :math:`\hat v - \hat u^2`, and takes the second moment of the rotated coordinate. A new direction that the old
    basis did not (fully) see, :math:`s_i = 1 - \sum_k C_{ik}^2 > 0`, adds :math:`s_i` times the old coordinates'
    mean ``v`` (per column): LDAdam's rule gives it a second moment of about 0, so the first gradient there (often
    the error feedback's burst) is divided by almost nothing and steps ~3x too far; with refreshes every few steps
    that fed the next basis and diverged (``tests/test_convergence.py``). That variance estimate can
    be negative (``v`` and ``u`` are separate moving averages); ``clamp`` sets it to 0 before rotating, as LDAdam
    does (then no absolute value is needed), otherwise the absolute value of the result is taken.
    """
    new_avg = matmul(change, exp_avg)
    variance = exp_avg_sq / bias2 - exp_avg.square() / bias1**2
    if clamp:
        variance.clamp_(min=0.0)
    squared = change.square()
    new_sq = (matmul(squared, variance) + new_avg.square() / bias1**2).abs_().mul_(bias2)
    unseen = torch.rsub(squared.sum(dim=-1, keepdim=True), 1.0).clamp_(min=0.0)  # 1 - |Q_old^T q_i|^2 per new i
    new_sq.addcmul_(unseen, exp_avg_sq.mean(dim=-2, keepdim=True))
    return new_avg, new_sq


def subspace_movement(old: Tensor, new: Tensor, change: Optional[Tensor] = None) -> Tensor:
    """How much of the old subspace the new basis lost: ``1 - ||Q_new^T Q_old||_F^2 / r`` in [0, 1] (one value per
    matrix of a stack; ``change``: ``Q_new^T Q_old`` when already computed)."""
    r = old.shape[-1]
    change = matmul(new.mT, old) if change is None else change
    return (1.0 - change.square().sum(dim=(-2, -1)) / r).clamp_(min=0.0)
