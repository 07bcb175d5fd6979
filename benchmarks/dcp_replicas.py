"""Can ``torch.distributed.checkpoint`` (DCP) hold LoRDO's per-rank state? Mid-round each rank's replica, error
feedback and payload state are its own, under the same names on every rank. DCP plans a save collectively and writes
an entry that several ranks hold under one key once (it takes such entries for replicas of one tensor), so on load
every rank reads one rank's copy.

Two gloo processes each save ``{"replica": full(rank), "rank<r>": full(rank)}`` with ``dcp.save`` and load them back
with ``dcp.load``; the script prints what each rank got. Usage: ``python benchmarks/dcp_replicas.py`` (seconds).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def _run(rank: int, path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dcp.save({"replica": torch.full((3,), float(rank)), f"rank{rank}": torch.full((3,), float(rank))},
             checkpoint_id=path)
    dist.barrier()
    loaded = {"replica": torch.zeros(3), f"rank{rank}": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=path)
    print(f"rank {rank} saved replica={float(rank)}, loaded replica={loaded['replica'][0].item()}, "
          f"rank{rank}={loaded[f'rank{rank}'][0].item()}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as path:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_run, args=(path, port), nprocs=2)
        print("files:", sorted(os.listdir(path)))


if __name__ == "__main__":
    main()
