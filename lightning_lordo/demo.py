"""The main job: a small byte-level GPT trained with ``strategy="lordo"`` and with ``strategy="ddp"``.

``lordo-demo`` (or ``python -m lightning_lordo.demo``) trains the same model, from the same initial weights, on
the same data with both strategies on 2 CPU processes, evaluates both final models on the same held-out text
(cross-entropy and torchmetrics perplexity), and prints a table of quality, bytes sent per worker,
optimizer-state memory and wall time. The default corpus is English prose from the Python standard library's
own sources (no download); ``--data PATH`` trains on any text file. ``--tiny`` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torchmetrics.text import Perplexity

from lightning_lordo.lightning.callbacks import _human
from lightning_lordo.lightning.strategy import LoRDOStrategy
from lightning_lordo.models import ByteDataModule, GPTLightningModule

METHODS = ("lordo", "ddp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lordo-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=str, default=None, help="a text file to train on (default: built-in corpus)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per method (default 300)")
    parser.add_argument("--workers", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step (default 8)")
    parser.add_argument("--sync-every", type=int, default=16, help="LoRDO's K (default 16)")
    parser.add_argument("--rank", type=int, default=16, help="LoRDO's rank (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, both methods (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run with a tiny model (for CI)")
    parser.add_argument("--json", type=str, default=None, help="also write the results to this JSON file")
    return parser


def _model_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.tiny:
        return {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32}
    return {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128}


class _ResultWriter(L.Callback):
    """Rank 0 writes what only the workers know (bytes, optimizer state) to a file for the main process."""

    def __init__(self, path: Path) -> None:
        self.path, self.buckets = path, None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        optimizer = trainer.optimizers[0]
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor))
        out: dict[str, Any] = {"optimizer_state_bytes": state_bytes}
        strategy = trainer.strategy
        if isinstance(strategy, LoRDOStrategy):  # the strategy's convention: the error feedback at its peak (with
            memory = optimizer.memory_report()  # the projection it holds between folds), counted once
            out["optimizer_state_bytes"] = sum(memory[k] for k in ("lowrank_moments", "bases", "fullrank_moments",
                                                                   "error_feedback", "other"))
            out["bytes_sent"] = strategy.accountant.total_bytes
            out["bytes_by_purpose"] = dict(strategy.accountant.totals)
            out["syncs"] = strategy.synchronizer.syncs_done
            out["error_feedback_bytes"] = optimizer.memory_report()["error_feedback"]
            out["sync_buffer_bytes"] = sum(strategy.synchronizer.memory_report().values())  # the anchor, mostly
        else:  # DDP's gradient all-reduce: every trainable parameter, in its dtype, every optimizer step
            per_step = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
            out["bytes_sent"] = per_step * trainer.global_step
            if self.buckets is not None:
                out["sync_buffer_bytes"] = self.buckets
        self.path.write_text(json.dumps(out))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """DDP's gradient buckets (a copy of the gradients unless they are views), read while it still wraps."""
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ddp = model._get_ddp_logging_data()
            if not ddp.get("gradient_as_bucket_view"):
                self.buckets = sum(int(n) for n in str(ddp["bucket_sizes"]).replace(",", " ").split())


@torch.no_grad()
def evaluate(module: GPTLightningModule, datamodule: ByteDataModule) -> dict[str, float]:
    """Mean cross-entropy (nats/byte) and torchmetrics perplexity of ``module`` on the validation windows."""
    module.eval()
    perplexity = Perplexity()
    total, count = 0.0, 0
    for x, y in datamodule.val_dataloader():
        logits = module(x)
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
        perplexity.update(logits, y)
    return {"val_loss": total / count, "val_ppl": float(perplexity.compute())}


