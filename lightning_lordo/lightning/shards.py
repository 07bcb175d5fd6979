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
0's). A shard that is missing names the file and the fix. Copy a checkpoint with its directory; on nodes without
a shared file system, each node needs the shards of its ranks (rank 0's for another world size).
``load_full(path)`` reads a sharded checkpoint into one dict (every rank's state under
``checkpoint["lordo"]["ranks"]``), e.g. to inspect it.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_lordo.comm.wire import wire_bytes

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
                         "LoRDOStrategy(checkpoint_shards=False).")


def count_agreements(comm_state: dict[str, Any], world_size: int) -> None:
    """Add a save's two agreements (``any_failed``: a 4-byte all-reduce each) to a saved accountant state, so the
    totals a resume starts from include them, payload and wire bytes alike."""
    totals, wire = comm_state["totals"], comm_state.setdefault("wire_totals", {})
    totals[PURPOSE] = totals.get(PURPOSE, 0) + AGREEMENT_BYTES
    wire[PURPOSE] = wire.get(PURPOSE, 0) + 2 * wire_bytes("all_reduce", AGREEMENT_BYTES // 2, world_size)


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


def write(checkpoint_io: Any, state: dict[str, Any], filepath: Any, save_id: str, rank: int) -> None:
    checkpoint_io.save_checkpoint(state, shard_path(filepath, save_id, rank))


def read(checkpoint_io: Any, filepath: Any, meta: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard of checkpoint ``filepath``, or an error that names it and the fix."""
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
    return checkpoint_io.load_checkpoint(path)


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
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    io = TorchCheckpointIO()
    checkpoint = io.load_checkpoint(filepath)
    lordo = checkpoint.get("lordo")
    if lordo is not None and "shards" in lordo:
        meta = lordo["shards"]
        lordo["ranks"] = [read(io, filepath, meta, r) for r in range(meta["ranks"])]
    return checkpoint
