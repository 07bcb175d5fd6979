"""The timing bookkeeping of ``benchmarks/speed.py``: interleaved steps in a rotated order, paired ratios."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import speed  # noqa: E402


def test_interleaved_rotates_the_order_every_repeat():
    calls = []
    steps = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = speed._interleaved(steps, 4)
    assert calls == list("abc" "bca" "cab" "abc")
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_ratio_is_the_median_of_each_repeats_ratio():
    times = {"a": [2.0, 10.0, 3.0], "b": [1.0, 4.0, 3.0]}  # ratios 2, 2.5, 1; ratio of medians: 3 / 3 = 1
    assert speed._ratio(times, "a", "b") == 2.0
