"""``benchmarks/gpu_check.py --cpu``'s Lightning section (``gpu_fit.py``): every fit it runs on a GPU runs on the CPU
too and passes its own check, the optimizer-alone fits included (their check wanted a worker's rounds, so the script
reported them FAILED after one device stopped running rounds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import gpu_fit  # noqa: E402

pytestmark = pytest.mark.slow  # six Lightning fits, each in a process of its own


@pytest.mark.timeout(300)
def test_every_fit_of_the_gpu_check_runs_and_passes_on_the_cpu() -> None:
    result = gpu_fit.check_lightning(cpu=True)
    fits = result["fits"]
    assert set(fits) == set(gpu_fit.FITS)
    assert result["ok"], {label: row.get("error", row.get("ok")) for label, row in fits.items()}
    for label, (strategy, anchor, _) in gpu_fit.FITS.items():
        row = fits[label]
        assert row["loss_last"] < row["loss_first"] and row["devices_during_training"] == ["cpu"], (label, row)
        if strategy == "auto":
            assert row["syncs"] == 0
        else:  # rounds: a sync every K steps and at the end; alone: a basis refresh every K steps, no anchor
            assert row["syncs"] == (2 if anchor else 1), (label, row["syncs"])
            assert "peak_memory_over_auto" in row and "step_mean_over_auto" in row
