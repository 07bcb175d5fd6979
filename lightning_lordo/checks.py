"""Checks of one value each, whose error names the argument, the value given, what is allowed and the fix
(``ValueError``; nothing is clamped)."""

from __future__ import annotations

import difflib
import math
import sys
import warnings
from collections.abc import Iterable, Mapping
from numbers import Real
from typing import Any


class KnobError(ValueError):
    """A knob's value refused; :attr:`knob` names the knob (a preset's value that the user's knobs make meaningless
    gives way instead of being blamed on the user: :func:`~lightning_lordo.strategy_knobs.resolve_knobs`)."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(message)
        self.knob = knob


def fail(name: str, value: Any, allowed: str, fix: str) -> KnobError:
    """The error for ``name=value``: what is allowed, and how to fix it."""
    return KnobError(name.split("[")[0], f"Invalid {name}={value!r}: {allowed}. {fix}")


def is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_unit_interval(name: str, value: Any, *, closed_right: bool) -> float:  # [0, 1], or [0, 1)
    right = "]" if closed_right else ")"
    ok = is_number(value) and 0.0 <= value and (value <= 1.0 if closed_right else value < 1.0)
    if not ok:
        raise fail(name, value, f"it must be a number in [0, 1{right}", f"Pass e.g. {name}=0.9.")
    return float(value)


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = is_number(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise fail(name, value, f"it must be a finite number {bound}", f"Pass a value {bound}.")
    return float(value)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise fail(name, value, f"it must be an integer >= {minimum}", f"Pass e.g. {name}={max(minimum, 1)}.")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise fail(name, value, f"allowed values are {', '.join(map(repr, choices))}", "Pick one of them.")
    return value


def check_group_keys(group: Mapping[str, Any], knobs: Iterable[str], whole_optimizer: Iterable[str]) -> None:
    """Refuse a param group's key that would be ignored there: an argument of the whole optimizer (``seed``), or an
    Adam flag the optimizer does not have. Other keys (a scheduler's, the user's own tags) pass, as torch's
    optimizers let them; one close to a knob's name (``rnak``, but also a tag such as ``no_decay``) with a warning."""
    knobs = tuple(knobs)
    for key in group:
        if key in whole_optimizer:
            raise KnobError(key, f"Invalid param group key {key}={group[key]!r}: it is an argument of the whole "
                            f"optimizer, so a group would ignore it. Pass it to the constructor, e.g. {key}=...")
        if key in _ADAM_FLAGS and group[key]:
            raise KnobError(key, f"Invalid param group key {key}={group[key]!r}: LoRDO has no such mode, so it "
                            "would be ignored. Drop it.")
        match = difflib.get_close_matches(str(key), knobs, n=1, cutoff=0.75) if key not in knobs else []
        if match and key not in _TORCH_GROUP_KEYS:
            warnings.warn(f"LoRDO: the param group key {key!r} is not a knob, so LoRDO does not read it (it stays in "
                          f"the group, as torch's optimizers keep your own keys). Did you mean {match[0]!r}? If it is "
                          "your own tag, ignore this.", stacklevel=_outside_level())


def _outside_level() -> int:
    """The ``stacklevel`` of the innermost caller outside the plugin and torch (the user's line)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and str(frame.f_globals.get("__name__")).partition(".")[0] in ("lightning_lordo",
                                                                                                 "torch"):
        frame, level = frame.f_back, level + 1
    return level


_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
_TORCH_GROUP_KEYS = ("params", "param_names", "initial_lr", *_ADAM_FLAGS, "foreach", "fused", "decoupled_weight_decay")


def check_whole_optimizer(*, seed: Any, foreach: Any, fused: Any, layout: Any) -> None:
    """The arguments of a whole LoRDO optimizer (no param group has them)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise fail("seed", seed, "it must be an integer", "Pass e.g. seed=0.")
    for name, flag in (("foreach", foreach), ("fused", fused)):
        if not (isinstance(flag, bool) or (name == "fused" and flag is None)):
            raise fail(name, flag, "it must be True or False" + " or None" * (name == "fused"), "Pass a bool.")
    if layout not in (None, "in_place", "stacked", "compiled"):
        raise fail("layout", layout, "allowed values are None (by device), 'in_place', 'stacked', 'compiled'",
                   "Pick one of them.")
