"""How a run resumes from a LoRDO checkpoint (what it holds: :mod:`lightning_lordo.checkpoint`), also with changed
knobs, another world size, another preset (``lordo`` <-> ``diloco``), a checkpoint of another strategy or a changed
set of trainable parameters.

The rule: **the knobs passed now win**. Every difference from the checkpoint's knobs is listed in one warning,
with what it did to the state: a new rank restarts that matrix's moments (its basis comes from the next averaged
gradient), a matrix that became full-rank gets AdamW moments expanded through its basis, error feedback and
factored statistics are created, cast or dropped, a changed payload or payload dtype restarts the payload's error
feedback. What cannot be converted is refused before training starts, naming the knob, the saved value and the new
one: going back to synchronous steps after the warm-up's switch, switch knobs changed after the switch, or a
changed set of trainable parameters in a checkpoint written mid-round (the local replicas cannot be matched).

Optimizer state is matched to parameters by name, so a parameter added (an untied head), removed or frozen keeps
the others' state. A torch Adam/AdamW state (``diloco``, plain DDP) resumed by ``lordo`` keeps the full-rank
moments and restarts the low-rank ones; a LoRDO state resumed by ``diloco`` becomes AdamW state (low-rank moments
expanded through the basis, error feedback dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo.checkpoint import plain, sync_knob_changes
from lightning_lordo.config import SyncConfig
from lightning_lordo.optim.functional import EF_PROJECTION
from lightning_lordo.optim.loading import group_knob_changes
from lightning_lordo.optim.lordo import LoRDO

if TYPE_CHECKING:
    from lightning_lordo.comm.accounting import CommAccountant
    from lightning_lordo.sync.synchronizer import Synchronizer


class Saved(Protocol):
    """The strategy as this module reads and restores it (a ``LoRDOStrategy`` after setup)."""

    synchronizer: Synchronizer
    sync_config: SyncConfig
    accountant: CommAccountant
    parameter_names: dict[Tensor, str]
    optimizers: list[Optimizer]
    lowrank: bool
    world_size: int
    global_rank: int
    _restored_optimizer: Optional[dict[str, Any]]
    _restored_names: Optional[list[str]]
    _lordo_checkpoint: bool
    _reset_on_load: bool
    _overlap_to_redo: Optional[dict[str, Any]]

    def _note_synced_buffers(self, now: bool = False) -> None: ...


def knob_changes(saved: dict[str, Any], strategy: Saved) -> list[str]:
    """The knobs that differ from the checkpoint's, as ``name: saved -> now`` (optimizer knobs per group)."""
    changes = sync_knob_changes(saved["sync_knobs"], strategy.sync_config)
    changes += group_knob_changes(saved["optimizer_knobs"], strategy.optimizers[0])
    if saved["lowrank"] != strategy.lowrank:
        changes.append(f"lowrank: {saved['lowrank']!r} -> {strategy.lowrank!r} (preset "
                       f"{'lordo' if saved['lowrank'] else 'diloco'} -> {'lordo' if strategy.lowrank else 'diloco'})")
    return changes


def own_states(restored: dict[str, Any], strategy: Any) -> bool:
    """Whether each rank resumes its own state (its shard): the same world size, a complete save, and not
    synchronous steps after local ones. Those average only the gradients, so each rank's own optimizer moments would
    keep the replicas apart for good: every rank then takes rank 0's state, as for another world size."""
    if restored["world_size"] != strategy.world_size or restored.get("partial", False):
        return False
    saved, steps, now = restored.get("layout"), restored["sync"]["optimizer_steps"], strategy.sync_config
    if saved is None:
        return True
    old = saved["sync_knobs"]
    local_before = not old.get("synchronous", False) and 0 < steps and steps >= old.get("warmup_steps", 0)
    return not (local_before and (now.synchronous or steps < now.warmup_steps))


