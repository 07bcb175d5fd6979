"""Everything compressed: LoRDO's payloads against DDP and the communication hooks a Lightning user would pick.

Two models, 4 workers, K = 32 (issue 14):

* ``bytes``: the project's benchmark model, a byte-level GPT (d 64 x 2 layers, 0.12 M parameters) on ``--bytes``
  (tinyshakespeare);
* ``words``: an embedding-heavy word-level GPT (vocabulary 4096, d 64 x 2 layers, tied embedding: 71 % of the
  parameters) on ``--words`` (WikiText-2 validation), in the spirit of Lightning's demo Transformer.

Stages (resumable: a run already in ``results/compressed.jsonl`` is skipped; each run is appended when it ends):

* ``lr``: ``lordo`` (its ``lowrank`` + int8 payload) and DDP at three learning rates each, seed 0, per model, and
  3x further out while an edge wins;
* ``choose``: the everything-compressed candidates at LoRDO's LR, seed 0: ``fullrank_rank`` 4 or 16 (the full-rank
  2-D parameters' messages), ``moments_every`` 1 or 4 (the averaged moments every K or 4K steps);
* ``main``: 2 seeds of ``full``, ``lowrank``, ``lowrank`` + int8, the chosen compressed configuration (the
  ``"lordo_compressed"`` preset), DDP, DDP + PowerSGD rank 4 and 16, DDP + fp16 hook; LoRDO's payloads at LoRDO's
  LR, DDP and its hooks at DDP's;
* ``candidate``: ``full``, ``lowrank`` + int8 and ``lordo_compressed`` with the candidate default of the authors'
  protocol (``authors.CANDIDATE``): the ``full`` payload at LRs 0.003 and 0.01 (seed 0, extended past a winning
  edge), then 2 seeds of each at the best of them;
* ``frequent``: ``full``, ``lowrank`` + int8 and ``lordo_compressed`` at K = 8 (4x the syncs, still fewer bytes than
  PowerSGD rank 4), 2 seeds per model at LoRDO's LR: the local steps' loss gap is what kept the word model behind
  PowerSGD, and the compressed payloads have bytes to spare;
* ``frequent_seeds``: the word model, where PowerSGD rank 4's two seeds differ by 0.085: seeds 2-4 of it and of the
  ``frequent`` payloads, and ``lowrank`` + int8 at K = 4 (seeds 0-4);
* ``window``: the word model's ``lowrank`` + int8 at K = 4 with ``basis_every=8`` (the bases every 32 steps, from
  the window's summed pseudo-gradients), seeds 0-4;
* ``k3``: ``lowrank`` + int8 at K = 3, the most frequent syncs whose bytes stay below PowerSGD rank 4's on the word
  model (5 seeds there, 2 on the byte model);
* ``embedding_moments``: the word model's ``lowrank`` + int8 at K = 8 with its full-rank moments (the embedding's,
  72 % of the parameters) averaged too, every 2nd sync to stay below PowerSGD rank 4's bytes (5 seeds); then the
  same on the byte model and ``lordo_compressed`` with the full-rank moments averaged at K = 32 (2 seeds each);
* ``compressed_k8``: ``lordo_compressed`` with the full-rank moments averaged at K = 8 (5 seeds on the word model,
  2 on the byte model).

Bytes per worker are payload bytes (what a worker hands to collectives) unless a column says wire (by the
collectives' algorithms); the plugin's exclude the one-time setup broadcast and Lightning's per-batch flags, as DDP's
do (``bytes_everything`` keeps the flags). ``python benchmarks/report_compressed.py`` writes the table.

    python benchmarks/compressed.py --bytes ../shared/data/tinyshakespeare.txt \\
        --words ../shared/data/wikitext2-valid.txt [--stage lr|choose|main|all]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from authors import CANDIDATE
from harness import RunSpec, append, done, load, provenance, ranked, run

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "compressed.jsonl"
STAGES = ("lr", "choose", "main", "candidate", "frequent", "frequent_seeds", "window", "k3", "embedding_moments",
          "compressed_k8", "today", "today_lr")
FREQUENT_K, FREQUENT_PAYLOADS, MORE_SEEDS = 8, ("lowrank_int8", "lordo_compressed", "full"), (2, 3, 4)
MODELS: dict[str, dict[str, Any]] = {
    "bytes": {"corpus": "bytes"},
    "words": {"corpus": "words", "vocab": 4096},
}
COMMON = {"steps": 640, "workers": 4, "sync_every": 32, "rank": 8, "val_every": 64, "val_batches": 16}
LORDO_LRS, DDP_LRS = (0.01, 0.03, 0.1), (0.001, 0.003, 0.01)
#: the candidate (error feedback, omega 0.97) took a 4x lower LR than the defaults in the authors' protocol
GRIDS = {"lordo": LORDO_LRS, "ddp": DDP_LRS, "candidate_full": (0.003, 0.01)}
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
INT8 = {"payload": "lowrank", "payload_dtype": "int8"}
CANDIDATES = {f"fullrank_rank={r},moments_every={m}": {**INT8, "fullrank_rank": r, "moments_every": m}
              for r in (4, 16) for m in (1, 4)}
PAYLOADS = {"full": {}, "lowrank": {"payload": "lowrank"}, "lowrank_int8": INT8,
            # the preset's synchronization knobs as recorded here, before it averaged the full-rank moments too
            # (the stages that add them say so); its optimizer knobs are the lean ones, which the harness pins
            "lordo_compressed": {"payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 16,
                                 "moments_every": 4}}
#: The payloads again with the candidate default of the authors' protocol (authors.CANDIDATE: omega 0.97, G + E,
#: error feedback, 3 power steps)
CANDIDATE_PAYLOADS = {f"candidate_{n}": {**CANDIDATE, **knobs} for n, knobs in PAYLOADS.items() if n != "lowrank"}
PEERS = {"ddp": {}, "powersgd4": {"hook": "powersgd", "hook_rank": 4}, "powersgd16": {"hook": "powersgd",
                                                                                      "hook_rank": 16},
         "fp16": {"hook": "fp16"}}


def spec(model: str, data: str, name: str, lr: float, seed: int = 0, **changes: Any) -> RunSpec:
    """Method ``name`` on ``model``; ``changes`` override :data:`COMMON` (e.g. ``sync_every``)."""
    extra = {**MODELS[model], **COMMON, **changes}
    if name in PEERS:
        return RunSpec(method="ddp", lr=lr, data=data, seed=seed, **extra, **PEERS[name])
    knobs = {**PAYLOADS, **CANDIDATE_PAYLOADS, **CANDIDATES}[name]
    return RunSpec(method="lordo", lr=lr, data=data, seed=seed, knobs=dict(knobs), **extra)


def _lr_losses(model: str, family: str) -> dict[float, float]:
    """Seed 0's final validation loss by learning rate: ``lordo``'s and ``ddp``'s from the ``lr`` stage,
    ``candidate_full``'s from the ``candidate`` stage."""
    stage = "candidate" if family == "candidate_full" else "lr"
    return {r["spec"]["lr"]: r["final_val_loss"] for r in load(RESULTS)
            if r.get("stage") == stage and r.get("model") == model and r.get("name") == family
            and r["spec"]["seed"] == 0}


