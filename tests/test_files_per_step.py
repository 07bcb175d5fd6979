"""Issue 32's target for a training step, kept: one optimizer step passes through at most 6 files of the package
(``benchmarks/files_per_step.py``, two forked CPU processes). A sync's target of 6 is not met (16: the README's
design section says why), so only its count's growth is caught here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import files_per_step  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["in_place", "stacked", "fabric"])
def test_an_optimizer_step_passes_through_at_most_six_files(tmp_path: Path, layout: str) -> None:
    found = files_per_step.measure_fabric(tmp_path) if layout == "fabric" else files_per_step.measure(layout, tmp_path)
    assert len(found["step"]) <= 6, found["step"]
    assert "optim/lordo.py" in found["step"] and "optim/functional.py" in found["step"]  # the step itself ran
    assert len(found["sync"]) <= 16, found["sync"]  # not the target: today's count, so that it does not grow
