"""The collectives of one synchronization round, as functions that change nothing local: each returns averaged
copies (and, for the payloads, a round to commit later). :class:`~lightning_lordo.sync.synchronizer.Synchronizer`
runs them all first and commits afterwards, so a failure or an interruption in any of them leaves the worker as it
was (SPEC §4-5; torchft's exchange-then-commit).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo._tensors import all_finite, finite_flags, math_dtype, mix_seed, seeded_normal
from lightning_lordo.comm.communicator import Communicator
from lightning_lordo.comm.quantization import quantized_mean
from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.fullrank import is_factored
from lightning_lordo.optim.functional import Hyper
from lightning_lordo.optim.lordo import LoRDO

#: ``(parameter, its state tensors, their averages)`` for one purpose of :func:`average_state`.
StateEntries = list[tuple[Tensor, list[Tensor], list[Tensor]]]


@dataclass
class Exchange:
    """Everything one round's collectives brought; nothing of the worker changed yet.

    Attributes:
        averaged: the averaged pseudo-gradients, one per parameter (float32, float64 for float64 parameters).
        payload_rounds: ``(payload, round)`` pairs to commit (error feedback, right factors).
        buffers: the floating buffers' averages and the other buffers from rank 0.
        state: by purpose (``moments``, ``error_feedback``), the optimizer state to overwrite with its averages.
        bases: the new bases (``{param: basis}``), identical on every worker.
        checked: the parameters whose averaged optimizer state ``state_finite`` checks, in order.
        state_finite: one bool per ``checked`` parameter, whether its averaged state is finite (a tensor, read at
            the commit with the round's other figures; a non-finite one is reset there, on every worker alike).
        norm: the L2 norm of the averaged pseudo-gradients (a 0-d tensor, read at the commit).
        basis_seconds: the time spent computing the bases.
        finite: whether the averaged pseudo-gradients are finite (if not, ``state`` and ``bases`` stay empty).
        staged: the bucketed path with several processes (:mod:`lightning_lordo.sync.bucketed`): each parameter's
            new synchronized point, which the commit copies into the parameters and the anchor (``None``: the
            general path's ``averaged``, or one process's parameters as they are).
        streamed: the low-rank messages' rounds are streamed (``averaged`` is ``None`` at their parameters):
            :func:`~lightning_lordo.sync.bucketed.commit_streamed` commits the parameters.
    """

    averaged: list[Tensor]
    payload_rounds: list[tuple[Any, Any]]
    buffers: tuple[list[Tensor], list[Tensor]]
    state: dict[str, StateEntries] = field(default_factory=dict)
    bases: dict[Tensor, Tensor] = field(default_factory=dict)
    checked: list[Tensor] = field(default_factory=list)
    state_finite: Optional[Tensor] = None
    norm: Optional[Tensor] = None
    basis_seconds: float = 0.0
    finite: bool = True  # False: the averaged pseudo-gradient is not finite (the round is discarded everywhere)
    staged: Optional[list[Tensor]] = None
    streamed: bool = False


def average_buffers(comm: Communicator, buffers: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Floating buffers averaged and the others from rank 0, as copies (nothing alone: one process has nothing to
    average). Reads nothing: :func:`repair_buffers` handles a non-finite average."""
    if comm.world_size == 1:
        return [], []
    floating = comm.mean([b.detach() for b in buffers if b.is_floating_point()], "buffers")
    others = [b.detach().clone() for b in buffers if not b.is_floating_point()]
    comm.broadcast(others, "buffers")
    return floating, others


def repair_buffers(comm: Communicator, buffers: Sequence[Tensor]) -> list[Tensor]:
    """The floating buffers' averages when their plain average was not finite (identical on all workers): the mean
    of the finite values (one more all-reduce, only then), with a warning."""
    local = [b for b in buffers if b.is_floating_point()]
    finite = [torch.isfinite(b) for b in local]
    sums = [torch.where(f, b, torch.zeros_like(b)) for f, b in zip(finite, local)]
    counts = [f.float() for f in finite]
    comm.all_reduce_mean(sums + counts, "buffers")  # means of both: their ratio is the finite mean
    floating = [torch.where(c > 0, s.float() / c.clamp(min=1e-30), b.float()).to(b.dtype)
                for s, c, b in zip(sums, counts, local)]
    if comm.rank == 0:
        left = "" if all_finite(floating) else " Some values are non-finite on every worker and stay so."
        warnings.warn(f"LoRDO {comm.context}: module buffers are not finite on some worker; they are averaged "
                      f"over the workers where they are finite.{left}", RuntimeWarning, stacklevel=4)
    return floating


def read_figures(round_: Exchange, movement: dict[Tensor, Tensor], error_norm: Optional[Tensor]
                 ) -> tuple[float, Optional[float], float, list[Tensor]]:
    """The committed round's figures in one host read: the pseudo-gradients' norm, the mean subspace movement
    (``None`` without new bases), the payloads' error-feedback norm (0 without), and the parameters whose averaged
    optimizer state is not finite (to reset, on every worker alike)."""
    device = round_.norm.device if round_.norm is not None else torch.device("cpu")
    nothing = torch.zeros((), device=device)  # made where the figures are: no host-to-device copy before the read
    moved = torch.stack(list(movement.values())).mean() if movement else torch.full((), float("nan"), device=device)
    parts = [round_.norm if round_.norm is not None else nothing, moved,
             error_norm if error_norm is not None else nothing,
             round_.state_finite if round_.state_finite is not None else torch.ones(0, dtype=torch.bool, device=device)]
    values = torch.cat([t.to(device=device, dtype=torch.float32).reshape(-1) for t in parts]).tolist()
    reset = [p for p, ok in zip(round_.checked, values[3:]) if not ok]
    return values[0], (None if values[1] != values[1] else values[1]), values[2], reset


def commit_buffers(buffers: Sequence[Tensor], floating: list[Tensor], others: list[Tensor]) -> None:
    targets = [b for b in buffers if b.is_floating_point()] + [b for b in buffers if not b.is_floating_point()]
    for b, new in zip(targets, floating + others):
        b.copy_(new)


def averaged_state(optimizer: Optimizer, params: Sequence[Tensor], config: SyncConfig, moments_due: bool = True,
                   fold: bool = True, stepped: Optional[set[int]] = None) -> dict[str, list[tuple[Any, list[Tensor]]]]:
    """The optimizer state a sync averages, by purpose: ``(parameter, its tensors)`` pairs, the same parameters and
    shapes on every worker (the order of ``params``).

    ``moments`` (when ``moments_due``: every ``moments_every``-th sync): the low-rank moments in their current
    (old, shared) basis (global scope only) and, with ``average_fullrank_moments``, the full-rank parameters' moments
    (:func:`fullrank_moments`; zeros where this worker holds none). ``holders``: one flag per ``moments`` row,
    whether this worker holds that moment, i.e. stepped the parameter in the round (its position is in ``stepped``;
    ``None``: every one) and has its state; the average is over the workers that hold it (:func:`average_state`),
    so a branch that some worker never ran keeps its holders' moments. ``error_feedback``: the optimizer's
    error-feedback buffers, if asked for, folded first unless ``fold`` is false (a resumed overlapped round, whose
    averages come from the checkpoint's copies: the live tensors are only written, at the landing)."""
    lowrank = set(optimizer.lowrank_params()) if isinstance(optimizer, LoRDO) else set()
    groups = {p: g for g in optimizer.param_groups for p in g["params"]}
    moments, feedback, held = [], [], []
    for i, p in enumerate(params):
        state = optimizer.state.get(p, {})
        ran = stepped is None or i in stepped
        if p in lowrank:
            if moments_due and config.average_moments and config.basis_scope == "global" and "exp_avg" in state:
                moments.append((p, [state["exp_avg"], state["exp_avg_sq"]]))
                held.append(ran)
            if config.average_error_feedback and "error_feedback" in state:
                if fold:  # the average of E itself (each worker's R - Q c otherwise)
                    optimizer.fold_error_feedback([p])
                feedback.append((p, [state["error_feedback"]]))
        elif moments_due and config.average_fullrank_moments and p in groups:  # one the optimizer does not hold
            layout = fullrank_moments(optimizer, p, groups[p])  # never steps: no moments
            has = bool(layout) and all(k in state for k, _, _ in layout)
            if layout:
                moments.append((p, [state[k] if has else torch.zeros(shape, dtype=dtype, device=p.device)
                                    for k, dtype, shape in layout]))
                held.append(ran and has)
    holders = [(None, [_on_device(torch.tensor(held, dtype=torch.float32), params[0].device)])] if moments else []
    return {"moments": moments, "error_feedback": feedback, "holders": holders}


def _on_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device`` without the host waiting for the device: from pinned memory on CUDA."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def holder_shares(comm: Communicator, state: dict[str, list[tuple[Any, list[Tensor]]]]) -> Optional[Tensor]:
    """The share of the workers holding each ``moments`` row of ``state`` (:func:`averaged_state`), averaged across
    the workers (purpose ``holders``) before the round's read; ``None`` alone or without moments."""
    rows = state.get("holders") or []
    return comm.mean([rows[0][1][0]], "holders")[0] if rows and comm.world_size > 1 else None


def round_read(finite: Tensor, buffers_finite: Tensor, shares: Optional[Tensor]
               ) -> tuple[bool, bool, Optional[list[float]]]:
    """The round's one host read before the commit: whether its pseudo-gradients are finite, whether its buffers
    are, and the holders' shares (:func:`holder_shares`)."""
    flags = torch.stack([finite, buffers_finite.to(finite.device)])
    if shares is None:
        ok, buffers_ok = flags.tolist()
        return ok, buffers_ok, None
    values = torch.cat([flags.to(shares.dtype), shares.to(finite.device)]).tolist()
    return bool(values[0]), bool(values[1]), values[2:]


def fullrank_moments(optimizer: Optimizer, p: Tensor, group: dict[str, Any]
                     ) -> Optional[list[tuple[str, Any, tuple[int, ...]]]]:
    """The moments ``(key, dtype, shape)`` that ``optimizer`` keeps for the full-rank ``p``, known before its first
    step: LoRDO's (AdamW's, or the factored ones of ``fullrank_state="factored"``) and torch Adam/AdamW's moments,
    SGD's momentum; ``None`` for another optimizer."""
    if isinstance(optimizer, LoRDO):
        if is_factored(p, Hyper.of(group)):  # the factors average as the second moment's row and column means do
            # as fullrank.new_state makes them: the factors in the math dtype (a float64 weight's in float64)
            return [("exp_avg", torch.bfloat16, p.shape), ("factored_row", math_dtype(p.dtype), (p.shape[0],)),
                    ("factored_col", math_dtype(p.dtype), (math.prod(p.shape[1:]),))]
        return [(k, math_dtype(p.dtype), p.shape) for k in ("exp_avg", "exp_avg_sq")]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:3 if group.get("amsgrad") else 2]
        return [(k, p.dtype, p.shape) for k in keys]
    if isinstance(optimizer, torch.optim.SGD):
        return [("momentum_buffer", p.dtype, p.shape)] if group.get("momentum") else []
    return None


