"""``benchmarks/scale.py``'s arithmetic and output: the parameter and FLOP counts, the projected GPU wall time of a
stage, a run's row from what its workers wrote, the summary table with the paper's four claims, and the figures.

Projection (``--dry-run``), per method, on one GPU shared by M workers:

* compute: FLOPs of one training step per worker, counted by ``torch.utils.flop_counter.FlopCounterMode`` on the meta
  device at the stage's batch (forward and backward; validation batches forward only), times M (the workers share the
  GPU), divided by a sustained throughput. That throughput is *measured on the H200* in
  ``results/gpu_check.json``: its ``strategy="auto"`` fit (406 M parameters, bf16-mixed, 4 x 512 tokens, fused AdamW)
  ran at FLOPs per step / median step time. Assumed: the 16 M model reaches the same throughput;
* optimizer step: gpu_check's measured step of the GPT-2-124M-shaped set on the H200 (AdamW foreach for DDP and
  DiLoCo, LoRDO for the LoRDO family, the lean knobs for ``lordo_compressed``) scaled by the number of parameter
  tensors (launch-bound), times M;
* communication: the payload bytes the dry run measured (per step after PowerSGD's two uncompressed steps, or per
  sync after the first step's initial bases), scaled to the stage's steps and K, as wire bytes (the measured
  wire / payload ratio) over the gloo loopback bus bandwidth measured here (2 processes, 64 MiB all-reduces), plus
  1 ms per round (a step of the synchronous methods, a sync of the others). Assumed: the GPU machine's loopback is
  no slower and the copies between device and host (~25 GB/s) are negligible;
* start-up per run: gpu_check's fit seconds less its steps (CUDA context, cuBLAS, first step), plus 2 s; and 10 s
  for the script itself (imports, provenance, figures).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from harness import ROOT, finish_panels, panels
from torch.utils.flop_counter import FlopCounterMode

from lightning_lordo.models import CharGPT

H200_BF16_DENSE = 989e12  # FLOP/s, the datasheet's dense bf16 peak (H100 SXM and H200 alike)
ALPHA = 1e-3  # seconds per communication round on the loopback (assumed)
ORCHESTRATION_S = 10.0  # scale.py's own start, provenance and figures (assumed; about 5 s on the 2-core CPU)
PER_STEP = ("ddp", "ddp_powersgd", "lowrank_ddp")  # methods that communicate every step
OPT_KIND = {"ddp": "adamw_foreach", "ddp_powersgd": "adamw_foreach", "diloco": "adamw_foreach",
            "lordo_compressed": "lordo_lean"}  # the others: "lordo"
GPT2_SET_TENSORS = 2 + 12 * 12 + 2  # gpu_check's GPT-2-124M step set: embeddings, 12 blocks of 12, final norm
CLAIMS = (
    "1 LoRDO within 1 % of low-rank DDP's perplexity, with ~10x (here: >= 8x) fewer payload bytes",
    "2 the global basis beats the local one (lordo's perplexity > 1 % below lordo_local's)",
    "3 a global basis without QHM (omega = 1) stagnates (perplexity > 1.05 x lordo's)",
    "4 at a small rank, LoRDO uses less memory than DDP at equal loss (perplexity within 1 %)",
)


def _model(cfg: dict[str, Any], vocab: int = 256, tie: bool = True) -> CharGPT:
    with torch.device("meta"):
        return CharGPT(vocab, cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["seq_len"], tie_weights=tie)


def params(cfg: dict[str, Any]) -> int:
    return sum(p.numel() for p in _model(cfg).parameters())


def flops(cfg: dict[str, Any], batch: int, vocab: int = 256, tie: bool = True) -> tuple[float, float]:
    """FLOPs of one training step (forward and backward) and of one forward pass, for ``batch`` sequences."""
    model = _model(cfg, vocab, tie)
    x = torch.zeros(batch, cfg["seq_len"], dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
    return float(counter.get_total_flops()), float(forward)


def calibration(path: Path = ROOT / "results" / "gpu_check.json") -> dict[str, Any]:
    """Sustained FLOP/s, start-up seconds and optimizer-step ms measured on the H200 by ``gpu_check.py``."""
    check = json.loads(path.read_text())
    auto = check["lightning"]["fits"]["auto (fused AdamW)"]
    model = {"d_model": 1024, "n_layers": 24, "n_heads": 16, "seq_len": auto["batch"][1]}
    step_flops, _ = flops(model, auto["batch"][0], vocab=50257, tie=False)
    step_s = auto["step_ms_median"] / 1e3
    row = next(r for r in check["step"]["rows"] if r["set"] == "GPT-2-124M")
    return {"flops_per_s": step_flops / step_s, "startup_s": auto["fit_seconds"] - auto["steps"] * step_s + 2.0,
            "opt_ms": {k: row[f"{k}_ms"] for k in ("adamw_foreach", "lordo", "lordo_lean")},
            "source": f"{path.name}: {check.get('device')}, commit {check['header']['commit'][:7]}, "
                      f"torch {check['header']['torch']}"}


def _bandwidth_worker(rank: int, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(16 * 2**20)  # 64 MiB
    dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(x)
    if rank == 0:
        queue.put(x.numel() * 4 * 3 / (time.perf_counter() - start))  # bus bandwidth: 2 (M-1)/M = 1 at M = 2
    dist.destroy_process_group()


def loopback_bandwidth() -> float:
    """Bytes per second of a 2-process gloo all-reduce over loopback on this machine (bus bandwidth)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_bandwidth_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    value = queue.get(timeout=120)
    for p in procs:
        p.join(30)
    return value


