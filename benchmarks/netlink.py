"""Real wall time of DDP, its PowerSGD hook, DiLoCo and LoRDO (blocking and overlapped) on a bandwidth-limited link.

The worker processes run inside a network namespace of their own whose loopback device carries a token bucket
filter (``tc qdisc ... tbf rate R``): every byte the workers exchange (127.0.0.1 inside that namespace) is limited
to R, and nothing else on the machine is affected. Needs root (``ip netns``, ``tc``): without them the script says
so and exits with status 2.

For each rate the same model, data and steps are trained with ``ddp``, ``powersgd4`` (DDP + PowerSGD rank 4),
``diloco``, ``lordo`` (blocking syncs) and ``lordo_overlap`` (``overlap_steps``; both with the harness's pinned
optimizer knobs, those of the ``"lordo_lean"`` preset, not today's defaults; the full payload), also
``lordo_compressed`` with and without overlap (``lordo_compressed``: the preset's knobs before it averaged the
full-rank moments too; ``lordo_compressed_preset``: the preset as it is today); ``compute`` is the limit: each
worker's local steps with no communication at all, as one single-worker run per worker, all at once (so they share
the cores as the workers of the other runs do). The script prints wall times (the whole ``fit``: launch and the
setup broadcast included) and the training loop's times (from the first step to the last), each as a ratio to
``compute``, the share of DDP's step that is communication (1 - compute / ddp), each method's time to a target
validation loss (``--target``; default: the highest final loss of the methods, which every one reaches) and writes
``results/netlink.json`` and ``results/netlink_loss_time.png`` (validation loss against wall time). Run it on an
otherwise idle machine.

Usage: ``python benchmarks/netlink.py --data ../shared/data/tinyshakespeare.txt`` (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from math import inf, nan
from pathlib import Path
from typing import Any, Optional

from harness import ROOT, RunSpec, finish_panels, panels, provenance

from lightning_lordo.config import LEAN_KNOBS
from lightning_lordo.strategy_knobs import PRESETS

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


def _start(spec: RunSpec) -> subprocess.Popen:
    """One run in the namespace, in a fresh interpreter (the launcher must not inherit this process's state)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from harness import RunSpec, run; "
            "print('RESULT ' + json.dumps(run(RunSpec(**json.loads(sys.argv[1])))))")
    spec_json = json.dumps({k: v for k, v in spec.__dict__.items()})
    return subprocess.Popen(["ip", "netns", "exec", NAMESPACE, sys.executable, "-c", code, spec_json],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen) -> dict[str, Any]:
    stdout, stderr = process.communicate(timeout=3600)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(f"run failed ({process.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def run_in_namespace(spec: RunSpec, copies: int = 1) -> dict[str, Any]:
    """``spec`` in the namespace; ``copies`` > 1 runs that many independent copies at once (the compute limit: each
    worker's local steps alone, beside the others on the same cores, nothing sent) and returns the first one's
    figures with the slowest one's times."""
    records = [_result(p) for p in [_start(spec) for _ in range(copies)]]
    out = records[0]
    out["wall_seconds"] = max(r["wall_seconds"] for r in records)
    out["train_seconds"] = max(r["train_seconds"] for r in records)
    return out


#: The model (6.4 M parameters; DDP's step is mostly communication at 1 Gbit/s) and its workers
MODEL = {"workers": 2, "d_model": 512, "n_layers": 2, "seq_len": 32, "batch_size": 4, "rank": 32, "sync_every": 32}
#: ``"lordo_compressed"`` as measured here, before the preset averaged the full-rank moments too
COMPRESSED = {**LEAN_KNOBS, "payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 16, "moments_every": 4}
PRESET = PRESETS["lordo_compressed"][0]
METHODS: dict[str, dict[str, Any]] = {
    "ddp": {"method": "ddp"},
    "powersgd4": {"method": "ddp", "hook": "powersgd", "hook_rank": 4},
    "diloco": {"method": "diloco"},
    "lordo": {"method": "lordo"},
    "lordo_overlap": {"method": "lordo", "knobs": {"overlap_steps": 8}},
    "lordo_compressed": {"method": "lordo", "knobs": dict(COMPRESSED)},
    "lordo_compressed_overlap": {"method": "lordo", "knobs": {**COMPRESSED, "overlap_steps": 8}},
    # the preset as it is today (the full-rank moments averaged too), blocking and overlapped by 2 and 4 steps
    "lordo_compressed_preset": {"method": "lordo", "knobs": dict(PRESET)},
    "lordo_compressed_preset_overlap2": {"method": "lordo", "knobs": {**PRESET, "overlap_steps": 2}},
    "lordo_compressed_preset_overlap4": {"method": "lordo", "knobs": {**PRESET, "overlap_steps": 4}},
    "compute": {"method": "lordo", "workers": 1},  # each worker's steps alone: 2 single-worker runs side by side
}


def has_namespaces() -> bool:
    try:
        setup_namespace("1gbit")
    except (OSError, subprocess.CalledProcessError):
        return False
    teardown_namespace()
    return True


def model_seconds(point: dict[str, float]) -> float:
    """Since when the model a validation saw existed on every rank (runs before that was recorded: when the
    validation ended, K - tau steps late for overlapped runs, whose validation at a launch sees the round before,
    landed tau steps after its own launch)."""
    return point.get("model_seconds", point["seconds"])


def time_to(curve: list[dict[str, float]], target: float) -> Optional[float]:
    """Wall seconds until a model whose validation loss reaches ``target`` existed (``None``: never)."""
    return next((model_seconds(c) for c in curve if c["val_loss"] <= target), None)


def figure(results: dict[str, Any], path: Path) -> None:
    rates = sorted({r["rate"] for r in results["runs"]})
    fig, axes = panels(len(rates))
    for ax, rate in zip(axes, rates):
        runs = [r for r in results["runs"] if r["rate"] == rate]
        for name in dict.fromkeys(r["name"] for r in runs):  # each method's run of median wall time
            mine = sorted((r for r in runs if r["name"] == name), key=lambda r: r["wall_seconds"])
            r = mine[(len(mine) - 1) // 2]
            ax.plot([model_seconds(c) for c in r["curve"]], [c["val_loss"] for c in r["curve"]], marker=".",
                    label=r["name"])
    finish_panels(fig, axes, "wall seconds", "validation loss", [f"2 workers, {rate}" for rate in rates], path)


LABELS = {"ddp": "DDP", "powersgd4": "DDP + PowerSGD r4", "diloco": "DiLoCo",
          "lordo": "`lordo_lean` knobs, full payload", "lordo_overlap": "`lordo_lean` knobs, full payload, "
          "`overlap_steps=8`", "lordo_compressed": "`lordo_compressed` (earlier)",
          "lordo_compressed_overlap": "`lordo_compressed` (earlier), `overlap_steps=8`",
          "lordo_compressed_preset": "`lordo_compressed`", "lordo_compressed_preset_overlap2":
          "`lordo_compressed`, `overlap_steps=2`", "lordo_compressed_preset_overlap4":
          "`lordo_compressed`, `overlap_steps=4`", "compute": "compute only"}


def with_references(runs: list[dict[str, Any]]) -> None:
    """Give each run of an earlier invocation that has no ``reference`` (the compute-only times it is compared
    with; runs stored before references were) the compute-only run of its rate and repeat in the same results (one of
    no repeat: repeat 0's), the one the summaries compared it with before."""
    computes = {(r["rate"], r.get("repeat") or 0): r for r in runs if r["name"] == "compute"}
    for r in runs:
        compute = computes.get((r["rate"], r.get("repeat") or 0), computes.get((r["rate"], 0)))
        if r["name"] != "compute" and "reference" not in r and compute is not None:
            r["reference"] = _times(compute)


def _times(*computes: dict[str, Any]) -> dict[str, float]:
    """The mean wall and training-loop seconds of compute-only runs."""
    return {k: statistics.mean(c[k] for c in computes) for k in ("wall_seconds", "train_seconds")}


def set_references(ran: list[dict[str, Any]], bracket: bool, fallback: list[dict[str, Any]]) -> None:
    """Give each run of ``ran`` (one rate's, in the order they ran) but the compute-only ones its ``reference``:
    bracketed, the mean of the compute-only runs just before and after it; otherwise its turn's compute-only run (the
    one of the same repeat). A run without them (yet): the mean of ``fallback``, or none if that is empty."""
    for i, r in enumerate(ran):
        if r["name"] == "compute":
            continue
        if bracket:
            after = next((c for c in ran[i + 1:] if c["name"] == "compute"), None)
            before = next((c for c in reversed(ran[:i]) if c["name"] == "compute"), None)
            mine = [c for c in (before, after) if c is not None] if after is not None else []
        else:
            mine = [c for c in ran if c["name"] == "compute" and c["repeat"] == r["repeat"]]
        mine = mine or fallback
        if mine:
            r["reference"] = _times(*mine)
        else:
            r.pop("reference", None)


def plan(methods: list[str], repeats: int, bracket: bool) -> list[str]:
    """The order of one rate's runs: the methods in turn, ``repeats`` times; with ``bracket`` a compute-only run
    before the first and after every other run (each is compared with the mean of the two beside it), otherwise
    compute-only once per turn where ``methods`` puts it (each run is compared with its turn's)."""
    if not bracket:
        return methods * repeats
    others = [m for m in methods if m != "compute"]
    return ["compute", *[run for _ in range(repeats) for m in others for run in (m, "compute")]]


def summarize(results: dict[str, Any], rates: list[str], target: float) -> list[str]:
    """Each run's ratios to its ``reference`` (:func:`with_references`; a compute-only run: itself), its time to
    ``target``; printed, and returned as a markdown table whose figures are medians over the repeats (with each
    repeat's ratio beside them when there are several)."""
    table = {}
    for rate in rates:
        runs = [r for r in results["runs"] if r["rate"] == rate]
        ddp = [r["wall_seconds"] for r in runs if r["name"] == "ddp"]
        compute_wall = statistics.median(r["wall_seconds"] for r in runs if r["name"] == "compute")
        if ddp:
            share = 1 - compute_wall / statistics.median(ddp)
            results.setdefault("communication_share_of_ddp", {})[rate] = share
            print(f"{rate}: communication is {100 * share:.0f} % of DDP's wall time")
        for r in runs:
            reference = r if r["name"] == "compute" else r.get("reference", {"wall_seconds": nan, "train_seconds": nan})
            r["seconds_to_target"] = time_to(r["curve"], target)
            r["x_compute"] = r["wall_seconds"] / reference["wall_seconds"]
            r["loop_x_compute"] = r["train_seconds"] / reference["train_seconds"]
            reach = "never" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f} s"
            print(f"  {r['name']:<24} repeat {r.get('repeat', 0)} wall {r['wall_seconds']:7.1f} s "
                  f"({r['x_compute']:.2f}x compute), training loop {r['train_seconds']:7.1f} s "
                  f"({r['loop_x_compute']:.2f}x), to loss {target:.3f}: {reach}")
        for name in LABELS:
            mine = [r for r in runs if r["name"] == name]
            if mine:
                table.setdefault(name, {})[rate] = mine
    lines = [f"| method | {' | '.join(f'{rate} wall | x compute | loop x | to {target:.3f}' for rate in rates)} "
             "| MB per worker | final loss |", "|---|" + "---|" * (4 * len(rates) + 2)]
    for name, per_rate in table.items():
        cells = []
        for rate in rates:
            rs = per_rate.get(rate, [])
            if not rs:
                cells += ["", "", "", ""]
                continue
            ratios = [r["x_compute"] for r in rs]
            each = f" ({', '.join(f'{x:.2f}' for x in ratios)})" if len(rs) > 1 and name != "compute" else ""
            reach = [r["seconds_to_target"] for r in rs if r["seconds_to_target"] is not None]
            cells += [f"{statistics.median(r['wall_seconds'] for r in rs):.1f} s",
                      f"{statistics.median(ratios):.2f}x{each}",
                      f"{statistics.median(r['loop_x_compute'] for r in rs):.2f}x",
                      (f"{statistics.median(reach):.1f} s" if reach else "never") + ("*" if late(rs) else "")]
        first = next(iter(per_rate.values()))[0]
        lines.append(f"| {LABELS[name]} | {' | '.join(cells)} | {first['bytes_sent'] / 1e6:,.1f} | "
                     f"{first['final_val_loss']:.4f} |")
    if any(late(rs) for per_rate in table.values() for rs in per_rate.values()):
        lines += ["", "\\* overlapped runs made before the plugin said which model a validation saw: their time to "
                  "the target is when the validation ended, K - tau steps after the model it saw existed."]
    return lines


def late(runs: list[dict[str, Any]]) -> bool:
    """Whether ``runs`` are overlapped ones whose curve has no ``model_seconds`` (:func:`model_seconds`)."""
    return any(r.get("spec", {}).get("knobs", {}).get("overlap_steps") and r["curve"]
               and "model_seconds" not in r["curve"][0] for r in runs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--target", type=float, default=None, help="validation loss for the time-to-target column")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; runs of other methods or "
                        "other rates already in results/netlink.json (same steps) are kept")
    parser.add_argument("--repeat", type=int, default=1, help="run the methods this many times per rate, in turn "
                        "(each ratio is to the compute-only run of its own repeat: this machine's speed drifts)")
    parser.add_argument("--bracket", action="store_true", help="a compute-only run before the first and after every "
                        "other run; each ratio is to the mean of the two beside it (use with few methods)")
    parser.add_argument("--report", action="store_true", help="only rewrite the table and figure from "
                        "results/netlink.json (no runs, no root needed)")
    args = parser.parse_args(argv)
    path = ROOT / "results" / "netlink.json"
    if args.report:
        results = json.loads(path.read_text())
        write_report(results, report_rates(results, args.rates.split(",")), args.target, path)
        return 0
    if args.repeat < 1 or ("compute" not in args.methods.split(",") and (args.repeat > 1 or args.bracket)):
        raise SystemExit(f"--repeat={args.repeat}: use 1 or more, and with more than 1 or with --bracket include "
                         "compute in --methods")
    if os.geteuid() != 0 or not has_namespaces():
        print("netlink.py needs root with network namespaces and tc (ip netns add, tc qdisc): not available here.",
              file=sys.stderr)
        return 2
    methods = args.methods.split(",")
    old = json.loads(path.read_text()) if path.exists() else {}
    earlier = [r for r in old.get("runs", []) if "name" in r and r["spec"]["steps"] == args.steps]
    with_references(earlier)
    rates = args.rates.split(",")
    kept = [r for r in earlier if r["name"] not in methods or r["rate"] not in rates]
    headers = old.get("headers", []) if kept else []
    results: dict[str, Any] = {"headers": [*headers, provenance("python benchmarks/netlink.py " + " ".join(argv))],
                               "runs": kept, **({"target": old["target"]} if kept and "target" in old else {})}
    model = {**MODEL, "steps": args.steps, "val_every": args.steps // 8, "val_batches": 2}
    # every run so far (their references where known), in case the invocation does not finish; not read back
    partial = path.with_suffix(".partial.json")
    try:
        for rate in rates:
            setup_namespace(rate)
            counts: dict[str, int] = {}
            ran = []
            for name in plan(methods, args.repeat, args.bracket):
                method = METHODS[name]
                lr = 3e-3 if method["method"] == "ddp" else 1e-2
                spec = RunSpec(lr=lr, data=str(Path(args.data).resolve()), **{**model, **method})
                copies = model["workers"] if name == "compute" else 1
                repeat = counts[name] = counts.get(name, -1) + 1
                ran.append({"name": name, "rate": rate, "repeat": repeat, **run_in_namespace(spec, copies)})
                print(f"{rate:>8} {name:<14} repeat {repeat} wall={ran[-1]['wall_seconds']:.1f}s "
                      f"loss={ran[-1]['final_val_loss']:.4f} bytes={ran[-1]['bytes_sent']:.3e}", flush=True)
                set_references(ran, args.bracket, [])  # those known so far, for the partial file
                partial.write_text(json.dumps({**results, "runs": [*results["runs"], *ran]}, indent=2))
            results["runs"] += ran
            fallback = [r for r in results["runs"] if r["rate"] == rate and r["name"] == "compute"]
            set_references(ran, args.bracket, fallback)
    finally:
        teardown_namespace()
    write_report(results, report_rates(results, rates), args.target, path)
    partial.unlink(missing_ok=True)
    return 0


def report_rates(results: dict[str, Any], rates: list[str]) -> list[str]:
    """``rates`` and every other rate that ``results`` has runs of, slowest first (a rerun of one rate keeps the
    others in the table)."""
    scale = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}

    def bits(rate: str) -> float:
        number, unit = rate[:-4], rate[-4:].lower()
        return float(number) * scale[unit] if unit in scale and number.replace(".", "", 1).isdigit() else inf
    return sorted(dict.fromkeys([*rates, *(r["rate"] for r in results["runs"])]), key=bits)


def write_report(results: dict[str, Any], rates: list[str], target: Optional[float], path: Path) -> None:
    """The summary (printed), ``results`` to ``path``, the table to ``results/netlink.md`` and the figure."""
    if target is None:  # a report of earlier results keeps their target
        target = results.get("target") or max(r["final_val_loss"] for r in results["runs"])
    results["target"] = target
    lines = summarize(results, rates, target)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    commits = ", ".join(sorted({h["commit"][:7] for h in results["headers"]}))
    (path.parent / "netlink.md").write_text("\n".join([
        "## A real bandwidth-limited link", "", f"Made by `python benchmarks/netlink.py` at commits {commits} "
        f"({'; '.join(h['command'] for h in results['headers'])}).", "", "### Wall time", "", *lines, ""]))
    figure(results, path.parent / "netlink_loss_time.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
