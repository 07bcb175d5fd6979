"""Optimizer state across changes of its knobs: a LoRDO state made to fit the knobs it has now, and AdamW state
expanded from a low-rank one (a matrix that becomes full-rank, or a checkpoint resumed by another optimizer)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo._tensors import canonical, math_dtype
from lightning_lordo.config import KNOBS_BEFORE_THEY_EXISTED, OPTIMIZER_DEFAULTS, ef_dtype_for
from lightning_lordo.optim.bases import REFRESH_COUNTERS, start_counting
from lightning_lordo.optim.fullrank import conform as conform_fullrank
from lightning_lordo.optim.fullrank import expand_factored, is_factored
from lightning_lordo.optim.functional import EF_PROJECTION, Hyper, fold_error_feedback


@torch.no_grad()
def conform_state(optimizer: Optimizer, names: Optional[Mapping[Tensor, str]] = None) -> list[str]:
    """Make each parameter's state fit its group's knobs as they are now (after knobs changed, e.g. on a resume),
    and say what changed: a low-rank matrix whose rank changed, or that was full-rank, starts its moments over
    (its basis comes from its next gradient); one that is full-rank now gets AdamW moments expanded through
    its basis (the first moment exactly, ``Q u``; the second lifted, ``(Q o Q) v``, floored at its mean);
    error-feedback buffers and factored statistics are created (zeros), cast or dropped as the knobs say; a
    full-rank matrix's moments are factored or expanded as ``fullrank_state`` says."""
    changes: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            label = (names or {}).get(p) or str(tuple(p.shape))
            _check_fits(p, state, label)
            r = optimizer.lowrank_rank(p, group)
            lowrank_state = "basis" in state or ("exp_avg" in state and state["exp_avg"].shape != p.shape)
            if r and lowrank_state and state.get("basis") is not None and state["basis"].shape[1] == r:
                changes += _conform_lowrank(optimizer, p, group, state, label)
            elif r:
                state.clear()  # the next step gives it a basis (from the averaged gradient) and fresh moments
                changes.append(f"{label}: rank {r}, moments restarted")
            elif lowrank_state:
                optimizer.state[p] = expand_lowrank_state(state, p)
                changes.append(f"{label}: full-rank now, moments expanded through its basis")
            h = Hyper.of(group)
            change = None if r else conform_fullrank(p, optimizer.state[p], h, optimizer._fused_for(p)
                                                     and not is_factored(p, h))
            if change:
                changes.append(f"{label}: {change}")
    return changes


def _check_fits(p: Tensor, state: Mapping[str, Any], label: str) -> None:
    """Refuse state saved for a parameter of another shape (a state dict of other parameters, or in another order)."""
    basis, first = state.get("basis"), state.get("exp_avg")
    if basis is not None:
        fits = p.ndim == 2 and basis.shape[0] == min(p.shape) and (first is None or first.shape[-1] == max(p.shape))
    else:
        fits = first is None or first.shape == p.shape or (first.ndim == 2 and p.ndim == 2 and first.shape[-1] ==
                                                           max(p.shape))  # low-rank moments awaiting their basis
    if not fits:
        saved = tuple((basis if basis is not None else first).shape)
        raise ValueError(f"Invalid optimizer state for {label} of shape {tuple(p.shape)}: it holds a "
                         f"{'basis' if basis is not None else 'moment'} of shape {saved}, saved for another parameter. "
                         "Load a state dict saved for these parameters, in this order.")


def _conform_lowrank(optimizer: Optimizer, p: Tensor, group: dict[str, Any], state: dict[str, Tensor],
                     label: str) -> list[str]:
    changes = []
    if group["error_feedback"] and "error_feedback" in state:
        wanted = ef_dtype_for(group["ef_dtype"], p.device)
        if state["error_feedback"].dtype != wanted:
            fold_error_feedback(state)  # E itself, then cast
            state["error_feedback"] = state["error_feedback"].to(wanted)
            changes.append(f"{label}: error feedback cast to {str(wanted).removeprefix('torch.')}")
    elif "error_feedback" in state:
        state.pop(EF_PROJECTION, None)
        del state["error_feedback"]
        changes.append(f"{label}: error feedback dropped")
    if group["normalizer"] != "factored" and "factored_row" in state:
        del state["factored_row"], state["factored_col"]
    missing = (group["error_feedback"] and "error_feedback" not in state) or (
        group["normalizer"] == "factored" and "factored_row" not in state)
    optimizer._init_lowrank_state(p, group, optimizer.lowrank_rank(p, group))
    if missing:
        changes.append(f"{label}: error feedback or factored statistics start at zero")
    return changes


def adamw_entry(state: Mapping[str, Any], p: Tensor) -> tuple[dict[str, Any], bool]:
    """torch Adam/AdamW's state for ``p`` from a LoRDO (or torch) state entry, and whether it was expanded from a
    low-rank one (or from factored moments); what torch's AdamW has no use for (error feedback, factored statistics)
    is dropped."""
    if "basis" in state:
        return expand_lowrank_state(state, p), True
    if "factored_row" in state:  # fullrank_state="factored"
        return {"step": state["step"], **expand_factored(state, p)}, False
    return {k: v for k, v in state.items() if k in ("step", "exp_avg", "exp_avg_sq")}, False


