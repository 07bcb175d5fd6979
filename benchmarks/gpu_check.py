"""The checks that need a GPU, in one script that finishes in under 8 minutes on one GPU (an H200).

1. ``optimizer``: the grouped step (both layouts) against the per-matrix reference on the device, for every update
   mode and normalizer, with float32 and bfloat16 parameters (tall, wide, square, mixed), against the reference on
   the CPU; a bf16 model trained under autocast with LoRDO; and no host read in a step but the CPU step counters.
2. ``fit``: a single-process ``strategy="lordo"`` fit, ``devices=1``, ``precision="bf16-mixed"``; the parameters'
   device is recorded during training (Lightning's teardown moves the module back to the CPU).
3. ``synchronizer``: two processes on the one device over gloo with device tensors (the communicator's polling
   wait), three syncs: replicas bitwise identical after each, bytes counted.
4. ``speed``: the optimizer step of LoRDO (the device's default layout, and each layout forced: which one a GPU
   should default to) against torch's fused and foreach AdamW on a GPT-2-small-shaped set.
5. ``step``: the optimizer step of LoRDO (default knobs, and ``LEAN_KNOBS``) against torch's fused and foreach AdamW
   on three fp32 parameter sets, GPT-2-124M, GPT-2-355M and Llama-1B shaped (embeddings and heads take AdamW, as in
   the plugin): median ms, ratio to fused AdamW, ops dispatched per step.
6. ``lightning``: one Lightning fit per strategy, each in its own process (``gpu_fit.py``): a 406 M-parameter
   GPT-2-medium-shaped GPT, bf16-mixed, 4 x 512 tokens, 40 steps, against ``strategy="auto"`` with fused AdamW:
   step time (median, mean, syncs included), peak GPU memory, sync time, host reads per sync, last loss.
7. ``memory``: resident bytes of fused AdamW, ``"lordo"`` and ``"lordo_lean"`` on the 406 M model counted from the
   storages (``memory.py``), checked against ``torch.cuda.memory_allocated``, and a sync's transient.

``--cpu`` runs the same on the CPU (smaller speed and step sets, 3 speed repeats, a tiny GPT in the fits: about
2 minutes on 2 cores, the speed section most of it). Writes ``results/gpu_check.json`` (or ``gpu_check-cpu.json``)
with the provenance, prints the tables, and exits non-zero if any check failed. Usage:
``python benchmarks/gpu_check.py [--cpu]``

GPU runtime, estimated: optimizer ~30 s, fit ~20 s, synchronizer ~30 s (two spawned processes), speed ~20 s, step
~40 s (creating the 1.5 B Llama-shaped set and its AdamW state dominates), lightning 6 processes x (~20 s start-up:
imports, CUDA, model init + 40 steps x ~0.1 s + syncs) ~ 2.5-3 min, memory ~30 s: about 5.5 minutes in all.
"""

from __future__ import annotations

import json
import math
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
from counts import tensors_in
from gpu_fit import check_lightning
from gpu_resume import check_resume
from harness import ROOT, provenance
from memory import check as check_memory
from speed import LAYOUTS
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import LEAN_KNOBS, OPTIMIZER_DEFAULTS, SyncConfig
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
    # float32 error feedback: "auto" would keep it in bfloat16 on the GPU and float32 on the CPU reference
    opt = cls(params, lr=0.02, rank=8, error_feedback=True, foreach=foreach, **{"ef_dtype": "float32", **knobs})
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


