"""The README's main job, in its reduced form (``--tiny``), run the way a user runs it."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_lordo.demo import main, result_rows
from lightning_lordo.lightning.callbacks import _human

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


def _clean_env() -> dict[str, str]:
    drop = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.timeout(280)
def test_demo_console_command_tiny_run(tmp_path: Path) -> None:
    command = shutil.which("lordo-demo", path=str(Path(sys.executable).parent))
    assert command is not None, "the console script `lordo-demo` is not installed"
    out = tmp_path / "demo.json"
    # rank d/8, as the full demo's 16 of 128
    done = subprocess.run([command, "--tiny", "--steps", "16", "--sync-every", "4", "--rank", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"lordo", "ddp"}
    for r in results.values():
        assert math.log(40) < r["val_loss"] < math.log(256)  # learned something, from a random start (5.55)
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-3)
    assert results["lordo"]["syncs"] == 4
    assert results["lordo"]["bytes_sent"] < results["ddp"]["bytes_sent"] / 2
    lordo = results["lordo"]
    assert 0 < lordo["error_feedback_bytes"] < lordo["optimizer_state_bytes"]  # the buffer, part of the state
    # the moments and bases are below AdamW's moments; with the float32 buffer (the CPU's) this tiny model's state is
    # above AdamW's. The table shows the state once, the buffer in it (it was added twice)
    assert lordo["optimizer_state_bytes"] - lordo["error_feedback_bytes"] < results["ddp"]["optimizer_state_bytes"]
    rows = result_rows(list(results.values()))
    assert rows[0][4] == _human(lordo["optimizer_state_bytes"])
    ddp = results["ddp"]  # its gradient buckets (not views, Lightning's default): a float32 copy of the model
    assert lordo["sync_buffer_bytes"] > 0 and rows[0][6] == _human(lordo["sync_buffer_bytes"])
    assert ddp["sync_buffer_bytes"] == lordo["sync_buffer_bytes"]  # one float32 copy of the model each
    assert rows[1][6] == _human(ddp["sync_buffer_bytes"])
    assert "loss" in done.stdout and "buffers" in done.stdout and "lordo" in done.stdout and "ddp" in done.stdout


def test_demo_trains_on_a_given_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "demo.json"
    assert main(["--tiny", "--steps", "8", "--data", str(corpus), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["method"] for r in results] == ["lordo", "ddp"]
    assert all(r["val_loss"] < math.log(256) for r in results)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--data", "/no/such/file.txt"], ["--rank", "-1"]])
def test_demo_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=argv[0]):
        main(argv)


def test_demo_refuses_a_text_too_short_for_its_windows(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(SystemExit, match=r"--data=.*too few for seq_len.*pass a longer text"):
        main(["--tiny", "--data", str(short)])
