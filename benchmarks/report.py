"""Tables and figures from the committed results (no training): ``python benchmarks/report.py``.

Prints rich tables, writes ``benchmarks/results/summary.md`` (the tables as Markdown, used by README.md) and
PNG figures under ``benchmarks/results/``: validation loss vs step, validation loss vs cumulative bytes sent
(log axis), and bytes / memory bars. The wall-clock model uses SPEC §8's ring all-reduce time with M = 4.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from typing import Any, Optional

from harness import METHODS, ROOT, load
from quality import PAYLOAD_STEPS, PAYLOAD_TOLERANCE, within
from rich.console import Console
from rich.table import Table

from lightning_lordo.comm.communicator import ring_allreduce_seconds

RESULTS = ROOT / "results"
NAMES = {"ddp": "DDP (AdamW)", "lowrank_ddp": "low-rank DDP", "diloco": "DiLoCo", "lordo_noqhm": "LoRDO w/o QHM",
         "lordo_local": "LoRDO-Local", "lordo": "LoRDO"}
LINKS = {"1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8, "100 Gbit/s": 100e9 / 8}
LATENCY = 50e-6  # seconds per ring hop (alpha)


def _runs(part: str) -> list[dict[str, Any]]:
    return [r for r in load(RESULTS / f"{part}.jsonl") if "spec" in r]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def main_table(part: str) -> list[list[str]]:
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in _runs(part):
        by_method[r["spec"]["method"]].append(r)
    rows = []
    ref = by_method.get("lowrank_ddp")
    ref_ppl = statistics.fmean(math.exp(r["final_val_loss"]) for r in ref) if ref else float("nan")
    ddp_bytes = statistics.fmean(r["bytes_sent"] for r in by_method["ddp"]) if "ddp" in by_method else float("nan")
    for method in METHODS:
        runs = by_method.get(method)
        if not runs:
            continue
        loss, loss_sd = _mean_std([r["final_val_loss"] for r in runs])
        ppl, ppl_sd = _mean_std([math.exp(r["final_val_loss"]) for r in runs])
        sent = statistics.fmean(r["bytes_sent"] for r in runs)
        memory = runs[0]["optimizer_memory"]
        state = memory.get("adamw_state", sum(memory.get(k, 0) for k in ("lowrank_moments", "bases",
                                                                          "fullrank_moments", "other")))
        moves = [r.get("subspace_movement_mean") for r in runs if r.get("subspace_movement_mean") is not None]
        rows.append([NAMES[method], f"{runs[0]['spec']['lr']:g}", str(len(runs)), f"{loss:.4f} ± {loss_sd:.4f}",
                     f"{ppl:.3f} ± {ppl_sd:.3f}", f"{100 * (ppl / ref_ppl - 1):+.1f} %", _mb(sent),
                     f"{ddp_bytes / sent:.1f}x", _mb(state), _mb(memory.get("error_feedback", 0)),
                     _mb(sum(runs[0].get("sync_memory", {}).values())),
                     f"{statistics.fmean(moves):.4f}" if moves else "-"])
    return rows


MAIN_COLUMNS = ["method", "lr", "seeds", "val loss (nats/byte)", "val ppl", "ppl vs low-rank DDP",
                "sent / worker", "DDP bytes / this", "optimizer state", "error feedback", "sync buffers",
                "subspace movement / sync"]


def ablation_rows() -> list[list[str]]:
    rows = []
    for r in _runs("ablations"):
        spec = r["spec"]
        change = {k: v for k, v in spec["knobs"].items()}
        for key, default in (("rank", 8), ("sync_every", 16), ("batch_size", 8)):
            if spec[key] != default:
                change[key] = spec[key]
        label = spec["method"] + (" " + ", ".join(f"{k}={v}" for k, v in change.items()) if change else "")
        memory = r["optimizer_memory"]
        rows.append([label, f"{r['final_val_loss']:.4f}", _mb(r["bytes_sent"]),
                     _mb(memory.get("error_feedback", 0)), f"{r.get('subspace_movement_mean') or 0:.4f}",
                     f"{r.get('diagnostics', {}).get('term_ratio', float('nan')):.2f}"])
    return rows


ABLATION_COLUMNS = ["variant (LoRDO unless named)", "val loss", "sent / worker", "EF buffers", "movement",
                    "term ratio"]


PAYLOAD_COLUMNS = ["payload", "dtype", "steps", "seeds", "val loss", "vs full, same steps",
                   "seeds within 1 % of full (same seed and steps)", "pseudo-gradient bytes", "full / this",
                   "all bytes / worker", "full / this (all)"]
Groups = dict[tuple[str, str, int], dict[int, dict[str, Any]]]  # (payload, dtype, steps) -> seed -> run


def _payload_groups() -> Groups:
    """The payload runs by (payload, dtype, steps), then by seed; only runs with the LR and corpus of the
    reference (full/float32 at 640 steps in the ``payload`` part), so a rerun at another LR cannot mix in."""
    runs = _runs("payload") + _runs("payload-budget")
    reference = [r for r in _runs("payload") if r["spec"]["knobs"] == {"payload": "full", "payload_dtype": "float32"}
                 and r["spec"]["steps"] == PAYLOAD_STEPS]
    if not reference:
        raise SystemExit("payload.jsonl has no full/float32 run at 640 steps: run the payload part first")
    lr, data = reference[0]["spec"]["lr"], reference[0]["spec"]["data"]
    groups: Groups = defaultdict(dict)
    for r in runs:
        spec = r["spec"]
        if (spec["lr"], spec["data"]) == (lr, data):
            groups[(spec["knobs"]["payload"], spec["knobs"]["payload_dtype"], spec["steps"])][spec["seed"]] = r
    return dict(groups)


def _mean(runs: dict[int, dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs.values())


def _mean_bytes(runs: dict[int, dict[str, Any]], purpose: str) -> float:
    return statistics.fmean(r["bytes_by_purpose"].get(purpose, 0) for r in runs.values())


def payload_rows() -> list[list[str]]:
    """Every payload and step budget (mean ± std over seeds) against full/float32 at the same steps: loss,
    pseudo-gradient bytes and all bytes (everything counted)."""
    groups = _payload_groups()
    rows = []
    for (payload, dtype, steps), runs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        loss, loss_sd = _mean_std([r["final_val_loss"] for r in runs.values()])
        full = groups.get(("full", "float32", steps), {})
        paired = [s for s in runs if s in full]
        vs_full, seeds_within, pg_ratio, all_ratio = "-", "-", "-", "-"
        if paired:
            vs_full = f"{100 * (loss / _mean(full, 'final_val_loss') - 1):+.2f} %"
            ok = sum(runs[s]["final_val_loss"] <= (1 + PAYLOAD_TOLERANCE) * full[s]["final_val_loss"] for s in paired)
            seeds_within = f"{ok} of {len(paired)}"
            pg_ratio = f"{_mean_bytes(full, 'pseudo_gradients') / _mean_bytes(runs, 'pseudo_gradients'):.1f}x"
            all_ratio = f"{_mean(full, 'bytes_sent') / _mean(runs, 'bytes_sent'):.2f}x"
        rows.append([payload, dtype, str(steps), str(len(runs)), f"{loss:.4f} ± {loss_sd:.4f}", vs_full, seeds_within,
                     _mb(_mean_bytes(runs, "pseudo_gradients")), pg_ratio, _mb(_mean(runs, "bytes_sent")), all_ratio])
    return rows


ISO_COLUMNS = ["payload", "dtype", "fewest steps: every seed within 1 % of full", "steps vs full", "val loss there",
               "all bytes / worker", "full / this (all)", ">= 4x fewer bytes", "fewest steps: every seed at or below "
               "full", "full / this (all) there"]


def _fewest_steps(groups: Groups, payload: str, dtype: str, tolerance: float) -> Optional[int]:
    """The fewest measured steps at which every seed of full/float32 at 640 steps was run for this payload and
    reached a loss within ``tolerance`` of full's on the same seed."""
    base = _losses(groups[("full", "float32", PAYLOAD_STEPS)])
    for steps in sorted(s for p, d, s in groups if (p, d) == (payload, dtype)):
        if within(_losses(groups[(payload, dtype, steps)]), base, tolerance):
            return steps
    return None


