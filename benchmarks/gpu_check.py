"""The checks that need a GPU, in one script that finishes in under 8 minutes on one GPU.

1. ``optimizer``: the grouped step (both layouts) against the per-matrix reference on the device, for every update
   mode and normalizer, with float32 and bfloat16 parameters (tall, wide, square, mixed), against the reference on
   the CPU; a bf16 model trained under autocast with LoRDO; and no host read in a step but the CPU step counters.
2. ``fit``: a single-process ``strategy="lordo"`` fit, ``devices=1``, ``precision="bf16-mixed"``.
3. ``synchronizer``: two processes on the one device over gloo with device tensors (the communicator's polling
   wait), three syncs: replicas bitwise identical after each, bytes counted.
4. ``speed``: the optimizer step of LoRDO (the device's default layout, and each layout forced: which one a GPU
   should default to) against torch's fused and foreach AdamW on a GPT-2-small-shaped set.

``--cpu`` runs the same on the CPU (smaller speed set). Writes ``results/gpu_check.json`` (or
``gpu_check-cpu.json``) and exits non-zero if any check failed. Usage: ``python benchmarks/gpu_check.py [--cpu]``
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from harness import ROOT, provenance
from speed import LAYOUTS
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import SyncConfig
from lightning_lordo.models import ByteDataModule, GPTLightningModule
from lightning_lordo.sync.synchronizer import Synchronizer

CASES = {
    "lordo col_rms": {}, "factored, mu auto": {"normalizer": "factored", "mu": "auto"},
    "lifted": {"normalizer": "lifted"}, "scalar": {"normalizer": "scalar"},
    "authors": {"normalizer": "mean_denom", "full_rank_input": "accumulated", "omega": 0.97},
    "subspace_qh": {"update": "subspace_qh", "omega": 0.94}, "unnormalized": {"update": "unnormalized_lowrank"},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _params(device: torch.device, dtype: torch.dtype, seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(48, 96), (48, 96), (96, 48), (64, 64), (33,), (8, 3, 5)]
    return [nn.Parameter(torch.randn(s, generator=generator).to(device=device, dtype=dtype)) for s in shapes]


def _run(params: list[nn.Parameter], knobs: dict[str, Any], foreach: bool, steps: int = 5,
         cls: type[LoRDO] = LoRDO) -> list[Tensor]:
    opt = cls(params, lr=0.02, rank=8, error_feedback=True, foreach=foreach, **knobs)
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
        opt.step()
    return [p.detach().float().cpu() for p in params]


def _max_rel(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)) for x, y in zip(a, b))


def check_optimizer(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, knobs in CASES.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4 * 2**-7)):
            reference = _run(_params(device, dtype, 0), knobs, False)
            cpu = _run(_params(torch.device("cpu"), dtype, 0), knobs, False)
            errors = {}
            for layout, cls in LAYOUTS.items():
                grouped = _run(_params(device, dtype, 0), knobs, True, cls=cls)
                errors[f"{layout}_vs_reference"] = _max_rel(grouped, reference)
                errors[f"{layout}_vs_cpu"] = _max_rel(grouped, cpu)
            out[f"{name}/{str(dtype).split('.')[1]}"] = {**errors, "ok": max(errors.values()) <= tol}
    out["autocast_bf16_training"] = _autocast_training(device)
    out["host_reads"] = _host_reads(device)
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def _autocast_training(device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    x, target = torch.randn(256, 32, device=device), torch.randn(256, 1, device=device)
    opt = LoRDO(model.parameters(), lr=3e-3, rank=8)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return {"first_loss": losses[0], "last_loss": losses[-1], "ok": finite and losses[-1] < 0.8 * losses[0]}


def _host_reads(device: torch.device) -> dict[str, Any]:
    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bad: list[str] = []
            self.counters = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if str(func).startswith(("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")):
                if args[0].device.type == "cpu" and args[0].dim() == 0:
                    self.counters += 1
                else:
                    self.bad.append(f"{func} on {args[0].device} {tuple(args[0].shape)}")
            return func(*args, **(kwargs or {}))

    params = _params(device, torch.float32, 1)
    opt = LoRDO(params, rank=8, error_feedback=True, normalizer="factored")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.request_diagnostics()
    with Reads() as reads:
        opt.step()
    return {"step_counter_reads": reads.counters, "other_reads": reads.bad, "ok": not reads.bad}


def check_fit(device: torch.device) -> dict[str, Any]:
    module = GPTLightningModule(d_model=64, n_layers=2, n_heads=4, seq_len=64, lr=3e-3, warmup_steps=4,
                                total_steps=48)
    data = ByteDataModule(seq_len=64, batch_size=8, train_samples=48 * 8, val_batches=4)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(strategy="lordo", accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                            precision="bf16-mixed", max_steps=48, val_check_interval=24, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(module, datamodule=data)
    losses = trainer.callback_metrics
    params_ok = all(torch.isfinite(p).all() and p.device.type == device.type for p in module.parameters())
    return {"val_loss": float(losses["val_loss"]), "syncs": len(trainer.strategy.sync_reports),
            "ok": params_ok and float(losses["val_loss"]) < 5.0}


def _worker(rank: int, port: int, device: str, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(device)
        opt = LoRDO(model.parameters(), rank=4, lr=1e-2)
        comm = Communicator(CommAccountant(), timedelta(seconds=30))
        sync = Synchronizer(list(model.parameters()), [], opt, SyncConfig(sync_every=3), comm)
        identical = []
        for _ in range(9):
            x = torch.randn(8, 16, device=device) * (rank + 1)
            opt.zero_grad()
            model(x).square().mean().backward()
            sync.before_optimizer_step()
            opt.step()
            report = sync.on_optimizer_step()
            if report is not None:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                copies = [torch.empty_like(flat) for _ in range(2)]
                dist.all_gather(copies, flat)
                identical.append(bool(torch.equal(copies[0], copies[1])))
        result = {"identical_after_syncs": identical, "bytes": comm.accountant.total_bytes,
                  "device": str(next(model.parameters()).device)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def check_synchronizer(device: torch.device) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(_worker, args=(port, str(device), tmp), nprocs=2, join=True,
                                              start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in (0, 1)]
    ok = all("error" not in r and r["identical_after_syncs"] == [True] * 3 and r["bytes"] > 0 for r in ranks)
    return {"ranks": ranks, "ok": ok}


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check_speed(device: torch.device, layers: int) -> dict[str, Any]:
    from speed import gpt2_small

    rows = []
    for rank in (96, 24):
        optimizers = {}
        for kind in ("adamw_fused", "adamw_foreach", "lordo", "lordo_in_place", "lordo_stacked"):
            params, embeddings = gpt2_small(layers)
            params = [nn.Parameter(p.detach().to(device)) for p in params]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            if kind.startswith("lordo"):  # the device's default layout, then each layout forced
                cls = LAYOUTS.get(kind.removeprefix("lordo_"), LoRDO)
                optimizers[kind] = cls(params, lr=1e-3, rank=rank, full_rank=params[:embeddings])
            else:
                optimizers[kind] = torch.optim.AdamW(params, lr=1e-3, **{kind.split("_")[1]: True})
            optimizers[kind].step()
        times: dict[str, list[float]] = {k: [] for k in optimizers}
        for _ in range(10):
            for kind, opt in optimizers.items():
                times[kind].append(_timed(opt.step, device, 1))
        ms = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"rank": rank, **{f"{k}_ms": v for k, v in ms.items()},
                     "lordo_over_fused": ms["lordo"] / ms["adamw_fused"],
                     "lordo_over_foreach": ms["lordo"] / ms["adamw_foreach"]})
        del optimizers
    return {"layers": layers, "rows": rows, "ok": True}


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no GPU here: run with --cpu to check the same on the CPU")
    device = torch.device("cpu" if cpu else "cuda:0")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results: dict[str, Any] = {"header": provenance("python benchmarks/gpu_check.py " + " ".join(argv)),
                               "device": torch.cuda.get_device_name(0) if not cpu else "cpu"}
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "optimizer": lambda: check_optimizer(device), "fit": lambda: check_fit(device),
        "synchronizer": lambda: check_synchronizer(device),
        "speed": lambda: check_speed(device, 2 if cpu else 12)}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - every check reports, whatever the others do
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']:.0f} s)", flush=True)
    for row in results["speed"].get("rows", []):
        print(f"  speed rank {row['rank']}: LoRDO {row['lordo_ms']:.2f} ms (in place {row['lordo_in_place_ms']:.2f}, "
              f"stacked {row['lordo_stacked_ms']:.2f}), fused AdamW {row['adamw_fused_ms']:.2f} "
              f"ms ({row['lordo_over_fused']:.2f}x), foreach AdamW {row['adamw_foreach_ms']:.2f} ms "
              f"({row['lordo_over_foreach']:.2f}x)")
    path = ROOT / "results" / ("gpu_check-cpu.json" if cpu else "gpu_check.json")
    path.write_text(json.dumps(results, indent=2))
    return 0 if all(results[name]["ok"] for name in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
