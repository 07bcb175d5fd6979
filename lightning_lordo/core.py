"""The LoRDO core: what the Trainer's and Fabric's strategies share, by composition (each holds one).

It owns the resolved knobs, the conversion of the user's optimizer, the synchronizer and its communicators' traffic
accounting, the step driver (before and after each optimizer step), the trainable-set check, the parameter plan and
the figures (one summary convention for the Trainer's monitor and Fabric's ``communication_summary()``). It imports
neither Lightning nor Fabric: each strategy keeps only its framework's hooks and calls into it.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_lordo._tensors import nbytes
from lightning_lordo.comm.accounting import ddp_wire_bytes
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import OPTIMIZER_DEFAULTS
from lightning_lordo.convert import (
    check_dense,
    check_switch_betas,
    compile_patterns,
    convert_optimizer,
    full_rank_params,
    plan_message,
    repoint_schedulers,
    scale_scheduler_lrs,
    undriven_step_message,
    unfrozen_message,
)
from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.strategy_knobs import Knobs
from lightning_lordo.sync.report import SyncReport, breakdown
from lightning_lordo.sync.synchronizer import Synchronizer


def saving_ratio(ddp: float, sent: float) -> float:
    """DDP's bytes per byte sent; 1.0 while neither has sent anything (one device), finite always."""
    return 1.0 if ddp == 0 and sent == 0 else ddp / max(sent, 1)


