"""Bytes per worker of the int8 mean at 2, 4 and 8 processes: reduce-scatter vs all-gather vs a float32 all-reduce.

One message of ``--numel`` numbers (default 2^20, a 1024 x 1024 matrix: per-row int8 scales for the all-gather,
per-block ones for the reduce-scatter) is averaged once by each reduction, with M gloo worker processes (fork) on
this machine. For each, the payload bytes (what a worker hands to the collectives) and the wire bytes (what it puts
on the network by the collective's algorithm, :mod:`lightning_lordo.comm.accounting`) are read from the communicator's
accountant, checked equal on every rank, with the relative error of the result against the float64 mean and the
median wall time of ``--repeats`` rounds (a shared machine: indicative only). Writes
``benchmarks/results/int8_scaling.json`` with its provenance and prints the ratios measured in this run.

    python benchmarks/int8_scaling.py                     # M = 2, 4, 8; about a minute on 2 cores
    python benchmarks/int8_scaling.py --workers 2 4 --numel 100003
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.quantization import quantized_mean

ROOT = Path(__file__).resolve().parent
METHODS = {  # name: (payload_dtype, reduction)
    "int8_reduce_scatter": ("int8", "reduce_scatter"),
    "int8_all_gather": ("int8", "all_gather"),
    "float32_all_reduce": ("float32", "all_reduce"),
    "int8_auto": ("int8", "auto"),
}


def _message(rank: int, numel: int) -> torch.Tensor:
    rows = 1024 if numel % 1024 == 0 else 1
    g = torch.Generator().manual_seed(1_000 + rank)
    return torch.randn(rows, numel // rows, generator=g)


def _worker(rank: int, world: int, port: int, numel: int, repeats: int, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        comm = Communicator(CommAccountant(), timedelta(seconds=120))
        x = _message(rank, numel)
        for name, (dtype, reduction) in METHODS.items():
            seconds = []
            for _ in range(repeats):
                comm.accountant.start_round()
                start = time.perf_counter()
                mean = quantized_mean(comm, [x], "message", dtype, reduction)
                seconds.append(time.perf_counter() - start)
                payload = comm.accountant.end_round()
            result[name] = {"payload_bytes": payload.get("message", 0),
                            "wire_bytes": comm.accountant.last_round_wire.get("message", 0),
                            "collectives": mean.traffic, "seconds_median": statistics.median(seconds)}
            if rank == 0:
                truth = sum(_message(m, numel).double() for m in range(world)) / world
                err = float((mean.means[0].double() - truth).norm() / truth.norm())
                result[name]["relative_error_vs_float64_mean"] = err
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"_error": traceback.format_exc()}
    finally:
        torch.save(result, Path(out, f"rank{rank}.pt"))
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, numel: int, repeats: int) -> dict[str, Any]:
    """One job of ``world`` processes; rank 0's figures, after checking every rank counted the same bytes."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("fork")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, numel, repeats, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(600)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        ranks = []
        for r in range(world):
            path = Path(out, f"rank{r}.pt")
            if not path.exists():
                raise RuntimeError(f"worker {r} of {world} wrote nothing (exit code {procs[r].exitcode})")
            ranks.append(torch.load(path, weights_only=False))
            if "_error" in ranks[r]:
                raise RuntimeError(f"worker {r} of {world} failed:\n{ranks[r]['_error']}")
    for name in METHODS:
        for key in ("payload_bytes", "wire_bytes"):
            values = {rec[name][key] for rec in ranks}
            if len(values) != 1:
                raise RuntimeError(f"{name} at M={world}: {key} differ between ranks: {sorted(values)}")
    return ranks[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--numel", type=int, default=2**20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "int8_scaling.json")
    args = parser.parse_args()
    if args.numel < 1 or args.repeats < 1 or min(args.workers) < 2:
        parser.error(f"Invalid --numel={args.numel}, --repeats={args.repeats} or --workers={args.workers}: numel and "
                     "repeats must be >= 1, every worker count >= 2.")
    by_world = {m: measure(m, args.numel, args.repeats) for m in args.workers}
    first, last = args.workers[0], args.workers[-1]
    ratios: dict[str, float] = {}
    for key in ("payload_bytes", "wire_bytes"):
        for name in METHODS:
            ratios[f"{name} {key} M={last} / M={first}"] = by_world[last][name][key] / by_world[first][name][key]
        for m in args.workers:
            rs = by_world[m]["int8_reduce_scatter"][key]
            for other in ("float32_all_reduce", "int8_all_gather"):
                ratios[f"{other} / int8_reduce_scatter {key} M={m}"] = by_world[m][other][key] / rs
    print(f"bytes per worker, one mean of {args.numel:,} numbers (payload = handed to collectives; wire = ring model)")
    print(f"{'M':>3} {'method':<22} {'payload':>12} {'wire':>12} {'rel. error':>11} {'seconds':>8}")
    for m, figures in by_world.items():
        for name in METHODS:
            f = figures[name]
            print(f"{m:>3} {name:<22} {f['payload_bytes']:>12,} {f['wire_bytes']:>12,} "
                  f"{f['relative_error_vs_float64_mean']:>11.2e} {f['seconds_median']:>8.3f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    from harness import provenance  # benchmarks/ is on sys.path when run as a script

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT.parent), *sys.argv[1:]])
    record = {"provenance": provenance(command), "numel": args.numel, "repeats": args.repeats,
              "by_workers": {str(m): f for m, f in by_world.items()}, "ratios": ratios,
              "notes": "payload bytes: numel x itemsize of what a worker hands to the collectives; wire bytes: the "
                       "ring/direct models of lightning_lordo.comm.accounting; seconds: median wall time on a shared "
                       "machine, indicative only"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
