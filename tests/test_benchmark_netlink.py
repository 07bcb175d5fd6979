"""The bookkeeping of ``benchmarks/netlink.py`` (its runs need root and take half an hour): the order of the runs and
which compute-only runs each ratio is taken against."""

import json
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


def _ran(order: list[str], walls: list[float]) -> list[dict]:
    """Runs in ``order`` as main() numbers them (each name's repeats counted from 0)."""
    counts: dict[str, int] = {}
    out = []
    for name, wall in zip(order, walls, strict=True):
        counts[name] = counts.get(name, -1) + 1
        out.append(_run(name, wall, repeat=counts[name]))
    return out


@pytest.mark.parametrize("methods", [["a", "b", "compute"], ["compute", "a", "b"], ["a", "compute", "b"]])
def test_unbracketed_runs_take_their_own_turns_compute_only_run(methods):
    order = netlink.plan(methods, 2, bracket=False)
    walls = [{"compute": 10.0 if i < 3 else 20.0}.get(name, 50.0) for i, name in enumerate(order)]
    ran = _ran(order, walls)
    netlink.set_references(ran, bracket=False, fallback=[_run("compute", 99)])
    for i, r in enumerate(ran):
        if r["name"] != "compute":
            assert r["reference"]["wall_seconds"] == (10.0 if i < 3 else 20.0), (methods, i)


def test_bracketed_plan_round_trip_and_runs_still_waiting_for_their_second_compute():
    order = netlink.plan(["compute", "a", "b"], 2, bracket=True)
    ran = _ran(order, [10.0 * (i + 1) for i in range(len(order))])
    netlink.set_references(ran[:4], bracket=True, fallback=[])  # compute, a, compute, b: b not bracketed yet
    assert ran[1]["reference"]["wall_seconds"] == 20.0  # (10 + 30) / 2
    assert "reference" not in ran[3]
    netlink.set_references(ran, bracket=True, fallback=[])
    assert [r["reference"]["wall_seconds"] for r in ran if r["name"] != "compute"] == [20.0, 40.0, 60.0, 80.0]
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


def _results() -> dict:
    compute = {**_run("compute", 20), "curve": [{"seconds": 12, "val_loss": 3.1}], "bytes_sent": 0,
               "final_val_loss": 3.1}
    lordo = {**_run("lordo", 30), "reference": {"wall_seconds": 25, "train_seconds": 20},
             "curve": [{"seconds": 10, "val_loss": 3.0}], "bytes_sent": 1e6, "final_val_loss": 3.0}
    return {"headers": [{"commit": "abcdef0123", "command": "python benchmarks/netlink.py"}],
            "runs": [compute, {**compute, "repeat": 1, "wall_seconds": 22.0}, lordo]}


def test_summary_ratios_use_the_references():
    results = _results()
    lines = netlink.summarize(results, ["1gbit"], target=3.1)
    lordo = results["runs"][2]
    assert lordo["x_compute"] == pytest.approx(1.2)
    assert lordo["loop_x_compute"] == pytest.approx(25 / 20)
    assert lordo["seconds_to_target"] == 10
    row = next(line for line in lines if line.startswith("| `lordo_lean` knobs, full payload |"))
    assert "| 1.20x |" in row and "| 1.25x |" in row and "| 10.0 s |" in row
    compute_row = next(line for line in lines if line.startswith("| compute only"))
    assert "1.00x |" in compute_row and "(" not in compute_row  # no list of its ratios to itself


def test_report_rewrites_the_table_and_keeps_the_stored_target(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(netlink, "figure", lambda results, path: drawn.append(path))
    path = tmp_path / "netlink.json"
    path.write_text(json.dumps({**_results(), "target": 3.05}))
    netlink.write_report(json.loads(path.read_text()), ["1gbit"], None, path)
    assert json.loads(path.read_text())["target"] == 3.05
    table = (tmp_path / "netlink.md").read_text()
    assert "to 3.050" in table and "abcdef0" in table and "| `lordo_lean` knobs, full payload |" in table
    assert drawn == [tmp_path / "netlink_loss_time.png"]


def test_time_to_target_is_when_the_validated_model_existed_and_older_overlapped_runs_are_marked():
    results = _results()
    overlapped = {**_run("lordo_overlap", 30), "reference": {"wall_seconds": 25, "train_seconds": 20},
                  "spec": {"knobs": {"overlap_steps": 8}}, "bytes_sent": 1e6, "final_val_loss": 3.0}
    # the validation at step 64 saw the model of step 32, which every rank held from 9.5 s on
    new = {**overlapped, "curve": [{"seconds": 12.0, "val_loss": 3.2, "model_step": 0, "model_seconds": 0.0},
                                   {"seconds": 14.0, "val_loss": 3.0, "model_step": 32, "model_seconds": 9.5}]}
    results["runs"].append(new)
    lines = netlink.summarize(results, ["1gbit"], target=3.1)
    assert new["seconds_to_target"] == 9.5
    assert not any(line.startswith("\\*") for line in lines)
    results["runs"][-1] = old = {**overlapped, "curve": [{"seconds": 14.0, "val_loss": 3.0}]}
    lines = netlink.summarize(results, ["1gbit"], target=3.1)
    assert old["seconds_to_target"] == 14.0
    row = next(line for line in lines if line.startswith("| `lordo_lean` knobs, full payload, `overlap_steps=8`"))
    assert "| 14.0 s* |" in row and any(line.startswith("\\* overlapped runs made before") for line in lines)
    assert "*" not in next(line for line in lines if line.startswith("| `lordo_lean` knobs, full payload |"))


def test_a_report_covers_every_rate_with_runs_slowest_first():
    results = {"runs": [_run("a", 1, rate="1gbit"), _run("a", 1, rate="100mbit"), _run("b", 1, rate="500kbit")]}
    assert netlink.report_rates(results, ["1gbit"]) == ["500kbit", "100mbit", "1gbit"]
    assert netlink.report_rates({"runs": []}, ["1gbit", "100mbit"]) == ["100mbit", "1gbit"]


@pytest.mark.parametrize("missing", ["root", "namespaces"])
def test_without_root_or_network_namespaces_it_says_so_and_exits_2(monkeypatch, capsys, missing):
    monkeypatch.setattr(netlink.os, "geteuid", lambda: 1000 if missing == "root" else 0)
    monkeypatch.setattr(netlink, "has_namespaces", lambda: missing != "namespaces")
    monkeypatch.setattr(netlink, "run_in_namespace", lambda *a, **k: pytest.fail("nothing may run"))
    assert netlink.main(["--data", "unused.txt", "--methods", "ddp"]) == 2
    assert "needs root with network namespaces and tc" in capsys.readouterr().err
