"""``ef_decay="auto"`` follows the bases' refresh interval that the optimizer measures (steps between a group's last
two bases): ``1 - 1/n`` within ``[beta1, 0.99]``, 0.99 before a second basis; the counters are saved and restored
with the param groups, and dropped when a checkpoint becomes torch AdamW's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.optim.bases import REFRESH_COUNTERS
from lightning_lordo.optim.conversion import adamw_state_dict
from lightning_lordo.optim.functional import Hyper
from lightning_lordo.optim.loading import LORDO_KNOBS


def _steps(opt: LoRDO, lin: nn.Linear, n: int) -> None:
    for _ in range(n):
        lin.weight.grad, lin.bias.grad = torch.randn_like(lin.weight), torch.randn_like(lin.bias)
        opt.step()


def _refresh(opt: LoRDO, lin: nn.Linear) -> None:
    opt.install_bases({lin.weight: torch.randn_like(lin.weight)})


@pytest.mark.parametrize(("every", "expected"), [(3, 0.9), (20, 0.95), (50, 0.98), (500, 0.99)])
def test_auto_decay_follows_the_measured_refresh_interval(every: int, expected: float) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(20, 16)
    opt = LoRDO(lin.parameters(), lr=1e-3, rank=4)
    group = opt.param_groups[0]
    _steps(opt, lin, every)  # the first step gave the matrix a basis from its gradient
    assert group["refresh_interval"] == 0 and Hyper.of(group).ef_decay == 0.99  # one basis so far: fixed
    _refresh(opt, lin)
    assert group["refresh_interval"] == every and group["since_refresh"] == 0
    assert Hyper.of(group).ef_decay == pytest.approx(expected)
    _steps(opt, lin, 2)
    _refresh(opt, lin)  # the interval is the latest one
    assert group["refresh_interval"] == 2 and Hyper.of(group).ef_decay == pytest.approx(0.9)
    _refresh(opt, lin)  # no step since: the interval stays
    assert group["refresh_interval"] == 2


def test_a_number_is_used_as_given() -> None:
    lin = nn.Linear(20, 16)
    opt = LoRDO(lin.parameters(), lr=1e-3, rank=4, ef_decay=0.5)
    _steps(opt, lin, 3)
    _refresh(opt, lin)
    assert Hyper.of(opt.param_groups[0]).ef_decay == 0.5


def test_the_counters_are_saved_restored_and_dropped_for_adamw() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(20, 16)
    opt = LoRDO(lin.parameters(), lr=1e-3, rank=4)
    _steps(opt, lin, 7)
    _refresh(opt, lin)
    _steps(opt, lin, 5)
    saved = opt.state_dict()
    assert {k: saved["param_groups"][0][k] for k in REFRESH_COUNTERS} == {"since_refresh": 5, "refresh_interval": 7}
    again = LoRDO(nn.Linear(20, 16).parameters(), lr=1e-3, rank=4)
    again.load_state_dict(saved)
    assert {k: again.param_groups[0][k] for k in REFRESH_COUNTERS} == {"since_refresh": 5, "refresh_interval": 7}
    older = {**saved, "param_groups": [{k: v for k, v in g.items() if k not in REFRESH_COUNTERS}
                                       for g in saved["param_groups"]]}  # a checkpoint from before the counters
    again.load_state_dict(older)
    assert {k: again.param_groups[0][k] for k in REFRESH_COUNTERS} == {"since_refresh": 0, "refresh_interval": 0}
    torch_groups = adamw_state_dict(saved, list(lin.parameters()), LORDO_KNOBS)["param_groups"]
    assert not any(k in g for g in torch_groups for k in REFRESH_COUNTERS)
