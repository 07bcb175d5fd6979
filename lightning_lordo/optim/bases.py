"""New bases for many low-rank matrices at once (SPEC §4.4-4.5), the grouped path of :meth:`LoRDO.compute_bases` and
:meth:`LoRDO.set_bases`.

Matrices of one shape (and rank, projection and device) are stacked, so a power step is one batched matmul pair and
one batched QR for the whole stack, and the rotation of the moments one batched product: the number of dispatched
operations of a sync grows with the number of distinct shapes, not with the number of matrices (a GPT has three).
The per-matrix functions of :mod:`lightning_lordo.optim.projection` are the readable reference; tests compare both.
Nothing here reads a value back to the host but the CPU step counters (one stacked read per call). Each param
group counts the steps between its bases (:func:`record_refresh`), which ``ef_decay="auto"`` reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_lordo._tensors import all_finite, is_tall
from lightning_lordo.optim.functional import EF_PROJECTION, fold_error_feedback, stack_slices
from lightning_lordo.optim.projection import power_basis, rotate_moments, subspace_movement, svd_basis

#: ``(parameter, its group, its rank)``, as :meth:`LoRDO._lowrank_entries` lists them.
Entry = tuple[Tensor, dict[str, Any], int]
_RESET_KEYS = ("exp_avg", "exp_avg_sq", "factored_row", "factored_col")


def batchable(group: Mapping[str, Any], warm: Any) -> bool:
    """Whether a matrix's next basis can be computed in a stack: exact SVD, or power steps from a warm start (the
    randomized finder and the first power basis draw seeded random numbers per matrix)."""
    return group["projection"] == "svd" or (group["projection"] == "power" and warm is not None)


def spanned(entries: Sequence[Entry], spans: Mapping[Tensor, Tensor]) -> dict[Tensor, Tensor]:
    """``{param: Q}`` for the ``entries`` whose new basis is their ``spans[param]`` as it is: an orthonormal basis
    ``Q`` (``a x r``, canonical) of the column space of the matrix the basis is computed from, as a low-rank
    payload's round gives for its averaged update ``Q B`` (SPEC §5: the new basis is ``orth(P)``). It applies with
    the ``power`` projection at ``Q``'s rank, whose warm-started step on ``Q B`` would only turn the basis within
    ``span(Q)``, at the cost of a dense ``Q B`` and a QR per matrix; the other projections compute theirs."""
    return {p: spans[p] for p, group, r in entries
            if p in spans and group["projection"] == "power" and spans[p].shape[-1] == r}


def compute_stacked(entries: Sequence[Entry], sources: Mapping[Tensor, Tensor], warm: Mapping[Tensor, Any]
                    ) -> dict[Tensor, Tensor]:
    """``{param: basis}`` for ``entries`` (all :func:`batchable`), one stack per shape, rank, projection, power steps
    and device; each basis is a view of its stack (``a x r``, float32, canonical orientation)."""
    stacks: dict[tuple[Any, ...], list[Tensor]] = defaultdict(list)
    for p, group, r in entries:
        key = (tuple(p.shape), r, group["projection"], group["power_iters"], sources[p].device)
        stacks[key].append(p)
    bases: dict[Tensor, Tensor] = {}
    for (_, r, projection, iters, _), same in stacks.items():
        for part in stack_slices(len(same), same[0].numel()):  # the stack is a copy: bound it
            bases.update(_stacked_bases(same[part], sources, warm, r, projection, iters))
    return bases


def _stacked_bases(params: Sequence[Tensor], sources: Mapping[Tensor, Tensor], warm: Mapping[Tensor, Any], r: int,
                   projection: str, iters: int) -> dict[Tensor, Tensor]:
    """The bases of same-shape ``params``, one stacked computation."""
    stacked = torch.stack([sources[p] for p in params])  # the parameters' orientation
    m = stacked.mT if is_tall(params[0]) else stacked
    q = svd_basis(m, r) if projection == "svd" else power_basis(m, torch.stack([warm[p] for p in params]), iters)
    return dict(zip(params, q.unbind(0)))


def check_shapes(entries: Sequence[Entry], bases: Mapping[Tensor, Tensor]) -> None:
    """Refuse, before any is installed, a basis that does not fit its matrix (``a x r``: smaller side by rank;
    float32, on the parameter's device)."""
    for p, _, r in entries:
        q = bases[p]
        if tuple(q.shape) != (min(p.shape), r) or q.dtype != torch.float32 or q.device != p.device:
            raise ValueError(f"Invalid basis ({tuple(q.shape)}, {q.dtype}, {q.device}) for a {tuple(p.shape)} "
                             f"weight on {p.device} at rank {r}: it must be {(min(p.shape), r)}, the smaller side by "
                             f"the rank, float32 on {p.device}, as compute_bases gives it.")


def check_sources(entries: Sequence[Entry], sources: Mapping[Tensor, Tensor]) -> Mapping[Tensor, Tensor]:
    """Refuse a source of a basis (``install_bases``) shaped unlike its weight, or not finite (a NaN source gives a
    NaN basis, which the next bases, warm-started from it, keep); returns ``sources``."""
    given = [p for p, _, _ in entries if p in sources]
    if all(sources[p].shape == p.shape for p in given) and all_finite(sources[p] for p in given):
        return sources
    bad = next(p for p in given if sources[p].shape != p.shape or not all_finite([sources[p]]))
    raise ValueError(f"Invalid source of shape {tuple(sources[bad].shape)} for the basis of a {tuple(bad.shape)} "
                     f"weight (finite: {all_finite([sources[bad]])}): it must be a finite matrix of the weight's shape "
                     "(e.g. its gradient).")


def install_stacked(entries: Sequence[Entry], states: Sequence[dict[str, Tensor]], bases: Mapping[Tensor, Tensor]
                    ) -> dict[Tensor, Tensor]:
    """Install ``bases`` into ``states`` (one per entry) and move the moments into them (``transition``), stacked by
    shape, rank, knobs and step count; unfolded error-feedback buffers are folded first, in their old bases, stacked
    too (:func:`fold_each`). Returns ``{param: movement}`` (0-d tensors, not
    read) for the matrices that had a basis."""
    steps = torch.stack([s["step"] for s in states]).tolist() if states else []  # CPU counters: one read
    fold_each(states)
    stacks: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, ((p, group, _), state) in enumerate(zip(entries, states)):
        if state.get("basis") is None:
            state["basis"] = bases[p]
            continue
        key = (tuple(p.shape), group["transition"], group["variance_clamp"], tuple(group["betas"]),
               steps[i], state["basis"].device)
        stacks[key].append(i)
    movement: dict[Tensor, Tensor] = {}
    for (_, transition, clamp, (beta1, beta2), t, _), index in stacks.items():
        group_states = [states[i] for i in index]
        old = torch.stack([s["basis"] for s in group_states])
        new = torch.stack([bases[entries[i][0]] for i in index])
        change = torch.bmm(new.mT, old)
        if transition == "reset" and t:
            for key in _RESET_KEYS:
                present = [s[key] for s in group_states if key in s]
                if present:
                    torch._foreach_zero_(present)
            torch._foreach_zero_([s["step"] for s in group_states])
        elif transition == "rotate" and t:
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in group_states], [s["exp_avg_sq"] for s in group_states]
            u, v = rotate_moments(torch.stack(exp_avgs), torch.stack(exp_avg_sqs), change, 1 - beta1**t,
                                  1 - beta2**t, clamp=clamp)
            torch._foreach_copy_(exp_avgs, u.unbind(0))
            torch._foreach_copy_(exp_avg_sqs, v.unbind(0))
        moved = subspace_movement(old, new, change).unbind(0)
        for i, m in zip(index, moved):
            states[i]["basis"] = bases[entries[i][0]]
            movement[entries[i][0]] = m
    return movement