def projected_bytes(row: dict[str, Any], steps: int, sync_every: int, dry_sync_every: int) -> tuple[float, int]:
    """Payload bytes per worker over ``steps`` steps from a dry run's cumulative bytes per step; rounds."""
    b = row["step_bytes"]
    if row["method"] in PER_STEP:  # steady state after the first two steps (PowerSGD's uncompressed ones)
        return b[1] + (b[-1] - b[1]) / (len(b) - 2) * (steps - 2), steps
    per_sync = (b[-1] - b[0]) / (len(b) // dry_sync_every)  # after the first step (the initial bases)
    return b[0] + per_sync * steps / sync_every, steps // sync_every


def print_projection(cfg: dict[str, Any], sync_every: int, dry: dict[str, Any], rows: list[dict[str, Any]],
                     loopback_gbps: Optional[float] = None, budget_s: float = 480.0) -> dict[str, Any]:
    """Print the stage's projected wall time on one H200 per method, the total, and the steps that fit the budget."""
    calib = calibration()
    busbw = loopback_gbps * 1e9 if loopback_gbps else loopback_bandwidth()
    workers, steps = cfg["workers"], cfg["steps"]
    train_flops, val_flops = flops(cfg, cfg["batch_size"])
    throughput = calib["flops_per_s"]
    opt_scale = sum(1 for _ in _model(cfg).parameters()) / GPT2_SET_TENSORS
    validations = steps // cfg["val_every"]
    print(f"\nProjection of the {params(cfg) / 1e6:.2f} M stage on one H200, {workers} workers sharing it over gloo, "
          f"{steps} steps of {cfg['batch_size']} x {cfg['seq_len']} bytes per worker, K = {sync_every}:")
    tokens = cfg["batch_size"] * cfg["seq_len"]
    rule = (6 * params(cfg) + 12 * cfg["n_layers"] * cfg["seq_len"] * cfg["d_model"]) * tokens
    print(f"  measured: {train_flops / 1e12:.3f} TFLOP per worker step (FlopCounterMode; 6N + 12LTd would give "
          f"{rule / 1e12:.3f}), {val_flops / 1e12:.3f} TFLOP per validation batch; gloo loopback "
          f"{busbw / 1e9:.2f} GB/s "
          f"({'given' if loopback_gbps else 'measured on this machine'})")
    print(f"  from {calib['source']}: sustained {throughput / 1e12:.0f} TFLOP/s "
          f"({throughput / H200_BF16_DENSE:.1%} of the 989 TFLOP/s dense bf16 peak), start-up "
          f"{calib['startup_s']:.1f} s per run, optimizer step x {opt_scale:.2f} of the GPT-2-124M set's ms")
    print(f"  {'method':<18}{'compute s':>10}{'optim s':>9}{'valid s':>9}{'payload MB':>12}{'comm s':>8}"
          f"{'start s':>9}{'total s':>9}")
    fixed, per_step, projected = ORCHESTRATION_S, 0.0, {}
    for row in rows:
        if abs(row["lr"] - cfg["lr"]) > 1e-12:
            continue
        payload, rounds = projected_bytes(row, steps, sync_every, dry["sync_every"])
        wire = payload * (row["bytes_wire"] / row["bytes_payload"] if row["bytes_payload"] else 0.0)
        parts = {"compute": steps * workers * train_flops / throughput,
                 "optimizer": steps * workers * calib["opt_ms"][OPT_KIND.get(row["method"], "lordo")] * opt_scale
                 / 1e3,
                 "validation": validations * cfg["val_batches"] * val_flops / throughput,  # split over workers
                 "comm": wire / busbw + rounds * ALPHA}
        total = calib["startup_s"] + sum(parts.values())
        projected[row["method"]] = {**parts, "payload": payload, "total": total}
        fixed += calib["startup_s"]
        per_step += sum(parts.values()) / steps
        print(f"  {row['method']:<18}{parts['compute']:>10.1f}{parts['optimizer']:>9.1f}{parts['validation']:>9.1f}"
              f"{payload / 1e6:>12.1f}{parts['comm']:>8.1f}{calib['startup_s']:>9.1f}{total:>9.1f}")
    total = fixed + per_step * steps
    fit = max(0, int((budget_s - fixed) / per_step)) if per_step else 0
    print(f"  total: {total:.0f} s ({total / 60:.1f} min) for {len(projected)} methods and {ORCHESTRATION_S:.0f} s "
          f"of the script's own; the steps that fit "
          f"{budget_s / 60:.0f} min: {fit} ({fit // 128 * 128} as a multiple of 128; "
          f"{fit * cfg['batch_size'] * cfg['seq_len'] * workers / 1e6:.1f} M training bytes in all)")
    return {"methods": projected, "total_s": total, "steps_that_fit": fit}


def merge(run_dir: Path, workers: int, wall: float) -> dict[str, Any]:
    """One row from rank 0's ``run.json`` and every worker's ``rank<r>.json``."""
    run = json.loads((run_dir / "run.json").read_text())
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(workers)]
    optimizer = sum(v for k, v in run["optimizer_memory"].items() if not k.startswith("adamw_equivalent"))
    train_s = [r["train_seconds"] for r in ranks]
    comm_s = [r["comm_seconds"] for r in ranks]
    val_s = [r["val_seconds"] for r in ranks]
    final = run["curve"][-1]["val_loss"] if run["curve"] else float("nan")
    return {
        "final_val_loss": final, "final_val_ppl": math.exp(final), "curve": run["curve"],
        "bytes_payload": run["bytes_sent"], "bytes_wire": run["wire_bytes"],
        "bytes_by_purpose": run.get("bytes_by_purpose"), "step_bytes": ranks[0]["step_bytes"],
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in ranks], "memory_kind": ranks[0]["memory_kind"],
        "optimizer_state_bytes": optimizer, "optimizer_memory": run["optimizer_memory"],
        "sync_buffer_bytes": sum(run.get("sync_memory", {}).values()),
        "cpu_seconds": [r["cpu_seconds"] for r in ranks], "train_seconds": max(train_s),
        "comm_seconds": sum(comm_s) / workers, "val_seconds": sum(val_s) / workers,
        "compute_seconds": sum(t - c - v for t, c, v in zip(train_s, comm_s, val_s)) / workers,
        "replicas_identical": len({r["digest"] for r in ranks}) == 1,
        "replica_max_abs_diff": max(r["replica_max_abs_diff"] for r in ranks),
        "subspace_movement_mean": run.get("subspace_movement_mean"), "wall_seconds": wall,
        "device": ranks[0]["device_name"], "backend": ranks[0]["backend"],
        "lowrank_tensors": ranks[0]["lowrank_tensors"],
    }


