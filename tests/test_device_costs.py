"""What a GPU pays for, counted on the CPU (``benchmarks/counts.py``); one process's sync, which is the
basis refresh alone: nothing compressed, averaged or broadcast."""

from __future__ import annotations

import functools
import math
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from strategy_helpers import TinyRegressor, loader, lordo, sync_rounds, trainer
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo._tensors import FlatLayout
from lightning_lordo.comm import communicator, lowrank_phases
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.config import SyncConfig
from lightning_lordo.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.optim import fullrank, functional
from lightning_lordo.strategy_knobs import PRESETS
from lightning_lordo.sync import bucketed

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import counts  # noqa: E402


def _fit(preset: str, steps: int = 12) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = TinyRegressor()
    trainer(lordo(sync_every=4, start_method="popen", **PRESETS[preset][0]), devices=1, max_steps=steps).fit(
        module, loader())
    return [p.detach().clone() for p in module.parameters()]


def test_alone_the_compressed_preset_follows_the_lean_preset_bit_for_bit() -> None:
    """``"lordo_compressed"`` with one device has nothing to send, so it compresses nothing: its trajectory is
    ``"lordo_lean"``'s (the same optimizer knobs), bit for bit, over three syncs."""
    compressed, lean = _fit("lordo_compressed"), _fit("lordo_lean")
    assert all(torch.equal(a, b) for a, b in zip(compressed, lean, strict=True))
    default = _fit("lordo")  # and the comparison can fail: other knobs give another trajectory
    assert not all(torch.equal(a, b) for a, b in zip(default, lean, strict=True))


def test_alone_the_sync_knobs_that_only_shape_messages_are_neutral() -> None:
    config = SyncConfig(payload="lowrank", payload_dtype="int8", fullrank_rank=16, moments_every=4,
                        average_fullrank_moments=True, broadcast_bases=True, sync_every=8).alone()
    assert (config.payload, config.payload_dtype, config.fullrank_rank, config.moments_every) == ("full", "float32",
                                                                                                  0, 1)
    assert not (config.average_fullrank_moments or config.broadcast_bases) and config.sync_every == 8


@pytest.mark.parametrize("preset", counts.SYNC_PRESETS)
def test_a_sync_reads_back_at_most_two_values_alone(preset: str) -> None:
    row = counts.count_sync(preset)
    assert row["world"] == 1 and row["reads"] <= 2, row


@pytest.mark.timeout(120)
def test_a_sync_reads_back_at_most_two_values_with_two_workers() -> None:
    rows = counts.count_syncs_two_processes()
    assert [r["preset"] for r in rows] == list(counts.SYNC_PRESETS)
    assert all(r["world"] == 2 and r["reads"] <= 2 for r in rows), rows
    # issue 29's target, at most 2 ops per tensor: a message is packed in one op per bucket and unpacked in a few per
    # trailing shape (``FlatLayout``), not a view per tensor (4.85 ops per tensor before, 2.60 with the views)
    full_payload = [r for r in rows if r["preset"] in ("lordo", "lordo_lean")]
    assert all(r["ops_per_tensor"] <= 2.0 for r in full_payload), rows
    # the same target for the compressed preset: the low-rank payload stacks same-shape matrices (the accelerators'
    # layout), the int8 codec codes every row of a message in one pass, and the messages travel as two collectives
    # (73.4 before, 9.30 matrix by matrix, 3.82 with rows coded by length in five messages, 1.85 now)
    assert next(r for r in rows if r["preset"] == "lordo_compressed")["ops_per_tensor"] <= 2.0, rows


