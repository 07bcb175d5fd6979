"""One Lightning fit of a GPT, for the ``lightning`` section of ``benchmarks/gpu_check.py`` (one process per strategy,
so that no fit inherits another's allocator, compiled kernels or process group). Prints one JSON line, the last
line of its standard output.

On the GPU: a GPT-2-medium-shaped model (:class:`~lightning_lordo.models.CharGPT`: 24 layers, d_model 1024, 16 heads,
vocabulary 50257, context 512, untied output head: 406 M parameters), ``precision="bf16-mixed"``, batches of 4 x 512
tokens, 40 steps, ``sync_every`` at its default. With ``--cpu``: a tiny GPT (2 layers, d 64, vocabulary 256, context
64), batches of 2, 6 steps, ``sync_every=4`` (a sync at step 4 and the final one at step 6), precision 32.

The data: a pool of random token windows (8 on the GPU, 4 with ``--cpu``) cycled, so the model can memorize them and
the loss falls. The optimizer the module returns is torch's AdamW with ``fused=True``: what ``strategy="auto"`` runs,
and what the LoRDO strategies convert (their full-rank parameters keep the fused AdamW).

Measured per training batch by a callback, the device synchronized at both ends (on the GPU): the batch's time
(forward, backward, optimizer step and, at the steps that synchronize, the sync); which batches synchronized (a
:class:`~lightning_lordo.sync.report.SyncReport` appeared); the loss; the parameters' device during training. Host
reads in the synchronizer's calls: on the GPU the synchronizing CUDA operations (``torch.cuda.set_sync_debug_mode``),
on the CPU the scalar reads dispatched (``.item()``, ``is_nonzero``, ``equal``; the dispatch mode that counts them
slows the CPU's syncs down, the GPU's sync debug mode does not).

:func:`check_lightning` (imported by ``gpu_check.py``) runs every fit of :data:`FITS`, each in its own process.

Usage: ``python benchmarks/gpu_fit.py --strategy {auto,lordo,lordo_lean,lordo_compressed,...} [--anchor-device cpu]
[--fullrank-state factored] [--cpu]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

from lightning_lordo import CommunicationMonitor, LoRDOStrategy
from lightning_lordo.models import GPTLightningModule
from lightning_lordo.strategy_knobs import PRESETS

#: The fit's sizes: the GPT's, the batch, the steps, the learning rate, precision, sync_every (None: the default).
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"model": {"vocab_size": 50257, "d_model": 1024, "n_layers": 24, "n_heads": 16, "seq_len": 512,
                      "tie_weights": False}, "batch": 4, "steps": 40, "lr": 3e-4, "precision": "bf16-mixed",
            "sync_every": None, "pool": 8},
    "cpu": {"model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64,
                      "tie_weights": False}, "batch": 2, "steps": 6, "lr": 3e-3, "precision": "32-true",
            "sync_every": 4, "pool": 4},
}
#: The first batches (cuBLAS set-up, optimizer state, first bases) are left out of the step-time statistics.
WARMUP = 2
READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE")


class FusedAdamWGPT(GPTLightningModule):
    """The package's GPT module, its optimizer torch's fused AdamW at a constant learning rate."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.param_groups(), lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                 fused=True)


