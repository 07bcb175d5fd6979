"""Speed and memory of the optimizer itself, in one process, as ratios measured side by side.

1. Optimizer step: LoRDO with the lean knobs (``lordo``: no error feedback; grouped, its CPU layout, and
   ``lordo_stacked``, the accelerators' layout run here; ``lordo_default``: the defaults, error feedback on) vs
   torch's AdamW (foreach and fused) on the same parameters and gradients, on the 3.2 M-parameter GPT (ranks 32 =
   d/8 and 16, the default) and on a 12-layer GPT-2-small-shaped parameter set (ranks 96 = d/8, 24 = d/32 and 16),
   1 and 2 threads, interleaved repeats in an order rotated every repeat (times: medians; ratios: medians of each
   repeat's ratio, as the machine drifts between repeats); ``matmul_floor``, the two matmuls per low-rank matrix
   that any LoRDO step computes, timed the same way (``floor_over_fused``: the least LoRDO step over fused AdamW's
   on this machine); the ops each step dispatches and its full-size memory passes per matrix; a whole training
   step (forward + backward + step).
2. Basis computation per sync: power iteration (1 step) vs randomized SVD vs exact SVD as the matrix grows.
3. Memory: optimizer state at several ranks against AdamW's, for the whole model and the low-rank matrices
   alone, plus the error-feedback buffers and the synchronization buffers (anchor) in separate lines (SPEC §8).

Writes ``benchmarks/results/speed.json`` and prints the tables. Takes about 5 minutes on 2 cores (``--quick``:
the GPT-2 set at 2 layers, about 2 minutes; ``--reruns N``: only the 3.2 M set's rows, N times, to
``results/speed-reruns.json``, about 15 s a time). Usage: ``python benchmarks/speed.py [--quick | --reruns N]``
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
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_lordo import LoRDO
from lightning_lordo._tensors import canonical
from lightning_lordo.config import LEAN_KNOBS, OPTIMIZER_DEFAULTS
from lightning_lordo.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.optim.projection import compute_basis

SIZES = {"small (d64, 2L)": (64, 2), "medium (d128, 4L)": (128, 4), "large (d256, 4L)": (256, 4)}
OPTIMIZERS = ("adamw_foreach", "adamw_fused", "lordo", "lordo_stacked", "matmul_floor", "lordo_reference",
              "lordo_default")
VIEWS = ("aten.t.", "aten.transpose", "aten.permute", "aten.view", "aten._unsafe_view", "aten.unbind", "aten.expand",
         "aten.select", "aten.slice", "aten.alias", "aten.as_strided", "aten.detach", "aten.unsqueeze", "aten.squeeze",
         "aten.lift_fresh", "profiler.", "aten._local_scalar_dense")


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved(steps: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` per repeat: every repeat runs each once, back to back, in an order rotated every
    repeat, so the machine's drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    kinds = list(steps)
    for i in range(repeats):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            times[kind].append(_median_seconds(steps[kind], 1))
    return times


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over the repeats of each repeat's ratio ``a / b`` (steps timed side by side)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def gpt2_small(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> tuple[list[Tensor], int]:
    """A GPT-2-small-shaped parameter set (random values): token and position embeddings (full-rank), per block
    two LayerNorms, the fused qkv (2304 x 768), the attention out (768 x 768), the MLP in (3072 x 768) and out
    (768 x 3072) with their biases, and a final LayerNorm. Returns the parameters and how many are embeddings."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in shapes], 2


class _MatmulFloor(LoRDO):
    """Not an optimizer: only the two matmuls per low-rank matrix that every LoRDO step must compute, the projection
    ``Q^T G`` and the back-projection ``Q x`` (4 m n r flops). No implementation of the step is faster than this."""

    def step(self, closure: Any = None) -> None:
        if not self.state:  # the first call: a real step, which creates the bases
            return super().step(closure)
        for p in self.lowrank_params():
            q = self.state[p]["basis"]
            torch.mm(q, torch.mm(q.mT, canonical(p.grad, p)))


class InPlace(LoRDO):
    """The CPU's layout of the grouped step, on any device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, layout="in_place", **kwargs)


class Stacked(LoRDO):
    """The accelerators' layout (batched matmuls on stacked tensors), on any device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, layout="stacked", **kwargs)


#: LoRDO with each layout of the grouped step forced (benchmarks/gpu_check.py uses them too).
LAYOUTS: dict[str, type[LoRDO]] = {"in_place": InPlace, "stacked": Stacked}


