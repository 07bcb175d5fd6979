"""Speed and memory of the optimizer itself, in one process, as ratios measured side by side.

1. Step overhead: a LoRDO optimizer step vs an AdamW step on the same model and gradients, for 3 GPT sizes
   (interleaved repetitions; medians), and the same for a whole training step (forward + backward + step).
2. Basis computation per sync: power iteration (1 step) vs randomized SVD vs exact SVD as the matrix grows.
3. Memory: optimizer state at several ranks against AdamW's, for the whole model and the low-rank matrices
   alone, plus the error-feedback buffers and the synchronization buffers (anchor) in separate lines (SPEC §8).

Writes ``benchmarks/results/speed.json`` and prints the tables. Takes about 3 minutes on 2 cores.
Usage: ``python benchmarks/speed.py``
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from harness import ROOT, provenance
from rich.console import Console
from rich.table import Table

from lightning_lordo import LoRDO
from lightning_lordo.lightning.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.optim.projection import compute_basis

SIZES = {"small (d64, 2L)": (64, 2), "medium (d128, 4L)": (128, 4), "large (d256, 4L)": (256, 4)}


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).logsumexp(-1).mean().backward()
    optimizer.step()


def step_overhead(repeats: int = 30) -> list[dict[str, Any]]:
    rows = []
    for name, (d, layers) in SIZES.items():
        torch.manual_seed(0)
        models = {k: CharGPT(d_model=d, n_layers=layers, n_heads=4, seq_len=64) for k in ("adamw", "lordo")}
        models["lordo"].load_state_dict(models["adamw"].state_dict())
        optimizers = {
            "adamw": torch.optim.AdamW(models["adamw"].parameters(), lr=1e-3),
            "lordo": LoRDO(models["lordo"].parameters(), lr=1e-3, rank=d // 8,
                           full_rank=full_rank_params(models["lordo"])),
        }
        x = torch.randint(0, 256, (8, 64))

        for kind in optimizers:  # warm up, and create the state
            _train_step(models[kind], optimizers[kind], x)
        opt_times: dict[str, list[float]] = {"adamw": [], "lordo": []}
        full_times: dict[str, list[float]] = {"adamw": [], "lordo": []}
        for _ in range(repeats):  # interleaved, so machine noise hits both alike
            for kind in optimizers:
                opt_times[kind].append(_median_seconds(optimizers[kind].step, 1))
                full_times[kind].append(_median_seconds(partial(_train_step, models[kind], optimizers[kind], x), 1))
        adamw_opt, lordo_opt = statistics.median(opt_times["adamw"]), statistics.median(opt_times["lordo"])
        adamw_full, lordo_full = statistics.median(full_times["adamw"]), statistics.median(full_times["lordo"])
        rows.append({"model": name, "params": sum(p.numel() for p in models["adamw"].parameters()),
                     "adamw_step_ms": adamw_opt * 1e3, "lordo_step_ms": lordo_opt * 1e3,
                     "optimizer_step_ratio": lordo_opt / adamw_opt, "train_step_ratio": lordo_full / adamw_full})
    return rows


def basis_cost(repeats: int = 5) -> list[dict[str, Any]]:
    rows = []
    for a in (64, 128, 256, 512, 1024):
        torch.manual_seed(0)
        m, r = torch.randn(a, 4 * a), max(1, a // 8)
        warm = compute_basis(m, r, "svd")
        times = {
            "power": _median_seconds(partial(compute_basis, m, r, "power", warm=warm), repeats),
            "randomized": _median_seconds(partial(compute_basis, m, r, "randomized"), repeats),
            "svd": _median_seconds(partial(compute_basis, m, r, "svd"), repeats),
        }
        rows.append({"shape": f"{a}x{4 * a}", "rank": r, **{f"{k}_ms": v * 1e3 for k, v in times.items()},
                     "svd_over_power": times["svd"] / times["power"]})
    return rows


def memory(ranks: tuple[int, ...] = (4, 8, 16, 32)) -> list[dict[str, Any]]:
    rows = []
    for r in ranks:
        torch.manual_seed(0)
        model = CharGPT(d_model=128, n_layers=4, n_heads=4, seq_len=128)
        opt = LoRDO(model.parameters(), rank=r, error_feedback=True, full_rank=full_rank_params(model))
        model(torch.randint(0, 256, (2, 16))).mean().backward()
        opt.step()
        report = opt.memory_report()
        state = report["lowrank_moments"] + report["bases"] + report["fullrank_moments"] + report["other"]
        lowrank_params = opt.lowrank_params()
        lowrank_state = report["lowrank_moments"] + report["bases"] + sum(
            opt.state[p]["step"].numel() * 4 for p in lowrank_params)
        anchor = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append({"rank": r, "optimizer_state_bytes": state, "adamw_bytes": report["adamw_equivalent"],
                     "ratio_whole_model": state / report["adamw_equivalent"],
                     "ratio_lowrank_matrices": lowrank_state / report["adamw_equivalent_lowrank"],
                     "error_feedback_bytes": report["error_feedback"], "anchor_bytes": anchor})
    return rows


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    return table


def main() -> int:
    torch.set_num_threads(1)
    results = {"header": provenance("python benchmarks/speed.py"), "step_overhead": step_overhead(),
               "basis_cost": basis_cost(), "memory": memory()}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "speed.json").write_text(json.dumps(results, indent=2))
    console = Console()
    console.print(_table("LoRDO vs AdamW step time (1 thread, medians of interleaved repeats)",
                         results["step_overhead"]))
    console.print(_table("Basis computation per matrix (a x 4a, r = a/8)", results["basis_cost"]))
    console.print(_table("Optimizer memory, GPT d128 4L (0.84 M params), SPEC §8 lines", results["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
