"""One benchmark run: a byte-level GPT trained through Lightning with M worker processes, and its figures.

A run is described by a :class:`RunSpec` (method, learning rate, seed, model and data sizes, LoRDO knobs) and
returns a plain dict: validation loss along the way and at the end, bytes sent per worker (counted by the
strategy for the LoRDO family; computed as numel x 4 per step for DDP's gradient all-reduce), optimizer and
synchronization memory, wall time, subspace movement and the term ratio. Runs are appended to a JSONL file as
they finish, so an interrupted part keeps what it measured.

Methods (SPEC §7):

* ``ddp``: Lightning DDP + AdamW, gradients all-reduced every step.
* ``lowrank_ddp``: DDP (gradients all-reduced every step) + LoRDO with omega = 1, whose bases are recomputed
  every ``sync_every`` steps from the averaged gradient (GaLore/LDAdam-style low-rank DDP).
* ``diloco``: local AdamW, parameters averaged every K steps.
* ``lordo_noqhm``: LoRDO-Global with omega = 1 (no full-rank term).
* ``lordo_local``: each worker computes its basis from its own pseudo-gradient.
* ``lordo``: the method.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.models import ByteDataModule, GPTLightningModule
from lightning_lordo.strategy import full_rank_params, track_step_calls

METHODS = ("ddp", "lowrank_ddp", "diloco", "lordo_noqhm", "lordo_local", "lordo")
ROOT = Path(__file__).resolve().parent


@dataclasses.dataclass
class RunSpec:
    method: str
    lr: float
    data: str
    seed: int = 0
    steps: int = 640
    workers: int = 4
    batch_size: int = 8
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    sync_every: int = 16
    rank: int = 8
    val_every: int = 64
    val_batches: int = 16
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps % self.val_every:  # Lightning validates every val_every steps: the last ones would be unseen
            raise ValueError(f"RunSpec: steps={self.steps} is not a multiple of val_every={self.val_every}, so the "
                             "final validation loss would be measured before the end; pick multiples.")

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.knobs.items()))
        return f"{self.method}[{extra}]" if extra else self.method


class BenchModule(GPTLightningModule):
    """The demo's GPT; for ``lowrank_ddp`` its optimizer is LoRDO (omega 1) under plain DDP."""

    def __init__(self, lowrank_rank: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lowrank_rank = lowrank_rank

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        if not self.lowrank_rank:
            return config
        adamw = config["optimizer"]
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay",
                                                         "initial_lr")} for g in adamw.param_groups]
        lordo = LoRDO(groups, rank=self.lowrank_rank, omega=1.0, full_rank=full_rank_params(self))
        scheduler = config["lr_scheduler"]["scheduler"]
        scheduler.optimizer = lordo
        track_step_calls(lordo)
        return {"optimizer": lordo, "lr_scheduler": config["lr_scheduler"]}


class GradientBasisRefresh(L.Callback):
    """Low-rank DDP: every ``every`` steps, new bases from the (already all-reduced) gradient, before the step."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        lordo: LoRDO = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if trainer.global_step % self.every == 0 and trainer.global_step > 0:
            lordo.install_bases({p: p.grad for p in lordo.lowrank_params() if p.grad is not None})


class Recorder(L.Callback):
    """Rank 0 writes the run's figures to ``path`` (the workers are forked: the parent cannot see them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.curve: list[dict[str, float]] = []

    def _bytes(self, trainer: L.Trainer, module: L.LightningModule) -> float:
        strategy = trainer.strategy
        if isinstance(strategy, LoRDOStrategy):
            return strategy.accountant.total_bytes
        per_step = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return per_step * trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self.curve.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"]),
                           "bytes": self._bytes(trainer, module)})

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        optimizer = trainer.strategy.optimizers[0]
        out: dict[str, Any] = {"curve": self.curve, "bytes_sent": self._bytes(trainer, module)}
        if isinstance(trainer.strategy, LoRDOStrategy):
            strategy = trainer.strategy
            out["bytes_by_purpose"] = dict(strategy.accountant.totals)
            reports = strategy.sync_reports
            moves = [r.subspace_movement for r in reports if r.subspace_movement is not None]
            out["subspace_movement_mean"] = sum(moves) / len(moves) if moves else None
            out["sync_seconds_mean"] = sum(r.seconds for r in reports) / max(1, len(reports))
            out["basis_seconds_mean"] = sum(r.basis_seconds for r in reports) / max(1, len(reports))
            out["sync_memory"] = strategy.synchronizer.memory_report()
        if isinstance(optimizer, LoRDO):
            out["optimizer_memory"] = optimizer.memory_report()
            out["diagnostics"] = optimizer.diagnostics()
        else:
            out["optimizer_memory"] = {"adamw_state": sum(t.numel() * t.element_size()
                                                          for s in optimizer.state.values() for t in s.values()
                                                          if isinstance(t, torch.Tensor))}
        self.path.write_text(json.dumps(out))