class LoRDOCore:
    """The shared part of ``LoRDOStrategy`` and ``LoRDOFabricStrategy``.

    Args:
        knobs: the strategy's resolved knobs (:func:`~lightning_lordo.strategy_knobs.resolve_knobs`).
        owner: the strategy's user-facing name, for the errors (``"strategy='lordo'"``, ``"Fabric(strategy='lordo')"``).
    """

    def __init__(self, knobs: Knobs, owner: str) -> None:
        self.knobs, self.owner = knobs, owner
        self.sync_config = knobs.sync_config
        self.full_rank_patterns = compile_patterns(knobs.full_rank_params)
        self.accountant = CommAccountant()
        self.communicator: Optional[Communicator] = None
        self.overlap_comm: Optional[Communicator] = None  # overlap_steps: the side group's communicator
        self.synchronizer: Optional[Synchronizer] = None
        self.sync_reports: list[SyncReport] = []
        self.parameter_names: dict[Tensor, str] = {}
        self.ddp_bytes_per_step = 0  # what DDP's gradient all-reduce passes per worker and optimizer step
        self.module: Optional[nn.Module] = None
        self.optimizer: Optional[Optimizer] = None  # the optimizer stepped: LoRDO, or the user's (diloco)
        self.unfrozen: set[str] = set()  # one process: the parameters unfrozen after setup, warned about once
        self._step_driven = False  # before_step ran for the step being taken (after_step clears it)
        self._undriven_check: Any = None  # the optimizer's hook that refuses a step without it (its handle)
        self._first_step_mark: Any = None  # the conversion's hook that marks the first step for the schedulers

    def new_fit(self) -> None:
        """A new run counts its own traffic and reports."""
        self.accountant, self.sync_reports = CommAccountant(), []

    # ------------------------------------------------------------------ setup
    def attach(self, module: nn.Module, user_optimizer: Optimizer, schedulers: Sequence[Any], source: str,
               on_switch: Callable[[], None]) -> Optimizer:
        """The optimizer LoRDO steps (the user's Adam/AdamW converted, a LoRDO as it is, or with ``lowrank=False``
        the user's own) and the synchronizer over the module's trainable parameters.

        Args:
            schedulers: the LR schedulers stepping ``user_optimizer``; they are re-pointed at the converted one.
            source: where the optimizer came from, for the error (``"configure_optimizers returned"``).
            on_switch: called at the end of the warm-up (the strategy scales its schedulers' base LRs).
        """
        assert self.communicator is not None, "the communicator is made before the optimizer is attached"
        self.parameter_names = {p: n for n, p in module.named_parameters()}
        strays = [tuple(p.shape) for g in user_optimizer.param_groups for p in g["params"]
                  if p not in self.parameter_names]
        if strays:  # they would train on every rank and never be averaged
            raise ValueError(f"{self.owner}: {source} an optimizer holding {len(strays)} parameter(s) that the model "
                             f"does not (shapes {strays[:3]}), so they would never be synchronized. Give the "
                             "optimizer one model's parameters, or make them one model (e.g. an nn.ModuleDict of "
                             "both, set up once).")
        optimizer, core, owner = user_optimizer, weakref.ref(self), self.owner  # the hook below keeps no core alive
        if self.knobs.lowrank:
            if not isinstance(optimizer, LoRDO) and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
                raise TypeError(
                    f"{self.owner} converts torch.optim.Adam or AdamW into LoRDO, but {source} "
                    f"{type(optimizer).__name__}. Use Adam/AdamW or lightning_lordo.LoRDO, or strategy='diloco' "
                    "(full-rank local steps with any optimizer, averaged every K steps).")
            if isinstance(optimizer, LoRDO) and self.knobs.optimizer_given:  # they would be silently dropped
                raise ValueError(
                    f"The strategy got optimizer knobs ({', '.join(self.knobs.optimizer_given)}, from optimizer=), "
                    f"but {source} a LoRDO, whose own knobs are the ones that train. Set them in one place: in "
                    "LoRDO(...) and no optimizer=, or use torch's AdamW and let the strategy convert it.")
            if isinstance(optimizer, LoRDO) and self.knobs.preset_optimizer:  # the preset's give way to the user's
                warnings.warn(f"LoRDO: {source} a LoRDO, whose own knobs train: the preset's optimizer values "
                              f"{self.knobs.preset_optimizer} give way (its other knobs apply).", stacklevel=3)
            names = list(self.parameter_names.values())
            unmatched = [r.pattern for r in self.full_rank_patterns if not any(map(r.search, names))]
            if unmatched:
                raise ValueError(f"Invalid full_rank_params: {unmatched} match no parameter name, so they would be "
                                 f"ignored. The names are like {names[:4]}; "
                                 "strategy.parameter_plan() lists them with their steps. Fix or drop the pattern.")
            optimizer = convert_optimizer(user_optimizer, full_rank_params(module, self.full_rank_patterns),
                                          self.knobs.optimizer_knobs, self.sync_config.seed, self.parameter_names)
            if optimizer is not user_optimizer:  # its first step's hook goes at the first after_step
                self._first_step_mark = repoint_schedulers(list(schedulers), user_optimizer, optimizer)
        if isinstance(optimizer, torch.optim.LBFGS) and self.communicator.world_size > 1 and \
                not self.sync_config.synchronous:
            raise TypeError(f"{self.owner}: {source} torch.optim.LBFGS, whose curvature history pairs its own last "
                            "step with the gradient change since, which a sync's jump to the average corrupts. Use "
                            "it on one device, or with strategy='ddp'.")
        if isinstance(optimizer, LoRDO):
            check_dense(module, optimizer)
        self.check_sync_knobs(optimizer, converted=optimizer is not user_optimizer)
        if "switch_betas" in self.knobs.sync_given:
            check_switch_betas([c.scheduler for c in schedulers], self.sync_config.switch_betas)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.ddp_bytes_per_step = nbytes(trainable)
        self.synchronizer = Synchronizer(trainable, list(module.buffers()), optimizer, self.sync_config,
                                         self.communicator, self.overlap_comm)
        self.synchronizer.switch_callbacks.append(on_switch)
        self.module, self.optimizer = module, optimizer

        def refuse_undriven(opt: Optimizer, args: Any, kwargs: Any) -> None:  # on the step's path: core.py's code
            found = core()
            if found is not None and not found._step_driven:
                raise RuntimeError(undriven_step_message(owner))

        self._undriven_check = optimizer.register_step_post_hook(refuse_undriven)  # until finish() or teardown
        return optimizer

    def check_sync_knobs(self, optimizer: Optimizer, converted: bool) -> None:
        """Refuse synchronization knobs the user set that this optimizer would ignore, and warn once about those one
        process ignores (nothing travels: :meth:`~lightning_lordo.config.SyncConfig.alone`)."""
        given, config, lordo = self.knobs.sync_given, self.sync_config, isinstance(optimizer, LoRDO)
        # (knobs of LoRDO's low-rank state without LoRDO, lowrank=False, are refused when the strategy is built)
        if lordo and config.average_error_feedback and not any(g["error_feedback"] for g in optimizer.param_groups):
            raise ValueError("Invalid average_error_feedback=True: it shapes what a sync does with LoRDO's "
                             "error-feedback buffers, and the LoRDO that trains has none, so it would be ignored. "
                             "Drop it.")
        if lordo and config.initial_basis == "random" and any(
                g["projection"] == "power" and g["oversample"] != OPTIMIZER_DEFAULTS["oversample"]
                for g in optimizer.param_groups):
            raise ValueError("Invalid oversample with initial_basis='random' and projection='power': oversample only "
                             "shapes power's first basis (a range finder), and the first bases are random here, so "
                             "it would be ignored. Drop it, or use initial_basis='gradient' or "
                             "projection='randomized'.")
        if lordo and not converted and "seed" in given and config.seed != optimizer.seed:
            raise ValueError(f"Invalid seed={config.seed!r}: the LoRDO you return has seed={optimizer.seed}, which "
                             "seeds its bases. Set the seed in one place: LoRDO(..., seed=...), no experimental seed.")
        if "switch_betas" in given and not any("betas" in g for g in optimizer.param_groups):
            raise ValueError(f"Invalid switch_betas={config.switch_betas!r}: {type(optimizer).__name__} has no betas, "
                             "so it would be ignored. Drop it.")
        if config.average_fullrank_moments and isinstance(optimizer, torch.optim.SGD) and not any(
                g.get("momentum") for g in optimizer.param_groups):
            raise ValueError("Invalid average_fullrank_moments=True: SGD without momentum keeps no state to average, "
                             "so it would be ignored. Drop it.")
        rounds_only = ("max_skipped_syncs", "bucket_cap_mb") if config.alone().synchronous else ()
        alone = [k for k in ("payload", "payload_dtype", "fullrank_rank", "moments_every", "average_fullrank_moments",
                             "average_error_feedback", "broadcast_bases", "average_moments", *rounds_only)
                 if k in given]
        if alone and self.communicator is not None and self.communicator.world_size == 1:
            warnings.warn(f"LoRDO on one process: {', '.join(f'{k}={getattr(config, k)!r}' for k in alone)} shape "
                          "what travels between workers or the rounds, and one process has neither here, so they "
                          "have no effect.", stacklevel=3)

    def plan_message(self) -> Optional[str]:
        """The start-up line of the parameter plan (``None`` without a LoRDO optimizer)."""
        return plan_message(self.optimizer, self.parameter_names) if isinstance(self.optimizer, LoRDO) else None

    def parameter_plan(self) -> list[dict[str, Any]]:
        """Which parameter takes the low-rank step and which takes AdamW, with names and reasons."""
        return self.optimizer.describe(self.parameter_names) if isinstance(self.optimizer, LoRDO) else []

    @staticmethod
    def scale_schedulers(schedulers: Sequence[Any], scale: float) -> None:
        for scheduler in schedulers:
            scale_scheduler_lrs(scheduler, scale)

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        """After the backward pass of each optimizer step: the gradient average (synchronous phase), first bases."""
        assert self.synchronizer is not None
        self.synchronizer.before_optimizer_step()
        self._step_driven = True

    def after_step(self, last: bool = False) -> Optional[SyncReport]:
        """After each optimizer step: the step count and, every ``sync_every`` steps (or at ``last``), the sync."""
        synchronizer = self.synchronizer
        assert synchronizer is not None
        self._step_driven = False
        if self._first_step_mark is not None:  # removed here: from inside torch's loop over the hooks it breaks it
            self._first_step_mark.remove()
            self._first_step_mark = None
        k = self.sync_config.sync_every  # at a sync, or every K synchronous steps (their gradients' average)
        if last or ((synchronizer.optimizer_steps + 1) % k == 0 if synchronizer.synchronous_now else self.round_due()):
            self.check_synchronized_set()
        report = synchronizer.on_optimizer_step()
        if report is not None:
            self.sync_reports.append(report)
        return report

    def round_due(self) -> bool:
        """Whether the step being taken (not counted yet) ends a round of local steps: its sync follows."""
        sync, k = self.synchronizer, self.sync_config.sync_every
        return sync is not None and not sync.synchronous_now and sync.steps_since_sync + 1 >= k

    def finish(self) -> list[SyncReport]:
        """The end of training: the round in flight lands, and the steps since it are synchronized."""
        assert self.synchronizer is not None
        self.release_optimizer()
        reports = self.synchronizer.finish()
        self.sync_reports += reports
        return reports

    def release_optimizer(self) -> None:
        """The optimizer's steps are the user's own again (after the final sync, at teardown): no more check of
        undriven steps. Training may go on (Fabric's ``finish()`` mid-run): the next setup checks again."""
        if self._undriven_check is not None:
            self._undriven_check.remove()
            self._undriven_check = None

    def round_ended(self) -> bool:
        """At the exit: the round in flight's thread ends (bounded by the timeout; not landed). Whether no thread of
        this core is still in a collective, so that its groups may be destroyed."""
        if (sync := self.synchronizer) is None:
            return True
        sync.let_in_flight_end()
        launched = sync.in_flight
        return launched is None or launched.thread is None or not launched.thread.is_alive()

    def check_synchronized_set(self) -> None:
        """Refuse parameters that became trainable after setup (e.g. unfrozen by a callback): they would train
        locally on every rank and never be averaged."""
        assert self.synchronizer is not None and self.module is not None
        known = {id(p) for p in self.synchronizer.params}
        new = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in known]
        if new and self.communicator is not None and self.communicator.world_size == 1:  # nothing drifts apart
            if not set(new) <= self.unfrozen:
                warnings.warn(f"LoRDO: {new[:5]} became trainable after training started: they train, but their bases "
                              "are never refreshed (only what was trainable at setup is). Unfreeze them before "
                              "trainer.fit / fabric.setup, or resume from a checkpoint, for refreshed bases.",
                              stacklevel=3)
            self.unfrozen.update(new)
        elif new:
            raise RuntimeError(unfrozen_message(new))

    # ------------------------------------------------------------------ figures
    def ddp_equivalent_bytes(self, world_size: int, report: Optional[SyncReport] = None) -> int:
        """What DDP's gradient all-reduce would have passed per worker, by now or by ``report``'s step: nothing on
        one device (DDP sends nothing there)."""
        if world_size <= 1:
            return 0
        steps = report.step if report is not None else \
            self.synchronizer.optimizer_steps if self.synchronizer is not None else 0
        return self.ddp_bytes_per_step * steps

    def figures(self, world_size: int, report: Optional[SyncReport] = None,
                totals_only: bool = False) -> dict[str, float]:
        """The figures after ``report``, with the byte totals at the end of its round (or the current totals
        without one; only the byte totals with ``totals_only``)."""
        total = report.total_bytes if report is not None and report.total_bytes is not None \
            else self.accountant.total_bytes
        ddp = self.ddp_equivalent_bytes(world_size, report)
        wire = report.total_wire_bytes if report is not None and report.total_wire_bytes is not None \
            else self.accountant.total_wire_bytes
        ddp_wire = ddp_wire_bytes(ddp, world_size)  # DDP's gradients by a float32 ring all-reduce
        out: dict[str, float] = {
            "bytes_sent_total": total, "ddp_equivalent_bytes": ddp, "bytes_saving_vs_ddp": saving_ratio(ddp, total),
            "wire_bytes_total": wire, "ddp_equivalent_wire_bytes": ddp_wire,
            "wire_saving_vs_ddp": saving_ratio(ddp_wire, wire)}
        if totals_only or self.synchronizer is None:
            return out
        out["skipped_syncs"] = self.synchronizer.skipped_syncs
        if report is not None:
            out.update({
                "bytes_sent_sync": report.bytes_sent,
                "wire_bytes_sync": sum(report.wire_by_purpose.values()),
                **{f"bytes_sync/{k}": v for k, v in breakdown(report.bytes_by_part).items()},
                **{f"wire_bytes_sync/{k}": v for k, v in breakdown(report.wire_by_part).items()},
                "sync_seconds": report.seconds,
                "basis_seconds": report.basis_seconds,
            })
            norm = report.pseudo_gradient_norm  # None for a synchronous step, NaN for a discarded round
            if norm is not None and math.isfinite(norm):
                out["pseudo_gradient_norm"] = norm
            if report.subspace_movement is not None:
                out["subspace_movement"] = report.subspace_movement
            out.update(report.extra)  # e.g. sync_error_feedback_norm (compressed payloads), reset counts
        if hasattr(self.synchronizer.optimizer, "diagnostics"):  # those of the round's last step, if it took them
            taken = None if report is None else report.step if report.taken_at is None else report.taken_at
            age = self.synchronizer.optimizer_steps - taken if taken is not None else None
            out.update(self.synchronizer.optimizer.diagnostics(age))
        out.update(self.memory_figures())
        return {k: v for k, v in out.items() if v is not None}  # a figure this round does not have is left out

    def memory_figures(self) -> dict[str, float]:
        """SPEC §8's three memory lines (bytes per worker), and AdamW's state for the same parameters."""
        if self.synchronizer is None:
            return {}
        optimizer = self.synchronizer.optimizer
        out = {"sync_buffer_bytes": sum(self.synchronizer.memory_report().values())}
        if hasattr(optimizer, "memory_report"):
            memory = optimizer.memory_report()
            out["optimizer_state_bytes"] = (memory["lowrank_moments"] + memory["bases"] + memory["fullrank_moments"]
                                            + memory["other"])
            out["error_feedback_bytes"] = memory["error_feedback"]
            out["adamw_state_bytes"] = memory["adamw_equivalent"]
        return out

    def summary(self, world_size: int) -> dict[str, Any]:
        """This rank's figures so far, one convention for the Trainer's end-of-fit table and Fabric's
        ``communication_summary()``: the byte totals (by purpose, on the wire, DDP's equivalent and the ratio, which
        is ``None`` on one device), the syncs and steps, the mean sync time and the memory lines."""
        sync, reports = self.synchronizer, self.sync_reports
        out: dict[str, Any] = {**self.figures(world_size, totals_only=True), **self.memory_figures()}
        if world_size <= 1:
            out["bytes_saving_vs_ddp"] = out["wire_saving_vs_ddp"] = None  # DDP sends nothing on one device
        out.update({
            "bytes_by_purpose": dict(sorted(self.accountant.totals.items())),
            "syncs": sync.syncs_done if sync is not None else 0,
            "skipped_syncs": sync.skipped_syncs if sync is not None else 0,
            "optimizer_steps": sync.optimizer_steps if sync is not None else 0,
            "steps_since_sync": sync.steps_since_sync if sync is not None else 0,
            "round_in_flight": sync is not None and sync.in_flight is not None,
            "mean_sync_seconds": sum(r.seconds for r in reports) / len(reports) if reports else None,
            "mean_basis_seconds": sum(r.basis_seconds for r in reports) / len(reports) if reports else None,
            "world_size": world_size,
        })
        return out


