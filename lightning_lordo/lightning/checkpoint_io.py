"""The Trainer's checkpoint files: atomic writes (``AtomicCheckpointIO``), a clear error for a truncated or corrupt
file, and the gather of every rank's state to rank 0 for a single-file checkpoint. What the files hold is
:mod:`lightning_lordo.checkpoint`'s; Lightning writes the file from rank 0, with the *synchronized* model, so
plain ``Model.load_from_checkpoint`` gives a usable model. The gather costs rank 0 the memory of every rank's
optimizer state for the duration of the save (per-rank shards, ``shards.py``, the default, do not).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


def gather_to_rank_zero(local: Any, world_size: int, rank: int) -> Optional[list[Any]]:
    """Every rank's ``local`` on rank 0 (a list indexed by rank), ``None`` elsewhere. All ranks must call it."""
    if world_size == 1:
        return [local]
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered


class CorruptCheckpointError(OSError):
    """A checkpoint file or shard that torch cannot read back: truncated or corrupt (the original error chained)."""


_NOT_CORRUPTION = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ConnectionError,
                   TimeoutError, InterruptedError)


def unreadable(err: BaseException) -> bool:
    """Whether ``err``, raised by ``torch.load``, says the file's bytes are broken (cut short, overwritten): torch's
    zip reader, an end of file or a seek past it, an unpickling of garbage; not a missing file, a permission, or
    ``weights_only`` refusing a class that is not allowed."""
    if isinstance(err, CorruptCheckpointError):
        return True
    if isinstance(err, (EOFError,)) or (isinstance(err, OSError) and not isinstance(err, _NOT_CORRUPTION)):
        return True
    if isinstance(err, pickle.UnpicklingError):
        return "Unsupported global" not in str(err)
    return isinstance(err, RuntimeError) and any(s in str(err) for s in ("PytorchStreamReader", "corrupt", "EOF"))


def describe(err: BaseException) -> str:
    """``Type: first line`` of an exception (torch's texts run over many lines)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` sets it process-wide)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, but a save never leaves a truncated file: it writes a temporary file in the
    target's directory, fsyncs it, renames it over the target and fsyncs the directory. A save that fails (a full
    disk, an interruption) leaves the previous file as it was and removes the temporary one. The file gets the
    permissions ``open`` would give it (``0o666`` less the umask: 0644 under the usual 022), not the temporary
    file's 0600. Paths that are not on the local file system (``s3://...``) are written as Lightning writes them.
    A file that cannot be read back (truncated or corrupt) raises :class:`CorruptCheckpointError` naming it."""

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return super().load_checkpoint(path, *args, **kwargs)
        except Exception as err:
            if not unreadable(err):
                raise
            raise CorruptCheckpointError(
                f"The checkpoint file {str(path)!r} cannot be read: it is truncated or corrupt ({describe(err)}). "
                "Resume from an earlier checkpoint, or copy this one again from where it was written (the strategy "
                "never leaves a half-written file, so a truncated one was most likely cut short by a copy, a "
                "download or a full disk).") from err

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                os.chmod(temporary, 0o666 & ~_umask())  # not mkstemp's 0600: what Lightning's own writer gives
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
