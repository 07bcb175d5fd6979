"""Per-rank checkpoint shards: each rank writes its own LoRDO state next to Lightning's checkpoint file.

Layout of a checkpoint ``step=40.ckpt`` written by M workers::

    step=40.ckpt                      Lightning's file (rank 0): the synchronized model, rank 0's optimizer state,
                                      checkpoint["lordo"]: the synchronizer, the layout, {"shards": {"id", ...}}
    step=40.ckpt.lordo-<id>/rank-0.pt each rank's own state: its communication totals, payload error feedback,
    ...                               module buffers, its replica mid-round, its optimizer state (not rank 0's:
    step=40.ckpt.lordo-<id>/rank-M-1.pt  that is Lightning's ``optimizer_states``)

No rank holds another's state, and the file Lightning writes does not grow with M. ``<id>`` is drawn by rank 0 for
each save and broadcast, so a save over an existing file (``last.ckpt``) writes a new directory: the old pair stays
consistent until the new file replaces it, then each rank removes its own stale shards. A save is a collective:
the ranks agree that every shard was written before rank 0 writes the file, and that the file was written before
the stale shards go (two 4-byte all-reduces and an 8-byte broadcast, counted as ``checkpoint`` outside rounds).
After a failed collective, or from an exception (``OnExceptionCheckpoint``: it may have stopped one rank alone), an
emergency save waits for no rank: rank 0 writes its own shard and the file. The file records the directory's
name, so a resume finds it next to the file it reads (a copy, a symbolic link's target). An asynchronous
CheckpointIO is refused: its writes could not be agreed on.

On resume each rank reads the file and its own shard (with another world size, or from an emergency save: rank
0's). A shard that is missing, truncated or corrupt names the file, the rank and the fix. Each shard records its
identity (``"identity"``: the save id, its rank, the save's ranks and world size, and the synchronizer's counters
it was written with, e.g. ``steps_since_sync``, with a digest of them all); a shard whose identity the file
contradicts (swapped between ranks, copied from another save or run, a hand-edited file) is refused. Copy a
checkpoint with its directory; on nodes without a shared file system, each node needs the shards of its ranks
(rank 0's for another world size). ``load_full(path)`` reads a sharded checkpoint into one dict (every rank's
state under ``checkpoint["lordo"]["ranks"]``), e.g. to inspect it.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_lordo.comm.accounting import wire_bytes
from lightning_lordo.lightning.checkpoint_io import AtomicCheckpointIO, CorruptCheckpointError, describe, unreadable

PURPOSE = "checkpoint"
AGREEMENT_BYTES = 8  # the two float32 flags of a save's agreements (``any_failed``), per rank


def directory(filepath: Any, save_id: str) -> str:
    """The shard directory a save of checkpoint ``filepath`` writes (next to the path as given: a symbolic link
    such as ``save_last="link"``'s is replaced by the file, so its shards go next to it)."""
    return f"{filepath}.lordo-{save_id}"


def directory_name(filepath: Any, save_id: str) -> str:
    """The shard directory's name, recorded in the file: a resume finds it next to the file it reads, wherever
    the pair was copied."""
    return directory(filepath, save_id).replace("\\", "/").rsplit("/", 1)[-1]


def shard_path(filepath: Any, save_id: str, rank: int) -> str:
    return f"{directory(filepath, save_id)}/rank-{rank}.pt"


def _read_directory(filepath: Any, meta: dict[str, Any]) -> str:
    path = str(filepath)
    if "dir" not in meta:
        return directory(path, meta["id"])
    parent = path.replace("\\", "/").rsplit("/", 1)[0] if "/" in path.replace("\\", "/") else "."
    return f"{parent}/{meta['dir']}"


def check_checkpoint_io(checkpoint_io: Any) -> None:
    """Refuse an asynchronous CheckpointIO: its saves return before anything is written, so the ranks' agreement
    that every shard and the file were written would mean nothing."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError("checkpoint_shards=True with an AsyncCheckpointIO: the shards' writes could not be "
                         "agreed on before the stale ones are removed. Use the strategy's default CheckpointIO, or "
                         "LoRDOStrategy(experimental={'checkpoint_shards': False}).")


def count_agreements(comm_state: dict[str, Any], world_size: int) -> None:
    """Add a save's two agreements (``any_failed``: a 4-byte all-reduce each) to a saved accountant state, so the
    totals a resume starts from include them, payload and wire bytes alike."""
    for payload, wire in (("totals", "wire_totals"), ("parts", "wire_parts")):  # parts: the next report's
        counts, wires = comm_state.setdefault(payload, {}), comm_state.setdefault(wire, {})
        counts[PURPOSE] = counts.get(PURPOSE, 0) + AGREEMENT_BYTES
        wires[PURPOSE] = wires.get(PURPOSE, 0) + 2 * wire_bytes("all_reduce", AGREEMENT_BYTES // 2, world_size)


def new_save_id(communicator: Any, device: torch.device, collective: bool) -> str:
    """Rank 0's random id for this save, on every rank (a broadcast; locally drawn without ``collective``)."""
    value = torch.tensor([secrets.randbits(62) if communicator is None or communicator.rank == 0 else 0],
                         dtype=torch.int64, device=device)
    if collective and communicator is not None:
        communicator.broadcast([value], PURPOSE, in_round=False)
    return f"{int(value.item()):016x}"


def any_failed(communicator: Any, device: torch.device, failed: bool) -> bool:
    """Whether any rank failed (an all-reduce of the ranks' flags: every rank gets the same answer)."""
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    if communicator is not None:
        communicator.all_reduce_mean([flag], PURPOSE, in_round=False)
    return bool(flag.item() > 0)


def failure_reasons(communicator: Any, error: Optional[BaseException]) -> list[tuple[int, str]]:
    """``(rank, reason)`` of every rank whose write failed (an object all-gather: only after ``any_failed``)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if communicator is None:
        return [(0, mine or "unknown")]
    import torch.distributed as dist

    reasons: list[Optional[str]] = [None] * communicator.world_size
    dist.all_gather_object(reasons, mine, group=communicator.group)
    return [(r, reason) for r, reason in enumerate(reasons) if reason is not None]


#: The synchronizer's counters a shard must agree with (the same on every rank: they move at every step and sync).
AGREED = ("optimizer_steps", "steps_since_sync", "syncs_done", "skipped_syncs")


def identity(lordo: dict[str, Any], rank: int) -> dict[str, Any]:
    """What rank ``rank``'s shard of a save must agree with in the file's ``checkpoint["lordo"]``: the save id, the
    rank, the save's ranks, world size and kind, the synchronizer's counters, and a digest of them all (no tensor is
    hashed: the counters and the random save id tell the saves apart)."""
    sync = lordo.get("sync") or {}
    fields: dict[str, Any] = {"save_id": str(lordo["shards"]["id"]), "rank": int(rank),
                              "ranks": int(lordo["shards"]["ranks"]), "world_size": int(lordo.get("world_size", 1)),
                              "partial": bool(lordo.get("partial", False))}
    fields.update({k: int(sync[k]) for k in AGREED if k in sync})
    fields["digest"] = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]
    return fields


def write(checkpoint_io: Any, state: dict[str, Any], filepath: Any, save_id: str, rank: int,
          lordo: dict[str, Any]) -> None:
    """Rank ``rank``'s shard, with its :func:`identity` (``lordo``: the file's ``checkpoint["lordo"]``)."""
    shard = {**state, "identity": identity(lordo, rank)}
    checkpoint_io.save_checkpoint(shard, shard_path(filepath, save_id, rank))


def read(checkpoint_io: Any, filepath: Any, meta: dict[str, Any], rank: int, *,
         lordo: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s shard of checkpoint ``filepath`` (``lordo``: its ``checkpoint["lordo"]``, whose ``"shards"``
    is ``meta``), checked against the file, or an error that names it, the rank and the fix."""
    folder = _read_directory(filepath, meta)
    path = f"{folder}/rank-{rank}.pt"
    if not get_filesystem(path).exists(path):
        need = ("each node needs its ranks' shards" if rank != 0 or meta.get("ranks", 1) == 1 else
                "every node needs rank-0.pt (a resume with another world size, or of an emergency save, starts "
                "every rank from rank 0's state)")
        raise FileNotFoundError(
            f"The LoRDO checkpoint {str(filepath)!r} keeps each rank's state in {folder!r}, and rank {rank}'s "
            f"shard {path!r} is not there. Copy that directory with the checkpoint (on nodes without a shared file "
            f"system: {need}). The model alone needs no shard: MyModel.load_from_checkpoint(path), or start a new "
            "fit from its weights.")
    try:
        state = checkpoint_io.load_checkpoint(path)
    except Exception as err:
        if not unreadable(err):
            raise
        cause = err.__cause__ if isinstance(err, CorruptCheckpointError) and err.__cause__ is not None else err
        raise CorruptCheckpointError(
            f"Rank {rank}'s LoRDO shard {path!r} of checkpoint {str(filepath)!r} cannot be read: it is truncated or "
            f"corrupt ({describe(cause)}). Copy the shard directory again from where the checkpoint was written, or "
            "resume from an earlier checkpoint. The model alone needs no shard: MyModel.load_from_checkpoint(path), "
            "or start a new fit from its weights.") from cause
    _check_identity(state, filepath, path, lordo, rank)
    return state


