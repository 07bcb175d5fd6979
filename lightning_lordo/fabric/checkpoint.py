"""``fabric.save`` / ``fabric.load`` with ``Fabric(strategy="lordo")``: checkpoints of the synchronized model.

Between two synchronizations every rank holds its own model, and Fabric writes rank 0's objects only. So a save
that includes the synchronized model or its optimizer must come at a synchronization boundary (right after a
synchronization, every ``sync_every`` steps counted from the last one, or after ``fabric.strategy.finish()``,
which starts the count again; any step in the synchronous phase); elsewhere it raises, naming the next one. With
``overlap_steps`` a round is in flight at each of them, so save after ``finish()``: it lands the round, and the
save *waits* for it. At a boundary the model and buffers are identical on every rank. The file then holds, besides
your own keys:

* your ``"model"`` entry as Fabric writes it, and your optimizer's entry in torch AdamW's shape (rank 0's state,
  the low-rank moments expanded through their bases), so that ``Fabric(strategy="ddp")`` loads the file into your
  AdamW, with or without this plugin;
* ``checkpoint["lordo"]`` (:mod:`lightning_lordo.checkpoint`): the synchronizer's state without the anchor
  (counters, the outer step's momentum), the optimizer's class, the communication totals and LoRDO's own optimizer
  state (rank 0's: the low-rank moments are averaged at each synchronization, the full-rank moments are rank 0's;
  ``fabric.save(filter=...)`` filters it as your optimizer's entry); tensors, numbers and strings, which
  ``torch.load(weights_only=True)`` reads. A file that another strategy saved again with this entry beside a newer
  optimizer entry (its step counts differ) has the entry ignored, with a warning.

``fabric.load(path, {"model": model, "optimizer": optimizer, ...})`` restores all of it on every rank: the loaded
model becomes the synchronized point, the counters and byte totals continue (a checkpoint saved in the synchronous
warm-up, loaded into a run past it, switches to local steps there, switch knobs included). Every rank resumes from
rank 0's optimizer state with the knobs passed now, as the Trainer's resume does (one warning lists what changed;
not bit-exact for the full-rank moments; the compressed payloads' error feedback restarts at zero). An optimizer
state that this strategy did not write (a DDP run's AdamW state, say) is converted as the Trainer converts it: the
full-rank moments are kept, the low-rank matrices' moments restart in their new subspace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from typing_extensions import override

from lightning_lordo.checkpoint import adamw_entry, check, fabric_entry, sync_knob_changes
from lightning_lordo.optim.loading import (
    FROM_ANOTHER_STRATEGY,
    LORDO_KNOBS,
    group_knob_changes,
    is_lordo_state,
    load_optimizer,
    warn,
)
from lightning_lordo.optim.lordo import LoRDO

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

    from lightning_lordo.comm.accounting import CommAccountant
    from lightning_lordo.core import LoRDOCore
    from lightning_lordo.sync.synchronizer import Synchronizer

#: The checkpoint key of the strategy's own state.
STATE_KEY = "lordo"


class SynchronizedCheckpoints:
    """Fabric's ``save_checkpoint`` and ``load_checkpoint`` for :class:`~lightning_lordo.fabric.LoRDOFabricStrategy`
    (a mixin before Fabric's ``DDPStrategy``; the strategy provides ``core``, ``module``, ``optimizer``,
    ``synchronizer``, ``accountant`` and ``world_size``)."""

    core: LoRDOCore
    module: Optional[nn.Module]
    optimizer: Optional[Optimizer]
    synchronizer: Optional[Synchronizer]
    accountant: CommAccountant
    world_size: int
    global_rank: int

    def _ours(self, state: Any) -> tuple[bool, Optional[str]]:
        """Whether ``state`` (a dict of unwrapped objects) holds the synchronized model, and the optimizer's key."""
        if not isinstance(state, dict) or self.synchronizer is None:
            return False, None
        model = any(v is self.module for v in state.values())
        return model, next((k for k, v in state.items() if v is self.optimizer), None)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        model, optimizer_key = self._ours(state)
        if model or optimizer_key is not None:
            synchronizer = self.synchronizer
            if synchronizer.in_flight is not None:  # the same on every rank: all raise, none waits in a barrier
                raise RuntimeError(
                    f"fabric.save with strategy='lordo' saves the synchronized model, but at optimizer step "
                    f"{synchronizer.optimizer_steps} the round launched at step {synchronizer.in_flight.step} is "
                    "still in flight (overlap_steps) and every rank holds its own model. Call "
                    "fabric.strategy.finish() on every rank first: it lands the round (training may go on after).")
            if synchronizer.steps_since_sync > 0:
                steps, since = synchronizer.optimizer_steps, synchronizer.steps_since_sync
                next_sync = steps + synchronizer.config.sync_every - since
                raise RuntimeError(
                    f"fabric.save with strategy='lordo' saves the synchronized model, but this is optimizer step "
                    f"{steps}, {since} local step(s) after the last "
                    "synchronization, and every rank holds its own model. "
                    + ("With overlap_steps a round is in flight after each sync, so call fabric.strategy.finish() on "
                       "every rank first (it lands the round; training may go on after)."
                       if synchronizer.config.overlap_steps else
                       f"Save right after a synchronization (the next is after optimizer step {next_sync}; rounds "
                       "count from the last one, finish() included), or call fabric.strategy.finish() on every rank "
                       "first."))
            own = None
            writes = self.global_rank == 0  # Fabric writes rank 0's objects only
            if optimizer_key is not None and isinstance(self.optimizer, LoRDO) and writes:  # AdamW's shape: any
                own = self.optimizer.state_dict()  # strategy loads it
                state = {**state, optimizer_key: adamw_entry(self.core, own)[0]}
                keep = (filter or {}).get(optimizer_key)  # Fabric filters the user's entry: LoRDO's alike
                if keep is not None:
                    own = {k: v for k, v in own.items() if keep(k, v)} or None
            state = {**state, STATE_KEY: fabric_entry(self.core, self.world_size, own, optimizer_key)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        base = super()  # type: ignore[misc]
        if state is not None and not isinstance(state, dict) and state is self.module:  # fabric.load_raw(model)
            self._drop_round_in_flight()
            remainder = base.load_checkpoint(path, state, strict=strict, weights_only=weights_only)
            self._new_synchronized_point()
            return remainder
        model, optimizer_key = self._ours(state)
        if not model and optimizer_key is not None and self.synchronizer is not None and self.synchronizer.mid_round:
            raise RuntimeError("fabric.load of the optimizer without the model between syncs: each rank's model is its "
                               "own then, and the loaded state belongs to the checkpoint's synchronized model. Load "
                               "the model too (fabric.load(path, {'model': model, 'optimizer': optimizer})), or call "
                               "fabric.strategy.finish() first.")
        if not model and optimizer_key is None:  # nothing synchronized is loaded: a round in flight goes on
            return base.load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        self._drop_round_in_flight()
        proxy = dict(state)
        if optimizer_key is not None:
            proxy[optimizer_key] = None  # Fabric puts the saved state dict here; it is checked before it is loaded
        remainder = base.load_checkpoint(path, proxy, strict=strict, weights_only=weights_only)
        saved = remainder.pop(STATE_KEY, None)
        if saved is not None:
            saved = check(saved, f"Checkpoint {str(path)!r}")
        for key, value in proxy.items():  # what Fabric restored in place, e.g. your step counter
            if key != optimizer_key:
                state[key] = value
        own = (saved or {}).get("optimizer_state")  # LoRDO's own, if it was LoRDO (format 1: under the user's key)
        entry = proxy[optimizer_key] if optimizer_key is not None else remainder.get((saved or {}).get("optimizer_key"))
        notes = []
        if own is not None and entry is not None and _steps(own) != _steps(entry):  # the file was saved again
            notes.append(f"the checkpoint's {STATE_KEY!r} entry is older than its optimizer entry (another strategy "
                         "saved the file again with it): it is ignored, and the file is loaded as another strategy's")
            saved = own = None
        notes += sync_knob_changes(saved.get("sync_knobs") if saved is not None else None, self.sync_config)
        if optimizer_key is not None and proxy[optimizer_key] is not None:
            self._load_optimizer(proxy[optimizer_key] if own is None else own, saved, notes)
        else:
            warn(notes, self.global_rank)
        if saved is not None:
            self._restore_counters(saved)
        restored_optimizer = optimizer_key is not None and proxy[optimizer_key] is not None
        sync = saved["sync"] if saved is not None else {}
        # the switch knobs scale the optimizer's groups: once, onto warm-up values (just restored, or never switched)
        switched = self.synchronizer is not None and self.synchronizer.switched
        switch = sync.get("synchronous", False) and (restored_optimizer or not switched)
        self._new_synchronized_point(sync.get("anchor_step"), switch=switch)
        return remainder

    def _load_optimizer(self, optimizer_state: dict[str, Any], saved: Optional[dict[str, Any]], notes: list[str]
                        ) -> None:
        """As the Trainer's resume (``optim/loading.py``): the knobs passed now win, a state of another optimizer or
        strategy is converted, and one warning lists what changed (after ``notes``)."""
        knobs = [{k: g[k] for k in LORDO_KNOBS if k in g} for g in optimizer_state["param_groups"]]
        names = {p: n for n, p in self.module.named_parameters()}
        another = saved is None and not is_lordo_state(optimizer_state)  # a DDP run's AdamW, say
        notes = notes + ([FROM_ANOTHER_STRATEGY] if another and isinstance(self.optimizer, LoRDO) else [])
        notes += group_knob_changes(knobs, self.optimizer)
        notes += load_optimizer(self.optimizer, optimizer_state, None, names)
        warn(notes, self.global_rank)

    def _restore_counters(self, saved: dict[str, Any]) -> None:
        self.synchronizer.load_state_dict(saved["sync"], anchor=False)  # the loaded model is the anchor
        self.accountant.load_state_dict(saved["communication"])

    def _drop_round_in_flight(self) -> None:
        """A round launched before loading the synchronized model (``overlap_steps``) no longer applies: it is
        dropped before anything is restored (its thread counts bytes and reads the bases)."""
        if self.synchronizer is not None:
            self.synchronizer.drop_in_flight()

    def _new_synchronized_point(self, step: Optional[int] = None, switch: bool = False) -> None:
        """Every rank loaded the same model (that of optimizer step ``step``, if known): it is the synchronized
        point (the anchor) from now on; ``switch``: it was saved in the synchronous phase, so a run now past its
        warm-up switches to local steps here (switch knobs included)."""
        synchronizer = self.synchronizer
        if synchronizer is None:
            return
        synchronizer.steps_since_sync = 0
        if synchronizer.synchronous_now:
            return
        if switch:
            synchronizer.switch_to_local()
        else:
            synchronizer.take_anchor(step)


def _steps(optimizer_state: dict[str, Any]) -> dict[Any, float]:
    """Each parameter's step count in an optimizer state dict: LoRDO's own state and its AdamW-shaped copy have the
    same, and a file that another strategy saved again after training on does not."""
    return {i: float(entry["step"]) for i, entry in optimizer_state.get("state", {}).items() if "step" in entry}