def refuse_unconvertible(saved: dict[str, Any], sync_state: dict[str, Any], strategy: Saved,
                         replicas_saved: bool = False) -> None:
    """Raise ``ValueError`` (before training starts) for what a resume cannot convert; ``replicas_saved``: the
    checkpoint holds each rank's replica (mid-round: local steps since the sync, or an overlapped round in flight)."""
    old, now = saved["sync_knobs"], strategy.sync_config
    steps, mid_round = sync_state["optimizer_steps"], sync_state["steps_since_sync"] > 0 or replicas_saved
    switched = not old.get("synchronous", False) and steps >= old.get("warmup_steps", 0)
    synchronous_now = now.synchronous or steps < now.warmup_steps
    if switched and synchronous_now and old.get("warmup_steps", 0):
        knob = "synchronous" if now.synchronous else "warmup_steps"
        saved_phase = f"warmup_steps={old.get('warmup_steps', 0)!r}, synchronous={old.get('synchronous', False)!r}"
        raise ValueError(f"Cannot resume with {knob}={getattr(now, knob)!r} (the checkpoint has {saved_phase}): "
                         f"it was written at optimizer step {steps}, after the switch to local steps, and the switch "
                         "cannot be undone. Keep the checkpoint's warm-up, or start a new run.")
    if synchronous_now and mid_round:
        knob = "synchronous=True" if now.synchronous else f"warmup_steps={now.warmup_steps}"
        since = sync_state["steps_since_sync"]
        why = f"{since} local steps since the last sync" if since else "an overlapped round in flight"
        where = (f"the checkpoint of the end of fit (after its final sync; with overlap_steps={old['overlap_steps']} "
                 "no other is at a sync), or resume with local rounds" if old.get("overlap_steps") else
                 "a checkpoint written at a sync")
        raise ValueError(f"Cannot resume with synchronous steps ({knob}) at optimizer step {steps + 1}: the "
                         f"checkpoint was written mid-round ({why}), when the replicas differ. Resume from {where}.")
    for name in ("switch_betas", "switch_reset_moments", "switch_lr_scale"):
        if switched and old.get("warmup_steps", 0) and plain(getattr(now, name)) != plain(old.get(name)):
            raise ValueError(f"Cannot change {name} from {old.get(name)!r} to {getattr(now, name)!r}: the switch "
                             f"already happened (optimizer step {old['warmup_steps']}). Pass the checkpoint's value.")
    if saved["sync_names"] != [strategy.parameter_names.get(p, "") for p in strategy.synchronizer.params] \
            and mid_round:
        raise ValueError("The trainable parameters differ from the checkpoint's (a parameter added, removed, frozen "
                         "or untied), and the checkpoint was written mid-round (or with an overlapped round in "
                         "flight), when each rank's replica is its own: they cannot be matched. Resume from a "
                         "checkpoint written at a sync, or keep the model.")


def apply_restored(self: Saved, restored: dict[str, Any]) -> list[str]:
    """``checkpoint["lordo"]`` into ``self`` (the strategy, after setup): refuse what cannot be converted, then
    restore the synchronizer, this rank's replica, buffers, payload state and totals; returns the notes for the
    resume's warning (the optimizer's state comes later, in ``load_optimizer``)."""
    saved = restored.get("layout")
    same_world = own_states(restored, self)  # else every rank resumes rank 0's state
    notes = knob_changes(saved, self) if saved is not None else []
    if saved is not None:
        # every rank reads its own shard (rank 0's: own_states); its replica is saved
        # whenever the replicas differ from the anchor (``mid_round``: a round in flight included), on all alike
        replicas = any(r is not None and "params" in r for r in restored["ranks"])
        refuse_unconvertible(saved, restored["sync"], self, replicas_saved=replicas)
    names_now = [self.parameter_names.get(p, "") for p in self.synchronizer.params]
    same_params = saved is None or saved["sync_names"] == names_now
    if same_params:
        self.synchronizer.load_state_dict(restored["sync"])
    else:  # at a sync (refused otherwise): the model Lightning loaded is the synchronized one
        sync_state = {**restored["sync"], "anchor": [], "outer": {"momentum": []}, "basis_window": []}
        self.synchronizer.load_state_dict(sync_state)
        if restored["sync"]["anchor"]:  # none: written in the synchronous phase, the switch comes at the next step
            self.synchronizer.take_anchor()
        notes.append("the trainable parameters changed: the synchronized model is the loaded one, the outer "
                     "momentum restarts")
    mine = restored["ranks"][self.global_rank if same_world else 0]
    self.accountant.load_state_dict(mine["comm"])
    self._restored_optimizer = mine.get("optimizer")  # None for rank 0: Lightning's optimizer_states
    self._restored_names = saved["param_names"] if saved is not None else None
    self._lordo_checkpoint = True
    edited = _edited(self.synchronizer, self.parameter_names) if same_world and same_params else []
    if edited:
        if "overlap" in mine:
            raise ValueError(f"The model differs from the checkpoint's synchronized model ({', '.join(edited[:3])}; "
                             "edited after the save?), and the checkpoint was written with an overlapped round in "
                             "flight, which lands on the saved model. Undo the edit, or resume from a checkpoint "
                             "written at a sync.")
        self.synchronizer.take_anchor(self.synchronizer.synchronized_step)
        notes.append(f"the model differs from the checkpoint's synchronized model ({', '.join(edited[:3])}"
                     f"{', ...' if len(edited) > 3 else ''}; edited after the save?): training follows the loaded "
                     "weights, which become the synchronized model (each worker's progress since the last sync and "
                     "its own buffers are dropped)")
    self._note_synced_buffers(now=True)  # the loaded model's (the synchronized one), before each rank's own come back
    if same_world and same_params and not edited:
        # mid-round each rank's own parameters; else the model Lightning loaded is already the synchronized one
        source = mine.get("params", self.synchronizer.anchor.tensors)  # no anchor in the synchronous phase
        for p, value in zip(self.synchronizer.params, source, strict=bool(source)):
            p.data.copy_(value)
        for b, value in zip(self.synchronizer.buffers, mine.get("buffers", []), strict="buffers" in mine):
            b.copy_(value)
        # older checkpoints did not record it: every parameter counts as stepped, as their rounds averaged
        self.synchronizer.stepped = set(mine.get("stepped", range(len(self.synchronizer.params))))
        defaults = SyncConfig.__dataclass_fields__  # a knob newer than the checkpoint was at its default
        payload_changed = saved is not None and any(
            saved["sync_knobs"].get(k, defaults[k].default) != getattr(self.sync_config, k)
            for k in ("payload", "payload_dtype", "fullrank_rank"))
        if payload_changed:
            notes.append("the payload changed: its sync-level error feedback restarts")
        elif "payload" in mine:
            self.synchronizer.payloads.load_state_dict(mine["payload"])
        if "overlap" in mine:  # a round was in flight: its collectives are redone, it lands at its step
            _refuse_round_changes(saved, self)
            if payload_changed:
                raise ValueError("Cannot change the payload (payload, payload_dtype, fullrank_rank) when resuming a "
                                 "checkpoint written while an overlapped round was in flight: the round is redone "
                                 "with the checkpoint's payload state. Keep them, or resume from another checkpoint.")
            self._overlap_to_redo = mine["overlap"]  # after the optimizer state is loaded (saving.py)
    elif not same_world:
        self.synchronizer.steps_since_sync = 0  # the round restarts from the synchronized model
        self._reset_on_load = True
        written = ("written after a failed or interrupted collective (rank 0's state only)" if restored.get(
            "partial") else f"written by {restored['world_size']} workers, resumed by {self.world_size}"
            if restored["world_size"] != self.world_size else "synchronous steps after local ones")
        notes.append(f"{written}: resumed from the "
                     "synchronized model; reset: each worker's progress since the last sync, the error-feedback "
                     "buffers and the payload's sync-level error feedback; every worker starts from rank 0's "
                     "optimizer moments and communication totals")
    return notes