def _losses(runs: dict[int, dict[str, Any]]) -> dict[int, float]:
    return {seed: r["final_val_loss"] for seed, r in runs.items()}


def payload_iso_loss() -> tuple[list[str], list[list[str]]]:
    """Bytes at equal validation loss, the issue's target: the fewest measured steps (640, then the budgets) at
    which *every* seed's loss is within 1 % of full/float32's at 640 steps on the same seed, and the bytes there
    (everything counted) against full's at 640 steps; then the same without the 1 % tolerance."""
    groups = _payload_groups()
    base_all = _mean(groups[("full", "float32", PAYLOAD_STEPS)], "bytes_sent")
    rows = []
    for payload, dtype in sorted({(p, d) for p, d, _ in groups} - {("full", "float32")}):
        row = [payload, dtype]
        missed = f"not within {max(s for p, d, s in groups if (p, d) == (payload, dtype))}"
        steps = _fewest_steps(groups, payload, dtype, PAYLOAD_TOLERANCE)
        if steps is None:
            row += [missed, "-", "-", "-", "-", "-"]
        else:
            runs = groups[(payload, dtype, steps)]
            ratio = base_all / _mean(runs, "bytes_sent")
            row += [str(steps), f"{steps / PAYLOAD_STEPS:.2f}x", f"{_mean(runs, 'final_val_loss'):.4f}",
                    _mb(_mean(runs, "bytes_sent")), f"{ratio:.2f}x", "yes" if ratio >= 4 else "no"]
        strict = _fewest_steps(groups, payload, dtype, 0.0)
        if strict is None:
            row += [missed, "-"]
        else:
            row += [str(strict), f"{base_all / _mean(groups[(payload, dtype, strict)], 'bytes_sent'):.2f}x"]
        rows.append(row)
    return ISO_COLUMNS, rows