def average_state(comm: Communicator, state: dict[str, list[tuple[Any, list[Tensor]]]], config: SyncConfig,
                  shares: Optional[Sequence[float]] = None
                  ) -> tuple[dict[str, StateEntries], list[Tensor], Optional[Tensor]]:
    """Averages of ``state`` (from :func:`averaged_state`), in ``config.moments_dtype``; the parameters checked and,
    per parameter, whether its averages are finite (a bool tensor, not read; identical on every worker, the averages
    being identical). ``shares`` (read from :func:`holder_shares`, identical on every worker): a ``moments`` row that
    only some workers hold is averaged over them (the others send zeros); one that no worker holds keeps its values
    (the last round's average, or none). Alone nothing is averaged (the state stays as it is, and is only checked)."""
    out: dict[str, StateEntries] = {}
    checked: dict[Tensor, list[Tensor]] = {}  # parameter -> the tensors whose finiteness decides its reset
    partial = [j for j, s in enumerate(shares or []) if 0 < s < 1]
    flags = state["holders"][0][1][0] if partial else None  # this worker's, on the device: never read on the host
    for purpose, entries in state.items():
        if purpose == "holders" or not any(ts for _, ts in entries):
            continue
        sent = [[t * flags[j].to(t.dtype) for t in ts] if purpose == "moments" and j in partial else ts
                for j, (_, ts) in enumerate(entries)]
        tensors = [t for ts in sent for t in ts]
        if comm.world_size == 1:
            means = tensors
        elif config.moments_dtype == "float32":
            means = comm.mean(tensors, purpose)
        else:
            means = [m.to(t.dtype) for t, m in zip(tensors, quantized_mean(comm, tensors, purpose,
                                                                         config.moments_dtype).means)]
        rows, offset = [], 0
        for j, (p, ts) in enumerate(entries):
            mine = means[offset: offset + len(ts)]
            offset += len(ts)
            if purpose == "moments" and shares is not None and shares[j] == 0:
                mine = list(ts)  # nobody stepped it: the values every holder of the last average has
            elif purpose == "moments" and j in partial:
                torch._foreach_mul_(mine, 1.0 / shares[j])  # the mean over the workers that hold it
            rows.append((p, ts, mine))
            checked.setdefault(p, []).extend(mine)
        if comm.world_size > 1:
            out[purpose] = rows
    if not checked:
        return out, [], None
    return out, list(checked), _per_parameter(finite_flags([t for ts in checked.values() for t in ts]),
                                              [len(ts) for ts in checked.values()])


