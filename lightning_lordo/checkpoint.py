"""What a LoRDO checkpoint holds under ``checkpoint["lordo"]``, for the Trainer and Fabric alike: the entry, built
from the core both strategies hold, its format version and the migrations from older released formats. The
frameworks' glue only writes and restores it: ``lightning/saving.py`` (the Trainer's hooks), ``lightning/shards.py``
(the per-rank files), ``lightning/resume.py`` (a resume with changed knobs), ``fabric/checkpoint.py`` (Fabric's hooks).

Every entry is :func:`entry`: the format, the world size and the synchronizer's state (``sync``: its ``state_dict``,
without the anchor where the saved model is the anchor, at a synchronization boundary), then the framework's own keys.
The Trainer's (:func:`trainer_entry`) adds the layout (knobs and parameter names, :func:`layout`), the launch step of a
round in flight (``in_flight``), every rank's state (:func:`rank_state`: ``ranks``, or per-rank shards) and what
Lightning's AdamW-shaped ``optimizer_states`` entry (:func:`adamw_entry`) leaves out; Fabric's (:func:`fabric_entry`),
which saves at synchronization boundaries only, the optimizer's class, the communication totals, the synchronization
knobs (``sync_knobs``, read when present: a resume lists what changed) and LoRDO's own
optimizer state (the user's optimizer entry holds it in AdamW's shape, as the Trainer's does). Everything is tensors (on
the CPU in the Trainer's entry), numbers and strings, so ``torch.load(path, weights_only=True)`` reads it.

Format 1 was the first released; Fabric then kept the synchronizer's counters at the top of its entry. Format 2
nests them under ``sync`` as the Trainer did (:data:`MIGRATIONS` brings a format-1 entry there). The development
versions before format 1 wrote no ``format``, and their several layouts are not read: such a checkpoint is refused
with the fix (its weights still load without the plugin). A later format adds a function to :data:`MIGRATIONS` that
brings format ``n`` to ``n + 1``, so every older released format keeps resuming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.conversion import adamw_state_dict
from lightning_lordo.optim.loading import LORDO_KNOBS
from lightning_lordo.optim.lordo import LoRDO

if TYPE_CHECKING:
    from lightning_lordo.core import LoRDOCore

FORMAT = 2
#: The synchronizer's counters that Fabric's format-1 entry kept at its top.
_FABRIC_1_SYNC = ("optimizer_steps", "syncs_done", "skipped_syncs", "consecutive_skips", "outer", "basis_window",
                  "anchor_step", "synchronous")


def _sync_nested(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: Fabric's counters under ``sync``, as saved at a boundary (no anchor, no local steps since);
    the Trainer's entry is unchanged."""
    if "sync" in state:
        return state
    rest = {k: v for k, v in state.items() if k not in _FABRIC_1_SYNC}
    return {**rest, "sync": {"anchor": [], "steps_since_sync": 0, **{k: state[k] for k in _FABRIC_1_SYNC}}}


#: format n -> the function that turns a format-n ``checkpoint["lordo"]`` into format n + 1.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _sync_nested}


def entry(sync: dict[str, Any], world_size: int, **rest: Any) -> dict[str, Any]:
    """A checkpoint's LoRDO entry (module docstring): ``sync``, the synchronizer's ``state_dict``; ``rest``, the
    framework's own keys."""
    return stamp({"world_size": world_size, "sync": sync, **rest})


def stamp(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a checkpoint's LoRDO entry) marked with the current format."""
    state["format"] = FORMAT
    return state


def check(state: dict[str, Any], where: str) -> dict[str, Any]:
    """``state`` in the current format, migrated from an older released one; refused, naming ``where`` and the fix,
    when it has no format (a development version's) or a newer one."""
    version = state.get("format")
    fix = ("Resume it with the version of lightning-lordo that wrote it, or start a new fit from its weights "
           "(MyModel.load_from_checkpoint(path) reads them without the plugin).")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"{where} was written by a development version of lightning-lordo, before checkpoint "
                         f"format 1, whose LoRDO state is not read. {fix}")
    if version > FORMAT:
        raise ValueError(f"{where} has LoRDO checkpoint format {version}, newer than this lightning-lordo's "
                         f"({FORMAT}). Upgrade lightning-lordo, or {fix[0].lower()}{fix[1:]}")
    while version < FORMAT:
        state, version = MIGRATIONS[version](state), version + 1
    return stamp(state)


# ------------------------------------------------------------------------------------------------ the content
def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (containers rebuilt)."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def sync_knobs(config: SyncConfig) -> dict[str, Any]:
    """The synchronization knobs as a checkpoint records them (plain values)."""
    knobs = dataclasses.asdict(config)
    knobs["timeout"] = config.timeout.total_seconds()
    return knobs


