"""What a LoRDO checkpoint holds beyond Lightning's own keys, and how it is restored.

Lightning writes one file, from rank 0: the model (here the *synchronized* model, so plain
``Model.load_from_checkpoint`` gives a usable model) and rank 0's optimizer state. Between syncs every rank
has its own state, so the strategy gathers it to rank 0 and stores it under ``checkpoint["lordo"]``:

* ``sync``: the synchronizer's state (anchor, outer momentum, step and sync counters), identical on all ranks;
* ``world_size``;
* ``ranks``: one entry per rank, each with its local parameters (only mid-round: at a sync boundary they equal
  the anchor), its optimizer state dict and its communication totals.

Everything is tensors, numbers and strings, so ``torch.load(path, weights_only=True)`` reads it. The gather
costs rank 0 the memory of every rank's optimizer state for the duration of the save.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo.optim.lordo import LoRDO


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (containers rebuilt)."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def gather_to_rank_zero(local: Any, world_size: int, rank: int) -> Optional[list[Any]]:
    """Every rank's ``local`` on rank 0 (a list indexed by rank), ``None`` elsewhere. All ranks must call it."""
    if world_size == 1:
        return [local]
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered


def is_lordo_optimizer_state(state_dict: dict[str, Any]) -> bool:
    return all("omega" in group for group in state_dict.get("param_groups", [])) and bool(state_dict["param_groups"])


def convert_adam_state(optimizer: LoRDO, saved: dict[str, Any]) -> str:
    """Load an Adam/AdamW state dict (e.g. from a plain DDP run) into ``optimizer``.

    Full-rank parameters keep their AdamW moments (LoRDO runs the same AdamW on them); low-rank matrices start
    with fresh moments (their bases come from the first gradient). Returns a sentence saying so.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved["param_groups"]) != len(optimizer.param_groups) or len(params) != sum(
        len(g["params"]) for g in saved["param_groups"]
    ):
        raise ValueError(
            "The checkpoint's optimizer has a different number of param groups or parameters than the one "
            "configure_optimizers returns now; resume with the same configure_optimizers."
        )
    kept, reset = {}, 0
    for index, p in enumerate(params):
        entry = saved["state"].get(index)
        if entry is None:
            continue
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if optimizer.lowrank_rank(p, group):
            reset += 1
        else:
            kept[index] = {"step": torch.as_tensor(entry["step"], dtype=torch.float32).cpu(),
                           "exp_avg": entry["exp_avg"].float(), "exp_avg_sq": entry["exp_avg_sq"].float()}
    groups = []
    for current, old in zip(optimizer.param_groups, saved["param_groups"]):
        merged = {k: v for k, v in current.items() if k != "params"}
        merged.update({k: old[k] for k in ("lr", "betas", "eps", "weight_decay", "initial_lr") if k in old})
        merged["params"] = old["params"]
        groups.append(merged)
    optimizer.load_state_dict({"state": kept, "param_groups": groups})
    return (f"kept the Adam moments of {len(kept)} full-rank tensors and reset those of {reset} low-rank matrices "
            "(they start over in their new subspace)")


def reset_error_feedback(optimizer: Optimizer) -> int:
    """Zero every error-feedback buffer; returns how many there were."""
    count = 0
    for state in optimizer.state.values():
        if "error_feedback" in state:
            state["error_feedback"].zero_()
            count += 1
    return count


def warn_on_rank_zero(message: str, rank: int) -> None:
    if rank == 0:
        warnings.warn(message, stacklevel=3)