def best(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each method's run with the lowest final validation loss, with the LRs measured for it."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        m = row["method"]
        lrs = sorted({*out.get(m, {}).get("lrs", []), row["lr"]})
        if m not in out or row["final_val_loss"] < out[m]["final_val_loss"]:
            out[m] = dict(row)
        out[m]["lrs"] = lrs
    return out


def memory(row: dict[str, Any]) -> float:
    """The claim's memory: peak GPU memory per worker on the GPU; on the CPU the counted optimizer state (moments,
    bases, error feedback), since a CPU process's peak RSS is mostly the interpreter's."""
    return max(row["peak_memory_bytes"]) if row["memory_kind"] == "cuda_max_allocated" \
        else row["optimizer_state_bytes"]


def claims(runs: dict[str, dict[str, Any]]) -> list[tuple[str, str, Optional[bool]]]:
    """(claim, the measured figures, holds) for the paper's four claims; holds is None where a run is missing."""
    def ppl(m: str) -> float:
        return runs[m]["final_val_ppl"]

    out: list[tuple[str, str, Optional[bool]]] = []
    needs = (("lordo", "lowrank_ddp"), ("lordo", "lordo_local"), ("lordo", "lordo_noqhm"), ("lordo_small_rank", "ddp"))
    for claim, (a, b) in zip(CLAIMS, needs):
        if a not in runs or b not in runs:
            out.append((claim, f"not measured ({a} or {b} missing)", None))
            continue
        gap = ppl(a) / ppl(b) - 1
        if claim.startswith("1"):
            ratio = runs[b]["bytes_payload"] / max(1.0, runs[a]["bytes_payload"])
            out.append((claim, f"ppl {ppl(a):.3f} vs {ppl(b):.3f} ({gap:+.1%}), {ratio:.1f}x fewer bytes",
                        gap <= 0.01 and ratio >= 8))
        elif claim.startswith("2"):
            out.append((claim, f"ppl {ppl(a):.3f} vs local {ppl(b):.3f} ({gap:+.1%})", gap < -0.01))
        elif claim.startswith("3"):
            moved = runs[b].get("subspace_movement_mean")
            out.append((claim, f"omega=1 ppl {ppl(b):.3f} vs {ppl(a):.3f} ({-gap / (1 + gap):+.1%}); basis movement "
                        f"per sync {moved if moved is None else f'{moved:.3g}'}", ppl(b) > 1.05 * ppl(a)))
        else:
            ma, mb = memory(runs[a]), memory(runs[b])
            kind = "peak GPU" if runs[a]["memory_kind"] == "cuda_max_allocated" else "optimizer state"
            out.append((claim, f"{kind} {ma / 1e6:.2f} vs DDP {mb / 1e6:.2f} MB, ppl {gap:+.1%} vs DDP",
                        ma < mb and gap <= 0.01))
    return out


def print_summary(rows: list[dict[str, Any]], label: str, methods: list[str]) -> None:
    """The summary table (each method at its best measured LR) and the four claims: printed last."""
    runs = best(rows)
    if not runs:
        print("summary: no finished run")
        return
    ddp = runs.get("ddp")
    first = next(iter(runs.values()))
    print(f"\nSummary, stage {label} ({first['device']}, {first['backend']}, {first['spec']['workers']} workers, "
          f"{first['spec']['steps']} steps, K = {first['spec']['sync_every']}); each method at its best measured LR:")
    head = (f"  {'method':<18}{'LRs':>16}{'val loss':>9}{'ppl':>8}{'vs DDP':>8}{'payload MB':>11}{'wire MB':>9}"
            f"{'/DDP':>7}{'peak MB':>9}{'opt MB':>8}{'compute s':>10}{'comm s':>8}  replicas")
    print(head)
    for m in [m for m in methods if m in runs] + [m for m in runs if m not in methods]:
        r = runs[m]
        lrs = ",".join(f"{lr:.2g}" + ("*" if lr == r["lr"] else "") for lr in r["lrs"])
        vs = f"{r['final_val_ppl'] / ddp['final_val_ppl'] - 1:+.1%}" if ddp else "-"
        ratio = f"{r['bytes_payload'] / ddp['bytes_payload']:.3f}" if ddp and ddp["bytes_payload"] else "-"
        agree = "identical" if r["replicas_identical"] else f"max diff {r['replica_max_abs_diff']:.2g}"
        print(f"  {m:<18}{lrs:>16}{r['final_val_loss']:>9.4f}{r['final_val_ppl']:>8.3f}{vs:>8}"
              f"{r['bytes_payload'] / 1e6:>11.2f}{r['bytes_wire'] / 1e6:>9.2f}{ratio:>7}"
              f"{max(r['peak_memory_bytes']) / 1e6:>9.1f}{r['optimizer_state_bytes'] / 1e6:>8.2f}"
              f"{r['compute_seconds']:>10.1f}{r['comm_seconds']:>8.1f}  {agree}")
    print("  (LRs: those measured, * the best; peak MB: " + ("GPU max allocated" if first["memory_kind"] ==
          "cuda_max_allocated" else "peak RSS of the CPU process") + " per worker; bytes per worker)")
    note = "" if label == "16m-gpu" else " (at 16 M: not measured until the GPU run)"
    if label.endswith("-dryrun"):
        note += f"; a dry run of {first['spec']['steps']} steps checks the plumbing, it is no evidence"
    print(f"\nThe paper's claims, stage {label}{note}")
    for claim, figures, holds in claims(runs):
        verdict = {True: "holds", False: "does not hold", None: "not measured"}[holds]
        print(f"  claim {claim}: {figures} -> {verdict}")


def figures(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Loss against steps, loss against bytes per worker (payload, wire), memory per method: PNGs beside ``out``."""
    runs = best(rows)
    stem = out.with_suffix("")
    paths = [Path(f"{stem}-loss-steps.png"), Path(f"{stem}-loss-bytes.png"), Path(f"{stem}-memory.png")]
    fig, axes = panels(1)
    for m, r in runs.items():
        axes[0].plot([p["step"] for p in r["curve"]], [p["val_loss"] for p in r["curve"]], marker=".", label=m)
    finish_panels(fig, axes, "optimizer step", "validation loss (nats/byte)", [f"{out.stem}: held-out loss"], paths[0])
    fig, axes = panels(2)
    for m, r in runs.items():
        for ax, key in zip(axes, ("bytes", "wire_bytes")):
            ax.plot([max(1.0, p[key]) for p in r["curve"]], [p["val_loss"] for p in r["curve"]], marker=".", label=m)
    for ax in axes:
        ax.set_xscale("log")
    finish_panels(fig, axes, "bytes per worker", "validation loss (nats/byte)", ["payload", "wire"], paths[1])
    fig, axes = panels(2)
    names = list(runs)
    axes[0].bar(names, [max(runs[m]["peak_memory_bytes"]) / 1e6 for m in names], label="peak per worker")
    axes[1].bar(names, [runs[m]["optimizer_state_bytes"] / 1e6 for m in names], label="optimizer state")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=60)
    kind = "GPU max allocated" if rows[0]["memory_kind"] == "cuda_max_allocated" else "CPU peak RSS"
    finish_panels(fig, axes, "method", "MB", [f"peak memory per worker ({kind})", "counted optimizer state"],
                  paths[2])
    import matplotlib.pyplot as plt

    plt.close("all")
    return paths
