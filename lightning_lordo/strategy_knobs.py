"""The strategies' side of the knobs: the registered names (presets) and the split of a strategy's arguments into
its :class:`~lightning_lordo.config.SyncConfig` and the optimizer knobs, validated (shared by the Trainer's and
Fabric's strategies)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_lordo.config import (
    LEAN_KNOBS,
    OPTIMIZER_DEFAULTS,
    SyncConfig,
    check_knob_combinations,
    check_optimizer_knobs,
)

#: The registered strategy names (the Trainer's and Fabric's): name -> (knobs, description). Each is registered as
#: is and with the suffixes of :data:`LAUNCH_SUFFIXES`.
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "lordo": ({}, "LoRDO: global basis from the averaged pseudo-gradient + full-rank QHM term, error feedback"),
    "lordo_local": ({"basis_scope": "local", "average_moments": False},
                    "LoRDO-Local: each worker computes its own basis"),
    "diloco": ({"lowrank": False}, "DiLoCo: the user's optimizer locally, averaged every K steps"),
    "lordo_lean": (dict(LEAN_KNOBS), "LoRDO without the error-feedback buffer: rank-r optimizer state only, at "
                                     "some loss"),
    "lordo_compressed": ({**LEAN_KNOBS, "payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 16,
                          "moments_every": 4, "average_fullrank_moments": True},
                         "LoRDO with everything compressed: int8 low-rank messages for every weight matrix, the "
                         "moments (the full-rank ones too) every 4th sync (lean optimizer knobs)"),
    "lowrank_ddp": ({"synchronous": True}, "low-rank DDP: gradients averaged every step, LoRDO's low-rank "
                                           "moments, bases from the averaged gradient every K steps"),
}
#: Suffix of a registered name -> its start method (as Lightning's ``ddp``, ``ddp_spawn``, ``ddp_fork``).
LAUNCH_SUFFIXES = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
#: The optimizer knobs a strategy takes (lr, betas, eps and weight_decay come from the user's optimizer).
STRATEGY_OPTIMIZER_KNOBS = tuple(k for k in OPTIMIZER_DEFAULTS if k not in ("lr", "betas", "eps", "weight_decay"))


def _differs(value: Any, default: Any) -> bool:
    """Whether a knob was set to something other than its default (``True`` is not ``1``, ``16.0`` not ``16``)."""
    return type(value) is not type(default) or value != default


def split_strategy_knobs(owner: str, knobs: Mapping[str, Any], accepted: Sequence[str], *, lowrank: bool,
                         optimizer_source: str) -> tuple[SyncConfig, dict[str, Any]]:
    """A strategy's knobs, validated: its :class:`SyncConfig` and the optimizer knobs set to non-defaults.

    Args:
        owner: the strategy's class name, for the errors.
        knobs: every argument given by name (optimizer knobs, SyncConfig fields, the strategy's own).
        accepted: the argument names the strategy takes; any other is refused with a close match suggested.
        lowrank: whether the user's optimizer becomes LoRDO (``False``: DiLoCo, no low-rank payload).
        optimizer_source: where lr, betas, eps and weight_decay come from, for the error that refuses them.
    """
    unknown = sorted(set(knobs) - set(accepted))
    from_user = sorted(set(unknown) & {"lr", "betas", "eps", "weight_decay"})
    if from_user:
        raise ValueError(f"{owner} got {from_user}: these come from {optimizer_source}. Set them there.")
    if unknown:
        hints = {k: difflib.get_close_matches(k, accepted, n=1) for k in unknown}
        raise TypeError(f"{owner} got unknown arguments {unknown}"
                        f"{''.join(f' ({k}: did you mean {v[0]!r}?)' for k, v in hints.items() if v)}. The "
                        f"arguments are: {', '.join(accepted)}.")
    optimizer_knobs = {k: knobs[k] for k in STRATEGY_OPTIMIZER_KNOBS
                       if k in knobs and _differs(knobs[k], OPTIMIZER_DEFAULTS[k])}
    if optimizer_knobs and lowrank is False:
        name = next(iter(optimizer_knobs))
        raise ValueError(f"Invalid {name}={optimizer_knobs[name]!r} with lowrank=False ('diloco'): the optimizer knobs "
                         "shape LoRDO's step, and 'diloco' runs your optimizer as it is, so it would be ignored. Drop "
                         "it, or use a LoRDO preset ('lordo').")
    check_optimizer_knobs(optimizer_knobs, in_group=False)
    check_knob_combinations(optimizer_knobs, {**OPTIMIZER_DEFAULTS, **optimizer_knobs})
    config = SyncConfig(**{k: knobs[k] for k in SyncConfig.__dataclass_fields__ if k in knobs})
    if config.basis_every > 1 and lowrank is False:
        raise ValueError(f"Invalid basis_every={config.basis_every} with lowrank=False ('diloco'): there are no "
                         "low-rank bases to refresh. Drop basis_every, or use a LoRDO preset.")
    if config.payload == "lowrank" and lowrank is False:
        raise ValueError("Invalid payload='lowrank' with lowrank=False ('diloco'): the low-rank payload sends the "
                         "low-rank matrices of the LoRDO optimizer. Use payload='full' (payload_dtype may be "
                         "'bfloat16' or 'int8'), or a LoRDO preset.")
    return config, optimizer_knobs
