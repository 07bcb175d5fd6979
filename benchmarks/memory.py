"""Device memory of LoRDO against fused AdamW, counted from the tensors' storages (what a GPU would hold).

For each configuration, one process-local run on the CPU: an optimizer step (which creates the optimizer state) and
a sync (which creates the synchronization buffers), then every storage is counted once:

* ``params``, ``grads``: the model's parameters and gradients;
* ``optimizer``: every optimizer state tensor but LoRDO's error-feedback buffers; ``error_feedback``: those buffers
  (bfloat16, as ``ef_dtype="auto"`` keeps them on an accelerator, unless the row says float32);
* ``sync``: the anchor (only where it stays on the parameters' device: ``anchor_device="param"``; ``"auto"`` puts it
  in pinned host memory on an accelerator), the outer momentum and the payloads' state;
* ``transient``: the largest number of bytes that a sync allocates and holds at once (:class:`LiveBytes`, which
  follows every storage the sync's ops create until it is freed); ``step_transient``: the same for an optimizer step.

LoRDO runs in the accelerators' layout (``layout="stacked"``: same-shape matrices stacked, in stacks of at most
``STACK_BYTES``), as it would on a GPU.

Ratios are to fused AdamW's resident bytes (params + grads + 2 moments). The model is GPT-2-medium-shaped (24
layers, d 1024, vocabulary 50257, untied head: 406 M parameters, float32), one process (one device). Takes about
3 minutes and 8 GB of memory; ``--small`` runs a 4-layer, d 256 version in seconds.

Usage: ``python benchmarks/memory.py [--small] [--device cuda] [--processes 2]``. ``--processes 2`` measures only a
sync's transient, in each of two forked gloo processes on GPT-2-small's shape (``--small``: the 4-layer one), against
its bound (two buckets and the low-rank messages).
Writes ``results/memory.json`` (``memory-small.json``,
``memory-cuda.json``); on a GPU each row also gives ``torch.cuda.memory_allocated`` to check the count against.
"""

from __future__ import annotations

import argparse
import gc
import json
import weakref
from datetime import timedelta
from typing import Any

import torch
from counts import preset_knobs, tensors_in
from harness import ROOT, provenance
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_lordo import LoRDO
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.config import SyncConfig
from lightning_lordo.convert import full_rank_params
from lightning_lordo.models import CharGPT
from lightning_lordo.sync.synchronizer import Synchronizer

