"""The README's generated blocks: each block between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` is
rendered here from its one source, so that the README cannot drift from it; ``KNOBS.md`` is generated whole.

    python benchmarks/readme_figures.py          # rewrite the blocks in README.md, and KNOBS.md
    python benchmarks/readme_figures.py --check  # exit 1 if either differs (tests/test_readme_figures.py)

Blocks: ``demo`` (``benchmarks/results/demo.json``, written by ``lordo-demo --json``), ``knobs`` (the knobs a
user is most likely to touch, from the docstrings of ``LoRDOStrategy``, ``LoRDO``, ``SyncConfig`` and
``Experimental``, as the whole reference in ``KNOBS.md``) and ``measured`` (a row per question, each from its
committed result file: ``dropin.jsonl``, ``authors.jsonl``, ``compressed.jsonl``, ``netlink.json``,
``gpu_check.json``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import load, ranked

from lightning_lordo import LoRDO, LoRDOStrategy
from lightning_lordo.config import OPTIMIZER_DEFAULTS, SyncConfig
from lightning_lordo.demo import COLUMNS, result_rows
from lightning_lordo.strategy_knobs import (
    EXPERIMENTAL_KNOBS,
    MAPPING_DOCS,
    OPTIMIZER_MAPPING_KNOBS,
    STRATEGY_OPTIMIZER_KNOBS,
    Experimental,
    docstring_entries,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KNOBS = ROOT / "KNOBS.md"
#: The knobs the README's table shows (the rest are in KNOBS.md).
README_KNOBS = ("sync_every", "preset", "payload", "outer_optimizer", "overlap_steps",
                "anchor_device", "timeout", "rank", "error_feedback", "full_rank_params", "warmup_steps",
                "checkpoint_shards")


def demo_block(results_file: Path = ROOT / "benchmarks" / "results" / "demo.json") -> str:
    """The demo's table and its provenance, from the JSON ``lordo-demo --json`` writes."""
    data = json.loads(results_file.read_text())
    args, prov = data["args"], data["provenance"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in result_rows(data["results"])]
    dirty = " with uncommitted changes" if prov["uncommitted_changes"] else ""
    lines += ["", f"Provenance: `{prov['command']}` at {prov['commit'][:7]}{dirty}, torch {prov['torch']}, lightning "
              f"{prov['lightning']}, Python {prov['python']}, {prov['machine']}. {args['steps']} steps, "
              f"{args['workers']} workers x {args['batch_size']} sequences, K = {args['sync_every']}, rank "
              f"{args['rank']}, one seed, LR {args['lr']:g} for both. DDP's bytes computed, LoRDO's counted; error "
              "feedback float32 on the CPU (bfloat16 on a GPU). Sync buffers: LoRDO's anchor, DDP's gradient buckets."]
    return "\n".join(lines)


def _named() -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(LoRDOStrategy.__init__).parameters.items()
            if n not in ("self", "ddp", "optimizer", "experimental")}


def knob(name: str) -> tuple[str, str, str]:
    """``(home, default, meaning)`` of a knob, from the signature, the defaults and the docstrings."""
    named = _named()
    if name in named:
        docs = docstring_entries(LoRDOStrategy.__doc__ or "", "Args:")
        default = named[name]
        return "named", "the preset's" if default is None else f"`{default!r}`", docs[name]
    if name in OPTIMIZER_MAPPING_KNOBS:
        meaning = MAPPING_DOCS.get(name) or docstring_entries(LoRDO.__doc__ or "", "Args:")[name]
        return "`optimizer`", f"`{OPTIMIZER_DEFAULTS.get(name, ())!r}`", meaning
    if name in EXPERIMENTAL_KNOBS:
        sync = SyncConfig.__dataclass_fields__.get(name)
        default = sync.default if sync is not None else {"lowrank": True, "checkpoint_shards": True}.get(name)
        return "`experimental`", f"`{default!r}`", docstring_entries(Experimental.__doc__ or "")[name]
    raise KeyError(name)


def markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown: ``x`` as `x`, :class:`~a.B` as `B`, a pipe as a slash."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m[1].split('.')[-1]}`", text)
    return text.replace("``", "`").replace("|", "/")


def knobs_block() -> str:
    """The README's table of the knobs most users touch (the first sentence of each description; knobs that share
    one description share a row)."""
    rows: list[tuple[list[str], str, list[str], str]] = []
    for name in README_KNOBS:
        home, default, meaning = knob(name)
        if rows and rows[-1][3] == meaning:
            rows[-1][0].append(f"`{name}`")
            rows[-1][2].append(default)
        else:
            rows.append(([f"`{name}`"], home, [default], meaning))
    lines = ["| knob | home | default | meaning |", "|---|---|---|---|"]
    for names, home, defaults, meaning in rows:
        default = defaults[0] if len(set(defaults)) == 1 else ", ".join(defaults)
        lines.append(f"| {', '.join(names)} | {home} | {default} | {markdown(meaning.split('. ')[0].rstrip('.'))} |")
    return "\n".join(lines)


def knobs_reference() -> str:
    """KNOBS.md: every knob, in its home, with its default and its whole description."""
    homes = {"Named arguments of `LoRDOStrategy` (and `LoRDOFabricStrategy`, but `monitor`)": list(_named()),
             "`optimizer={...}`: LoRDO's knobs for converting your AdamW (or `LoRDO(...)`'s own arguments)":
                 [*STRATEGY_OPTIMIZER_KNOBS, "full_rank_params"],
             "`experimental=Experimental(...)`: research, ablation and rarely changed knobs": list(EXPERIMENTAL_KNOBS)}
    out = ["# Knobs", "", "Generated by `python benchmarks/readme_figures.py` from the docstrings of `LoRDOStrategy`,",
           "`LoRDO`, `SyncConfig` and `Experimental`; do not edit by hand. `lr`, `betas`, `eps` and `weight_decay`",
           "come from your optimizer. An experimental knob left `None` takes the preset's value, else the default."]
    for title, names in homes.items():
        out += ["", f"## {title}", "", "| knob | default | meaning |", "|---|---|---|"]
        for name in names:
            _, default, meaning = knob(name)
            out.append(f"| `{name}` | {default} | {markdown(meaning)} |")
    return "\n".join(out) + "\n"


RESULTS = ROOT / "benchmarks" / "results"
#: The drop-in variant that runs today's defaults (``dropin.py``: the main sweep's "lordo" ran before
#: ``ef_decay="auto"`` followed the bases' interval).
TODAYS_LORDO = "lordo, ef_decay auto (interval)"


def dropin_row() -> str:
    """Drop-in, 500 steps, mean of the seeds at DDP's best LR: today's LoRDO (and DiLoCo) against DDP."""
    records = [r for r in load(RESULTS / "dropin.jsonl") if "family" in r]

    def mean(family: str, lr: float, method: str, variant: Any = None) -> Any:
        values = [r["loss_long"] for r in records if (r["family"], r["lr"], r["method"], r.get("variant"))
                  == (family, lr, method, variant)]
        return statistics.mean(values) if values else None

    parts = []
    for family, label in (("mlp", "MLP"), ("cnn_noisy", "BatchNorm CNN"), ("transformer", "Lightning's Transformer")):
        lrs = {r["lr"] for r in records if r["family"] == family and r["method"] == "ddp" and "variant" not in r}
        lr = min(lrs, key=lambda x: ranked(mean(family, x, "ddp")))
        # today's defaults: a variant's rerun where the first sweep ran earlier defaults, else the sweep's own
        today = TODAYS_LORDO if any(r.get("variant") == TODAYS_LORDO and r["family"] == family for r in records) \
            else None
        ddp, lordo = mean(family, lr, "ddp"), mean(family, lr, "lordo", today)
        diloco = mean(family, lr, "diloco", "diloco, average")
        text = f"{label}: {lordo / ddp - 1:+.1%}"
        parts.append(text + (f" (DiLoCo {diloco / ddp - 1:+.1%})" if diloco is not None else ""))
    return ("| Drop-in: your AdamW LR (DDP's best), 2 processes, 500 steps, 2 seeds | loss vs DDP: "
            + "; ".join(parts) + " | [Drop-in](benchmarks/README.md#drop-in-models-this-project-did-not-write-dropinpy-"
            "issue-30) |")


