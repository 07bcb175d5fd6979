"""What the optimizer holds, in words and bytes: the per-parameter plan and the memory report (SPEC §8)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from lightning_lordo.optim.functional import EF_PROJECTION, Hyper, can_unfold, resolve_rank

if TYPE_CHECKING:  # the optimizer passes itself in
    from torch.optim import Optimizer

_LOWRANK_MOMENTS = ("exp_avg", "exp_avg_sq")


def describe(optimizer: Optimizer, names: Optional[Mapping[Tensor, str]] = None) -> list[dict[str, Any]]:
    """One row per parameter of a :class:`~lightning_lordo.LoRDO`: its step (``lowrank``, ``adamw``, or ``frozen``
    while it does not require a gradient), rank and the reason."""
    rows = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            r = optimizer.lowrank_rank(p, group)
            if r:
                reason = f"2-D, rank {r} < smaller side {min(p.shape)}"
            elif p.ndim != 2:
                reason = f"{p.ndim}-D"
            elif id(p) in optimizer._full_rank:
                reason = optimizer._full_rank[id(p)]
            elif group["rank"] == 0:
                reason = "opted out (rank=0)"
            else:
                reason = f"rank {resolve_rank(group['rank'], min(p.shape))} >= smaller side {min(p.shape)}"
            if not r and group["fullrank_state"] == "factored" and p.ndim >= 2:
                reason += "; factored state (fullrank_state='factored')"
            name = names.get(p, "") if names is not None else ""
            step = "lowrank" if r else "adamw"
            if not p.requires_grad:
                step, reason = "frozen", f"requires_grad=False: no step (it would take {step})"
            rows.append({"name": name, "group": gi, "shape": tuple(p.shape), "step": step, "rank": r,
                         "reason": reason})
    return rows


def plan_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Two lines for the start-up log from :func:`describe`'s rows: how many tensors take each step, and the
    largest of each by name, with its shape and why."""
    lines = []
    for step, label in (("lowrank", "take the low-rank step"), ("adamw", "take AdamW")):
        mine = [r for r in rows if r["step"] == step]
        if not mine:
            lines.append(f"LoRDO: no tensor takes {'the low-rank step' if step == 'lowrank' else 'AdamW'}.")
            continue
        big = max(mine, key=lambda r: math.prod(r["shape"]))
        shape = " x ".join(map(str, big["shape"])) or "scalar"
        lines.append(f"LoRDO: {len(mine)} tensors {label}; the largest is {big['name'] or '(unnamed)'} ({shape}: "
                     f"{big['reason']}).")
    frozen = sum(r["step"] == "frozen" for r in rows)
    return lines + ([f"LoRDO: {frozen} frozen tensors (requires_grad=False) take no step."] if frozen else [])


def memory_report(optimizer: Optimizer) -> dict[str, int]:
    """Bytes of optimizer state by category, and AdamW's for the same parameters.

    Keys: ``lowrank_moments``, ``bases``, ``fullrank_moments``, ``error_feedback`` (the buffers and, where the
    grouped step may keep them unfolded, the ``r x b`` projection that holds between folds, whether or not it does
    at this moment), ``other`` (step counters, factored normalizer), ``adamw_equivalent`` (2 moments per parameter
    element in the parameter's dtype, as torch's AdamW keeps them, for the parameters that train or hold state; the
    math here is float32, so with bfloat16 parameters a full-rank tensor's moments are twice AdamW's) and
    ``adamw_equivalent_lowrank`` (the same for the low-rank matrices alone).
    """
    out = dict.fromkeys(("lowrank_moments", "bases", "fullrank_moments", "error_feedback", "other",
                         "adamw_equivalent", "adamw_equivalent_lowrank"), 0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            lowrank = bool(optimizer.lowrank_rank(p, group))
            state = optimizer.state.get(p, {})
            held = p.requires_grad or bool(state)  # AdamW keeps no state for a frozen parameter either
            adamw = 2 * p.numel() * p.element_size() * held  # torch's AdamW keeps its moments in p's dtype
            out["adamw_equivalent"] += adamw
            out["adamw_equivalent_lowrank"] += adamw if lowrank else 0
            for key, value in state.items():
                out[_category(key, lowrank)] += value.numel() * value.element_size()
            if lowrank and "error_feedback" in state and EF_PROJECTION not in state and optimizer.foreach \
                    and can_unfold([state], Hyper.of(group)):  # folded right now: its projection comes back
                out["error_feedback"] += state["exp_avg"].numel() * state["exp_avg"].element_size()
    return out


def _category(key: str, lowrank: bool) -> str:
    if key in _LOWRANK_MOMENTS or (not lowrank and key.startswith("factored_")):  # a full-rank factored moment
        return "lowrank_moments" if lowrank else "fullrank_moments"
    return {"basis": "bases", "error_feedback": "error_feedback", EF_PROJECTION: "error_feedback"}.get(key, "other")


def diagnostics(stats: Mapping[str, Tensor]) -> dict[str, float]:
    """:meth:`LoRDO.diagnostics` from the sums one step collected (``low_sq``, ``full_sq``, ``ef_sq``)."""
    out: dict[str, float] = {}
    names = [k for k in ("low_sq", "full_sq", "ef_sq") if k in stats]
    if not names:
        return out
    sums = dict(zip(names, torch.stack([stats[k].reshape(()).double() for k in names]).tolist()))  # one host read
    if "low_sq" in sums and "full_sq" in sums:
        low = sums["low_sq"]
        out["term_ratio"] = (sums["full_sq"] / low) ** 0.5 if low > 0 else float("inf")
    if "ef_sq" in sums:
        out["error_feedback_norm"] = sums["ef_sq"] ** 0.5
    return out