class _Devices(L.Callback):
    """The parameters' devices during training (after fit, Lightning's teardown has moved them to the CPU)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen.update(p.device.type for p in pl_module.parameters())


def check_fit(device: torch.device) -> dict[str, Any]:
    module = GPTLightningModule(d_model=64, n_layers=2, n_heads=4, seq_len=64, lr=3e-3, warmup_steps=4,
                                total_steps=48)
    data = ByteDataModule(seq_len=64, batch_size=8, train_samples=48 * 8, val_batches=4)
    devices = _Devices()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(strategy="lordo", accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                            precision="bf16-mixed", max_steps=48, val_check_interval=24, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                            callbacks=[devices])
        trainer.fit(module, datamodule=data)
    losses = trainer.callback_metrics
    finite = all(torch.isfinite(p).all() for p in module.parameters())
    on_device = devices.seen == {device.type} and trainer.strategy.root_device.type == device.type
    return {"val_loss": float(losses["val_loss"]), "syncs": len(trainer.strategy.sync_reports),
            "devices_during_training": sorted(devices.seen), "root_device": str(trainer.strategy.root_device),
            "ok": finite and on_device and float(losses["val_loss"]) < 5.0}


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


def check_speed(device: torch.device, layers: int, repeats: int = 10) -> dict[str, Any]:
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
        for _ in range(repeats):
            for kind, opt in optimizers.items():
                times[kind].append(_timed(opt.step, device, 1))
        ms = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"rank": rank, **{f"{k}_ms": v for k, v in ms.items()},
                     "lordo_over_fused": ms["lordo"] / ms["adamw_fused"],
                     "lordo_over_foreach": ms["lordo"] / ms["adamw_foreach"]})
        del optimizers
    return {"layers": layers, "rows": rows, "ok": True}


#: The step section's fp32 sets: (family, layers, d, FFN, vocabulary, the GPT-2s' context or the Llama's key/value
#: width: 8 of 32 heads of 64). GPT-2: fused qkv, head tied to the token embedding; Llama (3.2-1B-like, its head
#: untied): q, k, v, o, gate, up, down, RMSNorm weights. With --cpu: d, FFN, vocabulary and the last / 8, 2 layers.
STEP_SETS = {"GPT-2-124M": ("gpt2", 12, 768, 3072, 50257, 1024), "GPT-2-355M": ("gpt2", 24, 1024, 4096, 50257, 1024),
             "Llama-1B": ("llama", 16, 2048, 8192, 128256, 512)}
STEP_KINDS = ("adamw_fused", "adamw_foreach", "lordo", "lordo_lean")
#: ``LoRDO(layout="compiled")`` on the first set only: each stack shape compiles (seconds), the device's time is short.
COMPILED_SET = "GPT-2-124M"


def _shapes(family: str, layers: int, d: int, ffn: int, vocab: int, extra: int) -> list[tuple[int, ...]]:
    """A set's shapes, the two that take AdamW first (embeddings: token and position, or token and head)."""
    if family == "gpt2":
        block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (ffn, d), (ffn,), (d, ffn), (d,)]
        return [(vocab, d), (extra, d)] + block * layers + [(d,), (d,)]
    block = [(d,), (d, d), (extra, d), (extra, d), (d, d), (d,), (ffn, d), (ffn, d), (d, ffn)]
    return [(vocab, d), (vocab, d)] + block * layers + [(d,)]


