"""Launch paths run as users run them: ``torchrun --nproc_per_node=2`` and a simulated 2-node run (``num_nodes=2,
devices=1``, one process per node with ``NODE_RANK`` set, the master on 127.0.0.1), each a subprocess running
``tests/launch_script.py`` (``Trainer(strategy="lordo")``, 40 steps, syncs at 16, 32 and 40) under a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

SCRIPT = Path(__file__).with_name("launch_script.py")
HARD_TIMEOUT_S = 150  # a 2-process run takes ~10-20 s here; a hang is killed well before pytest's own timeout
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK",
               "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _tail(text: str, n: int = 4000) -> str:
    """The end of a child's output, preceded by its first traceback (torchrun's summary buries the workers')."""
    if not text:
        return "<empty>"
    first = text.find("Traceback (most recent call last)")
    head = text[first:first + 3000] + "\n[...]\n" if 0 <= first < len(text) - n else ""
    return head + text[-n:]


def _run(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> list[tuple[int, str, str]]:
    """Start every command (each in its own process group), wait for all under one hard timeout, kill the groups
    of those still running. Returns (returncode, stdout, stderr) per command; a timeout fails with every tail."""
    procs = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for argv, env in commands]
    results: list[tuple[int, str, str]] = []
    timed_out = False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=HARD_TIMEOUT_S if not timed_out else 5)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it started
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    if timed_out:
        pytest.fail(f"launch did not finish in {HARD_TIMEOUT_S} s:\n" + "\n".join(
            f"--- command {i} (rc {rc}) stderr tail:\n{_tail(err)}" for i, (rc, _, err) in enumerate(results)))
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"command {i} {commands[i][0]} exited {rc}\nstdout:\n{_tail(out, 2000)}\nstderr:\n{_tail(err)}"
    return results


def _reports(out: Path, results: list[tuple[int, str, str]]) -> list[dict[str, Any]]:
    stderr = "\n".join(_tail(err, 2000) for _, _, err in results)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank0.pt", "rank1.pt"], f"rank reports {files}; stderr tails:\n{stderr}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def _check_training(reports: list[dict[str, Any]]) -> None:
    for r, report in enumerate(reports):
        assert (report["world_size"], report["dist_world_size"]) == (2, 2), report
        assert (report["global_rank"], report["dist_rank"]) == (r, r), report
        assert report["global_step"] == 40 and report["final_sync_done"]
        # syncs at steps 16 and 32 (every "lordo" default of 16) and the final one at the last step, 40
        assert [s["step"] for s in report["syncs"]] == [16, 32, 40], report["syncs"]
        assert all(s["bytes"] > 0 and not s["skipped"] for s in report["syncs"]), report["syncs"]
        purposes = {p for s in report["syncs"] for p in s["by_purpose"]}
        assert {"pseudo_gradients", "moments"} <= purposes, purposes  # LoRDO's rounds: averaged deltas and moments
        for purpose in purposes:  # every byte of the rounds is in the accountant's totals
            in_rounds = sum(s["by_purpose"].get(purpose, 0) for s in report["syncs"])
            assert report["totals"][purpose] == in_rounds, (purpose, report["totals"], report["syncs"])
        assert report["lowrank"] == ["net.2.weight"], report["lowrank"]  # the LoRDO step, not only AdamW
    assert [s["bytes"] for s in reports[0]["syncs"]] == [s["bytes"] for s in reports[1]["syncs"]]
    # each rank drew its own half of every epoch (Lightning's distributed sampler)
    seen0, seen1 = (set(report["seen"][:80]) for report in reports)
    assert not seen0 & seen1 and len(seen0 | seen1) == 160
    # mid-round the local replicas had trained apart; the final models are identical, bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(reports[0]["mid_round"], reports[1]["mid_round"]))
    final0, final1 = reports[0]["state_dict"], reports[1]["state_dict"]
    assert final0.keys() == final1.keys() and final0
    for name in final0:
        assert torch.equal(final0[name], final1[name]), f"{name} differs between ranks after the final sync"


@pytest.mark.timeout(HARD_TIMEOUT_S + 60)
def test_torchrun_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(SCRIPT), str(out), "--devices", "2"]
    reports = _reports(out, _run([(argv, _env())], tmp_path))
    _check_training(reports)
    for r, report in enumerate(reports):
        assert report["environment"] == "TorchElasticEnvironment", report["environment"]
        assert (report["local_rank"], report["node_rank"], report["num_nodes"]) == (r, 0, 1), report


@pytest.mark.timeout(HARD_TIMEOUT_S + 60)
def test_two_nodes_one_device_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = str(_free_port())
    argv = [sys.executable, str(SCRIPT), str(out), "--num-nodes", "2", "--devices", "1"]
    commands = [(argv, _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))) for node in (0, 1)]
    reports = _reports(out, _run(commands, tmp_path))
    _check_training(reports)
    for r, report in enumerate(reports):
        assert report["environment"] == "LightningEnvironment", report["environment"]
        assert (report["local_rank"], report["node_rank"], report["num_nodes"]) == (0, r, 2), report