def _check_identity(state: dict[str, Any], filepath: Any, path: str, lordo: dict[str, Any], rank: int) -> None:
    """Refuse a shard that is not rank ``rank``'s of this save: its identity is missing or differs from what the file
    says. Removes ``state["identity"]``."""
    saved, expected = state.pop("identity", None), identity(lordo, rank)
    if saved is None:
        raise ValueError(f"Rank {rank}'s LoRDO shard {path!r} of checkpoint {str(filepath)!r} records no identity, "
                         "which every shard of this checkpoint format has: it was edited or replaced. Restore the "
                         "checkpoint's folder as it was written, or start a new fit from the file's weights.")
    if saved == expected:
        return
    why = []
    if saved.get("save_id") != expected["save_id"]:
        why.append(f"was written by another save (save id {saved.get('save_id')}; this checkpoint's is "
                   f"{expected['save_id']}): a shard copied from another checkpoint or run")
    if saved.get("rank") != rank:
        why.append(f"holds rank {saved.get('rank')}'s state, not rank {rank}'s: the shards were swapped or renamed")
    differ = [k for k in expected if k not in ("save_id", "rank", "digest") and saved.get(k) != expected[k]]
    if differ:
        why.append("was written with " + ", ".join(f"{k}={saved.get(k)!r}" for k in differ) + ", but the checkpoint "
                   "file says " + ", ".join(f"{k}={expected[k]!r}" for k in differ) + ": the file or the shard was "
                   "edited or replaced")
    if not why:
        why.append(f"has an identity digest {saved.get('digest')!r} that does not match its fields (expected "
                   f"{expected['digest']!r}): its identity was edited")
    raise ValueError(
        f"Refusing checkpoint {str(filepath)!r}: rank {rank}'s shard {path!r} {'; and it '.join(why)}. Resuming it "
        "(or exporting it) would mix states that do not belong together. Copy the checkpoint file together with its "
        "shard directory, both as they were written, or resume from an earlier checkpoint. The model alone needs no "
        "shard: MyModel.load_from_checkpoint(path), or start a new fit from its weights.")


