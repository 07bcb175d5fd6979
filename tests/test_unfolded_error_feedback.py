"""The grouped step (both layouts) keeps the error feedback unfolded (``R``, ``c = Q^T R``, ``E = R - Q c``) where the
algebra allows: it matches the per-matrix reference over many steps, across basis changes and periodic folds, and
everything that reads or writes the buffer from outside the step sees ``E`` itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_optim import _close, _ef, _gen
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.config import SyncConfig
from lightning_lordo.lightning.resume import reset_error_feedback
from lightning_lordo.optim.functional import EF_PROJECTION, FOLD_EVERY
from lightning_lordo.sync.exchange import averaged_state

#: Knobs where the buffer unfolds, and where it cannot (a normalizer that varies within a column with the
#: accumulated input; a bfloat16 buffer), which keep the folded step.
UNFOLDING = {
    "defaults (col_rms, accumulated)": {},
    "scalar": {"normalizer": "scalar"},
    "authors (mean_denom)": {"normalizer": "mean_denom", "omega": 0.97},
    "gradient input, lifted": {"full_rank_input": "gradient", "normalizer": "lifted"},
    "decayed": {"ef_decay": 0.8, "mu": 1.3},
    "subspace_qh": {"update": "subspace_qh", "omega": 0.9},
    "omega 1": {"omega": 1.0},
    "mu auto, gradient input": {"mu": "auto", "full_rank_input": "gradient"},
}
FOLDED = {
    "lifted, accumulated": {"normalizer": "lifted"},
    "bfloat16 buffer": {"ef_dtype": "bfloat16"},
    "mu auto, accumulated": {"mu": "auto"},
}


@pytest.fixture(params=[True, False], ids=["in-place", "stacked"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both layouts of the grouped step on the CPU: in place (the CPU's default) and stacked (the accelerators'), as
    the ``layout=`` every LoRDO the test builds takes (the constructor's default, set here)."""
    defaults = {**LoRDO.__init__.__kwdefaults__, "layout": "in_place" if request.param else "stacked"}
    monkeypatch.setattr(LoRDO.__init__, "__kwdefaults__", defaults)


def _model(seed: int) -> list[nn.Parameter]:
    """Two wide matrices of one shape (one group), a tall one of the same canonical shape, a square one, a bias."""
    gen = _gen(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 14), (6, 14), (14, 6), (8, 8), (8,)]]


def _run(knobs: dict[str, Any], steps: int, foreach: bool, rebase_at: tuple[int, ...] = (9, 27)
         ) -> tuple[list[nn.Parameter], LoRDO, int]:
    """``steps`` steps on gradients with a mean (the buffer's sums grow) and new bases at ``rebase_at``; returns the
    parameters, the optimizer and how many steps began with the buffers unfolded."""
    params = _model(1)
    opt = LoRDO(params, lr=0.02, rank=3, weight_decay=0.05, foreach=foreach, **{"omega": 0.7, **knobs})
    gen, unfolded = _gen(2), 0
    mean = [torch.randn(p.shape, generator=gen) for p in params]
    for step in range(1, steps + 1):
        for p, m in zip(params, mean):
            p.grad = m + 0.5 * torch.randn(p.shape, generator=gen)
        unfolded += all(EF_PROJECTION in opt.state[p] for p in opt.lowrank_params()) and step > 1
        opt.step()
        if step in rebase_at:
            opt.install_bases({p: torch.randn(p.shape, generator=gen) for p in opt.lowrank_params()})
    return params, opt, unfolded


@pytest.mark.parametrize("knobs", UNFOLDING.values(), ids=UNFOLDING.keys())
def test_the_unfolded_step_matches_the_reference_across_folds_and_new_bases(knobs: dict[str, Any],
                                                                            layout: None) -> None:
    steps = FOLD_EVERY + 18  # a periodic fold, and two basis changes
    grouped, g_opt, unfolded = _run(knobs, steps, foreach=True)
    reference, r_opt, never = _run(knobs, steps, foreach=False)
    # unfolded except the first step, the step after each basis change and each FOLD_EVERY-th step
    assert never == 0 and unfolded >= steps - 5, unfolded
    for a, b in zip(grouped, reference):
        _close(a.detach(), b.detach(), rtol=2e-6)
        if b.ndim == 2:
            for key in ("exp_avg", "exp_avg_sq"):
                _close(g_opt.state[a][key], r_opt.state[b][key], rtol=1e-5)
            _close(_ef(g_opt, a), r_opt.state[b]["error_feedback"], rtol=1e-5)


@pytest.mark.parametrize("knobs", FOLDED.values(), ids=FOLDED.keys())
def test_knobs_that_do_not_allow_it_keep_the_buffer_folded(knobs: dict[str, Any], layout: None) -> None:
    grouped, opt, unfolded = _run(knobs, 6, foreach=True)
    assert unfolded == 0 and not any(EF_PROJECTION in opt.state[p] for p in grouped)


