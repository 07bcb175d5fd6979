"""What a LoRDO checkpoint leaves behind when another strategy resumes it ("ddp", one device; FSDP untried).

A LoRDO checkpoint's ``optimizer_states`` entry is in torch AdamW's shape (``checkpoint.adamw_entry``): any
strategy resumes it with the user's AdamW, no callback and no plugin needed. LoRDO's own optimizer state (bases,
low-rank moments, error feedback) is under ``checkpoint["lordo"]`` (rank 0's shard with ``checkpoint_shards``).
What this module adds:

* ``Trainer(strategy="ddp", callbacks=[ConvertLoRDOCheckpoint()])`` warns once with what the resume leaves behind;
* ``lordo-export lordo.ckpt ddp.ckpt`` writes a file without the LoRDO state (smaller);
* both convert a checkpoint whose optimizer entry is LoRDO's own (the earlier format).

The AdamW moments: each low-rank matrix's expanded through its basis (the first moment exactly, ``Q u``; the second
``(Q o Q) v`` floored at its mean, as when a matrix becomes full-rank on a resume); the full-rank parameters' as they
are; the step counts, learning rates and LR schedulers kept. Left behind (there is nothing in DDP to hold them): the
bases, the error-feedback buffers, the outer (Nesterov) momentum, the payload's error feedback, the other ranks' own
state and, for a checkpoint written mid-round, each worker's progress since the last sync and an overlapped round in
flight (the model saved is the synchronized one, which DDP resumes from). The LoRDO-only knobs are not in the param
groups, so torch's Adam/AdamW fill in their own defaults.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_lordo.lightning.checkpoint_io import AtomicCheckpointIO, describe
from lightning_lordo.lightning.shards import with_shards
from lightning_lordo.lightning.user_warnings import PluginWarnings
from lightning_lordo.optim.conversion import adamw_state_dict
from lightning_lordo.optim.loading import LORDO_KNOBS, is_lordo_state


def to_torch_checkpoint(checkpoint: dict[str, Any]) -> list[str]:
    """Convert a LoRDO checkpoint (a dict, as Lightning loads it) in place for torch's Adam/AdamW; returns what was
    converted and reset, empty for a checkpoint without LoRDO state (left as it is)."""
    lordo = checkpoint.get("lordo")
    states = checkpoint.get("optimizer_states", [])
    if lordo is None and not any(is_lordo_state(s) for s in states):
        return []
    layout = (lordo or {}).get("layout")
    if layout is None and any(is_lordo_state(s) for s in states):
        raise ValueError("This LoRDO checkpoint has no parameter layout (checkpoint['lordo']['layout']), written by "
                         "a version before 0.1.0: its low-rank moments cannot be matched to parameters. Resume it with "
                         "strategy='lordo' and save it again.")
    left_out = (lordo or {}).get("optimizer_entry", {})  # what the save left out of its AdamW-shaped entry
    notes, expanded, dropped_ef = [], left_out.get("expanded", 0), left_out.get("error_feedback", 0)
    for i, saved in enumerate(states):
        if is_lordo_state(saved):  # a checkpoint whose optimizer entry is LoRDO's own (the earlier format)
            states[i], counts = _adamw_state_dict(saved, layout["param_names"], checkpoint["state_dict"])
            expanded, dropped_ef = expanded + counts[0], dropped_ef + counts[1]
    if expanded:
        notes.append(f"the moments of {expanded} low-rank matrices were expanded through their bases into AdamW "
                     "moments")
    reset = [f"{dropped_ef} error-feedback buffers"] if dropped_ef else []
    if lordo is not None:
        sync = lordo["sync"]
        if _has_tensors(sync.get("outer")):
            reset.append("the outer Nesterov momentum")
        if sync["steps_since_sync"] > 0:
            reset.append(f"each worker's {sync['steps_since_sync']} local steps since the last sync (the "
                         "synchronized model is resumed)")
        ranks = [r for r in lordo.get("ranks") or [] if r is not None]
        if lordo.get("in_flight") is not None:  # its copies are in the shards
            reset.append(f"the overlapped round in flight (launched at optimizer step {lordo['in_flight']})")
        if any(_has_tensors(r.get("payload")) for r in ranks):
            reset.append("the payload's error feedback")
        elif "shards" in lordo and not ranks:  # the per-rank shards were not read (see shards.load_full)
            reset.append("the per-rank shards' state (the payload's error feedback, if any)")
        if lordo.get("world_size", 1) > 1:
            reset.append(f"the optimizer state of ranks 1..{lordo['world_size'] - 1} (every rank starts from rank 0's)")
        reset.append("the communication totals")
        del checkpoint["lordo"]
    if reset:
        notes.append("reset: " + ", ".join(reset))
    return notes


def _adamw_state_dict(saved: dict[str, Any], names: list[str],
                      model: dict[str, torch.Tensor]) -> tuple[dict[str, Any], tuple[int, int]]:
    """The state dict for torch's AdamW (the parameters found by their names, in the groups' order), and how many
    low-rank matrices were expanded and error-feedback buffers dropped."""
    positions = [i for g in saved["param_groups"] for i in g["params"]]
    unknown = [n for n in (names[:len(positions)] + [""] * (len(positions) - len(names))) if n not in model]
    if unknown:
        raise ValueError(f"The checkpoint's optimizer state belongs to parameter {unknown[0]!r}, which is not in its "
                         "state_dict: the checkpoint is inconsistent. Resume it with strategy='lordo'.")
    entries = [saved["state"].get(i, {}) for i in positions]
    counts = (sum("basis" in e for e in entries), sum("error_feedback" in e for e in entries))
    return adamw_state_dict(saved, [model[n] for n in names[:len(positions)]], LORDO_KNOBS), counts


def _has_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensors(v) for v in obj)
    return False


class ConvertLoRDOCheckpoint(Callback):
    """Resume a LoRDO checkpoint with another strategy (``"ddp"``, one device, ...): converts its optimizer state
    for torch's Adam/AdamW as Lightning loads it and warns once (rank 0) with what was reset. Under a LoRDO
    strategy it does nothing (LoRDO resumes its own checkpoints)."""

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        from lightning_lordo.lightning.strategy import LoRDOStrategy

        if isinstance(trainer.strategy, LoRDOStrategy):
            return
        notes = to_torch_checkpoint(checkpoint)
        if notes:  # through the strategy's own gate: once, on rank 0, at the user's line (trainer.fit)
            with PluginWarnings(lambda: trainer.global_rank):
                warnings.warn(f"Converted a LoRDO checkpoint for {type(trainer.strategy).__name__}: "
                              + "; ".join(notes) + ".", UserWarning, stacklevel=2)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lordo-export",
                                     description="Convert a LoRDO checkpoint for a run without the LoRDO strategy.")
    parser.add_argument("source", help="a checkpoint written under strategy='lordo' (or 'diloco', 'lowrank_ddp')")
    parser.add_argument("target", help="where to write the converted checkpoint (written atomically)")
    parser.add_argument("--force", action="store_true", help="replace target if it exists")
    args = parser.parse_args(argv)
    _check_paths(parser, Path(args.source), Path(args.target), args.force)
    try:
        checkpoint = AtomicCheckpointIO().load_checkpoint(args.source)
    except Exception as err:  # torch's unpickler fails on bytes that are no checkpoint in many ways
        parser.error(f"source {args.source!r} cannot be read as a checkpoint ({describe(err.__cause__ or err)}): "
                     "pass a checkpoint file that Lightning wrote")
    try:
        checkpoint = with_shards(args.source, checkpoint)  # every rank's shard, if it has them
    except FileNotFoundError as err:  # a copy without its shards: the conversion keeps none of their state
        print(f"note: {err}", file=sys.stderr)
    except (OSError, ValueError) as err:  # a corrupt or swapped shard: its error names it and the fix
        parser.error(str(err))
    notes = to_torch_checkpoint(checkpoint)
    if not notes:
        parser.error(f"{args.source!r} holds no LoRDO state: any strategy resumes it as it is")
    AtomicCheckpointIO().save_checkpoint(checkpoint, args.target)
    print(f"wrote {args.target}: " + "; ".join(notes))
    return 0


def _check_paths(parser: argparse.ArgumentParser, source: Path, target: Path, force: bool) -> None:
    """Refuse, naming the argument and the fix, before anything is read or written: a source that is not a file
    (or is one rank's shard), a target that is the source, a directory, or an existing file without ``--force``."""
    if not source.exists():
        parser.error(f"source {str(source)!r}: no such file")
    if source.is_dir():
        parser.error(f"source {str(source)!r} is a directory: pass the checkpoint file (a sharded checkpoint's "
                     "folder, <file>.lordo-<id>, sits beside it and is read with it)")
    if ".lordo-" in source.parent.name and source.name.startswith("rank-"):
        parser.error(f"source {str(source)!r} is one rank's shard: pass the checkpoint file it belongs to, "
                     f"{str(source.parent.parent / source.parent.name.rsplit('.lordo-', 1)[0])!r}")
    if source.resolve() == target.resolve():
        parser.error(f"target {str(target)!r} is the source: write the converted checkpoint to another path")
    if target.is_dir():
        parser.error(f"target {str(target)!r} is a directory: name the file to write, e.g. "
                     f"{str(target / 'ddp.ckpt')!r}")
    if target.exists() and not force:
        parser.error(f"target {str(target)!r} exists: pass --force to replace it, or name another file")

if __name__ == "__main__":
    sys.exit(main())
