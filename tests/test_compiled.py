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

SHAPES = [(24, 40)] * 4 + [(40, 24)] * 4  # wide and tall stacks


def _run(layout: str, dtype: torch.dtype = torch.float32, steps: int = 6, foreach: bool = True,
         scale: float = 1.0) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter((torch.randn(s) * scale).to(dtype)) for s in SHAPES]
    # two groups on the same shapes: another normalizer broadcasts its denominator differently (another graph)
    groups = [{"params": params[0:2] + params[4:6]},  # the same stacks (2 wide, 2 tall) in both groups
              {"params": params[2:4] + params[6:8], "normalizer": "scalar", "weight_decay": 0.0}]
    opt = LoRDO(groups, rank=4, lr=1e-2, weight_decay=0.1, foreach=foreach, **({"layout": layout} if foreach else {}))
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        for group in opt.param_groups:
            group["lr"] = 1e-2 * 0.8**step  # a schedule: must not recompile
        opt.step()
    return [p.detach() if dtype == torch.float64 else p.detach().float() for p in params]


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
    assert not compiled._failed and len(compiled._stacks) == 4  # 2 shapes x 2 normalizers
    assert counters["stats"]["unique_graphs"] == 4  # one per stack: the learning rate is a tensor


def test_bfloat16_weights_take_the_compiled_step() -> None:
    got, stacked = _run("compiled", torch.bfloat16), _run("stacked", torch.bfloat16)
    for a, b in zip(got, stacked, strict=True):  # one rounding to bfloat16 per step, against two
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    assert not compiled._failed


def test_float64_weights_keep_the_eager_steps_precision() -> None:
    got, stacked = _run("compiled", torch.float64, steps=12, scale=300.0), _run("stacked", torch.float64, steps=12,
                                                                               scale=300.0)
    for a, b in zip(got, stacked, strict=True):  # float32 scalars would be 1e-4 off after 12 steps
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_a_failed_compilation_warns_once_and_the_step_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: object) -> object:
        def fail(*args: object) -> None:
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")
        return fail

    monkeypatch.setattr(compiled.torch, "compile", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run("compiled")
    said = [w for w in caught if "torch.compile failed" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler found" in str(said[0].message)
    for a, b in zip(got, _run("stacked"), strict=True):
        assert torch.equal(a, b)  # the eager stacked step, bit for bit


def test_an_error_that_is_not_the_compilers_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error once compiled kernels may have run (out of memory, say) is not taken for a failed compilation: the
    eager passes after it could apply the update twice."""
    def failing(fn: object) -> object:
        def fail(*args: object) -> None:
            raise RuntimeError("CUDA out of memory")
        return fail

    monkeypatch.setattr(compiled.torch, "compile", failing)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        _run("compiled")
    assert not compiled._failed


def test_past_the_graph_limit_new_stacks_take_the_eager_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stack (shape and number of matrices) is a graph; past ``MAX_GRAPHS`` a new one runs the eager foreach
    passes, not torch.compile's fallback matrix by matrix."""
    monkeypatch.setattr(compiled, "MAX_GRAPHS", 2)
    got = _run("compiled")
    assert len(compiled._stacks) == 2
    for a, b in zip(got, _run("stacked"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
