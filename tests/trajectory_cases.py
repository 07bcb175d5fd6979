"""Short, seeded trajectories whose results are committed as fixtures (``tests/fixtures/trajectories.pt``).

They were recorded before the optimizer step was grouped and the synchronization reordered into exchange-then-
commit, with the per-matrix step and the mutate-as-you-go sync (``python tests/trajectory_cases.py`` rewrote the
file; the commit that did so is named in ``tests/fixtures/README.md``). ``tests/test_trajectories.py`` checks that
today's code still produces them: bitwise where the math is the same, within 1e-6 relative where only the order of
floating-point operations changed.

* ``optimizer``: one process, a mixed set of shapes (three wide, two tall, one square, bfloat16 too, 1-D, 3-D, a
  full-rank matrix), 12 steps of every update mode and normalizer, a basis install every 4 steps.
* ``strategy``: 2 processes (fork), 10 optimizer steps with K = 4, configurations whose synchronization math does
  not depend on where the moments are averaged (local moments, ``reset``, DiLoCo, the ``lowrank`` payload).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_lordo.optim.bases import REFRESH_COUNTERS

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "trajectories.pt"

OPTIMIZER_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "authors": {"omega": 0.97, "normalizer": "mean_denom", "full_rank_input": "accumulated", "error_feedback": True,
                "projection": "svd", "variance_clamp": True},
    "subspace_qh": {"update": "subspace_qh", "omega": 0.94, "error_feedback": True, "ef_decay": 0.9},
    "unnormalized": {"update": "unnormalized_lowrank", "omega": 0.9, "normalizer": "scalar"},
    "factored": {"normalizer": "factored", "mu": 1.5, "error_feedback": True, "ef_dtype": "bfloat16"},
    "lifted_auto": {"normalizer": "lifted", "mu": "auto", "projection": "randomized"},
    "omega1_reset": {"omega": 1.0, "transition": "reset"},
    "keep_power3": {"transition": "keep", "power_iters": 3, "rank": 0.25},
}

#: The optimizer's defaults when the fixture was recorded (no error feedback, omega 0.7, the gradient into the
#: full-rank term, one power step). Every case is over them (:func:`recorded_knobs`), so the fixture keeps its meaning
#: whatever today's defaults are.
RECORDED_DEFAULTS: dict[str, Any] = {"omega": 0.7, "full_rank_input": "gradient", "error_feedback": False,
                                     "power_iters": 1, "ef_decay": 1.0, "update_scale": 1.0}


def recorded_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """``knobs`` over :data:`RECORDED_DEFAULTS` (``subspace_qh`` and ``omega=1`` have no full-rank term, so no input
    for it)."""
    no_term = knobs.get("update") == "subspace_qh" or knobs.get("omega") == 1.0
    base = {k: v for k, v in RECORDED_DEFAULTS.items() if not (k == "full_rank_input" and no_term)}
    merged = {**base, **knobs}
    if not merged["error_feedback"]:  # the recording's decay (1.0) only applies to a buffer
        merged.pop("ef_decay")
    if merged.get("projection") == "svd":  # exact bases take no power steps
        merged.pop("power_iters")
    return merged


STRATEGY_CASES: dict[str, dict[str, Any]] = {
    "local_moments": {"average_moments": False, "error_feedback": True, "normalizer": "factored",
                      "outer_optimizer": "nesterov"},
    "reset": {"transition": "reset", "average_fullrank_moments": True},
    "diloco": {"lowrank": False},
    "lowrank_int8": {"payload": "lowrank", "payload_dtype": "int8", "average_moments": False},
    "local_scope": {"basis_scope": "local", "average_moments": False, "omega": 0.9},
}


def as_recorded(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state dict as the fixture recorded it: ``ef_dtype`` became ``"auto"`` by default after the
    recording, which on the CPU (every parameter here) is the recorded ``"float32"``; ``update_scale`` came later
    (the cases run it at the recorded 1.0), ``ef_decay`` became ``"auto"`` (without a buffer it means nothing), and
    the groups count the steps between bases (bookkeeping that ``"auto"`` reads). The math is the same."""
    for group in state["param_groups"]:
        for key in REFRESH_COUNTERS:
            group.pop(key, None)
        if group.get("ef_dtype") == "auto":
            group["ef_dtype"] = "float32"
        if group.get("update_scale") == 1.0:  # a knob added after the recording, at the recorded step's scale
            del group["update_scale"]
        if group.get("ef_decay") == "auto" and not group["error_feedback"]:  # no buffer to decay
            group["ef_decay"] = 1.0
    return state