def run_method(method: str, args: argparse.Namespace, init: dict[str, torch.Tensor], workdir: Path) -> dict[str, Any]:
    """Train one method from ``init`` and return its figures."""
    L.seed_everything(args.seed, verbose=False)
    config = _model_config(args)
    module = GPTLightningModule(**config, lr=args.lr, warmup_steps=max(1, args.steps // 20), total_steps=args.steps)
    module.load_state_dict(init)
    datamodule = _datamodule(args, config["seq_len"])
    if method == "lordo":
        strategy: Any = LoRDOStrategy(sync_every=args.sync_every, start_method="fork", optimizer={"rank": args.rank},
                                      experimental={"seed": args.seed})
    else:
        strategy = "ddp_fork"
    result_file = workdir / f"{method}.json"
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.workers, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[_ResultWriter(result_file)],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)  # the main process gets rank 0's final weights back
    wall = time.perf_counter() - start
    result = json.loads(result_file.read_text())
    datamodule.setup("validate")
    result.update(evaluate(module, datamodule), wall_seconds=wall, method=method)
    return result


def _datamodule(args: argparse.Namespace, seq_len: int) -> ByteDataModule:
    samples = args.steps * args.batch_size * args.workers
    return ByteDataModule(path=args.data, seq_len=seq_len, batch_size=args.batch_size, train_samples=samples,
                          val_batches=8 if args.tiny else 64, seed=args.seed)


#: The columns of the demo's table (the terminal's and the README's, :func:`result_rows`).
COLUMNS = ("method", "val loss", "sent per worker", "DDP / this", "optimizer state",
           "of which error feedback", "sync buffers", "wall time")


def result_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells: the optimizer state includes the error-feedback buffers (LoRDO's full-size state); the
    sync buffers are held beside it (LoRDO's anchor, DDP's gradient buckets)."""
    ddp = next(r for r in results if r["method"] == "ddp")
    rows = []
    for r in results:
        saving = ddp["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else math.inf
        feedback, buffers = r.get("error_feedback_bytes", 0), r.get("sync_buffer_bytes", 0)
        rows.append([r["method"], f"{r['val_loss']:.3f}", _human(r["bytes_sent"]),
                     f"{saving:.1f}x", _human(r["optimizer_state_bytes"]), _human(feedback) if feedback else "-",
                     _human(buffers) if buffers else "-", f"{r['wall_seconds']:.1f} s"])
    return rows


def results_table(results: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    table = Table(title=f"{args.steps} steps, {args.workers} workers x {args.batch_size} sequences; LoRDO "
                        f"K={args.sync_every}, rank={args.rank}")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in result_rows(results):
        table.add_row(*row)
    return table


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "workers", "batch_size", "sync_every", "rank"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.data is not None and not Path(args.data).is_file():
        raise SystemExit(f"--data={args.data}: no such file; pass a text file, or leave --data out")
    try:  # a text too short for the model's windows
        _datamodule(args, _model_config(args)["seq_len"]).setup("fit")
    except ValueError as err:
        raise SystemExit(f"--data={args.data}: {err}; pass a longer text, or leave --data out") from None
    torch.set_num_threads(1)  # one thread per worker process: the workers share the machine's cores
    console = Console()
    L.seed_everything(args.seed, verbose=False)
    init = GPTLightningModule(**_model_config(args)).state_dict()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            console.rule(f"training with strategy={method!r}")
            results.append(run_method(method, args, init, Path(tmp)))
    console.print(results_table(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "provenance": _provenance(argv)}, indent=2))
    return 0


def _provenance(argv: Optional[list[str]]) -> dict[str, Any]:
    """The command, commit (when run from a git checkout), versions and machine of a result file."""
    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run([*git, "status", "--porcelain", "--", "lightning_lordo"], capture_output=True,
                                    text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", None
    return {"command": " ".join(["lordo-demo", *(sys.argv[1:] if argv is None else argv)]), "commit": commit,
            "uncommitted_changes": dirty, "torch": torch.__version__, "lightning": L.__version__,
            "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cores"}


if __name__ == "__main__":
    raise SystemExit(main())
