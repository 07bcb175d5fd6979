"""A low-rank payload's round gives the optimizer its new bases and the norms of its updates (issue 29, B6): the new
basis of a matrix it sent is its ``Q = orth(P)`` (SPEC §5), not a power step on the dense ``Q B``; and ``|Q B|`` is
``|B|``. Checked against float64 references on random inputs."""

from __future__ import annotations

import functools
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.lowrank import LowRankPayload

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))  # strategy_helpers' memory module


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


CASES = {  # knobs -> whether a refresh takes the payload's bases
    "default": ({}, True),
    "broadcast_bases": ({"broadcast_bases": True}, True),
    "basis_every": ({"basis_every": 2}, False),  # the window's summed pseudo-gradients are no Q B
    "local_scope": ({"basis_scope": "local", "average_moments": False}, False),  # each worker's own
}


def _seen(rank: int, world: int) -> dict[str, Any]:
    """Per case, the number of bases each ``compute_bases`` call was given (``spans``) over 4 syncs."""
    from strategy_helpers import sync_rounds

    from lightning_lordo.config import SyncConfig
    from lightning_lordo.sync.synchronizer import Synchronizer

    seen: dict[str, list[int]] = {}
    original = LoRDO.compute_bases
    try:
        for name, (knobs, _) in CASES.items():
            calls: list[int] = []

            def compute_bases(self, sources, generation=None, spans=None, calls=calls):  # noqa: ANN001, ANN202
                calls.append(len(spans or {}))
                return original(self, sources, generation, spans)

            LoRDO.compute_bases = compute_bases  # type: ignore[method-assign]
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
            params = list(net.parameters())
            opt = LoRDO(params, lr=1e-2, rank=4)
            comm = Communicator(CommAccountant(), timedelta(seconds=60))
            config = SyncConfig(sync_every=2, synchronous=False, payload="lowrank", **knobs)
            sync = Synchronizer(params, [], opt, config, comm)
            assert len(list(sync_rounds(sync, opt, params, 8, rank))) == 4
            seen[name] = calls
    finally:
        LoRDO.compute_bases = original  # type: ignore[method-assign]
    return seen


@pytest.mark.timeout(120)
def test_a_sync_passes_the_payloads_bases_only_where_they_are_this_rounds_average(tmp_path: Path) -> None:
    """The wiring of B6 with 2 workers: a refresh from this round's average gets the payload's bases (also with
    ``broadcast_bases``), one from a window of rounds or from each worker's own pseudo-gradient does not."""
    from strategy_helpers import gloo_worker, run_fork_job

    for rank, seen in enumerate(run_fork_job(functools.partial(gloo_worker, body=_seen), 2, tmp_path, timeout=100)):
        for name, (_, takes) in CASES.items():
            if name == "broadcast_bases" and rank == 1:  # rank 0 computes the bases and sends them
                assert seen[name] == [], seen[name]
                continue
            refreshes = [n for n in seen[name] if n] if takes else seen[name]
            assert refreshes, (name, seen[name])
            assert all(n == 2 for n in refreshes) if takes else not any(seen[name]), (name, seen[name])
