"""Evidence at scale (issue 33): M workers on one machine, a byte-level GPT of 16 M parameters (and optionally a
GPT-2-small-shaped one), every method at equal tokens through Lightning's Trainer and the registered strategy names.

Launch: each run starts M fresh worker processes (forked from this script, which never touches CUDA), each with the
cluster environment of one single-device node (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``; ``num_nodes=M``,
``devices=1``), as ``tests/test_launch.py``'s two-node test does. With M GPUs or more, worker r sees GPU r only
(``CUDA_VISIBLE_DEVICES``) and the backend is NCCL. With fewer (one H200), every worker uses ``cuda:0`` over gloo with
CUDA tensors. What that changes from a cluster: the M workers share one GPU's compute (time-sliced, so a worker's
compute seconds are about M times a dedicated GPU's), and their collectives go through host memory and loopback TCP
(about 1 GB/s measured on this project's CPU machine) instead of NVLink or a network: bytes are exact, communication
seconds are not a cluster's. On the CPU (``--tiny``, the test) the same launch runs with M = 2 over gloo.

Methods (``METHODS``), K = 32, the registered presets' defaults: DDP with AdamW, DDP with the PowerSGD hook (rank 4),
``diloco``, ``lowrank_ddp``, ``lordo``, ``lordo_compressed``, ``lordo`` at a small rank, ``lordo_local`` (the registered
preset: ``basis_scope="local"``) and ``lordo`` with ``omega=1``. All at the user's AdamW LR; ``--sweep`` adds 0.5x and
2x (each method's best of 3 LRs; the summary says which LRs each method has). Tokens: bytes (vocabulary 256).

Every run records (``benchmarks/results/scale-<stage>.jsonl``, one line per run, with provenance): validation loss
and perplexity on the held-out file against steps and against bytes per worker (payload and wire), peak memory per
worker (``torch.cuda.max_memory_allocated``; peak RSS on the CPU) and the counted optimizer state, the training time
split into compute and communication (DDP: its communication hook blocks and is timed; LoRDO strategies: their
synchronization reports), and the replicas' agreement at the end. A finished (stage, method, lr, seed) is skipped on
a rerun: a second call continues where the first stopped. Figures (``scale_report.py``) go next to the JSONL; the
summary table with the paper's four claims is printed last.

``--dry-run``: the 16 M model on the CPU for 8 steps (K = 2) to measure its bytes, then the projected GPU wall time
from the FLOPs per step (``scale_report.py`` says what is measured, what is assumed). Usage, after
``python benchmarks/build_corpus.py --download``: ``python benchmarks/scale.py --tiny`` (CPU, ~30 s) | ``--dry-run``
(CPU, ~5 min) | ``--stage 16m`` (GPU, < 8 min) | ``--stage 124m`` (GPU, optional) [``--sweep``] [``--budget-s 480``]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import scale_report
import torch
import torch.distributed as dist
from harness import ROOT, BenchModule, Recorder, RunSpec, append, load, provenance
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from peers import AllReduceCounter
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDOStrategy
from lightning_lordo.comm.accounting import ddp_wire_bytes
from lightning_lordo.models import ByteDataModule
from lightning_lordo.strategy_knobs import PRESETS, strategy_kwargs

SYNC_EVERY = 32  # the paper's K
#: Model, data and run sizes per stage (batch_size per worker; val_batches: batches of held-out windows per
#: validation, shared out among the workers).
STAGES: dict[str, dict[str, Any]] = {
    "tiny": {"d_model": 48, "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 4, "steps": 64,
             "val_every": 32, "val_batches": 8, "workers": 2, "lr": 3e-3, "small_rank": 4},
    "16m": {"d_model": 512, "n_layers": 5, "n_heads": 8, "seq_len": 1024, "batch_size": 4, "steps": 512,
            "val_every": 128, "val_batches": 64, "workers": 4, "lr": 2e-3, "small_rank": 4},
    "124m": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "batch_size": 4, "steps": 512,
             "val_every": 128, "val_batches": 32, "workers": 4, "lr": 6e-4, "small_rank": 8},
}
#: The dry run: the stage's model on the CPU, long enough for 4 syncs; windows of 128 bytes (the model keeps its
#: context; the bytes sent do not depend on the batch) so that a step takes seconds, not tens of seconds
DRY_RUN = {"batch_size": 1, "steps": 8, "sync_every": 2, "val_every": 8, "val_batches": 1, "window": 128}
#: name -> (registered strategy name, or "ddp" for Lightning's DDPStrategy with a hook; knobs over the preset's)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {"hook": "allreduce"}), "ddp_powersgd": ("ddp", {"hook": "powersgd"}),
    "diloco": ("diloco", {}), "lowrank_ddp": ("lowrank_ddp", {}), "lordo": ("lordo", {}),
    "lordo_compressed": ("lordo_compressed", {}), "lordo_small_rank": ("lordo", {"rank": "small"}),
    "lordo_local": ("lordo_local", {}), "lordo_noqhm": ("lordo", {"omega": 1.0}),
}
LR_FACTORS, SWEEP_FACTORS = (1.0,), (1.0, 0.5, 2.0)
NOT_TRAINING = ("setup_broadcast", "lightning_sigterm_check")  # traffic no method needs (harness counts the same)


class TimedDDP(DDPStrategy):
    """Lightning's DDP with one gradient bucket and a communication hook (the plain all-reduce, or PowerSGD with error
    feedback and warm start, compressing from the third step) that blocks until its collectives are done and times
    them: with one bucket nothing overlaps the backward pass anyway. Bytes: :class:`peers.AllReduceCounter`."""

    def __init__(self, hook: str, hook_rank: int = 4, **kwargs: Any) -> None:
        super().__init__(start_method="popen", bucket_cap_mb=1024, **kwargs)
        self.hook, self.hook_rank = hook, hook_rank
        self.counter = AllReduceCounter()
        self.comm_seconds = 0.0

    def configure_ddp(self) -> None:
        super().configure_ddp()
        state, hook = None, default_hooks.allreduce_hook
        if self.hook == "powersgd":
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=self.hook_rank,
                                           start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            hook = powersgd.powerSGD_hook

        def timed(state, bucket):  # unannotated: DDP refuses any bucket annotation but dist.GradBucket
            _sync(self.root_device)  # the backward's kernels count as compute
            start = time.perf_counter()
            future = hook(state, bucket)
            future.wait()
            _sync(self.root_device)
            self.comm_seconds += time.perf_counter() - start
            return future

        self.model.register_comm_hook(state, timed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HeldOutBytes(ByteDataModule):
    """Bytes of ``train.txt`` to train on, of ``val.txt`` (held-out documents, ``build_corpus.py``) to validate on."""

    def __init__(self, corpus: str, **kwargs: Any) -> None:
        super().__init__(text=" " * 8, **kwargs)
        for part in ("train", "val"):
            raw = bytearray((Path(corpus) / f"{part}.txt").read_bytes())
            setattr(self, f"{part}_data", torch.frombuffer(raw, dtype=torch.uint8))


class ScaleRecorder(Recorder):
    """harness's :class:`Recorder` (rank 0: curve, bytes, memory reports in ``run.json``), plus wire bytes and
    perplexity per validation, cumulative bytes per step, and per worker (``rank<r>.json``): peak memory, the time
    split, and the replicas' agreement at the end."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir / "run.json")
        self.run_dir, self.val_seconds, self.step_bytes = run_dir, 0.0, []
        self._val_start = 0.0

    def _bytes(self, trainer: L.Trainer, module: L.LightningModule) -> float:
        strategy = trainer.strategy
        return strategy.counter.total if isinstance(strategy, TimedDDP) else super()._bytes(trainer, module)

    def _wire(self, trainer: L.Trainer, payload: float) -> float:
        strategy = trainer.strategy
        if isinstance(strategy, LoRDOStrategy):
            return sum(v for k, v in strategy.accountant.wire_totals.items() if k not in NOT_TRAINING)
        return ddp_wire_bytes(int(payload), trainer.world_size)  # every DDP byte goes through a ring all-reduce

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, module, *args)
        self.step_bytes.append(self._bytes(trainer, module))

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        _sync(module.device)
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_validation_end(trainer, module)
        _sync(module.device)
        self.val_seconds += time.perf_counter() - self._val_start
        if self.curve and "wire_bytes" not in self.curve[-1]:
            point = self.curve[-1]
            point.update(val_ppl=math.exp(point["val_loss"]), wire_bytes=self._wire(trainer, point["bytes"]))

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self.start  # the final sync included (it runs after on_train_end)
        strategy = trainer.strategy
        if isinstance(strategy, TimedDDP):
            comm = strategy.comm_seconds
        else:
            comm = sum(r.seconds for r in strategy.sync_reports)
        # Lightning's teardown has moved the module to the CPU: NCCL needs it back on the GPU for the check
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flat = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).to(device)
        mean = flat.clone()
        dist.all_reduce(mean)
        deviation = (flat - mean / trainer.world_size).abs().max().reshape(1)
        dist.all_reduce(deviation, op=dist.ReduceOp.MAX)
        root, usage = strategy.root_device, resource.getrusage(resource.RUSAGE_SELF)
        peak = torch.cuda.max_memory_allocated(root) if root.type == "cuda" else usage.ru_maxrss * 1024
        out = {"rank": trainer.global_rank, "train_seconds": seconds, "comm_seconds": comm,
               "val_seconds": self.val_seconds, "peak_memory_bytes": peak,
               "cpu_seconds": usage.ru_utime + usage.ru_stime,
               "memory_kind": "cuda_max_allocated" if root.type == "cuda" else "cpu_peak_rss",
               "replica_max_abs_diff": float(deviation), "digest": hashlib.sha256(flat.cpu().numpy()).hexdigest(),
               "device_name": torch.cuda.get_device_name(root) if root.type == "cuda" else "cpu",
               "backend": dist.get_backend(), "step_bytes": self.step_bytes,
               "lowrank_tensors": sum(row["step"] == "lowrank" for row in strategy.parameter_plan())
               if isinstance(strategy, LoRDOStrategy) else 0}
        (self.run_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
        super().on_fit_end(trainer, module)


def make_strategy(job: dict[str, Any]) -> Any:
    """The method's strategy: a registered name with its preset's knobs (plus the method's), or :class:`TimedDDP`."""
    common = {"process_group_backend": job["backend"]}
    if job["strategy"] == "ddp":
        return TimedDDP(job["knobs"]["hook"], timeout=timedelta(seconds=job["timeout"]), **common)
    entry = StrategyRegistry[job["strategy"]]
    # the seed seeds LoRDO's bases; DiLoCo's AdamW has none (the strategy refuses a seed it would ignore)
    preset = PRESETS[entry["init_params"]["preset"]][0] if "preset" in entry["init_params"] else {}
    seed = {"seed": job["spec"]["seed"]} if preset.get("lowrank", True) else {}
    return entry["strategy"](**entry["init_params"], **common, timeout=job["timeout"], monitor=False,
                             sync_every=job["spec"]["sync_every"], **strategy_kwargs(**job["knobs"], **seed))


def train(job: dict[str, Any]) -> None:
    spec = RunSpec(**job["spec"])
    L.seed_everything(spec.seed, verbose=False)  # every worker builds the same model
    module = BenchModule(spec, vocab_size=256, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads,
                         seq_len=spec.seq_len, lr=spec.lr, warmup_steps=max(1, spec.steps // 20),
                         total_steps=spec.steps)
    data = HeldOutBytes(job["corpus"], seq_len=job["window"], batch_size=spec.batch_size,
                        train_samples=spec.steps * spec.batch_size * spec.workers, val_batches=spec.val_batches,
                        seed=spec.seed)
    strategy = make_strategy(job)
    callbacks: list[L.Callback] = [ScaleRecorder(Path(job["run_dir"]))]
    if isinstance(strategy, TimedDDP):
        callbacks.append(strategy.counter)
    trainer = L.Trainer(strategy=strategy, accelerator="gpu" if job["gpus"] else "cpu", devices=1,
                        num_nodes=spec.workers, precision=job["precision"], max_steps=spec.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=spec.val_every, num_sanity_val_steps=0, callbacks=callbacks,
                        default_root_dir=job["run_dir"])
    trainer.fit(module, datamodule=data)


def worker(job: dict[str, Any], rank: int) -> None:
    """Node ``rank`` of ``workers`` single-device nodes (a forked process: this script never initialized CUDA)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), NODE_RANK=str(rank))
    if job["gpus"] > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank % job["gpus"])
    try:
        torch.set_num_threads(job["threads"])
        torch.set_flush_denormal(True)  # CPU arithmetic only (no effect on a GPU): subnormal residue stays cheap
        train(job)
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(job["run_dir"], f"error{rank}.txt").write_text(traceback.format_exc())
        sys.exit(1)


def changed_files() -> list[str]:
    """``git status --short`` of the package and the benchmarks: what the commit in the provenance lacks."""
    paths = [":(top)lightning_lordo", ":(top)benchmarks", ":(top,exclude)benchmarks/results"]
    try:
        return subprocess.run(["git", "status", "--short", "--", *paths], capture_output=True, text=True,
                              cwd=ROOT).stdout.splitlines()
    except OSError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunFailed(RuntimeError):
    """A run's workers failed or timed out; the message holds their errors."""


def launch(job: dict[str, Any], workers: int, timeout: float) -> dict[str, Any]:
    """Run one job in ``workers`` fresh processes, killed after ``timeout`` seconds; merge what they wrote."""
    run_dir = Path(tempfile.mkdtemp(prefix="scale-"))
    job = {**job, "run_dir": str(run_dir), "port": free_port()}
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=worker, args=(job, r)) for r in range(workers)]
    start = time.perf_counter()
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, start + timeout - time.perf_counter()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        wall = time.perf_counter() - start
        errors = [f.read_text() for f in sorted(run_dir.glob("error*.txt"))]
        if hung or errors or any(p.exitcode for p in procs):
            raise RunFailed(f"{len(hung)} worker(s) killed after {timeout:.0f} s; exit codes "
                            f"{[p.exitcode for p in procs]}" + "".join(f"\n{e}" for e in errors[:1]))
        return scale_report.merge(run_dir, workers, wall)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def key(row: dict[str, Any]) -> tuple[str, str, str, int]:
    return row["stage"], row["method"], f"{row['lr']:.4g}", row["seed"]


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=sorted(STAGES), default="16m")
    parser.add_argument("--tiny", action="store_true", help="the tiny stage (the CPU test)")
    parser.add_argument("--dry-run", action="store_true", help="the stage's model on the CPU for a few steps, "
                                                               "then the projected GPU wall time")
    parser.add_argument("--corpus", default=str(ROOT / "cache" / "scale-corpus"),
                        help="a folder with train.txt and val.txt (build_corpus.py)")
    parser.add_argument("--out", type=Path, help="JSONL (default results/scale-<stage>-{cpu,gpu,dryrun}.jsonl)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workers", type=int, help="M (default: the stage's)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the stage's)")
    parser.add_argument("--lr", type=float, help="the user's AdamW LR (default: the stage's)")
    parser.add_argument("--sweep", action="store_true", help="also 0.5x and 2x the LR: each method's best of 3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--budget-s", type=float, help="start no run that would end after this many seconds "
                                                       "(default: 480 for the 16m stage on a GPU)")
    parser.add_argument("--loopback-gbps", type=float, help="--dry-run: this gloo bus bandwidth, not measured")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run's workers are killed")
    parser.add_argument("--collective-timeout", type=float, default=120.0, help="seconds, every collective")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    call_start = time.perf_counter()
    stage = "tiny" if args.tiny else args.stage
    cfg = {**STAGES[stage], "sync_every": SYNC_EVERY, **(DRY_RUN if args.dry_run else {})}
    cfg.update({k: v for k, v in (("workers", args.workers), ("steps", args.steps), ("lr", args.lr)) if v})
    gpus = 0 if args.device == "cpu" or args.dry_run else num_cuda_devices()
    if args.device == "cuda" and not gpus:
        raise SystemExit("--device cuda: no GPU here")
    label = stage + ("-dryrun" if args.dry_run else "-gpu" if gpus else "-cpu")
    out = args.out or ROOT / "results" / f"scale-{label}.jsonl"
    budget = args.budget_s or (480.0 if stage == "16m" and gpus else None)  # the 8 minutes
    workers = cfg["workers"]
    base = {"corpus": args.corpus, "gpus": gpus, "backend": "nccl" if gpus >= workers else "gloo",
            "precision": "bf16-mixed" if gpus else "32-true", "timeout": args.collective_timeout,
            "threads": max(1, (os.cpu_count() or 1) // workers), "window": cfg.get("window", cfg["seq_len"])}
    print(f"stage {label}: {scale_report.params(cfg) / 1e6:.2f} M parameters (d {cfg['d_model']} x "
          f"{cfg['n_layers']} layers, context {cfg['seq_len']}), {workers} workers on "
          f"{f'{gpus} GPU(s)' if gpus else 'the CPU'} over {base['backend']}, {cfg['steps']} steps of "
          f"{cfg['batch_size']} x {base['window']} bytes per worker, K = {cfg['sync_every']}", flush=True)
    prov = provenance("python benchmarks/scale.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    prov["changed_files"] = changed_files()
    rows = load(out)
    finished = {key(r) for r in rows if "method" in r}
    methods = args.methods.split(",")
    failed, walls = [], []
    for factor in SWEEP_FACTORS if args.sweep else LR_FACTORS:
        for method in methods:
            lr = cfg["lr"] * factor
            if (label, method, f"{lr:.4g}", args.seed) in finished:
                print(f"  {method} lr {lr:.4g}: done before, skipped", flush=True)
                continue
            elapsed = time.perf_counter() - call_start
            if budget and walls and elapsed + max(walls) > budget:
                print(f"  budget: {elapsed:.0f} s spent of {budget:.0f}; rerun the same command to go on")
                break
            name, knobs = METHODS[method]
            knobs = {k: cfg["small_rank"] if v == "small" else v for k, v in knobs.items()}
            spec = RunSpec(method=method, lr=lr, data=args.corpus, seed=args.seed, steps=cfg["steps"],
                           workers=workers, batch_size=cfg["batch_size"], seq_len=cfg["seq_len"],
                           d_model=cfg["d_model"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"],
                           sync_every=cfg["sync_every"], rank=knobs.get("rank", 16), val_every=cfg["val_every"],
                           val_batches=cfg["val_batches"], knobs=knobs)
            job = {**base, "spec": dataclasses.asdict(spec), "strategy": name, "knobs": knobs}
            try:
                row = launch(job, workers, args.run_timeout)
            except RunFailed as err:
                failed.append(method)
                print(f"  {method} lr {lr:.4g}: FAILED: {err}", flush=True)
                continue
            walls.append(row["wall_seconds"])
            row = {"stage": label, "method": method, "lr": lr, "seed": args.seed, "strategy": name,
                   "knobs": knobs, "spec": job["spec"], "window": base["window"],
                   "params": scale_report.params(cfg), **row, "provenance": prov}
            append(out, row)
            rows.append(row)
            print(f"  {method} lr {lr:.4g}: val loss {row['final_val_loss']:.4f}, "
                  f"{row['bytes_payload'] / 1e6:.2f} MB payload, {row['wall_seconds']:.1f} s", flush=True)
    done_rows = [r for r in rows if r.get("stage") == label]
    if done_rows:
        scale_report.figures(done_rows, out)
    if args.dry_run:
        scale_report.print_projection(STAGES[stage], SYNC_EVERY, DRY_RUN, done_rows, args.loopback_gbps)
    wall = time.perf_counter() - call_start
    print(f"wall time of this call: {wall:.0f} s ({wall / 60:.1f} min)" + (f"; failed: {failed}" if failed else ""))
    scale_report.print_summary(done_rows, label, methods)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
