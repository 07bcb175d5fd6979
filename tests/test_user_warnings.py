"""The plugin's warnings, as a user sees them: each one once, from global rank 0 only, at the user's own line (the
``trainer.fit`` call, the user's ``configure_optimizers``), never at a line inside ``lightning_lordo``; warnings of
the user's own code pass through unchanged, on every rank."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_helpers import TinyRegressor, loader, lordo, trainer

import lightning_lordo
from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.lightning.user_warnings import PluginWarnings
from lightning_lordo.optim import loading

PLUGIN_DIR = str(Path(lightning_lordo.__file__).resolve().parent)
NAN = float("nan")


def _recording(path: Path) -> Any:
    """A ``warnings.showwarning`` that appends each warning shown, with the process's rank, to ``path`` (forked
    workers inherit it)."""

    def record(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
               line: Any = None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else -1
        entry = {"rank": rank, "pid": os.getpid(), "message": str(message), "category": category.__name__,
                 "filename": filename, "lineno": lineno}
        with open(path, "a") as out:
            out.write(json.dumps(entry) + "\n")

    return record


def _shown(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fit_recording(path: Path, fit: L.Trainer, module: L.LightningModule, **kwargs: Any) -> int:
    """Runs ``fit`` with every warning recorded; returns the line of the ``fit`` call (the user's call site)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning shown each time: "once" must be the plugin's doing
        warnings.showwarning = _recording(path)
        line = _line() + 1
        fit.fit(module, loader(), **kwargs)
    return line


def _line() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


class EveryWarning(TinyRegressor):
    """Adam with L2 weight decay (becomes decoupled: a warning), a (24, 12) layer below rank 14 (a warning; the
    (3, 16) output head takes AdamW by the structure, silently), and a NaN
    loss on rank 1 at step 5, which makes round 2 (synchronized at step 8) non-finite (a warning)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=0.01)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if self.global_rank == 1 and self.trainer.global_step == 5 else loss


EXPECTED = ("LoRDO applies weight decay decoupled", "weight matrices are not larger than the rank",
            "the averaged pseudo-gradient is not finite")


def test_two_processes_show_each_warning_once_from_rank_zero_at_the_fit_line(tmp_path: Path) -> None:
    path = tmp_path / "shown.jsonl"
    line = _fit_recording(path, trainer(lordo(sync_every=4, rank=14), max_steps=10), EveryWarning())
    shown = _shown(path)
    ours = [w for w in shown if w["message"].startswith("LoRDO")]
    for expected in EXPECTED:
        found = [w for w in ours if expected in w["message"]]
        assert len(found) == 1, (expected, found)
        assert found[0]["rank"] == 0
        assert (found[0]["filename"], found[0]["lineno"]) == (__file__, line), found[0]
    assert len(ours) == len(EXPECTED), ours
    assert not [w for w in shown if w["filename"].startswith(PLUGIN_DIR)], shown


class OwnLoRDO(TinyRegressor):
    """Builds LoRDO itself, with rank 8 for the (3, 16) head (larger than its smaller side: LoRDO warns), and warns
    on its own too."""

    def configure_optimizers(self) -> Any:
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        head = list(self.net[5].parameters())
        rest = [p for p in self.parameters() if all(p is not h for h in head)]
        return LoRDO([{"params": rest, "rank": 4}, {"params": head, "rank": 8}], lr=1e-2)


def test_a_warning_from_the_users_configure_optimizers_points_there_once(tmp_path: Path) -> None:
    path = tmp_path / "shown.jsonl"
    own = LoRDOStrategy(sync_every=4, start_method="fork", timeout=timedelta(seconds=60))  # no optimizer knobs
    _fit_recording(path, trainer(own, max_steps=4), OwnLoRDO())
    shown = _shown(path)
    ours = [w for w in shown if w["message"].startswith("LoRDO")]
    assert len(ours) == 1 and "rank=8 is not below the smaller side (3)" in ours[0]["message"], ours
    assert ours[0]["rank"] == 0 and ours[0]["filename"] == __file__
    lines, start = inspect.getsourcelines(OwnLoRDO.configure_optimizers)
    call = start + next(i for i, text in enumerate(lines) if "return LoRDO(" in text)
    assert ours[0]["lineno"] == call, (ours[0], call)  # the LoRDO(...) call in configure_optimizers
    mine = [w for w in shown if w["message"] == "the user's own warning"]
    assert sorted(w["rank"] for w in mine) == [0, 1]  # the user's own warnings are left alone, on every rank
    assert {w["filename"] for w in mine} == {__file__}


def test_the_users_filters_still_apply(tmp_path: Path) -> None:
    path = tmp_path / "shown.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="LoRDO")
        warnings.showwarning = _recording(path)
        trainer(lordo(sync_every=4, start_method="popen"), devices=1, max_steps=4).fit(EveryWarning(), loader())
    assert not [w for w in _shown(path) if w["message"].startswith("LoRDO")]


def test_a_resume_warning_points_at_the_fit_call(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_epochs=1, save_top_k=-1)
    trainer(lordo(sync_every=4, start_method="popen"), devices=1, callbacks=[checkpoints], max_steps=6,
            enable_checkpointing=True).fit(TinyRegressor(), loader())
    path = tmp_path / "shown.jsonl"
    fit = trainer(lordo(sync_every=2, start_method="popen"), devices=1, max_steps=8)
    line = _fit_recording(path, fit, TinyRegressor(), ckpt_path=str(tmp_path / "ckpt" / "step=6.ckpt"))
    found = [w for w in _shown(path) if w["message"].startswith("LoRDO resumed a checkpoint with changes")]
    assert len(found) == 1 and "sync_every" in found[0]["message"], found
    assert (found[0]["filename"], found[0]["lineno"]) == (__file__, line)


def test_a_warning_held_back_is_shown_once_and_only_on_rank_zero(tmp_path: Path) -> None:
    for rank, expected in ((0, 1), (1, 0)):
        path = tmp_path / f"rank{rank}.jsonl"
        held = PluginWarnings(lambda rank=rank: rank)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _recording(path)
            for i in range(3):
                with held, held:  # re-entrant: shown when the outer one ends
                    loading.warn(["a note"], 0)
                    assert len(_shown(path)) == min(i, expected)
        found = _shown(path)
        assert len(found) == expected, found
        assert all(w["filename"] == __file__ for w in found)


def test_a_warning_from_python_dash_c_is_at_the_users_line() -> None:
    """Code run by ``python -c`` is the user's, though its file is ``<string>`` (only spawn's bootstrap, a
    ``<string>`` frame calling into multiprocessing, is skipped): the warning shows there, not in Lightning."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "from strategy_helpers import TinyRegressor, loader, lordo, trainer\n"
            "trainer(lordo(start_method='popen', rank=16), devices=1, max_steps=2).fit(TinyRegressor(), loader())\n")
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    shown = [line for line in done.stderr.splitlines() if "UserWarning: LoRDO" in line]
    assert shown and all(line.startswith("<string>:3: ") for line in shown), shown
