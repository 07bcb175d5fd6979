"""The compressed payloads of SPEC §5 (``lightning_lordo.payload``): low-rank (PowerSGD-style) and reduced precision,
with error feedback.

Two levels: pure functions and one-process payloads (no process group: nothing travels, the numerics are the same),
and one 2-process gloo job (fork) that runs every scenario once and saves what each worker saw; the tests then check
it against references computed here (the synthetic pseudo-gradients are a deterministic function of rank and round).
The job bounds itself: each collective has a timeout, the workers are joined with a timeout and killed if left.
"""

from __future__ import annotations

import math
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from strategy_helpers import run_fork_job
from torch import Tensor

import lightning_lordo.comm.communicator as accounting_module
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.int8 import dequantize_int8, mean_of_packed, pack_rows, quantize_int8, rows_view
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.comm.quantization import QuantizedAverager, round_trip

WORLD = 2
SHAPES = [(6, 10), (12, 5), (7, 7)]  # wide, tall (transposed to 5 x 12), square
RANKS = [2, 2, 3]
# the batched payload stacks matrices of one shape and rank: two stacks (one tall) and two matrices alone
BATCH_SHAPES = [(6, 10), (12, 5), (6, 10), (7, 7), (12, 5), (6, 10), (12, 5)]
BATCH_RANKS = [2, 2, 2, 3, 2, 2, 3]
DENSE_SHAPES = SHAPES + [(10,), (2, 3, 4), ()]  # the averager also takes biases, conv-like and 0-D tensors
ROUNDS = 30
DEFAULT_MESSAGE_BYTES = accounting_module._MESSAGE_BYTES
U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits, round to nearest)


def _comm() -> Communicator:
    return Communicator(CommAccountant(), timedelta(seconds=20))


def _pseudo_gradient(rank: int, t: int, shape: tuple[int, ...], index: int) -> Tensor:
    """Worker ``rank``'s pseudo-gradient at round ``t``: a persistent rank-2 drift shared by all workers (so the
    sums grow with t), a rank-1 term that changes every round (shared), and rank-1 noise of this worker's own."""
    if len(shape) != 2:
        g = torch.Generator().manual_seed(10_000 * index + 100 * t + rank)
        return torch.randn(shape, generator=g) + 0.5
    a, b = shape
    common = torch.Generator().manual_seed(1_000 + index)
    drift = torch.randn(a, 2, generator=common) @ torch.randn(2, b, generator=common)
    per_round = torch.Generator().manual_seed(2_000 + 97 * index + t)
    shared = 0.5 * torch.randn(a, 1, generator=per_round) @ torch.randn(1, b, generator=per_round)
    own = torch.Generator().manual_seed(3_000 + 97 * index + 7_919 * t + 1_000_003 * rank)
    noise = 0.7 * torch.randn(a, 1, generator=own) @ torch.randn(1, b, generator=own)
    return drift + shared + noise