def sync_knob_changes(saved: Optional[dict[str, Any]], config: SyncConfig) -> list[str]:
    """The synchronization knobs that differ from those a checkpoint recorded (``saved``; ``None``: none recorded),
    as ``name: saved -> now``."""
    if saved is None:
        return []
    return [f"{name}: {saved[name]!r} -> {value!r}" for name, value in sync_knobs(config).items()
            if name in saved and plain(saved[name]) != plain(value)]


def plain(value: Any) -> Any:
    """A knob's value as compared across a save: a tuple as a list (a YAML or an older file has lists)."""
    return list(value) if isinstance(value, tuple) else value


def layout(core: LoRDOCore) -> dict[str, Any]:
    """The knobs and parameter names a checkpoint records, to compare with those of the run that resumes it."""
    optimizer, names = core.optimizer, core.parameter_names
    groups = [{k: g[k] for k in LORDO_KNOBS if k in g} for g in optimizer.param_groups]
    return {"optimizer_knobs": groups if isinstance(optimizer, LoRDO) else None,
            "sync_knobs": sync_knobs(core.sync_config), "lowrank": core.knobs.lowrank,
            "param_names": [names.get(p, "") for g in optimizer.param_groups for p in g["params"]],
            "sync_names": [names.get(p, "") for p in core.synchronizer.params]}


def rank_state(core: LoRDOCore, rank: int) -> dict[str, Any]:
    """A rank's own state: its communication totals, payload state and buffers (each rank's own between syncs,
    e.g. BatchNorm's), the positions of the parameters it stepped in the round (whose moments it holds), its
    optimizer state (rank 0's only if it is LoRDO's: Lightning's ``optimizer_states`` entry then holds it in AdamW's
    shape, :func:`adamw_entry`) and, mid-round, its replica."""
    sync = core.synchronizer
    local: dict[str, Any] = {"comm": core.accountant.state_dict(), "payload": to_cpu(sync.payloads.state_dict()),
                             "buffers": to_cpu(sync.buffers), "stepped": sorted(sync.stepped)}
    if rank != 0 or isinstance(core.optimizer, LoRDO):  # rank 0's LoRDO state: here, as
        local["optimizer"] = to_cpu(core.optimizer.state_dict())  # Lightning's entry holds AdamW's shape
    if sync.mid_round:
        local["params"] = to_cpu(sync.params)
    if sync.in_flight is not None and sync.in_flight.result is not None:  # an emergency save skips a round in flight
        local["overlap"] = to_cpu(sync.overlap_state_dict())
    return local


def adamw_entry(core: LoRDOCore, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The optimizer entry (Lightning's ``optimizer_states``, Fabric's user key) for rank 0's LoRDO state ``saved``:
    in torch AdamW's shape, so that a plain strategy (``"ddp"``, one device; ``"fsdp"``, GPU only, untried) resumes
    the checkpoint with the user's AdamW, whether this plugin is installed or not (the low-rank moments expanded
    through their bases; LoRDO's own state is in ``checkpoint["lordo"]``); and what the shape leaves out, for the
    Trainer's ``checkpoint["lordo"]["optimizer_entry"]``."""
    params = [p for g in core.optimizer.param_groups for p in g["params"]]
    entries = [e for e in saved["state"].values() if e]
    left_out = {"expanded": sum("basis" in e for e in entries),
                "error_feedback": sum("error_feedback" in e for e in entries)}
    return adamw_state_dict(saved, params, LORDO_KNOBS, to_host=True), left_out


def trainer_entry(core: LoRDOCore, world_size: int, partial: bool, local: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's entry without the ranks' own state (what every rank has the same of: the synchronizer's state,
    the layout, the launch step of a round in flight that ``local``, this rank's :func:`rank_state`, holds: named
    here for a strategy that does not read the shards); ``partial``: an emergency save's, with rank 0's state only."""
    return entry(to_cpu(core.synchronizer.state_dict()), world_size, layout=layout(core), partial=partial,
                 in_flight=local["overlap"]["step"] if "overlap" in local else None)


def fabric_entry(core: LoRDOCore, world_size: int, optimizer_state: Optional[dict[str, Any]] = None,
                 optimizer_key: Optional[str] = None) -> dict[str, Any]:
    """Fabric's entry, saved at a synchronization boundary: the saved model is the anchor; ``optimizer_state``:
    LoRDO's own state dict, when the user's optimizer entry (under ``optimizer_key``) holds it in AdamW's shape
    (:func:`adamw_entry`)."""
    own = {} if optimizer_state is None else {"optimizer_state": optimizer_state, "optimizer_key": optimizer_key}
    return entry(core.synchronizer.state_dict(anchor=False), world_size, optimizer=type(core.optimizer).__name__,
                 communication=core.accountant.state_dict(), sync_knobs=sync_knobs(core.sync_config), **own)