class InCore:
    """A strategy attribute that lives in the strategy's core: ``strategy.synchronizer`` is
    ``strategy.core.synchronizer`` (read and written), so the strategies' hooks and users keep their names."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, strategy: Any, owner: Optional[type] = None) -> Any:
        return self if strategy is None else getattr(strategy.core, self.name)

    def __set__(self, strategy: Any, value: Any) -> None:
        setattr(strategy.core, self.name, value)


class HoldsCore:
    """The core's state under the strategy's names (a mixin of both strategies)."""

    def teardown(self) -> None:
        self.core.release_optimizer()  # after the fit (or a failed one)
        super().teardown()  # type: ignore[misc]

    core: LoRDOCore
    sync_config = InCore()
    accountant = InCore()
    communicator = InCore()
    synchronizer = InCore()
    sync_reports = InCore()
    parameter_names = InCore()
    ddp_bytes_per_step = InCore()

    @property
    def lowrank(self) -> bool:
        return self.core.knobs.lowrank

    @property
    def optimizer_knobs(self) -> dict[str, Any]:
        return self.core.knobs.optimizer_knobs

    def parameter_plan(self) -> list[dict[str, Any]]:
        """Which parameter takes the low-rank step and which takes AdamW, with names and reasons."""
        return self.core.parameter_plan()

    @property
    def ddp_equivalent_bytes(self) -> int:
        """Bytes DDP's gradient all-reduce would have passed per worker for the optimizer steps so far (0 on one
        device: DDP sends nothing there)."""
        return self.core.ddp_equivalent_bytes(self.world_size)  # type: ignore[attr-defined]