class Windows(Dataset):
    """``length`` items cycling over a pool of ``pool`` random windows of ``seq_len + 1`` tokens."""

    def __init__(self, vocab: int, seq_len: int, pool: int, length: int) -> None:
        self.tokens = torch.randint(vocab, (pool, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        row = self.tokens[i % len(self.tokens)]
        return row[:-1], row[1:]


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += str(func).startswith(READS)
        return func(*args, **(kwargs or {}))


class StepRecorder(L.Callback):
    """Times each training batch, notes the batches that synchronized, the losses and the parameters' devices, and
    counts the host reads in the synchronizer's calls (``on_optimizer_step``, ``finish``)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.times: list[float] = []
        self.sync_batches: list[int] = []
        self.losses: list[Tensor] = []
        self.devices: set[str] = set()
        self.reads_in_syncs = 0  # in the calls that returned a sync's report
        self.reads_between = 0  # in the calls that did not synchronize
        self._start, self._reports = 0.0, 0

    @staticmethod
    def _count(trainer: L.Trainer) -> int:
        return len(getattr(trainer.strategy, "sync_reports", []))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronizer = getattr(trainer.strategy, "synchronizer", None)
        if synchronizer is not None:
            for name in ("on_optimizer_step", "finish"):
                setattr(synchronizer, name, self._counted(getattr(synchronizer, name)))

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        out = fn(*args, **kwargs)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                reads = sum("synchronizing" in str(w.message) for w in caught)
                for w in caught:  # the others go on to the strategy's warnings
                    if "synchronizing" not in str(w.message):
                        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            else:
                with _ScalarReads() as counter:
                    out = fn(*args, **kwargs)
                reads = counter.count
            if out:  # a report, or finish()'s non-empty list
                self.reads_in_syncs += reads
            else:
                self.reads_between += reads
            return out
        return wrapper

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._reports = self._count(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        if self._count(trainer) > self._reports:
            self.sync_batches.append(len(self.times) - 1)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach())
        self.devices.update(p.device.type for p in pl_module.parameters())


def _peak_rss_mib() -> float | None:
    """This process's peak resident memory (VmHWM: ``ru_maxrss`` would keep the parent's across fork and exec)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(match.group(1)) / 2**10 if match else None


def make_strategy(name: str, anchor_device: str | None, sync_every: int | None, fullrank_state: str | None = None
                  ) -> Any:
    """``"auto"``, or the registered preset ``name`` as a :class:`LoRDOStrategy` with the extra knobs."""
    if name == "auto":
        if anchor_device or fullrank_state:
            raise SystemExit("--anchor-device and --fullrank-state need a LoRDO strategy")
        return "auto"
    knobs: dict[str, Any] = {"optimizer": {"fullrank_state": fullrank_state}} if fullrank_state else {}
    if anchor_device:
        knobs["anchor_device"] = anchor_device
    if sync_every:
        knobs["sync_every"] = sync_every
    return LoRDOStrategy(preset=name, **knobs)


def fit(name: str, anchor_device: str | None, cpu: bool, fullrank_state: str | None = None) -> dict[str, Any]:
    size = SIZES["cpu" if cpu else "gpu"]
    cuda = not cpu
    torch.manual_seed(0)
    module = FusedAdamWGPT(**size["model"], lr=size["lr"], lr_schedule="constant")
    data = DataLoader(Windows(size["model"]["vocab_size"], size["model"]["seq_len"], size["pool"],
                              size["batch"] * size["steps"]), batch_size=size["batch"])
    strategy = make_strategy(name, anchor_device, size["sync_every"], fullrank_state)
    recorder = StepRecorder(cuda)
    # the monitor the strategy would add, without its table at the end of fit (it would print on standard output)
    callbacks = [recorder] + ([CommunicationMonitor(summary=False)] if name != "auto" else [])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu" if cpu else "gpu", devices=1, strategy=strategy,
                            precision=size["precision"], max_steps=size["steps"], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=tmp)
        trainer.fit(module, train_dataloaders=data)
    seconds = time.perf_counter() - start
    times = [t * 1e3 for t in recorder.times]
    timed = times[WARMUP:]
    median = statistics.median(timed)
    syncs = [times[i] for i in recorder.sync_batches if i >= WARMUP]
    reports = list(getattr(trainer.strategy, "sync_reports", []))
    losses = [float(x) for x in recorder.losses]
    sync_config = getattr(trainer.strategy, "sync_config", None)
    out = {
        "strategy": name, "anchor_device": anchor_device,  # None: no anchor (alone, or "auto")
        "fullrank_state": fullrank_state,
        "params": sum(p.numel() for p in module.parameters()), "precision": size["precision"],
        "batch": [size["batch"], size["model"]["seq_len"]], "steps": len(times),
        "sync_every": sync_config.sync_every if sync_config else None,
        "step_ms_median": median, "step_ms_mean": statistics.fmean(timed), "first_step_ms": times[0],
        "step_ms": times, "sync_batches": recorder.sync_batches, "syncs": len(reports),
        "sync_ms_excess_mean": statistics.fmean(s - median for s in syncs) if syncs else None,
        "sync_ms_reported_mean": statistics.fmean(r.seconds for r in reports) * 1e3 if reports else None,
        "host_reads_per_sync": recorder.reads_in_syncs / len(reports) if reports else None,
        "host_reads_between_syncs": recorder.reads_between,
        "host_reads_kind": "synchronizing CUDA ops" if cuda else "scalar reads dispatched",
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "peak_rss_mib": _peak_rss_mib(),
        "loss_first": losses[0], "loss_last": losses[-1], "devices_during_training": sorted(recorder.devices),
        "root_device": str(trainer.strategy.root_device), "fit_seconds": seconds,
    }
    expected = "cpu" if cpu else "cuda"
    # rounds: a sync every K steps and one at the end of fit; alone (one device, no anchor): a basis refresh every K
    wanted = 0 if name == "auto" else 2 if anchor_device else size["steps"] // size["sync_every"]
    out["ok"] = (len(times) == size["steps"] and math.isfinite(losses[-1]) and losses[-1] < losses[0]
                 and out["devices_during_training"] == [expected] and len(reports) >= wanted)
    return out


