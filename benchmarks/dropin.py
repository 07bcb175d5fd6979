"""Drop-in check (issue 30): models this project did not write, trained as a new user would, LoRDO against DDP.

Three families, each with AdamW and a constant learning rate, 2 worker processes on the CPU:

* ``transformer``: Lightning's demo ``Transformer`` (``lightning.pytorch.demos``; its defaults: 200 wide, 2 + 2
  layers) on WikiText-2 (the validation split given by ``--data``, word-level, its 4096 most frequent words, the
  first 90 % to train on), batch 16 x 35 tokens per worker, the loss as the demo computes it (NLL of its log-softmax);
* ``mlp``: a 64-256-256-10 ReLU MLP on a synthetic task (labels of a random teacher network, 5 % flipped);
* ``cnn``: three 3x3 convolutions with BatchNorm, pooling, a 64-wide hidden layer and a head, on synthetic 3 x 16 x
  16 images (10 random smooth templates, shifted by up to 4 pixels, with noise 0.8: every method ends near 0);
* ``cnn_noisy``: the same CNN on a harder version (shifts up to 8 pixels, noise 3.0: AdamW alone ends at 0.18-0.29
  after 500 steps).

Each run trains 500 steps and validates (a fixed held-out set; LoRDO: the synchronized model) at steps 50 and 500:
the issue's short and long runs are the two ends of one run (a constant learning rate makes the first 50 steps of a
long run a short run). Methods: ``ddp`` (Lightning's DDP) and ``lordo`` (``LoRDOStrategy()``, defaults), at 5
learning rates x 2 seeds; ``lowrank_ddp`` at the user's LR only. The user's LR is DDP's best at that horizon.

Appends to ``benchmarks/results/dropin.jsonl`` (a header line with the provenance, then one line per run) and skips
runs already there. ``--report`` prints the tables. Usage:
``python benchmarks/dropin.py --data ../shared/data/wikitext2-valid.txt [--families mlp,cnn] [--report]``
Runtime on the 2-core machine: about 25 minutes (the transformer's 20 runs most of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch
from harness import ROOT, append, provenance, ranked
from lightning.pytorch.demos import Transformer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_lordo import LoRDOStrategy
from lightning_lordo.strategy_knobs import strategy_kwargs

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
SEEDS = (0, 1)
FAMILIES = ("transformer", "mlp", "cnn", "cnn_noisy")
STEPS, SHORT = 500, 50
VOCAB = 4096  # the demo's decoder at 4096 x 200 (the full 13k-word vocabulary triples a 2-core run's time)
OUT = ROOT / "results" / "dropin.jsonl"


# ------------------------------------------------------------------------------------------------ data and models
def wikitext(path: str, seq_len: int = 35, vocab_size: int = VOCAB) -> tuple[TensorDataset, TensorDataset, int]:
    """Word-level WikiText-2: the ``vocab_size - 1`` most frequent words, the others as ``<unk>``."""
    words = Path(path).read_text(encoding="utf-8").replace("\n", " <eos> ").split()
    vocab = {w: i for i, (w, _) in enumerate(Counter(words).most_common(vocab_size - 1))}
    unk = vocab.setdefault("<unk>", len(vocab))
    ids = torch.tensor([vocab.get(w, unk) for w in words])
    windows = ids[: (len(ids) - 1) // seq_len * seq_len + 1]
    x = windows[:-1].view(-1, seq_len)
    y = windows[1:].view(-1, seq_len)
    cut = int(0.9 * len(x))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:]), len(vocab)


def teacher_task(seed: int = 1234, n: int = 18_000) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    w1, w2 = torch.randn(64, 128, generator=g) / 8, torch.randn(128, 10, generator=g) / 11
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    flip = torch.rand(n, generator=g) < 0.05
    y[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    return TensorDataset(x[:16_000], y[:16_000]), TensorDataset(x[16_000:], y[16_000:])


def template_images(seed: int = 4321, n: int = 12_000, noise: float = 0.8,
                    shift: int = 4) -> tuple[TensorDataset, TensorDataset]:
    """16 x 16 crops of 10 smooth random templates, shifted by up to ``shift`` pixels, with Gaussian ``noise``."""
    g = torch.Generator().manual_seed(seed)
    side = 16 + shift
    templates = F.avg_pool2d(torch.randn(10, 3, side, side, generator=g), 5, stride=1, padding=2)  # smooth
    labels = torch.randint(0, 10, (n,), generator=g)
    dx, dy = torch.randint(0, shift + 1, (n,), generator=g), torch.randint(0, shift + 1, (n,), generator=g)
    images = torch.stack([templates[c, :, i:i + 16, j:j + 16] for c, i, j in zip(labels.tolist(), dx.tolist(),
                                                                                  dy.tolist())])
    images = images / images.std() + noise * torch.randn(images.shape, generator=g)
    return TensorDataset(images[:10_000], labels[:10_000]), TensorDataset(images[10_000:], labels[10_000:])


def cnn() -> nn.Module:
    def block(i: int, o: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, stride=stride, padding=1), nn.BatchNorm2d(o), nn.ReLU()]
    return nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 64, 2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


class Module(L.LightningModule):
    """The user's LightningModule: their model, their loss, AdamW at their learning rate."""

    def __init__(self, family: str, lr: float, vocab: int = 0) -> None:
        super().__init__()
        self.family, self.lr = family, lr
        if family == "transformer":
            self.model: nn.Module = Transformer(vocab_size=vocab)
        elif family == "mlp":
            self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                       nn.Linear(256, 10))
        else:
            self.model = cnn()

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.family == "transformer":
            return F.nll_loss(self.model(x, y), y.reshape(-1))
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Record(L.Callback):
    """Writes the validation losses (rank 0) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.losses = path, {}

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        self.losses[trainer.global_step] = float(trainer.callback_metrics["val_loss"])
        Path(self.path).write_text(json.dumps(self.losses))


# ------------------------------------------------------------------------------------------------ one run
def run_one(spec: dict[str, Any], data: str) -> dict[str, Any]:
    L.seed_everything(spec["seed"], verbose=False)
    torch.set_num_threads(1)
    vocab = 0
    if spec["family"] == "transformer":
        train, val, vocab = wikitext(data)
        batch = 16
    else:
        train, val = teacher_task() if spec["family"] == "mlp" else template_images(**IMAGES[spec["family"]])
        batch = 64
    module = Module(spec["family"], spec["lr"], vocab)
    knobs = strategy_kwargs(**spec.get("knobs", {}), synchronous=spec["method"] == "lowrank_ddp",
                            lowrank=spec["method"] != "diloco")
    strategy: Any = DDPStrategy(start_method="fork") if spec["method"] == "ddp" else \
        LoRDOStrategy(start_method="fork", monitor=False, **knobs)
    with tempfile.TemporaryDirectory() as tmp:
        record = Record(str(Path(tmp) / "losses.json"))
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, val_check_interval=SHORT,
                            check_val_every_n_epoch=None, limit_val_batches=16, num_sanity_val_steps=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[record])
        trainer.fit(module, DataLoader(train, batch_size=batch, shuffle=True, drop_last=True),
                    DataLoader(val, batch_size=batch))
        losses = {int(k): v for k, v in json.loads(Path(record.path).read_text()).items()}
    return {**spec, "loss_short": losses[SHORT], "loss_long": losses[STEPS], "losses": losses}


def specs(families: list[str], lrs: tuple[float, ...] = LRS,
          methods: tuple[str, ...] = ("ddp", "lordo", "lowrank_ddp")) -> list[dict[str, Any]]:
    out = [{"family": f, "method": m, "lr": lr, "seed": s} for f in families for lr in lrs for s in SEEDS
           for m in ("ddp", "lordo") if m in methods]
    return out + [{"family": f, "method": "lowrank_ddp", "lr": 1e-3, "seed": s} for f in families for s in SEEDS
                  if "lowrank_ddp" in methods]


#: ``--variants``: the outer step against the gap of the local steps, each at the user's LRs (DDP's best at 50 and at
#: 500 steps in the main sweep), 2 seeds: ``(method, knobs)``.
VARIANTS = {"lordo, nesterov(1.0, 0.5)": ("lordo", {"outer_optimizer": "nesterov", "outer_lr": 1.0,
                                                   "outer_momentum": 0.5}),
            "diloco, average": ("diloco", {}),
            "lordo, nesterov(0.7, 0.9)": ("lordo", {"outer_optimizer": "nesterov"}),
            # the default ef_decay="auto" after it began to follow the bases' interval (1 - 1/16 at K = 16): the
            # main sweep's "lordo" ran when it meant beta1; named, so that its record has its own key
            "lordo, ef_decay auto (interval)": ("lordo", {"ef_decay": "auto"}),
            # the memory configuration's optimizer state (issue 29): the full-rank matrices' moments factored
            "lordo, factored full-rank state": ("lordo", {"fullrank_state": "factored"})}
#: The image tasks of the CNN families: template_images' noise and largest shift.
IMAGES = {"cnn": {"noise": 0.8, "shift": 4}, "cnn_noisy": {"noise": 3.0, "shift": 8}}
USER_LRS = {"transformer": (3e-3, 1e-3), "mlp": (1e-3, 3e-3), "cnn": (1e-2,), "cnn_noisy": ()}


def variant_specs(families: list[str], only: str = "", lrs: tuple[float, ...] = ()) -> list[dict[str, Any]]:
    """The variants at the user's LRs, or at ``lrs`` when given (a variant's own sweep)."""
    return [{"family": f, "method": method, "lr": lr, "seed": s, "knobs": knobs, "variant": name}
            for name, (method, knobs) in VARIANTS.items() if not only or name == only
            for f in families for lr in (lrs or USER_LRS[f]) for s in SEEDS]


def variants_report(records: list[dict[str, Any]]) -> None:
    """Mean validation loss of each variant against DDP and the default LoRDO at the same LR."""
    for family in FAMILIES:
        for lr in USER_LRS[family]:
            base = {m: [r for r in records if r["family"] == family and r["lr"] == lr and r["method"] == m
                        and "variant" not in r] for m in ("ddp", "lordo")}
            if not base["ddp"]:
                continue
            ddp = [statistics.mean(r[k] for r in base["ddp"]) for k in ("loss_short", "loss_long")]
            print(f"\n{family}, lr {lr:g}: mean over seeds, 50 steps | 500 steps (vs DDP)")
            rows = [("ddp", base["ddp"]), ("lordo (defaults)", base["lordo"])] + [
                (name, [r for r in records if r.get("variant") == name and r["family"] == family and r["lr"] == lr])
                for name in VARIANTS]
            for name, runs in rows:
                if runs:
                    short, long = (statistics.mean(r[k] for r in runs) for k in ("loss_short", "loss_long"))
                    print(f"  {name:28s} {short:.4f} ({short / ddp[0] - 1:+.1%}) | {long:.4f} "
                          f"({long / ddp[1] - 1:+.1%})  [{len(runs)} seed(s)]")


def _key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["family"], record["method"], record["lr"], record["seed"],
            json.dumps(record.get("knobs", {}), sort_keys=True))


def load() -> list[dict[str, Any]]:
    if not OUT.exists():
        return []
    return [r for r in map(json.loads, OUT.read_text().splitlines()) if "family" in r]


# ------------------------------------------------------------------------------------------------ report
def report(records: list[dict[str, Any]], as_lordo: str = "") -> bool:
    """Prints per family and horizon: each method's mean loss per LR, its best LR, and LoRDO at DDP's best LR
    against DDP there; returns whether every target holds (within 2 % at 50 steps, 1 % at 500; best LR within 2x).
    ``as_lordo`` names a variant whose runs stand for "lordo" (a later default's own sweep) where it ran."""
    ok = True
    if as_lordo:
        replaced = {r["family"] for r in records if r.get("variant") == as_lordo}  # the others ran it in the sweep
        records = [r for r in records if r.get("method") != "lordo" or r["family"] not in replaced
                   or r.get("variant") == as_lordo]
        records = [{k: v for k, v in r.items() if k != "variant"} if r.get("variant") == as_lordo else r
                   for r in records]
    for family in FAMILIES:
        mine = [r for r in records if r["family"] == family and "variant" not in r]  # the main sweep
        if not mine:
            continue
        for horizon, key, tolerance in (("50 steps", "loss_short", 0.02), ("500 steps", "loss_long", 0.01)):
            means: dict[tuple[str, float], float] = {}
            for method in ("ddp", "lordo", "lowrank_ddp"):
                for lr in LRS:
                    values = [r[key] for r in mine if r["method"] == method and r["lr"] == lr]
                    if values:
                        means[method, lr] = statistics.mean(values)
            print(f"\n{family}, {horizon}: mean validation loss over seeds {SEEDS}")
            print("  method       " + "  ".join(f"{lr:>8g}" for lr in LRS))
            for method in ("ddp", "lordo", "lowrank_ddp"):
                print(f"  {method:12s} " + "  ".join(f"{means[method, lr]:8.4f}" if (method, lr) in means
                                                     else f"{'-':>8s}" for lr in LRS))
            best = {m: min((lr for lr in LRS if (m, lr) in means), key=lambda lr: ranked(means[m, lr]), default=None)
                    for m in ("ddp", "lordo")}
            if best["ddp"] is None or best["lordo"] is None or ("lordo", best["ddp"]) not in means:
                continue
            user = best["ddp"]
            gap = means["lordo", user] / means["ddp", user] - 1
            ratio = max(best["lordo"], user) / min(best["lordo"], user)
            holds = gap <= tolerance and ratio <= 2
            ok &= holds
            print(f"  user's LR (DDP's best) {user:g}: lordo {means['lordo', user]:.4f} vs ddp "
                  f"{means['ddp', user]:.4f} ({gap:+.2%}, target <= {tolerance:+.0%}); lordo's best LR "
                  f"{best['lordo']:g} ({ratio:.0f}x DDP's, target <= 2x): {'holds' if holds else 'FAILS'}")
    return ok


def run_apart(script: str, data: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``script --one spec`` in its own process (a fresh interpreter per run); its ``RESULT`` line's record."""
    proc = subprocess.run([sys.executable, script, "--data", data, "--one", json.dumps(spec)], capture_output=True,
                          text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"run {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent.parent / "shared" / "data" / "wikitext2-valid.txt"))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--lrs", default=",".join(map(str, LRS)), help="a part of the sweep, run in this order")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--variants", action="store_true", help="run (or, with --report, report) VARIANTS")
    parser.add_argument("--variant", default="", help="with --variants: run only this one")
    parser.add_argument("--methods", default="ddp,lordo,lowrank_ddp", help="the main sweep's methods to run")
    parser.add_argument("--variant-lrs", default="", help="with --variants: these LRs instead of the user's")
    parser.add_argument("--as-lordo", default="", help="with --report: this variant's runs stand for lordo")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a run in its own process (the parent collects its line)
        print("RESULT " + json.dumps(run_one(json.loads(args.one), args.data)), flush=True)
        return 0
    if args.report:
        if args.variants:
            variants_report(load())
            return 0
        return 0 if report(load(), args.as_lordo) else 1
    done = {_key(r) for r in load()}
    lrs = tuple(float(lr) for lr in args.lrs.split(","))
    families = args.families.split(",")
    variant_lrs = tuple(float(lr) for lr in args.variant_lrs.split(",") if lr)
    wanted = variant_specs(families, args.variant, variant_lrs) if args.variants else \
        specs(families, lrs, tuple(args.methods.split(",")))
    pending = [s for s in wanted if _key(s) not in done]
    if pending:
        append(OUT, {"header": provenance("python benchmarks/dropin.py " + " ".join(argv)), "steps": STEPS,
                     "resumed": bool(done)})
    for spec in pending:
        record = run_apart(__file__, args.data, spec)
        append(OUT, record)
        print(f"{spec.get('variant', '')} {spec['family']:11s} {spec['method']:11s} lr {spec['lr']:<7g} "
              f"seed {spec['seed']}: "
              f"{record['loss_short']:.4f} @ {SHORT}, {record['loss_long']:.4f} @ {STEPS}", flush=True)
    if args.variants:
        variants_report(load())
        return 0
    return 0 if report(load()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
