"""Lightning's own collectives, guarded: the strategy's ``barrier``, ``broadcast``, ``reduce`` and ``all_gather``
name what failed and why instead of the backend's raw text, and Lightning's check for SIGTERM before every batch
and its SIGTERM handler are replaced by versions without a collective inside a signal handler (a mixin of
:class:`~lightning_lordo.LoRDOStrategy`, before ``DDPStrategy`` in its bases)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_lordo.comm.accounting import wire_bytes
from lightning_lordo.comm.communicator import CollectiveTimeout, Communicator, side_communicator
from lightning_lordo.lightning._compat import note_sigterm
from lightning_lordo.sync.faults import guarded

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.strategies.launchers.launcher import _Launcher

    from lightning_lordo.comm.accounting import CommAccountant
    from lightning_lordo.config import SyncConfig
    from lightning_lordo.sync.synchronizer import Synchronizer

#: What Lightning's callbacks' collectives carry, by the method that issues them (lightning 2.6).
_CALLBACK_COLLECTIVES = {("ModelCheckpoint", "check_monitor_top_k"): "whether to save a top-k checkpoint",
                         ("ModelCheckpoint", "file_exists"): "whether the checkpoint file exists on rank 0",
                         ("ModelCheckpoint", "setup"): "of its directory",
                         ("ModelCheckpoint", "on_train_batch_end"): "of its time-interval decision",
                         ("ModelCheckpoint", "_save_checkpoint"): "after a save",
                         ("EarlyStopping", "_evaluate_stopping_criteria"): "whether to stop"}


class GuardedCollectives:
    """Needs ``communicator``, ``synchronizer``, ``sync_config``, ``lightning_module``, ``launcher``,
    ``root_device`` and ``_every_rank_saves`` from the strategy it is mixed into."""

    _sigterm_pending = False  # a SIGTERM arrived; the next per-batch check tells every rank
    _posted_check: Optional[tuple[Any, torch.Tensor, int]] = None  # the check in flight: wait, flags, steps
    _counting = False  # Lightning's collectives go into this fit's accountant (configure_ddp to the next entry)
    _control_comm: Optional[Communicator]  # the per-batch checks' communicator, on a gloo group of their own
    accountant: CommAccountant
    _is_last_step: Callable[[], bool]
    _every_rank_saves: Callable[[], bool]
    communicator: Optional[Communicator]
    synchronizer: Optional[Synchronizer]
    sync_config: SyncConfig
    lightning_module: Optional[L.LightningModule]
    launcher: Optional[_Launcher]
    root_device: torch.device
    world_size: int
    global_rank: int

    def _lightning_collective(self, what: Any, run: Any) -> Any:
        """One of Lightning's collectives, its failure named (``core.guarded``)."""
        return guarded(self.communicator, what, self.sync_config.timeout, run)

    def _caller(self, operation: str, default: str) -> str:
        """What issued one of Lightning's collectives, for its error: the first caller that is not the strategy
        (a few frames up: cheap). A callback is named with its method (``ModelCheckpoint's reduce_boolean_decision
        (whether to save a top-k checkpoint) in ModelCheckpoint.check_monitor_top_k``), a logged metric as such,
        another caller by its class and method; ``default`` when none is found."""
        from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

        frame, decision = sys._getframe(2), False
        for _ in range(12):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            decision = decision or frame.f_code.co_name == "reduce_boolean_decision"
            if owner is None or owner is self:
                frame = frame.f_back
                continue
            method = frame.f_code.co_name
            if isinstance(owner, Callback):
                name = base = type(owner).__name__
                for known in (ModelCheckpoint, EarlyStopping):
                    if isinstance(owner, known) and name != known.__name__:
                        name, base = f"{name} (a {known.__name__})", known.__name__
                hint = _CALLBACK_COLLECTIVES.get((base, method))
                verb = "reduce_boolean_decision" if decision else operation
                return f"{name}'s {verb}{f' ({hint})' if hint else ''} in {type(owner).__name__}.{method}"
            if type(owner).__name__ in ("_Sync", "_ResultMetric", "_ResultCollection"):
                return f"Lightning's {operation} of a metric logged with sync_dist=True"
            return f"Lightning's {operation} in {type(owner).__name__}.{method}"
        return default

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not self._every_rank_saves():  # after a failed collective, or in an exception that may be this rank's
            return  # alone: nobody can be waited for (the emergency checkpoint of OnExceptionCheckpoint, say)
        what = (lambda: self._caller("barrier", "Lightning's barrier")) if name is None else \
            f"Lightning's barrier ({name})"
        self._lightning_collective(what, lambda: super(GuardedCollectives, self).barrier(name))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        out = self._lightning_collective(lambda: self._caller("broadcast", "Lightning's broadcast"),
                                         lambda: super(GuardedCollectives, self).broadcast(obj, src))
        if self.world_size > 1:  # torch's broadcast_object_list: the pickled object and its int64 size
            self._count("broadcast", 8 + len(pickle.dumps(out)), sender=self.global_rank == src)
        return out

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        out = self._lightning_collective(lambda: self._caller("reduce", "Lightning's reduce"),
                                         lambda: super(GuardedCollectives, self).reduce(tensor, group, reduce_op))
        if isinstance(tensor, torch.Tensor):  # DDP's reduce passes anything else through
            self._count("all_reduce", tensor.numel() * tensor.element_size())
        return out

    @override
    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        out = self._lightning_collective(lambda: self._caller("all_gather", "Lightning's all_gather"),
                                         lambda: super(GuardedCollectives, self).all_gather(tensor, group, sync_grads))
        if isinstance(tensor, torch.Tensor):
            self._count("all_gather", tensor.numel() * tensor.element_size())
        return out

    def _count(self, kind: str, nbytes: int, sender: bool = True) -> None:
        """Lightning's own collectives (a metric logged with ``sync_dist=True``, a callback's decision, a broadcast)
        are on the wire too: counted under ``lightning_collectives``, between rounds (a broadcast's payload on its
        sender, its wire bytes on every worker, as the strategy's own). Those of Lightning's setup (``log_dir``,
        ``ModelCheckpoint``'s directory) come before this fit's accountant exists: held until it does."""
        if self.world_size <= 1 or not nbytes:
            return
        entry = (nbytes if sender else 0, wire_bytes(kind, nbytes, self.world_size))
        if self._counting:
            self._add_lightning(*entry)
        else:
            self.__dict__.setdefault("_pending_counts", []).append(entry)

    def _add_lightning(self, nbytes: int, wire: int) -> None:
        if nbytes:
            self.accountant.add("lightning_collectives", nbytes, in_round=False, wire=wire)
        else:
            self.accountant.add_wire("lightning_collectives", wire, in_round=False)

    def _start_counting(self) -> None:
        """This fit's accountant exists (``configure_ddp``): what Lightning sent in this entry's setup goes in it, and
        what it sends until the next entry point starts (``setup_environment``)."""
        self._counting = True
        for entry in self.__dict__.pop("_pending_counts", []):
            self._add_lightning(*entry)

    @override
    def setup_environment(self) -> None:
        """An entry point (fit, validate, ...) starts: its setup's collectives wait for its accountant; what came
        after the last one's teardown (``on_fit_end`` hooks) was counted in that fit."""
        self._counting = False
        self.__dict__.pop("_pending_counts", None)
        super().setup_environment()  # type: ignore[misc]

    def _sigterm_check(self, finished: bool = False) -> None:
        """Lightning's check for SIGTERM before every training batch, replaced: an all-reduce of each rank's flags on
        a gloo group of its own (``_control_comm``; counted, bounded by the timeout), *pipelined*: the check posted
        before a batch of local steps is read before the next one, so such a step does not wait for the others'
        round trip (a per-step barrier on a slow or distant link); before a step that waits for the others anyway
        (:meth:`_next_step_communicates`) it is read at once. Every rank reads the same result at the same batch, so
        a SIGTERM to any rank stops every rank at the same batch, at most one batch later than a blocking check. A
        rank that ran out of batches while others have more (``finished``, at the end of training; that check
        waits) makes all of them stop with an error saying so, as do ranks that took different numbers of optimizer
        steps (a step skipped on some ranks only); a failure (a worker that died or hangs between syncs) is raised
        as :class:`CollectiveTimeout` naming this check, instead of swallowed by Lightning."""
        assert self.communicator is not None and self.synchronizer is not None and self.lightning_module is not None
        control = self._control_comm
        steps = self.synchronizer.optimizer_steps
        here = "at the end of training" if finished else f"before optimizer step {steps + 1}"
        try:
            if self._posted_check is not None:  # the previous batch's, read now by every rank
                wait, flags, posted = self._posted_check
                self._posted_check = None
                control.context = (f"Lightning's per-batch SIGTERM check before optimizer step {posted + 1} "
                                   f"(between syncs; read {here})")
                wait()
                self._act_on_checks(flags, False, posted)
            control.context = f"Lightning's per-batch SIGTERM check {here}"
            step = steps % 4096  # mean and mean square: their variance, the same on every rank (one decision), is 0
            # when all took as many steps (mod 4096: a mismatch shows a batch after it starts, long before that)
            flags = torch.tensor([float(self._sigterm_pending), float(finished), step, step * step],
                                 dtype=torch.float64)
            wait = control.begin_all_reduce_mean(flags, "lightning_sigterm_check")
            if finished or self._next_step_communicates():  # read now: a rank that has finished would not be there
                wait()
                self._act_on_checks(flags, finished, steps)
            else:
                self._posted_check = (wait, flags, steps)
        except CollectiveTimeout as err:  # the default group is not to be trusted either (e.g. a dead peer)
            self.communicator.failure = self.communicator.failure or str(err)
            raise

    def _next_step_communicates(self) -> bool:
        """Whether the coming optimizer step waits for the other ranks (the synchronous phase, the first bases, a
        sync, an overlapped landing, ``fit``'s last step and its final sync): its check is read before it, as a
        blocking check would be, so that a rank whose peer ran out of batches stops with the error that says so."""
        sync = self.synchronizer
        due = sync.steps_since_sync + 1
        return (sync.synchronous_now or sync.optimizer_steps == 0 or due >= sync.config.sync_every
                or (sync.in_flight is not None and due >= sync.config.overlap_steps) or self._is_last_step())

    def _setup_control(self) -> None:
        """The per-batch checks' communicator for this fit, on a gloo group made once per strategy (every rank
        calls this together, at setup)."""
        group = getattr(self, "_control_comm", None)
        self._control_comm = side_communicator(self.accountant, self.sync_config.timeout) if group is None \
            else Communicator(self.accountant, self.sync_config.timeout, group=group.group)
        self._posted_check = None

    def _check_steps_before_round(self, taken: bool = True) -> None:
        """Before a round of local steps: this rank's step count, sent as the per-batch check sends it, by every rank
        that took the step (``after_optimizer_step``). A rank that skipped it sends its own count (``taken=False``)
        at that batch's end, before any collective of Lightning's (``callbacks.SyncBeforeSaves``): the two pair, and
        every rank stops naming the cause instead of waiting for the timeout in the round."""
        assert self.synchronizer is not None and self.communicator is not None
        control, steps = self._control_comm, self.synchronizer.optimizer_steps + taken  # this step counted, if taken
        control.context = f"sync {self.synchronizer.syncs_done + 1}'s step-count check (optimizer step {steps})"
        step = steps % 4096
        flags = torch.tensor([0.0, 0.0, step, step * step], dtype=torch.float64)
        try:
            control.begin_all_reduce_mean(flags, "lightning_sigterm_check")()
        except CollectiveTimeout as err:  # the default group is not to be trusted either (an emergency save skips)
            self.communicator.failure = self.communicator.failure or str(err)
            raise
        self._act_on_checks(flags, False, steps)

    def _act_on_checks(self, flags: torch.Tensor, finished: bool, steps: int) -> None:
        sigterm, done, mean, mean_square = flags.tolist()
        if 0 < done < 1:  # the same decision on every rank
            mine = "finished" if finished else f"was about to take optimizer step {steps + 1}"
            theirs = "others were still training" if finished else "another rank had finished"
            raise CollectiveTimeout(
                f"LoRDO: the workers ran different numbers of batches: this rank {mine} while {theirs} (it took "
                f"{steps} steps). Give every rank the same number of batches: a DistributedSampler with drop_last, "
                "or data of equal length per rank.")
        if mean_square - mean * mean > 1e-6:  # float64 sums of squares below 2^24: exact; else at least 1/n - 1/n^2
            raise CollectiveTimeout(
                f"LoRDO: the workers took different numbers of optimizer steps (this rank: {steps}), "
                "so their syncs would not pair: an optimizer_step override skipped a step on some ranks only. "
                "Decide on every rank alike, e.g. skip = self.trainer.strategy.reduce_boolean_decision(skip, "
                "all=False).")
        if sigterm > 0:  # on every rank at once; Lightning's own checks follow its flag, set only here
            note_sigterm(self.lightning_module.trainer)
            raise SIGTERMException()

    def _sigterm_notifier(self, signum: int, frame: Any) -> None:
        """Lightning's SIGTERM handler, replaced: it notes the signal (and, in the main process, passes it on to the
        processes it launched, as Lightning does) but issues no collective and does not set Lightning's own flag.
        Lightning's handler broadcasts from inside the signal handler, which pairs with whatever collective the ranks
        are in (it hangs them when the signal reaches a rank twice: from the process group and from the launcher),
        and its loops leave at the end of a batch as soon as the local flag is set, each rank at another batch. The
        per-batch check carries the flag to every rank and sets Lightning's on all of them at the same batch."""
        rank_zero_info(f"LoRDO: received SIGTERM ({signum}); every rank stops before its next batch.")
        if not self._sigterm_pending and self.launcher is not None:
            self.launcher.kill(signum)
        self._sigterm_pending = True