def authors_row() -> str:
    """The authors' protocol, seed 0 from the rebuilt warm start: today's defaults (stage ``interval``) against the
    baselines and the defaults before the drop-in changes (stage ``issue30``), perplexity and bytes."""
    records = [r for r in load(RESULTS / "authors.jsonl") if "final_val_loss" in r]

    def runs(stage: str, name: str) -> list[dict[str, Any]]:
        return [r for r in records if r.get("stage") == stage and r["name"] == name]

    ddp, low, before = (runs("issue30", n)[0] for n in ("ddp", "lowrank_ddp", "lordo_candidate_before"))
    today = runs("interval", "lordo_current")
    user = next(r for r in today if r["spec"]["lr"] == ddp["spec"]["lr"])
    best = min(today, key=lambda r: ranked(r["final_val_loss"]))

    def ppl(r: dict[str, Any]) -> str:
        return f"{math.exp(r['final_val_loss'] - low['final_val_loss']) - 1:+.1%}"

    best_note = ("its best of 0.5x, 1x, 2x" if best is user
                 else f"its best LR is {best['spec']['lr']:g}: {ppl(best)}")
    return ("| The authors' protocol (0.84 M GPT, 4 workers, K = 32, one seed) | perplexity vs low-rank DDP: "
            f"today's defaults at DDP's best LR {ppl(user)} ({best_note}) at "
            f"{ddp['bytes_sent'] / user['bytes_sent']:.1f}x fewer bytes than DDP; the authors' step, undecayed "
            f"buffer {ppl(before)} at its best LR; DDP {ppl(ddp)} | [Authors' protocol](benchmarks/"
            "README.md#the-interval-following-decay-in-the-authors-protocol-authorspy---stage-interval) |")


def compressed_row() -> str:
    """The ``"lordo_compressed"`` preset as it is today (stage ``today``: ``update_scale="auto"``, at DDP's best LR)
    against the full payload with the same optimizer knobs (``"lordo_lean"``), DDP's bytes (everything counted) and
    PowerSGD rank 4 at that LR, per model (means over seeds)."""
    import report_compressed  # the benchmarks' own report: its means are the section's

    means = report_compressed.main_means()
    runs = report_compressed._runs("today")
    gaps, ratios, psgd = [], [], []

    def mean(model: str, name: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["model"] == model and r["name"] == name)

    for model, methods in sorted(means.items()):
        loss = mean(model, "lordo_compressed:today", "final_val_loss")
        gaps.append(f"{model} {loss / mean(model, 'full:today', 'final_val_loss') - 1:+.1%}")
        ratios.append(methods["ddp"]["bytes"] / mean(model, "lordo_compressed:today", "bytes_everything"))
        psgd.append(f"{model} {loss / methods['powersgd4']['loss'] - 1:+.1%}")
    lr = {r["spec"]["lr"] for r in runs}.pop()
    return (f"| Everything compressed (4 workers, K = 32, {len(means)} models, 2 seeds, at DDP's best LR {lr:g}) | "
            f"`\"lordo_compressed\"`'s loss against the full payload: {', '.join(gaps)}, at {min(ratios):.0f}x-"
            f"{max(ratios):.0f}x fewer bytes than DDP; against PowerSGD rank 4: {', '.join(psgd)} | [Compressed]"
            "(benchmarks/README.md#everything-compressed-compressedpy) |")