def _true_mean(t: int, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    return [sum(_pseudo_gradient(m, t, s, i).double() for m in range(WORLD)) / WORLD for i, s in enumerate(shapes)]


def _canonical(t: Tensor) -> Tensor:
    return t.mT if t.dim() == 2 and t.shape[0] > t.shape[1] else t


# ---------------------------------------------------------------------------------------------------------------
# Pure functions and one process
# ---------------------------------------------------------------------------------------------------------------
def _varied(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    """Random values whose rows differ in magnitude by orders, plus a zero row where there are rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.dim() >= 2:
        x = x * torch.logspace(-3, 3, x.shape[0]).reshape(-1, *([1] * (x.dim() - 1)))
        x[1] = 0.0
    return x


@pytest.mark.parametrize("shape", [(9, 33), (40, 3), (4, 5, 6), (17,), (1,), ()])
def test_int8_round_trip_error_is_at_most_half_a_scale_per_row(shape: tuple[int, ...]) -> None:
    x = _varied(shape)
    q, scales = quantize_int8(x)
    rows = rows_view(x)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert q.shape == rows.shape and scales.shape == (rows.shape[0],)
    assert int(q.abs().max()) <= 127
    assert torch.equal(scales, rows.abs().amax(dim=1) / 127)
    err = (rows - rows_view(dequantize_int8(q, scales, x.shape))).abs()
    bound = scales[:, None] / 2 * (1 + 1e-6) + 1e-7 * scales[:, None]
    assert bool((err <= bound).all()), float((err / scales[:, None].clamp(min=1e-30)).max())
    assert float(err.max()) > 0 or x.numel() <= 1  # rounding really happens (the bound is not vacuous)
    if x.dim() >= 2:  # the zero row: scale 0, exact zeros
        assert scales[1] == 0 and bool((q[1] == 0).all())
    assert torch.equal(round_trip(x, "int8"), dequantize_int8(q, scales, x.shape))


def test_a_packed_message_gives_the_tensor_by_tensor_codec_bit_for_bit() -> None:
    """``pack_rows`` / ``mean_of_packed`` (every row coded in one pass) against the readable reference: each
    tensor quantized alone, each worker's message dequantized and summed in worker order, divided by the workers."""
    shapes = [(9, 33), (40, 3), (4, 5, 6), (17,), (1,), (), (7, 33), (3, 3), (33,)]
    workers = []
    for w in range(3):
        xs = [_varied(shape, seed=10 * w + i) for i, shape in enumerate(shapes)]
        xs[2][0, 0, 1] = math.nan if w == 1 else xs[2][0, 0, 1]  # a non-finite row on one worker
        workers.append(xs)
    packed = [pack_rows(xs) for xs in workers]
    for xs, (_, sent, _) in zip(workers, packed):
        assert [s.shape for s in sent] == [x.shape for x in xs]
        for x, s in zip(xs, sent):
            reference = dequantize_int8(*quantize_int8(x), x.shape)
            assert torch.equal(s.isnan(), reference.isnan()) and torch.equal(s.nan_to_num(), reference.nan_to_num())
    layout = packed[0][2]
    assert all(torch.equal(p[2].lengths, layout.lengths) and torch.equal(p[2].row_of, layout.row_of) for p in packed)
    assert layout.rows == sum(rows_view(x).shape[0] for x in workers[0])  # every row of every tensor, in one pass
    means = mean_of_packed(torch.stack([p[0] for p in packed]), layout)
    for i, shape in enumerate(shapes):
        decoded = [dequantize_int8(*quantize_int8(xs[i]), shape) for xs in workers]
        reference = decoded[0].clone()
        for d in decoded[1:]:
            reference.add_(d)
        reference.div_(len(workers))
        assert means[i].shape == shape and torch.equal(means[i].isnan(), reference.isnan()), shape
        assert torch.equal(torch.nan_to_num(means[i]), torch.nan_to_num(reference)), shape


def test_bfloat16_round_trip_error_is_at_most_2_to_the_minus_8_relative() -> None:
    x = _varied((50, 64), seed=1)
    err = (x - round_trip(x, "bfloat16")).abs()
    assert bool((err <= x.abs() * U_BF16).all())
    assert float((err / x.abs().clamp(min=1e-30)).max()) > U_BF16 / 4  # a rounding near the bound exists


def test_int8_marks_non_finite_rows_with_a_nan_scale() -> None:
    x = torch.ones(3, 4)
    x[0, 1], x[2, 3] = math.nan, math.inf
    q, scales = quantize_int8(x)
    assert math.isnan(scales[0]) and math.isnan(scales[2]) and scales[1] == 1 / 127
    assert bool((q[0] == 0).all()) and bool((q[2] == 0).all())
    back = dequantize_int8(q, scales)
    assert not bool(torch.isfinite(back[0]).any()) and bool(torch.isfinite(back[1]).all())


def test_one_process_counts_nothing_but_quantizes_and_keeps_error_feedback() -> None:
    comm = _comm()
    xs = [_pseudo_gradient(0, 0, s, i) for i, s in enumerate(DENSE_SHAPES)]
    for dtype in ("bfloat16", "int8"):
        averager = QuantizedAverager(dtype)
        result = averager.reduce(comm, xs, "pseudo_gradients")
        assert result.finite and result.traffic == {}
        for x, avg, e in zip(xs, result.averaged, result.errors or []):
            assert torch.equal(avg, round_trip(x, dtype)) and torch.equal(e, x - avg)
        averager.commit(result)
        assert averager.error_norm() > 0
    payload = LowRankPayload(RANKS)
    result = payload.reduce(comm, [_pseudo_gradient(0, 0, s, i) for i, s in enumerate(SHAPES)])
    assert result.finite and result.traffic == {} and comm.accountant.total_bytes == 0
    assert [tuple(q.shape) for q in result.bases] == [(6, 2), (5, 2), (7, 3)]


def test_lowrank_error_feedback_identity_in_one_process_and_without_error_feedback_mass_is_lost() -> None:
    """Rank 1 against a rank-2 drift: each round transmits one direction. With error feedback the other comes back
    later (the gap is the error feedback, exactly, and shrinks relative to the sums); without, it is lost for good."""
    comm = _comm()
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for ef in (True, False):
        payload = LowRankPayload([1, 1, 1], seed=1, error_feedback=ef)
        gap = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for t in range(2 * ROUNDS):
            ds = [_pseudo_gradient(0, t, s, i) for i, s in enumerate(SHAPES)]
            result = payload.reduce(comm, ds)
            payload.commit(result)
            for g, tot, d, u in zip(gap, total, ds, result.averaged):
                g += d.double() - u.double()
                tot += d.double()
            if ef:
                for g, e in zip(gap, payload.state_dict()["errors"]):
                    torch.testing.assert_close(_canonical(g), e.double(), atol=1e-5 * (t + 1), rtol=0)
            if t + 1 in (ROUNDS, 2 * ROUNDS):
                ratios[ef].append(max(float(g.norm() / tot.norm()) for g, tot in zip(gap, total)))
        if not ef:
            assert payload.state_dict()["errors"] == [] and payload.memory_report()["sync_error_feedback"] == 0
    assert ratios[True][1] < ratios[True][0] < 0.1, ratios  # converges
    assert min(ratios[False]) > 0.3, ratios  # without error feedback, half the drift never arrives


def test_lowrank_resumes_bit_identically_from_its_state_dict() -> None:
    comm = _comm()
    first = LowRankPayload(RANKS, seed=5, payload_dtype="int8")
    for t in range(3):
        first.commit(first.reduce(comm, [_pseudo_gradient(0, t, s, i) for i, s in enumerate(SHAPES)]))
    saved = first.state_dict()
    assert all(isinstance(v, Tensor) for vs in saved.values() for v in vs)
    second = LowRankPayload(RANKS, seed=5, payload_dtype="int8")
    second.load_state_dict(saved)
    ds = [_pseudo_gradient(0, 3, s, i) for i, s in enumerate(SHAPES)]
    a, b = first.reduce(comm, ds), second.reduce(comm, ds)
    for x, y in zip(a.averaged + a.bases + a.errors + a.right, b.averaged + b.bases + b.errors + b.right):
        assert torch.equal(x, y)
    assert first.memory_report() == {"sync_error_feedback": 4 * (60 + 60 + 49),
                                     "payload_right_factors": 4 * (10 * 2 + 12 * 2 + 7 * 3)}


def test_commit_refuses_a_stale_round_and_inputs_are_validated() -> None:
    comm = _comm()
    payload = LowRankPayload(RANKS)
    ds = [_pseudo_gradient(0, 0, s, i) for i, s in enumerate(SHAPES)]
    stale = payload.reduce(comm, ds)
    payload.commit(payload.reduce(comm, ds))
    with pytest.raises(RuntimeError, match="not the latest"):
        payload.commit(stale)
    with pytest.raises(ValueError, match="exceeds"):
        LowRankPayload([6, 6, 3]).reduce(comm, ds)
    with pytest.raises(ValueError, match="3 matrices for 2 ranks"):
        LowRankPayload([2, 2]).reduce(comm, ds)
    with pytest.raises(ValueError, match="does not match"):
        payload.reduce(comm, [ds[0], ds[1].mT, ds[2]][::-1])
    with pytest.raises(ValueError, match="overflows"):
        QuantizedAverager("int8", "all_reduce")
    with pytest.raises(ValueError, match="payload_dtype"):
        LowRankPayload(RANKS, payload_dtype="fp8")
    averager = QuantizedAverager("bfloat16")
    averager.commit(averager.reduce(comm, ds, "x"))
    with pytest.raises(ValueError, match="same list"):
        averager.reduce(comm, ds[:2], "x")


# ---------------------------------------------------------------------------------------------------------------
# Two processes over gloo: every scenario runs once, each worker saves what it saw
# ---------------------------------------------------------------------------------------------------------------
SCENARIOS: dict[str, dict[str, Any]] = {
    "exact": dict(kind="lowrank", ranks=[min(s) for s in SHAPES], rounds=2),
    "lr-float32": dict(kind="lowrank"),
    "lr-int8": dict(kind="lowrank", dtype="int8"),
    "lr-bfloat16-gather": dict(kind="lowrank", dtype="bfloat16", reduction="all_gather"),
    "lr-bfloat16": dict(kind="lowrank", dtype="bfloat16"),
    "avg-int8": dict(kind="dense", dtype="int8"),
    "avg-bfloat16-gather": dict(kind="dense", dtype="bfloat16", reduction="all_gather"),
    "avg-bfloat16": dict(kind="dense", dtype="bfloat16"),
    "avg-int8-chunked": dict(kind="dense", dtype="int8", rounds=3, chunk_bytes=16),
    "avg-bfloat16-chunked": dict(kind="dense", dtype="bfloat16", rounds=3, chunk_bytes=16),
    "lr-bfloat16-gather-chunked": dict(kind="lowrank", dtype="bfloat16", reduction="all_gather", rounds=3,
                                       chunk_bytes=16),
    "nan-lr-float32": dict(kind="lowrank", rounds=4, bad=(2, math.nan)),
    "inf-lr-int8": dict(kind="lowrank", dtype="int8", rounds=4, bad=(2, math.inf)),
    "nan-lr-bfloat16": dict(kind="lowrank", dtype="bfloat16", rounds=4, bad=(2, math.nan)),
    "batched-float32": dict(kind="lowrank", batched=True),
    "batched-int8": dict(kind="lowrank", dtype="int8", batched=True),
    "unbatched-float32": dict(kind="lowrank", batched=False),
    "nan-batched-int8": dict(kind="lowrank", dtype="int8", batched=True, rounds=4, bad=(2, math.nan)),
    "nan-avg-int8": dict(kind="dense", dtype="int8", rounds=4, bad=(2, math.nan)),
    "inf-avg-bfloat16": dict(kind="dense", dtype="bfloat16", rounds=4, bad=(2, -math.inf)),
}


def _scenario(rank: int, comm: Communicator, kind: str, dtype: str = "float32", reduction: str = "auto",
              ranks: Optional[list[int]] = None, rounds: int = ROUNDS,
              bad: Optional[tuple[int, float]] = None, chunk_bytes: Optional[int] = None,
              batched: Optional[bool] = None) -> list[dict[str, Any]]:
    if chunk_bytes is not None:  # many collective calls per message (restored by the next scenario)
        accounting_module._MESSAGE_BYTES = chunk_bytes
    else:
        accounting_module._MESSAGE_BYTES = DEFAULT_MESSAGE_BYTES
    shapes = _shapes(kind, batched)
    payload: Any
    if kind == "lowrank":
        payload = LowRankPayload(ranks or (RANKS if batched is None else BATCH_RANKS), seed=3, payload_dtype=dtype,
                                 reduction=reduction, batched=bool(batched))
        payload._ensure_state([torch.zeros(s) for s in shapes])  # test only: record the initial right factors
    else:
        payload = QuantizedAverager(dtype, reduction)
    record = []
    for t in range(rounds):
        ds = [_pseudo_gradient(rank, t, s, i) for i, s in enumerate(shapes)]
        if bad is not None and bad[0] == t and rank == 1:
            ds[1][2, 3] = bad[1]
        before = payload.state_dict()
        comm.accountant.start_round()
        result = payload.reduce(comm, ds, "pseudo_gradients")
        counted = comm.accountant.end_round()
        payload.commit(result)
        record.append(dict(before=before, after=payload.state_dict(), finite=bool(result.finite),
                           averaged=result.averaged, bases=getattr(result, "bases", None), traffic=result.traffic,
                           counted=counted, error_norm=payload.error_norm()))
    return record


def _shapes(kind: str, batched: Optional[bool]) -> list[tuple[int, ...]]:
    """A scenario's matrices: ``batched`` set (either way) takes the shapes that stack."""
    return DENSE_SHAPES if kind == "dense" else SHAPES if batched is None else BATCH_SHAPES


def _worker(rank: int, world: int, port: int, out: str) -> None:
    results: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        comm = _comm()
        for name, knobs in SCENARIOS.items():
            try:
                results[name] = _scenario(rank, comm, **knobs)
            except Exception:  # noqa: BLE001 - reported to the test; the other scenarios still run
                results[name] = {"error": traceback.format_exc()}
                if comm.failure is not None:  # the process group cannot be trusted any more
                    break
    except BaseException:  # noqa: BLE001
        results["_error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out, f"rank{rank}.pt"))
        os._exit(0)  # no teardown: a failed collective would make destroy_process_group wait


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return dict(enumerate(run_fork_job(_worker, WORLD, tmp_path_factory.mktemp("payload"), timeout=90)))


def _rounds(runs: dict[int, dict[str, Any]], name: str) -> list[list[dict[str, Any]]]:
    """``[rank][round]`` records of scenario ``name``."""
    out = []
    for r in range(WORLD):
        record = runs[r][name]
        assert not isinstance(record, dict), f"rank {r}, scenario {name}:\n{record['error']}"
        out.append(record)
    return out


@pytest.mark.timeout(120)
def test_lowrank_with_full_rank_reproduces_the_full_average(runs: dict[int, dict[str, Any]]) -> None:
    per_rank = _rounds(runs, "exact")
    for t in range(2):
        truth = _true_mean(t, SHAPES)
        for r in range(WORLD):
            rec = per_rank[r][t]
            assert rec["finite"]
            for avg, ref in zip(rec["averaged"], truth):
                assert avg.shape == ref.shape
                torch.testing.assert_close(avg.double(), ref, atol=2e-5 * float(ref.abs().max()), rtol=0)
            assert rec["error_norm"] < 1e-4 * sum(float(x.norm()) for x in truth)  # nothing left behind


def _check_error_feedback(per_rank: list[list[dict[str, Any]]], shapes: list[tuple[int, ...]],
                          exact_reduction: bool) -> None:
    """After every round: sum of true averages - sum of applied updates = mean over workers of the error feedback
    (exactly with an exact reduction; up to the bfloat16 rounding of the sum with a bfloat16 all-reduce), and the
    gap stays small next to the sums, which grow with the rounds."""
    sum_true = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sum_applied = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    applied_norms = [0.0] * len(shapes)
    worst_reduction_share = 0.0
    for t in range(len(per_rank[0])):
        recs = [per_rank[r][t] for r in range(WORLD)]
        assert all(rec["finite"] for rec in recs)
        for i, (truth, applied) in enumerate(zip(_true_mean(t, shapes), recs[0]["averaged"])):
            assert all(torch.equal(applied, rec["averaged"][i]) for rec in recs)  # identical on all ranks
            sum_true[i] += truth
            sum_applied[i] += applied.double()
            applied_norms[i] += float(applied.norm())
        for i in range(len(shapes)):
            mean_e = sum(_canonical(rec["after"]["errors"][i].double()) for rec in recs) / WORLD
            gap = _canonical(sum_true[i] - sum_applied[i])
            scale = float(sum_true[i].norm())
            off = float((gap - mean_e).norm())
            float_tol = 1e-5 * (t + 1) * max(scale, 1.0)
            if exact_reduction:
                assert off <= float_tol, (t, i, off)
            else:  # M = 2: one rounding of the bfloat16 sum per round, at most 2^-8 of it
                assert off <= U_BF16 * applied_norms[i] + float_tol, (t, i, off)
                worst_reduction_share = max(worst_reduction_share, off)
            if t >= 10 and shapes[i] != ():
                assert float(gap.norm()) < 0.1 * scale, (t, i, float(gap.norm()), scale)
    if not exact_reduction:
        assert worst_reduction_share > 0  # the bfloat16 sum is rounded (gloo sums in bfloat16): no EF returns it
    assert float(sum_true[0].norm()) > 5 * float(_true_mean(0, shapes)[0].norm())  # the sums really grow


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "exact"), [("lr-float32", True), ("lr-int8", True), ("lr-bfloat16-gather", True),
                                             ("lr-bfloat16", False)])
def test_lowrank_error_feedback_returns_what_each_round_dropped(runs: dict[int, dict[str, Any]], name: str,
                                                               exact: bool) -> None:
    _check_error_feedback(_rounds(runs, name), SHAPES, exact)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "exact"), [("avg-int8", True), ("avg-bfloat16-gather", True),
                                             ("avg-bfloat16", False)])
