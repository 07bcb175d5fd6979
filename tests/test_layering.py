"""The README's layers, checked on the source: imports point down only. The tensor math (``optim/``) knows neither
communication nor Lightning; communication (``comm/``) never imports the optimizer; a round (``sync/``) runs
without Lightning; the core and the checkpoint's content (``core.py``, ``convert.py``, ``checkpoint.py``) import
neither Lightning nor Fabric; only the glue (``lightning/``, ``fabric/``) does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_lordo"
OURS = "lightning_lordo."
LIGHTNING = ("lightning", "pytorch_lightning")  # the framework, not this package

#: a module (by its path under the package) -> what it must not import (prefixes of dotted names)
RULES: dict[str, tuple[str, ...]] = {
    "optim/": (*LIGHTNING, "torch.distributed", *(OURS + x for x in ("comm", "sync", "lightning", "fabric", "core",
                                                                     "checkpoint", "convert", "strategy_knobs"))),
    "comm/": (*LIGHTNING, *(OURS + x for x in ("optim", "sync", "lightning", "fabric", "core", "checkpoint",
                                               "convert"))),
    "sync/": (*LIGHTNING, *(OURS + x for x in ("lightning", "fabric", "core", "checkpoint", "convert"))),
    "core.py": (*LIGHTNING, OURS + "lightning", OURS + "fabric"),
    "convert.py": (*LIGHTNING, OURS + "lightning", OURS + "fabric"),
    "checkpoint.py": (*LIGHTNING, OURS + "lightning", OURS + "fabric"),
    "_tensors.py": (OURS,),
}


def imported(source: str) -> set[str]:
    """Every dotted name ``source`` imports, anywhere in it (``from a import b`` gives ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def violations(relative: str, source: str) -> list[str]:
    """The imports of the module at ``relative`` (a path under the package) that its layer's rule forbids."""
    forbidden = next((rule for prefix, rule in RULES.items() if relative.startswith(prefix)), ())
    return sorted(n for n in imported(source) for f in forbidden
                  if n == f or n.startswith(f + ".") or (f == OURS and n.startswith(OURS)))


def test_the_rules_catch_an_upward_import() -> None:
    assert violations("optim/x.py", "import torch\nfrom lightning_lordo.sync.outer import Anchor\n") == [
        "lightning_lordo.sync.outer", "lightning_lordo.sync.outer.Anchor"]
    assert violations("comm/x.py", "def f():\n    from lightning_lordo.optim import lordo\n") == [
        "lightning_lordo.optim", "lightning_lordo.optim.lordo"]
    assert violations("core.py", "from lightning.pytorch import Trainer\n") == [
        "lightning.pytorch", "lightning.pytorch.Trainer"]
    assert violations("core.py", "import lightning_lordo.config\n") == []
    assert violations("lightning/strategy.py", "from lightning.pytorch import Trainer\n") == []


@pytest.mark.parametrize("path", sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")))
def test_imports_point_down(path: str) -> None:
    assert violations(path, (PACKAGE / path).read_text(encoding="utf-8")) == []