#: name -> (preset, optimizer knobs over the preset's, sync knobs over the preset's)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "lordo": ("lordo", {"ef_dtype": "bfloat16"}, {}),  # on an accelerator "auto" is bfloat16
    "lordo, ef float32": ("lordo", {"ef_dtype": "float32"}, {}),
    "lordo, anchor on the device": ("lordo", {"ef_dtype": "bfloat16"}, {"anchor_device": "param"}),
    "lordo_lean": ("lordo_lean", {}, {}),
    "lordo_lean, anchor on the device": ("lordo_lean", {}, {"anchor_device": "param"}),
    "lordo, factored full-rank state": ("lordo", {"ef_dtype": "bfloat16", "fullrank_state": "factored"}, {}),
    "lordo_lean, factored full-rank state": ("lordo_lean", {"fullrank_state": "factored"}, {}),
}


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops create while active and that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}  # storage pointer -> live tensors created here that use it
        self._sizes: dict[int, int] = {}

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            self.live -= self._sizes.pop(ptr)
            del self._refs[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen = {t.untyped_storage().data_ptr() for t in tensors_in([args, kwargs or {}])}
        out = func(*args, **(kwargs or {}))
        for t in tensors_in([out]):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen and ptr not in self._refs:
                continue  # an input's storage that existed before (in place, or a view of it)
            if ptr not in self._refs:
                self._refs[ptr], self._sizes[ptr] = 0, t.untyped_storage().nbytes()
                self.live += self._sizes[ptr]
                self.peak = max(self.peak, self.live)
            self._refs[ptr] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def storage_bytes(tensors: list[Tensor], counted: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``counted`` (which is updated)."""
    total = 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in counted:
            counted.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def model(small: bool, gpt2_small: bool = False) -> CharGPT:
    """The 406 M GPT-2-medium shape, ``small``: a 4-layer one 256 wide, ``gpt2_small``: GPT-2-small's (163 M with
    the untied head), which ``--processes 2`` uses (two processes of the 406 M one do not fit in 23 GB)."""
    torch.manual_seed(0)
    if small:
        return CharGPT(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, seq_len=128, tie_weights=False)
    if gpt2_small:
        return CharGPT(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, seq_len=512, tie_weights=False)
    return CharGPT(vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, seq_len=512, tie_weights=False)


def measure(name: str, small: bool, device: str = "cpu") -> dict[str, Any]:
    net = model(small).to(device)
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    sync = None
    if name.startswith("adamw"):
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, fused=name == "adamw (fused)",
                                                       foreach=name == "adamw (foreach)")
        opt.step()
    else:
        preset, opt_knobs, sync_knobs = CONFIGS[name]
        knobs, config = preset_knobs(preset)
        opt = LoRDO(params, rank=16, full_rank=full_rank_params(net), layout="stacked", **{**knobs, **opt_knobs})
        comm = Communicator(CommAccountant(), timedelta(minutes=5))
        rounds = SyncConfig(**{"sync_every": 1, "synchronous": False, **config, **sync_knobs})  # a worker's rounds
        sync = Synchronizer(params, [], opt, rounds, comm)
        sync.before_optimizer_step()
        opt.step()
    counted: set[int] = set()
    row: dict[str, Any] = {"config": name, "params": storage_bytes(params, counted),
                           "grads": storage_bytes([p.grad for p in params], counted)}
    states = [(k, v) for s in opt.state.values() for k, v in s.items() if isinstance(v, Tensor)]
    row["optimizer"] = storage_bytes([v for k, v in states if k != "error_feedback"], counted)
    row["error_feedback"] = storage_bytes([v for k, v in states if k == "error_feedback"], counted)
    row["sync"], row["transient"] = 0, 0
    if sync is not None:
        with LiveBytes() as live:
            sync.on_optimizer_step()  # sync_every=1: a sync
        row["transient"] = live.peak
        on_device = sync.config.anchor_device == "param"
        buffers = (sync.anchor.tensors if on_device else []) + sync.outer.momentum_buffers() + \
            [t for _, _, m, _ in sync.payloads.groups for t in tensors_in(m.state_dict())]
        row["sync"] = storage_bytes(buffers, counted)
    for p in params:
        p.grad.normal_(0, 1e-3)
    with LiveBytes() as live:
        opt.step()  # a step with the state (and, for LoRDO, bases) in place
    row["step_transient"] = live.peak
    row["resident"] = sum(row[k] for k in ("params", "grads", "optimizer", "error_feedback", "sync"))
    if device.startswith("cuda"):  # the storages against the allocator (the step counters live on the host)
        row["cuda_allocated"] = torch.cuda.memory_allocated(device)
    del opt, sync, net, params
    gc.collect()
    return row


#: The configurations whose sync transient ``--processes 2`` measures: the bucketed sync's (float32 full payload)
#: and the general path's (compressed payloads)
TWO_PROCESS_CONFIGS = ("lordo", "lordo_lean", "lordo_compressed")


def _sync_transient_worker(rank: int, port: int, small: bool, out: str) -> None:
    """One of two gloo workers: per configuration, two steps and syncs of the model; the second sync's transient peak
    against its bound (two buckets, a tensor larger than the cap being a bucket of its own, plus the low-rank
    messages: the averaged low-rank moments and the new bases, and a low-rank payload's round: its bases, the averaged
    and the sent B messages and the new right factors), written to ``out.<rank>``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=30))
    rows = []
    for preset in TWO_PROCESS_CONFIGS:
        net = model(small, gpt2_small=True)
        params = list(net.parameters())
        gen = torch.Generator().manual_seed(rank)  # the workers' pseudo-gradients differ
        knobs, config = preset_knobs(preset)
        ef = {"ef_dtype": "bfloat16"} if knobs.get("error_feedback", True) else {}  # an accelerator's "auto"
        opt = LoRDO(params, rank=16, full_rank=full_rank_params(net), layout="stacked", **ef, **knobs)
        rounds = SyncConfig(**{"sync_every": 1, "synchronous": False, **config})
        sync = Synchronizer(params, [], opt, rounds, Communicator(CommAccountant(), timedelta(minutes=30)))
        for _ in range(2):  # the second sync is measured: the first also creates the payloads' error feedback
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3  # (a sync releases them)
            sync.before_optimizer_step()
            opt.step()
            with LiveBytes() as live:
                sync.on_optimizer_step()  # sync_every=1: a sync
        lowrank = opt.lowrank_params()
        messages = sum(opt.state[p][k].numel() * 4 for p in lowrank for k in ("exp_avg", "exp_avg_sq", "basis"))
        # a low-rank payload's round, per matrix: its basis Q, the averaged and the sent B, the new right factor
        messages += 4 * sum(m.ranks[n] * sum(params[i].shape) * 4 for _, at, m, _ in sync.payloads.groups
                            if isinstance(m, LowRankPayload) for n, i in enumerate(at))
        bucket = max(rounds.bucket_cap_mb * 2**20, max(p.numel() * 4 for p in params))
        model_bytes = sum(p.numel() * 4 for p in params)
        rows.append({"config": preset, "transient": live.peak, "bound": 2 * bucket + messages,
                     "model": model_bytes, "transient_models": round(live.peak / model_bytes, 3),
                     "bound_models": round((2 * bucket + messages) / model_bytes, 3)})
        del opt, sync, net, params
        gc.collect()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def two_processes(small: bool) -> list[dict[str, Any]]:
    """The sync transient with two processes (forked, gloo), rank 0's rows."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_sync_transient_worker, args=(port, small, f"{tmp}/rows"), nprocs=2, start_method="fork")
        return json.loads(open(f"{tmp}/rows.0").read())


def check(device: torch.device, small: bool) -> dict[str, Any]:
    """``gpu_check.py``'s memory section: fused AdamW, ``"lordo"``, ``"lordo_lean"`` and the memory configuration
    (``"lordo_lean"`` with ``fullrank_state="factored"``) on ``device``; on a GPU the
    counted storages must account for what the allocator holds (within 5 % and 64 MB)."""
    rows = [measure(name, small, str(device)) for name in ("adamw (fused)", "lordo", "lordo_lean",
                                                           "lordo_lean, factored full-rank state")]
    for r in rows:
        r["over_adamw"] = round(r["resident"] / rows[0]["resident"], 3)
    counted = all(abs(r["cuda_allocated"] - r["resident"]) <= 0.05 * r["resident"] + 2**26
                  for r in rows if "cuda_allocated" in r)
    return {"ok": counted, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a 4-layer, d 256 model (seconds)")
    parser.add_argument("--device", default="cpu", help="where the model lives, e.g. cuda (then the counts are "
                        "checked against torch.cuda.memory_allocated, and the error feedback's dtype is the device's)")
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1,
                        help="2: only the sync's transient, in each of two processes (results/memory-2proc.json)")
    args = parser.parse_args()
    if args.processes == 2:
        rows = two_processes(args.small)
        print(f"{'configuration':<20}{'sync transient (models)':>25}{'bound (models)':>16}  holds")
        for r in rows:
            r["holds"] = r["transient"] <= r["bound"]
            print(f"{r['config']:<20}{r['transient_models']:>25}{r['bound_models']:>16}  {r['holds']}")
        path = ROOT / "results" / f"memory-2proc{'-small' if args.small else ''}.json"
        command = "python benchmarks/memory.py --processes 2" + (" --small" if args.small else "")
        path.write_text(json.dumps({"provenance": provenance(command), "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
        return
    rows = [measure(name, args.small, args.device) for name in ("adamw (fused)", "adamw (foreach)", *CONFIGS)]
    adamw = rows[0]["resident"]
    model_bytes = rows[0]["params"]
    gb = 1e9
    print(f"{'configuration':<38}{'resident GB':>12}{'/ AdamW':>9}{'optimizer':>11}{'EF':>8}{'sync':>8}"
          f"{'sync transient (models)':>25}{'step transient (models)':>25}")
    for r in rows:
        r["over_adamw"] = round(r["resident"] / adamw, 3)
        r["transient_models"] = round(r["transient"] / model_bytes, 2)
        r["step_transient_models"] = round(r["step_transient"] / model_bytes, 3)
        print(f"{r['config']:<38}{r['resident'] / gb:>12.2f}{r['over_adamw']:>8.2f}x{r['optimizer'] / gb:>11.2f}"
              f"{r['error_feedback'] / gb:>8.2f}{r['sync'] / gb:>8.2f}{r['transient_models']:>25}"
              f"{r['step_transient_models']:>25}"
              + (f"  (cuda allocated {r['cuda_allocated'] / gb:.2f} GB)" if "cuda_allocated" in r else ""))
    suffix = ("-small" if args.small else "") + ("" if args.device == "cpu" else f"-{args.device.split(':')[0]}")
    path = ROOT / "results" / f"memory{suffix}.json"
    command = "python benchmarks/memory.py" + (" --small" if args.small else "") + (
        "" if args.device == "cpu" else f" --device {args.device}")
    path.write_text(json.dumps({"provenance": provenance(command), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
