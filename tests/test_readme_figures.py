"""The README's figures are generated from committed result files (benchmarks/readme_figures.py): they match."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_figures  # noqa: E402


def test_the_readme_figures_are_the_committed_results() -> None:
    current = readme_figures.README.read_text()
    assert readme_figures.render(current) == current, "stale: run python benchmarks/readme_figures.py"
    assert "<!-- figures:demo -->" in current
