"""``LoRDO(layout="compiled")``: the stacked layout with its last full-size pass compiled by ``torch.compile``
(inductor on the CPU), against the eager stacked layout and the readable reference, and its fallback."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.optim import compiled

pytestmark = pytest.mark.slow  # each new stack shape compiles (seconds on 2 cores)

SHAPES = [(24, 40)] * 3 + [(40, 24)] * 3  # a wide and a tall stack


def _run(layout: str, dtype: torch.dtype = torch.float32, steps: int = 6, foreach: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    opt = LoRDO(params, rank=4, lr=1e-2, weight_decay=0.1, foreach=foreach,
                **({"layout": layout} if foreach else {}))
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.param_groups[0]["lr"] = 1e-2 * 0.8**step  # a schedule: must not recompile
        opt.step()
    return [p.detach().float() for p in params]


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    compiled.reset()
    torch._dynamo.reset()
    yield
    compiled.reset()


def test_the_compiled_step_gives_the_stacked_and_the_reference_steps_values() -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    got, stacked, reference = _run("compiled"), _run("stacked"), _run("", foreach=False)
    for a, b, c in zip(got, stacked, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)
    assert not compiled._failed
    assert 1 <= counters["stats"]["unique_graphs"] <= 2  # one per stack shape: the learning rate is a tensor


def test_bfloat16_weights_take_the_compiled_step() -> None:
    got, stacked = _run("compiled", torch.bfloat16), _run("stacked", torch.bfloat16)
    for a, b in zip(got, stacked, strict=True):  # one rounding to bfloat16 per step, against two
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    assert not compiled._failed


def test_a_failed_compilation_warns_once_and_the_step_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: object) -> object:
        def fail(*args: object) -> None:
            raise RuntimeError("no C++ compiler found")
        return fail

    monkeypatch.setattr(compiled.torch, "compile", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run("compiled")
    said = [w for w in caught if "torch.compile failed" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler found" in str(said[0].message)
    for a, b in zip(got, _run("stacked"), strict=True):
        assert torch.equal(a, b)  # the eager stacked step, bit for bit


def test_past_the_graph_limit_new_stacks_take_the_eager_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stack (shape and number of matrices) is a graph; past ``MAX_GRAPHS`` a new one runs the eager foreach
    passes, not torch.compile's fallback matrix by matrix."""
    monkeypatch.setattr(compiled, "MAX_GRAPHS", 1)
    got = _run("compiled")
    assert len(compiled._stacks) == 1
    for a, b in zip(got, _run("stacked"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
