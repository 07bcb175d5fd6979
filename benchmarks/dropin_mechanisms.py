"""Where the Transformer's gap of the local steps comes from (issue 30): three hypotheses, each tested by one change
to a run of ``dropin.py`` (Lightning's demo Transformer on WikiText-2, 2 CPU processes, 500 steps, validation at 50
and 500), 2 seeds, against the same runs without the change in ``results/dropin.jsonl``.

* ``noise_corrected``: each worker's Adam normalizes by the second moment of *its* half of the batch, which holds the
  gradient noise of half a batch, where DDP's Adam sees the average over M workers. ``diloco`` with a local AdamW
  whose denominator is the estimate for the averaged gradient, ``v_hat / M + (1 - 1/M) m_hat^2`` (the noise part of
  ``v`` divided by M): an update up to sqrt(M) larger where noise dominates, unchanged where the signal does.
  ``plain_local_adamw`` is the same code with M = 1 (it should match torch's AdamW, i.e. ``diloco``). The same
  correction on the MLP and the noisy CNN, at their users' LRs: does it help, or hurt, where the gap is small?
* ``frozen_embedding``: the embedding's rows get sparse gradients, and a row that only one worker's batches hit moves
  a full Adam step there and none on the other, so averaging halves it (DDP's Adam normalizes the averaged gradient
  back to a full step). The embedding frozen at its initialization, for ``ddp`` and ``diloco``: if the gap were the
  embedding's, it would close.
* ``rows_scaled``: the same hypothesis, tested the other way: each worker's pseudo-gradient of the embedding scaled
  row by row by ``f = (1 - (1 - q)^M) / q`` before the average, ``q`` the chance that a worker's batch holds the row's
  token (the training set's unigram frequencies): M for rare tokens, 1 for tokens every batch holds.

Appends to ``benchmarks/results/dropin_mechanisms.jsonl`` (a header line, then one line per run; runs already there
are skipped) and prints the table. About 20 minutes on the 2-core machine for the Transformer's runs. Usage:
``python benchmarks/dropin_mechanisms.py --data ../shared/data/wikitext2-valid.txt [--report]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import dropin
import torch
import torch.distributed as dist
from harness import ROOT, append, provenance

OUT = ROOT / "results" / "dropin_mechanisms.jsonl"
#: (mechanism, method, LR, family). The MLP and the noisy CNN at the user's LRs (DDP's best at 50 and at 500 steps)
#: check whether the noise correction carries over to families whose gap is small; the noisy CNN has no DiLoCo runs
#: in ``dropin.jsonl``, so ``plain_local_adamw`` gives its reference.
RUNS = [("noise_corrected", "diloco", 3e-3, "transformer"), ("noise_corrected", "diloco", 1e-3, "transformer"),
        ("plain_local_adamw", "diloco", 3e-3, "transformer"), ("frozen_embedding", "ddp", 3e-3, "transformer"),
        ("frozen_embedding", "diloco", 3e-3, "transformer"), ("rows_scaled", "diloco", 3e-3, "transformer"),
        ("rows_scaled", "lordo", 3e-3, "transformer"),
        ("noise_corrected", "diloco", 3e-3, "mlp"), ("noise_corrected", "diloco", 1e-3, "mlp"),
        ("noise_corrected", "diloco", 3e-3, "cnn_noisy"), ("noise_corrected", "diloco", 1e-2, "cnn_noisy"),
        ("plain_local_adamw", "diloco", 3e-3, "cnn_noisy"), ("plain_local_adamw", "diloco", 1e-2, "cnn_noisy")]


class LocalAdamW(torch.optim.Optimizer):
    """AdamW whose denominator estimates the second moment of the gradient averaged over ``workers`` (the process
    group's size when ``corrected``): ``v_hat / M + (1 - 1/M) m_hat^2``. Per parameter, readable, not fast."""

    def __init__(self, params: Any, lr: float, corrected: bool, weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay})
        self.corrected = corrected

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        m = dist.get_world_size() if self.corrected and dist.is_initialized() else 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1**t)
                v_eff = state["exp_avg_sq"] / (1 - beta2**t) / m + (1 - 1 / m) * m_hat * m_hat
                p.addcdiv_(m_hat, v_eff.sqrt_().add_(group["eps"]), value=-group["lr"])
        return loss


def row_factors(data: str, workers: int = 2) -> torch.Tensor:
    """``f`` per embedding row (module docstring), from the training split's unigram frequencies."""
    train, _, vocab = dropin.wikitext(data)
    tokens = train.tensors[0]
    p = torch.bincount(tokens.reshape(-1), minlength=vocab).double()
    p /= p.sum()
    q = 1 - (1 - p) ** (16 * tokens.shape[1])  # a worker's batch: 16 sequences
    return torch.where(q > 1e-12, (1 - (1 - q) ** workers) / q.clamp(min=1e-12), float(workers)).float()


