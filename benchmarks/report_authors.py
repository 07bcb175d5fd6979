"""Tables, targets and the loss-vs-bytes frontier of the authors' protocol (``benchmarks/authors.py``), from its
committed results (no training): ``python benchmarks/report_authors.py``.

Writes ``results/authors.md`` (used by README.md) and ``results/authors_frontier.png``. Only what ran is reported:
a method without a result, or with fewer seeds than asked, says so. A record repeated by a resumed run counts once.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import authors
from harness import ROOT, load, ranked

NAMES = {"ddp": "DDP (AdamW)", "ddp_qh": "DDP, authors' QH + beta switch", "lowrank_ddp": "low-rank DDP (authors')",
         "lordo_local": "LoRDO-Local (authors')", "lordo_noqhm": "LoRDO-Global w/o QHM",
         "lordo_defaults": "LoRDO, earlier defaults (lordo_lean)", "lordo_authors": "LoRDO, authors' choices",
         "lordo_authors_colrms": "LoRDO, authors' choices with col_rms",
         "lordo_authors_colrms_power": "LoRDO, authors' with col_rms and a power step",
         "lordo_candidate": "LoRDO, new defaults", "lordo_candidate_bf16": "new defaults, bfloat16 EF and payload",
         "lordo_candidate_compressed": "new defaults, everything compressed",
         "diloco": "DiLoCo", "powersgd4": "DDP + PowerSGD r4", "powersgd16": "DDP + PowerSGD r16",
         "fp16": "DDP + fp16 hook"}


def unique(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (name, spec): a resumed stage may have written a run twice (same spec, same figures)."""
    seen, out = set(), []
    for r in records:
        key = (r["name"], repr(sorted(r["spec"].items())))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def main_runs(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each method's runs at its best LR (every seed), in the protocol's main shape (no ablation or claim)."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    base = authors.warmup_lr()
    for name in authors.METHODS:
        try:
            lr = base * authors.best_scale(name)
        except SystemExit:
            continue
        reference = authors.continuation(name, "", lr)
        for r in records:
            spec = r["spec"]
            if r["name"] in (name, authors.SAME_RUN.get(name)) and r.get("stage") not in authors.REBUILT_STAGES \
                    and math.isclose(spec["lr"], lr) \
                    and spec["steps"] == reference.steps \
                    and spec["rank"] == reference.rank and spec["batch_size"] == reference.batch_size:
                out[name].append(r)
    return out


def _mean(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} +- {statistics.stdev(values):.4f}"


def report(path: Path) -> str:
    authors.RESULTS = path
    records = unique([r for r in load(path) if "spec" in r])
    headers = [r["header"] for r in load(path) if "header" in r]
    lines = ["## The authors' protocol (tinyshakespeare, 0.84 M-parameter byte GPT, M = 4, K = 32, rank 16)", "",
             f"Made by `python benchmarks/authors.py --data ../shared/data/tinyshakespeare.txt` at commits "
             f"{', '.join(sorted({h['commit'][:7] for h in headers}))}; torch {headers[-1]['torch']}, lightning "
             f"{headers[-1]['lightning']}, {headers[-1]['machine']}. Tables: `python benchmarks/report_authors.py`.",
             ""]
    wall = defaultdict(float)
    for r in records:
        wall[r["stage"]] += r["wall_seconds"]
    lines += ["Time per stage (sum of run wall times): " + ", ".join(f"{s} {wall[s] / 3600:.1f} h"
                                                                    for s in authors.STAGES if s in wall), ""]
    lines += ["### LR sweep (seed 0, final validation loss; LR = scale x the warm-up LR)", "",
              "| method | " + " | ".join(f"x{s:g}" for s in (0.25, 0.5, 1, 2, 4)) + " |", "|---" * 6 + "|"]
    for name in authors.SWEPT:
        losses = authors.scale_losses(name)
        best = min(losses, key=lambda k: ranked(losses[k])) if losses else None
        cells = [("**" if s == best else "") + f"{losses[s]:.4f}" + ("**" if s == best else "") if s in losses
                 else "" for s in (0.25, 0.5, 1, 2, 4)]
        lines.append(f"| {NAMES[name]} | " + " | ".join(cells) + " |")
    runs = main_runs(records)
    lines += ["", "### Main table (each method at its best LR; bytes per worker, training traffic only)", "",
              "| method | seeds | val loss | val ppl | ppl vs low-rank DDP | MB sent | fewer bytes than DDP "
              "| optimizer state MB |", "|---|---|---|---|---|---|---|---|"]
    ppl = {n: statistics.fmean(math.exp(r["final_val_loss"]) for r in rs) for n, rs in runs.items()}
    sent = {n: statistics.fmean(r["bytes_sent"] for r in rs) for n, rs in runs.items()}
    for name in (n for n in authors.METHODS if n in NAMES):  # the stages after the main table have their own
        if name not in runs:
            lines.append(f"| {NAMES[name]} | 0 | not run | | | | | |")
            continue
        rs = runs[name]
        versus = f"{100 * (ppl[name] / ppl['lowrank_ddp'] - 1):+.1f} %" if "lowrank_ddp" in ppl else ""
        fewer = f"{sent['ddp'] / sent[name]:.1f}x" if "ddp" in sent and sent[name] else ""
        lines.append(f"| {NAMES[name]} | {len(rs)} | {_mean([r['final_val_loss'] for r in rs])} | {ppl[name]:.3f} "
                     f"| {versus} | {sent[name] / 1e6:,.0f} | {fewer} | {optimizer_state(rs[0]) / 1e6:.2f} |")
    lines += ["", "### Targets", ""] + targets(runs, ppl, sent)
    lines += ablations(records, runs)
    lines += recheck(records, runs)
    more = [r for r in records if r["stage"] == "frontier"]
    if more:
        lines += ["", "### More bytes (seed 0)", "", "| run | val loss | MB sent | optimizer state MB |",
                  "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['final_val_loss']:.4f} | {r['bytes_sent'] / 1e6:,.0f} "
                  f"| {optimizer_state(r) / 1e6:.2f} |" for r in more]
    lines += budget(records, runs)
    return "\n".join(lines) + "\n"


def budget(records: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``--stage budget`` and ``window``: PowerSGD rank 16's bytes spent on syncs (the defaults at K = 4 to 8, with
    and without ``basis_every``), each run and each configuration's mean against PowerSGD rank 16 over its seeds."""
    mine = [r for r in records if r["stage"] in ("budget", "window") and r["name"].startswith("lordo_")]
    if not mine:
        return []
    base = authors.warmup_lr()
    lines = ["", "### PowerSGD rank 16's budget spent on syncs (`--stage budget`, `--stage window`)", "",
             "| configuration | LR scale | seed | val loss | MB sent | subspace movement per sync |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | x{r['spec']['lr'] / base:g} | {r['spec']['seed']} | {r['final_val_loss']:.4f} | "
              f"{r['bytes_sent'] / 1e6:,.0f} | {r.get('subspace_movement_mean') or 0:.3f} |" for r in mine]
    psgd = runs.get("powersgd16", [])
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        groups[(r["name"], r["spec"]["lr"])].append(r)
    if psgd:
        peer = statistics.fmean(x["final_val_loss"] for x in psgd)
        peer_mb = statistics.fmean(x["bytes_sent"] for x in psgd) / 1e6
        lines.append("")
        for (name, lr), rs in groups.items():
            if len(rs) < 2:
                continue
            loss, mb = statistics.fmean(x["final_val_loss"] for x in rs), statistics.fmean(x["bytes_sent"] for x in rs)
            lines.append(f"- {name} at LR x{lr / base:g}: {_mean([r['final_val_loss'] for r in rs])} ({len(rs)} "
                         f"seeds) at {mb / 1e6:,.0f} MB against DDP + PowerSGD r16's "
                         f"{_mean([r['final_val_loss'] for r in psgd])} ({len(psgd)} seeds) at {peer_mb:,.0f} MB: no "
                         f"worse at no more bytes {'holds' if loss <= peer and mb / 1e6 <= peer_mb else 'missed'} "
                         f"({loss - peer:+.4f}; {100 * (math.exp(loss - peer) - 1):+.2f} % perplexity).")
    return lines


def recheck(records: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The reference methods' seed 0 from the rebuilt warm-up checkpoint against their recorded runs."""
    again = [r for r in records if r["stage"] == "recheck"]
    if not again:
        return []
    lines = ["", "### Recheck: seed 0 again from the rebuilt warm-up checkpoint", "",
             "| method | recorded | from the rebuilt checkpoint | difference |", "|---|---|---|---|"]
    for r in again:
        before = next((x for x in runs.get(r["name"], []) if x["spec"]["seed"] == 0), None)
        if before is not None:
            lines.append(f"| {NAMES[r['name']]} | {before['final_val_loss']:.4f} | {r['final_val_loss']:.4f} "
                         f"| {r['final_val_loss'] - before['final_val_loss']:+.4f} |")
    return lines


def ablations(records: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One choice at a time away from the ablations' base (seed 0): what ran so far."""
    done = [r for r in records if r["stage"] == "ablations"]
    if not done:
        return []
    base_name = done[0]["name"].split(":")[0]
    base = next((r for r in runs.get(base_name, []) if r["spec"]["seed"] == 0), None)
    lines = ["", f"### Ablations (one choice at a time from {NAMES.get(base_name, base_name)}, seed 0)", "",
             "| change | val loss | vs base | MB sent | optimizer state MB | sync seconds |",
             "|---|---|---|---|---|---|"]
    rows = ([("(base)", base)] if base is not None else []) + [(r["name"].split(":", 1)[1], r) for r in done]
    for label, r in rows:
        delta = f"{r['final_val_loss'] - base['final_val_loss']:+.4f}" if base is not None else ""
        lines.append(f"| {label} | {r['final_val_loss']:.4f} | {delta} | {r['bytes_sent'] / 1e6:,.0f} "
                     f"| {optimizer_state(r) / 1e6:.2f} | {r.get('sync_seconds_mean', 0):.3f} |")
    return lines


def optimizer_state(record: dict[str, Any]) -> float:
    """Bytes of optimizer state per worker (moments, bases, error feedback; AdamW's for the DDP methods)."""
    memory = record["optimizer_memory"]
    return sum(v for k, v in memory.items() if not k.startswith("adamw_equivalent"))


def targets(runs: dict[str, list[dict[str, Any]]], ppl: dict[str, float], sent: dict[str, float]) -> list[str]:
    out = []
    for name in ("lordo_candidate", "lordo_candidate_bf16", "lordo_candidate_compressed", "lordo_defaults",
                 "lordo_authors", "lordo_authors_colrms"):
        if name not in ppl or "lowrank_ddp" not in ppl:
            out.append(f"- {NAMES[name]}: not measured against low-rank DDP yet.")
            continue
        gap = 100 * (ppl[name] / ppl["lowrank_ddp"] - 1)
        seeds = min(len(runs[name]), len(runs["lowrank_ddp"]))
        out.append(f"- {NAMES[name]} within 1 % perplexity of low-rank DDP: {gap:+.2f} % "
                   f"({'holds' if gap <= 1 else 'missed'}; {seeds} seed(s)); bytes "
                   f"{sent['lowrank_ddp'] / sent[name]:.1f}x fewer than low-rank DDP (target 10x: "
                   f"{'holds' if sent['lowrank_ddp'] >= 10 * sent[name] else 'missed'}), "
                   f"{sent['ddp'] / sent[name]:.1f}x fewer than DDP (target 20x: "
                   f"{'holds' if sent['ddp'] >= 20 * sent[name] else 'missed'}).")
        for peer in ("diloco", "powersgd4", "powersgd16"):
            if peer in ppl:
                fewer = sent[peer] / sent[name]
                better = ppl[name] <= ppl[peer]
                out.append(f"  - vs {NAMES[peer]}: ppl {ppl[name]:.3f} vs {ppl[peer]:.3f}, bytes {fewer:.2f}x "
                           f"{'fewer' if fewer >= 1 else 'more'}: "
                           + ("no worse at fewer bytes (holds)" if better and fewer >= 1 else
                              "worse at more bytes (missed)" if not better and fewer < 1 else
                              "a trade-off (not at equal bytes: see the frontier)"))
    if "lordo_noqhm" in runs:
        moves = [r.get("subspace_movement_mean") for r in runs["lordo_noqhm"]]
        with_qhm = ppl.get("lordo_authors", math.nan)
        out.append(f"- Stagnation without QHM: ppl {ppl['lordo_noqhm']:.3f} vs {with_qhm:.3f} with it; mean subspace "
                   f"movement {moves} vs "
                   f"{[r.get('subspace_movement_mean') for r in runs.get('lordo_authors', [])]}.")
    return out


def frontier(path: Path, figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    authors.RESULTS = path
    runs = main_runs(unique([r for r in load(path) if "spec" in r]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [(NAMES[name], rs) for name, rs in runs.items()]
    more: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)  # the K and basis_every variants
    for r in unique([r for r in load(path) if "spec" in r]):
        if r["stage"] in ("frontier", "budget", "window") and r["name"].startswith("lordo_"):
            more[(r["name"], r["spec"]["lr"])].append(r)
    best: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for (name, _), rs in more.items():  # each variant at its best LR
        loss = statistics.fmean(r["final_val_loss"] for r in rs)
        if name not in best or loss < statistics.fmean(r["final_val_loss"] for r in best[name][1]):
            best[name] = (name.replace("lordo_candidate", "defaults") + f" ({len(rs)} seed{'s' * (len(rs) > 1)})", rs)
    points += list(best.values())
    for label, rs in points:
        x = statistics.fmean(r["bytes_sent"] for r in rs) / 1e6
        y = statistics.fmean(r["final_val_loss"] for r in rs)
        ax.scatter(x, y, marker="o" if label in NAMES.values() else "^")
        ax.annotate(label, (x, y), fontsize=6, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the decade labels only
    ax.set_xlabel("MB sent per worker (log)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Authors' protocol: loss vs bytes (lower left is better)")
    fig.tight_layout()
    fig.savefig(figure, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(ROOT / "results" / "authors.jsonl"))
    args = parser.parse_args(argv)
    path = Path(args.results)
    text = report(path)
    (path.parent / "authors.md").write_text(text)
    frontier(path, path.parent / "authors_frontier.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
