"""Unit tests of ``lightning_lordo.optim.projection`` (SPEC §4.4-4.5) against float64 references.

The references are computed here in float64 (``torch.linalg.svd``/``qr`` on float64 inputs and the formula
of SPEC §4.5 written out), on random, never-zero inputs of tall, wide and square shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_lordo._tensors import orthonormalize, orthonormalize_each
from lightning_lordo.optim.projection import (
    compute_basis,
    power_basis,
    random_basis,
    randomized_basis,
    rotate_moments,
    subspace_movement,
    svd_basis,
)

# canonical orientation a x b with a <= b; "square" included
SHAPES = {"narrow": (5, 13), "wide": (8, 30), "square": (9, 9)}
RANK = 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spectrum_matrix(a: int, b: int, singular: list[float], seed: int) -> tuple[Tensor, Tensor]:
    """A float64 a x b matrix with the given singular values (the rest zero) and its left singular vectors."""
    gen = _gen(seed)
    u = torch.linalg.qr(torch.randn(a, a, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(b, a, generator=gen, dtype=torch.float64)).Q
    s = torch.zeros(a, dtype=torch.float64)
    s[: len(singular)] = torch.tensor(singular, dtype=torch.float64)
    return u @ torch.diag(s) @ v.T, u


def _projector_distance(q: Tensor, ref: Tensor) -> float:
    """||Q Q^T - R R^T||_F in float64: 0 when both bases span the same subspace."""
    q, ref = q.double(), ref.double()
    return (q @ q.T - ref @ ref.T).norm().item()


def _assert_orthonormal(q: Tensor, tol: float = 1e-5) -> None:
    eye = torch.eye(q.shape[1], dtype=torch.float64)
    assert (q.double().T @ q.double() - eye).abs().max().item() < tol


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rotate_moments_matches_spec_formula(shape):
    """u' = C u; v' = b2 |(C o C)(v/b2 - u o u/b1^2) + u' o u'/b1^2| (SPEC §4.5), C any r x r matrix."""
    r, b = RANK, shape[1]
    gen = _gen(1)
    u = torch.randn(r, b, generator=gen)
    # v small against u^2 (v/b2 - u^2/b1^2 < 0), so the sum inside |.| takes both signs and |.| acts
    v = (torch.rand(r, b, generator=gen) + 0.01) * 1e-3
    c = torch.randn(r, r, generator=gen)
    bias1, bias2 = 1 - 0.9**3, 1 - 0.999**3
    u_in, v_in = u.clone(), v.clone()
    new_u, new_v = rotate_moments(u, v, c, bias1, bias2)
    u64, v64, c64 = u.double(), v.double(), c.double()
    ref_u = c64 @ u64
    inner = (c64 * c64) @ (v64 / bias2 - u64 * u64 / bias1**2) + ref_u * ref_u / bias1**2
    ref_v = bias2 * inner.abs() + _unseen(c64, v64)
    assert (inner < 0).any() and (inner > 0).any()  # both branches of |.| are exercised
    torch.testing.assert_close(new_u.double(), ref_u, rtol=1e-5, atol=1e-6 * ref_u.abs().max().item())
    torch.testing.assert_close(new_v.double(), ref_v, rtol=1e-5, atol=1e-6 * ref_v.abs().max().item())
    assert new_u.dtype == new_v.dtype == torch.float32
    assert torch.equal(u, u_in) and torch.equal(v, v_in)  # the inputs are not modified


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rotate_moments_with_variance_clamp(shape):
    """clamp=True (LDAdam, the authors): the variance v/b2 - u o u/b1^2 is clamped at 0 before rotating, so
    v' = b2 ((C o C) max(v/b2 - u o u/b1^2, 0) + u' o u'/b1^2), nonnegative without an absolute value."""
    r, b = RANK, shape[1]
    gen = _gen(5)
    u = torch.randn(r, b, generator=gen)
    v = (torch.rand(r, b, generator=gen) + 0.01) * 1e-2  # some variances negative, some positive
    c = torch.randn(r, r, generator=gen)
    bias1, bias2 = 1 - 0.9**3, 1 - 0.999**3
    new_u, new_v = rotate_moments(u, v, c, bias1, bias2, clamp=True)
    u64, v64, c64 = u.double(), v.double(), c.double()
    variance = v64 / bias2 - u64 * u64 / bias1**2
    assert (variance < 0).any() and (variance > 0).any()  # the clamp acts on some entries only
    ref_u = c64 @ u64
    ref_v = bias2 * ((c64 * c64) @ variance.clamp(min=0) + ref_u * ref_u / bias1**2) + _unseen(c64, v64)
    torch.testing.assert_close(new_u.double(), ref_u, rtol=1e-5, atol=1e-6 * ref_u.abs().max().item())
    torch.testing.assert_close(new_v.double(), ref_v, rtol=1e-5, atol=1e-6 * ref_v.abs().max().item())
    _, unclamped = rotate_moments(u, v, c, bias1, bias2)
    assert (unclamped - new_v).abs().max() > 1e-3 * new_v.abs().max()  # it changes the result here