def _cuts(shape: tuple[int, int, int, int], divisor: int) -> dict[str, list[int]]:
    """How the work of a GPT of ``shape`` is cut under :func:`counts.byte_bounds_divided`: the stacks of each shape of
    low-rank matrices, the sync's buckets (``bucket_cap_mb`` divided too), the units and buckets of
    ``lordo_compressed``'s streamed round (every matrix's message low-rank; its cap: the bucket cap or the largest
    matrix), the collectives' messages of the parameters' own tensors, the chunks of the whole model flattened and of
    the low-rank messages (``P`` and ``B`` at the counts' rank 8: sized by the rank, these shrink 4 times where the
    bounds shrink 16), and the row slices of each full-rank matrix."""
    layers, width, vocab, heads = shape
    model = CharGPT(vocab_size=vocab, d_model=width, n_layers=layers, n_heads=heads, seq_len=32)
    params = list(model.parameters())
    full = {id(p) for p in full_rank_params(model)}
    lowrank = [p for p in params if p.dim() == 2 and id(p) not in full]
    by_shape: dict[tuple[int, ...], int] = {}
    for p in lowrank:
        by_shape[tuple(p.shape)] = by_shape.get(tuple(p.shape), 0) + 1
    cap = SyncConfig.bucket_cap_mb / divisor * 2**20
    sent = [p for p in params if p.dim() == 2]  # lordo_compressed: every matrix's message is low-rank
    streamed_cap = max(cap, max(p.numel() for p in sent) * 4)  # as bucketed._exchange_streamed sets it
    units = lowrank_phases.make_units(SimpleNamespace(batched=True, ranks=[8] * len(sent)), sent, streamed_cap)
    messages = sum(8 * sum(p.shape) for p in sent)  # P (a x r) and B (r x b) of every matrix
    with counts.byte_bounds_divided(divisor):
        return {
            "stacks": [len(functional.stack_slices(n, math.prod(s))) for s, n in by_shape.items()],
            "buckets": [len(b) for b in bucketed.buckets(params, set(lowrank), cap)],
            "units": [len(u) for u in units],
            "streamed buckets": [len(b) for b in lowrank_phases._buckets(units, sent, streamed_cap)],
            "messages": [len(b) for b in communicator._buckets(params)],
            "chunks": [len(communicator._chunks(torch.empty(n, device="meta")))
                       for n in (sum(p.numel() for p in params), messages)],
            "rows": [len(fullrank.row_slices(*p.shape)) for p in params if p.dim() == 2 and id(p) in full],
        }


def test_gpt2_small_a_sixteenth_the_size_is_cut_as_gpt2_small_is() -> None:
    """The counts below run GPT-2-small at a quarter of its width and vocabulary (every matrix 16 times smaller) with
    every byte bound divided by 16: it is cut into the same stacks, buckets, units, messages and slices, so it
    dispatches what GPT-2-small does. With the package of 15ef1eb both gave the same ops, sync by sync (361, 283, 390,
    335) and step by step (LoRDO 309, lean 229, foreach AdamW 404), in 7 s and 2 s against 122 s and 21 s. The
    comparison can fail: not dividing the bounds cuts the small model otherwise."""
    full, small = _cuts(counts.GPT2_SMALL, 1), _cuts(counts.GPT2_SMALL_BY_16, 16)
    assert full == small, (full, small)
    assert max(full["stacks"]) > 1 and len(full["buckets"]) > 1 and max(full["rows"]) > 1  # the bounds cut it
    assert _cuts(counts.GPT2_SMALL_BY_16, 1) != full


@functools.cache
def _gpt2_small_syncs() -> tuple[dict, ...]:
    """The 2-process syncs of GPT-2-small (196 tensors) per preset, then ``lordo_compressed`` with its round held:
    counted once for the tests below, at a sixteenth of the size with the byte bounds divided as much (the test above).
    The second sync of a run (4 steps, K = 2) is counted, not the benchmark's third (6 steps): at 86dea76 both gave
    360, 282, 452 and 380 ops, and the run takes a third less time."""
    return tuple(counts.count_syncs_two_processes(shapes=(counts.GPT2_SMALL_BY_16,), held=(counts.GPT2_SMALL_BY_16,),
                                                  steps=4, bytes_divisor=16))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sync_of_gpt2_small_dispatches_at_most_two_ops_per_tensor() -> None:
    """Issue 29's target at full width, 2 processes: at most 2 ops per tensor for every preset, where the sync holds
    its round (``lordo``, ``lordo_lean``; ``lordo_compressed`` with a ``bucket_cap_mb`` above its matrices) and where
    ``lordo_compressed``'s low-rank messages stream at the default ``bucket_cap_mb`` (bounding its memory). The
    streamed sync made 2.31 ops per tensor while it made ``Q B`` for its norms and recomputed the bases from it; the
    payload's own ``Q`` and ``|B|`` (B6) leave ``Q B`` to the commit."""
    rows = _gpt2_small_syncs()
    assert [r["preset"] for r in rows] == ["lordo", "lordo_lean", "lordo_compressed", "lordo_compressed"], rows
    assert all(r["world"] == 2 and r["reads"] <= 2 for r in rows), rows
    lordo, lean, streamed, held = rows
    assert not (lordo["streamed"] or lean["streamed"] or held["streamed"]) and streamed["streamed"]
    assert all(r["ops_per_tensor"] <= 2.0 for r in rows), rows


