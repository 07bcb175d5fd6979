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
After a failed collective (an emergency save) rank 0 writes its own shard and the file, without collectives.

On resume each rank reads the file and its own shard (with another world size, or from an emergency save: rank
0's). A shard that is missing names the file and the fix. Copy a checkpoint with its directory; on nodes without
a shared file system, each node needs the shards of its ranks. ``load_full(path)`` reads a sharded checkpoint into
one dict (every rank's state under ``checkpoint["lordo"]["ranks"]``), e.g. to inspect it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem

PURPOSE = "checkpoint"
AGREEMENT_BYTES = 8  # the two float32 flags of a save's agreements (``any_failed``), per rank


def directory(filepath: Any, save_id: str) -> str:
    """The shard directory of checkpoint ``filepath`` (a symbolic link, e.g. ``save_last="link"``, resolved)."""
    path = str(filepath)
    if isinstance(get_filesystem(path), LocalFileSystem):
        path = os.path.realpath(path)
    return f"{path}.lordo-{save_id}"


def shard_path(filepath: Any, save_id: str, rank: int) -> str:
    return f"{directory(filepath, save_id)}/rank-{rank}.pt"


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
    path = shard_path(filepath, meta["id"], rank)
    if not get_filesystem(path).exists(path):
        raise FileNotFoundError(
            f"The LoRDO checkpoint {str(filepath)!r} keeps each rank's state in {directory(filepath, meta['id'])!r}, "
            f"and rank {rank}'s shard {path!r} is not there. Copy that directory with the checkpoint (on nodes "
            "without a shared file system: each node needs its ranks' shards). The model alone needs no shard: "
            "MyModel.load_from_checkpoint(path), or start a new fit from its weights.")
    return checkpoint_io.load_checkpoint(path)


def remove_own(filepath: Any, rank: int, keep: Optional[str] = None, only: Optional[str] = None) -> None:
    """Remove this rank's shards of checkpoint ``filepath``: of every save, of every save but ``keep``, or of save
    ``only``; then each shard directory left empty (the last rank to remove its shard removes the directory)."""
    path = str(filepath)
    fs = get_filesystem(path)
    for folder in fs.glob(glob_escape(directory(path, "")) + "*"):
        save_id = str(folder).rsplit(".lordo-", 1)[-1]
        if save_id == keep or (only is not None and save_id != only):
            continue
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"{folder}/rank-{rank}.pt")
        with contextlib.suppress(OSError):
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