def adamw_state_dict(saved: Mapping[str, Any], params: Sequence[Tensor], knobs: Collection[str],
                     to_host: bool = False) -> dict[str, Any]:
    """torch Adam/AdamW's state dict from LoRDO's (``saved``; ``params`` in its param groups' order): every entry
    through :func:`adamw_entry` (moved to host memory one at a time with ``to_host``, so a device holds one expanded
    matrix at most), and the param groups without LoRDO's ``knobs`` (torch's optimizer fills in its own defaults for
    its keys, e.g. ``amsgrad``)."""
    flat = [i for g in saved["param_groups"] for i in g["params"]]
    if len(flat) != len(params):
        raise ValueError(f"The optimizer state has {len(flat)} parameters and the model {len(params)}: they cannot be "
                         "matched. Resume it with strategy='lordo'.")
    state = {}
    for i, p in zip(flat, params):
        if saved["state"].get(i):
            entry = adamw_entry(saved["state"][i], p)[0]
            state[i] = {k: v.cpu() if to_host else v for k, v in entry.items()}
    dropped = {*knobs, *REFRESH_COUNTERS}
    groups = [{k: v for k, v in g.items() if k not in dropped} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def expand_lowrank_state(state: Mapping[str, Tensor], p: Tensor) -> dict[str, Tensor]:
    """AdamW state for ``p`` from its low-rank state: the first moment ``Q u`` (exactly the momentum, restricted to
    the subspace), the second ``(Q o Q) v`` floored at the mean of ``v`` (a per-coordinate estimate; the floor keeps
    directions outside the subspace from a near-zero denominator), the step count kept."""
    q, u, v = state["basis"].float(), state["exp_avg"].float(), state["exp_avg_sq"].float()
    dtype = math_dtype(p.dtype)
    first = canonical(q @ u, p)
    second = canonical(torch.maximum(q.square() @ v, v.mean()), p)
    return {"step": state["step"].detach().clone().float().cpu(), "exp_avg": first.to(dtype).contiguous(),
            "exp_avg_sq": second.to(dtype).contiguous()}


#: Restored from a checkpoint's param groups whatever its optimizer; LoRDO's own knobs stay as they are now.
HYPER = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def is_lordo_state(state_dict: Mapping[str, Any]) -> bool:
    return bool(state_dict.get("param_groups")) and all("omega" in g for g in state_dict["param_groups"])


def with_knobs_kept(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` to load into ``optimizer``: a LoRDO state as it is; another optimizer's (torch's AdamW, say)
    with the current groups' knobs and its own :data:`HYPER` (torch's ``load_state_dict`` would replace the groups
    with the saved ones, and LoRDO's knobs would fall back to their defaults); torch checks the group sizes."""
    saved = state_dict.get("param_groups", [])
    if is_lordo_state(state_dict) or len(saved) != len(optimizer.param_groups):
        return state_dict
    groups = [{**{k: v for k, v in now.items() if k != "params"}, **{k: g[k] for k in HYPER if k in g},
               "params": g["params"]} for now, g in zip(optimizer.param_groups, saved)]
    return {**state_dict, "param_groups": groups}


def restore_saved_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """After torch's ``load_state_dict``, which casts floating state to each parameter's dtype: every state tensor
    as it was saved (LoRDO keeps its math state in float32, the error feedback in its own dtype), step counters on
    the CPU (on the device for torch's fused AdamW), and the knobs a checkpoint older than them did not have."""
    saved = state_dict["state"]
    index = 0
    for group in optimizer.param_groups:
        for key in OPTIMIZER_DEFAULTS:  # a checkpoint older than a knob: what it ran with
            group.setdefault(key, KNOBS_BEFORE_THEY_EXISTED.get(key, optimizer.defaults[key]))
        start_counting(group)
        for p in group["params"]:
            for key, value in saved.get(index, {}).items():
                if isinstance(value, Tensor) and key != "step":  # counters stay on the CPU
                    optimizer.state[p][key] = value.to(device=p.device, copy=True)
            step = optimizer.state[p].get("step") if p in optimizer.state else None
            if step is not None and not optimizer.lowrank_rank(p, group) and optimizer._fused_for(p) \
                    and "factored_row" not in optimizer.state[p]:
                optimizer.state[p]["step"] = step.to(p.device)  # torch's fused AdamW keeps it on the device
            index += 1


#: LoRDO's attributes beside torch's pickled ``defaults``, ``state`` and ``param_groups``.
_OWN_ATTRIBUTES = ("seed", "foreach", "fused", "layout", "_compiled_on_cuda", "_random_bases", "_warned", "_record")


def picklable(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (torch's ``__getstate__``) with LoRDO's own attributes, the full-rank parameters by position (a
    copy's parameters are other tensors, with other ids)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    full = {i: optimizer._full_rank[id(p)] for i, p in enumerate(params) if id(p) in optimizer._full_rank}
    return {**state, **{k: getattr(optimizer, k) for k in _OWN_ATTRIBUTES}, "_full_rank_at": full}


def unpickled(optimizer: Any) -> None:
    """After torch's ``__setstate__`` of :func:`picklable`'s state: the full-rank parameters by id again. (torch's
    ``load_state_dict`` calls ``__setstate__`` too, with ``state`` and ``param_groups`` only: nothing to do then.)"""
    if "_full_rank_at" in optimizer.__dict__:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer._full_rank = {id(params[i]): why for i, why in optimizer.__dict__.pop("_full_rank_at").items()}
        optimizer._stats, optimizer._stats_age = {}, 0