def test_reduced_precision_error_feedback_returns_what_rounding_dropped(runs: dict[int, dict[str, Any]], name: str,
                                                                        exact: bool) -> None:
    _check_error_feedback(_rounds(runs, name), DENSE_SHAPES, exact)


def _orth64(p: Tensor) -> Tensor:
    return torch.linalg.qr(p.double(), mode="reduced").Q


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["lr-float32", "lr-int8", "lr-bfloat16"])
def test_bases_are_bitwise_identical_on_all_ranks_and_come_from_the_averaged_pseudo_gradient(
        runs: dict[int, dict[str, Any]], name: str) -> None:
    per_rank = _rounds(runs, name)
    for t in range(ROUNDS):
        recs = [per_rank[r][t] for r in range(WORLD)]
        for i in range(len(SHAPES)):
            assert all(torch.equal(recs[0]["bases"][i], rec["bases"][i]) for rec in recs)
            assert all(torch.equal(recs[0]["after"]["right"][i], rec["after"]["right"][i]) for rec in recs)
            assert all(torch.equal(recs[0]["before"]["right"][i], rec["before"]["right"][i]) for rec in recs)
            if name != "lr-float32":
                continue  # quantized P: Q = orth(mean of the dequantized P), checked identical above
            right = recs[0]["before"]["right"][i].double()
            p = sum((_canonical(_pseudo_gradient(r, t, SHAPES[i], i)).double() +
                     per_rank[r][t]["before"]["errors"][i].double()) @ right for r in range(WORLD)) / WORLD
            ref, q = _orth64(p), recs[0]["bases"][i].double()
            signs = torch.sign(torch.diagonal(ref.mT @ q))
            torch.testing.assert_close(q * signs, ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(q.mT @ q, torch.eye(q.shape[1], dtype=torch.float64), atol=1e-5, rtol=0)


def _expected_bytes(name: str) -> int:
    knobs = SCENARIOS[name]
    dtype = knobs.get("dtype", "float32")
    if knobs["kind"] == "lowrank":
        shapes = _shapes("lowrank", knobs.get("batched"))
        ranks = knobs.get("ranks", RANKS if knobs.get("batched") is None else BATCH_RANKS)
        numbers = sum(r * (a + b) for (a, b), r in zip(shapes, ranks))
        if dtype == "int8":
            return numbers + sum(2 * r * 4 for r in ranks)  # P^T and B: r rows each, one float32 scale a row
        return numbers * {"float32": 4, "bfloat16": 2}[dtype]
    numel = sum(math.prod(s) for s in DENSE_SHAPES)
    if dtype == "int8":
        rows = sum(s[0] if len(s) >= 2 else 1 for s in DENSE_SHAPES)
        return numel + 4 * rows
    return numel * {"float32": 4, "bfloat16": 2}[dtype]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["exact", "lr-float32", "lr-int8", "lr-bfloat16", "lr-bfloat16-gather",
                                  "avg-int8", "avg-bfloat16", "avg-bfloat16-gather", "batched-float32",
                                  "batched-int8"])
