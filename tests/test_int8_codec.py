"""The int8 codec of the all-gathered messages (``lightning_lordo.comm.int8``) and the messages that travel together.

1. ``pack_rows`` / ``mean_of_packed`` code every row of a message in one pass over one flat buffer. They are checked
   bit for bit against the readable reference kept here, the codec they replaced (the rows of each length stacked
   and coded apart, every worker's rows decoded and summed in worker order), on random layouts: mixed row lengths,
   empty and 0-d tensors, NaN and Inf rows, 1 to 4 workers. And a message costs the same kernels whatever its row
   lengths.
2. A sync's int8 all-gathered messages travel as two collectives (every P message and the dense one, then every B
   message): with 2 processes (fork, gloo, a timeout on every collective) the joined round gives every value, every
   state and every byte count per part of the groups' own rounds, each message sent alone.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from strategy_helpers import run_fork_job
from torch import Tensor

from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.int8 import mean_of_packed, pack_rows, quantize_int8, rows_view
from lightning_lordo.config import SyncConfig
from lightning_lordo.sync.payloads import FULLRANK_PART, LOWRANK_PART, PseudoGradientPayloads

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import counts  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# The reference: the codec by row length (as it was before the one-pass codec)
# ---------------------------------------------------------------------------------------------------------------
def _row_length(x: Tensor) -> int:
    return x.numel() if x.dim() <= 1 else math.prod(x.shape[1:])


def reference_pack(xs: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], list[tuple[int, list[int], list[int]]]]:
    """Per row length, the rows of its tensors stacked and quantized by ``quantize_int8``: the byte message (the
    scales of every length, then the values), what it carries dequantized, and its layout."""
    by_length: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        by_length.setdefault(_row_length(x), []).append(i)
    layout = [(n, idx, [rows_view(xs[i]).shape[0] for i in idx]) for n, idx in by_length.items()]
    packed = [quantize_int8(torch.cat([rows_view(xs[i].float()) for i in idx])) for _, idx, _ in layout]
    message = torch.cat([s.view(torch.int8) for _, s in packed] + [q.reshape(-1) for q, _ in packed])
    sent = _reference_unstack([q.float() * s[:, None] for q, s in packed], layout, [x.shape for x in xs])
    return message, sent, layout


def reference_mean(messages: Tensor, layout: list[tuple[int, list[int], list[int]]],
                   shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Every worker's rows dequantized and summed in worker order, then divided by the number of workers."""
    world, n_scales = messages.shape[0], sum(sum(c) for _, _, c in layout)
    scales = messages[:, : 4 * n_scales].reshape(-1).view(torch.float32).view(world, n_scales)
    at_scale, at_value, total = 0, 4 * n_scales, []
    for n, _, c in layout:
        k = sum(c)
        values = messages[:, at_value: at_value + k * n].view(world, k, n)
        acc = values[0].float() * scales[0, at_scale: at_scale + k, None]
        for w in range(1, world):
            acc.add_(values[w].float() * scales[w, at_scale: at_scale + k, None])
        total.append(acc / world if world > 1 else acc)
        at_scale, at_value = at_scale + k, at_value + k * n
    return _reference_unstack(total, layout, shapes)


def _reference_unstack(stacks: Sequence[Tensor], layout: list[tuple[int, list[int], list[int]]],
                       shapes: Sequence[torch.Size]) -> list[Tensor]:
    out: list[Any] = [None] * len(shapes)
    for stack, (_, idx, c) in zip(stacks, layout):
        for i, part in zip(idx, stack.split(c)):
            out[i] = part.reshape(shapes[i])
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. the one-pass codec against the reference
# ---------------------------------------------------------------------------------------------------------------
POOL = [(), (1,), (5,), (17,), (0,), (3, 4), (7, 4), (2, 33), (4, 5, 6), (1, 1), (0, 5), (6, 0), (9, 1), (2, 3, 0)]


def _layout(seed: int, count: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [POOL[int(i)] for i in torch.randint(len(POOL), (count,), generator=gen)]


def _tensors(shapes: Sequence[tuple[int, ...]], seed: int, bad: bool) -> list[Tensor]:
    """Values of varied magnitudes per row (some rows zero); ``bad``: NaN, Inf and -Inf in some rows."""
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for shape in shapes:
        x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-6, 6, (), generator=gen).item()
        rows = rows_view(x)
        if rows.numel() and torch.rand((), generator=gen) < 0.2:
            rows[int(torch.randint(rows.shape[0], (), generator=gen))] = 0.0
        if bad and rows.numel() and torch.rand((), generator=gen) < 0.4:
            r, c = (int(torch.randint(n, (), generator=gen)) for n in rows.shape)
            rows[r, c] = [math.nan, math.inf, -math.inf][int(torch.randint(3, (), generator=gen))]
        xs.append(x)
    return xs