class _Ops(TorchDispatchMode):
    """Dispatched ops but those on step counters alone (0-d host tensors: torch's foreach AdamW reads each
    parameter's on the host, which launches no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = tensors_in([args, kwargs or {}])  # in a foreach op's lists too
        self.ops += not tensors or not all(t.device.type == "cpu" and t.dim() == 0 for t in tensors)
        return func(*args, **(kwargs or {}))


def check_step(device: torch.device, cpu: bool) -> dict[str, Any]:
    rows = []
    for name, (family, layers, d, ffn, vocab, extra) in STEP_SETS.items():
        if cpu:
            layers, d, ffn, vocab, extra = 2, d // 8, ffn // 8, vocab // 8, extra // 8
        shapes = _shapes(family, layers, d, ffn, vocab, extra)
        row: dict[str, Any] = {"set": name + (" / 8, 2 layers" if cpu else ""),
                               "params_m": sum(math.prod(s) for s in shapes) / 1e6, "finite": True}
        kinds = STEP_KINDS + (("lordo_compiled",) if name == COMPILED_SET else ())
        for kind in kinds:
            generator = torch.Generator(device).manual_seed(0)
            params = [nn.Parameter(torch.randn(s, device=device, generator=generator) * 0.02) for s in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
            if kind.startswith("adamw"):
                opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3, **{kind.split("_")[1]: True})
            else:  # the embeddings (and the Llama's head) take AdamW, as the plugin's full_rank_params gives
                opt = LoRDO(params, lr=1e-3, full_rank=params[:2], **(LEAN_KNOBS if kind == "lordo_lean" else {}),
                            **({"layout": "compiled"} if kind == "lordo_compiled" else {}))
            for _ in range(2):  # state created (and, compiled, the stacks' kernels)
                opt.step()
            with _Ops() as counter:
                opt.step()
            row[f"{kind}_ops"] = counter.ops
            row[f"{kind}_ms"] = _timed(opt.step, device, 5 if cpu else 20)
            row["finite"] = row["finite"] and all(bool(torch.isfinite(p).all()) for p in params)
            del opt, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row.update({f"{k}_over_fused": row[f"{k}_ms"] / row["adamw_fused_ms"] for k in kinds[1:]})
        rows.append(row)
    return {"rank": OPTIMIZER_DEFAULTS["rank"], "rows": rows, "ok": all(r["finite"] for r in rows)}


def _table(title: str, columns: list[tuple[str, str, str]], rows: list[dict[str, Any]]) -> None:
    """Prints ``rows`` under ``columns`` (header, key, format); a missing value is ``-``."""
    cells = [[h for h, _, _ in columns]]
    cells += [["-" if r.get(k) is None else f.format(r[k]) for _, k, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    print(title)
    for line in cells:
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))))


def print_tables(results: dict[str, Any], cpu: bool) -> None:
    ms = "{:.2f}"
    _table("speed: optimizer step, GPT-2-small shapes (ms)",
           [("rank", "rank", "{}"), ("lordo", "lordo_ms", ms), ("in place", "lordo_in_place_ms", ms),
            ("stacked", "lordo_stacked_ms", ms), ("fused AdamW", "adamw_fused_ms", ms),
            ("foreach AdamW", "adamw_foreach_ms", ms), ("lordo/fused", "lordo_over_fused", "{:.2f}x"),
            ("lordo/foreach", "lordo_over_foreach", "{:.2f}x")], results["speed"].get("rows", []))
    _table(f"step: optimizer step, fp32 sets (median ms; LoRDO rank {results['step'].get('rank')}), ops per step "
           "(not on step counters)",
           [("set", "set", "{}"), ("params M", "params_m", "{:.1f}"), ("fused", "adamw_fused_ms", ms),
            ("foreach", "adamw_foreach_ms", ms), ("lordo", "lordo_ms", ms), ("lean", "lordo_lean_ms", ms),
            ("compiled", "lordo_compiled_ms", ms), ("lordo/fused", "lordo_over_fused", "{:.2f}x"),
            ("lean/fused", "lordo_lean_over_fused", "{:.2f}x"), ("compiled/fused", "lordo_compiled_over_fused",
                                                                 "{:.2f}x"),
            ("ops fused", "adamw_fused_ops", "{}"), ("foreach", "adamw_foreach_ops", "{}"),
            ("lordo", "lordo_ops", "{}"), ("lean", "lordo_lean_ops", "{}")], results["step"].get("rows", []))
    fits = list(results["lightning"].get("fits", {}).values())
    memory = "peak RSS MiB" if cpu else "peak GPU MiB"
    _table("lightning: one fit per process (step ms after 2 warm-up steps; sync: ms over the median step, and as "
           "the SyncReport says)",
           [("strategy", "label", "{}"), ("median", "step_ms_median", ms), ("mean", "step_ms_mean", ms),
            ("mean/auto", "step_mean_over_auto", "{:.2f}x"), (memory, results["lightning"].get("memory", ""),
                                                               "{:.0f}"),
            ("mem/auto", "peak_memory_over_auto", "{:.2f}x"), ("syncs", "syncs", "{}"),
            ("sync ms", "sync_ms_excess_mean", "{:.1f}"), ("reported", "sync_ms_reported_mean", "{:.1f}"),
            ("reads/sync", "host_reads_per_sync", "{:.0f}"), ("last loss", "loss_last", "{:.3f}"),
            ("ok", "ok", "{}")], fits)
    for row in fits:
        if row.get("error"):
            print(f"  {row['label']}: {row['error']}")


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
        "speed": lambda: check_speed(device, *((2, 3) if cpu else (12, 10))), "step": lambda: check_step(device, cpu),
        "lightning": lambda: check_lightning(cpu), "memory": lambda: check_memory(device, small=cpu),
        "resume": lambda: check_resume(device)}
    path = ROOT / "results" / ("gpu_check-cpu.json" if cpu else "gpu_check.json")
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - every check reports, whatever the others do
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']:.0f} s)", flush=True)
        if "error" in results[name]:
            print(results[name]["error"], flush=True)
        path.write_text(json.dumps(results, indent=2))  # after each section: a run cut short keeps what it measured
    print_tables(results, cpu)
    return 0 if all(results[name]["ok"] for name in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
