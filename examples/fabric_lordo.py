"""LoRDO with Lightning Fabric: your own training loop, local steps, a low-rank synchronization every K steps.

    python examples/fabric_lordo.py                 # 2 CPU processes, well under a minute
    python examples/fabric_lordo.py --devices 1 --sync-every 8

A small byte-level GPT (``lightning_lordo.models.CharGPT``) learns English prose taken from Python's own
docstrings (no download). ``Fabric(strategy="lordo")`` needs ``import lightning_lordo`` (it registers the name);
``fabric.setup`` turns the AdamW into LoRDO, every ``optimizer.step()`` is a local step, every ``sync_every``
steps the ranks synchronize, and ``fabric.strategy.finish()`` runs the final synchronization after the loop.
The default ``popen`` launcher runs this script once more per extra rank.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_lordo import LoRDOFabricStrategy  # importing lightning_lordo registers strategy="lordo"
from lightning_lordo.models import CharGPT, RandomWindows, default_corpus


def train(fabric: Fabric, args: argparse.Namespace) -> dict[str, Any]:
    fabric.seed_everything(0)
    text = torch.tensor(list(default_corpus()[:300_000].encode()), dtype=torch.uint8)
    windows = RandomWindows(text, args.seq_len, num_samples=args.steps * args.batch_size * fabric.world_size)
    loader = fabric.setup_dataloaders(DataLoader(windows, batch_size=args.batch_size, drop_last=True))
    model = CharGPT(d_model=64, n_layers=2, n_heads=4, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)  # no DDP wrapper; AdamW -> LoRDO

    losses = []
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)  # no gradient all-reduce
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()  # a local step; every sync_every steps, the synchronization
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 20 == 0:
            fabric.print(f"step {step:3d}  loss {loss.item():.3f} (rank 0's local loss)")
    fabric.strategy.finish()  # the final synchronization: every rank now holds the same model

    summary = fabric.strategy.communication_summary()
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    fabric.print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps, {summary['syncs']} synchronizations")
    fabric.print(f"bytes sent per rank: {summary['bytes_sent_total']:,}; DDP would have sent "
                 f"{summary['ddp_equivalent_bytes']:,}" + (f" ({summary['bytes_saving_vs_ddp']:.1f}x more)"
                                                           if summary["bytes_saving_vs_ddp"] else ""))
    if args.checkpoint:  # at a synchronization boundary (finish() just ran): the synchronized model
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": len(losses)})
    return {"first_loss": first, "last_loss": last, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--checkpoint", default="", help="write the final model and optimizer here (fabric.save)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank
    # strategy="lordo" takes the defaults (sync_every=16); the class takes every knob by name
    strategy = LoRDOFabricStrategy(sync_every=args.sync_every, optimizer={"rank": args.rank})
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    result = fabric.launch(train, args)
    if fabric.is_global_zero:
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
