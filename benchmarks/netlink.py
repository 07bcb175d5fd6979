"""Real wall time of ``ddp`` vs ``lordo`` with gloo's traffic forced through a bandwidth-limited link.

The two worker processes run inside a network namespace of their own whose loopback device carries a token
bucket filter (``tc qdisc ... tbf rate R``): every byte the workers exchange (127.0.0.1 inside that namespace)
is limited to R, and nothing else on the machine is affected. Needs root (``ip netns``, ``tc``).

For each rate the same model, data and number of steps are trained with ``ddp`` and ``lordo``; the script
prints measured wall times, their ratio, and the ratio that SPEC §8's ring all-reduce model predicts from the
measured bytes. Results: ``benchmarks/results/netlink.json``. About 10 minutes.

Usage: ``sudo python benchmarks/netlink.py --data ../shared/data/tinyshakespeare.txt``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import ROOT, RunSpec, provenance

NAMESPACE = "lordo_bw"


def _sh(*args: str) -> None:
    subprocess.run(args, check=True)


def setup_namespace(rate: str) -> None:
    teardown_namespace()
    _sh("ip", "netns", "add", NAMESPACE)
    # an Ethernet-sized MTU: tbf drops any packet larger than its burst, and loopback's default MTU is 64 KiB
    _sh("ip", "netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "mtu", "1500", "up")
    _sh("ip", "netns", "exec", NAMESPACE, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
        "burst", "256kb", "latency", "400ms")


def teardown_namespace() -> None:
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)


def run_in_namespace(spec: RunSpec) -> dict[str, Any]:
    """One run in the namespace, in a fresh interpreter (the launcher must not inherit this process's state)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from harness import RunSpec, run; "
            "print('RESULT ' + json.dumps(run(RunSpec(**json.loads(sys.argv[1])))))")
    spec_json = json.dumps({k: v for k, v in spec.__dict__.items()})
    done = subprocess.run(["ip", "netns", "exec", NAMESPACE, sys.executable, "-c", code, spec_json],
                          capture_output=True, text=True, timeout=3600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates")
    parser.add_argument("--steps", type=int, default=96)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"header": provenance("python benchmarks/netlink.py " + " ".join(argv)), "runs": []}
    try:
        for rate in args.rates.split(","):
            setup_namespace(rate)
            for method in ("ddp", "lordo"):
                spec = RunSpec(method=method, lr=3e-3, data=str(Path(args.data).resolve()), steps=args.steps,
                               workers=2, d_model=128, n_layers=4, seq_len=128, rank=16, val_every=args.steps,
                               val_batches=2)
                record = run_in_namespace(spec)
                record["rate"] = rate
                results["runs"].append(record)
                print(f"{rate:>8} {method:<6} wall={record['wall_seconds']:.1f}s bytes={record['bytes_sent']:.3e}",
                      flush=True)
    finally:
        teardown_namespace()
    for rate in args.rates.split(","):
        ddp, lordo = (next(r for r in results["runs"] if r["rate"] == rate and r["spec"]["method"] == m)
                      for m in ("ddp", "lordo"))
        print(f"{rate}: ddp {ddp['wall_seconds']:.1f} s, lordo {lordo['wall_seconds']:.1f} s, "
              f"ddp/lordo = {ddp['wall_seconds'] / lordo['wall_seconds']:.2f}")
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "netlink.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