def test_a_long_unfolded_run_stays_close_to_the_reference_and_folds_every_fold_every_steps(layout: None
                                                                                         ) -> None:
    """No basis change for 200 steps of gradients with a large mean: the grouped step stays within float32
    rounding of the reference. The buffer is folded every FOLD_EVERY-th step (``c`` restarts at zero there), which
    bounds the sums whose difference is the projected gradient (measured over 2000 steps of this run: the first
    moments 9.9e-6 from the reference with the fold, 2.3e-5 without)."""
    grouped, _, unfolded = _run({}, 200, foreach=True, rebase_at=())
    reference, _, _ = _run({}, 200, foreach=False, rebase_at=())
    assert unfolded >= 190
    for a, b in zip(grouped, reference):
        _close(a.detach(), b.detach(), rtol=2e-6)
    params, opt, _ = _run({}, FOLD_EVERY - 1, foreach=True, rebase_at=())
    for t in (FOLD_EVERY, FOLD_EVERY + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=_gen(t))
        opt.step()
        restarted = [not opt.state[p][EF_PROJECTION].any() for p in opt.lowrank_params()]
        assert all(restarted) == (t == FOLD_EVERY) and any(restarted) == (t == FOLD_EVERY), (t, restarted)


def _step_both(one: tuple[list[nn.Parameter], LoRDO], other: tuple[list[nn.Parameter], LoRDO], steps: int,
               seed: int) -> None:
    """``steps`` steps of two optimizers on the same random gradients."""
    gen = _gen(seed)
    for _ in range(steps):
        for p, q in zip(one[0], other[0]):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        one[1].step()
        other[1].step()


def test_folding_keeps_the_values_and_the_next_steps() -> None:
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    twin, twin_opt, _ = _run({}, 5, foreach=True, rebase_at=())
    before = {p: _ef(opt, p).clone() for p in opt.lowrank_params()}
    assert all(EF_PROJECTION in opt.state[p] for p in before)
    opt.fold_error_feedback(params)
    for p, e in before.items():
        assert EF_PROJECTION not in opt.state[p]
        _close(opt.state[p]["error_feedback"], e, rtol=1e-6)
    _step_both((params, opt), (twin, twin_opt), steps=3, seed=3)
    for p, q in zip(params, twin):
        _close(p.detach(), q.detach(), rtol=1e-6)


def test_a_checkpoint_of_unfolded_buffers_resumes_bitwise(layout: None) -> None:
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    saved = copy.deepcopy(opt.state_dict())  # as from a file: no tensor shared with the running optimizer
    assert any(EF_PROJECTION in entry for entry in saved["state"].values())
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = LoRDO(copies, lr=0.02, rank=3, weight_decay=0.05, omega=0.7)
    resumed.load_state_dict(saved)
    _step_both((params, opt), (copies, resumed), steps=4, seed=4)
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(resumed.state[q][key], value), key


def test_what_reads_the_buffer_from_outside_the_step_sees_the_error_feedback() -> None:
    """A new basis, a sync that averages the buffer, a change of its dtype on a resume, and a reset of it."""
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    lowrank = opt.lowrank_params()
    expected = {p: _ef(opt, p).clone() for p in lowrank}
    # a new basis: E is kept as it is (moved in the basis it was unfolded in)
    opt.install_bases({p: torch.randn(p.shape, generator=_gen(5)) for p in lowrank})
    for p in lowrank:
        assert EF_PROJECTION not in opt.state[p]
        _close(opt.state[p]["error_feedback"], expected[p], rtol=1e-6)
    # a sync that averages the buffers averages E
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    expected = {p: _ef(opt, p).clone() for p in opt.lowrank_params()}
    entries = averaged_state(opt, params, SyncConfig(average_error_feedback=True))["error_feedback"]
    assert [p for p, _ in entries] == opt.lowrank_params()
    for p, (tensor,) in entries:
        assert EF_PROJECTION not in opt.state[p]
        _close(tensor, expected[p], rtol=1e-6)
    # a resume that casts the buffer to bfloat16
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    expected = [_ef(opt, p).clone() for p in opt.lowrank_params()]
    for group in opt.param_groups:
        group["ef_dtype"] = "bfloat16"
    opt.conform_state()
    for p, e in zip(opt.lowrank_params(), expected):
        state = opt.state[p]
        assert EF_PROJECTION not in state and state["error_feedback"].dtype == torch.bfloat16
        _close(state["error_feedback"], e.to(torch.bfloat16), rtol=1e-6)
    # a resume that turns error feedback off drops the buffer and its projection; one that keeps it as it is leaves
    # it unfolded (a resumed run continues bit for bit)
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    opt.conform_state()
    assert all(EF_PROJECTION in opt.state[p] for p in opt.lowrank_params())
    for group in opt.param_groups:
        group["error_feedback"] = False
    opt.conform_state()
    assert not any({"error_feedback", EF_PROJECTION} & set(opt.state[p]) for p in opt.lowrank_params())
    # zeroed buffers stand for E = 0
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    assert reset_error_feedback(opt) == len(opt.lowrank_params())
    for p in opt.lowrank_params():
        assert not _ef(opt, p).any()