@pytest.mark.parametrize("seed", range(3))
def test_a_flat_layout_gives_every_tensor_back_in_a_few_ops_per_trailing_shape(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool = [(), (5,), (3,), (4, 5), (2, 5), (7, 3), (2, 2, 3), (1, 2, 3), (0, 5), (6, 0)]
    shapes = [pool[int(i)] for i in torch.randint(len(pool), (40,), generator=gen)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    layout = FlatLayout([t.shape for t in tensors])
    flat = layout.pack(tensors)
    assert flat.shape == (sum(t.numel() for t in tensors),)
    with counts.Counts() as c:
        out = layout.unpack(flat)
    for t, o in zip(tensors, out, strict=True):
        assert o.shape == t.shape and torch.equal(o, t)
        assert o.numel() == 0 or o.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views
    assert c.ops <= 1 + 2 * len(layout.groups) < len(tensors), (c.ops, len(layout.groups))


def test_the_counter_sees_reads_of_device_values_but_not_of_step_counters() -> None:
    """The counter can fail: ``.item()``, ``bool()`` and ``.tolist()`` of a computed value count, reads of the step
    counters (host memory on an accelerator too) and of what is computed from them alone do not."""
    step, value = torch.tensor(3.0), torch.randn(4)
    with counts.Counts([step]) as c:
        step.item()
        torch.stack([step, step]).tolist()
        value.sum().item()
        bool(value.abs().max() > 0)
        value.tolist()
        value.view(2, 2)
    assert c.reads == 3
    # host ops: step.item, the stack of steps; views: value.view; kernels: sum, item, abs, max, gt, is_nonzero
    assert (c.host_ops, c.device_views, c.ops - c.host_ops - c.device_views) == (2, 1, 6), c.by_op


@pytest.mark.slow
def test_an_optimizer_steps_kernels_grow_with_the_shapes_not_with_the_depth() -> None:
    """The accelerators' stacked step launches its kernels per shape (and per 64 MB stack), not per matrix: the same
    kernel ops at 12 and 24 layers. Counted as a GPU runs it: torch's foreach AdamW for the embeddings and the head,
    step counters on the host. It still launches far more than AdamW (``benchmarks/README.md``): the ratios to
    foreach AdamW are here to be printed, not held."""
    rows = [counts.count_steps(shape) for shape in (counts.SCALED_12, counts.SCALED_24)]
    tensors = 196  # the 12-layer GPT's parameter tensors: the step is batched, fewer kernel ops than tensors
    for name in ("lordo", "lordo_lean"):
        assert rows[0][name]["kernel_ops"] == rows[1][name]["kernel_ops"] < tensors, rows


def test_stacked_bases_match_the_per_matrix_reference() -> None:
    """New bases and rotated moments in the accelerators' stacked layout against the per-matrix path, on random
    inputs (tall, wide, two shapes, two ranks, each transition)."""
    def run(stacked: bool, transition: str) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(12, 30), (12, 30), (30, 12), (16, 16)]]
        opt = LoRDO(params, lr=0.01, rank=4, transition=transition, power_iters=2,
                    layout="stacked" if stacked else None)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        moved = opt.install_bases({p: torch.randn(p.shape, generator=gen) for p in params})
        return [t for p in params for t in (opt.state[p]["basis"], opt.state[p]["exp_avg"],
                                              opt.state[p]["exp_avg_sq"], moved[p])]

    for transition in ("rotate", "reset", "keep"):
        for a, b in zip(run(True, transition), run(False, transition), strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), transition


