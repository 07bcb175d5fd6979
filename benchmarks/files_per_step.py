"""How many files of the package one training step and one synchronization pass through (issue 32's target: at most
6 each). Two CPU processes (fork) train the test suite's small regressor under a Trainer as a user runs one: a CSV
logger writing every step, a progress bar, the strategy's monitor. In each process a profiler notes the package files
whose functions run

- ``step``: in ``LightningModule.optimizer_step`` of a plain optimizer step (step 2): the LightningOptimizer
  wrapper, the strategy's hooks, the core, the synchronizer's bookkeeping and the optimizer;
- ``sync step``: the same for the step that syncs (step K); ``sync``: in the sync itself (the core's
  ``after_step`` of that step, which runs the round);
- ``batch``: from the start of batch 2 to the start of batch 3, every hook of it (the monitor, the logging,
  Lightning's per-batch SIGTERM check, which the strategy replaces with a pipelined all-reduce).

Both layouts of the step are measured: ``in_place`` (the CPU's default: the user's AdamW, converted) and ``stacked``
(the accelerators': the user's own ``LoRDO(layout="stacked")``); and Fabric's ``optimizer.step()`` (``fabric``: the
user's AdamW converted by ``Fabric(strategy="lordo")``, the same loop by hand). Prints the files on rank 0 and
writes ``--json``.

    python benchmarks/files_per_step.py --json benchmarks/results/files_per_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger

from lightning_lordo import LoRDO, LoRDOFabricStrategy, LoRDOStrategy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import provenance  # noqa: E402
from strategy_helpers import TinyRegressor, loader, lordo  # noqa: E402

PACKAGE = str(ROOT / "lightning_lordo")
K = 4
STEPS = {2: "step", K: "sync step"}  # the optimizer step (1-based) each measured batch takes


class Profiled:
    """Notes the package files whose functions run while :meth:`record` is on, per label."""

    def __init__(self) -> None:
        self.files: dict[str, set[str]] = {}
        self.current: list[str] = []

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            for label in self.current:
                self.files.setdefault(label, set()).add(frame.f_code.co_filename[len(PACKAGE) + 1:])

    @contextmanager
    def record(self, label: Optional[str]) -> Iterator[None]:
        if label is None:
            yield
            return
        self.current.append(label)
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            self.current.remove(label)
            if not self.current:
                sys.setprofile(None)


PROFILE = Profiled()


class Trace(L.Callback):
    """Batch 2, from its start to the next batch's start (this callback comes first, so every other hook of the batch
    is inside); the sync itself, in the core's ``after_step`` of step K."""

    def __init__(self, out: Path) -> None:
        self.out, self.batch = out, None

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        core = trainer.strategy.core
        after_step = core.after_step

        def traced(*a: Any, **kw: Any) -> Any:
            with PROFILE.record("sync" if trainer.global_step + 1 == K else None):
                return after_step(*a, **kw)

        core.after_step = traced

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.batch is not None:
            self.batch.__exit__(None, None, None)
            self.batch = None
        if trainer.global_step + 1 == 2:
            self.batch = PROFILE.record("batch")
            self.batch.__enter__()
        if trainer.global_step == K + 1:  # every measurement done
            found = {name: sorted(files) for name, files in PROFILE.files.items()}
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(found))


class Regressor(TinyRegressor):
    """The user's model: the optimizer steps of :data:`STEPS` are profiled. ``layout="stacked"``: it returns its own
    ``LoRDO(layout="stacked")``."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout

    def configure_optimizers(self) -> Any:
        if self.layout == "in_place":
            return super().configure_optimizers()
        return LoRDO(self.parameters(), lr=1e-2, rank=4, layout="stacked")

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        with PROFILE.record(STEPS.get(self.trainer.global_step + 1)):
            super().optimizer_step(*args, **kwargs)


def measure(layout: str, out: Path) -> dict[str, list[str]]:
    torch.manual_seed(0)
    strategy = lordo(sync_every=K) if layout == "in_place" else \
        LoRDOStrategy(sync_every=K, start_method="fork", timeout=timedelta(seconds=60))  # no knobs: the user's LoRDO
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=K + 2, logger=CSVLogger(out),
                        log_every_n_steps=1, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[Trace(out)])
    trainer.fit(Regressor(layout), loader())
    return json.loads((out / "rank0.json").read_text())


def measure_fabric(out: Path) -> dict[str, list[str]]:
    """Fabric's loop by hand: ``optimizer.step()`` of step 2 and of step K, and the core's ``after_step`` of step K."""
    def work(fabric: Fabric) -> None:
        torch.manual_seed(0)
        model = TinyRegressor()
        model, optimizer = fabric.setup(model.net, model.configure_optimizers())
        core = fabric.strategy.core
        after_step = core.after_step
        step = 0

        def traced(*a: Any, **kw: Any) -> Any:
            with PROFILE.record("sync" if step == K else None):
                return after_step(*a, **kw)

        core.after_step = traced
        for step, (x, y) in enumerate(loader(), start=1):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            with PROFILE.record(STEPS.get(step)):
                optimizer.step()
            optimizer.zero_grad()
            if step == K + 1:
                break
        found = {name: sorted(files) for name, files in PROFILE.files.items()}
        (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(found))

    strategy = LoRDOFabricStrategy(sync_every=K, start_method="fork", timeout=60, optimizer={"rank": 4})
    Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(work)
    return json.loads((out / "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"provenance": provenance("python benchmarks/files_per_step.py" +
                                                     (f" --json {args.json}" if args.json else ""))}
    for layout in ("in_place", "stacked", "fabric"):
        with tempfile.TemporaryDirectory() as tmp:
            found = measure(layout, Path(tmp)) if layout != "fabric" else measure_fabric(Path(tmp))
        results[layout] = {name: {"files": files, "count": len(files)} for name, files in found.items()}
        for name in ("step", "sync step", "sync", "batch"):
            if name not in found:
                continue
            print(f"{layout}, {name}: {len(found[name])} files: {', '.join(found[name])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
