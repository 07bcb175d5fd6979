"""A LoRDO checkpoint resumed without the LoRDO strategy (``strategy="ddp"``, one device): its optimizer entry holds
AdamW moments, the low-rank ones expanded through their bases (checked against a float64 reference of the LoRDO
state in rank 0's shard); the ``ConvertLoRDOCheckpoint`` callback says what was left behind in one warning, and the
command line writes a file without the LoRDO state."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TinyRegressor, expand_lordo_state, loader, lordo, trainer

from lightning_lordo import LoRDOStrategy
from lightning_lordo.lightning.export import ConvertLoRDOCheckpoint, to_torch_checkpoint
from lightning_lordo.lightning.shards import load_full

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


@pytest.fixture(scope="module")
def mid_round(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 workers, K = 4, error feedback and a Nesterov outer step; the checkpoint at step 6 is mid-round."""
    directory = tmp_path_factory.mktemp("lordo")
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=6, save_top_k=-1)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, error_feedback=True, outer_optimizer="nesterov"), callbacks=[checkpoints],
            max_steps=8, enable_checkpointing=True).fit(TinyRegressor(), loader())
    return directory / "step=6.ckpt"


def expected_adamw_state(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """float64 reference from rank 0's LoRDO state (``strategy_helpers.expand_lordo_state``)."""
    checkpoint = load_full(path)
    names = checkpoint["lordo"]["layout"]["param_names"]
    shapes = [checkpoint["state_dict"][n].shape for n in names]
    return expand_lordo_state(checkpoint["lordo"]["ranks"][0]["optimizer"], shapes)


def assert_state_matches(state: dict[int, dict[str, torch.Tensor]], expected: dict[int, dict[str, torch.Tensor]]
                         ) -> None:
    assert state.keys() == expected.keys()
    for index, entry in expected.items():
        assert float(state[index]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            got = state[index][key]
            assert got.shape == entry[key].shape, (index, key)
            torch.testing.assert_close(got.double(), entry[key].double(), rtol=1e-6, atol=1e-9)


class AtStart(L.Callback):
    """Rank 0: the optimizer's state and the model when training resumes, the warnings from setup on, and the
    model at the end."""

    def __init__(self, path: Path) -> None:
        self.path, self.out = path, {}

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._recorder = warnings.catch_warnings(record=True)
        self.caught = self._recorder.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        self.out.update(type=type(optimizer).__name__, state=copy.deepcopy(optimizer.state_dict()),
                        model={k: v.clone() for k, v in module.state_dict().items()})

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._recorder.__exit__(None, None, None)
        self.out.update(steps=trainer.global_step, warnings=[str(w.message) for w in self.caught],
                        warned_at=[w.filename for w in self.caught],
                        final=torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        if trainer.global_rank == 0:
            torch.save(self.out, self.path)


@pytest.mark.parametrize("callback", [False, True], ids=["plain", "with-callback"])
def test_plain_ddp_resumes_a_lordo_checkpoint_and_the_callback_says_what_was_left(mid_round: Path, tmp_path: Path,
                                                                                  callback: bool) -> None:
    checkpoint = torch.load(mid_round, weights_only=True)
    assert checkpoint["lordo"]["sync"]["steps_since_sync"] == 2
    callbacks = [ConvertLoRDOCheckpoint()] if callback else []
    trainer("ddp_fork", callbacks=[*callbacks, AtStart(tmp_path / "out.pt")], max_steps=12).fit(
        TinyRegressor(), loader(), ckpt_path=str(mid_round))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["type"] == "AdamW" and out["steps"] == 12 and torch.isfinite(out["final"]).all()
    assert_state_matches(out["state"]["state"], expected_adamw_state(mid_round))
    group = out["state"]["param_groups"][0]
    assert "omega" not in group and group["decoupled_weight_decay"] is True and group["weight_decay"] == 0.01
    for key, value in checkpoint["state_dict"].items():  # DDP resumes the synchronized model
        assert torch.equal(out["model"][key], value), key
    messages = [m for m in out["warnings"] if "Converted a LoRDO checkpoint" in m]
    assert len(messages) == int(callback), out["warnings"]
    at = [f for m, f in zip(out["warnings"], out["warned_at"]) if "Converted a LoRDO checkpoint" in m]
    assert all(Path(f).name == Path(__file__).name for f in at), at  # the user's line (was Lightning's call.py)
    for text in ("for DDPStrategy", "moments of 2 low-rank matrices were expanded", "2 error-feedback buffers",
                 "outer Nesterov momentum", "2 local steps since the last sync", "ranks 1..1")[:6 * callback]:
        assert text in messages[0], (text, messages[0])


@pytest.fixture(scope="module")
def in_flight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``overlap_steps=2``: the checkpoint at step 5 holds the round launched at step 4 on every rank."""
    directory = tmp_path_factory.mktemp("overlap")
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, overlap_steps=2, error_feedback=True), callbacks=[checkpoints], max_steps=7,
            enable_checkpointing=True).fit(TinyRegressor(), loader())
    return directory / "step=5.ckpt"


def test_plain_ddp_resumes_a_checkpoint_with_an_overlapped_round_in_flight(in_flight: Path, tmp_path: Path) -> None:
    """The round in flight is left behind and named; DDP resumes the synchronized model (the anchor, which the
    round has not changed yet) with rank 0's moments in AdamW's shape."""
    full = load_full(in_flight)
    assert all(rank["overlap"]["step"] == 4 for rank in full["lordo"]["ranks"]), "no round in flight at the save"
    names = full["lordo"]["layout"]["param_names"]
    anchor = dict(zip(names, full["lordo"]["sync"]["anchor"]))
    assert anchor.keys() == {n for n, _ in TinyRegressor().named_parameters()}
    trainer("ddp_fork", callbacks=[ConvertLoRDOCheckpoint(), AtStart(tmp_path / "out.pt")], max_steps=9).fit(
        TinyRegressor(), loader(), ckpt_path=str(in_flight))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["type"] == "AdamW" and out["steps"] == 9 and torch.isfinite(out["final"]).all()
    assert_state_matches(out["state"]["state"], expected_adamw_state(in_flight))
    for name, value in anchor.items():  # the synchronized model, bit for bit
        assert torch.equal(out["model"][name], value), name
    messages = [m for m in out["warnings"] if "Converted a LoRDO checkpoint" in m]
    assert len(messages) == 1 and "the overlapped round in flight (launched at optimizer step 4)" in messages[0], \
        out["warnings"]
    # without the plugin: a plain one-device Trainer resumes the file from the synchronized model
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_PLUGIN, str(in_flight)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0 and "resumed at step 5 from the file's model" in done.stdout, done.stderr[-3000:]


def test_the_round_in_flight_is_named_in_the_file_whatever_the_optimizer(tmp_path: Path) -> None:
    """``"diloco"`` keeps the user's AdamW (no LoRDO optimizer entry to convert): the file itself names the round in
    flight, which its shards hold and a plain strategy does not read."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(0)
    trainer(LoRDOStrategy(preset="diloco", sync_every=4, overlap_steps=2, start_method="fork"),
            callbacks=[checkpoints], max_steps=6, enable_checkpointing=True).fit(TinyRegressor(), loader())
    checkpoint = torch.load(tmp_path / "step=5.ckpt", weights_only=True)
    assert checkpoint["lordo"]["in_flight"] == 4 and "ranks" not in checkpoint["lordo"]  # the round: in the shards
    notes = to_torch_checkpoint(checkpoint)
    assert any("the overlapped round in flight (launched at optimizer step 4)" in n for n in notes), notes


#: A user's script on a machine without the plugin: TinyRegressor's network, resumed on one device.
WITHOUT_THE_PLUGIN = """
import sys
sys.modules["lightning_lordo"] = None  # `import lightning_lordo` now fails
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 16), nn.GELU(),
                                 nn.Linear(16, 3))
    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
    def on_train_start(self):
        saved = torch.load(sys.argv[1], weights_only=True)["state_dict"]
        assert all(torch.equal(p, saved[n]) for n, p in self.state_dict().items())
        assert len(self.trainer.optimizers[0].state) == len(saved)
        print("resumed at step", self.trainer.global_step, "from the file's model")

data = DataLoader(TensorDataset(torch.randn(64, 12), torch.randn(64, 3)), batch_size=8)
L.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False,
          enable_progress_bar=False, enable_model_summary=False).fit(Net(), data, ckpt_path=sys.argv[1])
"""


def _one_device(ckpt: Path, path: Path) -> dict[str, Any]:
    L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[AtStart(path)]).fit(
        TinyRegressor(), loader(), ckpt_path=str(ckpt))
    return torch.load(path, weights_only=True)


def test_the_command_line_writes_a_checkpoint_without_the_lordo_state(mid_round: Path, tmp_path: Path) -> None:
    """As it is, a one-device run without the plugin's strategy resumes the checkpoint; the command line writes one
    without the LoRDO state that resumes to the same AdamW state. A file without LoRDO state is refused by name."""
    expected = expected_adamw_state(mid_round)
    assert_state_matches(_one_device(mid_round, tmp_path / "raw.pt")["state"]["state"], expected)
    target = tmp_path / "ddp.ckpt"
    command = [str(Path(sys.executable).parent / "lordo-export"), str(mid_round), str(target)]  # the README's
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr  # (python -m warned: runpy)
    assert "expanded through their bases" in done.stdout and "reset:" in done.stdout
    converted = torch.load(target, weights_only=True)
    assert "lordo" not in converted
    out = _one_device(target, tmp_path / "out.pt")
    assert out["type"] == "AdamW" and out["steps"] == 10 and torch.isfinite(out["final"]).all()
    assert_state_matches(out["state"]["state"], expected)
    again = subprocess.run([*command[:-2], str(target), str(tmp_path / "again.ckpt")], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "holds no LoRDO state" in again.stderr, again.stderr
    same = subprocess.run([*command[:-1], str(mid_round)], capture_output=True, text=True, timeout=120)
    assert same.returncode == 2 and "is the source" in same.stderr, same.stderr
    kept = subprocess.run(command, capture_output=True, text=True, timeout=120)  # the target exists now
    assert kept.returncode == 2 and "exists: pass --force" in kept.stderr, kept.stderr
    forced = subprocess.run([*command, "--force"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0 and "lordo" not in torch.load(target, weights_only=True)
    copy = tmp_path / "copy" / mid_round.name  # a copy whose rank-1 shard was cut short: named, not the file
    copy.parent.mkdir()
    shutil.copy(mid_round, copy)
    folder = next(mid_round.parent.glob(f"{mid_round.name}.lordo-*"))
    shutil.copytree(folder, copy.parent / folder.name)
    shard = copy.parent / folder.name / "rank-1.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    cut = subprocess.run([*command[:-2], str(copy), str(tmp_path / "cut.ckpt")], capture_output=True, text=True,
                         timeout=120)
    assert cut.returncode == 2 and "rank-1.pt" in cut.stderr and "cannot be read as a checkpoint" not in cut.stderr, \
        cut.stderr


def test_a_checkpoint_with_factored_full_rank_state_resumes_under_adamw(tmp_path: Path) -> None:
    """``fullrank_state="factored"``: the full-rank head's moments reach torch's AdamW expanded (the second moment
    the outer product of its factors over the rows' mean, the first in float32)."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=6, save_top_k=-1)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, fullrank_state="factored"), devices=1, callbacks=[checkpoints], max_steps=6,
            enable_checkpointing=True).fit(TinyRegressor(), loader())
    path = tmp_path / "step=6.ckpt"
    checkpoint = load_full(path)
    saved = checkpoint["lordo"]["ranks"][0]["optimizer"]["state"]
    factored = {i: e for i, e in saved.items() if "factored_row" in e}
    assert len(factored) == 1 and all(e["exp_avg"].dtype == torch.bfloat16 for e in factored.values())  # the head
    out = _one_device(path, tmp_path / "out.pt")
    assert out["type"] == "AdamW" and out["steps"] == 10 and torch.isfinite(out["final"]).all()
    for index, entry in factored.items():
        row, col = entry["factored_row"].double(), entry["factored_col"].double()
        got = out["state"]["state"][index]
        torch.testing.assert_close(got["exp_avg_sq"].double(), torch.outer(row, col) / row.mean())
        torch.testing.assert_close(got["exp_avg"].double(), entry["exp_avg"].double())
