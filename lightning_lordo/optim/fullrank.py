"""The AdamW step of LoRDO's full-rank parameters (SPEC §3: embeddings, vectors, ``full_rank``, matrices whose rank
would not save memory).

torch's own functional AdamW (:func:`adamw_torch`, foreach or fused) where it applies; :func:`adamw_reference` (one
parameter, readable) and :func:`adamw_grouped` (foreach) for what torch's AdamW does not cover: the quasi-hyperbolic
mix of ``update="subspace_qh"`` (QHAdam) and low-precision parameters with float32 moments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim.adamw import adamw as torch_adamw

from lightning_lordo.optim.functional import Hyper, apply_update


def adamw_reference(p: Tensor, state: dict[str, Tensor], h: Hyper, t: float) -> None:
    """AdamW (or QHAdam with ``update="subspace_qh"``) on one parameter, moments in ``state`` (float32 math)."""
    grad = p.grad.to(state["exp_avg"].dtype)
    state["exp_avg"].lerp_(grad, 1 - h.beta1)
    state["exp_avg_sq"].mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    denom = (state["exp_avg_sq"].sqrt() / (1 - h.beta2**t) ** 0.5).add_(h.eps)
    momentum = state["exp_avg"] / (1 - h.beta1**t)
    if h.update == "subspace_qh":  # QHAdam: ((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)
        momentum = momentum.mul_(h.omega).add_(grad, alpha=1 - h.omega)
    apply_update(p, momentum.div_(denom), h)


def adamw_grouped(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper,
                  steps: Sequence[float]) -> None:
    """:func:`adamw_reference` for a list of parameters of one device (``steps``: each one's step count)."""
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


def adamw_torch(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, fused: bool) -> None:
    """torch's own AdamW (``foreach``, or ``fused``) on parameters whose moments have their dtype; it increments
    the step counters itself."""
    torch_adamw(list(params), [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=not fused, fused=fused,
                amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps,
                maximize=False)
