r"""One LoRDO step as functions of tensors (SPEC §3, §6, §6b): the knobs it reads (:class:`Hyper`) and the grouped
path (same-shape matrices stacked: dispatched ops do not grow with their number), whose readable twin is
:mod:`~lightning_lordo.optim.reference`. A step runs only this and :mod:`~lightning_lordo.optim.lordo`. For a
low-rank matrix ``a x b`` (``a <= b``; a tall one is worked on transposed) with basis ``Q`` (``a x r``)::

    A = G + gamma E;  g = Q^T A;  E <- A - Q g                      (error feedback, optional)
    u <- beta1 u + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2
    "lordo":                D = (1 - omega) In / (mu (S + eps)) + omega Q (u_hat / (sqrt(v_hat) + eps))
    "unnormalized_lowrank": D = (1 - omega) In / (mu (S + eps)) + omega Q u_hat
    "subspace_qh":          D = Q ((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)
    W <- W (1 - lr lambda) - lr D

with ``In`` the full-rank input (``G``, or ``A`` with ``full_rank_input="accumulated"``) and ``S`` the normalizer of
SPEC §6. ``stats``, when given, collects the sums behind :meth:`LoRDO.diagnostics` (only when asked for).

**Unfolded error feedback** (where :func:`can_unfold`): the buffer holds ``R`` and the state ``c = Q^T R`` (key
:data:`EF_PROJECTION`), with ``E = R - Q c``. A step updates ``R <- G + gamma R`` in place and projects it; then
``g = c - gamma c_prev`` and ``E_new = R - Q c``, so no third matmul forms ``E``. Whatever reads or replaces the
buffer from outside the step folds it first (:func:`fold_error_feedback`), as does the step where ``c`` is missing,
every :data:`FOLD_EVERY`-th step (bounding the cancellation) and with diagnostics. Checkpoints hold ``R`` and ``c``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim.adamw import adamw as torch_adamw

from lightning_lordo.optim.compiled import apply_tail

TINY = torch.finfo(torch.float32).tiny
#: The most bytes of one stack of same-shape matrices (a float32 copy): a bounded transient whatever the depth.
STACK_BYTES = 64 * 2**20


def stack_slices(count: int, numel: int) -> list[slice]:
    """Slices of ``count`` matrices of ``numel`` each, in stacks of at most :data:`STACK_BYTES` as float32 (>= 1)."""
    per = max(1, STACK_BYTES // (4 * max(1, numel)))
    return [slice(start, start + per) for start in range(0, count, per)]


# ------------------------------------------------------------------------------------------------ the knobs
def resolve_rank(rank: Union[int, float], smaller_side: int) -> int:
    """The integer rank of a matrix with ``smaller_side`` for a configured ``rank`` (a float: a fraction of it)."""
    return max(1, int(math.floor(rank * smaller_side))) if isinstance(rank, float) else rank


@dataclass(frozen=True)
class Hyper:
    """The knobs of one param group that one step reads."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    omega: float
    update: str
    mu: Union[float, str]
    normalizer: str
    lifted_floor: float
    full_rank_input: str
    error_feedback: bool
    ef_decay: float  # "auto" resolved: :func:`auto_ef_decay`
    update_scale: Union[float, str]
    fullrank_state: str = "adamw"

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        decay = group["ef_decay"]
        return cls(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                   omega=group["omega"], update=group["update"], mu=group["mu"], normalizer=group["normalizer"],
                   lifted_floor=group["lifted_floor"], full_rank_input=group["full_rank_input"],
                   error_feedback=group["error_feedback"],
                   ef_decay=auto_ef_decay(beta1, group.get("refresh_interval")) if decay == "auto" else decay,
                   update_scale=group["update_scale"], fullrank_state=group["fullrank_state"])

    def scale(self, basis: Tensor) -> float:
        """The factor of this matrix's update (not of its weight decay): ``sqrt(a / r)`` for ``update_scale="auto"``
        (``basis``: ``a x r``, or a stack of them), else the number given."""
        if self.update_scale != "auto":
            return float(self.update_scale)
        a, r = basis.shape[-2:]
        return math.sqrt(a / r)


#: The longest memory of ``ef_decay="auto"``, and its value while a matrix's basis has not changed yet.
AUTO_EF_DECAY_MAX = 0.99


def auto_ef_decay(beta1: float, refresh_interval: Optional[float]) -> float:
    """``ef_decay="auto"``: ``1 - 1/n`` for bases every ``n`` steps, within ``[beta1, 0.99]``: the buffer remembers
    about one basis interval, what the next basis can take in (longer, stale directions fight each new basis)."""
    if not refresh_interval:
        return AUTO_EF_DECAY_MAX
    return min(AUTO_EF_DECAY_MAX, max(beta1, 1.0 - 1.0 / refresh_interval))