def _same(a: Tensor, b: Tensor) -> bool:
    """Bitwise equal, NaN where the other is NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num().view(torch.int32) if a.dtype == torch.float32 else a.nan_to_num(),
        b.nan_to_num().view(torch.int32) if b.dtype == torch.float32 else b.nan_to_num())


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_one_pass_codec_gives_the_codec_by_row_length_bit_for_bit(seed: int, world: int) -> None:
    shapes = _layout(seed, 3 + seed % 4 * 7)
    workers = [_tensors(shapes, 100 * seed + w, bad=seed % 3 == 0 and w == world - 1) for w in range(world)]
    new = [pack_rows(xs) for xs in workers]
    old = [reference_pack(xs) for xs in workers]
    for xs, (message, sent, layout), (ref_message, ref_sent, _) in zip(workers, new, old):
        assert message.dtype == torch.int8 and message.shape == ref_message.shape  # the same bytes
        assert all(_same(s, r) for s, r in zip(sent, ref_sent))
        # each tensor's scales and values, read out of the message, are quantize_int8's for the tensor alone
        rows = layout.rows
        scales, values = message[: 4 * rows].view(torch.float32), message[4 * rows:]
        at_scale = at_value = 0
        for i in layout.flat.order:
            q, s = quantize_int8(xs[i])
            assert _same(scales[at_scale: at_scale + s.numel()], s), (shapes[i], i)
            assert torch.equal(values[at_value: at_value + q.numel()].view(q.shape), q), (shapes[i], i)
            at_scale, at_value = at_scale + s.numel(), at_value + q.numel()
        assert (at_scale, at_value) == (rows, values.numel())
    layout = new[0][2]
    means = mean_of_packed(torch.stack([m for m, _, _ in new]), layout)
    ref_means = reference_mean(torch.stack([m for m, _, _ in old]), old[0][2], [torch.Size(s) for s in shapes])
    assert len(means) == len(shapes)
    for m, r, shape in zip(means, ref_means, shapes):
        assert m.shape == shape and _same(m, r), shape


def test_the_bad_rows_are_really_there() -> None:
    """The layouts above hold NaN and Inf rows and empty tensors (the comparison would be vacuous otherwise)."""
    bad = [x for seed in range(0, 12, 3) for x in _tensors(_layout(seed, 3 + seed % 4 * 7), 100 * seed, bad=True)]
    assert any(x.isnan().any() for x in bad) and any(x.isinf().any() for x in bad)
    assert any(x.numel() == 0 for x in bad) and any(x.dim() == 0 for x in bad)


def test_a_non_finite_row_keeps_a_nan_scale_and_sends_zeros() -> None:
    x = torch.tensor([[1.0, 2.0], [math.inf, 1.0], [math.nan, 3.0], [0.0, 0.0]])
    message, sent, layout = pack_rows([x, torch.tensor([-math.inf, 1.0])])
    scales = message[: 4 * layout.rows].view(torch.float32)
    assert scales[0] == 2.0 / 127 and scales[1:3].isnan().all() and scales[3] == 0 and scales[4].isnan()
    assert (message[4 * layout.rows:][2:6] == 0).all() and (message[-2:] == 0).all()
    assert sent[0][1:3].isnan().all() and torch.equal(sent[0][3], torch.zeros(2)) and sent[1].isnan().all()


def test_rows_of_subnormal_magnitude_are_coded_as_alone() -> None:
    """A row whose scale underflows to 0 (its values sent as 0), or lands on a subnormal whose rounding takes a
    quotient past 127 (clamped): the same bits as ``quantize_int8`` and the reference."""
    tiny = torch.tensor([[1e-44, -3e-45, 0.0], [1.9e-43, -1.9e-43, 1e-45], [2e-43, 5e-44, -7e-44], [1.0, 0.5, 0.25]])
    q, s = quantize_int8(tiny)
    assert s[0] == 0 and bool((tiny[0] != 0).any()) and bool((q[0] == 0).all())  # a zero scale sends zeros
    assert q[1, 0] == 127 and float(tiny[1, 0] / s[1]) > 127.5  # the clamp is reached
    xs = [tiny, tiny[1:3].reshape(-1), tiny * 1e-3]
    message, sent, layout = pack_rows(xs)
    ref_message, ref_sent, ref_layout = reference_pack(xs)
    assert all(_same(a, b) for a, b in zip(sent, ref_sent))
    rows = layout.rows
    alone = [quantize_int8(xs[i]) for i in layout.flat.order]
    assert _same(message[: 4 * rows].view(torch.float32), torch.cat([scales for _, scales in alone]))
    assert torch.equal(message[4 * rows:], torch.cat([q.reshape(-1) for q, _ in alone]))
    means = mean_of_packed(torch.stack([message] * 3), layout)
    ref = reference_mean(torch.stack([ref_message] * 3), ref_layout, [x.shape for x in xs])
    assert all(_same(a, b) for a, b in zip(means, ref))


def _ops_of_a_message(shapes: Sequence[tuple[int, ...]]) -> tuple[int, int, int]:
    """Kernel ops (not views) to pack a message and to average two workers' copies, and all ops of both."""
    xs = [torch.randn(s) for s in shapes]
    with counts.Counts() as packing:
        message, _, layout = pack_rows(xs)
    with counts.Counts() as averaging:
        mean_of_packed(torch.stack([message, message]), layout)
    kernels = [c.ops - sum(n for name, n in c.by_op.items() if name.startswith(counts.VIEWS))
               for c in (packing, averaging)]
    return kernels[0], kernels[1], packing.ops + averaging.ops


