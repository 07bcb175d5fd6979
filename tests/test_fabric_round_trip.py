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
from strategy_helpers import assert_identical, expand_lordo_state, flat_params, loader
from test_fabric import K, _launched, fabric_for, ranks_identical, regression_model, run_steps

from lightning_lordo.checkpoint import _FABRIC_1_SYNC
from lightning_lordo.optim.loading import FROM_ANOTHER_STRATEGY

pytestmark = pytest.mark.slow  # multi-process runs; CI runs them, -m 'not slow' skips them
ROOT = Path(__file__).resolve().parents[1]


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
    # saved as a user who keeps what the load did not consume (``state.update(remainder)``): the LoRDO entry,
    # older now than the optimizer's, goes along
    fabric.save(out, {**remainder, "model": net, "optimizer": optimizer, "step": state["step"] + K})
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
    for index, reference in expand_lordo_state(own, [p.shape for p in params]).items():  # AdamW's shape
        for key in ("exp_avg", "exp_avg_sq"):
            value = reference[key]
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
              f"rest = fabric.load({str(saved_path)!r}, {{'model': net, 'optimizer': opt, 'step': 0}})\n"
              f"torch.save(model.state_dict(), {str(tmp_path / 'plain.pt')!r})\n"
              "print('loaded', len(opt.state), type(opt.optimizer).__name__, sorted(rest))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and f"loaded {len(entry['state'])} AdamW ['lordo']" in done.stdout, \
        done.stderr[-3000:]
    assert_identical(torch.load(tmp_path / "plain.pt", weights_only=True), saved["model"])

    back = fabric_for().launch(_back_leg, ddp_path)
    ddp_saved = torch.load(ddp_path, weights_only=True)
    assert back["loaded"] == torch.cat([p.reshape(-1) for p in ddp_saved["model"].values()]).tolist()
    assert back["step"] == 3 * K and back["finite"]
    assert back["lowrank"] and set(back["fullrank"]) | set(back["lowrank"]) == set(ddp_saved["optimizer"]["state"])
    assert not set(back["fullrank"]) & set(back["lowrank"]), "a low-rank matrix kept AdamW's moments"
    for index, value in back["fullrank"].items():  # the full-rank moments kept
        assert torch.equal(torch.tensor(value), ddp_saved["optimizer"]["state"][index]["exp_avg"]), index
    assert "lordo" in ddp_saved, "the test needs the DDP run's file to carry the older LoRDO entry"
    said = [w for w in back["warnings"] if "older than its optimizer entry" in w]  # one warning says all
    assert len(said) == 1 and FROM_ANOTHER_STRATEGY in said[0], back["warnings"]


def _one_process_file(tmp_path: Path) -> tuple[Path, Any]:
    """A LoRDO file from one process (the optimizer alone) after 3 steps, and the optimizer that wrote it."""
    fabric = _launched()
    model = regression_model(0)
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(3), loader())))
    path = tmp_path / "lordo.ckpt"
    fabric.save(path, {"model": net, "optimizer": optimizer})
    return path, optimizer


def _load_into_fresh(path: Path, optimizer_too: bool = True, **knobs: Any) -> tuple[dict[str, Any], list[str], int]:
    """The optimizer's state after ``fabric.load`` into a new run (``knobs``: its strategy's), the warnings, and the
    synchronizer's step count."""
    fabric = _launched(**knobs)
    model = regression_model(1)
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"model": net, "optimizer": optimizer} if optimizer_too else {"model": net}, strict=False)
    steps = fabric.strategy.synchronizer.optimizer_steps
    return optimizer.optimizer.state_dict(), [str(w.message) for w in caught], steps