#: Knobs that shape what an overlapped round averages: the round in flight at a save is redone from its saved copies,
#: which these decided.
_ROUND_SHAPE = ("average_moments", "average_fullrank_moments", "average_error_feedback", "basis_scope",
                "moments_every", "basis_every")


def _refuse_round_changes(saved: Optional[dict[str, Any]], strategy: Saved) -> None:
    """Raise ``ValueError`` naming the first knob changed since a save with a round in flight that shapes the round."""
    if saved is None:
        return
    defaults = SyncConfig.__dataclass_fields__
    changed = [(k, saved["sync_knobs"].get(k, defaults[k].default), getattr(strategy.sync_config, k))
               for k in _ROUND_SHAPE]
    changed.append(("lowrank", saved["lowrank"], strategy.lowrank))
    groups = strategy.optimizers[0].param_groups
    # the full-rank moments' form shapes the round's copies when it averages them (AdamW's two or the factored three)
    shaping = ("rank", "error_feedback") + (("fullrank_state",) if strategy.sync_config.average_fullrank_moments
                                            else ())
    for old, group in zip(saved["optimizer_knobs"] or [], groups if isinstance(strategy.optimizers[0], LoRDO) else []):
        changed += [(k, old[k], group[k]) for k in shaping if k in old]
    changed = [(name, was, now) for name, was, now in changed if plain(was) != plain(now)]
    if changed:
        listed = ", ".join(f"{name} from {was!r} to {now!r}" for name, was, now in changed)
        keep = ", ".join(f"{name}={was!r}" for name, was, _ in changed)
        raise ValueError(f"Cannot change {listed} when resuming a checkpoint written with an overlapped round in "
                         "flight: the round is redone from the state the checkpoint's knobs shaped. Resume with "
                         f"{keep}, and change it from a checkpoint written at a sync (no round in flight), or resume "
                         "from another checkpoint.")


def _edited(sync: Synchronizer, names: dict[Tensor, str]) -> list[str]:
    """The parameters whose loaded values differ from the checkpoint's synchronized model (its anchor), which the
    model Lightning loaded is a copy of unless it was edited between the save and the resume. Lightning loads the
    weights before the precision plugin converts the module, so under "64-true" they arrive rounded through the
    float32 module: a copy still."""

    def copied(p: Tensor, a: Tensor) -> bool:
        a = a.to(device=p.device)  # a host-memory anchor is compared on p's device
        return torch.equal(p.detach(), a.to(p.dtype)) or (
            a.dtype == torch.float64 and torch.equal(p.detach(), a.float().to(p.dtype)))

    anchor = sync.anchor.tensors  # none: saved in the synchronous phase, where the loaded model is the model
    return [names.get(p, "?") for p, a in zip(sync.params, anchor) if not copied(p, a)]


def reset_error_feedback(optimizer: Optimizer) -> int:
    """Zero every error-feedback buffer; returns how many there were."""
    count = 0
    for state in optimizer.state.values():
        if "error_feedback" in state and isinstance(state["error_feedback"], torch.Tensor):
            state["error_feedback"].zero_()
            state.pop(EF_PROJECTION, None)  # E = R - Q c = 0
            count += 1
    return count