#: The lightning section's fits, each in a process of its own: label -> (strategy, anchor_device, fullrank_state).
#: One device runs the optimizer alone (no anchor, no rounds); an ``anchor_device`` asks for the rounds a worker of a
#: multi-device run takes (an anchor, a sync every K steps), so those fits measure a worker's costs.
FITS = {"auto (fused AdamW)": ("auto", None, None), "lordo (alone)": ("lordo", None, None),
        "lordo, rounds, anchor on the GPU": ("lordo", "param", None),
        "lordo, rounds, anchor cpu": ("lordo", "cpu", None),
        "lordo_lean (alone)": ("lordo_lean", None, None),
        "lordo_lean, rounds, anchor cpu": ("lordo_lean", "cpu", None),
        "lordo_lean, factored full-rank state (alone)": ("lordo_lean", None, "factored")}  # the memory configuration


def fit_process(strategy: str, anchor: str | None, fullrank_state: str | None, cpu: bool) -> dict[str, Any]:
    """This script in a fresh process: its JSON line (with ``error``: its exit status and standard error's tail)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--strategy", strategy,
               *(["--anchor-device", anchor] if anchor else []),
               *(["--fullrank-state", fullrank_state] if fullrank_state else []), *(["--cpu"] if cpu else [])]
    # without what an earlier fit in the parent left in its environment (its process group still holds that port)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV} | ({"OMP_NUM_THREADS": "1"} if cpu else {})
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parent, env=env)
    except subprocess.TimeoutExpired as err:
        return {"ok": False, "error": f"timed out after {err.timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"ok": False}
    if proc.returncode:
        row.update(ok=False, error=f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    return row


def check_lightning(cpu: bool) -> dict[str, Any]:
    """``gpu_check.py``'s ``lightning`` section: every fit of :data:`FITS`, one after the other, and the ratios of
    each to ``strategy="auto"``'s (step mean and median, peak memory: GPU, or with ``--cpu`` the process's RSS)."""
    if not cpu:
        torch.cuda.empty_cache()  # what this process cached, for the fits' processes
    # --cpu: two at a time on one thread each (the tiny fits' times are a smoke test there, not a measurement)
    with ThreadPoolExecutor(2 if cpu else 1) as pool:
        rows = list(pool.map(lambda args: fit_process(*args, cpu), FITS.values()))
    fits = {label: {"label": label, **row} for label, row in zip(FITS, rows)}
    base, memory = fits["auto (fused AdamW)"], "peak_rss_mib" if cpu else "peak_gpu_mib"
    for row in fits.values():
        if "step_ms_mean" in row and "step_ms_mean" in base:
            row.update(step_mean_over_auto=row["step_ms_mean"] / base["step_ms_mean"],
                       step_median_over_auto=row["step_ms_median"] / base["step_ms_median"],
                       peak_memory_over_auto=row[memory] / base[memory])
    return {"memory": memory, "fits": fits, "ok": all(r["ok"] for r in fits.values())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", required=True, choices=["auto", *PRESETS])
    parser.add_argument("--anchor-device", choices=["param", "cpu"], default=None)
    parser.add_argument("--fullrank-state", choices=["adamw", "factored"], default=None)
    parser.add_argument("--cpu", action="store_true", help="the tiny GPT on the CPU")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no GPU here: run with --cpu")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    result = fit(args.strategy, args.anchor_device, args.cpu, args.fullrank_state)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
