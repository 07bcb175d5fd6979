"""One LoRDO synchronization round over a process group (SPEC §4-5), independent of Lightning.

Every ``sync_every`` local steps all workers call :meth:`Synchronizer.sync` together:

1. ``prepare``: each worker's pseudo-gradient ``delta = anchor - params`` (old minus new, as DiLoCo).
2. ``average``: all-reduce the pseudo-gradients (the ``full`` payload of SPEC §5). A non-finite average
   (a NaN or Inf on any worker) discards the round on every worker: parameters go back to the anchor.
3. ``outer step``: plain averaging (``anchor - delta``) or Nesterov SGD on the anchor (DiLoCo).
4. ``bases``: new bases from the averaged pseudo-gradient (``basis_scope="global"``) or from each worker's
   own (``"local"``); the optimizer rotates its moments into them.
5. ``moments``: the low-rank moments are averaged (they share the basis, so the average is well defined).
6. ``apply``: parameters and anchor become the new point; floating buffers are averaged.

Failure semantics: every collective is bounded by the communicator's timeout; a worker that dies or hangs
makes the others raise :class:`~lightning_lordo.accounting.CollectiveTimeout` naming the sync. Parameters
are only overwritten after all collectives of the round succeeded.

Reference: Jovanović et al., "LoRDO: Distributed Low-Rank Optimization with Infrequent Communication",
ICML 2026 (arXiv 2602.04396); Douillard et al., "DiLoCo" (arXiv 2311.08105) for the outer step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_lordo.accounting import Communicator
from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.lordo import LoRDO


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
        if isinstance(optimizer, LoRDO):
            if config.initial_basis == "random":
                optimizer.init_random_bases()
            elif config.basis_scope == "global":
                optimizer.basis_source = self.average_first_gradients

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
        return averaged

    # ------------------------------------------------------------------ one round
    @torch.no_grad()
    def sync(self) -> SyncReport:
        """One synchronization round; every worker must call it at the same point."""
        start = time.perf_counter()
        self.comm.accountant.start_round()
        self.comm.context = f"sync {self.syncs_done + 1} (optimizer step {self.optimizer_steps})"
        with record_function("lordo.prepare_sync"):
            averaged = [(a.float() - p.float()) for a, p in zip(self.anchor, self.params)]
            # each worker's own pseudo-gradient is kept only when the bases come from it (LoRDO-Local)
            local = [d.clone() for d in averaged] if self.config.basis_scope == "local" else averaged
        with record_function("lordo.average"):
            self.comm.all_reduce_mean(averaged, "pseudo_gradients")
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in averaged])) if averaged \
            else torch.zeros(())
        if not torch.isfinite(norm):  # identical on all workers: they all discard the round
            return self._discard(start)

        with record_function("lordo.outer_step"):
            new_params = self._outer_step(averaged)
        basis_start = time.perf_counter()
        movement = None
        if self.lordo is not None:
            with record_function("lordo.bases"):
                movement = self._refresh_bases(local, averaged)
            with record_function("lordo.moments"):
                self._average_moments()
        basis_seconds = time.perf_counter() - basis_start
        with record_function("lordo.apply"):
            self._average_buffers()
            for p, a, new in zip(self.params, self.anchor, new_params):
                a.copy_(new)
                p.copy_(new)
        return self._finish(start, basis_seconds, movement, float(norm))

    def _outer_step(self, averaged: list[Tensor]) -> list[Tensor]:
        if self.config.outer_optimizer == "average":
            return [a.float() - d for a, d in zip(self.anchor, averaged)]
        if not self.outer_momentum:
            self.outer_momentum = [torch.zeros_like(d) for d in averaged]
        lr, mom = self.config.outer_lr, self.config.outer_momentum
        new = []
        for a, d, m in zip(self.anchor, averaged, self.outer_momentum):
            m.mul_(mom).add_(d)
            new.append(a.float() - lr * (d + mom * m))  # Nesterov, as torch.optim.SGD(nesterov=True)
        return new

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

    def _average_moments(self) -> None:
        lordo = self.lordo
        assert lordo is not None
        if not self.config.average_moments or self.config.basis_scope != "global":
            return
        moments = []
        for p in lordo.lowrank_params():
            state = lordo.state[p]
            if "exp_avg" in state:
                moments += [state["exp_avg"], state["exp_avg_sq"]]
        self.comm.all_reduce_mean(moments, "moments")

    def _average_buffers(self) -> None:
        floating = [b for b in self.buffers if b.is_floating_point()]
        self.comm.all_reduce_mean(floating, "buffers")
        self.comm.broadcast([b for b in self.buffers if not b.is_floating_point()], "buffers")

    def _discard(self, start: float) -> SyncReport:
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        self.skipped_syncs += 1
        return self._finish(start, 0.0, None, float("nan"), skipped=True)

    def _finish(
        self, start: float, basis_seconds: float, movement: Optional[float], norm: float, skipped: bool = False
    ) -> SyncReport:
        self.syncs_done += 1
        self.steps_since_sync = 0
        return SyncReport(
            index=self.syncs_done, step=self.optimizer_steps, bytes_by_purpose=self.comm.accountant.end_round(),
            seconds=time.perf_counter() - start, basis_seconds=basis_seconds, subspace_movement=movement,
            pseudo_gradient_norm=norm, skipped=skipped,
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
        """Bytes of synchronization buffers (SPEC §8): the anchor and the outer momentum."""
        return {
            "anchor": sum(a.numel() * a.element_size() for a in self.anchor),
            "outer_momentum": sum(m.numel() * m.element_size() for m in self.outer_momentum),
        }
