"""The plugin's warnings as a Lightning user sees them: once, from global rank 0, at the user's own line.

While the strategy runs one of its hooks (setup, the optimizer step, the final synchronization, a resume), every
warning raised from a line of ``lightning_lordo`` is held back, and when the hook returns it is shown once, on
global rank 0 only, attributed to the innermost frame of the user's code on the stack: the ``trainer.fit(...)``
line, the user's ``configure_optimizers``, a user override of ``optimizer_step``. Filters apply there as usual
(``warnings.filterwarnings("ignore", message="LoRDO")`` still silences them). Warnings from Lightning, PyTorch or
the user's own code pass through unchanged, on every rank.

Nothing global changes: the interception replaces :data:`warnings.showwarning` for the duration of the hook only
and never touches the filters (no ``catch_warnings``, which would reset every module's "already shown" registry).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Optional

#: Top-level packages that are not the user's code: the plugin, Lightning, PyTorch and the standard library.
FRAMEWORK_PACKAGES = frozenset({"lightning_lordo", "lightning", "pytorch_lightning", "lightning_fabric",
                                "lightning_utilities", "torch", "torchmetrics", "typing_extensions"}
                               ) | frozenset(sys.stdlib_module_names)


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0]


def user_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame from ``frame`` outwards that is the user's code; else the innermost one outside the
    plugin (e.g. Lightning's, in a process started by ``spawn``); ``None`` when every frame is the plugin's."""
    outside_plugin, inner = None, None
    while frame is not None:
        package = _package(frame)
        # spawn's bootstrap (``python -c "from multiprocessing.spawn import spawn_main; ..."``) is not the user's
        bootstrap = inner == "multiprocessing" and frame.f_code.co_filename.startswith("<")
        if package not in FRAMEWORK_PACKAGES and not bootstrap:
            return frame
        if outside_plugin is None and package != "lightning_lordo":
            outside_plugin = frame
        frame, inner = frame.f_back, package
    return outside_plugin


class _Held:
    __slots__ = ("message", "category", "filename", "lineno", "module", "module_globals")

    def __init__(self, message: Any, category: type[Warning], filename: str, lineno: int, module: Optional[str],
                 module_globals: Optional[dict[str, Any]]) -> None:
        self.message, self.category, self.filename, self.lineno = message, category, filename, lineno
        self.module, self.module_globals = module, module_globals


class PluginWarnings:
    """A reusable, re-entrant context for the strategy's hooks (see the module's docstring).

    Args:
        rank: returns the process's global rank when the hook ends (only rank 0 shows the warnings).
    """

    def __init__(self, rank: Callable[[], int]) -> None:
        self._rank = rank
        self._depth = 0
        self._held: list[_Held] = []
        self._previous: Any = None
        self.shown: set[tuple[type[Warning], str]] = set()  # what this process showed (each one once)

    def __enter__(self) -> PluginWarnings:
        self._depth += 1
        if self._depth == 1:
            self._previous = warnings.showwarning
            warnings.showwarning = self._intercept
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._depth -= 1
        if self._depth:
            return
        if warnings.showwarning == self._intercept:  # bound methods compare equal, never identical
            warnings.showwarning = self._previous
        held, self._held = self._held, []
        if self._rank() != 0:
            return
        for w in held:
            key = (w.category, str(w.message))
            if key in self.shown:
                continue
            self.shown.add(key)
            registry = w.module_globals.setdefault("__warningregistry__", {}) if w.module_globals is not None else None
            try:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=w.module,
                                       registry=registry, module_globals=w.module_globals)
            except ImportError:  # a module whose loader cannot give its source (a built-in one, say): without it
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=w.module, registry=registry)

    def _intercept(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                   line: Optional[str] = None) -> None:
        frame: Optional[FrameType] = sys._getframe(1)
        while frame is not None and _package(frame) == "warnings":  # the machinery that called us
            frame = frame.f_back
        if frame is None or _package(frame) != "lightning_lordo":
            self._previous(message, category, filename, lineno, file, line)
            return
        target = user_frame(frame)
        if target is None:
            self._held.append(_Held(message, category, filename, lineno, None, None))
        else:
            self._held.append(_Held(message, category, target.f_code.co_filename, target.f_lineno,
                                    str(target.f_globals.get("__name__", "")), target.f_globals))

