"""Does a bfloat16 error-feedback buffer (``ef_dtype="bfloat16"``) cost LoRDO validation loss against float32?

LoRDO (method ``"lordo"``) with the optimizer's current defaults (error feedback, ``full_rank_input="accumulated"``,
omega 0.97, 3 power steps: the harness pins the earlier lean knobs unless a spec names them, so they are named here),
at LoRDO's best swept LR of the ``lr-sweep`` part (``quality.best_lrs``), float32 against bfloat16, 2 seeds per
corpus. Runs are appended to ``benchmarks/results/ef_dtype.jsonl`` (a provenance header before each batch of new
runs) and skipped when already there, so an interrupted run resumes. The table compares each seed's pair; the seed
spread (float32, seed 0 against seed 1) is the noise to judge the difference by.

Usage: ``python benchmarks/ef_dtype.py --data ../shared/data/tinyshakespeare.txt ../shared/data/wikitext2-valid.txt``
(``--table`` prints the table of what is stored without running anything).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from harness import ROOT, RunSpec, done, load, run_pending
from quality import best_lrs

from lightning_lordo.config import LEAN_KNOBS, OPTIMIZER_DEFAULTS

OUT = ROOT / "results" / "ef_dtype.jsonl"
DTYPES = ("float32", "bfloat16")
SEEDS = (0, 1)
#: the defaults of the knobs the harness would otherwise pin to their lean values
DEFAULTS = {k: OPTIMIZER_DEFAULTS[k] for k in LEAN_KNOBS}


def spec_for(data: str, dtype: str, seed: int, lr: float, steps: int, val_every: int) -> RunSpec:
    return RunSpec(method="lordo", lr=lr, data=str(Path(data).resolve()), seed=seed, steps=steps, val_every=val_every,
                   knobs={**DEFAULTS, "ef_dtype": dtype})


def ef_bytes(record: dict[str, Any]) -> Optional[int]:
    """The error-feedback buffers' bytes on rank 0, from the optimizer's ``memory_report()``."""
    return record.get("optimizer_memory", {}).get("error_feedback")


def table(records: list[dict[str, Any]], specs: list[RunSpec]) -> str:
    lines = [f"{'corpus':<22} {'seed':>4} {'float32':>8} {'bfloat16':>8} {'diff %':>7} {'EF bytes f32':>12} "
             f"{'EF bytes bf16':>13}"]
    by_corpus: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for spec in specs:
        record = done(records, spec)
        if record is not None:
            by_corpus.setdefault(Path(spec.data).name, {}).setdefault(spec.seed, {})[spec.knobs["ef_dtype"]] = record
    for corpus, seeds in by_corpus.items():
        diffs = []
        for seed, pair in sorted(seeds.items()):
            loss = {d: pair[d]["final_val_loss"] if d in pair else float("nan") for d in DTYPES}
            diff = 100 * (loss["bfloat16"] / loss["float32"] - 1)
            if diff == diff:
                diffs.append(diff)
            nbytes = [ef_bytes(pair[d]) if d in pair else None for d in DTYPES]
            lines.append(f"{corpus:<22} {seed:>4} {loss['float32']:>8.4f} {loss['bfloat16']:>8.4f} {diff:>+7.2f} "
                         f"{nbytes[0]!s:>12} {nbytes[1]!s:>13}")
        if diffs:
            lines.append(f"{corpus:<22} mean bf16 - f32 difference: {sum(diffs) / len(diffs):+.2f} % "
                         f"({len(diffs)} seeds)")
        for d in DTYPES:
            losses = [pair[d]["final_val_loss"] for pair in seeds.values() if d in pair]
            if len(losses) > 1:
                spread = 100 * (max(losses) - min(losses)) / (sum(losses) / len(losses))
                lines.append(f"{corpus:<22} seed spread ({d}, max - min over mean): {spread:.2f} %")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", required=True, help="byte-level text files, one run set per file")
    parser.add_argument("--steps", type=int, default=640, help="optimizer steps per run (a multiple of --val-every)")
    parser.add_argument("--val-every", type=int, default=64)
    parser.add_argument("--lr", type=float, default=None, help="default: LoRDO's best LR of the lr-sweep part")
    parser.add_argument("--table", action="store_true", help="print the table of stored runs, run nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    missing = [d for d in args.data if not Path(d).is_file()]
    if missing:
        raise SystemExit(f"--data: no such file {missing}")
    lr = args.lr if args.lr is not None else best_lrs()["lordo"]
    specs = [spec_for(d, dtype, seed, lr, args.steps, args.val_every)
             for d in args.data for seed in SEEDS for dtype in DTYPES]
    records = load(OUT)
    pending = [] if args.table else [spec for spec in specs if not done(records, spec)]
    print(f"ef_dtype: lr={lr:g} steps={args.steps} knobs={DEFAULTS} ({len(pending)} of {len(specs)} runs to do)",
          flush=True)
    run_pending(OUT, pending, "python benchmarks/ef_dtype.py " + " ".join(argv),
                {"data": [Path(d).name for d in args.data]}, bool(records), lambda spec, record: (
                    f"ef_dtype: {Path(spec.data).name:<22} {spec.knobs['ef_dtype']:<8} seed={spec.seed} "
                    f"val_loss={record['final_val_loss']:.4f} ef_bytes={ef_bytes(record)} "
                    f"wall={record['wall_seconds']:.0f}s"))
    print(table(load(OUT), specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
