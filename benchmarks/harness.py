"""One benchmark run: a byte-level GPT trained through Lightning with M worker processes, and its figures.

A run is described by a :class:`RunSpec` (method, learning rate, seed, model and data sizes, LoRDO knobs) and
returns a plain dict: validation loss along the way and at the end, bytes sent per worker (counted by the
strategy for the LoRDO family; computed as numel x 4 per step for DDP's gradient all-reduce), optimizer and
synchronization memory, wall time, subspace movement and the term ratio. Runs are appended to a JSONL file as
they finish, so an interrupted part keeps what it measured.

Methods (SPEC §7, §10):

* ``ddp``: Lightning DDP, gradients all-reduced every step; ``optimizer="adamw"`` (torch's AdamW) or ``"qhadam"``
  (the authors' DDP baseline: LoRDO with every parameter full-rank and ``update="subspace_qh"``, i.e. QHAdam);
  ``hook="powersgd"`` / ``"fp16"``: PyTorch's communication hooks (:mod:`peers`), bytes counted at the hook.
* ``lowrank_ddp``: the plugin's ``"lowrank_ddp"`` preset (gradients averaged every step, LoRDO's low-rank moments,
  bases from the averaged gradient every ``sync_every`` steps); omega = 1 unless the knobs say otherwise.
* ``diloco``: local AdamW, parameters averaged every K steps.
* ``lordo_noqhm``: LoRDO-Global with omega = 1 (no full-rank term).
* ``lordo_local``: each worker computes its basis from its own pseudo-gradient.
* ``lordo``: the method.

A run either starts from scratch or from the weights of a warm-up checkpoint (``init_from``, the authors'
protocol: every method continues from one shared low-rank DDP checkpoint, with fresh optimizer state). Its LR
schedule (``lr_warmup``, ``lr_decay``) is warmup-stable-decay when ``schedule="wsd"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from peers import HOOKS, HookedDDP

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.comm.accounting import ddp_wire_bytes
from lightning_lordo.config import LEAN_KNOBS
from lightning_lordo.convert import track_step_calls
from lightning_lordo.models import ByteDataModule, GPTLightningModule
from lightning_lordo.strategy_knobs import strategy_kwargs
from lightning_lordo.sync.report import breakdown

METHODS = ("ddp", "lowrank_ddp", "diloco", "lordo_noqhm", "lordo_local", "lordo")
SCHEDULES = ("cosine", "wsd")
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
    # added for the authors' protocol (benchmarks/authors.py); the defaults keep the earlier parts' runs as they were
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    qh_omega: float = 0.94
    hook: str = ""
    hook_rank: int = 4
    schedule: str = "cosine"
    lr_warmup: int = 0
    lr_decay: int = 0
    init_from: str = ""
    save_to: str = ""
    data_seed: Optional[int] = None
    # added for benchmarks/compressed.py: "bytes" (a byte-level GPT) or "words" (a word-level GPT over the ``vocab``
    # most frequent words of ``data``, its tied embedding most of the parameters)
    corpus: str = "bytes"
    vocab: int = 0

    def __post_init__(self) -> None:
        if self.steps % self.val_every:  # Lightning validates every val_every steps: the last ones would be unseen
            raise ValueError(f"RunSpec: steps={self.steps} is not a multiple of val_every={self.val_every}, so the "
                             "final validation loss would be measured before the end; pick multiples.")
        if self.schedule not in SCHEDULES or self.optimizer not in ("adamw", "qhadam"):
            raise ValueError(f"RunSpec: schedule={self.schedule!r} (choose {SCHEDULES}), optimizer={self.optimizer!r} "
                             "(choose 'adamw' or 'qhadam')")
        if (self.corpus, self.vocab > 0) not in (("bytes", False), ("words", True)):
            raise ValueError(f"RunSpec: corpus={self.corpus!r}, vocab={self.vocab}: use corpus='bytes' (vocab 0) or "
                             "corpus='words' with vocab > 0")
        if self.hook and (self.hook not in HOOKS or self.method != "ddp"):
            raise ValueError(f"RunSpec: hook={self.hook!r} needs method='ddp' and one of {HOOKS}")
        self.betas = tuple(self.betas)

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.knobs.items()))
        name = self.method
        if self.hook:
            name += f"+{self.hook}" + (f"{self.hook_rank}" if self.hook == "powersgd" else "")
        if self.optimizer == "qhadam":
            name += f"+qhadam{self.qh_omega}"
        return f"{name}[{extra}]" if extra else name


def wsd(step: int, total: int, warmup: int, decay: int, floor: float = 0.1) -> float:
    """Warmup-stable-decay: linear warmup over ``warmup`` steps, 1, then cosine to ``floor`` over the last ``decay``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay and step >= total - decay:
        progress = (step - (total - decay)) / decay
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


