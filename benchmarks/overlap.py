"""The loss cost of overlapped syncs: LoRDO blocking vs ``overlap_steps`` (8 and 16, or ``--taus``), the same steps,
2 seeds.

The project's benchmark model (byte-level GPT, d 64 x 2 layers) on ``--data`` (tinyshakespeare), 4 workers, K = 32,
640 steps, LR 0.01 (LoRDO's best at K = 32 in ``benchmarks/compressed.py``), compared seed by seed. Resumable:
runs already in ``results/overlap.jsonl`` are skipped. Prints each overlap's final validation loss against the
blocking run of the same seed. About 8 minutes on 2 idle cores per ``--knobs`` set: ``lean`` (the harness's pinned
knobs, the earlier defaults) or ``defaults`` (today's defaults, ``authors.CANDIDATE``: error feedback, omega 0.97).

    python benchmarks/overlap.py --data ../shared/data/tinyshakespeare.txt [--knobs lean|defaults] [--taus 2,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from authors import CANDIDATE
from harness import ROOT, RunSpec, append, done, load, provenance, run

RESULTS = ROOT / "results" / "overlap.jsonl"
TAUS = (0, 8, 16)
SEEDS = (0, 1)
#: lean: the harness's pinned knobs (the earlier defaults); defaults: today's; the other two change one of the two
#: ways the defaults differ from the lean knobs (omega, error feedback), to see which one overlapping is sensitive to
KNOBS = {"lean": {}, "defaults": CANDIDATE, "defaults_omega_0.7": {**CANDIDATE, "omega": 0.7},
         "defaults_no_error_feedback": {**CANDIDATE, "error_feedback": False, "full_rank_input": "gradient"}}


def spec(data: str, tau: int, seed: int, knobs: str = "lean") -> RunSpec:
    return RunSpec(method="lordo", lr=0.01, data=data, seed=seed, steps=640, workers=4, sync_every=32, rank=8,
                   knobs={**KNOBS[knobs], **({"overlap_steps": tau} if tau else {})})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--knobs", default="lean", choices=tuple(KNOBS))
    parser.add_argument("--taus", default=",".join(map(str, TAUS[1:])), help="overlap_steps to measure (comma-"
                        "separated; the blocking runs always run)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    args = parser.parse_args(argv)
    taus = (0, *(int(t) for t in args.taus.split(",")))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    data = str(Path(args.data).resolve())
    records = load(RESULTS)
    pending = [(tau, seed) for tau in taus for seed in seeds if not done(records, spec(data, tau, seed, args.knobs))]
    if pending:
        append(RESULTS, {"header": provenance("python benchmarks/overlap.py " + " ".join(argv))})
    for tau, seed in pending:
        record = {"overlap_steps": tau, "knobs": args.knobs, **run(spec(data, tau, seed, args.knobs))}
        append(RESULTS, record)
        print(f"overlap_steps={tau:<3} seed={seed} val_loss={record['final_val_loss']:.4f} "
              f"wall={record['wall_seconds']:.0f}s", flush=True)
    records = [r for r in load(RESULTS) if "spec" in r and r.get("knobs", "lean") == args.knobs]
    loss = {(r["overlap_steps"], r["spec"]["seed"]): r["final_val_loss"] for r in records}
    print(f"knobs: {args.knobs}")
    for tau in sorted({r["overlap_steps"] for r in records} - {0}):
        gaps = [100 * (loss[(tau, s)] / loss[(0, s)] - 1) for s in sorted({s for _, s in loss})
                if (tau, s) in loss and (0, s) in loss]
        if gaps:
            print(f"overlap_steps={tau}: {', '.join(f'{g:+.2f} %' for g in gaps)} against blocking "
                  f"(mean {statistics.fmean(gaps):+.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
