"""What a compressed sync holds on the general path (``tests/test_streamed_sync.py`` streams it bucket by bucket): once
the low-rank messages are made, the pseudo-gradients they came from are freed
(each message keeps its own sum with the error feedback), for the int8 messages joined in two all-gathers and for
the messages sent each by itself; and the round is the same as when the caller keeps them."""

from __future__ import annotations

import functools
import gc
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from strategy_helpers import gloo_worker, run_fork_job

from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.lowrank import LowRankPhases
from lightning_lordo.config import SyncConfig
from lightning_lordo.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.sync.synchronizer import Synchronizer


class _Tracker:
    """Follows the pseudo-gradients a sync computes (weakly, or holding them with ``keep``) and notes, at each
    ``take_p`` (after the P messages are made, before the B messages), which of them are still alive."""

    def __init__(self, deltas: Any, keep: bool) -> None:
        self.deltas, self.keep = deltas, keep
        self.refs: list[weakref.ref] = []
        self.held: list[torch.Tensor] = []
        self.last_alive: list[bool] = []  # at the sync's last take_p: every message of the sync is made by then

    def new_sync(self) -> None:
        self.refs, self.held = [], []

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        out = self.deltas(*args, **kwargs)
        self.refs += [weakref.ref(t) for t in out]
        if self.keep:
            self.held += out
        return out

    def seen(self) -> None:
        gc.collect()
        self.last_alive = [r() is not None for r in self.refs]


def _body(payload_dtype: str, rank: int, world: int) -> dict[str, Any]:
    from lightning_lordo.sync import bucketed

    bucketed.streams = lambda sync: False  # the general path (a forked worker's module): tests/test_streamed_sync.py
    results: dict[str, Any] = {}
    take_p = LowRankPhases.take_p
    for keep in (False, True):  # keep: the caller holds the pseudo-gradients (the reference)
        torch.manual_seed(0)
        net = CharGPT(vocab_size=128, d_model=32, n_layers=2, n_heads=2, seq_len=16, tie_weights=False)
        params = list(net.parameters())
        opt = LoRDO(params, rank=4, full_rank=full_rank_params(net))
        config = SyncConfig(sync_every=1, synchronous=False, payload="lowrank", payload_dtype=payload_dtype,
                            fullrank_rank=4)
        sync = Synchronizer(params, [], opt, config, Communicator(CommAccountant(), timedelta(seconds=60)))
        tracker = sync.anchor.deltas = _Tracker(sync.anchor.deltas, keep)
        LowRankPhases.take_p = lambda phases, *a, tracker=tracker, **k: (tracker.seen(), take_p(phases, *a, **k))[1]
        gen = torch.Generator().manual_seed(rank)
        alive = []
        try:
            for _ in range(3):
                tracker.new_sync()
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen) * 1e-2
                sync.before_optimizer_step()
                opt.step()
                sync.on_optimizer_step()
                alive.append(tracker.last_alive)
        finally:
            LowRankPhases.take_p = take_p
        lowrank = [i for _, positions, m, _ in sync.payloads.groups if type(m).__name__ == "LowRankPayload"
                   for i in positions]
        state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        results[keep] = {"alive": [[a[i] for i in lowrank] for a in alive], "lowrank": len(lowrank),
                         "tensors": [p.detach().clone() for p in params] + state}
    return results


@pytest.mark.parametrize("payload_dtype", ["int8", "bfloat16"], ids=["joined-int8", "each-bfloat16"])
def test_a_compressed_sync_frees_the_pseudo_gradients_once_its_messages_are_made(tmp_path: Path,
                                                                                  payload_dtype: str) -> None:
    for r in run_fork_job(functools.partial(gloo_worker, body=functools.partial(_body, payload_dtype)), 2, tmp_path,
                          90):
        freed, kept = r[False], r[True]
        assert freed["lowrank"] > 4 and freed["alive"]  # both payloads (the low-rank and the full-rank matrices)
        assert all(not any(a) for a in freed["alive"]), freed["alive"]
        assert all(all(a) for a in kept["alive"])  # the check sees a pseudo-gradient that is still held
        assert all(torch.equal(a, b) for a, b in zip(freed["tensors"], kept["tensors"], strict=True))