class BenchModule(GPTLightningModule):
    """The demo's GPT with the spec's optimizer (AdamW, or QHAdam as LoRDO with every parameter full-rank) and
    LR schedule (cosine as before, or warmup-stable-decay)."""

    def __init__(self, spec: RunSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hparams.pop("spec", None)  # checkpoints stay loadable with weights_only=True
        self.spec = spec

    def configure_optimizers(self) -> Any:
        spec = self.spec
        config = super().configure_optimizers()
        adamw = config["optimizer"]
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "eps", "weight_decay", "initial_lr")}
                  for g in adamw.param_groups]
        for group in groups:
            group["betas"] = spec.betas
        if spec.optimizer == "qhadam":
            optimizer: torch.optim.Optimizer = LoRDO([{**g, "rank": 0} for g in groups], update="subspace_qh",
                                                     omega=spec.qh_omega)
        else:
            optimizer = torch.optim.AdamW(groups)
        if spec.schedule == "wsd":
            fn = functools.partial(wsd, total=spec.steps, warmup=spec.lr_warmup, decay=spec.lr_decay)
        else:
            fn = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
        track_step_calls(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WordDataModule(ByteDataModule):
    """Word-level language modelling: ``path``'s whitespace-separated words, the ``vocab - 1`` most frequent ones
    (ties by first appearance) as ids ``1..vocab-1`` and every other word as ``0``; split by position as the byte
    data is (the last ``val_fraction`` of the words is validation)."""

    def __init__(self, path: str, vocab: int, val_fraction: float = 0.1, **kwargs: Any) -> None:
        super().__init__(text=" " * 8, val_fraction=val_fraction, **kwargs)
        words = Path(path).read_text(encoding="utf-8").split()
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        ranked = sorted(counts, key=lambda w: -counts[w])[: vocab - 1]  # sorted() is stable: first appearance
        ids = {w: i + 1 for i, w in enumerate(ranked)}
        data = torch.tensor([ids.get(w, 0) for w in words], dtype=torch.int64)
        n_val = int(len(data) * val_fraction)
        self.train_data, self.val_data = data[: len(data) - n_val], data[len(data) - n_val:]


class SaveAtEnd(L.Callback):
    """Writes a checkpoint at the end of ``fit`` (every rank calls it: a save is a collective)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class Recorder(L.Callback):
    """Rank 0 writes the run's figures to ``path`` (the workers are forked: the parent cannot see them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.curve: list[dict[str, float]] = []
        self.start = time.perf_counter()
        self.train_seconds: Optional[float] = None
        self.model_since: dict[int, float] = {0: 0.0}  # synchronized step -> seconds when every rank first held it

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = time.perf_counter()  # the curve's "seconds": wall time since training began

    @staticmethod
    def _model_step(trainer: L.Trainer) -> int:
        """The optimizer step whose model validation sees: for the plugin the synchronized one (one round older
        than the replicas' average at an overlapped round's launch), for DDP the current one."""
        strategy = trainer.strategy
        return strategy.synchronizer.synchronized_step if isinstance(strategy, LoRDOStrategy) else trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.model_since.setdefault(self._model_step(trainer), time.perf_counter() - self.start)

    def _bytes(self, trainer: L.Trainer, module: L.LightningModule) -> float:
        """Payload bytes per worker of the training itself: for the plugin everything it counted but the one-time
        setup broadcast and Lightning's per-batch SIGTERM check (no method's traffic); for DDP its gradient
        all-reduce (numel x itemsize per step); for a communication hook what it handed to all_reduce."""
        strategy = trainer.strategy
        if isinstance(strategy, LoRDOStrategy):
            totals = strategy.accountant.totals
            return sum(v for k, v in totals.items() if k not in ("setup_broadcast", "lightning_sigterm_check"))
        if isinstance(strategy, HookedDDP):
            return strategy.counter.total
        per_step = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return per_step * trainer.global_step

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.train_seconds = time.perf_counter() - self.start  # the training loop alone: no launch, no setup

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        # "seconds": when this validation ended; "model_seconds": since when the model it saw existed on every rank
        # (an overlapped run validates at a launch the model of the round before, which landed tau steps after
        # that round's launch, K - tau steps before this validation)
        model_step, now = self._model_step(trainer), time.perf_counter() - self.start
        since = self.model_since.get(model_step, now)  # a resumed validation has no step of its own
        self.curve.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"]),
                           "seconds": now, "model_step": model_step, "model_seconds": since,
                           "bytes": self._bytes(trainer, module)})

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        optimizer = trainer.strategy.optimizers[0]
        out: dict[str, Any] = {"curve": self.curve, "bytes_sent": self._bytes(trainer, module),
                               "train_seconds": self.train_seconds}
        if isinstance(trainer.strategy, LoRDOStrategy):
            strategy = trainer.strategy
            out["bytes_by_purpose"] = dict(strategy.accountant.totals)
            wire = strategy.accountant.wire_totals
            out["wire_bytes"] = sum(v for k, v in wire.items()
                                    if k not in ("setup_broadcast", "lightning_sigterm_check"))
            # everything but the setup broadcast (which DDP makes too): Lightning's per-batch flags included
            out["bytes_everything"] = sum(v for k, v in strategy.accountant.totals.items() if k != "setup_broadcast")
            out["bytes_by_category"] = {}
            for report in strategy.sync_reports:
                for category, n in breakdown(report.bytes_by_part).items():
                    out["bytes_by_category"][category] = out["bytes_by_category"].get(category, 0) + n
            reports = strategy.sync_reports
            moves = [r.subspace_movement for r in reports if r.subspace_movement is not None]
            out["subspace_movement_mean"] = sum(moves) / len(moves) if moves else None
            out["sync_seconds_mean"] = sum(r.seconds for r in reports) / max(1, len(reports))
            out["basis_seconds_mean"] = sum(r.basis_seconds for r in reports) / max(1, len(reports))
            out["sync_memory"] = strategy.synchronizer.memory_report()
        else:  # every byte of DDP and of its hooks goes through a ring all-reduce
            out["wire_bytes"] = ddp_wire_bytes(out["bytes_sent"], trainer.world_size)
            out["bytes_everything"] = out["bytes_sent"]
        if isinstance(optimizer, LoRDO):
            out["optimizer_memory"] = optimizer.memory_report()
            out["diagnostics"] = optimizer.diagnostics()
        else:
            out["optimizer_memory"] = {"adamw_state": sum(t.numel() * t.element_size()
                                                          for s in optimizer.state.values() for t in s.values()
                                                          if isinstance(t, torch.Tensor))}
        self.path.write_text(json.dumps(out))


