"""Tables and targets of ``benchmarks/compressed.py`` from its committed results (no training):
``python benchmarks/report_compressed.py``.

Writes ``results/compressed.md`` (used by README.md) and ``results/compressed_frontier.png`` (validation loss against
bytes per worker, both models). Means are over the seeds that ran; a method with fewer than 2 seeds says so.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import compressed
from harness import ROOT, done, finish_panels, load, panels

NAMES = {"full": "LoRDO, `full` payload", "lowrank": "LoRDO, `lowrank`", "lowrank_int8": "LoRDO, `lowrank` + int8",
         "lordo_compressed": "`lordo_compressed`", "ddp": "DDP (AdamW)", "powersgd4": "DDP + PowerSGD r4",
         "powersgd16": "DDP + PowerSGD r16", "fp16": "DDP + fp16 hook"}


def _runs(stage: str) -> list[dict[str, Any]]:
    return [r for r in load(compressed.RESULTS) if r.get("stage") == stage and "spec" in r]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g}"


def table_lr() -> list[str]:
    rows = ["| model | family | lr | val loss |", "|---|---|---|---|"]
    for r in _runs("lr"):
        rows.append(f"| {r['model']} | {r['name']} | {r['spec']['lr']:g} | {r['final_val_loss']:.4f} |")
    return rows


def table_choose() -> list[str]:
    rows = ["| model | candidate | val loss | MB per worker | by category (MB) |", "|---|---|---|---|---|"]
    for r in _runs("choose"):
        parts = ", ".join(f"{k} {_mb(v)}" for k, v in sorted(r.get("bytes_by_category", {}).items()))
        rows.append(f"| {r['model']} | {r['name']} | {r['final_val_loss']:.4f} | {_mb(r['bytes_sent'])} | {parts} |")
    return rows


def main_means() -> dict[str, dict[str, dict[str, Any]]]:
    """Per model and method: mean loss, payload and wire bytes, bytes with everything, the seeds."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    records = [r for r in load(compressed.RESULTS) if "spec" in r]
    paths = {r["model"]: r["spec"]["data"] for r in records}
    try:
        specs = compressed.specs_for("main", paths)
    except SystemExit:  # the lr stage has not finished
        return {}
    for model, name, spec in specs:  # a run of another stage with the same spec counts (the main stage skipped it)
        record = done(records, spec)
        if record is not None:
            grouped[(model, name)].append(record)
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (model, name), runs in grouped.items():
        out[model][name] = {
            "loss": _mean([r["final_val_loss"] for r in runs]),
            "losses": [r["final_val_loss"] for r in runs],
            "bytes": _mean([r["bytes_sent"] for r in runs]),
            "wire": _mean([r["wire_bytes"] for r in runs]),
            "everything": _mean([r["bytes_everything"] for r in runs]),
            "seeds": sorted(r["spec"]["seed"] for r in runs),
            "categories": {k: _mean([r.get("bytes_by_category", {}).get(k, 0) for r in runs])
                           for k in {k for r in runs for k in r.get("bytes_by_category", {})}},
        }
    return out


