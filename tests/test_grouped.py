"""The grouped optimizer step against the per-matrix reference (and float64), the way torch tests foreach
against for-loop implementations: mixed shapes, orientations, dtypes and step counts."""

from __future__ import annotations

import pytest
import torch
from test_optim import RANK, _close, _gen, _hyper, _randomize_state, _ref_step, _snapshot
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.optim import functional

# -------------------------------------------------------------------------------- grouped vs reference
GROUPED_CASES = {
    "lordo col_rms": {"normalizer": "col_rms"},
    "lordo factored mu auto": {"normalizer": "factored", "mu": "auto"},
    "lordo lifted": {"normalizer": "lifted"},
    "lordo scalar": {"normalizer": "scalar"},
    "authors": {"normalizer": "mean_denom", "full_rank_input": "accumulated", "omega": 0.97},
    "subspace_qh": {"update": "subspace_qh", "omega": 0.9},
    "unnormalized": {"update": "unnormalized_lowrank", "normalizer": "mean_denom"},
    "bf16 error feedback, decayed": {"ef_dtype": "bfloat16", "ef_decay": 0.7, "full_rank_input": "accumulated"},
    "omega 1": {"omega": 1.0},
}
IN_PLACE_CASES = {name for name, knobs in GROUPED_CASES.items() if knobs.get("normalizer") != "factored"}


def _mixed_model(seed: int) -> list[nn.Parameter]:
    """Wide and tall matrices of one canonical shape (one group), a square one, bfloat16 and float64 ones, and
    full-rank tensors of three dtypes."""
    gen = _gen(seed)
    shapes = [(5, 11), (5, 11), (11, 5), (11, 5), (7, 7), (5, 11), (5, 11), (9,), (3, 4), (6,)]
    dtypes = [torch.float32] * 5 + [torch.bfloat16, torch.float64, torch.float32, torch.bfloat16, torch.float64]
    return [nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dtypes)]


