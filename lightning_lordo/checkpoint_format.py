"""What a LoRDO checkpoint holds under ``checkpoint["lordo"]``, the Trainer's and Fabric's alike, and its version.

Every entry is :func:`entry`: the format, the world size and the synchronizer's state (``sync``: its
``state_dict``, without the anchor where the saved model is the anchor, at a synchronization boundary), then the
framework's own keys. The Trainer adds the layout (knobs and parameter names), every rank's state (``ranks``, or
per-rank shards) and what Lightning's AdamW-shaped ``optimizer_states`` entry leaves out; Fabric, which saves at
synchronization boundaries only, the optimizer's class and the communication totals.

Format 1 was the first released; Fabric then kept the synchronizer's counters at the top of its entry. Format 2
nests them under ``sync`` as the Trainer did (:data:`MIGRATIONS` brings a format-1 entry there). The development
versions before format 1 wrote no ``format``, and their several layouts are not read: such a checkpoint is refused
with the fix (its weights still load without the plugin). A later format adds a function to :data:`MIGRATIONS` that
brings format ``n`` to ``n + 1``, so every older released format keeps resuming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