def lr_grid(model: str, family: str) -> list[float]:
    """The family's 3 learning rates, and the next one of :data:`LADDER` past an edge that wins (at most 5 in all)."""
    grid = sorted(GRIDS[family])
    losses = _lr_losses(model, family)
    while set(grid) <= set(losses):
        best = min(grid, key=lambda lr: ranked(losses[lr]))
        at = LADDER.index(best)
        if best == grid[0] and at > 0 and LADDER.index(grid[-1]) - at < 4:
            grid.insert(0, LADDER[at - 1])
        elif best == grid[-1] and at + 1 < len(LADDER) and at - LADDER.index(grid[0]) < 4:
            grid.append(LADDER[at + 1])
        else:
            break
    return grid


def best_lr(model: str, family: str) -> float:
    """The learning rate of the ``lr`` stage with the lowest final validation loss (``lordo`` or ``ddp``), once its
    grid (:func:`lr_grid`) has run."""
    losses, grid = _lr_losses(model, family), lr_grid(model, family)
    if not set(grid) <= set(losses):
        raise SystemExit(f"run the lr stage first ({model}, {family}: {len(losses)} of {len(grid)} runs)")
    return min(grid, key=lambda lr: ranked(losses[lr]))


def frequent_spec(model: str, data: str, name: str, seed: int, k: int = FREQUENT_K, tag: str = "",
                  **knobs: Any) -> tuple[str, str, RunSpec]:
    """Payload ``name`` at K = ``k`` at LoRDO's LR, with ``knobs`` added: (model, label, spec); ``tag`` names the
    added knobs in the label."""
    run_spec = spec(model, data, name, best_lr(model, "lordo"), seed, sync_every=k)
    run_spec.knobs = {**run_spec.knobs, **knobs}
    return model, f"{name}:sync_every={k}" + (f",{tag}" if tag else ""), run_spec


