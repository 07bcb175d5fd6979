"""A saved optimizer state loaded into the optimizer the run has now, whatever its knobs (the Trainer's and Fabric's
resumes share it). The rule: **the knobs passed now win**; lr, betas, eps and weight decay come from the checkpoint,
as for any optimizer. Optimizer state is matched to parameters by name; a torch Adam/AdamW state loaded into LoRDO
keeps the full-rank moments and restarts the low-rank ones, a LoRDO state loaded into torch's Adam/AdamW has its
low-rank moments expanded through their bases."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo.config import OPTIMIZER_DEFAULTS
from lightning_lordo.optim.bases import REFRESH_COUNTERS
from lightning_lordo.optim.conversion import HYPER, adamw_entry, is_lordo_state
from lightning_lordo.optim.lordo import LoRDO

#: The knobs LoRDO keeps in its param groups (lr, betas, eps, weight_decay come from the user's optimizer and are
#: restored with its state, as Lightning does for any optimizer).
LORDO_KNOBS = tuple(k for k in OPTIMIZER_DEFAULTS if k not in ("lr", "betas", "eps", "weight_decay"))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def group_knob_changes(saved_knobs: Optional[Sequence[dict[str, Any]]], optimizer: Optimizer) -> list[str]:
    """The LoRDO knobs of ``optimizer``'s param groups that differ from ``saved_knobs`` (one dict per group), as
    ``name (group i): saved -> now``."""
    if saved_knobs is None or not isinstance(optimizer, LoRDO):
        return []
    changes = []
    for i, (old, group) in enumerate(zip(saved_knobs, optimizer.param_groups)):
        where = f" (group {i})" if len(optimizer.param_groups) > 1 else ""
        changes += [f"{k}{where}: {old[k]!r} -> {group[k]!r}" for k in LORDO_KNOBS
                    if k in old and _plain(group[k]) != _plain(old[k])]
    return changes


def load_optimizer(optimizer: Optimizer, saved: dict[str, Any], saved_names: Optional[Sequence[str]],
                   names: dict[Tensor, str]) -> list[str]:
    """Load ``saved`` (an optimizer state dict, LoRDO's or torch Adam/AdamW's) into ``optimizer`` whatever its
    knobs; returns what was converted. The current knobs stay (LoRDO's); lr, betas, eps and weight decay come
    from the checkpoint as for any optimizer."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    order = [names.get(p, "") for p in params]
    by_name = _state_by_name(saved, saved_names if saved_names is not None else order)
    notes = []
    missing = [n for n in order if n not in by_name]
    dropped = [n for n in by_name if n not in set(order)]
    if missing or dropped:
        notes.append(f"optimizer state matched by name: {len(missing)} parameter(s) without saved state start fresh"
                     f"{' (' + ', '.join(missing[:3]) + ')' if missing else ''}, {len(dropped)} saved one(s) dropped"
                     f"{' (' + ', '.join(dropped[:3]) + ')' if dropped else ''}")
    state = {}
    lordo_now, from_lordo = isinstance(optimizer, LoRDO), is_lordo_state(saved)
    expanded = 0
    for i, (p, name) in enumerate(zip(params, order)):
        entry = by_name.get(name, ({}, {}))[0]
        if not entry:
            continue
        if not lordo_now and from_lordo:  # LoRDO's state into torch's AdamW; any other optimizer's as it is
            entry, was_lowrank = adamw_entry(entry, p)
            expanded += was_lowrank
        state[i] = entry
    if expanded:
        notes.append(f"the moments of {expanded} low-rank matrices were expanded through their bases into AdamW "
                     "moments (error feedback dropped)")
    groups, index = [], 0
    saved_groups = saved["param_groups"] if len(saved["param_groups"]) == len(optimizer.param_groups) else None
    for gi, group in enumerate(optimizer.param_groups):
        merged = {k: v for k, v in group.items() if k != "params"}
        if saved_groups is not None:  # another optimizer's own state: every key it saved (a scheduler's momentum)
            keys = [k for k in saved_groups[gi] if k != "params"] if not lordo_now and not from_lordo else \
                (*HYPER, *REFRESH_COUNTERS)
            merged.update({k: saved_groups[gi][k] for k in keys if k in saved_groups[gi]})
        merged["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(merged)
    knobs = [{k: g[k] for k in LORDO_KNOBS if k in g} for g in optimizer.param_groups]
    if lordo_now:  # conformed to the saved knobs (load_notes), then to the knobs passed now, which win
        optimizer.load_state_dict({"state": state, "param_groups": groups}, names)
        notes += optimizer.load_notes
    else:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    for group, now in zip(optimizer.param_groups, knobs):
        group.update(now)
    if lordo_now:
        notes += optimizer.conform_state(names)
    return notes


def _state_by_name(saved: dict[str, Any], names: Sequence[str]) -> dict[str, tuple[dict[str, Any], int]]:
    out = {}
    flat = [i for g in saved["param_groups"] for i in g["params"]]
    for position, index in enumerate(flat):
        name = names[position] if position < len(names) else f"#{position}"
        out[name] = (saved.get("state", {}).get(index, {}), position)  # no "state": filtered out at the save
    return out


#: The resume's note for a checkpoint without LoRDO state (a DDP run's, say) loaded into LoRDO.
FROM_ANOTHER_STRATEGY = ("a checkpoint of another strategy (no LoRDO state): the full-rank parameters keep their Adam "
                         "moments, the low-rank matrices' moments restart in their new subspace")


def warn(notes: list[str], rank: int) -> None:
    """One warning, from rank 0, with every knob that changed and what the resume did about it."""
    if notes and rank == 0:
        warnings.warn("LoRDO resumed a checkpoint with changes (the knobs passed now win): " + "; ".join(notes) + ".",
                      UserWarning, stacklevel=3)
