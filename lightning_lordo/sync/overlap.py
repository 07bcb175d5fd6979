"""Overlapped synchronization (``overlap_steps = tau``): a round's collectives run while local steps go on.

At the K-th local step of a round the worker *launches* the round: it copies what the round reads (its
pseudo-gradient ``delta = anchor - params``, its buffers, the optimizer state to average) and a thread runs every
collective of the round on those copies, over a side process group (so it never pairs with the main group's
collectives, such as Lightning's per-batch flags). The worker keeps taking local steps. ``tau`` steps later every
worker *lands* the round at the same step: it waits for the thread (bounded by the timeout) and commits, keeping its
local progress since the launch:

* parameters: ``params <- new_anchor + (params - params_at_launch)`` (a copy of the parameters is kept while the
  round is in flight: with no step since the launch the parameters become exactly the new anchor);
* averaged optimizer state, each tensor decayed by a factor beta per step (Adam's moments: beta1 for ``exp_avg``,
  beta2 for ``exp_avg_sq``; a momentum buffer: momentum; the error feedback: ``ef_decay``; :func:`_decays`):
  ``x <- beta^s mean + (x - beta^s x_at_launch)`` with ``s`` the steps since the launch, i.e. the state as if the
  average had been in place at the launch and the local updates since applied to it (linear: for an error-feedback
  buffer that the steps since keep unfolded, ``E = R - Q c``, adding ``R``'s progress adds ``E``'s); then the new
  bases are installed and the moments rotated into them;
* buffers: ``b <- mean + (b - b_at_launch)``.

So the averages, the new bases and the anchor are bitwise identical on every rank, and reach every rank at the
same optimizer step; the parameters and moments differ between ranks by their own local progress, as they do
between syncs. A non-finite round is discarded on every worker at the landing (parameters back to the anchor,
local progress since the launch included). The next round's pseudo-gradient covers the K steps since the launch.

Checkpoints: a checkpoint taken while a round is in flight *waits* for the thread (so the bytes it counted are
complete) and stores the launch's copies; the resumed run redoes the round's collectives from them (the result is
identical: the payload state only changes at the commit), without counting their bytes again, and lands it at the
same step. The final synchronization of ``fit`` lands the round in flight first.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo.comm.communicator import CollectiveTimeout, CommAccountant, Communicator
from lightning_lordo.optim.functional import Hyper
from lightning_lordo.sync import exchange as ex
from lightning_lordo.sync.basis_window import BasisWindow
from lightning_lordo.sync.report import SyncReport

Entries = dict[str, list[tuple[Tensor, list[Tensor]]]]


@dataclass
class Launch:
    """What a launched round read (copies), where it started, and what its thread brought back."""

    step: int  # optimizer step of the launch
    sync_index: int  # the number of the sync it is (syncs_done + 1 at the launch)
    params: list[Tensor]  # the parameters at the launch
    deltas: list[Tensor]  # the pseudo-gradient, anchor - params
    buffers: list[Tensor]
    live: Entries  # the optimizer state tensors the averages go into
    copies: Entries  # their values at the launch (what the thread averages)
    exchange_seconds: float = 0.0  # how long the round's collectives and bases took (not the local steps beside them)
    result: Optional[ex.Exchange] = None
    error: Optional[BaseException] = None
    thread: Optional[threading.Thread] = None
    stepped: set[int] = dataclasses.field(default_factory=set)  # the holders it took (given back if it is discarded)

    def state_dict(self) -> dict[str, Any]:
        """This worker's copies (per rank; the live entries are found again from the optimizer)."""
        return {"step": self.step, "sync_index": self.sync_index, "params": self.params, "buffers": self.buffers,
                "copies": {k: [ts for _, ts in v] for k, v in self.copies.items()}}


def launch(step: int, sync_index: int, params: list[Tensor], deltas: list[Tensor], buffers: Sequence[Tensor],
           live: Entries, copies: Optional[dict[str, list[list[Tensor]]]] = None) -> Launch:
    """A launch from the live state (copied now), or from saved ``copies`` (a resumed checkpoint)."""
    if copies is None:
        snap = {k: [(p, [t.detach().clone() for t in ts]) for p, ts in v] for k, v in live.items()}
    else:
        snap = {k: [(p, [c.to(t.device) for c, t in zip(saved, ts, strict=True)])
                    for (p, ts), saved in zip(v, _saved(copies, k, v), strict=True)] for k, v in live.items()}
    return Launch(step, sync_index, params, deltas, [b.detach().clone() for b in buffers], live, snap)


