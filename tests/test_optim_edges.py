"""The LoRDO optimizer used as a plain torch optimizer, at its edges: copied and pickled, loaded from AdamW's state,
a matrix whose first step has no gradient, a rank as large as a side, a basis that does not fit, the first basis's
oversampling."""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_continues_as_the_original_does(how: str) -> None:
    """torch keeps only ``defaults``, ``state`` and ``param_groups`` in a pickle; LoRDO's own attributes (its seed,
    layout, full-rank parameters) travel too, the full-rank ones by position."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(20, 12), nn.Tanh(), nn.Linear(12, 8)), torch.randn(16, 20)
    opt = LoRDO(model.parameters(), rank=4, seed=3, full_rank=[model[2].weight])
    _train(model, opt, x, 3)
    pair = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    twin, twin_opt = pair
    assert twin_opt.seed == 3 and twin_opt.lowrank_rank(twin[2].weight, twin_opt.param_groups[0]) == 0
    assert twin_opt.lowrank_rank(twin[0].weight, twin_opt.param_groups[0]) == 4
    _train(model, opt, x, 3)
    _train(twin, twin_opt, x, 3)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_adamws_state_dict_loads_and_the_low_rank_moments_restart() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(20, 8), torch.randn(4, 20)
    adamw = torch.optim.AdamW(model.parameters())
    _train(model, adamw, x, 2)
    opt = LoRDO(model.parameters(), rank=4)
    opt.load_state_dict(adamw.state_dict())
    assert opt.load_notes == ["(8, 20): rank 4, moments restarted"]
    assert torch.equal(opt.state[model.bias]["exp_avg"], adamw.state[model.bias]["exp_avg"])  # full-rank: kept
    _train(model, opt, x, 2)
    assert opt.state[model.weight]["exp_avg"].shape == (4, 20) and torch.isfinite(model.weight).all()


def test_a_matrix_without_a_gradient_at_the_first_step_gets_its_basis_from_its_first_gradient() -> None:
    """Not from a zero placeholder (an axis-aligned basis it would keep without refreshes)."""
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(48, 64)), nn.Parameter(torch.randn(48, 64))
    opt = LoRDO([w, v], rank=8)
    v.grad = torch.randn(48, 64)
    opt.step()
    assert "basis" not in opt.state.get(w, {})
    g = torch.randn(48, 8) @ torch.randn(8, 64) + 0.01 * torch.randn(48, 64)  # a rank-8 gradient, and noise
    w.grad = g
    opt.step()
    expected = torch.linalg.svd(g.double(), full_matrices=False)[0][:, :8]
    overlap = torch.linalg.svdvals(expected.T @ opt.state[w]["basis"].double())  # cosines of the principal angles
    assert overlap.min() > 0.99, overlap


def test_a_rank_as_large_as_the_smaller_side_runs_adamw_with_a_warning() -> None:
    """SPEC §2: low-rank where min(p, q) > r; a full-rank basis would hold more state than AdamW and save nothing."""
    w = nn.Parameter(torch.randn(4, 20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = LoRDO([w], rank=4)
    assert any("rank=4 is not below the smaller side (4)" in str(c.message) for c in caught)
    assert opt.lowrank_rank(w, opt.param_groups[0]) == 0
    lower = LoRDO([w], rank=3)
    assert lower.lowrank_rank(w, lower.param_groups[0]) == 3


@pytest.mark.parametrize("shape", [(20, 2), (8, 5)])
def test_a_basis_that_does_not_fit_is_refused_before_any_is_installed(shape: tuple[int, int]) -> None:
    w, v = nn.Parameter(torch.randn(8, 20)), nn.Parameter(torch.randn(8, 20))
    opt = LoRDO([v, w], rank=2)
    good = torch.linalg.qr(torch.randn(8, 2))[0]
    shown = re.escape(f"Invalid basis ({tuple(shape)}, torch.float32, cpu)") + r".*it must be \(8, 2\)"
    with pytest.raises(ValueError, match=shown):
        opt.set_bases({v: good, w: torch.randn(*shape)})
    assert "basis" not in opt.state.get(v, {})


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_adamw_modes_lordo_lacks_are_refused_on_conversion(flag: str) -> None:
    from lightning_lordo.convert import convert_optimizer

    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=rf"LoRDO has no {flag} mode.*without {flag}=True"):
        convert_optimizer(torch.optim.AdamW(model.parameters(), **{flag: True}), {}, {}, 0, {})


def test_oversample_shapes_the_first_basis_of_the_power_projection() -> None:
    """``"power"`` has no warm start for a matrix's first basis and finds it with the randomized range finder, whose
    extra columns ``oversample`` sets: a knob of ``"power"`` too (accepted, and it changes that basis)."""
    torch.manual_seed(0)
    grad = torch.randn(40, 6) @ torch.randn(6, 48) + 0.3 * torch.randn(40, 48)  # a rank-6 signal in noise
    exact = torch.linalg.svd(grad.double(), full_matrices=False).U[:, :4]
    captured = {}
    for oversample in (0, 20):
        w = nn.Parameter(torch.zeros(40, 48))
        opt = LoRDO([w], rank=4, projection="power", oversample=oversample, power_iters=1, seed=1)
        w.grad = grad.clone()
        opt.step()
        basis = opt.state[w]["basis"].double()
        captured[oversample] = (exact.mT @ basis).square().sum().item() / 4  # share of the exact subspace, 1 = all
    assert captured[20] > captured[0] + 0.01 and captured[20] > 0.99, captured


def test_frozen_parameters_take_no_step_in_the_plan_and_count_no_adamw_state() -> None:
    """``AdamW(self.parameters())`` with a frozen backbone: the plan named frozen weights as low-rank and the
    memory report counted AdamW state for them, which torch's AdamW never holds (a saving that was not there)."""
    from lightning_lordo.optim.report import plan_summary

    model = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 8))
    model[0].requires_grad_(False)
    opt = LoRDO(model.parameters(), rank=4)
    rows = {r["name"]: r for r in opt.describe({p: n for n, p in model.named_parameters()})}
    assert rows["0.weight"]["step"] == rows["0.bias"]["step"] == "frozen" and rows["2.weight"]["step"] == "lowrank"
    assert plan_summary(list(rows.values()))[-1] == "LoRDO: 2 frozen tensors (requires_grad=False) take no step."
    _train(model, opt, torch.randn(16, 48), 2)
    assert opt.memory_report()["adamw_equivalent"] == 2 * 4 * (40 * 8 + 8)  # the trainable layer's only