def test_a_lowrank_matrix_its_rank_does_not_compress_travels_in_full() -> None:
    """The low-rank payload's guard (as the full-rank matrices' one): a 16 x 24 matrix at rank 16 would send
    16 x 40 numbers (2,560 B) for its 384 (1,536 B), so it travels in full; a 64 x 96 one at rank 16 is compressed."""
    from lightning_lordo.comm.lowrank import LowRankPayload
    from lightning_lordo.comm.quantization import QuantizedAverager
    from lightning_lordo.sync.payloads import PseudoGradientPayloads

    small, large, bias = nn.Parameter(torch.zeros(16, 24)), nn.Parameter(torch.zeros(64, 96)), nn.Parameter(
        torch.zeros(16))
    payloads = PseudoGradientPayloads([small, large, bias], {small: 16, large: 16}, SyncConfig(payload="lowrank"))
    groups = {name: (positions, type(message)) for name, positions, message, _ in payloads.groups}
    assert groups["lowrank"] == ([1], LowRankPayload)
    assert groups["lowrank_in_full"] == ([0], QuantizedAverager)
    assert groups["fullrank"] == ([2], QuantizedAverager)
    assert LowRankPayload.traffic_bytes([(16, 24)], [16]) == 2560 > 16 * 24 * 4
    full = PseudoGradientPayloads([small, large, bias], {small: 16, large: 16}, SyncConfig(payload="full"))
    assert [positions for _, positions, _, _ in full.groups] == [[0, 1], [2]]  # the full payload: unchanged


