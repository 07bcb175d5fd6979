"""The loss cost of overlapped syncs: LoRDO blocking vs ``overlap_steps`` (8 and 16, or ``--taus``), the same steps,
2 seeds.

The project's benchmark model (byte-level GPT, d 64 x 2 layers) on ``--data`` (tinyshakespeare), 4 workers, K = 32,
640 steps (``--model netlink``: ``netlink.py``'s 6.4 M model, 2 workers, 256 steps, 16 validation batches; ``--model
words``: ``compressed.py``'s word-level model on ``--data`` WikiText-2, as the benchmark model), LR 0.01 (LoRDO's
best at K = 32 in ``benchmarks/compressed.py``; ``--lr`` to change it), compared seed by seed with the blocking run
of the same model, knobs and LR. Resumable: runs already in ``results/overlap.jsonl`` are skipped. About 20-60 s per
run on 2 idle cores (the word model: 1-2.5 min). ``--knobs``: ``lean`` (the harness's pinned knobs, the earlier
defaults), ``defaults`` (today's defaults, ``authors.CANDIDATE``: error feedback, omega 0.97), ``compressed`` (the
``"lordo_compressed"`` preset as it is today), one of the defaults' changes, or ``diloco`` (AdamW local steps).

``--basis-delay N`` is a diagnostic, not a plugin option: blocking syncs whose new bases (and the rotation of the
moments into them) are installed N optimizer steps after the sync, as an overlapped round's arrive; the rest of the
sync is unchanged. It separates the bases' delay from the rest of an overlapped landing (the local steps taken from
each worker's own point before the average arrives). ``--progress-kept F`` (also a diagnostic) lands overlapped
rounds keeping only the fraction F of each worker's parameter progress since the launch (0: the parameters become
the new anchor, the tau steps' parameter updates are dropped, as torchft's DiLoCo does). ``--consensus-launch
all|lowrank|fullrank`` (a diagnostic too) starts the steps in flight from the consensus: at each launch every worker
first replaces its parameters (all of them, the low-rank matrices only, or the others only) by their average, with a
blocking all-reduce outside the round (with the full payload, what the round then averages is unchanged; the
all-reduce costs what overlapping saves, so it is no option for the plugin). With plain averaging as the outer step,
``all`` is a blocking sync of the parameters whose moments, bases and buffers land tau steps later. The diagnostics
patch the plugin in this process, which the forked workers inherit.

    python benchmarks/overlap.py --data ../shared/data/tinyshakespeare.txt [--knobs lean|defaults|compressed|diloco]
        [--taus 2,4] [--seeds 0,1] [--lr 0.01] [--basis-delay 8] [--progress-kept 0.5] [--consensus-launch all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from authors import CANDIDATE
from harness import ROOT, RunSpec, append, done, load, provenance, run
from netlink import MODEL as NETLINK_MODEL

from lightning_lordo.optim.lordo import LoRDO
from lightning_lordo.strategy_knobs import PRESETS
from lightning_lordo.sync import overlap as overlapped
from lightning_lordo.sync.synchronizer import Synchronizer

RESULTS = ROOT / "results" / "overlap.jsonl"
TAUS = (0, 8, 16)
SEEDS = (0, 1)
LR = 0.01
#: lean: the harness's pinned knobs (the earlier defaults); defaults: today's; compressed: the "lordo_compressed"
#: preset today; the next three change one of the ways the defaults differ from the lean knobs (omega, error
#: feedback, the full-rank term's input), to see which one overlapping is sensitive to; diloco: the same runs
#: without LoRDO
KNOBS = {"lean": {}, "defaults": CANDIDATE, "compressed": dict(PRESETS["lordo_compressed"][0]),
         "defaults_omega_0.7": {**CANDIDATE, "omega": 0.7},
         "defaults_no_error_feedback": {**CANDIDATE, "error_feedback": False, "full_rank_input": "gradient"},
         "defaults_gradient_input": {**CANDIDATE, "full_rank_input": "gradient"},  # error feedback kept
         "diloco": {"lowrank": False},  # DiLoCo (AdamW local steps): what overlapping costs a method without LoRDO
         # the defaults since issue 30 (AdamW-sized steps, the buffer decayed over one basis interval): the harness
         # pins the recorded specs' update_scale=1.0 and undecayed buffer unless named; run them at --lr 0.003
         "today": {**CANDIDATE, "update_scale": "auto", "ef_decay": "auto"}}


#: benchmark: the project's benchmark model (d 64 x 2 layers, 4 workers, 640 steps, rank 8); netlink: the model of
#: ``netlink.py`` (d 512 x 2 layers, 2 workers, 256 steps, rank 32), validated on 16 batches rather than 2; words:
#: ``compressed.py``'s word-level model (vocabulary 4096, tied embedding, otherwise as the benchmark model) on
#: ``--data`` WikiText-2
MODELS = {"benchmark": {"steps": 640, "workers": 4, "sync_every": 32, "rank": 8},
          "netlink": {**NETLINK_MODEL, "steps": 256, "val_every": 32, "val_batches": 16},
          "words": {"steps": 640, "workers": 4, "sync_every": 32, "rank": 8, "corpus": "words", "vocab": 4096}}


def spec(data: str, tau: int, seed: int, knobs: str = "lean", lr: float = LR, model: str = "benchmark") -> RunSpec:
    return RunSpec(method="lordo", lr=lr, data=data, seed=seed, **MODELS[model],
                   knobs={**KNOBS[knobs], **({"overlap_steps": tau} if tau else {})})


_PATCHED: dict[str, Any] = {}  # each diagnostic's value patched in (at most one: patching twice would stack it)


def _first_patch(flag: str, value: Any) -> bool:
    """Whether the diagnostic ``flag`` is still to be patched in (with ``value``); a second, other value fails."""
    if flag in _PATCHED:
        assert _PATCHED[flag] == value, f"one {flag} per process"
        return False
    _PATCHED[flag] = value
    return True



def delay_bases(steps: int) -> None:
    """Patch the plugin (this process and the workers it forks) once: a sync's new bases are installed in the
    optimizer-step hook ``steps`` steps after the sync's own (where an overlapped round launched at that sync would
    land); the first bases at once. A diagnostic for blocking syncs only."""
    if not _first_patch("--basis-delay", steps):
        return
    install, count = LoRDO.set_bases, Synchronizer.on_optimizer_step
    pending: dict[int, tuple[LoRDO, Any, int]] = {}  # one entry: (optimizer, bases, steps left)

    def set_bases(self: LoRDO, bases: Any) -> dict:
        if all("basis" not in self.state.get(p, {}) for p in bases):
            return install(self, bases)
        assert not pending, "--basis-delay must be shorter than the sync interval"
        pending[0] = (self, bases, steps)
        return {}

    def on_optimizer_step(self: Synchronizer) -> Optional[Any]:
        queued_before = bool(pending)  # bases queued by this step's own sync wait for the next steps
        report = count(self)
        if queued_before:
            optimizer, bases, left = pending.pop(0)
            if left > 1:
                pending[0] = (optimizer, bases, left - 1)
            else:
                install(optimizer, bases)
        return report

    LoRDO.set_bases, Synchronizer.on_optimizer_step = set_bases, on_optimizer_step


def _variant(record: dict[str, Any]) -> tuple[str, str, float, int, float, str]:
    return record.get("model", "benchmark"), record.get("knobs", "lean"), record["spec"]["lr"], \
        record.get("basis_delay", 0), record.get("progress_kept", 1.0), record.get("consensus_launch", "")


def report(records: list[dict[str, Any]]) -> None:
    """Each variant's gap to the blocking run of the same knobs, LR and seed (no basis delay)."""
    runs = [r for r in records if "spec" in r]
    blocking = {(*_variant(r)[:3], r["spec"]["seed"]): r["final_val_loss"] for r in runs
                if r["overlap_steps"] == 0 and not r.get("basis_delay")}
    for model, knobs, lr, delay, kept, consensus in sorted({_variant(r) for r in runs}):
        mine = [r for r in runs if _variant(r) == (model, knobs, lr, delay, kept, consensus)]
        for tau in sorted({r["overlap_steps"] for r in mine} - ({0} if not delay else set())):
            pairs = [(r["final_val_loss"], blocking[(model, knobs, lr, r["spec"]["seed"])]) for r in mine
                     if r["overlap_steps"] == tau and (model, knobs, lr, r["spec"]["seed"]) in blocking]
            gaps = [100 * (x / b - 1) for x, b in pairs]
            if gaps:
                what = f"bases {delay} steps late (blocking)" if delay else f"overlap_steps={tau}" + (
                    f", {kept:g} of the progress kept" if kept != 1.0 else "") + (
                    f", launched from the consensus ({consensus} parameters)" if consensus else "")
                print(f"model={model} knobs={knobs} lr={lr:g} {what}: {', '.join(f'{g:+.2f} %' for g in gaps)} against "
                      f"blocking (mean {statistics.fmean(gaps):+.2f} %; {', '.join(f'{x:.4f}' for x, _ in pairs)})")


