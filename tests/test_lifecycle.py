"""The strategy's lifecycle on Lightning's hooks: side process groups made once per strategy, a failed fit with a
round in flight ending with the user's exception (``on_exception``), and ``teardown``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from strategy_helpers import TinyRegressor, free_port, loader, lordo, trainer

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    script = Path(__file__).with_name("lifecycle_script.py")
    return subprocess.run([sys.executable, str(script), *args], env={**env, "MASTER_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=240)


def test_two_fits_make_one_side_group_and_a_failed_fit_ends_with_the_users_exception() -> None:
    done = _run("fail")
    counts = re.findall(r"rank (\d): side groups made (\d+) then (\d+)", done.stderr)
    assert sorted(counts) == [("0", "2", "2"), ("1", "2", "2")], done.stderr[-3000:]  # checks' and the rounds'
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])  # not -6 / 134: an abort
    assert "ValueError: the user's own error" in done.stderr and "terminate called" not in done.stderr


def test_teardown_keeps_what_a_checkpoint_after_fit_needs(tmp_path: Path) -> None:
    """After ``fit`` (and its teardown) the synchronized model is still there to save, and resumes."""
    strategy = lordo(sync_every=4, start_method="popen", synchronous=False)  # rounds and their anchor on one device
    fitted = trainer(strategy, devices=1, max_steps=8)
    fitted.fit(TinyRegressor(), loader())
    anchor = strategy.synchronizer.anchor.tensors
    assert anchor and all(t.device.type == "cpu" for t in anchor)
    fitted.save_checkpoint(tmp_path / "after.ckpt")
    resumed = trainer(lordo(sync_every=4, start_method="popen"), devices=1, max_steps=12)
    resumed.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "after.ckpt")
    assert resumed.global_step == 12