def _strategy(spec: RunSpec) -> Any:
    if spec.method in ("ddp", "lowrank_ddp"):
        return "ddp_fork"
    presets: dict[str, dict[str, Any]] = {
        "diloco": {"lowrank": False},
        "lordo_noqhm": {"omega": 1.0},
        "lordo_local": {"basis_scope": "local", "average_moments": False},
        "lordo": {},
    }
    knobs = {**presets[spec.method], **spec.knobs}
    if knobs.get("lowrank", True):
        knobs.setdefault("rank", spec.rank)
    return LoRDOStrategy(sync_every=spec.sync_every, start_method="fork", seed=spec.seed, monitor=False, **knobs)


def run(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec`` and return its figures (blocking; forks ``spec.workers`` processes)."""
    if spec.method not in METHODS:
        raise ValueError(f"method={spec.method!r}: choose one of {METHODS}")
    torch.set_num_threads(1)
    L.seed_everything(spec.seed, verbose=False)
    module = BenchModule(
        lowrank_rank=spec.rank if spec.method == "lowrank_ddp" else 0, d_model=spec.d_model,
        n_layers=spec.n_layers, n_heads=spec.n_heads, seq_len=spec.seq_len, lr=spec.lr,
        warmup_steps=max(1, spec.steps // 20), total_steps=spec.steps,
    )
    data = ByteDataModule(path=spec.data, seq_len=spec.seq_len, batch_size=spec.batch_size,
                          train_samples=spec.steps * spec.batch_size * spec.workers, val_batches=spec.val_batches,
                          seed=spec.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        callbacks: list[L.Callback] = [Recorder(path)]
        if spec.method == "lowrank_ddp":
            callbacks.append(GradientBasisRefresh(spec.sync_every))
        trainer = L.Trainer(
            strategy=_strategy(spec), accelerator="cpu", devices=spec.workers, max_steps=spec.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            val_check_interval=spec.val_every, num_sanity_val_steps=0, callbacks=callbacks,
        )
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - start
        result = json.loads(path.read_text())
    final = result["curve"][-1]["val_loss"] if result["curve"] else float("nan")
    return {"spec": dataclasses.asdict(spec), "label": spec.label(), "final_val_loss": final,
            "final_val_ppl": float(torch.tensor(final).exp()), "wall_seconds": wall, **result}


def provenance(command: str) -> dict[str, Any]:
    """The exact command, commit, versions and machine of a result file."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "lightning_lordo", "benchmarks",
                                     ":!benchmarks/results"],
                                    capture_output=True, text=True, cwd=ROOT).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", True
    return {"command": command, "commit": commit, "uncommitted_changes": dirty, "torch": torch.__version__,
            "lightning": L.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                       f"{len(__import__('os').sched_getaffinity(0))} cores, {platform.platform()}"}


def append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(records: list[dict[str, Any]], spec: RunSpec) -> Optional[dict[str, Any]]:
    """The record of ``spec`` if this part already measured it (resuming an interrupted part)."""
    key = dataclasses.asdict(spec)
    return next((r for r in records if r.get("spec") == key), None)