def keep_progress(fraction: float) -> None:
    """Patch the plugin once (this process and the workers it forks): an overlapped landing adds ``fraction`` of each
    worker's parameter progress since the launch to the new anchor (the plugin: all of it). A diagnostic."""
    if not _first_patch("--progress-kept", fraction):
        return
    whole = overlapped.progress
    overlapped.progress = lambda round_, params: [fraction * t for t in whole(round_, params)]


def consensus_launch(which: str) -> None:
    """Patch the plugin once (this process and the workers it forks): each overlapped launch first averages the
    parameters ``which`` names (``all``, ``lowrank``: the low-rank matrices, ``fullrank``: the others) over the
    workers, blocking, outside the round's bytes, so the steps in flight start from the consensus. A diagnostic."""
    if not _first_patch("--consensus-launch", which):
        return
    launch = Synchronizer._launch

    def _launch(self: Synchronizer) -> None:
        lowrank = {id(p) for p in self.lordo.lowrank_params()} if self.lordo is not None else set()
        chosen = [p.detach() for p in self.params if which == "all" or (id(p) in lowrank) == (which == "lowrank")]
        with torch.no_grad():
            self.comm.all_reduce_mean(chosen, "diagnostic", in_round=False)
        launch(self)

    Synchronizer._launch = _launch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--knobs", default="lean", choices=tuple(KNOBS))
    parser.add_argument("--taus", default=",".join(map(str, TAUS[1:])), help="overlap_steps to measure (comma-"
                        "separated; the blocking runs always run)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--model", default="benchmark", choices=tuple(MODELS))
    parser.add_argument("--basis-delay", type=int, default=0, help="diagnostic: blocking syncs whose bases arrive "
                        "this many steps late (beside the blocking runs; --taus is then ignored)")
    parser.add_argument("--progress-kept", type=float, default=1.0, help="diagnostic: overlapped landings keep this "
                        "fraction of each worker's progress since the launch (beside the plugin's runs with all of it)")
    parser.add_argument("--consensus-launch", default="", choices=("", "all", "lowrank", "fullrank"),
                        help="diagnostic: the steps in flight start from the average of these parameters (beside the "
                        "plugin's runs)")
    args = parser.parse_args(argv)
    if not 0 <= args.basis_delay < 32:
        raise SystemExit(f"--basis-delay={args.basis_delay}: use 0 (off) to 31 (below the sync interval, 32)")
    if not 0.0 <= args.progress_kept <= 1.0 or (args.progress_kept != 1.0 and args.basis_delay):
        raise SystemExit(f"--progress-kept={args.progress_kept}: use a fraction from 0 to 1, without --basis-delay")
    if args.consensus_launch and (args.basis_delay or args.progress_kept != 1.0):
        raise SystemExit(f"--consensus-launch={args.consensus_launch}: use it without --basis-delay and "
                         "--progress-kept (one diagnostic per invocation)")
    if args.consensus_launch in ("lowrank", "fullrank") and KNOBS[args.knobs].get("lowrank", True) is False:
        raise SystemExit(f"--consensus-launch={args.consensus_launch} with --knobs {args.knobs}: every parameter is "
                         "full-rank there; use --consensus-launch all")
    taus = (0,) if args.basis_delay else (0, *(int(t) for t in args.taus.split(",")))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    data = str(Path(args.data).resolve())
    records = load(RESULTS)
    kept, consensus = args.progress_kept, args.consensus_launch
    # the plugin's runs first (blocking; overlapped unless a landing diagnostic is asked for), then the diagnostic's
    diagnostic = kept != 1.0 or bool(consensus)
    plan = [((0, 1.0, ""), tau) for tau in taus if not (tau and diagnostic)]
    plan += [((args.basis_delay, 1.0, ""), 0)] * bool(args.basis_delay)
    plan += [((0, kept, consensus), tau) for tau in taus if tau and diagnostic]
    pending = [(v, tau, seed) for v, tau in plan for seed in seeds
               if not done([r for r in records if "spec" in r and _variant(r)[3:] == v],
                           spec(data, tau, seed, args.knobs, args.lr, args.model))]
    if pending:
        append(RESULTS, {"header": provenance("python benchmarks/overlap.py " + " ".join(argv))})
    for (delay, fraction, launched_from), tau, seed in pending:
        if delay:
            delay_bases(delay)  # after the plugin's runs (pending is in plan order): the patch stays for this process
        if fraction != 1.0:
            keep_progress(fraction)  # likewise
        if launched_from:
            consensus_launch(launched_from)  # likewise
        record = {"overlap_steps": tau, "knobs": args.knobs, "model": args.model,
                  **({"basis_delay": delay} if delay else {}),
                  **({"progress_kept": fraction} if fraction != 1.0 else {}),
                  **({"consensus_launch": launched_from} if launched_from else {}),
                  **run(spec(data, tau, seed, args.knobs, args.lr, args.model))}
        append(RESULTS, record)
        print(f"overlap_steps={tau:<3} basis_delay={delay} progress_kept={fraction:g} consensus_launch="
              f"{launched_from or '-'} seed={seed} val_loss={record['final_val_loss']:.4f} "
              f"wall={record['wall_seconds']:.0f}s", flush=True)
    report(load(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
