"""The setup broadcast is skipped when a digest shows every worker already holds rank 0's tensors."""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from strategy_helpers import gloo_worker, run_fork_job

from lightning_lordo._tensors import digest
from lightning_lordo.comm.communicator import CommAccountant, Communicator


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.tensor(2.5),
            torch.empty(0, 4), torch.arange(6, dtype=torch.int64), torch.tensor([True, False])]


def test_digest_is_equal_for_equal_tensors_and_differs_on_any_change() -> None:
    base = digest(_tensors())
    assert base == digest([t.clone() for t in _tensors()]) and len(base) == 32
    assert base == digest(_tensors(), chunk_bytes=3)  # chunking reads the same bytes
    changed = []
    for i in range(len(_tensors())):
        for change in ("value", "dtype", "shape"):
            ts = _tensors()
            t = ts[i]
            if change == "value" and t.numel():
                flat = t.reshape(-1)
                flat[-1] = ~flat[-1] if t.dtype == torch.bool else flat[-1] + 1
            elif change == "dtype":
                ts[i] = t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
            elif change == "shape":
                ts[i] = t.reshape(1, *t.shape)
            else:
                continue
            changed.append(digest(ts))
    assert base not in changed and len(set(changed)) == len(changed)
    assert digest([torch.zeros(2)]) != digest([torch.zeros(2).neg()])  # -0.0: bitwise, not numerically equal
    assert digest(_tensors()[:2]) != base  # the number of tensors counts too


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for case in ("identical", "rank1_differs", "last_rank_differs"):
        comm = Communicator(CommAccountant(), timedelta(seconds=20))
        tensors = _tensors()
        if (case == "rank1_differs" and rank == 1) or (case == "last_rank_differs" and rank == world - 1):
            tensors[1].add_(1)  # one bfloat16 tensor differs
        sent = comm.broadcast_unless_identical(tensors, "setup_broadcast")
        results[case] = {"sent": sent, "tensors": tensors, "bytes": comm.accountant.totals["setup_broadcast"],
                         "wire": comm.accountant.wire_totals["setup_broadcast"]}
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_runs_only_when_a_worker_differs(world: int, tmp_path: Path) -> None:
    ranks = run_fork_job(partial(gloo_worker, body=_scenarios), world, tmp_path, timeout=120)
    model_bytes = sum(t.numel() * t.element_size() for t in _tensors())
    for case in ("identical", "rank1_differs", "last_rank_differs"):
        sent = {r[case]["sent"] for r in ranks}
        assert sent == {case != "identical"}, (case, sent)  # every worker gets the same answer
        for rank, r in enumerate(ranks):
            for mine, reference in zip(r[case]["tensors"], _tensors()):  # rank 0's values everywhere
                assert mine.dtype == reference.dtype and torch.equal(mine, reference), (case, rank)
            broadcast = case != "identical"
            # the digest: 32 bytes per worker, an all-gather ((M-1) x 32 on the wire); the broadcast: counted on
            # the sender, its wire bytes ((M-1)/M of the tensors) on every worker
            assert r[case]["bytes"] == 32 + (model_bytes if broadcast and rank == 0 else 0), (case, rank)
            wire_broadcast = sum(t.numel() * t.element_size() * (world - 1) // world for t in _tensors())
            assert r[case]["wire"] == (world - 1) * 32 + (wire_broadcast if broadcast else 0), (case, rank)