def test_the_memory_report_counts_the_projection_whether_or_not_it_is_held_right_now() -> None:
    params, opt, _ = _run({}, 5, foreach=True, rebase_at=())
    lowrank = opt.lowrank_params()
    expected = sum(opt.state[p]["error_feedback"].numel() * 4 + opt.state[p]["exp_avg"].numel() * 4 for p in lowrank)
    assert all(EF_PROJECTION in opt.state[p] for p in lowrank)
    assert opt.memory_report()["error_feedback"] == expected
    opt.fold_error_feedback(params)
    assert opt.memory_report()["error_feedback"] == expected
    _, reference, _ = _run({}, 5, foreach=False, rebase_at=())  # the per-matrix step never unfolds
    assert reference.memory_report()["error_feedback"] == sum(
        reference.state[p]["error_feedback"].numel() * 4 for p in reference.lowrank_params())


def test_a_bucket_where_one_matrix_got_a_new_basis_is_folded_and_stays_exact(layout: None) -> None:
    """Two matrices of one shape share a bucket; a new basis for one of them folds it alone, and the next step takes
    the whole bucket folded (then unfolded again), matching the reference."""
    runs = []
    for foreach in (True, False):
        params = _model(1)
        opt = LoRDO(params, lr=0.02, rank=3, weight_decay=0.05, foreach=foreach, omega=0.7)
        gen = _gen(6)
        for step in range(1, 13):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) + 0.5
            opt.step()
            if step == 6:
                opt.install_bases({params[0]: torch.randn(params[0].shape, generator=gen)})
                if foreach:
                    assert EF_PROJECTION not in opt.state[params[0]] and EF_PROJECTION in opt.state[params[1]]
        runs.append((params, opt))
    (grouped, g_opt), (reference, r_opt) = runs
    for a, b in zip(grouped, reference):
        _close(a.detach(), b.detach(), rtol=2e-6)
        if b.ndim == 2:
            _close(_ef(g_opt, a), r_opt.state[b]["error_feedback"], rtol=1e-5)


def test_folding_many_buffers_in_stacks_gives_what_folding_each_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerators' fold at a basis change (``fold_each``: one batched ``Q c`` per stack of same-shape buffers)
    against the per-matrix fold, on random inputs: two shapes, stacks bounded to two buffers, a lone buffer and a
    buffer already folded (left as it is)."""
    from lightning_lordo.optim import functional
    from lightning_lordo.optim.bases import fold_each
    from lightning_lordo.optim.functional import fold_error_feedback

    monkeypatch.setattr(functional, "STACK_BYTES", 2 * 6 * 10 * 4)
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 10)] * 5 + [(4, 7)]
    states = [{"error_feedback": torch.randn(s, generator=gen), "basis": torch.linalg.qr(
        torch.randn(s[0], 3, generator=gen)).Q, EF_PROJECTION: torch.randn(3, s[1], generator=gen)} for s in shapes]
    del states[2][EF_PROJECTION]  # folded already
    reference = copy.deepcopy(states)
    for s in reference:
        fold_error_feedback(s)
    fold_each(states)
    for got, want in zip(states, reference, strict=True):
        assert EF_PROJECTION not in got
        torch.testing.assert_close(got["error_feedback"], want["error_feedback"], atol=1e-6, rtol=0)
    assert torch.equal(states[2]["error_feedback"], reference[2]["error_feedback"])


def test_the_stacked_fold_holds_one_stack_of_products_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fold_each`` (the stacked layout's fold at a refresh) in stacks of ``STACK_BYTES``: each stack's product ``Q c``
    is freed before the next one is made (two were alive at once: a sync's transient above its bound of two buckets),
    and the buffers take the float64 reference's values."""
    import weakref

    from lightning_lordo.optim import bases, functional

    monkeypatch.setattr(functional, "STACK_BYTES", 2 * 8 * 16 * 4)  # two (8, 16) float32 buffers a stack
    gen = torch.Generator().manual_seed(0)
    states = [{"error_feedback": torch.randn(8, 16, generator=gen), "basis": torch.linalg.qr(torch.randn(
        8, 2, generator=gen))[0], EF_PROJECTION: torch.randn(2, 16, generator=gen)} for _ in range(6)]
    expected = [(s["error_feedback"].double() - s["basis"].double() @ s[EF_PROJECTION].double()) for s in states]
    products: list[weakref.ref] = []
    alive: list[int] = []
    bmm = torch.bmm

    def tracked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        alive.append(sum(r() is not None for r in products))
        out = bmm(a, b)
        products.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "bmm", tracked)
    bases.fold_each(states)
    assert alive == [0, 0, 0], alive  # three stacks of two
    for s, e in zip(states, expected):
        assert EF_PROJECTION not in s and torch.allclose(s["error_feedback"].double(), e, atol=1e-6)