def test_a_file_with_lordo_state_under_the_users_key_loads_as_before(tmp_path: Path) -> None:
    """A format-1 file (the counters at the top of the entry, LoRDO's state under the user's key), as the migration
    reads it, and a file saved by hand (LoRDO's state without the strategy's entry) load LoRDO's state exactly as
    the current layout does, and are not called another strategy's."""
    path, optimizer = _one_process_file(tmp_path)
    expected = optimizer.optimizer.state_dict()
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["lordo"]
    checkpoint["optimizer"], sync = entry.pop("optimizer_state"), entry.pop("sync")
    del entry["optimizer_key"]
    checkpoint["lordo"] = {**entry, **{k: sync[k] for k in _FABRIC_1_SYNC}, "format": 1}
    torch.save(checkpoint, tmp_path / "format1.ckpt")
    del checkpoint["lordo"]
    torch.save(checkpoint, tmp_path / "by_hand.ckpt")
    for file, counters in ((path, 3), (tmp_path / "format1.ckpt", 3), (tmp_path / "by_hand.ckpt", 0)):
        loaded, said, steps = _load_into_fresh(file)
        assert_identical(loaded["state"], expected["state"], str(file))
        assert not any(FROM_ANOTHER_STRATEGY in m for m in said), said
        assert steps == counters, (file, steps)


def test_the_save_filter_applies_to_lordos_own_state(tmp_path: Path) -> None:
    fabric = _launched()
    model = regression_model(0)
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(3), loader())))
    fabric.save(tmp_path / "f.ckpt", {"model": net, "optimizer": optimizer},
                filter={"optimizer": lambda key, value: key == "param_groups"})
    saved = torch.load(tmp_path / "f.ckpt", weights_only=True)
    assert set(saved["optimizer"]) == set(saved["lordo"]["optimizer_state"]) == {"param_groups"}
    loaded, _, _ = _load_into_fresh(tmp_path / "f.ckpt")
    assert not loaded["state"], "filtered-out moments came back"


def test_a_lordo_entry_older_than_the_optimizer_entry_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """Another strategy that saved the file again (``state.update(remainder)``) after training on: its AdamW entry
    is newer than the LoRDO state beside it, which is ignored."""
    path, _ = _one_process_file(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    for entry in checkpoint["optimizer"]["state"].values():  # a DDP run's later steps
        entry["step"] = entry["step"] + 5
        entry["exp_avg"] = torch.randn_like(entry["exp_avg"])
    torch.save(checkpoint, tmp_path / "resaved.ckpt")
    loaded, said, steps = _load_into_fresh(tmp_path / "resaved.ckpt")
    said = [m for m in said if "'lordo' entry is older than its optimizer entry" in m]
    assert len(said) == 1 and FROM_ANOTHER_STRATEGY in said[0], said  # one warning
    assert steps == 0, "the older entry's counters were restored"
    lowrank = {i for i, e in checkpoint["lordo"]["optimizer_state"]["state"].items() if "basis" in e}
    assert lowrank and all(not loaded["state"].get(i) for i in lowrank), "low-rank moments not restarted"
    for i, entry in checkpoint["optimizer"]["state"].items():  # the newer entry's moments
        if i not in lowrank:
            assert torch.equal(loaded["state"][i]["exp_avg"], entry["exp_avg"]), i
    # the model alone: the file's optimizer entry still shows the LoRDO entry is older, whose counters stay out
    _, said, steps = _load_into_fresh(tmp_path / "resaved.ckpt", optimizer_too=False)
    assert steps == 0 and any("is older than its optimizer entry" in m for m in said), (steps, said)
    assert _load_into_fresh(path, optimizer_too=False)[2] == 3  # the file as LoRDO saved it: counters restored


@pytest.mark.parametrize("optimizer_too", [True, False], ids=["with-optimizer", "model-only"])
def test_a_resume_with_other_distribution_knobs_lists_them(tmp_path: Path, optimizer_too: bool) -> None:
    """As the Trainer's resume: one warning names every knob that changed, the distribution knobs too (Fabric's
    entry did not record them: a resume with another ``sync_every`` said nothing)."""
    path, _ = _one_process_file(tmp_path)
    _, said, _ = _load_into_fresh(path, optimizer_too, sync_every=2 * K, overlap_steps=1)
    said = [m for m in said if "the knobs passed now win" in m]
    assert len(said) == 1 and f"sync_every: {K} -> {2 * K}" in said[0] and "overlap_steps: 0 -> 1" in said[0], said
    _, said, _ = _load_into_fresh(path, optimizer_too)
    assert not [m for m in said if "the knobs passed now win" in m], said
