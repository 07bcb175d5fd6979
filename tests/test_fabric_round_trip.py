"""lordo -> ddp -> lordo with Fabric and 2 processes: a file that ``fabric.save`` wrote with ``strategy="lordo"`` loads
into the user's AdamW under ``Fabric(strategy="ddp")``, with or without the plugin (its optimizer entry is
AdamW-shaped, checked against a float64 expansion of the LoRDO state kept under ``"lordo"``), and a DDP run's file
loads back under ``"lordo"`` (the full-rank moments kept, the low-rank ones restarted, one warning saying so)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_lordo.optim.loading import FROM_ANOTHER_STRATEGY
from tests.strategy_helpers import flat_params, loader
from tests.test_fabric import K, fabric_for, ranks_identical, regression_model, run_steps

pytestmark = pytest.mark.slow  # multi-process runs; CI runs them, -m 'not slow' skips them
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_environment():
    """Fabric's launcher writes MASTER_PORT, LOCAL_RANK, WORLD_SIZE into this process's environment."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _lordo_leg(fabric: Fabric, path: Path) -> None:
    model = regression_model(0)
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    data = fabric.setup_dataloaders(loader())
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), data)))  # ends at a sync
    fabric.save(path, {"model": net, "optimizer": optimizer, "step": 2 * K})


def _ddp_leg(fabric: Fabric, path: Path, out: Path) -> dict[str, Any]:
    model = regression_model(1)  # other weights: the load must replace them
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0))
    state = {"model": net, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    loaded = optimizer.state_dict()  # no tensors in the return value: they travel as shared memory that the
    # exiting worker takes along
    start = {"params": flat_params(model).tolist(), "step": state["step"], "remainder": sorted(remainder),
             "state": ({k: {kk: vv.tolist() for kk, vv in v.items()} for k, v in loaded["state"].items()},
                       loaded["param_groups"])}
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(K), fabric.setup_dataloaders(loader()))))
    fabric.save(out, {"model": net, "optimizer": optimizer, "step": state["step"] + K})
    return start


def _back_leg(fabric: Fabric, path: Path) -> dict[str, Any]:
    model = regression_model(2)
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    state = {"model": net, "optimizer": optimizer, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, state)
    loaded = flat_params(model).tolist()
    lordo = optimizer.optimizer
    fullrank = {i: lordo.state[p]["exp_avg"].tolist() for i, p in enumerate(model.parameters())
                if lordo.state.get(p) and "basis" not in lordo.state[p]}
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(K), fabric.setup_dataloaders(loader()))))
    assert ranks_identical(flat_params(model)), "not synchronized at the next boundary"
    return {"loaded": loaded, "fullrank": fullrank, "step": state["step"], "warnings": [str(w.message) for w in caught],
            "lowrank": [i for i, p in enumerate(model.parameters()) if "basis" in lordo.state.get(p, {})],
            "finite": bool(torch.isfinite(flat_params(model)).all())}


def expanded(lordo_state: dict[str, Any], params: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """float64 reference: m = Q u and v = max((Q o Q) v_r, mean(v_r)), in the parameter's orientation."""
    out = {}
    for index, entry in lordo_state["state"].items():
        if "basis" not in entry:
            out[index] = {k: entry[k].double() for k in ("exp_avg", "exp_avg_sq")}
            continue
        q, u, v = (entry[k].double() for k in ("basis", "exp_avg", "exp_avg_sq"))
        first, second = q @ u, torch.maximum(q.square() @ v, v.mean())
        tall = params[index].shape[0] > params[index].shape[1]
        out[index] = {"exp_avg": first.T if tall else first, "exp_avg_sq": second.T if tall else second}
    return out


def ddp_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=2, strategy="ddp_fork")


@pytest.mark.timeout(240)
def test_fabric_lordo_to_ddp_without_the_plugin_and_back(tmp_path: Path) -> None:
    saved_path, ddp_path = tmp_path / "lordo.ckpt", tmp_path / "ddp.ckpt"
    fabric_for().launch(_lordo_leg, saved_path)
    saved = torch.load(saved_path, weights_only=True)
    own = saved["lordo"]["optimizer_state"]
    assert saved["lordo"]["optimizer"] == "LoRDO" and all("omega" in g for g in own["param_groups"])
    params = list(saved["model"].values())
    assert sum("basis" in e for e in own["state"].values()) == 2, "the test needs low-rank matrices"
    entry = saved["optimizer"]
    assert not any("omega" in g for g in entry["param_groups"])
    for index, reference in expanded(own, params).items():  # AdamW's shape, from the LoRDO state
        for key, value in reference.items():
            assert entry["state"][index][key].shape == params[index].shape, (index, key)
            torch.testing.assert_close(entry["state"][index][key].double(), value, rtol=1e-6, atol=1e-9)

    start = ddp_fabric().launch(_ddp_leg, saved_path, ddp_path)
    assert start["params"] == torch.cat([p.reshape(-1) for p in params]).tolist()  # the LoRDO model, bit for bit
    assert start["step"] == 2 * K and start["remainder"] == ["lordo"]
    state, groups = start["state"]
    assert set(state) == set(entry["state"]) and groups[0]["lr"] == 1e-2 and groups[0]["weight_decay"] == 0.01
    for index, value in entry["state"].items():
        assert torch.equal(torch.tensor(state[index]["exp_avg"]), value["exp_avg"]), index

    # without the plugin: plain Fabric on one device reads the file into AdamW
    script = ("import sys; sys.modules['lightning_lordo'] = None\n"
              "import torch; from torch import nn; from lightning.fabric import Fabric\n"
              "fabric = Fabric(accelerator='cpu', devices=1)\n"
              "model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 16), nn.GELU(), "
              "nn.Linear(16, 3))\n"  # TinyRegressor's network
              "adamw = torch.optim.AdamW(model.parameters())\n"
              "net, opt = fabric.setup(model, adamw)\n"
              f"fabric.load({str(saved_path)!r}, {{'model': net, 'optimizer': opt}}, strict=False)\n"
              "print('loaded', len(opt.state), type(opt.optimizer).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and f"loaded {len(entry['state'])} AdamW" in done.stdout, done.stderr[-3000:]

    back = fabric_for().launch(_back_leg, ddp_path)
    ddp_saved = torch.load(ddp_path, weights_only=True)
    assert back["loaded"] == torch.cat([p.reshape(-1) for p in ddp_saved["model"].values()]).tolist()
    assert back["step"] == 3 * K and back["finite"]
    assert back["lowrank"] and set(back["fullrank"]) | set(back["lowrank"]) == set(ddp_saved["optimizer"]["state"])
    for index, value in back["fullrank"].items():  # the full-rank moments kept
        assert torch.equal(torch.tensor(value), ddp_saved["optimizer"]["state"][index]["exp_avg"]), index
    assert any(FROM_ANOTHER_STRATEGY in w for w in back["warnings"]), back["warnings"]