@pytest.fixture(params=[True, False], ids=["in-place", "stacked"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Both layouts of the grouped step on the CPU: in place (the CPU's default) and stacked (the accelerators').
    Returns how many groups each layout stepped, so a test can check which one ran. Every LoRDO the test builds
    takes ``layout=`` (the constructor's default, set here)."""
    defaults = {**LoRDO.__init__.__kwdefaults__, "layout": "in_place" if request.param else "stacked"}
    monkeypatch.setattr(LoRDO.__init__, "__kwdefaults__", defaults)
    calls = {"in_place": 0, "stacked": 0, "requested": request.param}
    for name in ("in_place", "stacked"):
        original = getattr(functional, f"_lowrank_{name}")

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(functional, f"_lowrank_{name}", counted)
    return calls


def _check_layout(calls: dict[str, int], case: str) -> None:
    """The requested layout stepped the float32 groups (the bfloat16 and float64 ones and the factored normalizer
    always take the stacked one)."""
    if calls["requested"] and case in IN_PLACE_CASES:
        assert calls["in_place"] > 0 and calls["stacked"] > 0  # the float64 / bfloat16 matrices
    else:
        assert calls["in_place"] == 0 and calls["stacked"] > 0


def test_error_feedback_is_laid_out_like_its_weight_and_an_older_contiguous_buffer_steps_the_same(
        layout: dict[str, int]) -> None:
    """A tall matrix's error feedback is its canonical (transposed) view of a buffer laid out like the weight, so
    the step reads it in the gradient's memory order; a contiguous buffer (as checkpoints of earlier versions hold
    it) gives the same step."""
    runs = []
    for contiguous in (False, True):
        params = _mixed_model(40)
        opt = LoRDO(params, lr=0.05, rank=RANK, error_feedback=True, full_rank_input="accumulated", omega=0.9)
        _randomize_state(opt, _gen(41))
        ef = opt.state[params[2]]["error_feedback"]  # (11, 5): tall
        assert ef.shape == (5, 11) and ef.mT.is_contiguous() and not ef.is_contiguous()
        if contiguous:
            for p in opt.lowrank_params():
                opt.state[p]["error_feedback"] = opt.state[p]["error_feedback"].contiguous()
        gen = _gen(42)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        runs.append((params, opt))
    (new, new_opt), (old, old_opt) = runs
    for a, b in zip(new, old):
        _close(a.detach(), b.detach(), rtol=1e-6)
        for key, value in old_opt.state[b].items():
            _close(new_opt.state[a][key], value, rtol=1e-5, scale=1.0 if key == "error_feedback" else 0.0)


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_step_matches_the_reference_on_mixed_shapes_and_dtypes(case: str, layout: dict[str, int]) -> None:
    """The grouped step (in place, or stacked with batched matmuls; foreach math, torch's AdamW) and the per-matrix
    reference agree on random state and gradients, also when a group mixes step counts (one matrix reset) and the
    model mixes dtypes, and so do the diagnostics of the last step; each float32 matrix also agrees with the
    float64 reference of SPEC §3."""
    knobs = {"rank": RANK, "omega": 0.6, "error_feedback": True, "weight_decay": 0.05, **GROUPED_CASES[case]}
    runs = {}
    for foreach in (True, False):
        params = _mixed_model(30)
        opt = LoRDO(params, lr=0.05, betas=(0.8, 0.95), foreach=foreach, **knobs)
        _randomize_state(opt, _gen(31), t=3)
        opt.state[params[1]]["step"].fill_(0.0)  # another step count in the same group: its own bucket
        gen = _gen(32)
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            if step == 3 and foreach:
                refs = {i: _ref_step(_snapshot(opt, params[i]), _hyper(opt)) for i in (0, 2, 4)}
            if step == 3:
                opt.request_diagnostics()
            opt.step()
        runs[foreach] = (params, opt)
    _check_layout(layout, case)
    (grouped, g_opt), (reference, r_opt) = runs[True], runs[False]
    for a, b in zip(grouped, reference):
        # a float32 difference of 1e-7 in an update can round a bfloat16 weight the other way: one ulp per step
        tol = 4 * 2**-7 if a.dtype == torch.bfloat16 else 1e-5
        _close(a.detach(), b.detach(), rtol=tol)
        for key, value in r_opt.state[b].items():
            # the 3 x 4 matrix runs at rank 3, its full rank: its error feedback (G + E minus its projection) is zero
            # in exact arithmetic, float32 residue of the O(1) gradients that CPU kernels round differently (seen:
            # 2.4e-7 apart on one Xeon); compared at the gradients' scale
            scale = 1.0 if key == "error_feedback" else 0.0
            _close(g_opt.state[a][key], value, rtol=1e-4, scale=scale)
    for i, ref in refs.items():  # the last step of three float32 matrices (wide, tall, square) in float64
        _close(grouped[i].detach(), ref["W"], rtol=1e-5)
    diagnostics, expected = g_opt.diagnostics(), r_opt.diagnostics()
    assert diagnostics.keys() == expected.keys() and diagnostics
    for key, value in expected.items():
        assert diagnostics[key] == pytest.approx(value, rel=1e-5), key


def test_grouped_step_dispatches_a_fixed_number_of_ops_per_group(layout: dict[str, int]) -> None:
    """The stacked layout's dispatched ops do not grow with the number of same-shape matrices (the reference's do);
    the in-place layout's grow by its three full-size ops per matrix (projection, addmm_, addcdiv_)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(n: int, foreach: bool) -> int:
        params = [nn.Parameter(torch.randn(8, 16)) for _ in range(n)]
        opt = LoRDO(params, rank=2, foreach=foreach, error_feedback=False)  # the buffer adds its own full-size ops
        for p in params:
            p.grad = torch.randn(8, 16)
        opt.step()  # the first step installs the bases
        with Count() as count:
            opt.step()
        return count.ops

    grouped = [ops(n, True) for n in (2, 8)]
    reference = [ops(n, False) for n in (2, 8)]
    # per matrix its step counter (add is one foreach op, item each), in place also its three full-size ops
    assert grouped[1] - grouped[0] == 6 * (1 + 3 * layout["requested"])
    assert reference[1] - reference[0] >= 6 * 15


HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose")


@pytest.mark.parametrize("foreach", [True, False], ids=["grouped", "reference"])
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_a_step_reads_nothing_on_the_host_but_cpu_step_counters(case: str, foreach: bool,
                                                                layout: dict[str, int]) -> None:
    """No host synchronization with the parameters' device in ``step``: every scalar read (``.item()``, ``bool()``,
    ``==`` on tensors) a step dispatches reads one of the CPU step counters, and nothing else, also while it
    collects the diagnostics."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[tuple[str, torch.Tensor]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(str(func).startswith(name) for name in HOST_READS):
                self.reads.append((str(func), args[0]))
            return func(*args, **(kwargs or {}))

    params = _mixed_model(40)
    knobs = {"rank": RANK, "omega": 0.6, "error_feedback": True, **GROUPED_CASES[case]}
    opt = LoRDO(params, lr=0.05, foreach=foreach, **knobs)
    gen = _gen(41)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if step == 1:
            opt.request_diagnostics()
            counters = {opt.state[p]["step"].data_ptr() for p in params}
            with HostReads() as mode:
                opt.step()
        else:
            opt.step()  # the first step installs the bases from the gradients (not a step's own work)
    assert mode.reads, "the step counters are read on the host (as torch's Adam does)"
    for func, tensor in mode.reads:
        assert tensor.device.type == "cpu" and tensor.data_ptr() in counters, f"{func} on {tuple(tensor.shape)}"
    assert opt.diagnostics()  # and the diagnostics were collected without any host read
    if foreach:
        _check_layout(layout, case)


def test_in_place_layout_keeps_non_finite_weights_when_the_decay_zeroes_them(layout: dict[str, int]) -> None:
    """lr x weight_decay = 1 multiplies the weights by 0: a NaN or inf in them stays non-finite (the reference's
    W * 0), so the sync's fault check still sees it (a BLAS ``beta=0`` would drop it)."""
    counts = {}
    for foreach in (True, False):
        params = [nn.Parameter(torch.randn(6, 13, generator=_gen(50))) for _ in range(2)]
        opt = LoRDO(params, lr=1.0, weight_decay=1.0, rank=RANK, foreach=foreach)
        gen = _gen(51)
        for step in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if step == 1:
                with torch.no_grad():
                    params[0][0, 0], params[1][2, 3] = float("nan"), float("inf")
            opt.step()
        counts[foreach] = [int((~p.isfinite()).sum()) for p in params]
    assert counts[True] == counts[False] == [1, 1]


def test_the_layout_is_an_argument_checked_by_name() -> None:
    w = nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"Invalid layout='fast': allowed values are None \(by device\)"):
        LoRDO([w], rank=2, layout="fast")
    assert LoRDO([w], rank=2, layout="stacked").stacked_layout(w)
    assert not LoRDO([w], rank=2).stacked_layout(w)  # the CPU's
