"""The strategy's model views and checkpoint state: evaluation and checkpoints see the synchronized model (the
anchor) in the middle of a round, and a checkpoint carries every rank's LoRDO state (what it holds:
:mod:`lightning_lordo.checkpoint`).

A mixin of :class:`~lightning_lordo.lightning.strategy.LoRDOStrategy`, apart so that the strategy's file holds
the training lifecycle and this one what is saved and restored.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from typing_extensions import override

from lightning_lordo import checkpoint as lordo_checkpoint
from lightning_lordo.checkpoint import check
from lightning_lordo.lightning import resume, shards
from lightning_lordo.lightning.callbacks import reports_undone
from lightning_lordo.lightning.checkpoint_io import gather_to_rank_zero
from lightning_lordo.optim import loading
from lightning_lordo.optim.lordo import LoRDO

if TYPE_CHECKING:
    from lightning_lordo.comm.communicator import Communicator
    from lightning_lordo.core import LoRDOCore
    from lightning_lordo.lightning.user_warnings import PluginWarnings
    from lightning_lordo.sync.synchronizer import Synchronizer


class SynchronizedState:
    """Hooks of Lightning's ``Strategy`` for validation and checkpoints; the strategy provides ``core``,
    ``synchronizer``, ``communicator``, ``parameter_names`` and the restore fields its ``__init__`` sets."""

    core: LoRDOCore
    synchronizer: Optional[Synchronizer]
    communicator: Optional[Communicator]
    _swapped_for_eval: bool
    #: the floating buffers (BatchNorm's statistics) of the synchronized model, and how many sync reports there were
    #: when they were copied (the strategy's ``_note_synced_buffers``, on the step's path), so that between syncs
    #: validation and checkpoints see its buffers too, not a rank's own
    _synced_buffers: Optional[list[Tensor]] = None
    _synced_buffers_reports: Optional[int] = None
    checkpoint_shards: bool = True  # per-rank shards next to the file (False: gathered into the file)
    _plugin_warnings: PluginWarnings  # warnings once, on rank 0, at the user's line
    _overlap_to_redo: Optional[dict[str, Any]] = None  # the copies of a round in flight at the save
    _trainer: Optional[Trainer]  # the strategy's: the Trainer of the module being run

    # ------------------------------------------------------------------ one model for evaluation and checkpoints
    def _mid_round(self) -> bool:
        return self.synchronizer is not None and self.synchronizer.mid_round

    def _exchange_buffers(self) -> None:
        """Exchange the floating buffers with the synchronized model's copies (twice: back as they were)."""
        assert self.synchronizer is not None and self._synced_buffers is not None
        for b, kept in zip([b for b in self.synchronizer.buffers if b.is_floating_point()], self._synced_buffers,
                           strict=True):
            own = b.detach().clone()
            b.copy_(kept)
            kept.copy_(own)

    def _swap_model(self, synchronized: bool) -> None:
        """The synchronized model (anchor and buffers) in, or each rank's own replica back."""
        assert self.synchronizer is not None
        if synchronized:
            self.synchronizer.anchor.swap_in()
        else:
            self.synchronizer.anchor.swap_out()
        if self._synced_buffers is not None:
            self._exchange_buffers()

    def swap_in_for_validation(self) -> None:
        """Validation during fit sees the synchronized model, identical on all ranks. The strategy's
        ``FinalSync`` callback, first among the callbacks, calls this before the other ``on_validation_start``
        hooks (Lightning calls the strategy's last); the strategy's own hook is the fallback."""
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._mid_round() and \
                not self._swapped_for_eval:
            self._swap_model(synchronized=True)
            self._swapped_for_eval = True

    def leave_validation_view(self) -> None:
        """The replicas back in the model, if validation has the anchor in (``callbacks.final_sync`` from
        ``on_validation_end``; the strategy's own ``on_validation_end``)."""
        if self._swapped_for_eval:
            self._swap_model(synchronized=False)
            self._swapped_for_eval = False

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.swap_in_for_validation()

    @override
    def on_validation_end(self) -> None:
        self.leave_validation_view()
        super().on_validation_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self._mid_round() and not self._swapped_for_eval:
            assert self.synchronizer is not None
            anchor = {id(p): a for p, a in zip(self.synchronizer.params, self.synchronizer.anchor.tensors)}
            module = self.lightning_module
            assert module is not None
            for name, p in module.named_parameters(remove_duplicate=False):  # tied weights: every name
                if id(p) in anchor and name in state:
                    state[name] = anchor[id(p)].detach().clone()
            floating = [b for b in self.synchronizer.buffers if b.is_floating_point()]
            synced = dict(zip(map(id, floating), self._synced_buffers or []))
            for name, b in module.named_buffers(remove_duplicate=False):
                if id(b) in synced and name in state:
                    state[name] = synced[id(b)].clone()
        return state

    # ------------------------------------------------------------------ checkpoint state (../checkpoint.py, shards.py)
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A collective: all ranks call it. With ``checkpoint_shards`` (the default) each rank writes its own state
        next to the file (``shards.py``); without, every rank's state is gathered to rank 0 into the file."""
        if self.synchronizer is None or "optimizer_states" not in checkpoint:  # save_weights_only: the model only
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # an emergency save (after a failed collective, or from an exception that need not have reached every
        # rank) waits for no rank: rank 0 writes what it has, and a resume starts every rank from it
        healthy = self._every_rank_saves()
        if healthy:  # an overlapped round in flight finishes its collectives first (overlap.py: checkpoints)
            self.synchronizer.wait_in_flight()
        comm = self.communicator if healthy and self.world_size > 1 else None
        if not self.checkpoint_shards:
            def gathered() -> None:
                checkpoint["lordo"] = self._gathered_state(collective=healthy)
                self._adamw_shaped(checkpoint)

            self._read_state(gathered)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        shards.check_checkpoint_io(self.checkpoint_io)
        save_id = shards.new_save_id(comm, self.root_device, collective=comm is not None)
        error: Optional[BaseException] = None
        local: Any = None

        def read() -> Any:  # all of it with the replica in place: the anchor saved is the anchor, not the replica
            state = lordo_checkpoint.rank_state(self.core, self.global_rank)
            if comm is not None:  # the two agreements below, counted ahead so the totals saved include them
                shards.count_agreements(state["comm"], self.world_size)
            checkpoint["lordo"] = lordo_checkpoint.trainer_entry(self.core, self.world_size, not healthy, state)
            self._adamw_shaped(checkpoint)
            return state

        try:  # an error here is agreed on below with the others, who would otherwise wait for this rank
            local = self._read_state(read)
            checkpoint["lordo"]["shards"] = {"id": save_id, "ranks": self.world_size if healthy else 1,
                                             "dir": shards.directory_name(filepath, save_id)}
        except Exception as err:  # noqa: BLE001 - re-raised by the agreement
            error = err
        if not healthy and self.global_rank != 0:
            return

        def write_shard() -> None:
            if error is not None:
                raise error
            shards.write(self.checkpoint_io, local, filepath, save_id, self.global_rank, checkpoint["lordo"])

        self._write_or_agree_to_fail(filepath, save_id, comm, "its LoRDO shard", write_shard)
        self._write_or_agree_to_fail(filepath, save_id, comm, "the checkpoint file", lambda: super(
            SynchronizedState, self).save_checkpoint(checkpoint, filepath, storage_options=storage_options))
        shards.remove_own(filepath, self.global_rank, keep=save_id)  # the previous save's, now stale

    def _adamw_shaped(self, checkpoint: dict[str, Any]) -> None:
        """Rank 0's optimizer entry in torch AdamW's shape, so that any strategy resumes the file with the user's AdamW
        (``checkpoint.adamw_entry``); LoRDO's own state is in ``checkpoint["lordo"]`` or rank 0's shard."""
        if isinstance(self.optimizers[0], LoRDO) and self.global_rank == 0:
            entry, left_out = lordo_checkpoint.adamw_entry(self.core, checkpoint["optimizer_states"][0])
            checkpoint["optimizer_states"], checkpoint["lordo"]["optimizer_entry"] = [entry], left_out

    def _gathered_state(self, collective: bool = True) -> dict[str, Any]:
        """``checkpoint["lordo"]`` of a single-file checkpoint: the shared entry and every rank's own state gathered to
        rank 0 (all ranks must call it: a checkpoint save is a collective). ``collective=False`` (after a failed
        collective): rank 0's own state only, marked ``partial``."""
        local = lordo_checkpoint.rank_state(self.core, self.global_rank)
        if collective:
            ranks = gather_to_rank_zero(local, self.world_size, self.global_rank)
        else:
            ranks = [local] if self.global_rank == 0 else None
        return {**lordo_checkpoint.trainer_entry(self.core, self.world_size, not collective, local), "ranks": ranks}

    def _every_rank_saves(self) -> bool:
        """Whether this save may wait for every rank: not after a failed collective, and not from an exception
        (``OnExceptionCheckpoint``), which may have stopped this rank alone; a SIGTERM stops every rank at the
        same batch (the per-batch check), so its save is a collective."""
        if self.communicator is not None and self.communicator.failure is not None:
            return False
        trainer = self._trainer
        return trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED or trainer.received_sigterm

    def _read_state(self, read: Any) -> Any:
        """``read()`` with the local replica in place (a save from within validation has the anchor swapped in)."""
        swapped = self._swapped_for_eval
        if swapped:
            self._swap_model(synchronized=False)
        try:
            return read()
        finally:
            if swapped:
                self._swap_model(synchronized=True)

    def _write_or_agree_to_fail(self, filepath: Any, save_id: str, comm: Any, what: str, write: Any) -> None:
        """Run ``write``; if it failed on any rank, every rank removes this save's shards and raises with every
        failing rank's reason (with the strategy's atomic CheckpointIO on a local disk the previous checkpoint
        is then as it was)."""
        error: Optional[BaseException] = None
        try:
            write()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = err
        if not shards.any_failed(comm, self.root_device, error is not None):
            return
        shards.remove_own(filepath, self.global_rank, only=save_id)
        reasons = shards.failure_reasons(comm, error)
        why = "; ".join(f"rank {r} could not write {what}: {reason}" for r, reason in reasons)
        raise RuntimeError(f"Saving checkpoint {str(filepath)!r} failed: {why}") from error

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's file (rank 0) and this rank's shards of it (a symbolic link's target keeps its shards)."""
        link = os.path.islink(str(filepath))
        super().remove_checkpoint(filepath)
        if not link:
            shards.remove_own(filepath, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # applied after setup, when the synchronizer exists; validate/test/predict only need the model
        restored = checkpoint.get("lordo") if fitting else None
        if restored is not None:
            restored = check(restored, f"Checkpoint {str(checkpoint_path)!r}")
        if restored is not None and "shards" in restored:  # this rank's shard, or rank 0's (resume.own_states)
            meta = restored["shards"]
            rank = self.global_rank if resume.own_states(restored, self) else 0
            ranks: list[Any] = [None] * max(meta["ranks"], rank + 1)
            ranks[rank] = shards.read(self.checkpoint_io, checkpoint_path, meta, rank, lordo=restored)
            restored = {**restored, "ranks": ranks}
        self._restored = restored
        self._restored_optimizer, self._lordo_checkpoint = None, False
        return checkpoint

    def _apply_restored_state(self) -> None:
        """The checkpoint's LoRDO state, after setup (the synchronizer exists): see ``resume.apply_restored``."""
        assert self._restored is not None and self.synchronizer is not None
        restored, self._restored = self._restored, None
        self._resume_notes = resume.apply_restored(self, restored)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._restored is not None and self.synchronizer is not None:  # restored after setup: Lightning's tuner
            self._apply_restored_state()  # callbacks put their search's starting point back; its rounds are undone,
            self._finished = False  # its final sync too
            reports = self.core.sync_reports
            del reports[sum(r.step <= self.synchronizer.optimizer_steps for r in reports):]
            self._synced_buffers_reports = min(self._synced_buffers_reports or 0, len(reports))
            if self._trainer is not None:
                reports_undone(self._trainer, len(reports))
        optimizer = self.optimizers[0]
        if self._restored_optimizer is None and not checkpoint.get("optimizer_states"):  # as DDP: nothing to load
            warnings.warn("LoRDO: the checkpoint holds no optimizer state (a launcher's main process writes such an "
                          "OnExceptionCheckpoint file after its workers fail): the optimizer starts afresh.",
                          stacklevel=2)
            return
        saved = self._restored_optimizer if self._restored_optimizer is not None else checkpoint["optimizer_states"][0]
        notes = list(self._resume_notes)
        if not self._lordo_checkpoint and isinstance(optimizer, LoRDO) and not loading.is_lordo_state(saved):
            notes.append(loading.FROM_ANOTHER_STRATEGY)  # a LoRDO state saved by another strategy keeps its moments
        notes += loading.load_optimizer(optimizer, saved, self._restored_names, self.parameter_names)
        if self._reset_on_load:
            resume.reset_error_feedback(optimizer)
        if self._overlap_to_redo is not None:  # every rank together: a round was in flight at the save
            self.synchronizer.load_overlap_state_dict(self._overlap_to_redo)
            self._overlap_to_redo = None
        with self._plugin_warnings:  # at the user's trainer.fit(ckpt_path=...) line
            loading.warn(notes, self.global_rank)
        self._restored_optimizer, self._restored_names, self._resume_notes = None, None, []
        self._lordo_checkpoint = self._reset_on_load = False