def test_bytes_counted_are_what_each_worker_passes_to_the_collectives(runs: dict[int, dict[str, Any]],
                                                                     name: str) -> None:
    knobs = SCENARIOS[name]
    expected = _expected_bytes(name)
    if knobs["kind"] == "lowrank" and "batched" in knobs:
        assert expected == LowRankPayload.traffic_bytes(BATCH_SHAPES, BATCH_RANKS, knobs.get("dtype", "float32"))
    elif knobs["kind"] == "lowrank":
        assert expected == LowRankPayload.traffic_bytes(SHAPES, knobs.get("ranks", RANKS), knobs.get("dtype",
                                                                                                     "float32"))
        if name != "exact":  # with r = min(a, b) the payload is larger than the matrices themselves
            assert expected < 4 * sum(a * b for a, b in SHAPES)
    kind = "all_gather" if knobs.get("dtype") == "int8" or knobs.get("reduction") == "all_gather" else "all_reduce"
    for per_round in _rounds(runs, name):
        for rec in per_round:
            assert rec["counted"] == {"pseudo_gradients": expected}, rec["counted"]
            assert rec["traffic"] == {kind: expected}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["nan-lr-float32", "inf-lr-int8", "nan-lr-bfloat16", "nan-avg-int8",
                                  "inf-avg-bfloat16", "nan-batched-int8"])