def test_error_feedback_is_bfloat16_on_accelerators_and_float32_on_the_cpu_by_default() -> None:
    from lightning_lordo.config import OPTIMIZER_DEFAULTS, ef_dtype_for

    assert OPTIMIZER_DEFAULTS["ef_dtype"] == "auto"
    assert ef_dtype_for("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert ef_dtype_for("auto", torch.device("cpu")) == torch.float32
    assert ef_dtype_for("float32", torch.device("cuda", 0)) == torch.float32
    p = nn.Parameter(torch.randn(8, 16))
    opt = LoRDO([p], rank=2, error_feedback=True)
    p.grad = torch.randn(8, 16)
    opt.step()
    assert opt.state[p]["error_feedback"].dtype == torch.float32


def _alone_run(general: bool, cap_mb: float, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[list[torch.Tensor], list[int], int]:
    """Three one-process syncs of a small GPT (bucket by bucket, or the general path); returns the parameters, anchor
    and optimizer state after them with the syncs' reported norms, the parameters' float32 bytes and the largest
    transient of a sync."""
    from datetime import timedelta

    import memory  # benchmarks/memory.py: LiveBytes

    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.convert import full_rank_params
    from lightning_lordo.models import CharGPT
    from lightning_lordo.sync import bucketed as alone
    from lightning_lordo.sync.synchronizer import Synchronizer

    if general:
        monkeypatch.setattr(alone, "applies", lambda sync: False)
    torch.manual_seed(0)
    net = CharGPT(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=16, tie_weights=False)
    params = list(net.parameters())
    opt = LoRDO(params, lr=1e-2, rank=4, error_feedback=True, full_rank=full_rank_params(net))
    sync = Synchronizer(params, [], opt, SyncConfig(sync_every=2, bucket_cap_mb=cap_mb, synchronous=False),
                        Communicator(CommAccountant(), timedelta(seconds=30)))
    gen = torch.Generator().manual_seed(1)
    peak, norms = 0, []
    for step in range(6):
        opt.zero_grad()
        net(torch.randint(0, 256, (2, 16), generator=gen)).square().mean().backward()
        sync.before_optimizer_step()
        opt.step()
        with memory.LiveBytes() as live:
            report = sync.on_optimizer_step()
        peak = max(peak, live.peak) if step % 2 else peak
        norms += [report.pseudo_gradient_norm] if report is not None else []
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params] + sync.anchor.tensors + state + [torch.tensor(norms)], [
        p.numel() * 4 for p in params], peak


def test_one_process_syncs_bucket_by_bucket_as_the_general_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-process sync (``sync/bucketed.py``) gives the general path's parameters, anchor and optimizer state bit
    for bit, and holds at most a bucket of pseudo-gradient at once where the general path holds the whole model."""
    cap_mb = 0.05  # about a tenth of this model
    bucketed, sizes, bucketed_peak = _alone_run(False, cap_mb, monkeypatch)
    whole, _, whole_peak = _alone_run(True, cap_mb, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(bucketed, whole, strict=True))
    assert whole_peak >= sum(sizes)  # the general path: the whole pseudo-gradient at once
    # one bucket (or the largest tensor, a bucket of its own) and the bases, moments and norms (well under 64 KB)
    assert bucketed_peak <= max(cap_mb * 2**20, max(sizes)) + 64 * 1024 < sum(sizes) / 2, (bucketed_peak, sum(sizes))


def test_one_process_overlapped_rounds_with_module_buffers() -> None:
    """Alone nothing is averaged, buffers included: an overlapped round lands with the live buffers as they are (it
    used to fail, zipping no averages with the live buffers)."""
    from datetime import timedelta

    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.sync.synchronizer import Synchronizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    params = list(net.parameters())
    opt = LoRDO(params, lr=1e-2, rank=2)
    sync = Synchronizer(params, list(net.buffers()), opt, SyncConfig(sync_every=4, overlap_steps=1),
                        Communicator(CommAccountant(), timedelta(seconds=30)))
    reports = []
    for _ in range(10):
        opt.zero_grad()
        net(torch.randn(6, 8)).square().mean().backward()
        sync.before_optimizer_step()
        opt.step()
        reports.append(sync.on_optimizer_step())
    landed = [r for r in reports if r is not None]
    assert len(landed) == 2 and not any(r.skipped for r in landed)
    assert torch.isfinite(net[1].running_mean).all() and net[1].num_batches_tracked.item() == 10


def test_finiteness_of_half_precision_tensors_is_not_an_overflow_of_their_norm() -> None:
    from lightning_lordo._tensors import finite_flags

    big = torch.full((65536,), 300.0, dtype=torch.float16)  # finite; its float16 norm would be inf
    assert finite_flags([big, torch.randn(3)]).tolist() == [True, True]
    big[7] = float("nan")
    assert finite_flags([big]).tolist() == [False]


def test_low_rank_payload_state_saved_before_the_guard_loads_into_the_split_groups() -> None:
    """A checkpoint whose low-rank payload covered a matrix its rank does not compress: the state of the matrices it
    still sends is kept (by position), that matrix's restarts."""
    from lightning_lordo.sync.payloads import PseudoGradientPayloads

    small, large, other = (nn.Parameter(torch.zeros(s)) for s in [(16, 24), (64, 96), (48, 96)])
    config = SyncConfig(payload="lowrank")
    payloads = PseudoGradientPayloads([small, large, other], {small: 16, large: 16, other: 16}, config)
    right = [torch.randn(24, 16), torch.randn(96, 16), torch.randn(96, 16)]  # as saved: all three, in order
    errors = [torch.randn(16, 24), torch.randn(64, 96), torch.randn(48, 96)]
    payloads.load_state_dict({"lowrank": {"right": right, "errors": errors}, "averager": {"errors": []}})
    state = payloads.lowrank_payload.state_dict()
    assert [tuple(r.shape) for r in state["right"]] == [(96, 16), (96, 16)]
    assert torch.equal(state["right"][0], right[1]) and torch.equal(state["errors"][1], errors[2])


def _transient_worker(rank: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_lordo.comm import communicator
    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.convert import full_rank_params
    from lightning_lordo.models import CharGPT
    from lightning_lordo.sync import bucketed
    from lightning_lordo.sync.synchronizer import Synchronizer

    torch.set_num_threads(1)
    communicator._MESSAGE_BYTES = 64 * 1024  # small messages, so that a bucket is a small part of this model
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    results = {}
    for path in ("bucketed", "general"):
        if path == "general":
            bucketed.applies = lambda sync: False  # this forked process's module only
        torch.manual_seed(0)
        net = CharGPT(vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, tie_weights=False)
        params = list(net.parameters())
        opt = LoRDO(params, rank=4, full_rank=full_rank_params(net))
        comm = Communicator(CommAccountant(), timedelta(seconds=60))
        sync = Synchronizer(params, [], opt, SyncConfig(sync_every=2, bucket_cap_mb=0.05), comm)
        peak, norms, grads_after = 0, [], []
        for report, live_peak in sync_rounds(sync, opt, params, 6, rank):
            peak = max(peak, live_peak)
            norms.append(report.pseudo_gradient_norm)
            grads_after.append(all(p.grad is None for p in params))
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        copies = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(copies, flat)
        lowrank = opt.lowrank_params()  # a sync's low-rank messages: the averaged moments and the new bases
        messages = sum(opt.state[p][k].numel() * 4 for p in lowrank for k in ("exp_avg", "exp_avg_sq", "basis"))
        results[path] = {"messages": messages,
                         "tensors": [p.detach().clone() for p in params] + sync.anchor.tensors + state,
                         "norms": norms, "peak": peak, "bytes": dict(comm.accountant.totals),
                         "identical": torch.equal(*copies), "released": grads_after,
                         "sizes": [p.numel() * 4 for p in params]}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_workers_sync_bucket_by_bucket_as_the_general_path_does(tmp_path: Path) -> None:
    """With several processes and the full float32 payload, the sync averages the pseudo-gradient a bucket at a
    time and stages the new point in the gradients (``sync/bucketed.py``): bit for bit the general path's parameters,
    anchor, optimizer state, norms and bytes, with the replicas identical, the gradients released after each sync,
    and a transient of at most two buckets (the bucket and its flat message) where the general path holds the whole
    pseudo-gradient."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_transient_worker, args=(port, str(tmp_path / "peak")), nprocs=2, start_method="fork")
    for rank in range(2):
        runs = torch.load(tmp_path / f"peak.{rank}", weights_only=False)
        one, whole = runs["bucketed"], runs["general"]
        assert one["identical"] and whole["identical"] and len(one["norms"]) == 3
        assert all(torch.equal(a, b) for a, b in zip(one["tensors"], whole["tensors"], strict=True))
        assert one["norms"] == whole["norms"] and one["bytes"] == whole["bytes"]
        assert one["released"] == [True] * 3 and whole["released"] == [False] * 3
        model, largest = sum(one["sizes"]), max(one["sizes"])
        assert whole["peak"] >= model  # the general path: the whole pseudo-gradient at once
        # two buckets (a tensor larger than the cap is a bucket of its own) and the low-rank messages, twice (the
        # commit rotates the averaged moments into the new bases), and the norms and figures (well under 64 KB)
        bound = 2 * max(0.05 * 2**20, largest) + 2 * one["messages"] + 64 * 1024
        assert one["peak"] <= bound < model, (one["peak"], bound, model)


def test_buckets_start_anew_for_every_kind_and_take_empty_tensors() -> None:
    from lightning_lordo.sync.bucketed import buckets

    empty, a, b, w = torch.zeros(0), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(8, 8)
    assert buckets([empty, a, w, b], {w}, 2**20) == [[2], [0, 1], [3]]  # low-rank first; one kind per bucket
    assert buckets([a, a.clone(), a.clone()], set(), 32) == [[0, 1], [2]]  # 16 bytes each, at most 32 a bucket


def test_a_finite_float64_tensor_past_float32s_range_is_finite() -> None:
    from lightning_lordo._tensors import finite_flags

    big = torch.full((4,), 1e100, dtype=torch.float64)  # norm 2e100: finite in float64, past float32 (3.4e38)
    assert finite_flags([big]).tolist() == [True]
    big[0] = float("inf")
    assert finite_flags([big]).tolist() == [False]


def test_a_stacked_step_works_in_bounded_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerators' layout stacks same-shape matrices, a copy of them: a group above ``STACK_BYTES`` is worked
    on in several stacks, with the same trajectory and a transient bounded by the stack, not by the group."""
    import memory

    from lightning_lordo.optim import functional

    torch.manual_seed(0)
    start = [torch.randn(24, 40) for _ in range(6)] + [torch.randn(40, 24) for _ in range(6)]  # wide and tall

    def run(stack_bytes: int) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(functional, "STACK_BYTES", stack_bytes)
        params = [nn.Parameter(w.clone()) for w in start]
        opt = LoRDO(params, rank=4, lr=1e-2, layout="stacked")
        peak = 0
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with memory.LiveBytes() as live:
                opt.step()
            peak = max(peak, live.peak) if step else 0  # the first step creates the state
        return [p.detach() for p in params], peak

    whole, whole_peak = run(2**30)
    stacked_by_two, bounded_peak = run(2 * 24 * 40 * 4)
    for a, b in zip(whole, stacked_by_two, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert bounded_peak < whole_peak / 2, (bounded_peak, whole_peak)


def test_a_batched_payload_dispatches_ops_per_shape_not_per_matrix() -> None:
    """Twelve matrices of one shape: the matrix-by-matrix payload dispatches ops per matrix, the batched one a
    number that does not grow with the matrices (the accelerators' layout)."""
    counted = {}
    for batched, n in [(False, 12), (False, 24), (True, 12), (True, 24)]:
        payload = LowRankPayload([2] * n, seed=1, payload_dtype="int8", batched=batched)
        ds = [torch.randn(6, 10) for _ in range(n)]
        comm = Communicator(CommAccountant(), timedelta(seconds=20))
        payload.commit(payload.reduce(comm, ds))  # the state exists from here on
        with counts.Counts() as count:
            payload.reduce(comm, ds)
        counted[(batched, n)] = count.ops
    assert counted[(True, 12)] == counted[(True, 24)] < counted[(False, 12)], counted
    assert counted[(False, 24)] - counted[(False, 12)] >= 12 * 5, counted  # at least 5 ops per matrix


def test_a_gradient_average_reads_back_only_where_this_rank_lacks_a_gradient() -> None:
    """The synchronous steps (``"lowrank_ddp"``, ``warmup_steps``): every gradient present, the average dispatches
    one op for the flags it sends beside them and reads nothing back (it wrote each flag with its own op, one per
    parameter, and read them all back every step); a missing one is read back to learn whether another rank had it."""
    from lightning_lordo.sync.exchange import average_gradients

    identity_comm = SimpleNamespace(world_size=2, average_temporaries=lambda tensors, purpose: None)  # as if equal
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(50)]
    for p in params:
        p.grad = torch.randn_like(p)
    with counts.Counts() as all_present:
        average_gradients(identity_comm, params)
    assert all_present.reads == 0 and all_present.ops <= 2, (all_present.reads, all_present.by_op)
    params[3].grad = None
    with counts.Counts() as one_missing:
        average_gradients(identity_comm, params)
    assert one_missing.reads == 1 and params[3].grad is None and params[4].grad is not None


def test_the_diagnostics_of_a_round_are_one_host_read() -> None:
    """The sums a round's last step collects (low-rank and full-rank terms, error feedback) are read back together,
    once per sync (they were three reads: a GPU stall each)."""
    from lightning_lordo import LoRDO

    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12))]
    opt = LoRDO(params, rank=4, error_feedback=True)
    for step in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 1:
            opt.request_diagnostics()
        opt.step()
    with counts.Counts() as c:
        found = opt.diagnostics()
    assert set(found) == {"term_ratio", "error_feedback_norm"} and c.reads == 1, (found, c.reads)
