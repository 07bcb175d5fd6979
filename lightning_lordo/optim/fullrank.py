"""The state of LoRDO's full-rank parameters (SPEC §3: embeddings, vectors, ``full_rank``, matrices whose rank would
not save memory), and their step where torch's AdamW does not apply (:meth:`LoRDO._adamw_step` picks; torch's own
functional AdamW, :func:`~lightning_lordo.optim.functional.adamw_torch`, where it does): :func:`adamw_grouped` for the
quasi-hyperbolic mix of ``update="subspace_qh"`` (QHAdam) and low-precision parameters with float32 moments.

``fullrank_state="factored"`` keeps a quarter of AdamW's bytes for the matrices among them (embeddings, output
heads): the first moment in bfloat16, the second factored as Adafactor's (a mean per row and per column of the
squared gradient; Shazeer & Stern, 2018), at AdamW's learning rate and bias corrections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import math_dtype
from lightning_lordo.optim.functional import STACK_BYTES, TINY, Hyper, is_factored
from lightning_lordo.optim.reference import apply_update


def adamw_grouped(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper,
                  steps: Sequence[float]) -> None:
    """:func:`~lightning_lordo.optim.reference.adamw_reference` for a list of parameters of one device (``steps``:
    each one's step count)."""
    grads = [p.grad.to(s["exp_avg"].dtype) for p, s in zip(params, states)]
    exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    torch._foreach_lerp_(exp_avgs, grads, 1 - h.beta1)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - h.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - h.beta2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, h.eps)
    momentum = torch._foreach_div(exp_avgs, [1 - h.beta1**t for t in steps])
    if h.update == "subspace_qh":
        torch._foreach_mul_(momentum, h.omega)
        torch._foreach_add_(momentum, grads, alpha=1 - h.omega)
    torch._foreach_div_(momentum, denom)
    if h.weight_decay:
        torch._foreach_mul_(list(params), 1 - h.lr * h.weight_decay)
    torch._foreach_add_(list(params), [m.to(p.dtype) for m, p in zip(momentum, params)], alpha=-h.lr)


# ------------------------------------------------------------------------ fullrank_state="factored"


def new_state(p: Tensor, h: Hyper, fused: bool) -> dict[str, Tensor]:
    """A full-rank parameter's fresh state (zeros, step 0). AdamW's: both moments in the math dtype, the step
    counter on the device for torch's fused AdamW (``fused``), else on the CPU. Factored: the first moment in
    bfloat16 and Adafactor's second-moment factors, the mean over each row (``a``) and each column (``b``) of the
    squared gradient (its rows are ``p.shape[0]``, as :func:`_rows`) in float32: ``2 + 4 / a + 4 / b`` bytes
    per element against AdamW's 8."""
    step = torch.zeros((), dtype=torch.float32, device=p.device if fused else torch.device("cpu"))
    if is_factored(p, h):
        (a, b), dtype = _sides(p), math_dtype(p.dtype)
        return {"step": step, "exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                "factored_row": torch.zeros(a, dtype=dtype, device=p.device),
                "factored_col": torch.zeros(b, dtype=dtype, device=p.device)}
    dtype = math_dtype(p.dtype)
    return {"step": step, **{k: torch.zeros_like(p, dtype=dtype) for k in ("exp_avg", "exp_avg_sq")}}


@torch.no_grad()
def conform(p: Tensor, state: dict[str, Tensor], h: Hyper, fused: bool) -> Optional[str]:
    """Make a full-rank parameter's state fit ``fullrank_state``, and say what changed (``None``: nothing).
    AdamW's second moment becomes its row and column means (Adafactor's factors, whose outer product over their
    mean has the same total), and back: the outer product of the factors over the rows' mean; the first moment is
    cast. The step count is kept."""
    if "basis" in state or "exp_avg" not in state:
        return None
    factored = is_factored(p, h)
    if factored and "exp_avg_sq" in state:
        v = _rows(state.pop("exp_avg_sq").to(math_dtype(p.dtype)))
        state.update(exp_avg=state["exp_avg"].to(torch.bfloat16), factored_row=v.mean(dim=1),
                     factored_col=v.mean(dim=0), step=state["step"].cpu())
        return "AdamW moments factored (fullrank_state='factored')"
    if not factored and "factored_row" in state:
        state.update(expand_factored(state, p))
        del state["factored_row"], state["factored_col"]
        state["step"] = state["step"].to(p.device if fused else torch.device("cpu"))
        return "factored moments expanded to AdamW's (fullrank_state='adamw')"
    return None


