r"""The LoRDO update as functions of tensors (SPEC §3, §6, §6b): a readable per-matrix reference and a grouped path.

:func:`lowrank_reference` is the algorithm, one matrix at a time, written to be read. :func:`lowrank_grouped` computes
the same for a list of matrices of one canonical shape, dtype and device (and one step count): they are stacked, the
projection and the back-projection are one batched matmul each, and the elementwise moment updates are ``foreach``
ops, so the number of dispatched operations does not grow with the number of matrices. Tests compare the two on
random inputs against float64 references. The AdamW parameters' step is in :mod:`lightning_lordo.optim.fullrank`.

For a low-rank matrix in the canonical orientation ``a x b`` (``a <= b``) with basis ``Q`` (``a x r``)::

    A = G + gamma E;  g = Q^T A;  E <- A - Q g                      (error feedback, optional)
    u <- beta1 u + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2
    "lordo":                D = (1 - omega) In / (mu (S + eps)) + omega Q (u_hat / (sqrt(v_hat) + eps))
    "unnormalized_lowrank": D = (1 - omega) In / (mu (S + eps)) + omega Q u_hat
    "subspace_qh":          D = Q ((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)
    W <- W (1 - lr lambda) - lr D

with ``In`` the full-rank input (``G``, or ``A`` with ``full_rank_input="accumulated"``) and ``S`` the normalizer of
SPEC §6. ``stats``, when given, collects the sums behind :meth:`LoRDO.diagnostics` (only when asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import canonical, is_tall, stack_slices
from lightning_lordo.optim.compiled import apply_tail
from lightning_lordo.optim.error_feedback import (
    accumulate,
    enter_unfolded,
    fold_error_feedback,
    unfold_now,
    unfolded_projection,
)
from lightning_lordo.optim.hyper import Hyper

_TINY = torch.finfo(torch.float32).tiny


def _add_stat(stats: Optional[dict[str, Tensor]], key: str, value: Tensor) -> None:
    if stats is not None:
        stats[key] = stats[key] + value if key in stats else value


# ------------------------------------------------------------------------------------------------ reference
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
        _add_stat(stats, "ef_sq", ef.float().square().sum())  # the stored buffer (maybe bf16), not the residual
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
            d_full.mul_(_rms(d_low) / _rms(d_full).clamp(min=_TINY))
        else:
            d_full.div_(h.mu)
        d_full.mul_(1.0 - h.omega)
        _add_stat(stats, "full_sq", d_full.square().sum())
        update = d_full.add_(d_low, alpha=h.omega)
    _add_stat(stats, "low_sq", d_low.square().sum() * h.omega**2)
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
    return (row[:, None] * col[None, :] / row.mean().clamp(min=_TINY)).sqrt()


def apply_update(p: Tensor, update: Tensor, h: Hyper, scale: float = 1.0) -> None:
    """Decoupled weight decay, then ``W -= lr * scale * update`` (``update`` shaped like ``p``)."""
    if h.weight_decay:
        p.mul_(1 - h.lr * h.weight_decay)
    p.add_(update.to(p.dtype), alpha=-h.lr * scale)


def _rms(t: Tensor) -> Tensor:
    return t.square().mean().sqrt()


# ------------------------------------------------------------------------------------------------ grouped
def lowrank_grouped(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, t: float,
                    stats: Optional[dict[str, Tensor]] = None, in_place: Optional[bool] = None,
                    compiled: bool = False) -> None:
    """:func:`lowrank_reference` for matrices of one shape, dtype and device at step count ``t``.

    Two layouts of the same math. ``in_place`` (the default on the CPU, where memory passes and not kernel launches
    cost the time; float32 weights, a fixed ``mu``, any normalizer but ``factored``): :func:`_lowrank_in_place`, no
    full-size tensor stacked and no full-size update materialized. Otherwise (the default on accelerators, where
    each launch costs) the stacked layout: one batched matmul per projection, foreach math, a fixed number of ops
    per stack (a group in stacks of at most :data:`~lightning_lordo._tensors.STACK_BYTES`, which bounds the step's
    transient memory); ``compiled``: its last full-size pass compiled (:mod:`~lightning_lordo.optim.compiled`)."""
    if in_place is None:
        in_place = params[0].device.type == "cpu"
    if in_place and _can_write_in_place(params[0], h):
        _lowrank_in_place(params, states, h, t, stats)
        return
    for part in stack_slices(len(params), params[0].numel()):  # each stack is a copy: bounded
        _lowrank_stacked(params[part], states[part], h, t, stats, compiled)


def _can_write_in_place(p: Tensor, h: Hyper) -> bool:
    # lr * weight_decay == 1 would be addmm_'s beta = 0, which ignores the weights (a NaN in them would vanish)
    return p.dtype == torch.float32 and h.mu != "auto" and h.normalizer != "factored" and h.lr * h.weight_decay != 1



def _lowrank_in_place(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, t: float,
                      stats: Optional[dict[str, Tensor]]) -> None:
    """The grouped step with the ``r x b`` moments stacked and every full-size tensor left where it is: per matrix
    one matmul reads the gradient (the projection), one ``addmm_`` applies the weight decay and the low-rank term
    to the weights, and one ``addcdiv_`` the full-rank term: 6 full-size passes per matrix without error feedback
    (AdamW: 7). The full-rank term reads the gradient after the weights were written: a gradient sharing its
    weight's memory is not supported (autograd never makes one).

    Error feedback is kept unfolded where the knobs allow (:func:`can_unfold`;
    :mod:`lightning_lordo.optim.error_feedback`): the buffer holds ``R`` and ``E = R - Q c``, so no third matmul
    computes ``E``; then the full-rank term's input ``A = R - gamma Q c_prev`` (:func:`_fold_into_low`). 9 passes
    and 2 matmuls per matrix, against 11 and 3 folded."""
    tall = is_tall(params[0])
    bias1, bias2 = 1 - h.beta1**t, 1 - h.beta2**t
    allowed = can_unfold(states, h)
    unfold = h.error_feedback and unfold_now(states, allowed and stats is None, t)
    q = torch.stack([s["basis"] for s in states])  # n x a x r
    grads = [canonical(p.grad, p) for p in params]  # a x b views
    accumulated = grads
    if h.error_feedback:
        errors = [s["error_feedback"] for s in states]  # canonical
        if unfold:  # R <- G + gamma R, in place
            accumulate(errors, grads, h.ef_decay)
            accumulated = errors
        else:
            accumulated = torch._foreach_add(grads, errors, alpha=h.ef_decay)
    projected = q.new_empty(q.shape[0], q.shape[2], grads[0].shape[1])  # n x r x b
    bases = q.unbind(0)
    for a, qt, out in zip(accumulated, q.mT.unbind(0), projected.unbind(0)):
        torch.mm(qt, a, out=out)
    previous = unfolded_projection(states, projected, h.ef_decay) if unfold else None
    if h.error_feedback and not unfold:
        for a, qi, g, e in zip(accumulated, bases, projected.unbind(0), errors):  # E <- A - Q g
            if e.dtype == a.dtype:
                torch.addmm(a, qi, g, alpha=-1, out=e)
            else:  # a low-precision buffer
                e.copy_(torch.addmm(a, qi, g, alpha=-1))
        if stats is not None:
            _add_stat(stats, "ef_sq", sum(e.float().square().sum() for e in errors))
        enter_unfolded(states, allowed)
    u_hat, v_hat = _moments_grouped(states, projected.unbind(0), h, bias1, bias2)
    full_term = h.update != "subspace_qh" and h.omega < 1.0
    if h.update == "subspace_qh":
        low = u_hat.mul_(h.omega).add_(projected, alpha=1 - h.omega).div_(v_hat.sqrt().add_(h.eps))
    else:
        low = u_hat / (v_hat.sqrt() + h.eps) if h.update == "lordo" else u_hat
        low.mul_(h.omega)
        if stats is not None:
            _add_stat(stats, "low_sq", torch.bmm(q, low).square().sum())
    value = (1.0 - h.omega) / h.mu
    if full_term:
        denom = _normalizer_grouped(states, q, h, None, v_hat, bias2, tall).add_(h.eps)  # in the weights' orientation
        _fold_into_low(low, previous, denom, h, tall)
    lr = h.lr * h.scale(q)  # the update's (not the weight decay's)
    for p, qi, li in zip(params, bases, low.unbind(0)):  # W <- W (1 - lr lambda) - lr Q (omega D_low)
        canonical(p, p).addmm_(qi, li, beta=1 - h.lr * h.weight_decay, alpha=-lr)
    if not full_term:
        return
    full_inputs = [canonical(a, p) for a, p in zip(accumulated, params)] if h.full_rank_input == "accumulated" \
        else [p.grad for p in params]
    denoms = denom.unbind(0)
    if stats is not None:
        _add_stat(stats, "full_sq", sum((x / d).square().sum() for x, d in zip(full_inputs, denoms)) * value**2)
    for p, x, d in zip(params, full_inputs, denoms):  # ... - lr (1 - omega) In / (mu (S + eps))
        p.addcdiv_(x, d, value=-lr * value)


def can_unfold(states: Sequence[dict[str, Tensor]], h: Hyper) -> bool:
    """Whether the grouped step may keep the error feedback unfolded: a float32 buffer, and no full-rank term
    (``subspace_qh``, ``omega=1``), one that reads the gradient, or a fixed ``mu`` and a normalizer constant along
    each column (``Q c / S = Q (c / S)``)."""
    return (h.error_feedback and states[0]["error_feedback"].dtype == torch.float32
            and (h.full_rank_input == "gradient" or h.update == "subspace_qh" or h.omega == 1.0
                 or (h.normalizer in ("col_rms", "scalar", "mean_denom") and h.mu != "auto")))


def _fold_into_low(low: Tensor, previous: Optional[Tensor], denom: Tensor, h: Hyper, tall: bool) -> None:
    """With unfolded buffers the full-rank term's input ``A = R - gamma Q c_prev``: its ``Q`` part joins the
    low-rank factor (already times omega), ``low -= gamma (1 - omega) / mu c_prev / (S + eps)`` (``denom``: S + eps
    in the weights' orientation, constant along each canonical column)."""
    if previous is not None and h.full_rank_input == "accumulated":
        canonical_denom = denom.mT if tall else denom
        low.sub_(previous.mul_(h.ef_decay * (1.0 - h.omega) / h.mu).div_(canonical_denom))


def _lowrank_stacked(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, t: float,
                     stats: Optional[dict[str, Tensor]], compiled: bool = False) -> None:
    """The stacked layout of :func:`lowrank_grouped`.

    Full-size tensors stay in the parameters' own orientation: for tall matrices (worked on transposed, SPEC §2)
    only the small ``r x b`` factors and the normalizer are transposed, never a gradient. The scalars of the
    full-rank term are folded into its (small) normalizer, so each full-size tensor is read or written as few times
    as the algorithm needs: the gradient stacked, read by the projection and by the full-rank term; the update
    written by the back-projection, completed in place, and added to the weights."""
    tall = is_tall(params[0])
    bias1, bias2 = 1 - h.beta1**t, 1 - h.beta2**t
    allowed = can_unfold(states, h)
    unfold = h.error_feedback and unfold_now(states, allowed and stats is None, t)  # as in the in-place layout
    grad = torch.stack([p.grad for p in params]).float()  # n x rows x cols, the parameters' orientation
    q = torch.stack([s["basis"] for s in states])  # n x a x r
    accumulated = grad
    if h.error_feedback:
        errors = [s["error_feedback"] for s in states]
        oriented = [e.mT if tall else e for e in errors]  # as the gradients
        if unfold:  # R <- G + gamma R in place, then stacked
            accumulate(oriented, grad.unbind(0), h.ef_decay)
            accumulated = torch.stack(oriented)
        else:
            accumulated = grad.clone()
            torch._foreach_add_(accumulated.unbind(0), oriented, alpha=h.ef_decay)
    # the projection Q^T A (canonical A = G^T for a tall matrix): n x r x b
    projected = torch.bmm(accumulated, q).mT.contiguous() if tall else torch.bmm(q.mT, accumulated)
    previous = unfolded_projection(states, projected, h.ef_decay) if unfold else None
    rows = projected.unbind(0)
    if h.error_feedback and not unfold:
        residual = torch.baddbmm(accumulated, *_back(q, projected, tall), alpha=-1)
        torch._foreach_copy_(errors, [r.mT if tall else r for r in residual.unbind(0)])
        if stats is not None:
            _add_stat(stats, "ef_sq", torch.stack(errors).float().square().sum())
        enter_unfolded(states, allowed)
    u_hat, v_hat = _moments_grouped(states, rows, h, bias1, bias2)
    if h.update == "subspace_qh":
        mixed = u_hat.mul_(h.omega).add_(projected, alpha=1 - h.omega).div_(v_hat.sqrt().add_(h.eps))
        _apply_grouped(params, torch.bmm(*_back(q, mixed, tall)), h, h.scale(q))
        return
    low = u_hat / (v_hat.sqrt() + h.eps) if h.update == "lordo" else u_hat  # n x r x b
    if h.omega == 1.0:
        update = torch.bmm(*_back(q, low, tall))
        if stats is not None:
            _add_stat(stats, "low_sq", update.square().sum())
        _apply_grouped(params, update, h, h.scale(q))
        return
    denom = _normalizer_grouped(states, q, h, grad, v_hat, bias2, tall).add_(h.eps)  # S + eps, orientation of W
    full_input = accumulated if h.full_rank_input == "accumulated" else grad
    if h.mu == "auto":  # both terms the same RMS: needs the full-rank term's RMS first
        d_low = torch.bmm(*_back(q, low, tall))
        d_full = full_input / denom
        d_full.mul_(_rms_each(d_low) / _rms_each(d_full).clamp(min=_TINY)).mul_(1.0 - h.omega)
        if stats is not None:
            _add_stat(stats, "full_sq", d_full.square().sum())
            _add_stat(stats, "low_sq", d_low.square().sum() * h.omega**2)
        _apply_grouped(params, d_full.add_(d_low, alpha=h.omega), h, h.scale(q))
        return
    _fold_into_low(low.mul_(h.omega), previous, denom, h, tall)
    update = torch.bmm(*_back(q, low, tall))  # omega D_low, then + (1 - omega) In / (mu (S + eps))
    if stats is not None:
        _add_stat(stats, "low_sq", update.square().sum())
        _add_stat(stats, "full_sq", (full_input / denom).square().sum() * ((1.0 - h.omega) / h.mu) ** 2)
    coef, scale = (1.0 - h.omega) / h.mu, h.scale(q)
    if not (compiled and apply_tail(params, update, full_input, denom, coef, 1 - h.lr * h.weight_decay, h.lr * scale)):
        update.addcdiv_(full_input, denom, value=coef)
        _apply_grouped(params, update, h, scale)


def _moments_grouped(states: Sequence[dict[str, Tensor]], rows: Sequence[Tensor], h: Hyper, bias1: float,
                     bias2: float) -> tuple[Tensor, Tensor]:
    """Both moments updated in place with the projected gradients ``rows`` (``r x b`` each); returns the stacked,
    bias-corrected ``u_hat`` and ``v_hat`` (new tensors)."""
    exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    torch._foreach_lerp_(exp_avgs, rows, 1 - h.beta1)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, rows, rows, value=1 - h.beta2)
    return torch.stack(exp_avgs).div_(bias1), torch.stack(exp_avg_sqs).div_(bias2)