def _unseen(c: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The second moment a new direction gets for the part of it the old basis did not see: ``1 - |row i of C|^2``
    (at least 0) times the old coordinates' mean second moment, per column."""
    return (1 - (c * c).sum(dim=1, keepdim=True)).clamp(min=0) * v.mean(dim=0, keepdim=True)


def test_rotate_moments_seeds_unseen_directions():
    """A new direction orthogonal to the old subspace gets no mean (u' = 0 there) and the old coordinates' mean
    second moment, not zero: a first gradient there is then normalized like the others, not blown up by ~3x."""
    u, v = torch.randn(4, 6, generator=_gen(3)), torch.rand(4, 6, generator=_gen(4)) + 0.1
    old = torch.eye(8)[:, :4]
    new = torch.eye(8)[:, [0, 1, 4, 5]]  # two directions kept, two unseen
    new_u, new_v = rotate_moments(u, v, new.T @ old, 0.5, 0.1)
    assert torch.equal(new_u[2:], torch.zeros(2, 6))
    torch.testing.assert_close(new_v[2:], v.mean(dim=0, keepdim=True).expand(2, 6))
    torch.testing.assert_close(new_v[:2], v[:2])


def test_rotate_moments_identity_and_signed_permutation():
    """C = I leaves the moments unchanged; C a signed permutation permutes u (with signs) and v (without)."""
    gen = _gen(2)
    u, v = torch.randn(4, 6, generator=gen), torch.rand(4, 6, generator=gen) + 0.5
    same_u, same_v = rotate_moments(u, v, torch.eye(4), 0.3, 0.02)
    torch.testing.assert_close(same_u, u)
    torch.testing.assert_close(same_v, v, rtol=1e-5, atol=1e-6)
    p = torch.eye(4)[[2, 0, 3, 1]] * torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None]
    perm_u, perm_v = rotate_moments(u, v, p, 0.3, 0.02)
    torch.testing.assert_close(perm_u, p @ u)
    torch.testing.assert_close(perm_v, p.abs() @ v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_svd_basis_is_top_left_singular_subspace(shape):
    a, b = shape
    m, u = _spectrum_matrix(a, b, [9.0, 5.0, 3.0, 1.0, 0.5], seed=3)
    q = svd_basis(m.float(), RANK)
    assert q.shape == (a, RANK) and q.dtype == torch.float32 and q.is_contiguous()
    _assert_orthonormal(q)
    assert _projector_distance(q, u[:, :RANK]) < 1e-5
    assert _projector_distance(q, u[:, 1 : RANK + 1]) > 1.0  # a wrong subspace is far


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_power_basis(shape):
    """Warm-started block power iteration: many steps converge to the top-r subspace; from a warm start that
    already spans it, one step stays there (and never returns a non-orthonormal basis)."""
    a, b = shape
    m, u = _spectrum_matrix(a, b, [9.0, 7.0, 5.0, 1.0, 0.5], seed=4)
    warm = random_basis(a, RANK, seed=5, device=torch.device("cpu"))
    one = power_basis(m.float(), warm, iters=1)
    many = power_basis(m.float(), warm, iters=30)
    _assert_orthonormal(one)
    _assert_orthonormal(many)
    assert _projector_distance(many, u[:, :RANK]) < 1e-4
    assert _projector_distance(one, u[:, :RANK]) > _projector_distance(many, u[:, :RANK])
    exact = u[:, :RANK].float()
    stay = power_basis(m.float(), exact, iters=1)
    assert _projector_distance(stay, exact) < 1e-5


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_randomized_basis_recovers_a_low_rank_range(shape):
    a, b = shape
    m, u = _spectrum_matrix(a, b, [4.0, 2.0, 1.0], seed=6)  # exactly rank 3
    q = randomized_basis(m.float(), RANK, oversample=2, iters=1, seed=7)
    assert q.shape == (a, RANK)
    _assert_orthonormal(q)
    assert _projector_distance(q, u[:, :RANK]) < 1e-4
    m5, u5 = _spectrum_matrix(a, b, [9.0, 7.0, 5.0, 1.0, 0.5], seed=8)  # truncation to the top r by SVD
    q5 = randomized_basis(m5.float(), RANK, oversample=4, iters=2, seed=9)
    assert _projector_distance(q5, u5[:, :RANK]) < 0.05
    assert torch.equal(q5, randomized_basis(m5.float(), RANK, oversample=4, iters=2, seed=9))  # seeded


def test_random_basis_is_seeded_and_orthonormal():
    q1 = random_basis(12, 4, seed=10, device=torch.device("cpu"))
    q2 = random_basis(12, 4, seed=10, device=torch.device("cpu"))
    q3 = random_basis(12, 4, seed=11, device=torch.device("cpu"))
    assert q1.shape == (12, 4) and q1.dtype == torch.float32
    _assert_orthonormal(q1)
    assert torch.equal(q1, q2) and not torch.allclose(q1, q3)


def test_compute_basis_dispatch():
    """``svd`` is exact; ``power`` with a warm start runs power steps from it; ``power`` without one falls back
    to the randomized range finder with the same seed and steps; bf16 inputs give float32 bases."""
    m, _ = _spectrum_matrix(6, 10, [5.0, 4.0, 3.0, 2.0, 1.0], seed=12)
    m = m.float()
    warm = random_basis(6, RANK, seed=13, device=torch.device("cpu"))
    assert torch.equal(compute_basis(m, RANK, "svd"), svd_basis(m, RANK))
    assert torch.equal(compute_basis(m, RANK, "power", warm=warm, power_iters=2), power_basis(m, warm, 2))
    assert torch.equal(compute_basis(m, RANK, "power", power_iters=2, oversample=3, seed=14),
                       randomized_basis(m, RANK, 3, 2, 14))
    assert torch.equal(compute_basis(m, RANK, "randomized", warm=warm, power_iters=2, oversample=3, seed=14),
                       randomized_basis(m, RANK, 3, 2, 14))
    for method in ("svd", "power", "randomized"):
        assert compute_basis(m.bfloat16(), RANK, method, warm=warm).dtype == torch.float32


def test_subspace_movement_matches_formula():
    """1 - ||Q_new^T Q_old||_F^2 / r: 0 for the same subspace (any signed permutation), 1 for an orthogonal one."""
    full = torch.linalg.qr(torch.randn(10, 10, generator=_gen(15), dtype=torch.float64)).Q
    old = full[:, :RANK].float()
    assert subspace_movement(old, old).item() == pytest.approx(0.0, abs=1e-6)
    assert subspace_movement(old, old[:, [2, 0, 1]] * torch.tensor([1.0, -1.0, 1.0])).item() == pytest.approx(
        0.0, abs=1e-6)
    assert subspace_movement(old, full[:, RANK : 2 * RANK].float()).item() == pytest.approx(1.0, abs=1e-6)
    new = torch.linalg.qr(full[:, :RANK] + 0.5 * full[:, RANK : 2 * RANK]).Q
    expected = 1.0 - ((new.T @ full[:, :RANK]) ** 2).sum().item() / RANK
    assert 0.05 < expected < 0.95
    assert subspace_movement(old, new.float()).item() == pytest.approx(expected, abs=1e-6)


def test_orthonormalize_each_is_one_qr_per_matrix() -> None:
    """The batched QR per shape (the low-rank payload's bases and right factors) against a QR per matrix: the same
    factor up to float32 rounding (LAPACK's batched path may round differently), signs included."""
    g = torch.Generator().manual_seed(3)
    ys = [torch.randn(40, 4, generator=g) for _ in range(3)] + [torch.randn(9, 33, generator=g).mT,
                                                                  torch.randn(12, 3, generator=g)]
    ys.append(torch.randn(33, 9, generator=g))  # the shape of a transposed one, stacked with it
    got = orthonormalize_each(ys)
    assert len(got) == len(ys)
    for y, q in zip(ys, got):
        assert torch.allclose(q, orthonormalize(y), atol=1e-6)
        assert torch.allclose(q.mT @ q, torch.eye(q.shape[1]), atol=1e-5)