def time_to_target(part: str = "main") -> list[list[str]]:
    """Modelled wall time to reach the worst method's final loss: measured compute + ring all-reduce time."""
    runs = [r for r in _runs(part) if r["spec"]["seed"] == 0]
    if not runs:
        return []
    target = max(r["final_val_loss"] for r in runs if r["spec"]["method"] in ("ddp", "lowrank_ddp", "lordo"))
    rows = []
    for r in runs:
        spec = r["spec"]
        compute_per_step = r["wall_seconds"] / spec["steps"]
        reached = next((p for p in r["curve"] if p["val_loss"] <= target), None)
        row = [NAMES[spec["method"]], f"{target:.3f}", str(reached["step"]) if reached else "not reached"]
        for bandwidth in LINKS.values():
            if reached is None:
                row.append("-")
                continue
            collectives = reached["step"] if spec["method"] in ("ddp", "lowrank_ddp") else reached["step"] // \
                spec["sync_every"]
            comm = ring_allreduce_seconds(reached["bytes"], spec["workers"], bandwidth, 0.0) + \
                collectives * ring_allreduce_seconds(0, spec["workers"], bandwidth, LATENCY)
            row.append(f"{reached['step'] * compute_per_step + comm:.0f} s")
        rows.append(row)
    return rows


def _markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def figures(part: str = "main") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in _runs(part) if r["spec"]["seed"] == 0]
    if not runs:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        steps = [p["step"] for p in r["curve"]]
        losses = [p["val_loss"] for p in r["curve"]]
        name = NAMES[r["spec"]["method"]]
        ax1.plot(steps, losses, marker="o", markersize=3, label=name)
        ax2.plot([p["bytes"] for p in r["curve"]], losses, marker="o", markersize=3, label=name)
    ax1.set(xlabel="optimizer step", ylabel="validation loss (nats/byte)", title="Validation loss vs step")
    ax2.set(xscale="log", xlabel="bytes sent per worker (log)", ylabel="validation loss (nats/byte)",
            title="Validation loss vs communication")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{part}_loss.png", dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    names = [NAMES[r["spec"]["method"]] for r in runs]
    ax1.barh(names, [r["bytes_sent"] / 1e6 for r in runs])
    ax1.set(xscale="log", xlabel="MB sent per worker (log)", title="Communication")
    states = [r["optimizer_memory"].get("adamw_state", sum(r["optimizer_memory"].get(k, 0) for k in (
        "lowrank_moments", "bases", "fullrank_moments", "other"))) / 1e6 for r in runs]
    ax2.barh(names, states)
    ax2.set(xlabel="optimizer state per worker (MB)", title="Optimizer memory")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{part}_bytes_memory.png", dpi=110)
    plt.close(fig)


def payload_figure() -> None:
    """Mean validation loss vs mean bytes per worker (all counted) for every payload, one point per step budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _payload_groups()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for payload, dtype in sorted({(p, d) for p, d, _ in groups}):
        budgets = sorted(steps for p, d, steps in groups if (p, d) == (payload, dtype))
        sent = [_mean(groups[(payload, dtype, s)], "bytes_sent") / 1e6 for s in budgets]
        loss = [_mean(groups[(payload, dtype, s)], "final_val_loss") for s in budgets]
        ax.plot(sent, loss, marker="o", label=f"{payload} / {dtype}")
        for x, y, steps in zip(sent, loss, budgets):
            ax.annotate(str(steps), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(_mean(groups[("full", "float32", PAYLOAD_STEPS)], "final_val_loss"), color="grey", linestyle="--",
               linewidth=1, label="full float32, 640 steps")
    ax.set(xscale="log", xlabel="MB sent per worker, everything counted (log)",
           ylabel="validation loss (mean of seeds)", title="Payloads: loss vs bytes (labels: steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "payload_loss_bytes.png", dpi=110)
    plt.close(fig)


def main() -> int:
    console = Console(width=160)
    sections = []

    def section(title: str, columns: list[str], rows: list[list[str]]) -> None:
        """One table, printed with rich and kept as Markdown for summary.md."""
        if not rows:
            return
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        sections.append(f"### {title}\n\n{_markdown(columns, rows)}")

    for part, title in (("main", "Main comparison (tinyshakespeare)"), ("long", "Longer runs (4x steps)"),
                        ("wikitext", "WikiText-2 (validation split as corpus)"), ("quick", "Quick mode")):
        section(title, MAIN_COLUMNS, main_table(part) if _runs(part) else [])
    section("Ablations", ABLATION_COLUMNS, ablation_rows() if _runs("ablations") else [])
    if _runs("payload"):
        section("Payloads (LoRDO, K = 16, rank 8; against full/float32 at the same steps)", PAYLOAD_COLUMNS,
                payload_rows())
        section("Payloads at equal validation loss (against full/float32 at 640 steps, seed by seed)",
                *payload_iso_loss())
        payload_figure()
    section("Modelled time to target (M = 4, ring all-reduce, 50 µs per hop)",
            ["method", "target loss", "step reached", *(f"time at {k}" for k in LINKS)], time_to_target())
    figures("main")
    figures("long")
    (RESULTS / "summary.md").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