#: the full-rank (embedding) moments averaged too: every 2nd sync, or with the preset's moments (every 4th)
MOMENTS_2 = {"tag": "fullrank_moments_every=2", "average_fullrank_moments": True, "moments_every": 2}
MOMENTS_4 = {"tag": "fullrank_moments_every=4", "average_fullrank_moments": True}


def _today(model: str, data: str, name: str, lr: float, seed: int = 0) -> RunSpec:
    """Payload ``name`` as the presets run it now: ``update_scale="auto"`` (the harness pins 1.0 unless named) and,
    for the ``"lordo_compressed"`` preset, the full-rank moments averaged too."""
    run_spec = spec(model, data, name, lr, seed)
    extra = {"average_fullrank_moments": True} if name == "lordo_compressed" else {}
    run_spec.knobs = {**run_spec.knobs, "update_scale": "auto", **extra}
    return run_spec


def specs_for(stage: str, paths: dict[str, str]) -> list[tuple[str, str, RunSpec]]:
    if stage == "candidate":  # the word model (where PowerSGD won) first, its LR grid, then seed 0 of each model
        models = [m for m in ("words", "bytes") if m in paths]
        grids = [(m, "candidate_full", spec(m, paths[m], "candidate_full", lr))
                 for m in models for lr in lr_grid(m, "candidate_full")]
        if not all(set(lr_grid(m, "candidate_full")) <= set(_lr_losses(m, "candidate_full")) for m in models):
            return grids
        return grids + [(m, n, spec(m, paths[m], n, best_lr(m, "candidate_full"), seed))
                        for seed in (0, 1) for m in models for n in CANDIDATE_PAYLOADS]
    out = []
    if stage == "frequent":
        models = [m for m in ("words", "bytes") if m in paths]  # the word model (where PowerSGD won) first
        return [frequent_spec(m, paths[m], n, seed) for seed in (0, 1) for m in models for n in FREQUENT_PAYLOADS]
    if stage == "frequent_seeds":
        data = paths["words"]
        out = [("words", "powersgd4", spec("words", data, "powersgd4", best_lr("words", "ddp"), seed))
               for seed in MORE_SEEDS]
        out += [frequent_spec("words", data, n, seed) for seed in MORE_SEEDS for n in FREQUENT_PAYLOADS]
        return out + [frequent_spec("words", data, "lowrank_int8", seed, k=4) for seed in (0, 1, *MORE_SEEDS)]
    if stage == "k3":
        return [frequent_spec(m, paths[m], "lowrank_int8", seed, k=3) for m in ("words", "bytes") if m in paths
                for seed in ((0, 1, *MORE_SEEDS) if m == "words" else (0, 1))]
    if stage == "embedding_moments":
        out = [frequent_spec("words", paths["words"], "lowrank_int8", seed, **MOMENTS_2)
               for seed in (0, 1, *MORE_SEEDS)]
        for seed in (0, 1):
            out.append(frequent_spec("bytes", paths["bytes"], "lowrank_int8", seed, **MOMENTS_2))
            out += [frequent_spec(m, paths[m], "lordo_compressed", seed, k=32, **MOMENTS_4) for m in ("words", "bytes")]
        return out
    if stage == "today":  # the preset and the full payload as they are now (update_scale="auto", which the
        # harness pins to 1.0 unless named), at the user's LR: DDP's best, where PowerSGD's and DDP's runs are
        return [(m, f"{name}:today", _today(m, paths[m], name, best_lr(m, "ddp"), seed))
                for seed in (0, 1) for m in ("words", "bytes") for name in ("lordo_compressed", "full")]
    if stage == "today_lr":  # is the user's LR the preset's best? seed 0 at the ladder's LRs either side of it
        return [(m, "lordo_compressed:today", _today(m, paths[m], "lordo_compressed", LADDER[at]))
                for m in ("words", "bytes") for i in (-1, 1) if 0 <= (at := LADDER.index(best_lr(m, "ddp")) + i)]
    if stage == "compressed_k8":
        return [frequent_spec(m, paths[m], "lordo_compressed", seed, **MOMENTS_4) for m in ("words", "bytes")
                for seed in ((0, 1, *MORE_SEEDS) if m == "words" else (0, 1))]
    if stage == "window":
        return [frequent_spec("words", paths["words"], "lowrank_int8", seed, k=4, tag="basis_every=8", basis_every=8)
                for seed in (0, 1, *MORE_SEEDS)]
    for model, data in paths.items():
        if stage == "lr":
            out += [(model, "lordo", spec(model, data, "lowrank_int8", lr)) for lr in lr_grid(model, "lordo")]
            out += [(model, "ddp", spec(model, data, "ddp", lr)) for lr in lr_grid(model, "ddp")]
        elif stage == "choose":
            out += [(model, n, spec(model, data, n, best_lr(model, "lordo"))) for n in CANDIDATES]
        else:
            lrs = {"lordo": best_lr(model, "lordo"), "ddp": best_lr(model, "ddp")}
            for seed in (0, 1):
                out += [(model, n, spec(model, data, n, lrs["lordo"], seed)) for n in PAYLOADS]
                out += [(model, n, spec(model, data, n, lrs["ddp"], seed)) for n in PEERS]
    return out


