"""``LoRDO(layout="compiled")``: the stacked layout (:func:`~lightning_lordo.optim.functional.lowrank_grouped`) with
its last full-size elementwise work compiled by ``torch.compile``.

The eager stacked step ends with three passes over full-size tensors: ``update += c In / (S + eps)``
(``addcdiv_``), the weight decay ``W *= 1 - lr lambda`` and ``W -= lr s update``. Compiled, one fused kernel per
matrix reads ``W``, the back-projected low-rank term, the full-rank input and the normalizer, and writes ``W``. The
three scalars travel as 0-d tensors filled on the weights' device (no host-to-device copy, which would wait for
the device), so a learning-rate schedule does not recompile; a new stack (its matrices' shape and number) does.
Past :data:`MAX_GRAPHS` stacks the others take the eager passes (``torch.compile``'s own cache limit would run the
function eagerly matrix by matrix, slower than foreach ops).

If compilation fails (no compiler, a backend that does not support an op: :data:`COMPILE_ERRORS`), the step warns
once and runs eagerly from then on. Compilation happens before the compiled kernels run, so a failed one leaves the
weights as they were; any other error (out of memory, say) propagates, as the eager step's would.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch._dynamo
import torch._inductor.exc
from torch import Tensor

#: The most stacks compiled (a stack: what makes torch.compile compile again, :func:`_stack_key`): its own limit.
MAX_GRAPHS = int(getattr(torch._dynamo.config, "recompile_limit", getattr(torch._dynamo.config, "cache_size_limit", 8)))
#: What a failed compilation raises (before any compiled kernel ran): only these fall back to the eager passes.
COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,) + tuple(
    getattr(torch._inductor.exc, name) for name in ("CppCompileError", "CUDACompileError")
    if hasattr(torch._inductor.exc, name))
_compiled: dict[str, Optional[Callable[..., None]]] = {"tail": None}
_failed: list[str] = []  # the first failure's message: set once, the eager path runs from then on
_stacks: set[tuple[object, ...]] = set()  # the stacks compiled so far


def _tail(params: list[Tensor], low: Tensor, full_input: Tensor, denom: Tensor, coef: Tensor, decay: Tensor,
          step: Tensor) -> None:
    """``W <- W decay - step (low + coef In / denom)`` for each matrix (``decay = 1 - lr lambda``, ``step = lr s``)."""
    for i, p in enumerate(params):
        p.mul_(decay).sub_((low[i] + coef * full_input[i] / denom[i]) * step)


def apply_tail(params: Sequence[Tensor], low: Tensor, full_input: Tensor, denom: Tensor, coef: float,
               decay: float, step: float) -> bool:
    """The compiled :func:`_tail` on the stacked ``low`` (the back-projected low-rank term), ``full_input`` and
    ``denom`` (broadcastable to them); ``False`` (nothing done) once compilation has failed: the caller runs the
    eager passes."""
    stack = _stack_key(params, low, full_input, denom)
    if _failed or (stack not in _stacks and len(_stacks) >= MAX_GRAPHS):
        return False
    _stacks.add(stack)
    if _compiled["tail"] is None:
        _compiled["tail"] = torch.compile(_tail)
    dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32  # the eager path's scalar precision
    scalars = [torch.full((), value, dtype=dtype, device=low.device) for value in (coef, decay, step)]
    try:
        _compiled["tail"](list(params), low, full_input, denom, *scalars)  # type: ignore[misc]
    except COMPILE_ERRORS as err:  # raised before a kernel ran: the eager path takes over, with a warning
        _failed.append(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        warnings.warn(f"LoRDO(layout='compiled'): torch.compile failed ({_failed[0]}); the step runs eagerly (the "
                      "stacked layout's values) from now on.", RuntimeWarning, stacklevel=2)
        return False
    return True


def on_cuda(layout: Optional[str]) -> bool:
    """Whether the stacked step compiles its last pass on CUDA: with ``layout="compiled"``, or by device
    (``layout=None``) where Triton, torch.compile's backend there, is installed (a failed compilation still falls
    back, with the warning). The CPU keeps its eager ``"in_place"`` layout by device: its inductor gains little."""
    return layout == "compiled" or (layout is None and _has_triton())


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - a torch without it has no Triton backend we know of
        return False
    return bool(has_triton())


def _stack_key(params: Sequence[Tensor], *stacked: Tensor) -> tuple[object, ...]:
    """What a compiled graph is specialized on: the number, dtype and device of the weights, and each stacked input's
    shape, strides and dtype (the normalizer's broadcast shape too)."""
    return (len(params), params[0].dtype, params[0].device,
            *((tuple(t.shape), t.stride(), t.dtype) for t in stacked))


def reset() -> None:
    """Forget the compiled function and any failure (tests; a new backend)."""
    _compiled["tail"] = None
    _failed.clear()
    _stacks.clear()
