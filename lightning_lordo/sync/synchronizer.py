"""LoRDO's synchronization over a process group (SPEC §4-5), independent of Lightning.

Every ``sync_every`` local steps all workers call :meth:`Synchronizer.sync` together. A round is two phases:

1. **exchange** (every collective, nothing local changes; :mod:`lightning_lordo.sync.exchange`): each worker's
   pseudo-gradient ``delta = anchor - params`` averaged (the ``full`` or ``lowrank`` payload, in
   ``payload_dtype``), the module buffers, the optimizer state in its *old* shared basis (low-rank moments; with
   ``average_fullrank_moments`` the full-rank moments; with ``average_error_feedback`` the error feedback), and,
   with ``broadcast_bases``, rank 0's new bases. The new bases are computed here too (pure math).
2. **commit** (local, cannot fail, Ctrl-C held back): the outer step (averaging, or Nesterov SGD on the anchor),
   the averaged optimizer state written, the new bases installed with the moments rotated into them, buffers,
   payload state, parameters and anchor.

Before any round, the synchronous phase (``warmup_steps``, or ``synchronous=True``: low-rank DDP) averages the
gradients every step (:meth:`before_optimizer_step`) and refreshes the bases every ``sync_every`` steps from the
averaged gradient; at the end of the warm-up the replicas are identical, the anchor is taken and the switch knobs
apply. Non-finite values discard the round on every worker (:mod:`lightning_lordo.sync.faults`). Every collective
is bounded by the communicator's timeout: a worker that dies or hangs makes the others raise ``CollectiveTimeout``
naming the sync, and is then as it was before the sync (every collective comes before the commit). References:
LoRDO (Jovanović et al., ICML 2026, arXiv 2602.04396); DiLoCo (arXiv 2311.08105) for the outer step.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_lordo._tensors import are_finite, finite_flags, nbytes
from lightning_lordo.comm.communicator import Communicator
from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.sync import bucketed, overlap
from lightning_lordo.sync import exchange as ex
from lightning_lordo.sync.basis_window import BasisWindow
from lightning_lordo.sync.faults import DiscardedRounds, reset_moments, reset_optimizer_state, signals_deferred
from lightning_lordo.sync.outer import Anchor, OuterStep
from lightning_lordo.sync.payloads import PseudoGradientPayloads
from lightning_lordo.sync.report import SyncReport


class Synchronizer(overlap.OverlappedRounds, DiscardedRounds):
    """Keeps the anchor (the last synchronized parameters) and runs synchronization rounds.

    Args:
        params: the trainable parameters, in an order identical on all workers.
        buffers: module buffers kept identical across workers (floating ones averaged, others from rank 0).
        optimizer: the local optimizer; if it is a :class:`LoRDO`, its bases and moments are synchronized.
        config: the synchronization knobs.
        communicator: the counted, time-bounded collectives.
        overlap_communicator: with ``overlap_steps``, the communicator of a side process group for the rounds'
            thread (:mod:`lightning_lordo.sync.overlap`); ``None``: ``communicator`` (one process only).
    """

    def __init__(self, params: Sequence[Tensor], buffers: Sequence[Tensor], optimizer: Optimizer, config: SyncConfig,
                 communicator: Communicator, overlap_communicator: Optional[Communicator] = None) -> None:
        self.params = list(params)
        self.buffers = list(buffers)
        self.optimizer = optimizer
        if config.average_fullrank_moments and any(ex.fullrank_moments(optimizer, p, g) is None
                                                   for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"Invalid average_fullrank_moments=True with {type(optimizer).__name__}: the moments it "
                             "averages are those of LoRDO, Adam, AdamW and SGD. Drop average_fullrank_moments.")
        self.config = config = config.alone() if communicator.world_size == 1 else config
        self.comm = communicator
        # overlap_steps: the rounds' collectives run on a thread over this communicator's (side) group
        self.overlap_comm = overlap_communicator or communicator
        self.in_flight: Optional[overlap.Launch] = None
        self.steps_since_sync = 0
        self.stepped: set[int] = set()  # positions stepped in the local round (averaged_state's holders)
        self.optimizer_steps = 0
        self.syncs_done = 0
        self.skipped_syncs = 0
        self.consecutive_skips = 0
        self.anchor = Anchor(self.params, config.anchor_device)
        self._anchor_step = 0  # the optimizer step whose synchronized model the anchor holds
        self.switched = False  # whether this process applied the switch knobs (the end of the warm-up)
        if not self.synchronous_now:  # the synchronous phase needs no anchor: it is taken at the switch
            self.take_anchor()
        self.outer = OuterStep(config.outer_optimizer, config.outer_lr, config.outer_momentum)
        lowrank = set(self.lordo.lowrank_params()) if self.lordo is not None else set()
        self.window = BasisWindow([p for p in self.params if p in lowrank], config.basis_every)
        self.switch_callbacks: list[Callable[[], None]] = []  # run after the switch (the strategy's LR schedulers)
        self._round = {"seconds": 0.0, "basis_seconds": 0.0, "movement": None}  # synchronous rounds
        # a state made at the first step (torch's optimizers) is fresh once cleared; one made eagerly is zeroed
        self._clear_to_reset = not any(optimizer.state.get(p) for p in self.params)
        self.comm.accountant.start_round(parts=True)  # the setup broadcast is in no sync's breakdown
        self.payloads = PseudoGradientPayloads(self.params, self.lordo.lowrank_ranks() if self.lordo else None, config,
                                               batched=any(self.lordo.stacked_layout(p) for p in lowrank))
        if self.lordo is not None and config.initial_basis == "random":
            self.lordo.init_random_bases()

    def take_anchor(self, step: Optional[int] = None) -> None:
        """The parameters as they are now become the synchronized point (every worker holds the same ones), the
        model of optimizer step ``step`` (``None``: now)."""
        self.anchor.take()
        self._anchor_step = self.optimizer_steps if step is None else step
        self.stepped = set()  # a new round

    @property
    def synchronized_step(self) -> int:
        """The optimizer step whose synchronized model the anchor holds, which validation and checkpoints see: the
        last sync's; with ``overlap_steps`` the launch of the last round that *landed* (K steps older than the
        replicas' average from a launch until its landing); in the synchronous phase, every step."""
        return self.optimizer_steps if self.synchronous_now else self._anchor_step

    @property
    def lordo(self) -> Optional[LoRDO]:
        return self.optimizer if isinstance(self.optimizer, LoRDO) else None

    # ------------------------------------------------------------------ driving
    @property
    def synchronous_now(self) -> bool:
        """Whether the next optimizer step is synchronous (``synchronous=True``, or within ``warmup_steps``)."""
        return self.config.synchronous or self.optimizer_steps < self.config.warmup_steps

    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """Every worker calls this after the backward pass of each optimizer step, before clipping and the step.

        In the synchronous phase it averages the gradients (DDP's all-reduce, purpose ``gradients``) and, every
        ``sync_every`` steps, gives the low-rank matrices new bases from the averaged gradient. In both phases the
        low-rank matrices without a basis get their first one (SPEC §4: from the averaged first gradient), and the
        last step before a round collects the optimizer's diagnostics for the monitor.
        """
        start = time.perf_counter()
        synchronous, lordo, k = self.synchronous_now, self.lordo, self.config.sync_every
        # a checkpoint of the synchronous phase resumed with local steps has no anchor yet: switch now, before this
        # step, while the replicas are still identical
        if not synchronous and not self.anchor.taken and self.params:
            self.switch_to_local()
        if synchronous:
            self.comm.context = f"gradient average (optimizer step {self.optimizer_steps + 1})"
            with signals_deferred(signal.SIGTERM):
                ex.average_gradients(self.comm, self.params)
            if lordo is not None and self.optimizer_steps and self.optimizer_steps % k == 0:
                basis_start = time.perf_counter()
                moved = lordo.set_bases(self._bases({p: p.grad for p in self.params if p.grad is not None}))
                self._round["movement"] = _mean_movement(moved)
                self._round["basis_seconds"] += time.perf_counter() - basis_start
        self._ensure_first_bases(averaged=synchronous)
        if len(self.stepped) < len(self.params):  # the round's holders of moments (averaged_state); then free
            self.stepped.update(i for i, p in enumerate(self.params) if p.grad is not None)
        next_step = (self.optimizer_steps + 1) if synchronous else (self.steps_since_sync + 1)
        if lordo is not None and next_step % k == 0:
            lordo.request_diagnostics()
        if self.anchor.on_side and next_step % k == 0 and not (synchronous or self.config.overlap_steps) \
                and bucketed.applies(self):
            self.anchor.prefetch(bucketed.first_bucket(self))  # in host memory: copied during this step's update
        if synchronous:
            self._round["seconds"] += time.perf_counter() - start

    def on_optimizer_step(self) -> Optional[SyncReport]:
        """Count one optimizer step; synchronize when ``sync_every`` local steps have passed. In the synchronous
        phase, report every ``sync_every`` steps, and switch to local steps at the end of ``warmup_steps``."""
        synchronous = self.synchronous_now
        self.optimizer_steps += 1
        if synchronous:
            switch = not self.config.synchronous and self.optimizer_steps == self.config.warmup_steps
            report = None
            if switch or self.optimizer_steps % self.config.sync_every == 0:
                report = self._finish_synchronous_round()
            if switch:
                self.switch_to_local()
            return report
        self.steps_since_sync += 1
        report = None
        if self.in_flight is not None and self.steps_since_sync >= self.config.overlap_steps:
            report = self._land_in_flight()
        if self.steps_since_sync >= self.config.sync_every:
            if not self.config.overlap_steps:
                return self.sync()
            self._launch()
        return report

    def _ensure_first_bases(self, averaged: bool) -> None:
        """First bases for the low-rank matrices that have none: from the gradient when it is already the average
        (``averaged``) or the scope is local, else from the averaged first gradient (one extra all-reduce)."""
        lordo = self.lordo
        if lordo is None or self.config.initial_basis == "random":
            return
        missing = lordo.missing_bases()
        if not missing:
            return
        if averaged or self.config.basis_scope == "local":
            lordo.set_bases(lordo.compute_bases(missing, generation=self.optimizer_steps))
        else:
            self.comm.context = "initial basis"
            lordo.set_bases(self._bases(ex.average_first_gradients(self.comm, missing, self.config)))

    def _bases(self, sources: dict[Tensor, Tensor], comm: Optional[Communicator] = None,
               generation: Optional[int] = None, spans: Optional[dict[Tensor, Tensor]] = None) -> dict[Tensor, Tensor]:
        """New bases from ``sources`` (and ``spans``, as :meth:`LoRDO.compute_bases`) identical on every worker:
        computed everywhere from identical inputs, or with ``broadcast_bases`` on rank 0 and sent (a collective)."""
        lordo = self.lordo
        assert lordo is not None
        comm = comm or self.comm
        generation = self.optimizer_steps if generation is None else generation
        lowrank = [p for p in lordo.lowrank_params() if p in sources]
        sources = {p: sources[p] for p in lowrank}
        if not self.config.broadcast_bases:
            return lordo.compute_bases(sources, generation=generation, spans=spans)
        if comm.rank == 0:  # contiguous, as the receivers' copies: the same layout rounds the same way later
            computed = lordo.compute_bases(sources, generation=generation, spans=spans)
            bases = {p: q.contiguous() for p, q in computed.items()}
        else:  # only rank 0 computes; the others receive
            ranks = lordo.lowrank_ranks()
            bases = {p: torch.empty(min(p.shape), ranks[p], device=p.device) for p in lowrank}
        comm.broadcast(list(bases.values()), "bases")
        return bases

    def _finish_synchronous_round(self) -> SyncReport:
        data, self._round = self._round, {"seconds": 0.0, "basis_seconds": 0.0, "movement": None}
        self.syncs_done += 1
        return self._report(seconds=data["seconds"], basis_seconds=data["basis_seconds"],
                            subspace_movement=data["movement"], pseudo_gradient_norm=None, extra={"synchronous": 1.0})

    def switch_to_local(self) -> None:
        """The end of the warm-up (the replicas are identical): take the anchor, apply the switch knobs."""
        self._refuse_non_finite_start()
        self.take_anchor()
        self.switched = True
        self.steps_since_sync = 0
        config = self.config
        for group in self.optimizer.param_groups:
            if config.switch_betas is not None:
                group["betas"] = config.switch_betas
            if config.switch_lr_scale != 1.0:
                for key in ("lr", "initial_lr", "max_lr", "min_lr"):  # the last two: OneCycleLR's
                    if key in group:
                        group[key] = group[key] * config.switch_lr_scale
        if config.switch_reset_moments:
            for p in self.params:
                reset_moments(self.optimizer, p)
        for callback in self.switch_callbacks:
            callback()

    # ------------------------------------------------------------------ one round
    @torch.no_grad()
    def sync(self) -> SyncReport:
        """One synchronization round; every worker must call it at the same point.

        Raises:
            CollectiveTimeout: a collective failed or timed out (another worker died or hangs); this worker's
                parameters, anchor, buffers and optimizer state are then as they were before the call.
        """
        with signals_deferred(signal.SIGTERM):  # Lightning's SIGTERM handler would issue a collective mid-round
            return self._sync()

    def _sync(self) -> SyncReport:
        start = time.perf_counter()
        self.comm.accountant.start_round()
        self.comm.context = f"sync {self.syncs_done + 1} (optimizer step {self.optimizer_steps})"
        with record_function("lordo.exchange"):
            round_ = bucketed.exchange(self) if bucketed.applies(self) else self.exchange(  # bucketed: never whole
                self.comm, self.anchor.deltas(), self.buffers, self.averaged_entries(), self.optimizer_steps,
                self.window.due(self.syncs_done + 1))
        due = (self.syncs_done + 1) % self.config.moments_every == 0  # this round averages the moments
        report = self.land(round_, start)
        self.stepped = set() if round_.finite and due else self.stepped  # held till the moments are averaged
        return report

    def averaged_entries(self, fold: bool = True) -> dict[str, list[tuple[Any, list[Tensor]]]]:
        """The state this sync averages, held where this worker stepped it (:func:`~.exchange.averaged_state`)."""
        due = (self.syncs_done + 1) % self.config.moments_every == 0  # this sync's number, from 1
        return ex.averaged_state(self.optimizer, self.params, self.config, due, fold, self.stepped)

    def exchange(self, comm: Communicator, local: list[Tensor], buffers: Sequence[Tensor],
                 entries: dict[str, list[tuple[Tensor, list[Tensor]]]], generation: int,
                 refresh: bool = True) -> ex.Exchange:
        """Every collective of a round on ``comm`` and, when ``refresh``, the new bases; reads only its arguments
        and the payloads', bases' and basis window's state (which change only at a commit), so it may run on
        another thread (``overlap_steps``). One host read: whether the pseudo-gradients and the buffers are finite
        (the commit reads the round's other figures at once)."""
        # the local pseudo-gradients are needed after their average only for local bases
        averaged, rounds, payload_finite = self.payloads.reduce(comm, local, self.config.basis_scope == "global")
        floating, others = ex.average_buffers(comm, buffers)
        magnitudes = self.payloads.norms(averaged, rounds)
        finite = are_finite(magnitudes).all()
        if payload_finite is not None:
            finite = finite & payload_finite.to(finite.device)
        buffers_finite = finite_flags(floating).all() if floating else torch.ones_like(finite)
        ok, buffers_ok, shares = ex.round_read(finite, buffers_finite, ex.holder_shares(comm, entries))
        if not buffers_ok:  # identical on all workers: all repair them together
            floating = ex.repair_buffers(comm, buffers)
        if not ok:  # identical on all workers: they all discard the round
            return ex.Exchange(averaged, rounds, (floating, others), finite=False)
        self.payloads.resolve(rounds, True)
        state, checked, state_finite = ex.average_state(comm, entries, self.config, shares)
        basis_start = time.perf_counter()
        bases = {}
        if self.lordo is not None and refresh:
            shared = self.config.basis_scope == "global"
            sources = {p: s for p, s in zip(self.params, averaged if shared else local)}
            sources = self.window.sources(sources) if self.window else sources
            spans = self.payloads.spans(self.params, rounds) if shared and not self.window else {}
            bases = self._bases(sources, comm, generation, spans) if shared else \
                self.lordo.compute_bases(sources, generation)
        return ex.Exchange(averaged, rounds, (floating, others), state, bases, checked, state_finite,
                           torch.linalg.vector_norm(magnitudes), time.perf_counter() - basis_start)

    @torch.no_grad()
    def land(self, round_: ex.Exchange, start: float, progress: Optional[list[Tensor]] = None,
             step: Optional[int] = None) -> SyncReport:
        """Commit an exchanged round (or discard a non-finite one on every worker) and report it; ``progress``:
        each parameter's local progress since the round's pseudo-gradient was taken at optimizer step ``step``
        (``None``: now), kept on top of the new synchronized point (``overlap_steps``)."""
        if not round_.finite:
            return self._discard(start, round_.buffers)
        with record_function("lordo.commit"), signals_deferred(signal.SIGINT):
            figures = self._commit(round_, progress)
            self._anchor_step = self.optimizer_steps if step is None else step
        reset = figures.pop("reset")
        extra = {"reset_moments": float(reset)} if reset else {}
        if self.payloads.compressed:
            extra["sync_error_feedback_norm"] = figures["error_norm"]
        return self._finish(start, round_.basis_seconds, figures["movement"], figures["norm"], extra=extra)

    def _commit(self, round_: ex.Exchange, progress: Optional[list[Tensor]] = None) -> dict[str, Any]:
        """Local and unable to fail: the exchanged round becomes this worker's state. Reads the round's figures
        back to the host once: the norm, the subspace movement, the sync-level error feedback's norm and which
        parameters' averaged state is not finite (those are reset, on every worker alike)."""
        self.window.commit(dict(zip(self.params, round_.averaged)), refreshed=bool(round_.bases))
        # alone, averaging leaves the replica where it is (anchor - (anchor - params)): it becomes the anchor as is
        unmoved = self.comm.world_size == 1 and self.config.outer_optimizer == "average" and progress is None
        if round_.streamed:  # parameters, anchor and the payloads' error feedback, bucket by bucket
            bucketed.commit_streamed(self, round_)
        elif unmoved and round_.staged is None:
            self.anchor.take()
        else:  # the averages' last use
            staged = round_.staged
            self.anchor.set(staged if staged is not None else self.outer.apply(self.anchor, round_.averaged))
        ex.commit_state(round_.state)
        movement = self.lordo.set_bases(round_.bases) if self.lordo is not None else {}
        ex.commit_buffers(self.buffers, *round_.buffers)
        for payload, payload_round in round_.payload_rounds:
            payload.commit(payload_round)
        if round_.staged is not None:  # the gradients that held them (bucketed module)
            bucketed.release_gradients(self.params)
        if progress:
            torch._foreach_add_(self.params, progress)
        error_norm = self.payloads.error_norm_tensor() if self.payloads.compressed else None
        norm, movement_mean, error, reset = ex.read_figures(round_, movement, error_norm)  # the commit's one read
        for p in reset:
            reset_optimizer_state(self.optimizer, p, clear=self.lordo is None and self._clear_to_reset)
        return {"norm": norm, "movement": movement_mean, "error_norm": error, "reset": len(reset)}

    def _finish(self, start: float, basis_seconds: float, movement: Optional[float], norm: float,
                skipped: bool = False, extra: Optional[dict[str, float]] = None) -> SyncReport:
        self.syncs_done += 1
        if not skipped:
            self.consecutive_skips = 0
        self.steps_since_sync = 0
        return self._report(seconds=time.perf_counter() - start, basis_seconds=basis_seconds,
                            subspace_movement=movement, pseudo_gradient_norm=norm, skipped=skipped,
                            extra=dict(extra or {}))

    def _report(self, **figures: Any) -> SyncReport:
        """The report of the round that just ended: its bytes (payload and wire) by purpose, and ``figures``."""
        accountant = self.comm.accountant
        sent = accountant.end_round()
        return SyncReport(index=self.syncs_done, step=self.optimizer_steps, bytes_by_purpose=sent,
                          wire_by_purpose=dict(accountant.last_round_wire), bytes_by_part=accountant.last_parts,
                          wire_by_part=accountant.last_wire_parts, total_bytes=accountant.total_bytes,
                          total_wire_bytes=accountant.total_wire_bytes, **figures)

    # ------------------------------------------------------------------ state
    def state_dict(self, anchor: bool = True) -> dict[str, Any]:  # anchor=False: a boundary's (the model is it)
        return {"anchor": self.anchor.state_dict() if anchor else [], "outer": self.outer.state_dict(),
                "steps_since_sync": self.steps_since_sync, "optimizer_steps": self.optimizer_steps,
                "syncs_done": self.syncs_done, "skipped_syncs": self.skipped_syncs,
                "consecutive_skips": self.consecutive_skips, "basis_window": self.window.state_dict(),
                "anchor_step": self.synchronized_step, "synchronous": self.synchronous_now}

    def load_state_dict(self, state: dict[str, Any], anchor: bool = True) -> None:
        """``anchor=False``: the anchor is left to the caller (a boundary's model). Synchronous throughout (one device,
        ``lowrank_ddp``) there is neither an anchor nor an outer step, whatever ``state`` holds."""
        if anchor and not self.config.synchronous:
            self.anchor.load_state_dict(state["anchor"])
        self.outer.load_state_dict(state["outer"] if not self.config.synchronous else {"momentum": []})
        self.steps_since_sync, self.optimizer_steps = state["steps_since_sync"], state["optimizer_steps"]
        self.syncs_done = state["syncs_done"]
        self.skipped_syncs, self.consecutive_skips = state["skipped_syncs"], state["consecutive_skips"]
        self.window.load_state_dict(state["basis_window"])
        self._anchor_step = state["anchor_step"]

    def memory_report(self) -> dict[str, int]:
        """Bytes of synchronization buffers (SPEC §8): the anchor, the outer momentum, the payload's state."""
        return {"anchor": self.anchor.nbytes(), "outer_momentum": nbytes(self.outer.momentum_buffers()),
                **({"basis_window": self.window.nbytes()} if self.window else {}), **self.payloads.memory_report()}


def _mean_movement(moved: dict[Tensor, Tensor]) -> Optional[float]:
    return float(torch.stack(list(moved.values())).mean()) if moved else None