# ------------------------------------------------------------------------------------------------ error feedback
#: The state key of an unfolded buffer's projection ``c``, and how often (in steps) the step folds it at the latest.
EF_PROJECTION = "ef_projection"
FOLD_EVERY = 32


def fold_error_feedback(state: dict[str, Tensor]) -> None:
    """Make an unfolded buffer the error feedback itself again, ``E = R - Q c``; a no-op for a folded one."""
    c = state.pop(EF_PROJECTION, None)
    if c is not None:
        state["error_feedback"].addmm_(state["basis"], c, alpha=-1)


def unfold_now(states: Sequence[dict[str, Tensor]], allowed: bool, t: float) -> bool:
    """Whether a step at count ``t`` takes these (same-bucket) buffers unfolded; if not, they are folded first.
    ``allowed``: the knobs allow it and no diagnostics are collected."""
    now = allowed and t % FOLD_EVERY != 0 and all(EF_PROJECTION in s for s in states)
    if not now:
        for s in states:
            fold_error_feedback(s)
    return now


def accumulate(sums: Sequence[Tensor], grads: Sequence[Tensor], decay: float) -> None:
    """``R <- G + decay R`` in place (``sums``: the buffers, oriented as ``grads``)."""
    if decay != 1.0:
        torch._foreach_mul_(sums, decay)
    torch._foreach_add_(sums, grads)


def unfolded_projection(states: Sequence[dict[str, Tensor]], projected: Tensor, decay: float) -> Tensor:
    """This step's ``c = Q^T R`` (``projected``, n x r x b) is kept in the states, and ``projected`` becomes the
    projected gradient ``c - decay c_prev`` in place; returns ``c_prev`` (stacked)."""
    previous = torch.stack([s[EF_PROJECTION] for s in states])
    torch._foreach_copy_([s[EF_PROJECTION] for s in states], projected.unbind(0))
    projected.sub_(previous, alpha=decay)
    return previous


def enter_unfolded(states: Sequence[dict[str, Tensor]], allowed: bool) -> None:
    """After a step that wrote ``E`` itself: ``E = R - Q 0``, so the next steps can keep it unfolded."""
    if allowed:
        for s in states:
            s[EF_PROJECTION] = torch.zeros_like(s["exp_avg"])


# ------------------------------------------------------------------------------------------------ AdamW parameters
def is_factored(p: Tensor, h: Hyper) -> bool:
    """Whether the full-rank ``p`` keeps the factored state (``fullrank_state="factored"``, 2-D or more, not empty)."""
    return h.fullrank_state == "factored" and p.ndim >= 2 and p.numel() > 0


def adamw_torch(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, fused: bool) -> None:
    """torch's own AdamW (foreach or ``fused``) for moments in the parameters' dtype; it counts the steps itself. The
    fused kernel needs a gradient laid out as its parameter; the foreach one takes no tensor LR (torch's loop does)."""
    grads = [p.grad if not fused or p.grad.stride() == p.stride() else torch.empty_like(p).copy_(p.grad)
             for p in params]
    torch_adamw(list(params), grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                [s["step"] for s in states], foreach=not fused and not isinstance(h.lr, Tensor), fused=fused,
                amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps,
                maximize=False)


