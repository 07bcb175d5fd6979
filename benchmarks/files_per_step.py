"""How many files of the package one training step and one synchronization pass through (issue 32's target: at most
6 each). Two CPU processes (fork) train the test suite's small regressor; in each, a profiler notes the package files
whose functions run during one optimizer step without a sync and during the step that syncs (the sync's own files are
that step's minus the plain step's). Prints the files on rank 0 and writes ``--json``.

    python benchmarks/files_per_step.py --json benchmarks/results/files_per_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from strategy_helpers import TinyRegressor, loader, lordo  # noqa: E402

PACKAGE = str(ROOT / "lightning_lordo")
K = 4


class Trace(L.Callback):
    """Profiles optimizer step 2 (local) and step K (the sync) on every rank."""

    def __init__(self, out: Path) -> None:
        self.out, self.files, self.current = out, {}, None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            self.files.setdefault(self.current, set()).add(frame.f_code.co_filename[len(PACKAGE) + 1:])

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step + 1
        self.current = {2: "step", K: "sync step"}.get(step)
        if self.current:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        sys.setprofile(None)
        if trainer.global_step == K:
            step, synced = self.files["step"], self.files["sync step"]
            found = {"step": sorted(step), "sync": sorted(synced - step), "sync step": sorted(synced)}
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = Path("/tmp/files_per_step")
    out.mkdir(exist_ok=True)
    torch.manual_seed(0)
    L.Trainer(strategy=lordo(sync_every=K), accelerator="cpu", devices=2, max_steps=K + 1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[Trace(out)]).fit(TinyRegressor(), loader())
    found = json.loads((out / "rank0.json").read_text())
    for name in ("step", "sync", "sync step"):
        print(f"{name}: {len(found[name])} files: {', '.join(found[name])}")
    if args.json:
        Path(args.json).write_text(json.dumps({name: {"files": files, "count": len(files)}
                                               for name, files in found.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
