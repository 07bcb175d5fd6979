"""The LoRDO step one matrix at a time, written to be read: what :mod:`~lightning_lordo.optim.functional` computes
grouped (``LoRDO(foreach=False)`` runs it; tests compare the two on random inputs against float64 references), and
AdamW's step on one parameter for the full-rank ones. The formulas are in :mod:`~lightning_lordo.optim.functional`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import canonical
from lightning_lordo.optim.functional import TINY, Hyper, add_stat, fold_error_feedback


def lowrank_reference(p: Tensor, state: dict[str, Tensor], h: Hyper, t: float,
                      stats: Optional[dict[str, Tensor]] = None) -> None:
    """One LoRDO step of one low-rank matrix ``p`` (its ``state`` holds ``basis``, the moments and the optional
    ``error_feedback`` / ``factored_*`` buffers; ``t`` is the step count including this step)."""
    bias1, bias2 = 1 - h.beta1**t, 1 - h.beta2**t
    fold_error_feedback(state)  # E itself, if a grouped step left it unfolded
    grad = canonical(p.grad, p).float()
    q = state["basis"]
    accumulated = grad
    if h.error_feedback:
        ef = state["error_feedback"]
        accumulated = grad + ef.float() * h.ef_decay
    projected = q.mT @ accumulated
    if h.error_feedback:
        ef.copy_(accumulated - q @ projected)
        add_stat(stats, "ef_sq", ef.float().square().sum())  # the stored buffer (maybe bf16), not the residual
    state["exp_avg"].lerp_(projected, 1 - h.beta1)
    state["exp_avg_sq"].mul_(h.beta2).addcmul_(projected, projected, value=1 - h.beta2)
    v_hat = state["exp_avg_sq"] / bias2
    u_hat = state["exp_avg"] / bias1
    if h.update == "subspace_qh":  # the QH mix inside the subspace, no full-rank term
        mixed = u_hat.mul_(h.omega).add_(projected, alpha=1 - h.omega)
        apply_update(p, canonical(q @ mixed.div_(v_hat.sqrt().add_(h.eps)), p), h, h.scale(q))
        return
    d_low = q @ (u_hat / (v_hat.sqrt() + h.eps) if h.update == "lordo" else u_hat)
    update = d_low  # omega == 1: pure low-rank step
    if h.omega < 1.0:
        full_input = accumulated if h.full_rank_input == "accumulated" else grad
        d_full = full_input / (_normalizer(state, h, grad, v_hat, bias2) + h.eps)
        if h.mu == "auto":  # mu = RMS(In/(S+eps)) / RMS(D_low): both terms get the same size
            d_full.mul_(_rms(d_low) / _rms(d_full).clamp(min=TINY))
        else:
            d_full.div_(h.mu)
        d_full.mul_(1.0 - h.omega)
        add_stat(stats, "full_sq", d_full.square().sum())
        update = d_full.add_(d_low, alpha=h.omega)
    add_stat(stats, "low_sq", d_low.square().sum() * h.omega**2)
    apply_update(p, canonical(update, p), h, h.scale(q))


def _normalizer(state: dict[str, Tensor], h: Hyper, grad: Tensor, v_hat: Tensor, bias2: float) -> Tensor:
    """The full-rank normalizer S of SPEC §6 for one matrix, broadcastable to ``a x b``."""
    if h.normalizer == "col_rms":
        return v_hat.mean(dim=0, keepdim=True).sqrt()
    if h.normalizer == "scalar":
        return v_hat.mean().sqrt()
    if h.normalizer == "mean_denom":  # S + eps = mean over all entries of (sqrt(v_hat) + eps)
        return v_hat.sqrt().mean()
    if h.normalizer == "lifted":
        floor = v_hat.mean().sqrt() * h.lifted_floor
        return torch.maximum((state["basis"].square() @ v_hat).sqrt(), floor)
    squared = grad.square()  # factored: Adafactor's row/column second moments of the gradient itself
    state["factored_row"].mul_(h.beta2).add_(squared.mean(dim=1), alpha=1 - h.beta2)
    state["factored_col"].mul_(h.beta2).add_(squared.mean(dim=0), alpha=1 - h.beta2)
    row, col = state["factored_row"] / bias2, state["factored_col"] / bias2
    return (row[:, None] * col[None, :] / row.mean().clamp(min=TINY)).sqrt()


def apply_update(p: Tensor, update: Tensor, h: Hyper, scale: float = 1.0) -> None:
    """Decoupled weight decay, then ``W -= lr * scale * update`` (``update`` shaped like ``p``)."""
    if h.weight_decay:
        p.mul_(1 - h.lr * h.weight_decay)
    p.add_(update.to(p.dtype), alpha=-h.lr * scale)


def _rms(t: Tensor) -> Tensor:
    return t.square().mean().sqrt()


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