def install_reference(entries: Sequence[Entry], states: Sequence[dict[str, Tensor]], bases: Mapping[Tensor, Tensor]
                      ) -> dict[Tensor, Tensor]:
    """:func:`install_stacked` one matrix at a time (:func:`transition_reference`), the readable reference."""
    movement = {}
    for (p, group, _), state in zip(entries, states):
        old, new = state.get("basis"), bases[p]
        fold_error_feedback(state)  # in the basis it was unfolded in
        if old is not None:
            transition_reference(state, group, old, new)
            movement[p] = subspace_movement(old, new)
        state["basis"] = new
    return movement


def transition_reference(state: dict[str, Tensor], group: Mapping[str, Any], old: Tensor, new: Tensor) -> None:
    """One matrix's moments moved from basis ``old`` into ``new`` by its group's ``transition`` (the reference of
    :func:`install_stacked`; the caller installs ``new``)."""
    kind = group["transition"]
    t = state["step"].item()
    if kind == "keep" or t == 0:
        return
    if kind == "reset":
        for key in _RESET_KEYS:
            if key in state:
                state[key].zero_()
        state["step"].zero_()
        return
    beta1, beta2 = group["betas"]
    u, v = rotate_moments(state["exp_avg"], state["exp_avg_sq"], new.mT @ old, 1 - beta1**t, 1 - beta2**t,
                          clamp=group["variance_clamp"])
    state["exp_avg"].copy_(u)
    state["exp_avg_sq"].copy_(v)


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
            del product  # before the next stack's: at most one stack's product at a time


#: A param group's counters (Python ints, saved with its knobs): its steps since its low-rank bases last changed,
#: and the steps between its last two changes (0: fewer than two seen), which ``ef_decay="auto"`` reads.
REFRESH_COUNTERS = ("since_refresh", "refresh_interval")


def start_counting(group: dict[str, Any]) -> None:
    """Give ``group`` its :data:`REFRESH_COUNTERS` (a new group, or one from a checkpoint older than them)."""
    for key in REFRESH_COUNTERS:
        group.setdefault(key, 0)


def record_refresh(groups: Sequence[dict[str, Any]]) -> None:
    """New bases in ``groups`` (each group once): the steps since the previous ones become its refresh interval."""
    for group in {id(g): g for g in groups}.values():
        if group["since_refresh"]:
            group["refresh_interval"], group["since_refresh"] = group["since_refresh"], 0