def remove_own(filepath: Any, rank: int, keep: Optional[str] = None, only: Optional[str] = None) -> None:
    """Remove this rank's shards of checkpoint ``filepath``: of every save, of every save but ``keep``, or of save
    ``only``; then each shard directory left empty (the last rank to remove its shard removes the directory).
    Best effort: a file system error leaves a stale shard behind rather than failing the save (or stalling the
    ranks that wait for this one)."""
    path = str(filepath)
    fs = get_filesystem(path)
    try:
        folders = fs.glob(glob_escape(directory(path, "")) + "*")
    except OSError:
        folders = []
    for folder in folders:
        save_id = str(folder).rsplit(".lordo-", 1)[-1]
        if save_id == keep or (only is not None and save_id != only):
            continue
        with contextlib.suppress(OSError):
            if fs.exists(f"{folder}/rank-{rank}.pt"):
                fs.rm(f"{folder}/rank-{rank}.pt")
            if not fs.ls(folder):
                fs.rmdir(folder)


def glob_escape(path: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


def load_full(filepath: Any) -> dict[str, Any]:
    """A checkpoint as one dict: a sharded one with every rank's state read into ``checkpoint["lordo"]["ranks"]``
    (as a single-file checkpoint has it)."""
    return with_shards(filepath, AtomicCheckpointIO().load_checkpoint(filepath))  # a corrupt file: named


def with_shards(filepath: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (read from ``filepath``) with every rank's shard read in, if it has shards; unchanged when a
    shard cannot be read (the error names it)."""
    io = AtomicCheckpointIO()
    lordo = checkpoint.get("lordo")
    if lordo is not None and "shards" in lordo:
        meta = lordo["shards"]
        lordo["ranks"] = [read(io, filepath, meta, r, lordo=lordo) for r in range(meta["ranks"])]
    return checkpoint
