"""A compressed sync with several processes streams its low-rank messages (``sync/bucketed.py``,
:meth:`~lightning_lordo.comm.lowrank.LowRankPayload.phases`): the pseudo-gradient, its averaged update and the new
error feedback are made a bucket at a time, never whole. It must give the general path's round bit for bit."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
from strategy_helpers import sync_rounds

from lightning_lordo import LoRDO
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.config import SyncConfig

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

CAP_MB = 0.15  # a stack of four 64 x 256 matrices is split in two
#: payload knobs, the LoRDO layout and other settings of each case: the compressed preset's messages (int8, the 2-D
#: full-rank parameters at rank 16), a float32 low-rank payload with the embeddings and the head sent in full, the
#: stacked layout's batched messages (stacks split by the cap; with a cap under two 64 x 256 matrices, stacks of
#: one), a rank that does not compress the 64 x 64 matrices (sent in full, their bases from their average), float64
#: weights, and a round made non-finite on one worker under the SVD projection (discarded, not an error). The bound
#: below counts a message sent in full at float32; the bfloat16 and int8 codecs hold a few more copies of such a
#: message, which the compressed preset does not send.
CASES = {
    "int8_fullrank_matrices": ({"payload_dtype": "int8", "fullrank_rank": 16}, None, {}),
    "float32": ({"payload_dtype": "float32"}, None, {}),
    "bfloat16_stacked": ({"payload_dtype": "bfloat16", "fullrank_rank": 16}, "stacked", {}),
    "int8_stacked": ({"payload_dtype": "int8", "fullrank_rank": 16}, "stacked", {}),
    "int8_stacks_of_one": ({"payload_dtype": "int8", "fullrank_rank": 16}, "stacked", {"cap_mb": 0.1}),
    "rank_sent_in_full": ({"payload_dtype": "float32"}, None, {"rank": 32}),
    "float64": ({"payload_dtype": "float32"}, None, {"dtype": torch.float64}),
    "svd_nan_discarded": ({"payload_dtype": "float32"}, None, {"projection": "svd", "nan_at": 3}),
}


def _worker(rank: int, port: int, out: str, case: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.convert import full_rank_params
    from lightning_lordo.models import CharGPT
    from lightning_lordo.sync import bucketed
    from lightning_lordo.sync.synchronizer import Synchronizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    knobs, layout, extra = CASES[case]
    cap = extra.get("cap_mb", CAP_MB)
    results = {}
    for path in ("streamed", "general"):
        if path == "general":
            bucketed.applies = lambda sync: False  # this forked process's module only
        torch.manual_seed(0)
        net = CharGPT(vocab_size=512, d_model=64, n_layers=4, n_heads=4, seq_len=32, tie_weights=False)
        net = net.to(extra.get("dtype", torch.float32))
        params = list(net.parameters())
        opt = LoRDO(params, rank=extra.get("rank", 4), full_rank=full_rank_params(net), layout=layout,
                    projection=extra.get("projection", "power"))
        comm = Communicator(CommAccountant(), timedelta(seconds=60))
        config = SyncConfig(sync_every=2, bucket_cap_mb=cap, payload="lowrank", **knobs)
        sync = Synchronizer(params, [], opt, config, comm)
        assert path == "general" or bucketed.streams(sync)  # the matrices pass one bucket
        peak, norms, errors = 0, [], []
        target = opt.lowrank_params()[0]

        def poison(step: int, target: torch.Tensor = target) -> None:
            if step == extra.get("nan_at") and rank == 1:  # one worker's low-rank matrix: the round is discarded
                target.data[0, 0] = float("nan")

        for report, live_peak in sync_rounds(sync, opt, params, 8, rank, before_sync=poison):
            # the first sync also creates the payloads' state (error feedback): resident
            peak = max(peak, live_peak if norms else 0)
            norms.append(report.pseudo_gradient_norm)
            errors.append(report.extra.get("sync_error_feedback_norm"))
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        payload_state = [t for s in sync.payloads.state_dict().values() for ts in s.values() for t in ts]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        copies = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(copies, flat)
        groups = {name: at for name, at, message, _ in sync.payloads.groups if isinstance(message, LowRankPayload)}
        ranks = [opt.lowrank_ranks()[params[i]] for i in groups.get("lowrank", [])] + \
            [16] * len(groups.get("fullrank_matrices", []))
        shapes = [params[i].shape for at in groups.values() for i in at]
        # what a round holds per low-rank matrix besides the buckets: messages, bases, factors and rotated moments
        messages = sum(r * sum(shape) * 4 for r, shape in zip(ranks, shapes, strict=True))
        results[path] = {"tensors": [p.detach().clone() for p in params] + sync.anchor.tensors + state + payload_state,
                         "norms": norms, "errors": errors, "peak": peak, "bytes": dict(comm.accountant.totals),
                         "identical": torch.equal(*copies), "messages": messages,
                         "streamed": [i for at in groups.values() for i in at],
                         "sizes": [p.numel() * p.element_size() for p in params], "cap": cap}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_stream_a_compressed_sync_as_the_general_path_does(tmp_path: Path, case: str) -> None:
    """Bit for bit the general path's parameters, anchor, optimizer state, payload state (error feedback, right
    factors), norms and bytes over four syncs, the replicas identical; and a transient of at most two buckets (the
    work and the update or the stacked bases' sources; a matrix larger than the cap is a bucket of its own), the
    pseudo-gradients of the parameters sent in full (norms, biases: held whole, twice with their averages), and the
    low-rank messages a few times over, where the general path holds the pseudo-gradient and its average."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(tmp_path / "run"), case), nprocs=2, start_method="fork")
    for rank in range(2):
        runs = torch.load(tmp_path / f"run.{rank}", weights_only=False)
        one, whole = runs["streamed"], runs["general"]
        assert one["identical"] and whole["identical"] and len(one["norms"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(one["tensors"], whole["tensors"], strict=True))
        assert torch.equal(*(torch.tensor(r["norms"]).nan_to_num(-1.0) for r in (one, whole)))  # a NaN's is NaN
        assert one["errors"] == whole["errors"]
        assert one["bytes"] == whole["bytes"]
        sizes, streamed = one["sizes"], set(one["streamed"])
        model, largest = sum(sizes), max(sizes[i] for i in streamed)
        in_full = sum(s for i, s in enumerate(sizes) if i not in streamed)
        assert whole["peak"] >= model  # the general path: the pseudo-gradient and its average, whole
        bound = 2 * max(one["cap"] * 2**20, largest) + 2 * in_full + 8 * one["messages"] + 64 * 1024
        extra = CASES[case][2]
        if "projection" in extra:  # the SVD's own outputs and workspace, a matrix's worth per call, are not counted
            continue
        assert one["peak"] <= bound and one["peak"] < whole["peak"], (one["peak"], bound, whole["peak"], model)
        if "rank" not in extra:  # at rank 32 the messages are about as large as these small matrices
            assert bound < whole["peak"], (bound, whole["peak"])


def test_a_streamed_round_is_the_held_rounds_value() -> None:
    """One process: the streamed phases give the eager phases' bases, right factors, error feedback and updates
    bit for bit, for the matrix-by-matrix and the batched payload with stacks split by the cap (stacks of one matrix
    too, which must round as a stack: a lone matrix's products round otherwise on the CPU)."""
    from datetime import timedelta

    from lightning_lordo.comm.communicator import CommAccountant, Communicator

    torch.manual_seed(1)
    # batched, the cap splits the stack of five 24 x 40 matrices in two (of two and three, none alone)
    deltas = [torch.randn(24, 40), torch.randn(40, 24), torch.randn(24, 40), torch.randn(8, 12), torch.randn(24, 40),
              torch.randn(24, 40), torch.randn(24, 40)]
    for batched, cap in ((False, 2), (True, 2), (True, 1.5)):  # 1.5: stacks of one matrix, as the held stack rounds
        held, streamed = (LowRankPayload([4, 4, 4, 2, 4, 4, 4], seed=3, payload_dtype="int8", batched=batched)
                          for _ in range(2))
        comm = Communicator(CommAccountant(), timedelta(seconds=30))
        for _ in range(3):
            want = held.reduce(comm, [d.clone() for d in deltas])
            phases = streamed.phases(like=deltas, source=lambda idx, now=deltas: [now[i].clone() for i in idx],
                                     cap_bytes=cap * 24 * 40 * 4)
            got = streamed.run(comm, phases)
            assert got.averaged == [] and got.errors == [] and len(phases.buckets) >= 3
            updates = {}
            for bucket in phases.buckets:
                updates.update(zip(*phases.commit_bucket(bucket)))
            held.commit(want)
            streamed.commit(got)
            assert all(torch.equal(updates[i], a) for i, a in enumerate(want.averaged))
            assert all(torch.equal(a, b) for a, b in zip(want.bases, got.bases, strict=True))
            for key in ("errors", "right"):
                assert all(torch.equal(a, b) for a, b in zip(held.state_dict()[key], streamed.state_dict()[key],
                                                             strict=True))
            deltas = [d * 0.5 + torch.randn_like(d) for d in deltas]
    for batched in (False, True):  # a payload of no matrix: an empty round
        empty = LowRankPayload([], seed=3, batched=batched).reduce(comm, [])
        assert empty.averaged == [] and empty.bases == [] and empty.errors == []


def test_the_low_rank_messages_stream_only_when_their_matrices_pass_one_bucket() -> None:
    """In one bucket the general path's round holds no more than streaming would: it keeps its one pass."""
    from types import SimpleNamespace

    from lightning_lordo.sync import bucketed
    from lightning_lordo.sync.payloads import PseudoGradientPayloads

    params = [torch.zeros(256, 256), torch.zeros(256, 256), torch.zeros(256)]  # 2 x 256 KB of low-rank matrices
    ranks = {params[0]: 8, params[1]: 8}

    def sync(world: int, cap_mb: float, **knobs: object) -> SimpleNamespace:
        config = SyncConfig(payload="lowrank", bucket_cap_mb=cap_mb, **knobs)
        return SimpleNamespace(comm=SimpleNamespace(world_size=world), config=config, params=params,
                               payloads=PseudoGradientPayloads(params, ranks, config))

    assert bucketed.streams(sync(2, 0.4))
    assert not bucketed.streams(sync(2, 0.6))  # 512 KB fit in one bucket
    assert not bucketed.streams(sync(1, 0.4))  # alone nothing travels
    assert not bucketed.streams(sync(2, 0.4, basis_scope="local"))  # the bases from each worker's own
    assert not bucketed.streams(sync(2, 0.4, broadcast_bases=True))


def test_alone_a_non_finite_round_under_the_svd_projection_is_discarded() -> None:
    """The bucketed sync computes its bases before it reads whether the round is finite: an SVD of a non-finite
    pseudo-gradient raises, which must not escape a round that is discarded anyway (the general path reads first)."""
    from datetime import timedelta

    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.sync import bucketed
    from lightning_lordo.sync.synchronizer import Synchronizer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    params = list(net.parameters())
    opt = LoRDO(params, rank=4, projection="svd")
    comm = Communicator(CommAccountant(), timedelta(seconds=30))
    sync = Synchronizer(params, [], opt, SyncConfig(sync_every=2, synchronous=False), comm)  # rounds, alone
    assert bucketed.applies(sync)
    target = opt.lowrank_params()[0]

    def poison(step: int) -> None:
        if step == 3:
            target.data[0, 0] = float("nan")

    reports = [r for r, _ in sync_rounds(sync, opt, params, 6, 0, before_sync=poison)]
    assert len(reports) == 3 and sync.skipped_syncs == 1
    assert all(torch.isfinite(p).all() for p in params)  # back at the last synchronized point