def test_a_non_finite_pseudo_gradient_on_one_worker_flags_the_round_on_all_and_changes_no_state(
        runs: dict[int, dict[str, Any]], name: str) -> None:
    per_rank = _rounds(runs, name)
    bad_round = SCENARIOS[name]["bad"][0]
    for r in range(WORLD):
        for t, rec in enumerate(per_rank[r]):
            assert rec["finite"] == (t != bad_round), (r, t)
            if t != bad_round:
                continue
            assert not all(bool(torch.isfinite(a).all()) for a in rec["averaged"])
            for key, before in rec["before"].items():
                assert all(torch.equal(x, y) for x, y in zip(before, rec["after"][key], strict=True)), key
            if SCENARIOS[name]["kind"] == "lowrank":  # both messages travel: nothing is read back mid-round
                full = _expected_bytes(name.replace("nan-", "").replace("inf-", ""))
                assert rec["counted"]["pseudo_gradients"] == full
    # the round after works again, on every worker
    assert all(per_rank[r][bad_round + 1]["finite"] for r in range(WORLD))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["avg-int8", "avg-bfloat16", "lr-bfloat16-gather"])
def test_messages_split_into_many_collective_calls_give_the_same_result_and_bytes(runs: dict[int, dict[str, Any]],
                                                                                  name: str) -> None:
    whole, chunked = _rounds(runs, name), _rounds(runs, f"{name}-chunked")
    for r in range(WORLD):
        for a, b in zip(whole[r][:3], chunked[r], strict=False):
            assert a["counted"] == b["counted"]
            for x, y in zip(a["averaged"], b["averaged"], strict=True):
                assert torch.equal(x, y)
            for x, y in zip(a["after"]["errors"], b["after"]["errors"], strict=True):
                assert torch.equal(x, y)


