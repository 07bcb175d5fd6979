"""Today's code reproduces the trajectories recorded before the optimizer step was grouped and the synchronization
reordered (``tests/trajectory_cases.py``, fixture ``tests/fixtures/trajectories.pt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trajectory_cases import FIXTURE, OPTIMIZER_CASES, STRATEGY_CASES, run_optimizer_case, run_strategy_case

#: How close each case must be: 0 is bitwise; otherwise the largest difference of each tensor, relative to its
#: largest entry. Only the order of floating-point operations may differ from the recording.
TOLERANCE: dict[str, float] = {}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return torch.load(FIXTURE, weights_only=True)


def assert_matches(actual: Any, expected: Any, rtol: float, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, f"{where}: dtype"
        assert actual.shape == expected.shape, f"{where}: shape"
        if rtol == 0:
            assert torch.equal(actual, expected), f"{where} differs"
        elif expected.numel():
            scale = expected.double().abs().max().item()
            diff = (actual.double() - expected.double()).abs().max().item()
            assert diff <= rtol * max(scale, 1e-30), f"{where}: difference {diff:.3g} over {rtol} x {scale:.3g}"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_matches(actual[key], expected[key], rtol, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: lengths"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_matches(a, e, rtol, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_optimizer_reproduces_the_recorded_trajectory(case: str, recorded: dict[str, Any]) -> None:
    actual = run_optimizer_case(dict(OPTIMIZER_CASES[case]))
    assert_matches(actual, recorded["optimizer"][case], TOLERANCE.get(f"optimizer/{case}", 0.0), case)


@pytest.mark.parametrize("case", list(STRATEGY_CASES))
def test_strategy_reproduces_the_recorded_trajectory(case: str, recorded: dict[str, Any], tmp_path: Path) -> None:
    actual = run_strategy_case(STRATEGY_CASES[case], str(tmp_path / case))
    assert_matches(actual, recorded["strategy"][case], TOLERANCE.get(f"strategy/{case}", 0.0), case)
