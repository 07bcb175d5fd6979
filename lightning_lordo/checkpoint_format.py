"""The version of what a LoRDO checkpoint holds under ``checkpoint["lordo"]`` (the Trainer's and Fabric's).

Format 1 is the first one released. The development versions before it wrote no ``format``, and their several
layouts are not read: such a checkpoint is refused with the fix (its weights still load without the plugin). A later
format adds a function to :data:`MIGRATIONS` that brings format ``n`` to ``n + 1``, so every older released format
keeps resuming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FORMAT = 1
#: format n -> the function that turns a format-n ``checkpoint["lordo"]`` into format n + 1 (none yet).
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


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
                         f"format {FORMAT}, whose LoRDO state is not read. {fix}")
    if version > FORMAT:
        raise ValueError(f"{where} has LoRDO checkpoint format {version}, newer than this lightning-lordo's "
                         f"({FORMAT}). Upgrade lightning-lordo, or {fix[0].lower()}{fix[1:]}")
    while version < FORMAT:
        state, version = MIGRATIONS[version](state), version + 1
    return stamp(state)