def table_main(means: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    rows = []
    for model, methods in means.items():
        ddp = methods.get("ddp", {}).get("bytes")
        rows += [f"**{model}** model", "",
                 "| method | seeds | val loss (mean) | MB per worker (payload) | MB (wire) | DDP / this (payload) |",
                 "|---|---|---|---|---|---|"]
        for name in NAMES:
            if name not in methods:
                continue
            m = methods[name]
            ratio = f"{ddp / m['bytes']:.0f}x" if ddp else "n/a"
            rows.append(f"| {NAMES[name]} | {len(m['seeds'])} | {m['loss']:.4f} | {_mb(m['bytes'])} | "
                        f"{_mb(m['wire'])} | {ratio} |")
        rows.append("")
    return rows


def targets(means: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The issue's targets for the two most compressed configurations, each model (means over seeds)."""
    rows = []
    for model, methods in means.items():
        psgd, full, ddp = (methods.get(n) for n in ("powersgd4", "full", "ddp"))
        for name in ("lordo_compressed", "lowrank_int8"):
            best = methods.get(name)
            if not (best and psgd and full and ddp):
                rows.append(f"- {model}, {NAMES[name]}: incomplete (methods so far: {sorted(methods)})")
                continue
            fewer = best["bytes"] < psgd["bytes"] and best["wire"] < psgd["wire"]
            better = best["loss"] <= psgd["loss"]
            ratio = ddp["bytes"] / best["everything"]
            gap = 100 * (best["loss"] / full["loss"] - 1)
            rows.append(f"- {model}, {NAMES[name]}: {_mb(best['bytes'])} MB (wire {_mb(best['wire'])}) at "
                        f"{best['loss']:.4f} vs PowerSGD r4 {_mb(psgd['bytes'])} MB (wire {_mb(psgd['wire'])}) at "
                        f"{psgd['loss']:.4f}: fewer bytes {'holds' if fewer else 'missed'}, equal or lower loss "
                        f"{'holds' if better else 'missed'} ({100 * (best['loss'] / psgd['loss'] - 1):+.2f} %). "
                        f"Everything counted, DDP / this = {ratio:.0f}x ({'holds' if ratio >= 100 else 'missed'} "
                        f">= 100x); loss {gap:+.2f} % against the `full` payload "
                        f"({'holds' if gap <= 1 else 'missed'} <= 1 %).")
    return rows


def figure(means: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    fig, axes = panels(len(means))
    for ax, methods in zip(axes, means.values()):
        for name, m in methods.items():
            ax.scatter(m["bytes"], m["loss"], label=NAMES.get(name, name),
                       marker="o" if name in compressed.PAYLOADS else "s")
        ax.set_xscale("log")
    finish_panels(fig, axes, "MB per worker (payload)", "validation loss (mean over seeds)",
                  [f"{model} model, 4 workers, K = 32" for model in means], path)


def table_candidate() -> list[str]:
    """The payloads with the authors'-protocol candidate default (``compressed.CANDIDATE_PAYLOADS``), beside the
    main table's same payloads with the lean knobs at the same seeds."""
    rows = ["| model | payload | lr | seed | val loss | lean knobs, their LR | MB per worker |",
            "|---|---|---|---|---|---|---|"]
    records = load(compressed.RESULTS)
    for r in _runs("candidate"):
        payload = r["name"].removeprefix("candidate_")
        twin = compressed.spec(r["model"], r["spec"]["data"], payload, compressed.best_lr(r["model"], "lordo"),
                               r["spec"]["seed"])
        found = done(records, twin)  # at LoRDO's LR, whichever stage ran it
        other = found["final_val_loss"] if found else None
        rows.append(f"| {r['model']} | {payload} | {r['spec']['lr']:g} | {r['spec']['seed']} | "
                    f"{r['final_val_loss']:.4f} | {'' if other is None else f'{other:.4f}'} | {_mb(r['bytes_sent'])} |")
    return rows


def table_frequent(means: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """``--stage frequent`` and ``frequent_seeds`` (K = 8, and 4): each payload's mean over seeds, and the targets
    against PowerSGD rank 4 over all its seeds, DDP (the main table's: K does not change it) and the ``full`` payload
    at the same K (the same steps)."""
    records = load(compressed.RESULTS)
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in [r for stage in ("frequent", "frequent_seeds", "window", "k3", "embedding_moments",
                                                 "compressed_k8") for r in _runs(stage)]:
        if ":sync_every=" in r["name"]:  # PowerSGD's extra seeds are counted with its others below
            grouped[(r["model"], r["name"])].append(r)
    psgd: dict[str, list[dict[str, Any]]] = {}
    for model in {m for m, _ in grouped}:
        data = next(r["spec"]["data"] for (m, _), rs in grouped.items() if m == model for r in rs)
        found = [done(records, compressed.spec(model, data, "powersgd4", compressed.best_lr(model, "ddp"), seed))
                 for seed in (0, 1, *compressed.MORE_SEEDS)]
        psgd[model] = [r for r in found if r is not None]
    rows = ["| model | payload | K | seeds | val loss (mean) | MB per worker (payload) | MB (wire) | DDP / this "
            "(everything) |", "|---|---|---|---|---|---|---|---|"]
    result: dict[tuple[str, str], dict[str, float]] = {}
    for (model, label), runs in sorted(grouped.items()):
        name, k = label.split(":sync_every=")
        k = k.replace(",basis_every=", ", basis every ")
        k = k.replace(",fullrank_moments_every=", ", full-rank moments every ")
        m = {k_: _mean([r[f] for r in runs]) for k_, f in (("loss", "final_val_loss"), ("bytes", "bytes_sent"),
                                                           ("wire", "wire_bytes"), ("everything", "bytes_everything"))}
        m["seeds"] = len(runs)
        result[(model, label)] = m
        ddp = means.get(model, {}).get("ddp", {}).get("bytes")
        ratio = f"{ddp / m['everything']:.0f}x" if ddp else "n/a"
        rows.append(f"| {model} | {NAMES[name]} | {k} | {len(runs)} | {m['loss']:.4f} | {_mb(m['bytes'])} | "
                    f"{_mb(m['wire'])} | {ratio} |")
    for model, runs in psgd.items():
        rows.append(f"| {model} | {NAMES['powersgd4']} | every step | {len(runs)} | "
                    f"{_mean([r['final_val_loss'] for r in runs]):.4f} | {_mb(_mean([r['bytes_sent'] for r in runs]))} "
                    f"| {_mb(_mean([r['wire_bytes'] for r in runs]))} | |")
    rows.append("")
    for (model, label), m in sorted(result.items()):
        name, k = label.split(":sync_every=")
        k = k.split(",")[0]  # basis_every does not change the `full` payload's steps
        full, ddp = result.get((model, f"full:sync_every={k}")), means.get(model, {}).get("ddp")
        peer = psgd.get(model)
        if name == "full" or not (peer and ddp):
            continue
        p_loss, p_bytes, p_wire = (_mean([r[f] for r in peer]) for f in ("final_val_loss", "bytes_sent", "wire_bytes"))
        fewer = m["bytes"] < p_bytes and m["wire"] < p_wire
        ratio = ddp["bytes"] / m["everything"]
        versus_full = "" if full is None else (
            f"; loss {100 * (m['loss'] / full['loss'] - 1):+.2f} % against `full` at K = {k} "
            f"({'holds' if m['loss'] <= 1.01 * full['loss'] else 'missed'} <= 1 %)")
        rows.append(f"- {model}, {NAMES[name]} ({label.split(':', 1)[1]}; {m['seeds']} seeds): {_mb(m['bytes'])} MB "
                    f"(wire {_mb(m['wire'])}) at {m['loss']:.4f} vs PowerSGD r4 ({len(peer)} seeds) {_mb(p_bytes)} "
                    f"MB at {p_loss:.4f}: fewer bytes {'holds' if fewer else 'missed'}, equal or lower loss "
                    f"{'holds' if m['loss'] <= p_loss else 'missed'} ({100 * (m['loss'] / p_loss - 1):+.2f} %); "
                    f"DDP / this = {ratio:.0f}x ({'holds' if ratio >= 100 else 'missed'} >= 100x){versus_full}.")
    return rows


def main() -> int:
    means = main_means()
    lines = ["### Learning rates (seed 0)", "", *table_lr(), "", "### Candidates for `lordo_compressed` (seed 0)", "",
             *table_choose(), "", "### Main table (mean over seeds)", "", *table_main(means), "### Targets", "",
             *targets(means), "", "### The payloads with the new defaults (`compressed.py --stage candidate`)", "",
             *table_candidate(), "", "### Syncing more often (`compressed.py --stage frequent`, "
             "`frequent_seeds`, `window`, `k3`)", "", *table_frequent(means), ""]
    out = ROOT / "results" / "compressed.md"
    out.write_text("\n".join(lines))
    if means:
        figure(means, ROOT / "results" / "compressed_frontier.png")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