def _strategy(spec: RunSpec) -> Any:
    if spec.method == "ddp":
        return HookedDDP(spec.hook, spec.hook_rank) if spec.hook else "ddp_fork"
    presets: dict[str, dict[str, Any]] = {
        "lowrank_ddp": {"synchronous": True, "omega": 1.0},
        "diloco": {"lowrank": False},
        "lordo_noqhm": {"omega": 1.0},
        "lordo_local": {"basis_scope": "local", "average_moments": False},
        "lordo": {},
    }
    knobs = {**presets[spec.method], **spec.knobs}
    if knobs.get("lowrank", True):
        knobs.setdefault("rank", spec.rank)
        # every recorded LoRDO run is a spec over the optimizer's defaults of its day: the lean ones (the defaults
        # before the authors' protocol), pinned so that a stored spec keeps meaning what it meant
        no_term = knobs.get("update") == "subspace_qh" or knobs.get("omega") == 1.0  # no full-rank term, no input
        lean = {k: v for k, v in LEAN_KNOBS.items() if not (k == "full_rank_input" and no_term)
                and not (k == "power_iters" and knobs.get("projection") == "svd")}  # exact bases: no power steps
        knobs = {**lean, **knobs}
        # and every one of them ran before update_scale and ef_decay existed: the authors' step size, an undecayed
        # buffer (a spec that sets them, e.g. authors.py's lordo_current, runs what it sets)
        knobs = {"update_scale": 1.0, **({"ef_decay": 1.0} if knobs.get("error_feedback") else {}), **knobs}
    # the seed seeds LoRDO's bases; DiLoCo's AdamW has none (the strategy refuses a seed it would ignore)
    seed = {"seed": spec.seed} if knobs.get("lowrank", True) else {}
    return LoRDOStrategy(sync_every=spec.sync_every, start_method="fork", monitor=False,
                         **strategy_kwargs(**knobs, **seed))


