"""What a GPU pays for, counted on the CPU: host reads and dispatched ops per sync and per optimizer step.

On an accelerator every read of a device value back to the host (``.item()``, ``bool()``, ``.tolist()``) stalls the
host until the device has caught up, and every dispatched op is at least one kernel launch. Neither needs a GPU to
count: :class:`Counts` counts both while the code runs on the CPU, in the accelerators' layout (``layout=
"stacked"``: stacked same-shape matrices, batched bases). Values computed only from LoRDO's step counters, which live in
host memory on an accelerator too, are not device reads and are not counted.

Printed (one run, counts do not depend on the machine); ``views`` are the ops that only view existing memory (no
kernel on a device), counted apart:

1. ``sync``: host reads and dispatched ops of one sync, per parameter tensor, at world size 1 and 2 (gloo, fork), for
   the presets' knobs, on a 12-layer GPT (GPT-2-small's depth) and, with 2 processes, a 24-layer one (GPT-2-medium's,
   issue 29's 406 M model), both 64 wide, and GPT-2-small itself (width 768). Where the work is batched by shape its
   ops do not grow with the depth, so the ops per tensor fall as the model deepens; the width matters only where a
   shape's matrices pass 64 MB and go in several stacks (``STACK_BYTES``), hence the full-width model.
2. ``step``: dispatched ops of one optimizer step, LoRDO against torch's foreach and fused AdamW, on GPT-2-small's
   parameter set (full widths: the step's stacks are bounded at 64 MB): all, and those on device data (the ones
   that launch kernels; torch's foreach AdamW dispatches one host op per step counter, which launches none), and of
   those the ones that compute (not views).

Usage: ``python benchmarks/counts.py`` (a few minutes, about 8 GB). Writes ``results/counts.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_lordo import LoRDO
from lightning_lordo.comm import communicator
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.config import LEAN_KNOBS, SyncConfig
from lightning_lordo.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.optim import fullrank, functional
from lightning_lordo.strategy_knobs import PRESETS
from lightning_lordo.sync import bucketed
from lightning_lordo.sync.synchronizer import Synchronizer

READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose")
#: Ops that only make a new view of existing memory: the host dispatches them, but no kernel runs on a device.
VIEWS = ("aten.view.", "aten._unsafe_view.", "aten.transpose.", "aten.t.", "aten.unsqueeze.", "aten.squeeze.",
         "aten.slice.", "aten.select.", "aten.detach.", "aten.alias.", "aten.split.", "aten.split_with_sizes.",
         "aten.unbind.", "aten.expand.", "aten.permute.", "aten.as_strided.", "aten.view_as_real.")
#: The presets whose syncs are counted: their optimizer knobs and synchronization knobs.
SYNC_PRESETS = ("lordo", "lordo_lean", "lordo_compressed")


class Counts(TorchDispatchMode):
    """Counts dispatched ops and host reads (``item``/``bool``/``equal`` and ``Tensor.tolist``) while active.

    Args:
        host: tensors that live in host memory on an accelerator too (LoRDO's step counters): reads of them, and of
            anything computed from them alone, are not device reads.
    """

    def __init__(self, host: Iterable[Tensor] = ()) -> None:
        super().__init__()
        self.ops, self.reads = 0, 0
        self.host_ops = 0  # ops on host tensors alone (step counters): no kernel on a device either
        self.device_views = 0  # ops that only view device data: no kernel either
        self.by_op: dict[str, int] = {}
        self._host = WeakIdKeyDictionary()
        for t in host:
            self._host[t] = True
        self._tolist: Callable[..., Any] = Tensor.tolist

    def _is_host(self, t: Any) -> bool:
        return isinstance(t, Tensor) and t in self._host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.ops += 1
        self.by_op[name] = self.by_op.get(name, 0) + 1
        inputs = tensors_in([args, kwargs or {}])
        host = bool(inputs) and all(self._is_host(a) for a in inputs)
        self.host_ops += host
        self.device_views += not host and name.startswith(VIEWS)
        if name.startswith(READS) and not host:
            self.reads += 1
        out = func(*args, **(kwargs or {}))
        if host:
            for t in tensors_in(out):
                self._host[t] = True
        return out

    def __enter__(self) -> Counts:
        counts = self
        original = self._tolist

        def tolist(t: Tensor) -> Any:
            if not counts._is_host(t):
                counts.reads += 1
            return original(t)

        Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in ``value``, however nested in lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def step_counters(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [s["step"] for s in optimizer.state.values() if isinstance(s.get("step"), Tensor)]


def preset_knobs(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preset's optimizer knobs and synchronization knobs."""
    knobs = PRESETS[name][0]
    optimizer = {k: v for k, v in knobs.items() if k in LEAN_KNOBS or k in ("rank", "omega")}
    return optimizer, {k: v for k, v in knobs.items() if k not in optimizer}


#: A ``bucket_cap_mb`` above GPT-2-small's matrices (about 500 MB of float32): a compressed sync holds its round.
HELD_CAP_MB = 1024.0
#: The GPTs whose syncs are counted: ``(layers, width, vocabulary, heads)``; scaled-down widths, and GPT-2-small's.
SCALED_12, SCALED_24, GPT2_SMALL = (12, 64, 256, 4), (24, 64, 256, 4), (12, 768, 50257, 12)
#: GPT-2-small with a quarter of its width and vocabulary: every matrix 16 times smaller, so with the byte bounds
#: divided by 16 (``bytes_divisor=16``) its syncs are cut into the same stacks and buckets as GPT-2-small's.
GPT2_SMALL_BY_16 = (12, 192, 12565, 12)


@contextmanager
def byte_bounds_divided(divisor: int) -> Iterator[None]:
    """The bounds in bytes that cut the work (a stack of same-shape matrices, a collective's message) divided by
    ``divisor`` while active, for a model whose tensors are ``divisor`` times smaller (:data:`GPT2_SMALL_BY_16`)."""
    bounds = [(functional, "STACK_BYTES"), (fullrank, "STACK_BYTES"), (communicator, "_MESSAGE_BYTES")]
    saved = [getattr(module, name) for module, name in bounds]
    for (module, name), value in zip(bounds, saved):
        setattr(module, name, value // divisor)
    try:
        yield
    finally:
        for (module, name), value in zip(bounds, saved):
            setattr(module, name, value)


def count_sync(preset: str, steps: int = 6, sync_every: int = 2, shape: tuple[int, int, int, int] = SCALED_12,
               bucket_cap_mb: Optional[float] = None, bytes_divisor: int = 1) -> dict[str, Any]:
    """Host reads and dispatched ops of the last sync of a short run (the process group, if any, is set up), on a
    GPT of ``shape`` (layers, width, vocabulary, heads); ``bucket_cap_mb``: the sync's, if not the default;
    ``bytes_divisor``: the sync's ``bucket_cap_mb`` and :func:`byte_bounds_divided`'s bounds divided by it."""
    with byte_bounds_divided(bytes_divisor):
        return _count_sync(preset, steps, sync_every, shape, bucket_cap_mb, bytes_divisor)


def _count_sync(preset: str, steps: int, sync_every: int, shape: tuple[int, int, int, int],
                bucket_cap_mb: Optional[float], bytes_divisor: int) -> dict[str, Any]:
    # the accelerators' layout (layout="stacked"), counted on the CPU
    torch.manual_seed(0)
    layers, width, vocab, heads = shape
    model = CharGPT(vocab_size=vocab, d_model=width, n_layers=layers, n_heads=heads, seq_len=32)
    params = list(model.parameters())
    knobs, sync_knobs = preset_knobs(preset)
    opt = LoRDO(params, lr=1e-3, rank=8, full_rank=full_rank_params(model), layout="stacked", **knobs)
    comm = Communicator(CommAccountant(), timedelta(seconds=60))
    if bucket_cap_mb is not None:
        sync_knobs = {**sync_knobs, "bucket_cap_mb": bucket_cap_mb}
    config = SyncConfig(**{"sync_every": sync_every, "synchronous": False, **sync_knobs})  # a worker's rounds
    config.bucket_cap_mb /= bytes_divisor
    sync = Synchronizer(params, [], opt, config, comm)
    x = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(comm.rank))
    for step in range(steps):
        opt.zero_grad()
        model(x).float().mean().backward()
        sync.before_optimizer_step()
        opt.step()
        if step < steps - 1:
            sync.on_optimizer_step()
    streamed = bucketed.streams(sync)  # low-rank messages made a bucket at a time (bucket_cap_mb)
    with Counts(step_counters(opt)) as counts:
        report = sync.on_optimizer_step()
    assert report is not None, "the counted step did not sync"
    views = sum(n for name, n in counts.by_op.items() if name.startswith(VIEWS))
    return {"preset": preset, "world": comm.world_size, "layers": layers, "width": width, "tensors": len(params),
            "bucket_cap_mb": config.bucket_cap_mb, "streamed": streamed, "reads": counts.reads,
            "ops": counts.ops, "ops_per_tensor": round(counts.ops / len(params), 2), "view_ops": views,
            "kernel_ops_per_tensor": round((counts.ops - views) / len(params), 2)}


def _worker(rank: int, world: int, port: int, out: str, shapes: Sequence[tuple[int, int, int, int]],
            held: Sequence[tuple[int, int, int, int]], steps: int, bytes_divisor: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        rows = [count_sync(name, steps=steps, shape=shape, bytes_divisor=bytes_divisor)
                for shape in shapes for name in SYNC_PRESETS]
        rows += [count_sync("lordo_compressed", steps=steps, shape=shape, bucket_cap_mb=HELD_CAP_MB,
                            bytes_divisor=bytes_divisor) for shape in held]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def count_syncs_two_processes(shapes: Sequence[tuple[int, int, int, int]] = (SCALED_12,),
                              held: Sequence[tuple[int, int, int, int]] = (), steps: int = 6,
                              bytes_divisor: int = 1) -> list[dict[str, Any]]:
    """:func:`count_sync` for every preset on each of ``shapes`` with 2 processes (fork, gloo), then
    ``"lordo_compressed"`` on each of ``held`` with a ``bucket_cap_mb`` that holds its low-rank round whole; rank 0's
    counts (rank 1's are checked to be the same). ``steps``: each run's (the counted sync is its last).
    ``bytes_divisor``: :func:`count_sync`'s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts")
        mp.start_processes(_worker, args=(2, port, out, tuple(shapes), tuple(held), steps, bytes_divisor), nprocs=2,
                           start_method="fork")
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert ranks[0] == ranks[1], f"the ranks counted differently: {ranks}"
    return ranks[0]


def count_step(make: Callable[[list[Tensor], torch.nn.Module], torch.optim.Optimizer],
               shape: tuple[int, int, int, int] = GPT2_SMALL, bytes_divisor: int = 1) -> dict[str, int]:
    """Dispatched ops of one optimizer step on the parameter set of a GPT of ``shape`` (GPT-2-small's: 12 layers,
    width 768, tied head, 1,024 positions; positions shrink with the width), with :func:`byte_bounds_divided`:
    all of them (``ops``), those on device data (``device_ops``: not on the step counters alone, which stay in
    host memory on an accelerator too; torch's foreach AdamW reads each parameter's counter on the host), and of
    those the ones that do not only view memory (``kernel_ops``: each launches at least one kernel)."""
    torch.manual_seed(0)
    layers, width, vocab, heads = shape
    model = CharGPT(vocab_size=vocab, d_model=width, n_layers=layers, n_heads=heads, seq_len=1024 * width // 768,
                    tie_weights=True)
    params = list(model.parameters())
    with byte_bounds_divided(bytes_divisor):
        opt = make(params, model)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.step()
        with Counts(step_counters(opt)) as counts:
            opt.step()
    return {"ops": counts.ops, "device_ops": counts.ops - counts.host_ops,
            "kernel_ops": counts.ops - counts.host_ops - counts.device_views}


def count_steps(shape: tuple[int, int, int, int] = GPT2_SMALL, bytes_divisor: int = 1) -> dict[str, Any]:
    """Per optimizer: ``ops``, ``device_ops`` and ``kernel_ops`` (:func:`count_step`). LoRDO as on an accelerator,
    counted on the CPU: the stacked layout, and torch's foreach AdamW for the embeddings and the head (``fused=None``
    takes it there; on the CPU the fused one). The ratios are of kernel ops."""
    row = {"adamw_foreach": count_step(lambda ps, m: torch.optim.AdamW(ps, foreach=True), shape, bytes_divisor),
           "adamw_fused": count_step(lambda ps, m: torch.optim.AdamW(ps, fused=True), shape, bytes_divisor)}
    for name in ("lordo", "lordo_lean"):
        knobs = preset_knobs(name)[0]
        row[name] = count_step(lambda ps, m, k=knobs: LoRDO(ps, rank=12, full_rank=full_rank_params(m),
                                                            layout="stacked", fused=False, **k), shape, bytes_divisor)
    for name in ("lordo", "lordo_lean"):
        for base in ("adamw_foreach", "adamw_fused"):
            row[f"{name}_over_{base[6:]}"] = round(row[name]["kernel_ops"] / row[base]["kernel_ops"], 1)
    return row


def main() -> None:
    from harness import ROOT, provenance

    sync_rows = [count_sync(name) for name in SYNC_PRESETS] + count_syncs_two_processes(
        (SCALED_12, SCALED_24, GPT2_SMALL), held=(GPT2_SMALL,))
    print("sync (accelerators' layout; GPTs of 12 layers, 196 parameter tensors, and 24, 388; width 64, or 768)")
    print(f"{'preset':<18}{'world':>6}{'layers':>7}{'width':>6}{'bucket MB':>10}{'streamed':>9}{'host reads':>12}"
          f"{'ops':>8}{'ops/tensor':>12}{'views':>8}{'non-view ops/tensor':>21}")
    for r in sync_rows:
        print(f"{r['preset']:<18}{r['world']:>6}{r['layers']:>7}{r['width']:>6}{r['bucket_cap_mb']:>10g}"
              f"{'yes' if r['streamed'] else 'no':>9}{r['reads']:>12}{r['ops']:>8}{r['ops_per_tensor']:>12}"
              f"{r['view_ops']:>8}{r['kernel_ops_per_tensor']:>21}")
    step = count_steps()
    print("\nstep (GPT-2-small's parameter set, full widths): dispatched ops, all and on device data",
          json.dumps(step))
    result = {"provenance": provenance("python benchmarks/counts.py"), "sync": sync_rows, "step": step}
    path = ROOT / "results" / "counts.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