# ------------------------------------------------------------------------------------------------ optimizer
def optimizer_params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 32), (16, 32), (16, 32), (48, 16), (48, 16), (24, 24), (20,), (2, 3, 4), (10, 40)]
    params = [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    params.append(nn.Parameter(torch.randn(16, 32, generator=generator).to(torch.bfloat16)))
    return params


def run_optimizer_case(knobs: dict[str, Any], steps: int = 12, **implementation: Any) -> dict[str, Any]:
    from lightning_lordo import LoRDO

    params = optimizer_params()
    full_rank = [params[8]]
    groups = [{"params": params[:6] + params[9:]}, {"params": params[6:9], "weight_decay": 0.0}]
    rank = knobs.pop("rank", 4)
    opt = LoRDO(groups, lr=1e-2, rank=rank, weight_decay=0.05, full_rank=full_rank, **recorded_knobs(knobs),
                **implementation)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        opt.step()
        if step % 4 == 0:
            sources = {p: torch.randn(p.shape, generator=generator) for p in opt.lowrank_params()}
            opt.install_bases(sources)
    return {"params": [p.detach().clone() for p in params], "optimizer": as_recorded(opt.state_dict())}


# ------------------------------------------------------------------------------------------------ strategy
class MixedShapes(L.LightningModule):
    """Three same-shape hidden layers (one group for a grouped step), a tall and a wide matrix, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)  # weight 24 x 12: tall
        self.hidden = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.norm = nn.LayerNorm(24)
        self.wide = nn.Linear(24, 8)  # weight 8 x 24: wide
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = x + torch.tanh(layer(x))
        return self.out(torch.tanh(self.wide(self.norm(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class Record(L.Callback):
    """Each rank's parameters, optimizer and synchronizer state before the final sync, and the parameters after."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        finish = strategy._finish_training

        def record_then_finish() -> None:  # the state before the final sync (run at the last step)
            if not strategy.final_sync_done:
                self.out[f"rank{trainer.global_rank}"] = {
                    "params": [p.detach().clone() for p in module.parameters()],
                    "optimizer": as_recorded(strategy.optimizers[0].state_dict()),
                    "anchor": [a.clone() for a in strategy.synchronizer.anchor.tensors],
                }
            finish()

        strategy._finish_training = record_then_finish

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.out[f"rank{trainer.global_rank}"]["final"] = [p.detach().clone() for p in module.parameters()]
        path = os.environ.get("LORDO_TRAJECTORY_OUT")
        if path:
            torch.save(self.out[f"rank{trainer.global_rank}"], f"{path}.rank{trainer.global_rank}")


def run_strategy_case(knobs: dict[str, Any], path: str, foreach: bool = True) -> dict[str, Any]:
    """Fit with 2 forked processes; returns both ranks' records (written to ``path.rankN`` by the workers).
    ``foreach=False``: the strategy's LoRDO takes the per-matrix reference step."""
    from datetime import timedelta

    from strategy_helpers import loader

    from lightning_lordo import LoRDO, LoRDOStrategy

    defaults = LoRDO.__init__.__kwdefaults__
    LoRDO.__init__.__kwdefaults__ = {**defaults, "foreach": foreach}
    try:
        return _fit_case(knobs, path, LoRDOStrategy, loader, timedelta)
    finally:
        LoRDO.__init__.__kwdefaults__ = defaults


def _fit_case(knobs: dict[str, Any], path: str, LoRDOStrategy: Any, loader: Any, timedelta: Any) -> dict[str, Any]:

    knobs = dict(knobs)
    if knobs.get("lowrank", True):
        knobs = recorded_knobs(knobs)
        knobs.setdefault("rank", 4)
    os.environ["LORDO_TRAJECTORY_OUT"] = path
    torch.manual_seed(0)
    module = MixedShapes()
    from lightning_lordo.strategy_knobs import strategy_kwargs

    strategy = LoRDOStrategy(sync_every=4, start_method="fork", timeout=timedelta(seconds=60), monitor=False,
                             **strategy_kwargs(**knobs))
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=10, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[Record({})]).fit(module, loader())
    del os.environ["LORDO_TRAJECTORY_OUT"]
    return {f"rank{r}": torch.load(f"{path}.rank{r}", weights_only=True) for r in (0, 1)}


def record_all(tmp: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"optimizer": {}, "strategy": {}}
    for name, knobs in OPTIMIZER_CASES.items():
        out["optimizer"][name] = run_optimizer_case(dict(knobs))
    for name, knobs in STRATEGY_CASES.items():
        out["strategy"][name] = run_strategy_case(knobs, str(tmp / name))
    return out


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory() as tmp:
        FIXTURE.parent.mkdir(exist_ok=True)
        torch.save(record_all(Path(tmp)), FIXTURE)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