def expand_factored(state: Mapping[str, Tensor], p: Tensor) -> dict[str, Tensor]:
    """AdamW's moments from the factored ones: the first moment in the math dtype, the second the outer product of
    the factors over the rows' mean (Adafactor's estimate)."""
    dtype = math_dtype(p.dtype)
    row, col = state["factored_row"].to(dtype), state["factored_col"].to(dtype)
    second = torch.outer(row, col).div_(row.mean().clamp(min=TINY)).view(p.shape)
    # laid out as ``p`` (a channels_last weight's too), as AdamW's own moments are: torch's fused AdamW wants that
    return {"exp_avg": state["exp_avg"].to(dtype), "exp_avg_sq": torch.empty_like(p, dtype=dtype).copy_(second)}


def factored_reference(p: Tensor, state: dict[str, Tensor], h: Hyper, t: float) -> None:
    """One step of the factored full-rank state, readable: AdamW (or QHAdam with ``update="subspace_qh"``) whose
    second moment is Adafactor's ``v_hat = row col^T / mean(row)`` of the squared gradient's row and column means,
    and whose first moment is stored in bfloat16 (the math in float32, the update from the unrounded moment)."""
    grad = p.grad.to(math_dtype(p.dtype))
    first = state["exp_avg"].to(grad.dtype).lerp_(grad, 1 - h.beta1)
    state["exp_avg"].copy_(first)
    squared = _rows(grad).square()  # (a copy of a gradient laid out otherwise than as rows)
    state["factored_row"].mul_(h.beta2).add_(squared.mean(dim=1), alpha=1 - h.beta2)
    state["factored_col"].mul_(h.beta2).add_(squared.mean(dim=0), alpha=1 - h.beta2)
    row, col = state["factored_row"], state["factored_col"]
    v_hat = torch.outer(row, col) / row.mean().clamp(min=TINY) / (1 - h.beta2**t)
    momentum = first / (1 - h.beta1**t)
    if h.update == "subspace_qh":
        momentum = momentum.mul_(h.omega).add_(grad, alpha=1 - h.omega)
    apply_update(p, momentum / (v_hat.sqrt().add_(h.eps)).reshape(p.shape), h)


def factored_step(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper,
                  steps: Sequence[float]) -> None:
    """:func:`factored_reference` for each parameter, with bounded transients: the factors from norms along each
    axis (no squared copy of the gradient), then the rest in slices of rows of at most ``STACK_BYTES`` as float32
    (an embedding's update never exists whole), the denominator as the outer product of two square-rooted
    factors."""
    for p, state, t in zip(params, states, steps):
        grad, (a, b) = p.grad, _sides(p)
        dtype = math_dtype(p.dtype)
        # along the dimensions themselves, not a view as rows: a weight of any layout (channels_last, permuted)
        row_sq = torch.linalg.vector_norm(grad, dim=tuple(range(1, grad.ndim)), dtype=dtype).square_().div_(b)
        col_sq = torch.linalg.vector_norm(grad, dim=0, dtype=dtype).square_().div_(a).reshape(-1)
        state["factored_row"].mul_(h.beta2).add_(row_sq, alpha=1 - h.beta2)
        state["factored_col"].mul_(h.beta2).add_(col_sq, alpha=1 - h.beta2)
        row_scale = (state["factored_row"] / (1 - h.beta2**t)).sqrt_()
        col_scale = (state["factored_col"] / state["factored_row"].mean().clamp(min=TINY)).sqrt_()
        first = state["exp_avg"]
        for rows in row_slices(a, b):  # slices along the first dimension: views whatever the layout
            g = grad[rows].to(dtype)
            m = first[rows].to(g.dtype).lerp_(g, 1 - h.beta1)
            first[rows].copy_(m)
            m.div_(1 - h.beta1**t)
            if h.update == "subspace_qh":
                m.mul_(h.omega).add_(g, alpha=1 - h.omega)
            m.div_(torch.outer(row_scale[rows], col_scale).add_(h.eps).view(m.shape))
            apply_update(p[rows], m, h)


def row_slices(rows: int, cols: int) -> list[slice]:
    """Slices of ``rows`` rows of ``cols`` numbers, each at most :data:`STACK_BYTES` as float32 (at least a row)."""
    per = max(1, STACK_BYTES // (4 * max(1, cols)))
    return [slice(start, start + per) for start in range(0, rows, per)]


def _sides(p: Tensor) -> tuple[int, int]:
    """``p``'s rows (``p.shape[0]``) and the numbers in each (the product of the other dimensions)."""
    return p.shape[0], math.prod(p.shape[1:])


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``x.shape[0]`` rows, to read (a matrix as it is; a view where its layout allows, else a copy)."""
    return x if x.ndim == 2 else x.reshape(x.shape[0], math.prod(x.shape[1:]))
