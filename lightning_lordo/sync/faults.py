"""What the synchronization does with non-finite values and interruptions, and the helpers it uses for that.

Non-finite values (NaN/Inf from a bad batch or an overflow, on any worker). The decision is taken from the
*averaged* pseudo-gradients, which are identical on every worker (a NaN or Inf anywhere makes the average
non-finite), so every worker takes the same branch without an extra message:

* the round is discarded on every worker: no worker applies it, the anchor and the outer momentum stay as they
  were, the parameters go back to the anchor, and :attr:`Synchronizer.skipped_syncs` counts it (the monitor
  logs ``lordo/skipped_syncs``; rank 0 warns, naming the sync and the ranks that sent non-finite values);
* a bad worker's optimizer state is usually non-finite too (a NaN gradient poisons Adam's moments, the error
  feedback, the factored statistics, SGD's momentum buffer) and would poison every later step. One small
  all-reduce of flags (purpose ``fault_flags``, only on this path) tells every worker, per parameter, whether
  its optimizer state is non-finite on *any* worker; every worker then resets the state of exactly those
  parameters. The reset is the same on all workers on purpose: step counters stay identical across workers
  (LoRDO's bias corrections, its moment rotation and the seeds of randomized projections depend on them), and
  the next moment average mixes fresh moments with fresh moments, not zeros with a good worker's history.
  What a reset means:

  - :class:`~lightning_lordo.LoRDO`: the basis is kept (it only ever comes from finite averaged
    pseudo-gradients, identical on all workers); every other state tensor (low-rank or AdamW moments, error
    feedback, factored statistics) is zeroed and the step counter restarts at 0, as with
    ``transition="reset"``: zero moments with bias correction from step 1 are exactly fresh Adam moments. Keeping
    the old step count with zeroed moments would be wrong: ``1 - beta2^t`` near 1 with a nearly empty second
    moment inflates the next updates several-fold.
  - any other optimizer (AdamW, SGD, ... in the ``diloco`` preset): the parameter's state is cleared, so the
    optimizer initializes it afresh at its next step (``step`` 0, zero moments, no momentum buffer). An
    optimizer whose state already existed when the synchronizer was built (eager initialization, e.g.
    Adagrad) has its state tensors zeroed instead, keys kept.

Floating buffers (e.g. BatchNorm statistics) never discard a round (a buffer non-finite on every worker, e.g.
with one worker, would otherwise discard every later round): when their average is not finite (the same
decision on every worker), they become the element-wise mean of the finite values across workers instead (one
more all-reduce, only then), with a warning; a value non-finite on every worker stays as it is.

Also: the first bases (``initial_basis="gradient"``) of a matrix whose averaged first gradient is non-finite come
from a seeded random matrix (identical on all workers) instead, with a warning; and after a successful round, a
low-rank matrix whose *averaged* moments are non-finite (an overflow with finite updates) has its state reset on
every worker (identical inputs, so no message is needed).

Interruptions: a round runs every collective first and changes nothing local until all of them succeeded; the
local commit that follows runs with Ctrl-C (SIGINT) held back (:func:`sigint_deferred`), so it is never half done.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo._tensors import all_finite
from lightning_lordo.comm.communicator import CollectiveTimeout, Communicator, translate
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.sync import exchange as ex
from lightning_lordo.sync.report import SyncReport


class NonFiniteTraining(RuntimeError):
    """Too many consecutive synchronization rounds were discarded for non-finite values (``max_skipped_syncs``):
    the model has not moved since the last good round. The message names the ranks that sent them."""


def state_tensors(state: dict[str, Any]) -> list[Tensor]:
    return [v for v in state.values() if isinstance(v, Tensor)]


def reset_optimizer_state(optimizer: Optimizer, p: Tensor, clear: bool) -> None:
    """Fresh optimizer state for ``p`` (module docstring). ``clear``: drop the state so the optimizer initializes
    it at its next step (torch's lazy optimizers); otherwise zero every tensor but a LoRDO basis, step included."""
    state = optimizer.state.get(p)
    if not state:
        return
    if clear:
        state.clear()
        return
    for key, value in state.items():
        if key == "basis":
            continue
        if isinstance(value, Tensor):
            value.zero_()
        elif key == "step" and isinstance(value, (int, float)):
            state[key] = type(value)(0)


def reset_moments(optimizer: Optimizer, p: Tensor) -> None:
    """Fresh moments for ``p`` (the switch at the end of a warm-up): LoRDO zeroes its moments and factored
    statistics and restarts the step counter (bias correction from step 1), keeping the basis and the error
    feedback; any other optimizer drops the parameter's state, to initialize it afresh at its next step."""
    state = optimizer.state.get(p)
    if not state:
        return
    if not isinstance(optimizer, LoRDO):
        state.clear()
        return
    for key in ("exp_avg", "exp_avg_sq", "factored_row", "factored_col", "step"):
        if key in state:
            state[key].zero_()


@contextmanager
def signals_deferred(*signums: int) -> Iterator[None]:
    """Hold back the signals ``signums`` while the block runs, then deliver each once, to the handler that was
    installed before. Only in the main thread (where Python handles signals), for signals with a Python-level or
    the default handler (an ignored signal stays ignored).

    A synchronization round holds back SIGTERM for its whole length: Lightning's SIGTERM handler issues a
    collective of its own, which inside a round would pair with the round's collectives and hang until the
    timeout. Deferred, it runs after the round, on every rank alike, and Lightning's preemption path follows.
    The local commit also holds back Ctrl-C (SIGINT), so that it is never half done.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signums}
    deferred = [s for s, handler in previous.items() if handler is not None and handler is not signal.SIG_IGN]
    received: dict[int, Any] = {}
    for signum in deferred:
        signal.signal(signum, lambda number, frame: received.setdefault(number, frame))
    try:
        yield
    finally:
        for signum in deferred:
            signal.signal(signum, previous[signum])
        for signum, frame in received.items():
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: let the default action happen
                signal.raise_signal(signum)


def sigint_deferred() -> Any:
    """Hold back Ctrl-C (SIGINT) while the block runs, then deliver it (:func:`signals_deferred`)."""
    return signals_deferred(signal.SIGINT)


class DiscardedRounds:
    """The synchronizer's discarding of a non-finite round (a base of
    :class:`~lightning_lordo.sync.synchronizer.Synchronizer`, which owns every attribute used here)."""

    comm: Any
    params: list[Tensor]
    buffers: list[Tensor]
    optimizer: Optimizer
    anchor: Any
    config: Any
    lordo: Any
    optimizer_steps: int
    skipped_syncs: int
    consecutive_skips: int
    _clear_to_reset: bool
    _finish: Any
    synchronized_step: int

    def _refuse_non_finite_start(self) -> None:
        """At the end of the synchronous steps (``warmup_steps``), before the anchor is taken: a synchronous step
        averages gradients as DDP does, with nothing discarded, so a NaN/Inf gradient on any rank reaches every
        replica; the rounds after would each discard back to that anchor, blaming every rank. Stop here instead."""
        if self.params and not all_finite(self.params):
            raise NonFiniteTraining(
                f"LoRDO: the parameters are not finite at the end of the synchronous steps (optimizer step "
                f"{self.optimizer_steps}, warmup_steps={self.config.warmup_steps}). A synchronous step averages the "
                "gradients as DDP does, so a NaN/Inf gradient on any rank reached every replica; no local round can "
                "start from them. Resume from a checkpoint of the synchronous steps with a lower learning rate, "
                "gradient clipping, or the bad batch removed.")

    def _discard(self, start: float, buffers: tuple[list[Tensor], list[Tensor]]) -> SyncReport:
        """Every worker is here (the decision came from identical averages): discard the round everywhere. One more
        collective tells every worker which parameters' optimizer state is non-finite on some worker and which
        ranks sent non-finite values; then, locally, those states are reset and the parameters go back to the
        anchor. The buffers' new values apply as in any round."""
        n, world = len(self.params), self.comm.world_size
        flags = torch.zeros(n + world, device=self.params[0].device if self.params else None)
        for i, p in enumerate(self.params):
            flags[i] = float(not all_finite(state_tensors(self.optimizer.state.get(p, {}))))
        flags[n + self.comm.rank] = float(not all_finite(self.anchor.deltas()))
        self.comm.all_reduce_mean([flags], "fault_flags")
        host = (flags.cpu() > 0).tolist()  # no collective below: commit
        bad_ranks = [r for r in range(world) if host[n + r]]
        with signals_deferred(signal.SIGINT):
            reset = [p for p, f in zip(self.params, host[:n]) if f]
            for p in reset:
                reset_optimizer_state(self.optimizer, p, clear=self.lordo is None and self._clear_to_reset)
            self.anchor.restore()
            ex.commit_buffers(self.buffers, *buffers)
        self.skipped_syncs += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.config.max_skipped_syncs:  # the same decision on every worker
            ranks = bad_ranks or "unknown: an overflow of the average"
            raise NonFiniteTraining(
                f"LoRDO {self.comm.context}: {self.consecutive_skips} consecutive syncs were discarded because the "
                f"averaged pseudo-gradient was not finite (NaN/Inf from rank(s) {ranks} this time); the model has "
                f"not changed since optimizer step {self.synchronized_step}. Check those ranks' data and loss, lower "
                "the learning rate, or raise max_skipped_syncs to keep trying.")
        if self.comm.rank == 0:
            warnings.warn(
                f"LoRDO {self.comm.context}: the averaged pseudo-gradient is not finite (NaN/Inf on rank(s) "
                f"{bad_ranks or 'unknown: an overflow of the average'}). The round is discarded on every worker: "
                "parameters go back to the last synchronized model, and the optimizer state of "
                f"{len(reset)} of {n} parameters (non-finite on some worker) is reset on every worker. Training "
                f"continues; {self.skipped_syncs} sync(s) skipped so far.",
                RuntimeWarning, stacklevel=3,
            )
        return self._finish(start, 0.0, None, float("nan"), skipped=True,
                            extra={"reset_params": float(len(reset)), "bad_ranks": float(len(bad_ranks))})


def guarded(communicator: Optional[Communicator], what: Any, timeout: Any, run: Callable[[], Any]) -> Any:
    """Run one of the framework's own collectives (``run``: Lightning's or Fabric's barrier, broadcast, reduce,
    all_gather; bounded by the process group's timeout) with its failure named as the plugin's own are: what was
    running (``what``, a string or a function giving it, called only on a failure) and the likely causes, as
    :class:`~lightning_lordo.comm.communicator.CollectiveTimeout`, instead of the backend's raw text. After an
    earlier failure it refuses at once: the process group cannot be trusted any more."""
    if communicator is not None and communicator.failure is not None:
        raise CollectiveTimeout(f"LoRDO: {what() if callable(what) else what} was not attempted because an earlier "
                                f"collective failed: {communicator.failure}")
    try:
        return run()
    except RuntimeError as err:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...)
        failure = translate(err, what() if callable(what) else what, timeout)
        if communicator is not None:
            communicator.failure = str(failure)
        raise failure from err