def _back(q: Tensor, x: Tensor, tall: bool) -> tuple[Tensor, Tensor]:
    """The two factors whose batched product is ``Q x`` (canonical, ``n x a x b``) in the parameters' orientation."""
    return (x.mT, q.mT) if tall else (q, x)


def _normalizer_grouped(states: Sequence[dict[str, Tensor]], q: Tensor, h: Hyper, grad: Optional[Tensor],
                        v_hat: Tensor, bias2: float, tall: bool) -> Tensor:
    """:func:`_normalizer` for a stack (``n x r x b`` moments), broadcastable to the stacked parameters (a new
    tensor: the caller adds ``eps`` in place)."""
    if h.normalizer == "col_rms":
        s = v_hat.mean(dim=1, keepdim=True).sqrt_()
        return s.mT if tall else s
    if h.normalizer == "scalar":
        return v_hat.mean(dim=(1, 2), keepdim=True).sqrt_()
    if h.normalizer == "mean_denom":
        return v_hat.sqrt().mean(dim=(1, 2), keepdim=True)
    if h.normalizer == "lifted":
        floor = v_hat.mean(dim=(1, 2), keepdim=True).sqrt_() * h.lifted_floor
        lifted = torch.bmm(v_hat.mT, q.square().mT) if tall else torch.bmm(q.square(), v_hat)
        return torch.maximum(lifted.sqrt_(), floor)
    assert grad is not None, "the factored normalizer reads the stacked gradient"
    squared = grad.square()  # factored: canonical rows are the raw columns of a tall matrix
    rows, cols = [s["factored_row"] for s in states], [s["factored_col"] for s in states]
    torch._foreach_mul_(rows, h.beta2)
    torch._foreach_add_(rows, squared.mean(dim=1 if tall else 2).unbind(0), alpha=1 - h.beta2)
    torch._foreach_mul_(cols, h.beta2)
    torch._foreach_add_(cols, squared.mean(dim=2 if tall else 1).unbind(0), alpha=1 - h.beta2)
    row, col = torch.stack(rows).div_(bias2), torch.stack(cols).div_(bias2)
    scale = row.mean(dim=1, keepdim=True).clamp(min=_TINY)
    s = (row[:, :, None] * col[:, None, :] / scale[:, :, None]).sqrt_()
    return s.mT if tall else s


def _rms_each(t: Tensor) -> Tensor:
    return t.square().mean(dim=(1, 2), keepdim=True).sqrt()


def _apply_grouped(params: Sequence[Tensor], update: Tensor, h: Hyper, scale: float) -> None:
    """:func:`apply_update` for every matrix at once (``update``: the stack, in the parameters' orientation)."""
    if h.weight_decay:
        torch._foreach_mul_(list(params), 1 - h.lr * h.weight_decay)
    torch._foreach_add_(list(params), update.to(params[0].dtype).unbind(0), alpha=-h.lr * scale)