def _per_parameter(flags: Tensor, counts: list[int]) -> Tensor:
    """Per parameter, whether all of its ``counts[i]`` consecutive ``flags`` hold; nothing copied from the host when
    every parameter has as many tensors (the usual case: two moments each)."""
    if len(set(counts)) == 1:
        return flags.view(len(counts), counts[0]).all(dim=1)
    return torch.stack([part.all() for part in flags.split(counts)])


def commit_state(entries: dict[str, StateEntries]) -> None:
    targets = [t for rows in entries.values() for _, tensors, _ in rows for t in tensors]
    if targets:
        torch._foreach_copy_(targets, [m for rows in entries.values() for _, _, means in rows for m in means])


def average_gradients(comm: Communicator, params: Sequence[Tensor]) -> None:
    """DDP's gradient all-reduce (purpose ``gradients``): the mean over workers in place, a missing gradient
    counting as zeros. A parameter without a gradient on every worker keeps none (one flag per parameter travels
    with the gradients). Alone there is nothing to average: no op, no host read."""
    if comm.world_size == 1:
        return
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise RuntimeError("LoRDO's synchronous phase averages dense gradients only; use a dense embedding "
                           "(sparse=False).")
    missing = [i for i, p in enumerate(params) if p.grad is None]
    flags = torch.ones(len(params), device=params[0].device if params else None)  # one fill, not one op per flag
    for i in missing:
        flags[i] = 0.0
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    comm.average_temporaries([*grads, flags], "gradients")  # a bucket at a time: no second set of gradients
    if missing:  # read back only where this rank lacks a gradient (another rank's counts)
        held = flags.tolist()
        for i in missing:
            if held[i] > 0:
                params[i].grad = grads[i]