def patch(mechanism: str, data: str) -> None:
    """Apply ``mechanism`` to ``dropin``'s module (before the Trainer forks its workers, which inherit it)."""
    init = dropin.Module.__init__
    held: dict[str, Any] = {}

    def module_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.family != "transformer":  # the embedding's mechanisms are the Transformer's
            return
        held["embedding"] = self.model.embedding.weight
        if mechanism == "frozen_embedding":
            held["embedding"].requires_grad_(False)

    dropin.Module.__init__ = module_init
    if mechanism in ("noise_corrected", "plain_local_adamw"):
        dropin.Module.configure_optimizers = lambda self: LocalAdamW(
            self.parameters(), lr=self.lr, corrected=mechanism == "noise_corrected")
    elif mechanism == "frozen_embedding":
        dropin.Module.configure_optimizers = lambda self: torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=self.lr)
    elif mechanism == "rows_scaled":
        from lightning_lordo.sync import outer
        factors = row_factors(data)[:, None]
        deltas = outer.Anchor.deltas

        def scaled(self: Any, params: Any = None, indices: Any = None) -> list[torch.Tensor]:
            out = deltas(self, params, indices)
            for j, i in enumerate(range(len(self.params)) if indices is None else indices):
                if self.params[i] is held.get("embedding"):
                    out[j].mul_(factors.to(out[j].device))
            return out

        outer.Anchor.deltas = scaled


def load() -> list[dict[str, Any]]:
    return [json.loads(line) for line in OUT.read_text().splitlines() if line and "header" not in line] \
        if OUT.exists() else []


def report(data: str) -> None:
    runs, base = load(), dropin.load()
    print(f"factor f over the embedding's rows: quantiles 0/10/50/90/100 % "
          f"{[round(float(v), 3) for v in torch.quantile(row_factors(data), torch.tensor([0, .1, .5, .9, 1.]))]}")

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.mean(r[key] for r in rows) if rows else float("nan")

    def reference(method: str, lr: float, family: str) -> list[dict[str, Any]]:
        name = {"diloco": "diloco, average", "lordo": "lordo, ef_decay auto (interval)"}.get(method)
        found = [r for r in base if r["family"] == family and r["method"] == method and r["lr"] == lr
                 and r.get("variant") == name and "rerun" not in str(r.get("variant"))]
        return found or [r for r in runs if (r["mechanism"], r["method"], r["lr"], r["family"]) ==
                         ("plain_local_adamw", method, lr, family)]  # the noisy CNN's DiLoCo

    print("| family | mechanism | method | LR | with it, 50 / 500 | without | DDP at that LR |")
    print("|---|---|---|---|---|---|---|")
    for mechanism, method, lr, family in RUNS:
        key = (mechanism, method, lr, family)
        mine = [r for r in runs if (r["mechanism"], r["method"], r["lr"], r["family"]) == key]
        ref, ddp = reference(method, lr, family), reference("ddp", lr, family)
        print(f"| {family} | {mechanism} | {method} | {lr:g} | {mean(mine, 'loss_short'):.4f} / "
              f"{mean(mine, 'loss_long'):.4f} "
              f"({len(mine)} seeds) | {mean(ref, 'loss_short'):.4f} / {mean(ref, 'loss_long'):.4f} | "
              f"{mean(ddp, 'loss_short'):.4f} / {mean(ddp, 'loss_long'):.4f} |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent.parent / "shared" / "data" / "wikitext2-valid.txt"))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        patch(spec["mechanism"], args.data)
        result = dropin.run_one({k: v for k, v in spec.items() if k != "mechanism"}, args.data)
        print("RESULT " + json.dumps({**result, "mechanism": spec["mechanism"]}), flush=True)
        return 0
    if not args.report:
        done = {(r["mechanism"], r["method"], r["lr"], r["family"], r["seed"]) for r in load()}
        pending = [{"family": family, "method": method, "lr": lr, "seed": seed, "mechanism": mechanism}
                   for mechanism, method, lr, family in RUNS for seed in dropin.SEEDS
                   if (mechanism, method, lr, family, seed) not in done]
        if pending:
            append(OUT, {"header": provenance("python benchmarks/dropin_mechanisms.py " + " ".join(argv))})
        for spec in pending:
            record = dropin.run_apart(__file__, args.data, spec)
            append(OUT, record)
            print(spec, f"{record['loss_short']:.4f} / {record['loss_long']:.4f}", flush=True)
    report(args.data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
