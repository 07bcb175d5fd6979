"""The step's own pieces: each parameter's rank resolved from its group's knob as it is now, and the converted
optimizer's own ``step`` with torch's scheduler mark (no wrapper function, no reference cycle)."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.convert import track_step_calls


def test_a_resolved_rank_follows_the_groups_rank_and_the_parameters_shape() -> None:
    p = nn.Parameter(torch.zeros(8, 12))
    opt = LoRDO([p], rank=1)
    group = opt.param_groups[0]
    assert opt.lowrank_rank(p, group) == 1
    group["rank"] = 1.0  # a fraction of the smaller side, not rank 1 (1 == 1.0 in Python): 8, so AdamW (SPEC §2)
    assert opt.lowrank_rank(p, group) == 0
    group["rank"] = 0.5
    assert opt.lowrank_rank(p, group) == 4
    p.data = torch.zeros(4, 12)  # the same parameter, another shape
    assert opt.lowrank_rank(p, group) == 2
    group["rank"] = 9  # above the smaller side: AdamW
    assert opt.lowrank_rank(p, group) == 0


def _converted() -> tuple[torch.optim.Optimizer, nn.Parameter]:
    p = nn.Parameter(torch.ones(3, 4))
    opt = LoRDO([p], lr=0.1, rank=2)
    track_step_calls(opt)
    return opt, p


def test_the_marked_step_is_freed_with_its_optimizer_by_reference_counting() -> None:
    opt, _ = _converted()
    alive = weakref.ref(opt)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del opt
        assert alive() is None  # no cycle through the marked step: torch's own mark avoids one too
    finally:
        if enabled:
            gc.enable()


def test_schedulers_on_the_converted_optimizer_do_not_warn_and_the_step_is_its_own() -> None:
    opt, p = _converted()
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        later = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made after the conversion
        before = p.detach().clone()
        p.grad = torch.ones_like(p)
        opt.step()
        later.step()
    assert getattr(opt, "_opt_called", False) and not torch.equal(p, before)
    assert len(opt._optimizer_step_post_hooks) == 1  # the mark's: the strategy removes it after the first step
    assert opt.param_groups[0]["lr"] == 0.05


def test_the_compiled_step_is_the_default_on_cuda_where_triton_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: ``layout=None`` compiles the stacked step's last pass on CUDA when Triton (torch.compile's backend
    there) is installed; the CPU keeps its eager layout, and an explicit layout is kept everywhere."""
    from lightning_lordo.optim import compiled

    monkeypatch.setattr(compiled, "_has_triton", lambda: True)
    assert compiled.on_cuda(None) and compiled.on_cuda("compiled") and not compiled.on_cuda("stacked")
    assert LoRDO([nn.Parameter(torch.zeros(4, 4))])._compiled_on_cuda  # looked for once, at the start
    monkeypatch.setattr(compiled, "_has_triton", lambda: False)
    assert not compiled.on_cuda(None) and compiled.on_cuda("compiled")
    assert not LoRDO([nn.Parameter(torch.zeros(4, 4))])._compiled_on_cuda