# ------------------------------------------------------------------------------------------------ grouped low-rank
def lowrank_grouped(params: Sequence[Tensor], states: Sequence[dict[str, Tensor]], h: Hyper, t: float,
                    stats: Optional[dict[str, Tensor]] = None, in_place: Optional[bool] = None,
                    compiled: bool = False) -> None:
    """:func:`~lightning_lordo.optim.reference.lowrank_reference` for matrices of one shape, dtype and device at
    step count ``t``, in one of two layouts. ``in_place`` (the CPU's default, where memory passes cost the time;
    float32 weights, a fixed ``mu``, any normalizer but ``factored``): :func:`_lowrank_in_place`, no full-size tensor
    stacked. Otherwise (the accelerators' default, where each launch costs) stacked: one batched matmul per
    projection, foreach math, stacks of at most :data:`STACK_BYTES` (a bounded transient); ``compiled``: its last
    full-size pass compiled (:mod:`~lightning_lordo.optim.compiled`)."""
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
    weight's memory is not supported (autograd never makes one). Unfolded error feedback (:func:`can_unfold`): the
    full-rank term's input ``A = R - gamma Q c_prev`` (:func:`_fold_into_low`); 9 passes and 2 matmuls per matrix,
    against 11 and 3 folded."""
    tall = params[0].shape[0] > params[0].shape[1]  # worked on transposed (SPEC §2)
    bias1, bias2 = 1 - h.beta1**t, 1 - h.beta2**t
    allowed = can_unfold(states, h)
    unfold = h.error_feedback and unfold_now(states, allowed and stats is None, t)
    q = torch.stack([s["basis"] for s in states])  # n x a x r
    grads = [p.grad.mT if tall else p.grad for p in params]  # a x b views
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
            add_stat(stats, "ef_sq", sum(e.float().square().sum() for e in errors))
        enter_unfolded(states, allowed)
    u_hat, v_hat = _moments_grouped(states, projected.unbind(0), h, bias1, bias2)
    full_term = h.update != "subspace_qh" and h.omega < 1.0
    if h.update == "subspace_qh":
        low = u_hat.mul_(h.omega).add_(projected, alpha=1 - h.omega).div_(v_hat.sqrt().add_(h.eps))
    else:
        low = u_hat / (v_hat.sqrt() + h.eps) if h.update == "lordo" else u_hat
        low.mul_(h.omega)
        if stats is not None:
            add_stat(stats, "low_sq", torch.bmm(q, low).square().sum())
    value = (1.0 - h.omega) / h.mu
    if full_term:
        denom = _normalizer_grouped(states, q, h, None, v_hat, bias2, tall).add_(h.eps)  # in the weights' orientation
        _fold_into_low(low, previous, denom, h, tall)
    lr = h.lr * h.scale(q)  # the update's (not the weight decay's)
    for p, qi, li in zip(params, bases, low.unbind(0)):  # W <- W (1 - lr lambda) - lr Q (omega D_low)
        (p.mT if tall else p).addmm_(qi, li, beta=1 - h.lr * h.weight_decay, alpha=-lr)
    if not full_term:
        return
    full_inputs = [a.mT if tall else a for a in accumulated] if h.full_rank_input == "accumulated" \
        else [p.grad for p in params]
    denoms = denom.unbind(0)
    if stats is not None:
        add_stat(stats, "full_sq", sum((x / d).square().sum() for x, d in zip(full_inputs, denoms)) * value**2)
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
    tall = params[0].shape[0] > params[0].shape[1]  # worked on transposed (SPEC §2)
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
            add_stat(stats, "ef_sq", torch.stack(errors).float().square().sum())
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
            add_stat(stats, "low_sq", update.square().sum())
        _apply_grouped(params, update, h, h.scale(q))
        return
    denom = _normalizer_grouped(states, q, h, grad, v_hat, bias2, tall).add_(h.eps)  # S + eps, orientation of W
    full_input = accumulated if h.full_rank_input == "accumulated" else grad
    if h.mu == "auto":  # both terms the same RMS: needs the full-rank term's RMS first
        d_low = torch.bmm(*_back(q, low, tall))
        d_full = full_input / denom
        d_full.mul_(_rms_each(d_low) / _rms_each(d_full).clamp(min=TINY)).mul_(1.0 - h.omega)
        if stats is not None:
            add_stat(stats, "full_sq", d_full.square().sum())
            add_stat(stats, "low_sq", d_low.square().sum() * h.omega**2)
        _apply_grouped(params, d_full.add_(d_low, alpha=h.omega), h, h.scale(q))
        return
    _fold_into_low(low.mul_(h.omega), previous, denom, h, tall)
    update = torch.bmm(*_back(q, low, tall))  # omega D_low, then + (1 - omega) In / (mu (S + eps))
    if stats is not None:
        add_stat(stats, "low_sq", update.square().sum())
        add_stat(stats, "full_sq", (full_input / denom).square().sum() * ((1.0 - h.omega) / h.mu) ** 2)
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
    """:func:`~.reference._normalizer` for a stack (``n x r x b`` moments), broadcastable to the stacked parameters
    (a new tensor: the caller adds ``eps`` in place)."""
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
    scale = row.mean(dim=1, keepdim=True).clamp(min=TINY)
    s = (row[:, :, None] * col[:, None, :] / scale[:, :, None]).sqrt_()
    return s.mT if tall else s


def _rms_each(t: Tensor) -> Tensor:
    return t.square().mean(dim=(1, 2), keepdim=True).sqrt()


def _apply_grouped(params: Sequence[Tensor], update: Tensor, h: Hyper, scale: float) -> None:
    """:func:`~lightning_lordo.optim.reference.apply_update` for a stack (``update``: the parameters' orientation)."""
    if h.weight_decay:
        torch._foreach_mul_(list(params), 1 - h.lr * h.weight_decay)
    torch._foreach_add_(list(params), update.to(params[0].dtype).unbind(0), alpha=-h.lr * scale)


def add_stat(stats: Optional[dict[str, Tensor]], key: str, value: Tensor) -> None:
    if stats is not None:
        stats[key] = stats[key] + value if key in stats else value
