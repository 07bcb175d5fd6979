"""The int8 reduce-scatter mean (``lightning_lordo.comm.reduce_scatter``) and the wire bytes of the communicator.

Pure parts in one process; then one gloo job (fork) per world size 2, 3 and 4 that runs every scenario once and
saves what each worker saw, checked here against float64 references computed from the same deterministic inputs
(a function of rank and round). The message holds 1637 numbers (prime: no world size divides it; several blocks per
chunk). Each collective has a timeout; the workers are joined with a timeout and killed if left.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import torch
from strategy_helpers import gloo_worker, run_fork_job
from torch import Tensor

import lightning_lordo.comm.communicator as communicator_module
from lightning_lordo.comm.accounting import ddp_wire_bytes, wire_bytes
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.int8 import quantize_int8
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.comm.quantization import QuantizedAverager, quantized_mean, resolve_reduction
from lightning_lordo.comm.reduce_scatter import chunk_layout, reduce_scatter_bytes

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

WORLDS = (2, 3, 4)
SHAPES = [(40, 33), (7,), (3, 5, 2), (), (9, 31)]  # 1637 numbers
NUMEL = sum(math.prod(s) for s in SHAPES)
LR_SHAPES, LR_RANKS = [(6, 40), (30, 7), (12, 12)], [2, 3, 4]
# the batched payload (the accelerators' layout) stacks same shapes and ranks: a wide and a tall stack, a lone matrix
BATCH_SHAPES, BATCH_RANKS = [(6, 40), (30, 7), (6, 40), (12, 12), (30, 7)], [2, 3, 2, 4, 3]
EF_ROUNDS = 20
DEFAULT_MESSAGE_BYTES = communicator_module._MESSAGE_BYTES


def _inputs(rank: int, t: int, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """Worker ``rank``'s tensors at round ``t``: a drift shared by all workers and rounds (so the sums grow), and
    noise of its own whose magnitude differs between tensors."""
    out = []
    for i, shape in enumerate(shapes):
        drift = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i))
        own = torch.randn(shape, generator=torch.Generator().manual_seed(10_000 * i + 101 * t + rank))
        out.append((drift + 0.8 * own) * 10.0 ** (i % 3 - 1))
    return out


def _true_mean(world: int, t: int, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    return [sum(_inputs(m, t, shapes)[i].double() for m in range(world)) / world for i in range(len(shapes))]


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _layout(n: int, world: int) -> tuple[int, int]:
    """(block, blocks per chunk), from the module docstring's definition, independently of the module."""
    c = -(-n // world)
    k = -(-c // 256)
    return -(-c // k), k


def _blocks_round_trip(x: Tensor, world: int) -> Tensor:
    """float64 ``dequantize(quantize(x))`` per block of the padded flat ``x`` (the first quantization)."""
    b, k = _layout(x.numel(), world)
    padded = torch.zeros(world * k * b)
    padded[: x.numel()] = x.float()
    q, s = quantize_int8(padded.view(-1, b))
    return (q.float() * s[:, None]).double().reshape(-1)[: x.numel()]


# ---------------------------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 255, 256, 257, 1637, 10_000])
def test_chunk_layout_covers_the_message_in_whole_blocks_with_little_padding(world: int, n: int) -> None:
    layout = chunk_layout(n, world)
    assert (layout.block, layout.blocks) == _layout(max(n, 1), world)
    assert layout.padded_numel >= n and layout.padded_numel == world * layout.blocks * layout.block
    assert layout.padded_numel - n < world * (layout.blocks + 1)  # chunks split evenly (was up to a whole block)
    assert layout.chunk_bytes == 4 * layout.blocks + layout.blocks * layout.block


def test_wire_models_and_the_ddp_reference() -> None:
    assert wire_bytes("all_reduce", 1000, 4) == 1500 and wire_bytes("all_reduce", 1000, 3) == 1333
    assert wire_bytes("all_gather", 1000, 4) == 3000 and wire_bytes("all_to_all", 1000, 4) == 1000
    assert wire_bytes("broadcast", 1000, 4) == 750
    assert all(wire_bytes(kind, 1000, 1) == 0 for kind in ("all_reduce", "all_gather", "all_to_all", "broadcast"))
    assert ddp_wire_bytes(4000, 8, steps=10) == 10 * 7000 and ddp_wire_bytes(4000, 1, steps=10) == 0
    with pytest.raises(ValueError, match="kind='ring'"):
        wire_bytes("ring", 10, 2)
    with pytest.raises(ValueError, match="steps=-1"):
        ddp_wire_bytes(10, 2, steps=-1)


def test_accountant_keeps_wire_bytes_by_purpose_and_round_trips_its_state() -> None:
    acc = CommAccountant()
    acc.add("pseudo_gradients", 100, wire=150)
    acc.add_wire("bases", 30)
    acc.add("setup_broadcast", 8, in_round=False)  # no wire given: a point-to-point send of 8
    assert acc.end_round() == {"pseudo_gradients": 100}
    assert acc.last_round_wire == {"pseudo_gradients": 150, "bases": 30}
    assert acc.total_bytes == 108 and acc.total_wire_bytes == 188 and "bases" not in acc.totals
    fresh = CommAccountant()
    fresh.load_state_dict(acc.state_dict())
    assert dict(fresh.wire_totals) == dict(acc.wire_totals) and dict(fresh.totals) == dict(acc.totals)


def test_reduction_choice_and_its_errors() -> None:
    assert resolve_reduction("int8", "auto") == "all_gather"  # world size unknown
    assert [resolve_reduction("int8", "auto", m) for m in (1, 2, 3, 8)] == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert resolve_reduction("bfloat16", "auto", 8) == "all_reduce"
    with pytest.raises(ValueError, match="'reduce_scatter' with payload_dtype='bfloat16'.*payload_dtype='int8'"):
        QuantizedAverager("bfloat16", "reduce_scatter")
    with pytest.raises(ValueError, match="reduction='all_reduce' with payload_dtype='int8'.*reduce_scatter"):
        LowRankPayload([2], payload_dtype="int8", reduction="all_reduce")


def test_one_process_reduce_scatter_is_one_block_rounding_and_counts_nothing() -> None:
    """Alone, the average of one message is its first quantization, and requantizing an int8 block is exact (its
    largest element is +-127 steps): both roundings together are one, and ``sent`` is the message itself."""
    comm = Communicator(CommAccountant(), timedelta(seconds=5))
    xs = _inputs(0, 0, SHAPES)
    result = quantized_mean(comm, xs, "pseudo_gradients", "int8", "reduce_scatter")
    assert result.traffic == {} and comm.accountant.total_bytes == 0 == comm.accountant.total_wire_bytes
    first = _blocks_round_trip(_flat(xs), 1)
    assert torch.equal(_flat(result.means).double(), first) and torch.equal(_flat(result.sent).double(), first)
    assert not torch.equal(first, _flat(xs).double())  # it was quantized
    assert [m.shape for m in result.means] == [torch.Size(s) for s in SHAPES]


# ---------------------------------------------------------------------------------------------------------------
# 2, 3 and 4 processes over gloo
# ---------------------------------------------------------------------------------------------------------------
def _mark(comm: Communicator) -> None:
    comm.accountant.start_round()


def _counted(comm: Communicator) -> dict[str, dict[str, int]]:
    payload = comm.accountant.end_round()
    return {"payload": payload, "wire": dict(comm.accountant.last_round_wire)}


def _averager_rounds(comm: Communicator, rank: int, averager: Any, rounds: int, shapes: list[tuple[int, ...]],
                     bad: tuple[int, float] | None = None) -> list[dict[str, Any]]:
    record = []
    for t in range(rounds):
        xs = _inputs(rank, t, shapes)
        if bad is not None and bad[0] == t and rank == 1:
            xs[0][3, 4] = bad[1]
        before = averager.state_dict()
        _mark(comm)
        result = averager.reduce(comm, xs, "pseudo_gradients")
        counted = _counted(comm)
        averager.commit(result)
        record.append(dict(before=before, after=averager.state_dict(), finite=result.finite, counted=counted,
                           averaged=getattr(result, "averaged", None), bases=getattr(result, "bases", None),
                           traffic=result.traffic))
    return record


def _scenarios(rank: int, comm: Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    world = comm.world_size
    means = []
    for t in range(3):
        _mark(comm)
        result = quantized_mean(comm, _inputs(rank, t, SHAPES), "pseudo_gradients", "int8", "reduce_scatter")
        means.append(dict(means=result.means, sent=result.sent, traffic=result.traffic, counted=_counted(comm)))
    out["mean"] = means
    out["ef"] = _averager_rounds(comm, rank, QuantizedAverager("int8", "reduce_scatter"), EF_ROUNDS, SHAPES)
    out["auto"] = _averager_rounds(comm, rank, QuantizedAverager("int8"), 2, SHAPES)
    out["gather"] = _averager_rounds(comm, rank, QuantizedAverager("int8", "all_gather"), 2, SHAPES)
    out["nan"] = _averager_rounds(comm, rank, QuantizedAverager("int8", "reduce_scatter"), 4, SHAPES, (2, math.nan))
    out["inf"] = _averager_rounds(comm, rank, QuantizedAverager("int8", "reduce_scatter"), 4, SHAPES, (1, -math.inf))
    payload = LowRankPayload(LR_RANKS, seed=5, payload_dtype="int8", reduction="reduce_scatter")
    out["lowrank"] = _averager_rounds(comm, rank, payload, 10, LR_SHAPES)
    payload = LowRankPayload(BATCH_RANKS, seed=5, payload_dtype="int8", reduction="reduce_scatter", batched=True)
    out["lowrank_batched"] = _averager_rounds(comm, rank, payload, 10, BATCH_SHAPES)
    communicator_module._MESSAGE_BYTES = 16  # many collective calls per message
    try:
        out["chunked"] = _averager_rounds(comm, rank, QuantizedAverager("int8", "reduce_scatter"), 3, SHAPES)
    finally:
        communicator_module._MESSAGE_BYTES = DEFAULT_MESSAGE_BYTES
    # the communicator's primitives, one each: payload and wire bytes, and the all-to-all's routing
    prims: dict[str, Any] = {}
    codes = torch.tensor([[100 * rank + j] * 6 for j in range(world)], dtype=torch.int32)
    _mark(comm)
    prims["routed"], prims["a2a_counted"] = comm.all_to_all(codes, "x")
    prims["a2a"] = _counted(comm)
    _mark(comm)
    comm.all_reduce_mean([torch.ones(10)], "x")
    prims["all_reduce"] = _counted(comm)
    _mark(comm)
    comm.all_gather(torch.ones(7, dtype=torch.int8), "x")
    prims["all_gather"] = _counted(comm)
    _mark(comm)
    comm.broadcast([torch.ones(5)], "x")
    prims["broadcast"] = _counted(comm)
    out["prims"] = prims
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    def body(rank: int, world: int) -> dict[str, Any]:
        return _scenarios(rank, Communicator(CommAccountant(), timedelta(seconds=20)))

    gloo_worker(rank, world, port, out, body)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"M{m}" for m in WORLDS])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_fork_job(_worker, world, tmp_path_factory.mktemp(f"reduce_scatter_{world}"), timeout=150)


def _chunk_bytes(n: int, world: int) -> int:
    b, k = _layout(n, world)
    return 4 * k + k * b


@pytest.mark.timeout(300)
def test_results_are_bitwise_identical_and_within_two_int8_roundings_of_the_float64_mean(job: Any) -> None:
    world, runs = job
    b, _ = _layout(NUMEL, world)
    worst_share = 0.0
    for t in range(3):
        recs = [runs[r]["mean"][t] for r in range(world)]
        for i in range(len(SHAPES)):
            assert all(torch.equal(recs[0]["means"][i], rec["means"][i]) for rec in recs)
        got = _flat(recs[0]["means"]).double()
        truth = _flat(_true_mean(world, t, SHAPES))
        xs = [_flat(_inputs(m, t, SHAPES)).double() for m in range(world)]
        padded = torch.zeros(world, -(-NUMEL // b) * b, dtype=torch.float64)
        padded[:, :NUMEL] = torch.stack(xs)
        block_max = padded.view(world, -1, b).abs().amax(dim=2).mean(dim=0)  # mean over workers of max|x_block|
        # |x - s| <= max|x_block| / 254 per worker, |a - â| <= max|a_block| / 254 <= mean_m max|x_m,block| / 254
        bound = (2 * block_max / 254 * (1 + 1e-5)).repeat_interleave(b)[:NUMEL]
        err = (got - truth).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
        worst_share = max(worst_share, float((err / bound).max()))
        sent_mean = sum(_flat(rec["sent"]).double() for rec in recs) / world
        torch.testing.assert_close(sent_mean, got, rtol=0, atol=2e-6 * float(truth.abs().max()))
        for m, rec in enumerate(recs):  # sent = first quantization, except on the chunk this rank owns
            diff = (_flat(rec["sent"]).double() - _blocks_round_trip(_flat(_inputs(m, t, SHAPES)), world)).abs()
            _, k = _layout(NUMEL, world)
            own = torch.zeros(NUMEL, dtype=torch.bool)
            own[m * k * b : (m + 1) * k * b] = True
            assert float(diff[~own].max()) == 0.0 and float(diff[own].max()) > 0
    assert worst_share > 0.3  # the bound is not vacuous: errors reach a good part of it


@pytest.mark.timeout(300)
def test_bytes_counted_are_exact_and_flat_in_the_number_of_workers(job: Any) -> None:
    world, runs = job
    chunk = _chunk_bytes(NUMEL, world)
    assert reduce_scatter_bytes(NUMEL, world) == {"all_to_all": (world - 1) * chunk, "all_gather": chunk}
    for r in range(world):
        for rec in runs[r]["mean"] + runs[r]["ef"] + runs[r]["chunked"]:
            assert rec["traffic"] == {"all_to_all": (world - 1) * chunk, "all_gather": chunk}
            assert rec["counted"]["payload"] == {"pseudo_gradients": world * chunk}
            assert rec["counted"]["wire"] == {"pseudo_gradients": 2 * (world - 1) * chunk}
    rows = sum(s[0] if len(s) >= 2 else 1 for s in SHAPES)
    gather = NUMEL + 4 * rows  # today's int8 all-gather: the whole message, per-row scales
    for r in range(world):
        rec = runs[r]["gather"][0]
        assert rec["counted"] == {"payload": {"pseudo_gradients": gather},
                                  "wire": {"pseudo_gradients": (world - 1) * gather}}
    # payload per worker: n (1 + 4/b) plus the padding, whatever M; wire: under 2 bytes a number (1 + 4/b) + padding
    assert NUMEL <= world * chunk <= NUMEL * (1 + 4 / 256) + world * 260
    assert 2 * (world - 1) * chunk < 2 * (NUMEL * (1 + 4 / 256) + world * 260)
    lr_sent = [sum(rec["counted"]["payload"].values()) for rec in runs[0]["lowrank"]]
    assert lr_sent == [LowRankPayload.traffic_bytes(LR_SHAPES, LR_RANKS, "int8", world, "reduce_scatter")] * 10


@pytest.mark.timeout(300)
def test_error_feedback_identity_over_twenty_rounds_against_float64(job: Any) -> None:
    """sum_t true mean - sum_t applied = mean_m e_m after every round (module docstring), and without the owner's
    requantization residual in its error feedback the identity would fail: the residual is not lost."""
    world, runs = job
    sum_true = torch.zeros(NUMEL, dtype=torch.float64)
    sum_applied = torch.zeros(NUMEL, dtype=torch.float64)
    largest_input, applied_norms = 0.0, 0.0
    for t in range(EF_ROUNDS):
        recs = [runs[r]["ef"][t] for r in range(world)]
        assert all(rec["finite"] for rec in recs)
        applied = _flat(recs[0]["averaged"])
        assert all(torch.equal(applied, _flat(rec["averaged"])) for rec in recs)
        sum_true += _flat(_true_mean(world, t, SHAPES))
        sum_applied += applied.double()
        applied_norms += float(applied.norm())
        errors = [_flat(rec["after"]["errors"]).double() for rec in recs]
        mean_e = sum(errors) / world
        tol = 2e-6 * applied_norms  # float32 arithmetic, a few roundings per round
        off = float((sum_true - sum_applied - mean_e).norm())
        assert off <= tol, (t, off, tol)
        # what each worker would keep without the owner's residual: its first quantization error only; the
        # difference to the kept error feedback is the round's requantization residual r, which the identity
        # would then miss (by far more than its tolerance): the test can tell a lost residual
        before = [_flat(rec["before"]["errors"]).double() if rec["before"]["errors"] else 0 for rec in recs]
        xs = [_flat(_inputs(m, t, SHAPES)).double() + before[m] for m in range(world)]
        first_only = sum(x - _blocks_round_trip(x, world) for x in xs) / world
        assert float((mean_e - first_only).norm()) > 20 * tol, t
        # bounded error feedback: ||e_m||_inf <= (M + 1) / (253 - M) * max ||D||_inf (module docstring)
        largest_input = max(largest_input, max(float(_flat(_inputs(m, t, SHAPES)).abs().max()) for m in range(world)))
        bound = (world + 1) / (253 - world) * largest_input * (1 + 1e-4)
        assert max(float(e.abs().max()) for e in errors) <= bound, t
    assert float((sum_true - sum_applied).norm()) < 0.01 * float(sum_true.norm())
    assert float(sum_true.norm()) > 5 * float(_flat(_true_mean(world, 0, SHAPES)).norm())  # the sums grow


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("key", "shapes"), [("lowrank", LR_SHAPES), ("lowrank_batched", BATCH_SHAPES)])
def test_lowrank_payload_over_the_reduce_scatter_keeps_its_identity_and_identical_bases(
        job: Any, key: str, shapes: list[tuple[int, int]]) -> None:
    world, runs = job
    sum_true = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sum_applied = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for t in range(10):
        recs = [runs[r][key][t] for r in range(world)]
        assert len(recs[0]["averaged"]) == len(shapes)
        for i, truth in enumerate(_true_mean(world, t, shapes)):
            assert all(torch.equal(recs[0]["bases"][i], rec["bases"][i]) for rec in recs)
            assert all(torch.equal(recs[0]["averaged"][i], rec["averaged"][i]) for rec in recs)
            sum_true[i] += truth
            sum_applied[i] += recs[0]["averaged"][i].double()
            gap = sum_true[i] - sum_applied[i]
            gap = gap.mT if gap.shape[0] > gap.shape[1] else gap
            mean_e = sum(rec["after"]["errors"][i].double() for rec in recs) / world
            assert float((gap - mean_e).norm()) <= 1e-5 * (t + 1) * float(sum_true[i].norm()), (t, i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["nan", "inf"])
def test_a_non_finite_input_on_one_worker_flags_the_round_on_every_worker(job: Any, name: str) -> None:
    world, runs = job
    bad = {"nan": 2, "inf": 1}[name]
    for r in range(world):
        for t, rec in enumerate(runs[r][name]):
            assert rec["finite"] == (t != bad), (r, t)
            if t == bad:
                assert all(torch.equal(x, y) for x, y in zip(rec["before"]["errors"], rec["after"]["errors"],
                                                               strict=True))
        assert runs[r][name][bad]["counted"] == runs[r]["ef"][0]["counted"]  # both collectives still ran


@pytest.mark.timeout(300)
def test_auto_uses_the_all_gather_up_to_two_workers_and_the_reduce_scatter_above(job: Any) -> None:
    world, runs = job
    kinds = {"all_gather"} if world <= 2 else {"all_to_all", "all_gather"}
    assert all(set(rec["traffic"]) == kinds for r in range(world) for rec in runs[r]["auto"])


@pytest.mark.timeout(300)
def test_many_collective_calls_give_the_same_bits_and_bytes(job: Any) -> None:
    world, runs = job
    for r in range(world):
        for whole, chunked in zip(runs[r]["ef"][:3], runs[r]["chunked"], strict=True):
            assert whole["counted"] == chunked["counted"]
            assert all(torch.equal(x, y) for x, y in zip(whole["averaged"], chunked["averaged"], strict=True))
            assert all(torch.equal(x, y) for x, y in zip(whole["after"]["errors"], chunked["after"]["errors"],
                                                           strict=True))


@pytest.mark.timeout(300)
def test_communicator_primitives_route_and_count_payload_and_wire_bytes(job: Any) -> None:
    world, runs = job
    for r in range(world):
        prims = runs[r]["prims"]
        expected = torch.tensor([[100 * k + r] * 6 for k in range(world)], dtype=torch.int32)
        assert torch.equal(prims["routed"], expected)  # row k: rank k's row for this rank
        foreign = (world - 1) * 6 * 4
        assert prims["a2a_counted"] == foreign and prims["a2a"] == {"payload": {"x": foreign}, "wire": {"x": foreign}}
        assert prims["all_reduce"] == {"payload": {"x": 40}, "wire": {"x": 2 * (world - 1) * 40 // world}}
        assert prims["all_gather"] == {"payload": {"x": 7}, "wire": {"x": (world - 1) * 7}}
        sender = {"x": 20} if r == 0 else {}
        assert prims["broadcast"] == {"payload": sender, "wire": {"x": (world - 1) * 20 // world}}
