"""The error-feedback buffer kept *unfolded* by the grouped step (:mod:`lightning_lordo.optim.functional`).

Folded, the buffer is the error feedback ``E`` itself: each step forms ``A = G + gamma E``, projects it (``g = Q^T
A``) and writes ``E <- A - Q g``, a third matmul per matrix besides the projection and the back-projection.
Unfolded, the buffer holds ``R`` and the state this step's projection ``c = Q^T R`` (key :data:`EF_PROJECTION`),
with ``E = R - Q c`` (an orthonormal ``Q``, the one the buffer was unfolded in). A step then updates ``R <- G +
gamma R`` in place and projects it, and since ``A = R - gamma Q c_prev``::

    g = Q^T A = c - gamma c_prev,    E_new = A - Q g = R - Q c

so ``E`` is never formed. Whatever reads or replaces the buffer from outside the step folds it first
(:func:`fold_error_feedback`: new bases, averaged buffers, a change of its dtype or its removal on a resume; a reset
zeroes it and drops ``c``; the values do not change). An overlapped landing adds its local progress to ``R`` as it
is, which is linear and keeps ``E = R - Q c``. The step folds a whole bucket (a stack), and computes ``E`` itself, where
``Q^T E`` may be large or ``c`` was not kept for every matrix of it: the first step, the first in a new basis,
every :data:`FOLD_EVERY`-th step and a step that collects diagnostics. So ``c`` sums at most :data:`FOLD_EVERY`
projected gradients, which bounds the cancellation in ``c - gamma c_prev``. Checkpoints hold ``R`` and ``c`` as
they are (a resume continues bit for bit); a version of the plugin older than this one would read ``R`` as ``E``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_lordo._tensors import stack_slices

#: The state key of an unfolded buffer's projection ``c``, and how often (in steps) the step folds it at the latest.
EF_PROJECTION = "ef_projection"
FOLD_EVERY = 32


def fold_error_feedback(state: dict[str, Tensor]) -> None:
    """Make an unfolded buffer the error feedback itself again, ``E = R - Q c``; a no-op for a folded one."""
    c = state.pop(EF_PROJECTION, None)
    if c is not None:
        state["error_feedback"].addmm_(state["basis"], c, alpha=-1)


def fold_each(states: Sequence[dict[str, Tensor]]) -> None:
    """:func:`fold_error_feedback` of every state, the buffers of one shape in stacks of at most ``STACK_BYTES``:
    one batched product ``Q c`` and one foreach subtraction per stack (the accelerators' layout; the same values up to
    float32 rounding)."""
    groups: dict[tuple[object, ...], list[dict[str, Tensor]]] = defaultdict(list)
    for s in states:
        if EF_PROJECTION in s:
            e = s["error_feedback"]
            groups[(tuple(e.shape), e.dtype, e.device, tuple(s["basis"].shape))].append(s)
    for same in groups.values():
        for part in stack_slices(len(same), same[0]["error_feedback"].numel()):
            stack = same[part]
            if len(stack) == 1:
                fold_error_feedback(stack[0])
                continue
            product = torch.bmm(torch.stack([s["basis"] for s in stack]), torch.stack([s.pop(EF_PROJECTION)
                                                                                      for s in stack]))
            torch._foreach_sub_([s["error_feedback"] for s in stack], product.unbind(0))


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