@pytest.mark.parametrize("payload_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_averager_never_writes_to_its_inputs(payload_dtype: str, requires_grad: bool) -> None:
    """Its error feedback is computed in a copy, also of an input that requires grad (whose detached view shares
    the input's memory), in the first round (no buffer yet) and in later ones."""
    averager = QuantizedAverager(payload_dtype=payload_dtype)
    for t in range(3):
        xs = [_varied(shape, seed=t).requires_grad_(requires_grad) for shape in DENSE_SHAPES]
        before = [x.detach().clone() for x in xs]
        averager.commit(averager.reduce(_comm(), xs, "pseudo_gradients"))
        assert all(torch.equal(x.detach(), b) for x, b in zip(xs, before)), t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["batched-float32", "batched-int8"])
def test_a_batched_payload_returns_what_each_round_dropped(runs: dict[int, dict[str, Any]], name: str) -> None:
    _check_error_feedback(_rounds(runs, name), BATCH_SHAPES, exact_reduction=True)


@pytest.mark.timeout(120)
def test_a_batched_payload_is_the_matrix_by_matrix_payload_up_to_float32_rounding(
        runs: dict[int, dict[str, Any]]) -> None:
    batched, alone = _rounds(runs, "batched-float32"), _rounds(runs, "unbatched-float32")
    for r in range(WORLD):
        for a, b in zip(batched[r], alone[r], strict=True):
            assert a["counted"] == b["counted"] and a["finite"] and b["finite"]
            pairs = [*zip(a["averaged"], b["averaged"], strict=True), *zip(a["bases"], b["bases"], strict=True),
                     *(xy for key in ("errors", "right") for xy in zip(a["after"][key], b["after"][key], strict=True))]
            assert len(pairs) == 4 * len(BATCH_SHAPES)
            for x, y in pairs:
                assert x.shape == y.shape and x.dtype == y.dtype
                torch.testing.assert_close(x, y, atol=1e-5 * max(1.0, float(y.abs().max())), rtol=0)


@pytest.mark.parametrize("shapes", [[(3,)], [(0, 5)], [(4, 6), (6,), ()]])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_packed_message_of_any_length_decodes(shapes: list[tuple[int, ...]], world: int) -> None:
    """Messages whose scale block is not 4-byte aligned in the batch (one worker, an odd length) or that hold no
    value at all decode to what each worker sent."""
    xs = [torch.randn(s, generator=torch.Generator().manual_seed(1)) for s in shapes]
    message, sent, layout = pack_rows(xs)
    out = mean_of_packed(torch.stack([message] * world), layout)
    for o, s in zip(out, sent, strict=True):
        assert o.shape == s.shape and torch.allclose(o, s, atol=1e-6)
