"""A LoRDO checkpoint carries its format: the current one loads, a development version's (no format) and a newer
one are refused with the fix, and an older released format would be migrated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from strategy_helpers import TinyRegressor, loader, lordo, trainer

from lightning_lordo import checkpoint as checkpoint_format
from lightning_lordo.checkpoint import FORMAT, check


def test_the_format_is_checked_and_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check({"format": FORMAT, "x": 1}, "here") == {"format": FORMAT, "x": 1}
    with pytest.raises(ValueError, match=r"here was written by a development version.*before checkpoint format 1"):
        check({"x": 1}, "here")
    with pytest.raises(ValueError, match=rf"here has LoRDO checkpoint format {FORMAT + 1}, newer.*Upgrade"):
        check({"format": FORMAT + 1}, "here")
    monkeypatch.setattr(checkpoint_format, "FORMAT", FORMAT + 1)
    monkeypatch.setitem(checkpoint_format.MIGRATIONS, FORMAT, lambda s: {**s, "new": s["old"] * 2})
    assert checkpoint_format.check({"format": FORMAT, "old": 3}, "here") == {"format": FORMAT + 1, "old": 3, "new": 6}


def test_format_1_entries_take_the_common_layout() -> None:
    """Format 2 nests Fabric's synchronizer counters under ``sync``, as the Trainer's format-1 entry already had
    them (unchanged by the migration)."""
    fabric = {"format": 1, "optimizer": "LoRDO", "world_size": 2, "communication": {"totals": {}},
              "optimizer_steps": 8, "syncs_done": 2, "skipped_syncs": 0, "consecutive_skips": 0,
              "outer": {"momentum": []}, "basis_window": [], "anchor_step": 8, "synchronous": False}
    migrated = check(dict(fabric), "here")
    assert migrated == {"format": 2, "optimizer": "LoRDO", "world_size": 2, "communication": {"totals": {}},
                        "sync": {"anchor": [], "steps_since_sync": 0, "optimizer_steps": 8, "syncs_done": 2,
                                 "skipped_syncs": 0, "consecutive_skips": 0, "outer": {"momentum": []},
                                 "basis_window": [], "anchor_step": 8, "synchronous": False}}
    trainer_entry = {"format": 1, "world_size": 2, "sync": {"anchor": []}, "layout": {}, "partial": False}
    assert check(dict(trainer_entry), "here") == {**trainer_entry, "format": 2}


def test_a_trainer_checkpoint_without_its_format_is_refused_at_resume(tmp_path: Path) -> None:
    fit = trainer(lordo(sync_every=2, start_method="popen", synchronous=False), devices=1, max_steps=4)
    fit.fit(TinyRegressor(), loader())
    fit.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert saved["lordo"]["format"] == FORMAT
    saved["lordo"]["format"] = 1  # the first released format: its Trainer entry resumes as it is
    torch.save(saved, tmp_path / "a.ckpt")
    trainer(lordo(sync_every=2, start_method="popen", synchronous=False), devices=1, max_steps=6).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "a.ckpt")
    del saved["lordo"]["format"]
    torch.save(saved, tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=r"Checkpoint '.*a\.ckpt' was written by a development version"):
        trainer(lordo(sync_every=2, start_method="popen", synchronous=False), devices=1, max_steps=6).fit(
            TinyRegressor(), loader(), ckpt_path=tmp_path / "a.ckpt")


def test_the_knob_changes_of_a_resume_compare_saved_tuples_as_values(tmp_path: Path) -> None:
    """``switch_betas`` is a tuple in the config and in the saved file (torch keeps tuples), a list once a YAML or
    an older file had it: the same value is no change (it was listed as ``(0.95, 0.99) -> (0.95, 0.99)``)."""
    from lightning_lordo.config import SyncConfig

    config = SyncConfig(warmup_steps=4, switch_betas=(0.95, 0.99), sync_every=8)
    torch.save(checkpoint_format.sync_knobs(config), tmp_path / "knobs.pt")
    saved = torch.load(tmp_path / "knobs.pt", weights_only=True)
    assert checkpoint_format.sync_knob_changes(saved, config) == []
    assert checkpoint_format.sync_knob_changes({**saved, "switch_betas": [0.95, 0.99]}, config) == []
    assert checkpoint_format.sync_knob_changes(saved, SyncConfig(warmup_steps=4, switch_betas=(0.9, 0.99),
                                                                 sync_every=4)) == [
        "sync_every: 8 -> 4", "switch_betas: (0.95, 0.99) -> (0.9, 0.99)"]
    assert checkpoint_format.sync_knob_changes(None, config) == []
