"""The low-rank payload's bases before and after B6 (issue 29): the held-out-style runs of ``compressed.py``'s main
stage for the payloads whose math B6 changed, on the code of the checkout this script sits in.

B6 installs the payload's ``Q = orth(P)`` as the optimizer's new basis (SPEC §5) where the warm-started power step
on the dense average ``Q B`` used to recompute it: the same subspace, turned within it, so the moments' rotation
and the second moments' coordinates differ. Run this script from a checkout of each commit (copy it into the older
one's ``benchmarks/``) with the same ``--out``; ``python benchmarks/payload_bases.py --report --out ...`` prints
the table of both.

    python benchmarks/payload_bases.py --bytes ../shared/data/tinyshakespeare.txt \\
        --words ../shared/data/wikitext2-valid.txt --out benchmarks/results/payload_bases.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from compressed import spec
from harness import append, load, provenance, run

NAMES = ("lordo_compressed", "lowrank_int8")  # the preset's messages as compressed.py records them, and int8 alone
SEEDS, LR = (0, 1), 0.01  # compressed.py's main stage: LoRDO's payloads at its LR


def measure(paths: dict[str, str], out: Path, command: str) -> None:
    header = provenance(command)
    append(out, {"header": header})
    for model, data in paths.items():
        for name in NAMES:
            for seed in SEEDS:
                record = run(spec(model, data, name, LR, seed))
                append(out, {"commit": header["commit"], "model": model, "name": name, "seed": seed,
                             "final_val_loss": record["final_val_loss"], "bytes_sent": record["bytes_sent"]})
                print(f"{header['commit'][:7]} {model} {name} seed {seed}: {record['final_val_loss']:.4f}, "
                      f"{record['bytes_sent']} B", flush=True)


def report(out: Path) -> None:
    rows = [r for r in load(out) if "model" in r]
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    losses: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        losses[(r["model"], r["name"], r["commit"])].append(r["final_val_loss"])
    print("| model | payload | " + " | ".join(c[:7] for c in commits) + " |")
    print("|---|---|" + "---|" * len(commits))
    for model in dict.fromkeys(r["model"] for r in rows):
        for name in NAMES:
            cells = [losses.get((model, name, c), []) for c in commits]
            print(f"| {model} | {name} | " + " | ".join(
                f"{sum(v) / len(v):.4f} ({', '.join(f'{x:.4f}' for x in v)})" if v else "-" for v in cells) + " |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", help="the byte-level corpus (tinyshakespeare)")
    parser.add_argument("--words", help="the word-level corpus (WikiText-2 validation)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="print the table of --out and run nothing")
    args = parser.parse_args(argv)
    if args.report:
        report(args.out)
        return
    paths = {m: p for m, p in (("bytes", args.bytes), ("words", args.words)) if p}
    measure(paths, args.out, "python benchmarks/payload_bases.py " + " ".join(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