def _optimizer(kind: str, params: list[Tensor], embeddings: int, rank: int) -> torch.optim.Optimizer:
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    cls = {"matmul_floor": _MatmulFloor, "lordo_stacked": Stacked}.get(kind, LoRDO)
    # the lean knobs (no error-feedback buffer), as the earlier results were measured; "lordo_default" is the
    # default, whose buffer adds its passes (functional.lowrank_grouped)
    knobs = {} if kind == "lordo_default" else LEAN_KNOBS
    return cls(params, lr=1e-3, rank=rank, full_rank=params[:embeddings], foreach=kind != "lordo_reference",
               **knobs)


def _copies(make: Callable[[], tuple[list[Tensor], int]], kinds: tuple[str, ...], rank: int
            ) -> dict[str, torch.optim.Optimizer]:
    """One copy of the parameters per optimizer, the same random gradients, state created by two steps."""
    out = {}
    for kind in kinds:
        params, embeddings = make()
        generator = torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        out[kind] = _optimizer(kind, params, embeddings, rank)
        out[kind].step()
        out[kind].step()
    return out


def optimizer_step(name: str, make: Callable[[], tuple[list[Tensor], int]], rank: int, threads: int,
                   repeats: int, kinds: tuple[str, ...] = OPTIMIZERS) -> dict[str, Any]:
    """Median step time of each optimizer over interleaved repeats, and LoRDO's ratios to AdamW (:func:`_ratio`)."""
    torch.set_num_threads(threads)
    optimizers = _copies(make, kinds, rank)
    times = _interleaved({kind: opt.step for kind, opt in optimizers.items()}, repeats)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    torch.set_num_threads(1)
    return {"set": name, "rank": rank, "threads": threads, **{f"{k}_ms": v for k, v in ms.items()},
            "lordo_over_foreach": _ratio(times, "lordo", "adamw_foreach"),
            "lordo_over_fused": _ratio(times, "lordo", "adamw_fused"),
            "floor_over_fused": _ratio(times, "matmul_floor", "adamw_fused"),
            "stacked_over_foreach": _ratio(times, "lordo_stacked", "adamw_foreach"),
            **({"default_over_foreach": _ratio(times, "lordo_default", "adamw_foreach"),
                "default_over_fused": _ratio(times, "lordo_default", "adamw_fused")} if "lordo_default" in ms else {})}


