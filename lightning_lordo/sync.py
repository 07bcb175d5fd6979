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
from collections.abc import Sequence
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
    pseudo_gradient_norm: float
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
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_momentum: list[Tensor] = []
        self.steps_since_sync = 0
        self.optimizer_steps = 0
        self.syncs_done = 0
        self.skipped_syncs = 0
        # torch's optimizers create a parameter's state at its first step, so clearing it gives fresh state;
        # one that already holds state now (eager, e.g. Adagrad) gets its tensors zeroed instead (module docstring)
        self._clear_to_reset = not any(optimizer.state.get(p) for p in self.params)
        self._init_payloads()
        if isinstance(optimizer, LoRDO):
            if config.initial_basis == "random":
                optimizer.init_random_bases()
            elif config.basis_scope == "global":
                optimizer.basis_source = self.average_first_gradients

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
    def on_optimizer_step(self) -> Optional[SyncReport]:
        """Count one local optimizer step; synchronize when ``sync_every`` of them have passed."""
        self.optimizer_steps += 1
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.config.sync_every:
            return self.sync()
        return None

    def average_first_gradients(self, grads: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """``LoRDO.basis_source``: the first bases come from the averaged first gradient (SPEC §4)."""
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
            movement, reset = None, 0
            if self.lordo is not None:
                with record_function("lordo.bases"):
                    movement = self._refresh_bases(local, averaged)
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

    def _refresh_bases(self, local: list[Tensor], averaged: list[Tensor]) -> Optional[float]:
        lordo = self.lordo
        assert lordo is not None
        source = averaged if self.config.basis_scope == "global" else local
        lowrank = set(lordo.lowrank_params())
        sources = {p: s for p, s in zip(self.params, source) if p in lowrank}
        moved = lordo.install_bases(sources)
        if self.config.broadcast_bases and self.config.basis_scope == "global":
            bases = [lordo.state[p]["basis"] for p in sources]
            self.comm.broadcast(bases, "bases")
        if not moved:
            return None
        return float(torch.stack(list(moved.values())).mean())

    def _average_moments(self) -> int:
        """Average the low-rank moments; reset the matrices whose averaged moments are not finite (same on all
        workers, the averages being identical). Returns how many were reset."""
        lordo = self.lordo
        assert lordo is not None
        if not self.config.average_moments or self.config.basis_scope != "global":
            return 0
        owners, moments = [], []
        for p in lordo.lowrank_params():
            state = lordo.state[p]
            if "exp_avg" in state:
                owners.append(p)
                moments += [state["exp_avg"], state["exp_avg_sq"]]
        if self.config.moments_dtype == "float32":
            self.comm.all_reduce_mean(moments, "moments")
        elif self.comm.world_size > 1:  # alone nothing is averaged: keep the moments as they are
            averaged = quantized_mean(self.comm, moments, "moments", self.config.moments_dtype).means
            for moment, mean in zip(moments, averaged):
                moment.copy_(mean)
        bad = [p for i, p in enumerate(owners) if not all_finite(moments[2 * i : 2 * i + 2])]
        for p in bad:
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
        for a, saved in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(saved)
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
