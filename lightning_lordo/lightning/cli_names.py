"""The registered names as classes, so that LightningCLI and YAML configs take knobs after a name:
``--trainer.strategy=lordo_compressed --trainer.strategy.sync_every=8``.

Given ``--trainer.strategy=NAME`` alone, LightningCLI passes the string to the Trainer (the registry's preset). Given
knobs too, jsonargparse needs a class, and it finds a :class:`~lightning.pytorch.strategies.Strategy` subclass by its
name: each class here is :class:`LoRDOStrategy` whose ``preset`` defaults to its own name, with the same signature
and documentation otherwise (the launcher suffixes ``_fork``/``_spawn`` have no class: use ``start_method``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from lightning_lordo.lightning.strategy import LoRDOStrategy


def preset_strategy(name: str) -> type[LoRDOStrategy]:
    """``LoRDOStrategy`` under the name ``name``, with ``preset=name`` as the default."""

    def __init__(self: LoRDOStrategy, *args: Any, preset: str = name, **kwargs: Any) -> None:
        LoRDOStrategy.__init__(self, *args, preset=preset, **kwargs)

    # the parent's signature with the types resolved (jsonargparse reads both) and this preset as the default
    hints = typing.get_type_hints(LoRDOStrategy.__init__)
    signature = inspect.signature(LoRDOStrategy.__init__)
    __init__.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
        p.replace(annotation=hints.get(p.name, p.annotation), default=name if p.name == "preset" else p.default)
        for p in signature.parameters.values()])
    __init__.__annotations__ = hints
    doc = f"``LoRDOStrategy(preset={name!r})`` under its registered name (module docstring).\n\n"
    return type(name, (LoRDOStrategy,), {"__init__": __init__, "__module__": __name__,
                                          "__doc__": doc + (LoRDOStrategy.__doc__ or "")})


lordo = preset_strategy("lordo")
lordo_lean = preset_strategy("lordo_lean")
lordo_local = preset_strategy("lordo_local")
lordo_compressed = preset_strategy("lordo_compressed")
lowrank_ddp = preset_strategy("lowrank_ddp")
diloco = preset_strategy("diloco")
