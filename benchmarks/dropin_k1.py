"""How large is an averaged local Adam step against DDP's? (issue 30's gap of the local steps, one process).

Lightning's demo Transformer on WikiText-2 (``dropin.py``'s ``transformer`` family and data): DDP's step (torch's
AdamW on the batch of 2 x 16 sequences) and the local family's with a sync after every step (two AdamWs, each with
its own moments, on one half each, parameters averaged after each step: DiLoCo or LoRDO at K = 1 without the
low-rank step) train side by side from the same weights on the same batches. Prints the validation loss of both
every 25 steps and, per tensor, the mean norm of DDP's step and the local family's over DDP's.

    python benchmarks/dropin_k1.py --data ../shared/data/wikitext2-valid.txt --lr 1e-3 --steps 100
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from dropin import Module, wikitext
from torch.nn import functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    train, val, vocab = wikitext(args.data)
    start = Module("transformer", args.lr, vocab).model
    ddp, local = copy.deepcopy(start), [copy.deepcopy(start), copy.deepcopy(start)]
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    local_opts = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in local]
    names = [n for n, _ in start.named_parameters()]
    sums = {n: [0.0, 0.0] for n in names}
    order = torch.Generator().manual_seed(0)
    vx, vy = val.tensors[0][:256], val.tensors[1][:256]

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(model(x, y), y.reshape(-1))

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        ddp_opt.zero_grad()
        loss(ddp, x, y).backward()
        ddp_opt.step()

    def local_steps(x: torch.Tensor, y: torch.Tensor) -> None:
        for i, (m, opt) in enumerate(zip(local, local_opts)):
            opt.zero_grad()
            loss(m, x[16 * i:16 * i + 16], y[16 * i:16 * i + 16]).backward()
            opt.step()
        with torch.no_grad():
            for a, b in zip(local[0].parameters(), local[1].parameters()):
                a.copy_((a + b) / 2)
                b.copy_(a)

    def step_of(model: torch.nn.Module, take_step: Callable[..., None], *batch: torch.Tensor) -> list[torch.Tensor]:
        before = [p.detach().clone() for p in model.parameters()]
        take_step(*batch)
        return [p.detach() - b for p, b in zip(model.parameters(), before)]

    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(train), (32,), generator=order)
        x, y = train.tensors[0][idx], train.tensors[1][idx]
        for name, d, lo in zip(names, step_of(ddp, ddp_step, x, y), step_of(local[0], local_steps, x, y)):
            sums[name][0] += d.norm().item()
            sums[name][1] += lo.norm().item()
        if step % 25 == 0:
            with torch.no_grad():
                print(f"step {step}: validation loss DDP {loss(ddp, vx, vy).item():.4f}, "
                      f"local (K = 1) {loss(local[0], vx, vy).item():.4f}", flush=True)
    for name, (d, lo) in sums.items():
        print(f"{name:55s} DDP's step {d / args.steps:.3e}, local / DDP {lo / d:.3f}")


if __name__ == "__main__":
    main()
