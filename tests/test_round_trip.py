"""lordo -> ddp -> lordo with the plain Trainer and 2 processes (issue 30): a LoRDO checkpoint resumes under
``strategy="ddp"`` with the user's AdamW, no callback and no plugin installed, from the LoRDO model bit for bit; the
DDP checkpoint resumes under ``"lordo"``. Each leg is a user's script (``round_trip_script.py``) run by Lightning's
own launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

SCRIPT = Path(__file__).with_name("round_trip_script.py")


def _leg(out: Path, strategy: str, steps: int, resume: Path | None = None, plugin: bool = True) -> list[dict[str, Any]]:
    out.mkdir()
    argv = [sys.executable, str(SCRIPT), str(out), "--strategy", strategy, "--steps", str(steps)]
    argv += ["--resume", str(resume)] if resume is not None else []
    argv += [] if plugin else ["--no-plugin"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
    done = subprocess.run(argv, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{strategy} leg failed:\n{done.stderr[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _model(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True, map_location="cpu")["state_dict"]


@pytest.mark.timeout(600)
def test_lordo_to_ddp_without_the_plugin_and_back(tmp_path: Path) -> None:
    # 20 steps at sync_every 16: the checkpoint is written after the final sync of fit
    lordo = _leg(tmp_path / "lordo", "lordo", steps=20)
    saved = torch.load(tmp_path / "lordo" / "last.ckpt", weights_only=True, map_location="cpu")
    entry = saved["optimizer_states"][0]
    shapes = [p.shape for p in saved["state_dict"].values()]  # the parameters, in the optimizer's order
    assert [entry["state"][i]["exp_avg"].shape for i in range(len(shapes))] == shapes, "not AdamW-shaped"
    assert not any("omega" in g for g in entry["param_groups"])

    ddp = _leg(tmp_path / "ddp", "ddp", steps=30, resume=tmp_path / "lordo" / "last.ckpt", plugin=False)
    for rank in ddp:
        assert rank["start"]["optimizer"] == "AdamW" and rank["start"]["global_step"] == 20
        for name, value in saved["state_dict"].items():  # the LoRDO model, bit for bit
            assert torch.equal(rank["start"]["params"][name], value), name
        assert rank["start"]["state"]["net.2.weight"]["exp_avg"].shape == (32, 48)
        assert rank["end"]["global_step"] == 30
    assert torch.equal(lordo[0]["end"]["params"]["net.2.weight"], lordo[1]["end"]["params"]["net.2.weight"])

    back = _leg(tmp_path / "back", "lordo", steps=40, resume=tmp_path / "ddp" / "last.ckpt")
    ddp_model = _model(tmp_path / "ddp" / "last.ckpt")
    for rank in back:
        assert rank["start"]["optimizer"] == "LoRDO" and rank["start"]["global_step"] == 30
        for name, value in ddp_model.items():
            assert torch.equal(rank["start"]["params"][name], value), name
        assert rank["end"]["global_step"] == 40
    said = " ".join(back[0]["warnings"])
    assert "another strategy" in said and "restart" in said, said