def run_stage(stage: str, paths: dict[str, str], argv: list[str]) -> None:
    while True:  # the lr grids grow while an edge keeps winning
        records = load(RESULTS)
        pending = [(m, n, s) for m, n, s in specs_for(stage, paths) if not done(records, s)]
        if not pending:
            return
        _run(stage, pending, argv)


def _run(stage: str, pending: list[tuple[str, str, RunSpec]], argv: list[str]) -> None:
    append(RESULTS, {"header": provenance("python benchmarks/compressed.py " + " ".join(argv)), "stage": stage})
    for model, name, run_spec in pending:
        record = {"stage": stage, "model": model, "name": name, **run(run_spec)}
        append(RESULTS, record)
        print(f"{stage}: {model:<6} {name:<36} lr={run_spec.lr:<7.3g} seed={run_spec.seed} "
              f"val_loss={record['final_val_loss']:.4f} bytes={record['bytes_sent']:.3e} "
              f"wall={record['wall_seconds']:.0f}s", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", required=True, help="text for the byte-level model (tinyshakespeare)")
    parser.add_argument("--words", required=True, help="text for the word-level model (WikiText-2 validation)")
    parser.add_argument("--stage", default="all", choices=(*STAGES, "all"))
    args = parser.parse_args(argv)
    paths = {"bytes": args.bytes, "words": args.words}
    for model, path in paths.items():
        if not Path(path).is_file():
            raise SystemExit(f"--{model}={path}: no such file")
    paths = {m: str(Path(p).resolve()) for m, p in paths.items()}
    for stage in STAGES if args.stage == "all" else (args.stage,):
        run_stage(stage, paths, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
