"""A LoRDO checkpoint for a run without the plugin's strategy (``strategy="ddp"``, one device, FSDP, ...).

A LoRDO checkpoint's ``optimizer_states`` hold low-rank moments (``r x n`` with a basis), which torch's Adam/AdamW
cannot use: resumed as they are, the first optimizer step fails with a shape mismatch. Two ways to convert:

* ``Trainer(strategy="ddp", callbacks=[ConvertLoRDOCheckpoint()])`` converts while Lightning loads the checkpoint
  (``on_load_checkpoint`` runs before the optimizer state is restored), with one warning saying what was reset;
* ``python -m lightning_lordo.lightning.export lordo.ckpt ddp.ckpt`` writes a converted file that any strategy
  resumes, no plugin needed.

What it does: each low-rank matrix's moments are expanded through its basis into AdamW moments (the first moment
exactly, ``Q u``; the second ``(Q o Q) v`` floored at its mean, as when a matrix becomes full-rank on a resume);
the full-rank parameters keep their Adam moments; the step counts, learning rates and LR schedulers are kept.
Reset (there is nothing in DDP to hold them): the error-feedback buffers, the outer (Nesterov) momentum, the
payload's error feedback, the other ranks' own state and, for a checkpoint written mid-round, each worker's
progress since the last sync (the model saved is the synchronized one, which DDP resumes from). The LoRDO-only
knobs leave the param groups, so torch's Adam/AdamW fill in their own defaults.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_lordo.lightning.checkpoint import AtomicCheckpointIO
from lightning_lordo.lightning.resume import LORDO_KNOBS, is_lordo_state
from lightning_lordo.lightning.shards import load_full
from lightning_lordo.optim.conversion import adamw_entry


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
    notes, expanded, dropped_ef = [], 0, 0
    for i, saved in enumerate(states):
        if is_lordo_state(saved):
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
        in_flight = [r["overlap"]["step"] for r in ranks if "overlap" in r]
        if in_flight:
            reset.append(f"the overlapped round in flight (launched at optimizer step {in_flight[0]})")
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
    state, expanded, dropped_ef = {}, 0, 0
    for index, entry in saved["state"].items():
        name = names[index] if index < len(names) else ""
        if name not in model:
            raise ValueError(f"The checkpoint's optimizer state {index} belongs to parameter {name!r}, which is not in "
                             "its state_dict: the checkpoint is inconsistent. Resume it with strategy='lordo'.")
        state[index], was_lowrank = adamw_entry(entry, model[name])
        expanded += was_lowrank
        dropped_ef += "error_feedback" in entry
    # torch-only keys (fused, foreach, capturable, amsgrad, maximize) were not kept by LoRDO: the torch optimizer
    # that loads these groups fills in its class's defaults for them
    groups = [{k: v for k, v in g.items() if k not in LORDO_KNOBS} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}, (expanded, dropped_ef)


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
        if notes and trainer.is_global_zero:
            warnings.warn(f"Converted a LoRDO checkpoint for {type(trainer.strategy).__name__}: " + "; ".join(notes)
                          + ".", UserWarning, stacklevel=2)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_lordo.lightning.export",
                                     description="Convert a LoRDO checkpoint for a run without the LoRDO strategy.")
    parser.add_argument("source", help="a checkpoint written under strategy='lordo' (or 'diloco', 'lowrank_ddp')")
    parser.add_argument("target", help="where to write the converted checkpoint (written atomically)")
    args = parser.parse_args(argv)
    if Path(args.source).resolve() == Path(args.target).resolve():
        parser.error(f"target {args.target!r} is the source: write the converted checkpoint to another path")
    try:
        checkpoint = load_full(args.source)  # with every rank's shard, if it has them
    except FileNotFoundError as err:  # a copy without its shards: the conversion keeps none of their state
        if not Path(args.source).is_file():
            parser.error(f"{args.source!r}: no such file")
        print(f"note: {err}", file=sys.stderr)
        checkpoint = torch.load(args.source, map_location="cpu", weights_only=True)
    notes = to_torch_checkpoint(checkpoint)
    if not notes:
        parser.error(f"{args.source!r} holds no LoRDO state: any strategy resumes it as it is")
    AtomicCheckpointIO().save_checkpoint(checkpoint, args.target)
    print(f"wrote {args.target}: " + "; ".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