def _saved(copies: dict[str, list[list[Tensor]]], purpose: str, live: list[tuple[Any, list[Tensor]]]
           ) -> list[list[Tensor]]:
    """The saved copies of ``purpose``; a checkpoint written before the holders' flags (one per moment) averaged
    every moment over every worker: all held."""
    saved = copies.get(purpose, [])
    if purpose == "holders" and (len(saved) != len(live) or saved and saved[0][0].shape != live[0][1][0].shape):
        return [[torch.ones_like(ts[0])] for _, ts in live]
    return saved


def run_now(round_: Launch, run: Callable[[Launch], ex.Exchange]) -> None:
    """``run(round_)`` (the round's collectives), timed; its result or exception is kept on ``round_``."""
    begin = time.perf_counter()
    try:
        round_.result = run(round_)
    except BaseException as err:  # re-raised on the training thread at the landing
        round_.error = err
    round_.exchange_seconds = time.perf_counter() - begin


def start(round_: Launch, run: Callable[[Launch], ex.Exchange]) -> None:
    """:func:`run_now` on a thread of its own."""
    round_.thread = threading.Thread(target=run_now, args=(round_, run), name=f"lordo-sync-{round_.sync_index}",
                                     daemon=True)
    round_.thread.start()


def wait(round_: Launch, timeout_s: float, context: str) -> ex.Exchange:
    """The round's exchange once its thread ended (within ``timeout_s`` plus a margin), or its error.

    Raises:
        CollectiveTimeout: the thread is still running after the timeout, or a collective in it failed.
    """
    if round_.thread is not None:
        round_.thread.join(timeout_s + 5.0)  # the thread's own collectives time out first, naming the collective
    if round_.thread is not None and round_.thread.is_alive():
        raise CollectiveTimeout(f"LoRDO {context}: the overlapped round launched at optimizer step {round_.step} did "
                                f"not finish within {timeout_s:g} s. A peer is dead or hangs.")
    if round_.error is not None:
        raise round_.error
    assert round_.result is not None
    return round_.result


def corrected(round_: Launch, result: ex.Exchange, optimizer: Optimizer, live_buffers: Sequence[Tensor],
              steps: int) -> ex.Exchange:
    """The exchange with its averaged state and buffers carrying this worker's local progress over the ``steps``
    steps since the launch (module docstring), written to the live tensors; ``result`` itself is not changed."""
    state: dict[str, ex.StateEntries] = {}
    for purpose, entries in result.state.items():
        rows = []
        for (p, snap, means), (_, live) in zip(entries, round_.live[purpose], strict=True):
            decays = _decays(optimizer, p, live, steps)
            rows.append((p, live, [m * d + (x - c * d) for m, x, c, d in zip(means, live, snap, decays)]))
        state[purpose] = rows
    new = []
    for floating, means in ((True, result.buffers[0]), (False, result.buffers[1])):
        live = [b for b in live_buffers if b.is_floating_point() == floating]
        snap = [b for b in round_.buffers if b.is_floating_point() == floating]
        # alone nothing was averaged (no means): the live buffers stay as they are; a non-finite local change (a bad
        # input's running statistics) is dropped, so the repaired average lands as on the blocking path
        new.append([_plus_finite(m, x - c) if floating else m + (x - c)
                    for m, x, c in zip(means, live, snap, strict=True)] if means else [])
    return dataclasses.replace(result, buffers=(new[0], new[1]), state=state)


def _plus_finite(mean: Tensor, change: Tensor) -> Tensor:
    """``mean + change`` where ``change`` is finite, ``mean`` elsewhere."""
    return torch.where(torch.isfinite(change), mean + change, mean)


def progress(round_: Launch, params: Sequence[Tensor]) -> list[Tensor]:
    """Each parameter's local progress since the launch (exactly zero without a step since)."""
    return [p.detach() - t for p, t in zip(params, round_.params)]