def run(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec`` and return its figures (blocking; forks ``spec.workers`` processes)."""
    if spec.method not in METHODS:
        raise ValueError(f"method={spec.method!r}: choose one of {METHODS}")
    torch.set_num_threads(1)
    # one thread per worker whatever the worker count: Lightning's launcher otherwise gives a lone worker every core
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    L.seed_everything(spec.seed, verbose=False)
    module = BenchModule(
        spec, vocab_size=spec.vocab or 256, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads,
        seq_len=spec.seq_len, lr=spec.lr,
        warmup_steps=max(1, spec.steps // 20), total_steps=spec.steps,
    )
    if spec.init_from:  # the authors' protocol: the warm-up checkpoint's (synchronized) model, fresh optimizer
        module.load_state_dict(torch.load(spec.init_from, weights_only=True)["state_dict"])
    data = (WordDataModule if spec.corpus == "words" else ByteDataModule)(
                          path=spec.data, seq_len=spec.seq_len, batch_size=spec.batch_size,
                          train_samples=spec.steps * spec.batch_size * spec.workers, val_batches=spec.val_batches,
                          seed=spec.seed if spec.data_seed is None else spec.data_seed,
                          **({"vocab": spec.vocab} if spec.corpus == "words" else {}))
    strategy = _strategy(spec)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        callbacks: list[L.Callback] = [Recorder(path)]
        if isinstance(strategy, HookedDDP):
            callbacks.append(strategy.counter)
        if spec.save_to:
            callbacks.append(SaveAtEnd(spec.save_to))
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=spec.workers, max_steps=spec.steps, logger=False,
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
        # pathspecs from the repository's top (ROOT is benchmarks/, where relative ones would match nothing)
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", ":(top)lightning_lordo", ":(top)benchmarks",
                                     ":(top,exclude)benchmarks/results"],
                                    capture_output=True, text=True, cwd=ROOT).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        # a copy without its git directory (the GPU machine's): the caller names the commit it copied
        commit, dirty = os.environ.get("LORDO_COMMIT", "unknown"), "LORDO_COMMIT" not in os.environ
    return {"command": command, "commit": commit, "uncommitted_changes": dirty, "torch": torch.__version__,
            "lightning": L.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                       f"{len(os.sched_getaffinity(0))} cores, {platform.platform()}"}


def run_pending(out: Path, pending: list[RunSpec], command: str, header: dict[str, Any], resumed: bool,
                describe: Callable[[RunSpec, dict[str, Any]], str]) -> None:
    """Run ``pending`` and append each record to ``out``, after a header line (``command``'s provenance and
    ``header``: a resumed part may run another commit's code); print ``describe(spec, record)`` after each run."""
    if pending:
        append(out, {"header": provenance(command), **header, "resumed": resumed})
    for spec in pending:
        record = run(spec)
        append(out, record)
        print(describe(spec, record), flush=True)


def append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def ranked(loss: Optional[float]) -> float:
    """A loss as a sort key: a NaN (a diverged run) or a missing one ranks last, where ``min`` would otherwise keep a
    NaN that comes first (every comparison with NaN is false)."""
    return loss if loss is not None and math.isfinite(loss) else math.inf


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(records: list[dict[str, Any]], spec: RunSpec) -> Optional[dict[str, Any]]:
    """The record of ``spec`` if this part already measured it (resuming an interrupted part); a record stored
    before a field existed has that field's default."""
    key = json.loads(json.dumps(dataclasses.asdict(spec)))  # as stored: tuples become lists
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec) if f.default is not dataclasses.MISSING}
    return next((r for r in records if "spec" in r and {**defaults, **r["spec"]} == key), None)


def panels(count: int) -> tuple[Any, list[Any]]:
    """A figure of ``count`` side-by-side panels (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(6 * count, 4.2), squeeze=False)
    return fig, list(axes[0])


def finish_panels(fig: Any, axes: list[Any], xlabel: str, ylabel: str, titles: list[str], path: Path) -> None:
    """Label every panel, add the legends, and write the figure to ``path``."""
    for ax, title in zip(axes, titles):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
