"""A low-rank payload's round gives the optimizer its new bases and the norms of its updates (issue 29, B6): the new
basis of a matrix it sent is its ``Q = orth(P)`` (SPEC §5), not a power step on the dense ``Q B``; and ``|Q B|`` is
``|B|``. Checked against float64 references on random inputs."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.lowrank import LowRankPayload


def _round(projection: str, layout: str, seed: int, payload_rank: int = 4):
    """An optimizer over five matrices (three of one shape, a tall one, another shape) and one payload round on
    random pseudo-gradients; the optimizer's bases from a first source, so that the power step has a warm start."""
    torch.manual_seed(seed)
    layers = [nn.Linear(40, 24, bias=False) for _ in range(3)] + [nn.Linear(16, 48, bias=False),
                                                                   nn.Linear(32, 20, bias=False)]
    params = [m.weight for m in layers]
    opt = LoRDO(params, rank=4, projection=projection, layout=layout)
    opt.install_bases({p: torch.randn(p.shape) for p in params})
    payload = LowRankPayload([payload_rank] * len(params), seed=seed, batched=layout == "stacked")
    comm = Communicator(CommAccountant(), timedelta(seconds=30))
    result = payload.reduce(comm, [torch.randn(p.shape) for p in params])
    return opt, params, result


def _projector(q: torch.Tensor) -> torch.Tensor:
    q = q.double()
    return q @ q.mT


@pytest.mark.parametrize("layout", ["in_place", "stacked"])
@pytest.mark.parametrize("seed", range(3))
def test_the_power_projection_takes_the_payloads_basis_which_spans_what_the_power_step_on_q_b_finds(
        layout: str, seed: int) -> None:
    opt, params, result = _round("power", layout, seed)
    spans = dict(zip(params, result.bases, strict=True))
    sources = dict(zip(params, result.averaged, strict=True))
    taken = opt.compute_bases(sources, spans=spans)
    assert list(taken) == params and all(taken[p] is spans[p] for p in params)  # as it is: no product, no QR
    # a source may be left out where its span is given: the streamed sync never makes Q B for these
    assert all(opt.compute_bases({}, spans=spans)[p] is spans[p] for p in params)
    recomputed = opt.compute_bases(sources)  # the power step on the dense Q B, warm-started: the same subspace
    for p, q in zip(params, result.bases, strict=True):
        assert torch.allclose(q.double().mT @ q.double(), torch.eye(q.shape[1], dtype=torch.float64), atol=1e-5)
        assert torch.allclose(_projector(recomputed[p]), _projector(q), atol=1e-4)


@pytest.mark.parametrize("layout", ["in_place", "stacked"])
def test_other_projections_and_other_ranks_compute_their_own_bases(layout: str) -> None:
    opt, params, result = _round("svd", layout, 0)
    spans = dict(zip(params, result.bases, strict=True))
    computed = opt.compute_bases(dict(zip(params, result.averaged, strict=True)), spans=spans)
    assert all(computed[p] is not spans[p] for p in params)  # the exact SVD the user asked for
    opt, params, result = _round("power", layout, 0, payload_rank=3)  # a payload at another rank than the basis
    spans = dict(zip(params, result.bases, strict=True))
    computed = opt.compute_bases(dict(zip(params, result.averaged, strict=True)), spans=spans)
    assert all(computed[p].shape[-1] == 4 for p in params)


@pytest.mark.parametrize("batched", [False, True])
def test_a_rounds_norms_are_its_updates_norms(batched: bool) -> None:
    """``|Q B| = |B|`` for an orthonormal ``Q``: the round's norms against the float64 norm of its applied update."""
    torch.manual_seed(0)
    shapes = [(24, 40), (24, 40), (40, 24), (8, 12)]
    payload = LowRankPayload([4, 4, 4, 2], seed=1, batched=batched)
    comm = Communicator(CommAccountant(), timedelta(seconds=30))
    for _ in range(3):
        result = payload.reduce(comm, [torch.randn(s) for s in shapes])
        assert len(result.norms) == len(shapes)
        for n, update in zip(result.norms, result.averaged, strict=True):
            assert n.dtype == torch.float32 and n.dim() == 0
            want = torch.linalg.vector_norm(update.double())
            assert abs(n.double() - want) <= 1e-5 * want
        payload.commit(result)