class _Ops(TorchDispatchMode):
    """Counts dispatched ops, and full-size memory passes: every read of an argument and every write of a result
    (or, in place, of the first argument; torch's fused AdamW writes its params and both moments) whose matrices
    have at least ``size`` elements, in units of ``size``. Views move nothing."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.ops, self.passes = size, 0, 0.0

    def _tensors(self, value: Any) -> list[Tensor]:
        if isinstance(value, Tensor):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in self._tensors(v)]
        return []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not any(name.startswith(v) for v in VIEWS):
            touched = self._tensors(list(args) + list((kwargs or {}).values()))
            if name.startswith("aten._fused_adam"):
                touched += self._tensors([args[0], args[2], args[3]])
            elif name.split(".")[1].endswith("_"):  # in place: the first argument is written
                touched += self._tensors(args[0])
            else:
                touched += self._tensors(out)
            self.passes += sum(t.numel() for t in touched if _area(t) >= self.size) / self.size
        return out


def _area(t: Tensor) -> int:
    """The elements of one matrix of ``t`` (a stack counts per matrix)."""
    return t.shape[-1] * t.shape[-2] if t.dim() >= 2 else t.numel()


def dispatch_counts(make: Callable[[], tuple[list[Tensor], int]], rank: int, matrix: int, matrices: int,
                    kinds: tuple[str, ...] = OPTIMIZERS) -> list[dict[str, Any]]:
    """Ops dispatched by one step, and full-size memory passes per matrix (``matrix`` elements, ``matrices`` of
    them in the set)."""
    optimizers = _copies(make, kinds, rank)
    rows = []
    for kind, opt in optimizers.items():
        with _Ops(matrix) as count:
            opt.step()
        rows.append({"optimizer": kind, "ops_per_step": count.ops, "passes_per_matrix": count.passes / matrices})
    return rows


def _gpt(d: int, layers: int) -> Callable[[], tuple[list[Tensor], int]]:
    def make() -> tuple[list[Tensor], int]:
        torch.manual_seed(0)
        model = CharGPT(d_model=d, n_layers=layers, n_heads=4, seq_len=64)
        params = list(model.parameters())
        full = {id(p) for p in full_rank_params(model)}
        return [p for p in params if id(p) in full] + [p for p in params if id(p) not in full], len(full)
    return make


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).logsumexp(-1).mean().backward()
    optimizer.step()


def training_step(repeats: int = 60) -> list[dict[str, Any]]:
    """A whole training step (forward, backward, optimizer step) of the demo's GPTs: LoRDO against AdamW
    (:func:`_interleaved`, :func:`_ratio`)."""
    rows = []
    for name, (d, layers) in SIZES.items():
        torch.manual_seed(0)
        base = CharGPT(d_model=d, n_layers=layers, n_heads=4, seq_len=64)
        models, optimizers = {}, {}
        for kind in ("adamw_foreach", "adamw_fused", "lordo", "lordo_default"):
            models[kind] = CharGPT(d_model=d, n_layers=layers, n_heads=4, seq_len=64)
            models[kind].load_state_dict(base.state_dict())
            params = list(models[kind].parameters())
            full = {id(p) for p in full_rank_params(models[kind])}
            ordered = [p for p in params if id(p) in full] + [p for p in params if id(p) not in full]
            optimizers[kind] = _optimizer(kind, ordered, len(full), d // 8)
        x = torch.randint(0, 256, (8, 64))
        for kind in optimizers:  # warm up, and create the state
            _train_step(models[kind], optimizers[kind], x)
        times = _interleaved({k: partial(_train_step, models[k], optimizers[k], x) for k in optimizers}, repeats)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"model": name, "params": sum(p.numel() for p in base.parameters()),
                     **{f"{k}_ms": v for k, v in ms.items()},
                     "lordo_over_foreach": _ratio(times, "lordo", "adamw_foreach"),
                     "lordo_over_fused": _ratio(times, "lordo", "adamw_fused"),
                     "default_over_foreach": _ratio(times, "lordo_default", "adamw_foreach"),
                     "default_over_fused": _ratio(times, "lordo_default", "adamw_fused")})
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


def reruns(runs: int) -> list[dict[str, Any]]:
    """The 3.2 M set's optimizer-step rows alone, ``runs`` times (each with fresh copies): how far a row moves
    between runs on this machine."""
    return [optimizer_step("GPT d256 4L (3.2 M)", _gpt(256, 4), 32, threads, 20) for _ in range(runs)
            for threads in (1, 2)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--reruns"]:  # --reruns N: the 3.2 M rows alone, N times (results/speed-reruns.json)
        rows = reruns(int(argv[1]))
        (ROOT / "results" / "speed-reruns.json").write_text(json.dumps(
            {"header": provenance("python benchmarks/speed.py " + " ".join(argv)), "optimizer_step": rows}, indent=2))
        Console(width=220).print(_table("The 3.2 M set's optimizer-step rows, run after run", rows))
        return 0
    quick = "--quick" in argv  # the GPT-2-small set at 2 layers instead of 12 (seconds instead of minutes)
    layers = 2 if quick else 12
    torch.set_num_threads(1)
    gpt2 = partial(gpt2_small, layers)
    default_rank = OPTIMIZER_DEFAULTS["rank"]  # beside d/8 (and d/32 on the 768-wide set)
    steps = [optimizer_step("GPT d256 4L (3.2 M)", _gpt(256, 4), r, threads, 20) for r in (32, default_rank)
             for threads in (1, 2)]
    steps += [optimizer_step(f"GPT-2 small shapes ({layers} layers)", gpt2, rank, threads, 3 if quick else 9,
                             kinds=tuple(k for k in OPTIMIZERS if k != "lordo_reference"))
              for rank in (96, 24, default_rank) for threads in (1, 2)]
    ops = dispatch_counts(gpt2, 96, 768 * 3072, 2 * layers, kinds=("adamw_foreach", "adamw_fused", "lordo",
                                                                   "lordo_stacked", "lordo_default"))
    passes = dispatch_counts(lambda: ([torch.nn.Parameter(torch.randn(3072, 768)) for _ in range(8)], 0), 96,
                             768 * 3072, 8)
    results = {"header": provenance("python benchmarks/speed.py " + " ".join(argv)), "optimizer_step": steps,
               "dispatch": ops, "memory_passes": passes, "training_step": training_step(),
               "basis_cost": basis_cost(), "memory": memory()}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / ("speed-quick.json" if quick else "speed.json")).write_text(json.dumps(results, indent=2))
    console = Console(width=220)
    console.print(_table("Optimizer step, ms (medians of interleaved repeats) and LoRDO's ratios",
                         results["optimizer_step"]))
    console.print(_table(f"Ops dispatched per step, GPT-2-small shapes ({layers} layers, rank 96); memory passes "
                         "per 3072 x 768 matrix", results["dispatch"]))
    console.print(_table("Full-size memory passes per matrix (8 matrices 3072 x 768, rank 96)",
                         results["memory_passes"]))
    console.print(_table("Whole training step, ms (1 thread)", results["training_step"]))
    console.print(_table("Basis computation per matrix (a x 4a, r = a/8)", results["basis_cost"]))
    console.print(_table("Optimizer memory, GPT d128 4L (0.84 M params), SPEC §8 lines", results["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
