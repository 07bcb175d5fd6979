"""A tiny model and a fit helper for the strategy tests (2 processes launched by fork, asserts in workers)."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDOStrategy
from lightning_lordo.strategy_knobs import strategy_kwargs


class TinyRegressor(L.LightningModule):
    """Three linear layers (two of them low-rank at rank 4) and a LayerNorm, on a synthetic regression."""

    def __init__(self, optimizer: str = "adamw", lr: float = 1e-2, scheduler: Any = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 16), nn.GELU(),
                                 nn.Linear(16, 3))
        self.optimizer_name, self.lr, self.scheduler = optimizer, lr, scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if not self.scheduler:
            return optimizer
        if self.scheduler == "sequential":  # warmup then cosine: schedulers made of schedulers
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
            schedule: Any = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
        else:
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5) * 0.9**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def regression_data(n: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=generator)
    w = torch.randn(12, 3, generator=generator)
    return TensorDataset(x, torch.tanh(x @ w))


def loader(n: int = 256, batch_size: int = 8) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=batch_size, shuffle=False)


def lordo(sync_every: int = 4, start_method: str = "fork", **knobs: Any) -> LoRDOStrategy:
    """The strategy for tests: fork for 2 workers; ``start_method="popen"`` runs a 1-device fit in this process."""
    if knobs.get("lowrank", True):  # "diloco" takes no optimizer knobs
        knobs.setdefault("rank", 4)
    return LoRDOStrategy(sync_every=sync_every, start_method=start_method, timeout=timedelta(seconds=60),
                         **strategy_kwargs(**knobs))


def trainer(strategy: Any, devices: int = 2, callbacks: Any = (), **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=devices, max_steps=10, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False)
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, callbacks=list(callbacks), **defaults)


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """All ranks' copies of ``t`` (test-only traffic, not counted by the plugin)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def sync_rounds(sync: Any, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, rank: int,
                before_sync: Callable[[int], None] = lambda step: None) -> Any:
    """Train ``steps`` steps of a :class:`Synchronizer` on random gradients (the workers apart, by ``rank``);
    yield ``(report, the sync's peak of live bytes)`` at each sync (``benchmarks/memory.py``'s ``LiveBytes``).
    ``before_sync(step)`` runs after each optimizer step."""
    import memory  # benchmarks/, on the path of the tests that call this

    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
        sync.before_optimizer_step()
        optimizer.step()
        before_sync(step)
        with memory.LiveBytes() as live:
            report = sync.on_optimizer_step()
        if report is not None:
            yield report, live.peak


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality (dtype included) of nested tensors, dicts, lists and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_worker(rank: int, world: int, port: int, out: str, body: Callable[[int, int], dict[str, Any]]) -> None:
    """A :func:`run_fork_job` worker (bind ``body`` with ``functools.partial``): one thread, a gloo process group,
    then ``body(rank, world)``'s results saved (a failure as its traceback under ``_error``), and an exit without
    teardown (after a failed collective, ``destroy_process_group`` would wait)."""
    results: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        results = body(rank, world)
    except BaseException:  # noqa: BLE001 - reported to the test
        results["_error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out, f"rank{rank}.pt"))
        os._exit(0)


def run_fork_job(worker: Callable[..., None], world: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    """``world`` forked processes running ``worker(rank, world, port, out)`` (each saves its results to
    ``out/rank<r>.pt`` and exits); joined within ``timeout`` seconds, stragglers killed. Returns every rank's
    results, failing on a rank that wrote nothing or reported an ``_error``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, str(out)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    results = []
    for r in range(world):
        path = out / f"rank{r}.pt"
        assert path.exists(), f"worker {r} of {world} wrote nothing (exit code {procs[r].exitcode})"
        results.append(torch.load(path, weights_only=False))
        assert "_error" not in results[r], results[r]["_error"]
    return results


def expand_lordo_state(lordo_state: dict[str, Any], shapes: list[torch.Size]) -> dict[Any, dict[str, torch.Tensor]]:
    """float64 reference of a LoRDO state dict in torch AdamW's shape (``shapes``: the parameters', by index):
    m = Q u and v = max((Q o Q) v_r, mean(v_r)) in the parameter's orientation; full-rank moments as they are."""
    out = {}
    for index, entry in lordo_state["state"].items():
        if not entry:
            continue
        if "basis" not in entry:
            out[index] = {"step": entry["step"], **{k: entry[k].double() for k in ("exp_avg", "exp_avg_sq")}}
            continue
        q, u, v = (entry[k].double() for k in ("basis", "exp_avg", "exp_avg_sq"))
        first, second = q @ u, torch.maximum(q.square() @ v, v.mean())
        tall = shapes[index][0] > shapes[index][1]
        out[index] = {"step": entry["step"], "exp_avg": first.T if tall else first,
                      "exp_avg_sq": second.T if tall else second}
    return out