def test_a_message_costs_the_same_kernels_whatever_its_row_lengths() -> None:
    """The codec by row length paid about 13 ops a length to pack and 6 a length per worker to decode: 20 lengths
    cost over 300 ops more than 2. One pass runs the same kernels for both (only views, to give each tensor back
    shaped, follow its trailing shapes), a few dozen ops in all."""
    two = [(8, 16), (4, 16), (32,), (8, 32)]
    twenty = [(8, 16 + k) for k in range(19)] + [(32,)]
    assert _ops_of_a_message(two)[:2] == _ops_of_a_message(twenty)[:2]
    assert _ops_of_a_message(two)[2] <= 60 and sum(_ops_of_a_message(two)[:2]) <= 30, _ops_of_a_message(two)


def test_a_layout_coded_again_makes_no_tensor_from_host_numbers() -> None:
    """A sync codes the same layouts every time: their row lengths go to the device once. A tensor made from host
    numbers (``torch.tensor``: ``lift_fresh``) is a blocking copy to an accelerator, a stream synchronization per
    message; none when a layout comes again, whichever tensors carry it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fresh(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.made += str(func).startswith("aten.lift_fresh")
            return func(*args, **(kwargs or {}))

    shapes = [(8, 16), (5, 3, 2), (7,), (), (0, 4)]
    xs = [torch.randn(s) for s in shapes]
    first, _, layout = pack_rows(xs)
    with Fresh() as fresh:
        again, sent, _ = pack_rows([x.clone() for x in xs])
        means = mean_of_packed(torch.stack([again, again]), layout)
    assert fresh.made == 0 and torch.equal(first, again)
    reference = reference_pack(xs)
    assert torch.equal(reference[0], again) and all(torch.equal(a, b) for a, b in zip(reference[1], sent))
    assert all(torch.equal(a, b) for a, b in zip(means, sent))


# ---------------------------------------------------------------------------------------------------------------
# 2. the messages of a sync joined, against each message alone (2 processes)
# ---------------------------------------------------------------------------------------------------------------
WORLD = 2
#: low-rank matrices (rank 2: two of one shape stack, a tall one, one its rank does not compress: 3 x 3 travels in
#: full), full-rank matrices (rank 2 compresses them) and dense tensors
LOWRANK = [(6, 10), (6, 10), (12, 5), (3, 3)]
FULLRANK = [(20, 8), (8, 20)]
DENSE = [(10,), (7,), (), (2, 3, 4), (0,)]
ROUNDS = 4


def _payloads(params: Sequence[Tensor]) -> PseudoGradientPayloads:
    config = SyncConfig(payload="lowrank", payload_dtype="int8", fullrank_rank=2, seed=5)
    return PseudoGradientPayloads(params, {params[i]: 2 for i in range(len(LOWRANK))}, config, batched=True)


def _local(rank: int, t: int, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1_000 * t + rank)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    if t == 2 and rank == 1:  # a non-finite round: flagged on both workers, no state moves
        xs[len(LOWRANK) + 1][3, 2] = math.nan
    return xs


def _state(payloads: PseudoGradientPayloads) -> dict[str, Any]:
    return copy.deepcopy(payloads.state_dict())


def _joined_worker(rank: int, world: int, port: int, out: str) -> None:
    results: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        shapes = LOWRANK + FULLRANK + DENSE
        params = [torch.zeros(s) for s in shapes]
        joined, alone = _payloads(params), _payloads(params)
        comm_joined = Communicator(CommAccountant(), timedelta(seconds=20))
        comm_alone = Communicator(CommAccountant(), timedelta(seconds=20))
        gathers: list[str] = []
        original = comm_joined.all_gather

        def counted_gather(flat: Tensor, purpose: str, parts: Sequence[tuple[str, int]] = ()) -> Any:
            gathers.append(purpose)
            return original(flat, purpose, parts)

        comm_joined.all_gather = counted_gather  # type: ignore[method-assign]
        records = []
        for t in range(ROUNDS):
            local = _local(rank, t, shapes)
            comm_joined.accountant.start_round(parts=True)
            averaged, rounds, finite = joined.reduce(comm_joined, [x.clone() for x in local])
            comm_joined.accountant.end_round()
            # the groups' own rounds, each message alone and in the groups' order (the reduction before joining)
            comm_alone.accountant.start_round(parts=True)
            ref_rounds = [(m, m.reduce(comm_alone, [local[i].clone() for i in positions], purpose))
                          for _, positions, m, purpose in alone.groups if positions]
            comm_alone.accountant.end_round()
            ref_averaged: list[Any] = [None] * len(shapes)
            for (_, result), (_, positions, _, _) in zip(ref_rounds, [g for g in alone.groups if g[1]]):
                for n, i in enumerate(positions):
                    ref_averaged[i] = result.averaged[n]
            ok = bool(finite)
            ref_ok = all(bool(r.finite) for _, r in ref_rounds)
            joined.resolve(rounds, ok)
            for m, r in rounds:
                m.commit(r)
            for m, r in ref_rounds:
                r.finite = ref_ok
                m.commit(r)
            records.append(dict(
                averaged=averaged, ref_averaged=ref_averaged, finite=ok, ref_finite=ref_ok,
                bases=[getattr(r, "bases", None) for _, r in rounds],
                ref_bases=[getattr(r, "bases", None) for _, r in ref_rounds],
                traffic=[r.traffic for _, r in rounds], ref_traffic=[r.traffic for _, r in ref_rounds],
                parts=dict(comm_joined.accountant.last_parts), ref_parts=dict(comm_alone.accountant.last_parts),
                wire=dict(comm_joined.accountant.last_wire_parts),
                ref_wire=dict(comm_alone.accountant.last_wire_parts),
                state=_state(joined), ref_state=_state(alone), gathers=list(gathers)))
            gathers.clear()
        results["records"] = records
    except BaseException:  # noqa: BLE001
        results["_error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out, f"rank{rank}.pt"))
        os._exit(0)  # no teardown: a failed collective would make destroy_process_group wait


def _equal_nested(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and _same(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal_nested(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(120)
def test_joined_messages_give_every_value_state_and_byte_of_the_messages_alone(tmp_path: Path) -> None:
    runs = run_fork_job(_joined_worker, WORLD, tmp_path, timeout=90)
    for rank, run in enumerate(runs):
        records = run["records"]
        assert len(records) == ROUNDS
        for t, rec in enumerate(records):
            where = f"rank {rank}, round {t}"
            assert rec["finite"] == rec["ref_finite"] == (t != 2), where
            assert _equal_nested(rec["averaged"], rec["ref_averaged"]), where
            assert _equal_nested(rec["bases"], rec["ref_bases"]), where
            assert _equal_nested(rec["state"], rec["ref_state"]), where
            assert rec["traffic"] == rec["ref_traffic"], where
            assert rec["parts"] == rec["ref_parts"] and rec["wire"] == rec["ref_wire"], where
            assert set(rec["parts"]) == {LOWRANK_PART, FULLRANK_PART} and all(rec["parts"].values()), where
            # two collectives: every P message and the dense ones, then every B message (five alone)
            assert rec["gathers"] == [LOWRANK_PART, LOWRANK_PART], where
        assert not _equal_nested(records[0]["state"], records[-1]["state"])  # the state did move
    for a, b in zip(runs[0]["records"], runs[1]["records"]):  # the averages are identical on both workers
        assert _equal_nested(a["averaged"], b["averaged"])


def test_tensors_without_rows_are_coded_whatever_their_trailing_shape() -> None:
    """A tensor of 3 or more dimensions with no rows (shaped (0, 3, 4)) is a 0 x 12 matrix of rows: coded, packed
    and decoded beside others like any tensor (its reshape used to fail: with no rows, -1 could be any width)."""
    empty = torch.zeros(0, 3, 4)
    assert rows_view(empty).shape == (0, 12)
    q, scales = quantize_int8(empty)
    assert q.shape == (0, 12) and scales.shape == (0,)
    xs = [torch.randn(5, 3), empty, torch.randn(2, 3, 4)]
    message, sent, layout = pack_rows(xs)
    means = mean_of_packed(torch.stack([message] * 2), layout)  # two workers sending the same
    assert [m.shape for m in means] == [s.shape for s in sent] == [x.shape for x in xs]
    assert all(torch.equal(m, s) for m, s in zip(means, sent))
    assert all(torch.allclose(s, x, atol=0.03) for s, x in zip(sent, xs))