def netlink_row() -> str:
    """Time to the target loss at 1 Gbit/s, DDP's over each current LoRDO configuration's (medians of repeats)."""
    data = json.loads((RESULTS / "netlink.json").read_text())
    lordo = ("lordo", "lordo_overlap", "lordo_compressed_preset", "lordo_compressed_preset_overlap2",
             "lordo_compressed_preset_overlap4")  # today's rows; "lordo_compressed" is the preset before

    def median(name: str) -> float:
        return statistics.median(r["seconds_to_target"] for r in data["runs"]
                                 if r["name"] == name and r["rate"] == "1gbit")
    speedups = [median("ddp") / median(name) for name in lordo]
    return (f"| A real bandwidth-limited link (6.4 M GPT, 2 workers) | at 1 Gbit/s each LoRDO configuration (the "
            f"step before `update_scale`) reached the target loss {min(speedups):.1f}x-{max(speedups):.1f}x sooner "
            "than one DDP run | "
            "[Slow link](benchmarks/README.md#a-real-slow-link-netlinkpy) |")


def gpu_row() -> str:
    """Peak GPU memory and mean step time (syncs included) of ``"lordo"`` against fused AdamW, one device."""
    data = json.loads((RESULTS / "gpu_check.json").read_text())
    fits = data["lightning"]["fits"]
    # the H200 run on record predates the optimizer-alone mode of one device ("lordo"); gpu_fit.FITS names it now
    auto, lordo = fits["auto (fused AdamW)"], fits.get("lordo (alone)", fits.get("lordo"))
    device, params = data["device"], lordo["params"] / 1e6
    return (f"| One {device}, {params:.0f} M GPT, {lordo['precision']}, one device | `\"lordo\"`: "
            f"{lordo['peak_gpu_mib'] / auto['peak_gpu_mib']:.2f}x fused AdamW's peak GPU memory, "
            f"{lordo['step_ms_mean'] / auto['step_ms_mean']:.2f}x its step time, syncs included | "
            "[GPU](benchmarks/README.md#on-a-gpu-gpu_checkpy) |")


def memory_row() -> str:
    """Resident bytes on the parameters' device (``memory.json``): the presets and the memory configuration against
    fused AdamW."""
    rows = {r["config"]: r for r in json.loads((RESULTS / "memory.json").read_text())["rows"]}
    parts = [f"{label} {rows[config]['over_adamw']:.2f}x" for config, label in (
        ("lordo", '`"lordo"`'), ("lordo_lean", '`"lordo_lean"`'),
        ("lordo_lean, factored full-rank state", 'with `fullrank_state="factored"`'))]
    return ("| Device memory, 406 M GPT (parameters, gradients, state, sync buffers) | vs fused AdamW: "
            + ", ".join(parts) + " | [Memory](benchmarks/README.md#what-a-gpu-pays-for-counted-"
            "on-the-cpu-countspy-memorypy-ef_dtypepy) |")


def measured_block() -> str:
    """The README's "Measured" table: each row from its committed result file (its section has the provenance)."""
    return "\n".join(["| question | result | where |", "|---|---|---|", dropin_row(), authors_row(),
                      compressed_row(), netlink_row(), memory_row(), gpu_row()])


BLOCKS: dict[str, Callable[[], str]] = {"demo": demo_block, "knobs": knobs_block, "measured": measured_block}


def render(text: str) -> str:
    """``text`` with every generated block rendered again."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- figures:{name} -->\n).*?(<!-- /figures:{name} -->)", re.S)
        if pattern.search(text) is None:
            raise SystemExit(f"README.md has no block <!-- figures:{name} --> ... <!-- /figures:{name} -->")
        match = pattern.search(text)
        assert match is not None
        text = text[:match.start()] + match[1] + make() + "\n" + match[2] + text[match.end():]
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's blocks differ from the results")
    args = parser.parse_args()
    current, knobs = README.read_text(), KNOBS.read_text() if KNOBS.exists() else ""
    wanted = render(current)
    if args.check:
        if wanted != current or knobs != knobs_reference():
            print("README.md's generated blocks or KNOBS.md are stale: run python benchmarks/readme_figures.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    KNOBS.write_text(knobs_reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
