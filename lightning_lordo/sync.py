"""One LoRDO synchronization round over a process group (SPEC §4-5), independent of Lightning.

Every ``sync_every`` local steps all workers call :meth:`Synchronizer.sync` together:

1. ``prepare``: each worker's pseudo-gradient ``delta = anchor - params`` (old minus new, as DiLoCo).
2. ``average``: average the pseudo-gradients (the ``full`` or ``lowrank`` payload of SPEC §5, in
   ``payload_dtype``, :mod:`lightning_lordo.payload` and :mod:`lightning_lordo.quantization`) and the floating
   module buffers (non-floating buffers come from rank 0), into copies.
3. ``outer step``: plain averaging (``anchor - delta``) or Nesterov SGD on the anchor (DiLoCo).
4. ``bases``: new bases from the averaged pseudo-gradient (``basis_scope="global"``) or from each worker's
   own (``"local"``); the optimizer rotates its moments into them.
5. ``moments``: the low-rank moments are averaged (they share the basis, so the average is well defined), in
   float32, or in bfloat16 when the payload is reduced (``SyncConfig.moments_dtype``).
6. ``apply``: parameters, anchor, buffers and outer momentum become the new point.

Non-finite values (NaN/Inf on any worker) discard the round on every worker, and poisoned optimizer state is
reset identically everywhere: :mod:`lightning_lordo.faults` documents what exactly happens.

Failure semantics: every collective is bounded by the communicator's timeout; a worker that dies or hangs
makes the others raise :class:`~lightning_lordo.accounting.CollectiveTimeout` naming the sync and the timeout.
A sync is a transaction on each worker: all collectives of a round write into copies, the optimizer's low-rank
state is restored if the round fails after the bases were installed, and the parameters, anchor, buffers and
outer momentum are written only after all collectives succeeded, with Ctrl-C (SIGINT) held back during those
few copies. An exception or ``KeyboardInterrupt`` inside a sync thus leaves that worker exactly as it was before
the sync (bytes already sent stay counted). Nothing here touches the disk.

Reference: Jovanović et al., "LoRDO: Distributed Low-Rank Optimization with Infrequent Communication",
ICML 2026 (arXiv 2602.04396); Douillard et al., "DiLoCo" (arXiv 2311.08105) for the outer step.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_lordo.accounting import Communicator
from lightning_lordo.config import SyncConfig
from lightning_lordo.faults import (
    all_finite,
    reset_moments,
    reset_optimizer_state,
    restore_lowrank_state,
    sigint_deferred,
    snapshot_lowrank_state,
    state_tensors,
)
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.payload import LowRankPayload
from lightning_lordo.quantization import QuantizedAverager, quantized_mean


@dataclass
class SyncReport:
    """What one synchronization did (all per worker)."""

    index: int
    step: int
    bytes_by_purpose: dict[str, int]
    seconds: float
    basis_seconds: float
    subspace_movement: Optional[float]
    pseudo_gradient_norm: Optional[float]
    skipped: bool = False
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_purpose.values())


class Synchronizer:
    """Keeps the anchor (the last synchronized parameters) and runs synchronization rounds.

    Args:
        params: the trainable parameters, in an order identical on all workers.
        buffers: module buffers kept identical across workers (floating ones averaged, others from rank 0).
        optimizer: the local optimizer; if it is a :class:`LoRDO`, its bases and moments are synchronized.
        config: the synchronization knobs.
        communicator: the counted, time-bounded collectives.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        optimizer: Optimizer,
        config: SyncConfig,
        communicator: Communicator,
    ) -> None:
        self.params = list(params)
        self.buffers = list(buffers)
        self.optimizer = optimizer
        self.config = config
        self.comm = communicator
        self.steps_since_sync = 0
        self.optimizer_steps = 0
        # the synchronous phase needs no anchor (the replicas never drift apart): it is taken at the switch
        self.anchor: list[Tensor] = [] if self.synchronous_now else [p.detach().clone() for p in self.params]
        self.outer_momentum: list[Tensor] = []
        self.switch_callbacks: list[Callable[[], None]] = []  # run after the switch (the strategy's LR schedulers)
        self._round_seconds = 0.0  # synchronous phase: time spent averaging gradients and refreshing bases
        self._round_basis_seconds = 0.0
        self._round_movement: Optional[float] = None
        self.comm.accountant.start_round()  # a synchronous round counts its gradients from here (not the setup)
        self.syncs_done = 0
        self.skipped_syncs = 0
        # torch's optimizers create a parameter's state at its first step, so clearing it gives fresh state;
        # one that already holds state now (eager, e.g. Adagrad) gets its tensors zeroed instead (module docstring)
        self._clear_to_reset = not any(optimizer.state.get(p) for p in self.params)
        self._init_payloads()
        if isinstance(optimizer, LoRDO) and config.initial_basis == "random":
            optimizer.init_random_bases()

    def _init_payloads(self) -> None:
        """SPEC §5: the low-rank matrices travel as the ``lowrank`` payload (if chosen), everything else through
        the averager, both in ``payload_dtype`` with per-worker error feedback (none for float32)."""
        lordo = self.lordo
        self.lowrank_payload: Optional[LowRankPayload] = None
        self._lowrank_positions: list[int] = []
        if self.config.payload == "lowrank":
            if lordo is None:
                raise ValueError("payload='lowrank' needs the LoRDO optimizer (strategy 'lordo' or 'lordo_local'); "
                                 "with 'diloco' use payload='full' (payload_dtype may still be bfloat16 or int8).")
            ranks = {id(p): lordo.lowrank_rank(p, g) for g in lordo.param_groups for p in g["params"]}
            self._lowrank_positions = [i for i, p in enumerate(self.params) if ranks.get(id(p), 0)]
            self.lowrank_payload = LowRankPayload([ranks[id(self.params[i])] for i in self._lowrank_positions],
                                                  seed=self.config.seed, payload_dtype=self.config.payload_dtype)
        self.averager = QuantizedAverager(self.config.payload_dtype)

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
        ``sync_every`` steps, gives the low-rank matrices new bases from the averaged gradient. In both phases, the
        low-rank matrices without a basis get their first one (SPEC §4: from the averaged first gradient).
        """
        start = time.perf_counter()
        synchronous = self.synchronous_now
        if synchronous:
            self.comm.context = f"gradient average (optimizer step {self.optimizer_steps + 1})"
            self._average_gradients()
            if self.lordo is not None and self.optimizer_steps and self.optimizer_steps % self.config.sync_every == 0:
                basis_start = time.perf_counter()
                self._round_movement = self._refresh_bases([p.grad for p in self.params], shared=True)
                self._round_basis_seconds += time.perf_counter() - basis_start
        self._ensure_first_bases(averaged=synchronous)
        if synchronous:
            self._round_seconds += time.perf_counter() - start

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
                self._switch_to_local()
            return report
        if not self.anchor:  # a synchronous checkpoint resumed with other phase knobs: the replicas are identical
            self.anchor = [p.detach().clone() for p in self.params]
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.config.sync_every:
            return self.sync()
        return None

    def _average_gradients(self) -> None:
        """DDP's gradient all-reduce: the mean over workers, a missing gradient counting as zeros. A parameter
        without a gradient on every worker keeps none (one flag per parameter travels with the gradients)."""
        flags = torch.zeros(len(self.params), device=self.params[0].device if self.params else None)
        grads = []
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("LoRDO's synchronous phase averages dense gradients only; use a dense embedding "
                                   "(sparse=False).")
            flags[i] = float(p.grad is not None)
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        self.comm.all_reduce_mean([*grads, flags], "gradients")
        for p, g, flag in zip(self.params, grads, flags.tolist()):
            if p.grad is None and flag > 0:
                p.grad = g

    def _ensure_first_bases(self, averaged: bool) -> None:
        """First bases for the low-rank matrices that have none: from the gradient when it is already the average
        (``averaged``) or the scope is local, else from the averaged first gradient (one extra all-reduce)."""
        lordo = self.lordo
        if lordo is None or self.config.initial_basis == "random":
            return
        missing = lordo.missing_bases()
        if not missing:
            return
        if not averaged and self.config.basis_scope == "global":
            missing = self.average_first_gradients(missing)
        lordo.install_bases(missing)

    def _finish_synchronous_round(self) -> SyncReport:
        seconds, basis_seconds, movement = self._round_seconds, self._round_basis_seconds, self._round_movement
        self._round_seconds, self._round_basis_seconds, self._round_movement = 0.0, 0.0, None
        self.syncs_done += 1
        return SyncReport(index=self.syncs_done, step=self.optimizer_steps,
                          bytes_by_purpose=self.comm.accountant.end_round(), seconds=seconds,
                          basis_seconds=basis_seconds, subspace_movement=movement, pseudo_gradient_norm=None,
                          extra={"synchronous": 1.0})

    def _switch_to_local(self) -> None:
        """The end of the warm-up (the replicas are identical): take the anchor, apply the switch knobs."""
        self.anchor = [p.detach().clone() for p in self.params]
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

    def average_first_gradients(self, grads: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """The first bases come from the averaged first gradient (SPEC §4)."""
        averaged = {p: g.detach().float().clone() for p, g in grads.items()}
        self.comm.context = "initial basis"
        self.comm.all_reduce_mean(list(averaged.values()), "initial_gradients")
        bad = [i for i, (p, g) in enumerate(averaged.items()) if not all_finite([g])]
        for i, p in enumerate(averaged):  # identical on all ranks: they all pick the same random matrices
            if i in bad:
                generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + 104_729 + i)
                averaged[p] = torch.randn(averaged[p].shape, generator=generator).to(averaged[p].device)
        if bad and self.comm.rank == 0:
            warnings.warn(f"LoRDO initial basis: the averaged first gradient of {len(bad)} weight matrices is not "
                          "finite (NaN/Inf on some worker); their first bases are seeded random ones instead.",
                          RuntimeWarning, stacklevel=2)
        return averaged

    # ------------------------------------------------------------------ one round
    @torch.no_grad()
    def sync(self) -> SyncReport:
        """One synchronization round; every worker must call it at the same point.

        Raises:
            CollectiveTimeout: a collective failed or timed out (another worker died or hangs); this worker's
                parameters, anchor, buffers and optimizer state are then as they were before the call.
        """
        start = time.perf_counter()
        self.comm.accountant.start_round()
        self.comm.context = f"sync {self.syncs_done + 1} (optimizer step {self.optimizer_steps})"
        with record_function("lordo.prepare_sync"):
            local = [(a.float() - p.float()) for a, p in zip(self.anchor, self.params)]
        with record_function("lordo.average"):
            averaged, payload_rounds = self._average_pseudo_gradients(local)
            floating, others = self._averaged_buffers()
        if not all_finite(averaged):  # identical on all workers: they all discard the round
            return self._discard(start, floating, others)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in averaged])) if averaged \
            else torch.zeros(())

        snapshot = snapshot_lowrank_state(self.lordo)
        try:
            with record_function("lordo.outer_step"):
                new_params = self._outer_step(averaged)
            basis_start = time.perf_counter()
            movement = None
            if self.lordo is not None:
                with record_function("lordo.bases"):
                    shared = self.config.basis_scope == "global"
                    movement = self._refresh_bases(averaged if shared else local, shared)
            with record_function("lordo.moments"):
                reset = self._average_moments()
            basis_seconds = time.perf_counter() - basis_start
        except BaseException:  # a collective failed or Ctrl-C: leave the optimizer as it was before the sync
            restore_lowrank_state(self.lordo, snapshot)
            raise
        with record_function("lordo.apply"), sigint_deferred():
            self._commit_buffers(floating, others)
            self._commit_outer_momentum(averaged)
            for payload, payload_round in payload_rounds:
                payload.commit(payload_round)
            for p, a, new in zip(self.params, self.anchor, new_params):
                a.copy_(new)
                p.copy_(new)
        extra = {"reset_moments": float(reset)} if reset else {}
        if self.config.payload != "full" or self.config.payload_dtype != "float32":
            extra["sync_error_feedback_norm"] = self.payload_error_norm()
        return self._finish(start, basis_seconds, movement, float(norm), extra=extra)

    def _average_pseudo_gradients(self, local: list[Tensor]) -> tuple[list[Tensor], list[tuple[Any, Any]]]:
        """The averaged pseudo-gradients (SPEC §5), and the payload rounds to commit if the sync succeeds.

        A non-finite round (NaN/Inf on any worker, so on every worker alike) comes back as non-finite averages, so
        the caller discards the round; its payload rounds are then never committed (error feedback unchanged)."""
        averaged: list[Tensor] = list(local)
        rounds: list[tuple[Any, Any]] = []
        positions = set(self._lowrank_positions)
        if self.lowrank_payload is not None:
            result = self.lowrank_payload.reduce(self.comm, [local[i] for i in self._lowrank_positions],
                                                 "pseudo_gradients")
            rounds.append((self.lowrank_payload, result))
            for n, i in enumerate(self._lowrank_positions):
                averaged[i] = result.averaged[n] if result.finite else torch.full_like(local[i], float("nan"))
        rest = [i for i in range(len(local)) if i not in positions]
        result = self.averager.reduce(self.comm, [local[i] for i in rest], "pseudo_gradients")
        rounds.append((self.averager, result))
        for i, mean in zip(rest, result.averaged):
            averaged[i] = mean
        return averaged, rounds

    def payload_error_norm(self) -> float:
        """Norm of this worker's sync-level error feedback (SPEC §5), over all payloads."""
        norms = [self.averager.error_norm()]
        if self.lowrank_payload is not None:
            norms.append(self.lowrank_payload.error_norm())
        return math.sqrt(sum(n * n for n in norms))

    def payload_state_dict(self) -> dict[str, Any]:
        """This worker's payload state (error feedback, right factors): per worker, for checkpoints."""
        state = {"averager": self.averager.state_dict()}
        if self.lowrank_payload is not None:
            state["lowrank"] = self.lowrank_payload.state_dict()
        return state

    def load_payload_state_dict(self, state: dict[str, Any]) -> None:
        self.averager.load_state_dict(state["averager"])
        if self.lowrank_payload is not None and "lowrank" in state:
            self.lowrank_payload.load_state_dict(state["lowrank"])

    def _outer_step(self, averaged: list[Tensor]) -> list[Tensor]:
        """The new anchor; the outer momentum itself is updated only at commit (:meth:`_commit_outer_momentum`)."""
        if self.config.outer_optimizer == "average":
            return [a.float() - d for a, d in zip(self.anchor, averaged)]
        lr, mom = self.config.outer_lr, self.config.outer_momentum
        momentum = self.outer_momentum or [None] * len(averaged)
        new = []
        for a, d, m in zip(self.anchor, averaged, momentum):
            m_next = d if m is None else m.mul(mom).add_(d)
            new.append(a.float() - lr * (d + mom * m_next))  # Nesterov, as torch.optim.SGD(nesterov=True)
        return new

    def _commit_outer_momentum(self, averaged: list[Tensor]) -> None:
        if self.config.outer_optimizer == "average":
            return
        if not self.outer_momentum:
            self.outer_momentum = [torch.zeros_like(d) for d in averaged]
        for m, d in zip(self.outer_momentum, averaged):
            m.mul_(self.config.outer_momentum).add_(d)

    def _refresh_bases(self, source: Sequence[Optional[Tensor]], shared: bool) -> Optional[float]:
        """New bases from ``source`` (one matrix or ``None`` per parameter); ``shared``: identical on all workers
        (then ``broadcast_bases`` sends rank 0's). Returns the mean subspace movement."""
        lordo = self.lordo
        assert lordo is not None
        lowrank = set(lordo.lowrank_params())
        sources = {p: s for p, s in zip(self.params, source) if p in lowrank and s is not None}
        moved = lordo.install_bases(sources)
        if self.config.broadcast_bases and shared:
            bases = [lordo.state[p]["basis"] for p in sources]
            self.comm.broadcast(bases, "bases")
        if not moved:
            return None
        return float(torch.stack(list(moved.values())).mean())

    def _averaged_state(self) -> dict[str, list[tuple[Tensor, list[Tensor]]]]:
        """The optimizer state averaged at a sync, by purpose: ``(parameter, its tensors)`` pairs.

        ``moments``: the low-rank moments (they share the basis; global scope only) and, with
        ``average_fullrank_moments``, every floating state tensor shaped like its full-rank parameter (AdamW's
        moments, SGD's momentum). ``error_feedback``: the optimizer's error-feedback buffers, if asked for."""
        config, lordo = self.config, self.lordo
        lowrank = set(lordo.lowrank_params()) if lordo is not None else set()
        moments, feedback = [], []
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            if p in lowrank:
                if config.average_moments and config.basis_scope == "global" and "exp_avg" in state:
                    moments.append((p, [state["exp_avg"], state["exp_avg_sq"]]))
                if config.average_error_feedback and "error_feedback" in state:
                    feedback.append((p, [state["error_feedback"]]))
            elif config.average_fullrank_moments:
                tensors = [v for k, v in state.items() if k != "step" and isinstance(v, Tensor)
                           and v.is_floating_point() and v.shape == p.shape]
                if tensors:
                    moments.append((p, tensors))
        return {"moments": moments, "error_feedback": feedback}

    def _average_moments(self) -> int:
        """Average the optimizer state of :meth:`_averaged_state` in place, in ``moments_dtype``; reset the parameters
        whose averaged state is not finite (the same on all workers, the averages being identical). Returns how
        many were reset."""
        bad: set[Tensor] = set()
        for purpose, entries in self._averaged_state().items():
            tensors = [t for _, ts in entries for t in ts]
            if not tensors:
                continue
            if self.config.moments_dtype == "float32":
                self.comm.all_reduce_mean(tensors, purpose)
            elif self.comm.world_size > 1:  # alone nothing is averaged: keep the state as it is
                for t, mean in zip(tensors, quantized_mean(self.comm, tensors, purpose,
                                                           self.config.moments_dtype).means):
                    t.copy_(mean)
            bad.update(p for p, ts in entries if not all_finite(ts))
        for p in self.params:  # in parameter order: the same on every worker
            if p in bad:
                reset_optimizer_state(self.optimizer, p, clear=self.lordo is None and self._clear_to_reset)
        return len(bad)

    def _averaged_buffers(self) -> tuple[list[Tensor], list[Tensor]]:
        """Floating buffers averaged and the others from rank 0, as copies (applied by :meth:`_commit_buffers`).

        A non-finite average (identical on all workers) is replaced by the mean of the finite values."""
        local = [b for b in self.buffers if b.is_floating_point()]
        floating = [b.detach().clone() for b in local]
        others = [b.detach().clone() for b in self.buffers if not b.is_floating_point()]
        self.comm.all_reduce_mean(floating, "buffers")
        if not all_finite(floating):
            finite = [torch.isfinite(b) for b in local]
            sums = [torch.where(f, b, torch.zeros_like(b)) for f, b in zip(finite, local)]
            counts = [f.float() for f in finite]
            self.comm.all_reduce_mean(sums + counts, "buffers")  # means of both: their ratio is the finite mean
            floating = [torch.where(c > 0, s.float() / c.clamp(min=1e-30), b.float()).to(b.dtype)
                        for s, c, b in zip(sums, counts, local)]
            if self.comm.rank == 0:
                left = "" if all_finite(floating) else " Some values are non-finite on every worker and stay so."
                warnings.warn(f"LoRDO {self.comm.context}: module buffers are not finite on some worker; they are "
                              f"averaged over the workers where they are finite.{left}", RuntimeWarning, stacklevel=4)
        self.comm.broadcast(others, "buffers")
        return floating, others

    def _commit_buffers(self, floating: list[Tensor], others: list[Tensor]) -> None:
        targets = [b for b in self.buffers if b.is_floating_point()] + [b for b in self.buffers
                                                                         if not b.is_floating_point()]
        for b, new in zip(targets, floating + others):
            b.copy_(new)

    # ------------------------------------------------------------------ non-finite rounds
    def _discard(self, start: float, floating: list[Tensor], others: list[Tensor]) -> SyncReport:
        """Every worker is here (the decision came from identical averages): discard the round everywhere.

        ``floating``, ``others``: the buffers' new values (:meth:`_averaged_buffers`), applied as in any round."""
        n = len(self.params)
        world = self.comm.world_size
        device = self.anchor[0].device if self.anchor else torch.device("cpu")
        flags = torch.zeros(n + world, device=device)
        for i, p in enumerate(self.params):
            flags[i] = float(not all_finite(state_tensors(self.optimizer.state.get(p, {}))))
        flags[n + self.comm.rank] = float(not all_finite(a.float() - p.float() for a, p in zip(self.anchor,
                                                                                                  self.params)))
        self.comm.all_reduce_mean([flags], "fault_flags")
        # no collective below: commit
        host = (flags.cpu() > 0).tolist()
        bad_ranks = [r for r in range(world) if host[n + r]]
        with sigint_deferred():
            reset = [p for p, f in zip(self.params, host[:n]) if f]
            for p in reset:
                reset_optimizer_state(self.optimizer, p, clear=self.lordo is None and self._clear_to_reset)
            for p, a in zip(self.params, self.anchor):
                p.copy_(a)
            self._commit_buffers(floating, others)
        self.skipped_syncs += 1
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

    def _finish(
        self, start: float, basis_seconds: float, movement: Optional[float], norm: float, skipped: bool = False,
        extra: Optional[dict[str, float]] = None,
    ) -> SyncReport:
        self.syncs_done += 1
        self.steps_since_sync = 0
        return SyncReport(
            index=self.syncs_done, step=self.optimizer_steps, bytes_by_purpose=self.comm.accountant.end_round(),
            seconds=time.perf_counter() - start, basis_seconds=basis_seconds, subspace_movement=movement,
            pseudo_gradient_norm=norm, skipped=skipped, extra=dict(extra or {}),
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "anchor": [a.clone() for a in self.anchor],
            "outer_momentum": [m.clone() for m in self.outer_momentum],
            "steps_since_sync": self.steps_since_sync,
            "optimizer_steps": self.optimizer_steps,
            "syncs_done": self.syncs_done,
            "skipped_syncs": self.skipped_syncs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["anchor"]  # empty when saved in the synchronous phase (no anchor is kept there)
        if saved and [tuple(a.shape) for a in saved] != [tuple(p.shape) for p in self.params]:
            raise ValueError("Synchronizer.load_state_dict: the saved anchor does not match the parameters' shapes; "
                             "resume with the model the checkpoint was written for.")
        self.anchor = [torch.empty_like(p).copy_(a) for p, a in zip(self.params, saved)]
        self.outer_momentum = [m.to(self.anchor[0].device) for m in state["outer_momentum"]]
        self.steps_since_sync = state["steps_since_sync"]
        self.optimizer_steps = state["optimizer_steps"]
        self.syncs_done = state["syncs_done"]
        self.skipped_syncs = state["skipped_syncs"]

    def memory_report(self) -> dict[str, int]:
        """Bytes of synchronization buffers (SPEC §8): the anchor, the outer momentum, the payload's state."""
        report = {
            "anchor": sum(a.numel() * a.element_size() for a in self.anchor),
            "outer_momentum": sum(m.numel() * m.element_size() for m in self.outer_momentum),
            **self.averager.memory_report(),
        }
        if self.lowrank_payload is not None:
            report.update(self.lowrank_payload.memory_report())
        return report