def average_first_gradients(comm: Communicator, grads: dict[Tensor, Tensor], config: SyncConfig
                            ) -> dict[Tensor, Tensor]:
    """The first bases come from the averaged first gradient (SPEC §4, purpose ``initial_gradients``), sent in
    ``config.payload_dtype`` (the reduced precisions perturb only the first bases, identically on every rank); a
    non-finite one (NaN/Inf on some worker) is replaced by a seeded random matrix, identical on all workers."""
    means = quantized_mean(comm, list(grads.values()), "initial_gradients", config.payload_dtype).means
    averaged = {p: m.float() for p, m in zip(grads, means)}
    # per element (finite_flags' norms would also flag a finite gradient whose norm passes the float range)
    finite = torch.stack([torch.isfinite(g).all() for g in averaged.values()]) if averaged else torch.ones(0)
    bad = [i for i, ok in enumerate(finite.tolist()) if not ok]  # one host read
    for i, p in enumerate(averaged):
        if i in bad:
            averaged[p] = seeded_normal(averaged[p].shape, mix_seed(config.seed, i, offset=104_729), averaged[p].device)
    if bad and comm.rank == 0:
        warnings.warn(f"LoRDO initial basis: the averaged first gradient of {len(bad)} weight matrices is not finite "
                      "(NaN/Inf on some worker); their first bases are seeded random ones instead.", RuntimeWarning,
                      stacklevel=3)
    return averaged