def _decays(optimizer: Optimizer, p: Tensor, live: list[Tensor], steps: int) -> list[float]:
    """decay^steps for each of ``p``'s averaged state tensors: the factor by which one step scales what the tensor
    held before it (Adam's exp_avg, exp_avg_sq and the factors of a factored exp_avg_sq: beta1, beta2; SGD's
    momentum buffer: momentum; LoRDO's error feedback: ef_decay, its buffer staying in the complement of the basis
    the round does not change); 1 for any other (a running maximum)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    beta1, beta2 = group.get("betas", (1.0, 1.0))
    keys = {id(v): k for k, v in optimizer.state[p].items() if isinstance(v, Tensor)}
    factor = {"exp_avg": beta1, "exp_avg_sq": beta2, "factored_row": beta2, "factored_col": beta2,
              "momentum_buffer": group.get("momentum", 1.0)}
    if "error_feedback" in keys.values():
        factor["error_feedback"] = Hyper.of(group).ef_decay
    return [float(factor.get(keys.get(id(t), ""), 1.0)) ** steps for t in live]


class OverlappedRounds:
    """The synchronizer's overlapped rounds (a base of :class:`~lightning_lordo.sync.synchronizer.Synchronizer`,
    which owns every attribute used here: the communicators, the anchor, the optimizer, the counters)."""

    in_flight: Optional[Launch]
    window: BasisWindow
    comm: Communicator
    overlap_comm: Communicator

    def _launch(self) -> None:
        """Start the round's collectives on a thread (``overlap_steps``; :mod:`lightning_lordo.sync.overlap`)."""
        self.comm.accountant.start_round()
        params = [p.detach().clone() for p in self.params]
        launched = launch(self.optimizer_steps, self.syncs_done + 1, params, self.anchor.deltas(params), self.buffers,
                          self.averaged_entries())
        if launched.sync_index % self.config.moments_every == 0:  # it averages the moments: its holders go with it
            launched.stepped, self.stepped = self.stepped, set()
        self.steps_since_sync = 0
        self._start(launched, self.overlap_comm)

    def _start(self, launched: Launch, comm: Communicator) -> None:
        """The launched round's collectives: on a thread over the side group, or here and now without one (one
        process; or a round in flight at a save resumed with ``overlap_steps=0``: every rank is at the resume)."""
        self.in_flight = launched
        comm.context = f"sync {launched.sync_index} (launched at optimizer step {launched.step}, overlapped)"

        def run(r: Launch) -> ex.Exchange:
            return self.exchange(comm, r.deltas, r.buffers, r.copies, r.step, self.window.due(r.sync_index))

        (run_now if comm.group is self.comm.group else start)(launched, run)

    def overlap_state_dict(self) -> Optional[dict[str, Any]]:
        """This worker's copies of the round in flight (call :meth:`wait_in_flight` first), or ``None``."""
        return self.in_flight.state_dict() if self.in_flight is not None else None

    def load_overlap_state_dict(self, saved: dict[str, Any]) -> None:
        """Redo the saved round's collectives from its copies (every worker together; their bytes are not counted
        again: the checkpoint's totals hold them). It lands at the same step as it would have."""
        scratch = Communicator(CommAccountant(), self.overlap_comm.timeout, group=self.overlap_comm.group)
        params = [t.to(p.device) for t, p in zip(saved["params"], self.params, strict=True)]
        buffers = [b.to(live.device) for b, live in zip(saved["buffers"], self.buffers, strict=True)]
        launched = launch(saved["step"], saved["sync_index"], params, self.anchor.deltas(params), buffers,
                          self.averaged_entries(fold=False), saved["copies"])  # as the run that saved left them
        self._start(launched, scratch)

    def _land_in_flight(self) -> SyncReport:
        """Wait for the round in flight and commit it with this worker's local progress since its launch."""
        launched = self.in_flight
        assert launched is not None
        result = wait(launched, self.config.timeout.total_seconds(), self.overlap_comm.context)
        self.in_flight = None
        self.comm.context = f"sync {launched.sync_index} (landing)"
        steps = self.steps_since_sync
        fixed = corrected(launched, result, self.optimizer, self.buffers, self.optimizer_steps - launched.step)
        # the report's seconds: the exchange's and the landing's, not the local steps taken beside the exchange
        report = self.land(fixed, time.perf_counter() - launched.exchange_seconds, progress(launched, self.params),
                           launched.step)
        report.taken_at = launched.step
        self.steps_since_sync = steps  # the schedule counts from the launch
        if not fixed.finite:  # a discarded round's moments are averaged at the next one, with its holders
            self.stepped |= launched.stepped
        return report

    def wait_in_flight(self) -> None:
        """Let the round in flight finish its collectives (a checkpoint's bytes and state are then complete)."""
        if self.in_flight is not None:
            wait(self.in_flight, self.config.timeout.total_seconds(), self.overlap_comm.context)

    def drop_in_flight(self) -> None:
        """Let the round in flight finish its collectives (every rank takes part), then forget it: a loaded
        checkpoint made it obsolete."""
        self.wait_in_flight()
        self.in_flight = None

    def let_in_flight_end(self) -> None:
        """A loop that failed: the round in flight's thread ends (its collectives finish or time out) before the
        process tears its process groups down, which would abort it and hide the user's exception. Not landed."""
        launched = self.in_flight
        if launched is not None and launched.thread is not None:
            launched.thread.join(self.config.timeout.total_seconds() + 5.0)

    def finish(self) -> list[SyncReport]:
        """The end of training: land the round in flight, then a final blocking sync of the steps after it."""
        reports = [self._land_in_flight()] if self.in_flight is not None else []
        if self.steps_since_sync > 0:
            reports.append(self.sync())
        return reports

    @property
    def mid_round(self) -> bool:
        """Whether the replicas may differ from the anchor (local steps since the last sync, or a round in flight)."""
        return self.steps_since_sync > 0 or self.in_flight is not None