def test_loading_adamws_state_keeps_the_knobs_given_to_lordo() -> None:
    """torch's load_state_dict replaces the groups with the saved ones: an AdamW state must not reset LoRDO's knobs
    (a group's rank 0, update_scale) to defaults; lr and betas come from the checkpoint, as for any optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    adamw = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=3e-3,
                              betas=(0.8, 0.95))
    model(torch.randn(4, 64)).sum().backward()
    adamw.step()
    opt = LoRDO([{"params": model[0].parameters()}, {"params": model[1].parameters(), "rank": 0}], lr=1e-3, rank=8,
                omega=0.9)
    opt.load_state_dict(adamw.state_dict())
    assert [g["rank"] for g in opt.param_groups] == [8, 0] and [g["omega"] for g in opt.param_groups] == [0.9, 0.9]
    assert [g["update_scale"] for g in opt.param_groups] == ["auto", "auto"]
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 3e-3] and opt.param_groups[1]["betas"] == (0.8, 0.95)
    assert torch.equal(opt.state[model[1].weight]["exp_avg"], adamw.state[model[1].weight]["exp_avg"])  # AdamW's


def test_state_saved_for_other_parameters_is_refused_by_name() -> None:
    w, b = nn.Parameter(torch.randn(8, 24)), nn.Parameter(torch.randn(24))
    opt = LoRDO([w, b], rank=2)
    w.grad, b.grad = torch.randn(8, 24), torch.randn(24)
    opt.step()
    swapped = LoRDO([b, w], rank=2)
    with pytest.raises(ValueError, match=r"Invalid optimizer state for \(24,\) of shape \(24,\): it holds a basis"):
        swapped.load_state_dict(opt.state_dict())


def test_a_late_first_basis_is_not_a_refresh_for_ef_decay_auto() -> None:
    """``ef_decay="auto"`` is 0.99 while no basis changes; a matrix getting its first basis later changes none."""
    from lightning_lordo.optim.functional import Hyper

    a, b = nn.Parameter(torch.randn(8, 24)), nn.Parameter(torch.randn(8, 24))
    opt = LoRDO([a, b], rank=2)
    for step in range(6):
        a.grad, b.grad = torch.randn(8, 24), torch.randn(8, 24) if step else None
        opt.step()
    assert "basis" in opt.state[b] and Hyper.of(opt.param_groups[0]).ef_decay == 0.99


def test_fused_adamw_takes_a_gradient_laid_out_unlike_its_parameter() -> None:
    """torch's fused CPU AdamW (LoRDO's default for full-rank tensors on the CPU) reads a gradient whose strides
    differ from its parameter's (a channels_last weight, a transposed view) in the parameter's order: wrong."""
    torch.manual_seed(0)
    conv = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    ours, theirs = nn.Parameter(conv.clone()), nn.Parameter(conv.clone())
    opt, ref = LoRDO([ours], full_rank=[ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    for _ in range(5):
        g = torch.randn(4, 3, 3, 3)  # contiguous, as a hand-made gradient is
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())


def test_a_tensor_learning_rate_steps_without_fused_adamw() -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    theirs.data.copy_(ours.data)
    opt = LoRDO([ours], lr=torch.tensor(1e-2), fused=False)
    ref = torch.optim.AdamW([theirs], lr=torch.tensor(1e-2), foreach=False)
    for _ in range(3):
        g = torch.randn(16)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())


def test_install_bases_refuses_a_non_finite_or_misshapen_source_and_set_bases_a_float64_basis() -> None:
    w = nn.Parameter(torch.randn(8, 24))
    opt = LoRDO([w], rank=2)
    bad = torch.randn(8, 24)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"Invalid source of shape \(8, 24\) for the basis of a \(8, 24\) weight "
                                         r"\(finite: False\)"):
        opt.install_bases({w: bad})
    with pytest.raises(ValueError, match=r"Invalid source of shape \(8, 20\)"):
        opt.install_bases({w: torch.randn(8, 20)})
    with pytest.raises(ValueError, match=r"Invalid basis \(\(8, 2\), torch.float64, cpu\)"):
        opt.set_bases({w: torch.linalg.qr(torch.randn(8, 2, dtype=torch.float64))[0]})
    assert "basis" not in opt.state.get(w, {})


def test_conversion_keeps_the_users_defaults_flags_and_tags_and_a_group_added_later_takes_them() -> None:
    """A group added after the conversion (``BaseFinetuning.unfreeze_and_add_param_group``, or through the user's
    own optimizer, which their callback may still hold) takes the user's defaults, as it would from their AdamW;
    an explicit ``fused=False`` / ``foreach=False`` and the user's own tags carry over."""
    from lightning_lordo.convert import convert_optimizer, repoint_schedulers

    head, body = nn.Linear(8, 8), nn.Linear(8, 8)
    for kind, kwargs in ((torch.optim.AdamW, {"lr": 3e-4, "betas": (0.85, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
                         (torch.optim.Adam, {"lr": 3e-4})):
        user = kind([{"params": head.parameters(), "lr_decay": 0.75}], fused=False, foreach=False, **kwargs)
        with pytest.warns(UserWarning, match="'lr_decay' is not a knob"):  # kept, with a warning (close to ef_decay)
            lordo = convert_optimizer(user, {}, {"rank": 2}, 0, {})
        assert lordo.fused is False and lordo.foreach is False and lordo.param_groups[0]["lr_decay"] == 0.75
        repoint_schedulers([], user, lordo)
        user.add_param_group({"params": body.parameters(), "lr": 1e-4})  # through the user's optimizer
        expected = kind([nn.Parameter(torch.zeros(1))], **kwargs).defaults
        added = lordo.param_groups[1]
        assert len(lordo.param_groups) == 2 and added["rank"] == 2 and added["lr"] == 1e-4
        assert (added["betas"], added["eps"], added["weight_decay"]) == (
            expected["betas"], expected["eps"], expected["weight_decay"]), (kind, added)
