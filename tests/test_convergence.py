"""The optimizer converges where AdamW does (issue 30): a linear regression, 3000 full-batch steps, with a fixed basis
and with bases refreshed from the pseudo-gradient every 4, 8 and 32 steps, for the optimizer knobs of every preset;
then the same under the Trainer, one device and two processes. The final loss must be at most 5 % of the start and at
most twice the lowest seen: with the error feedback undecayed (``ef_decay=1``, the former default) the loss fell and
then rose past its start (an integral wind-up), and with LDAdam's rotation a refresh every 4 steps diverged."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.config import LEAN_KNOBS

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

#: The optimizer knobs of the presets: "lordo", "lordo_local" and "lowrank_ddp" take the defaults, "lordo_lean" and
#: "lordo_compressed" the lean ones ("diloco" runs the user's AdamW); "authors" is the authors' recipe (SPEC §10).
PRESET_KNOBS: dict[str, dict[str, Any]] = {
    "defaults": {}, "lean": dict(LEAN_KNOBS),
    "authors": {"normalizer": "mean_denom", "full_rank_input": "accumulated", "projection": "svd",
                "variance_clamp": True, "update_scale": 1.0},
}


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g)
    y = x @ (torch.randn(48, 64, generator=g) / 8).T + 0.1 * torch.randn(512, 48, generator=g)
    return x, y


def _train(lin: nn.Linear, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int = 3000
           ) -> list[float]:
    """Full-batch steps of the regression; the loss before each."""
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(lin(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _check(losses: list[float], what: str) -> None:
    start, lowest, last = losses[0], min(losses), losses[-1]
    assert last <= 0.05 * start, f"{what}: {last:.4f} is not within 5 % of the start {start:.4f}"
    assert last <= 2 * lowest, f"{what}: {last:.4f} rose past twice the lowest loss {lowest:.4f}"


@pytest.mark.parametrize("refresh", [0, 4, 8, 32], ids=lambda r: f"refresh{r}" if r else "fixed-basis")
@pytest.mark.parametrize("preset", PRESET_KNOBS)
def test_regression_converges_with_a_fixed_or_refreshed_basis(preset: str, refresh: int) -> None:
    x, y = _problem()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    opt = LoRDO(lin.parameters(), lr=1e-2, weight_decay=0.0, rank=8, **PRESET_KNOBS[preset])
    anchor, losses = lin.weight.detach().clone(), []
    for t in range(1, 3001):
        loss = nn.functional.mse_loss(lin(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if refresh and t % refresh == 0:  # what a sync does: bases from the pseudo-gradient since the last one
            opt.install_bases({lin.weight: anchor - lin.weight.detach()})
            anchor = lin.weight.detach().clone()
    _check(losses, f"{preset}, refresh every {refresh or 'never'}")


@pytest.mark.parametrize("state", ["adamw", "factored"])
def test_regression_converges_on_the_full_rank_step(state: str) -> None:
    """The matrix on the full-rank step (as an embedding or a head), with AdamW's moments or the factored ones."""
    x, y = _problem()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    opt = LoRDO(lin.parameters(), lr=1e-2, weight_decay=0.0, full_rank=[lin.weight], fullrank_state=state)
    losses = _train(lin, opt, x, y)
    assert "factored_row" in opt.state[lin.weight] if state == "factored" else "exp_avg_sq" in opt.state[lin.weight]
    _check(losses, f"full-rank step, fullrank_state={state!r}")


def test_undecayed_error_feedback_still_winds_up() -> None:
    """The reason for a decay at all: ``ef_decay=1.0`` with the accumulated input (what the defaults were) and a
    fixed basis ends above twice its lowest loss. Kept reachable for the authors' recipe, documented."""
    x, y = _problem()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    opt = LoRDO(lin.parameters(), lr=1e-2, weight_decay=0.0, rank=8, ef_decay=1.0, full_rank_input="accumulated")
    losses = _train(lin, opt, x, y)
    assert losses[-1] > 2 * min(losses)


def test_a_long_memory_stalls_when_bases_change_often() -> None:
    """The reason ``"auto"`` follows the refresh interval: the long memory (0.99) that converges with a fixed basis
    stalls at many times the optimum when the bases change every 4 steps (``"auto"`` then decays with ``beta1``)."""
    x, y = _problem()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    opt = LoRDO(lin.parameters(), lr=1e-2, weight_decay=0.0, rank=8, ef_decay=0.99)
    anchor, losses = lin.weight.detach().clone(), []
    for t in range(1, 1001):
        loss = nn.functional.mse_loss(lin(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t % 4 == 0:
            opt.install_bases({lin.weight: anchor - lin.weight.detach()})
            anchor = lin.weight.detach().clone()
    assert losses[-1] > 0.05 * losses[0]


class Regression(L.LightningModule):
    """The regression under the Trainer; the user returns LoRDO, so the one linear layer takes the low-rank step
    (the strategy's own conversion would keep a model's only layer, its head, on AdamW)."""

    def __init__(self, knobs: dict[str, Any], out: str) -> None:
        super().__init__()
        self.lin, self.knobs, self.out, self.losses = nn.Linear(64, 48), knobs, out, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.lin(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            Path(self.out).write_text(json.dumps(self.losses))

    def configure_optimizers(self) -> LoRDO:
        return LoRDO(self.parameters(), lr=1e-2, weight_decay=0.0, rank=8, **self.knobs)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(FullBatches(self.global_rank, self.trainer.world_size), batch_size=None)


class FullBatches(IterableDataset):
    """The full batch (512 samples a step in all), one step an epoch as Lightning's ``DistributedSampler`` deals it
    (a permutation seeded by the epoch and seed 0, every ``world``-th sample of it to this rank), taken whole, in one
    epoch of :data:`STEPS` batches: a sample at a time and an epoch a step, the loader took more time than the
    training. The same batches as before, whatever ``PL_GLOBAL_SEED`` an earlier test left behind."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = _problem()
        for epoch in range(STEPS):
            rows = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))[self.rank::self.world]
            yield x[rows], y[rows]


STEPS = 1600


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("preset", ["defaults", "lean"])
def test_regression_converges_under_the_trainer(preset: str, devices: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Regression(PRESET_KNOBS[preset], str(tmp_path / "losses.json"))
    strategy = LoRDOStrategy(sync_every=8, start_method="fork", monitor=False)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False).fit(module)
    _check(json.loads((tmp_path / "losses.json").read_text()), f"{preset}, {devices} device(s)")
