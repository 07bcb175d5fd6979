"""The bookkeeping of ``benchmarks/netlink.py`` (its runs need root and take half an hour): the order of the runs and
which compute-only runs each ratio is taken against."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import netlink  # noqa: E402


def _run(name: str, wall: float, rate: str = "1gbit", repeat: int = 0) -> dict:
    return {"name": name, "rate": rate, "repeat": repeat, "wall_seconds": wall, "train_seconds": wall - 5}


def test_plan_brackets_every_run_with_compute_only_runs():
    assert netlink.plan(["a", "compute", "b"], 2, bracket=True) == [
        "compute", "a", "compute", "b", "compute", "a", "compute", "b", "compute"]
    assert netlink.plan(["a", "b", "compute"], 2, bracket=False) == ["a", "b", "compute"] * 2


def test_a_bracketed_run_is_compared_with_the_mean_of_its_neighbours():
    ran = [_run("compute", 20), _run("a", 30), _run("compute", 24), _run("b", 40), _run("compute", 30)]
    netlink.set_references(ran, bracket=True, fallback=[])
    assert ran[1]["reference"] == {"wall_seconds": 22, "train_seconds": 17}
    assert ran[3]["reference"] == {"wall_seconds": 27, "train_seconds": 22}
    assert "reference" not in ran[0]


def test_unbracketed_runs_take_their_turns_compute_and_the_rest_the_fallback():
    ran = [_run("a", 30), _run("compute", 24), _run("b", 40)]
    netlink.set_references(ran, bracket=False, fallback=[_run("compute", 10), _run("compute", 20)])
    assert ran[0]["reference"]["wall_seconds"] == 24
    assert ran[2]["reference"]["wall_seconds"] == 15
    alone = [_run("a", 30)]
    netlink.set_references(alone, bracket=False, fallback=[])
    assert "reference" not in alone[0]


def test_earlier_runs_keep_the_compute_only_run_of_their_own_repeat():
    runs = [_run("compute", 20, repeat=0), _run("compute", 30, repeat=1), _run("ddp", 90, repeat=1),
            {**_run("ddp", 80), "repeat": None},
            {**_run("a", 50), "reference": {"wall_seconds": 1, "train_seconds": 1}}, _run("b", 40, rate="100mbit")]
    netlink.with_references(runs)
    assert runs[2]["reference"]["wall_seconds"] == 30
    assert runs[3]["reference"]["wall_seconds"] == 20
    assert runs[4]["reference"]["wall_seconds"] == 1  # already set: kept
    assert "reference" not in runs[5]  # no compute-only run of its rate


def test_summary_ratios_use_the_references():
    runs = [_run("compute", 20), {**_run("lordo", 30), "reference": {"wall_seconds": 25, "train_seconds": 20},
                                  "curve": [{"seconds": 10, "val_loss": 3.0}], "bytes_sent": 1e6,
                                  "final_val_loss": 3.0}]
    runs[0].update(curve=[{"seconds": 12, "val_loss": 3.1}], bytes_sent=0, final_val_loss=3.1)
    results = {"runs": runs}
    lines = netlink.summarize(results, ["1gbit"], target=3.1)
    assert runs[1]["x_compute"] == pytest.approx(1.2)
    assert runs[1]["loop_x_compute"] == pytest.approx(25 / 20)
    assert any("1.20x" in line for line in lines)
