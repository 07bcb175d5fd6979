"""Would a row-sparse message pay for embeddings? The share of embedding rows whose pseudo-gradient is exactly zero.

An exact row-sparse message can skip the rows no worker changed in a round. This measures that share on the
word-level model of ``benchmarks/compressed.py`` (vocabulary 4096, d 64), one process standing for the 4 workers'
data (batch 4 x 8 windows of 64 words), AdamW as the benchmark's LR and weight decay, K = 32, for a tied embedding
(the head shares it: the softmax touches every row) and an untied one, with and without weight decay on it.
Writes ``results/row_sparsity.json`` with its provenance.

    python benchmarks/row_sparsity.py --words ../shared/data/wikitext2-valid.txt   # about a minute
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from harness import ROOT, WordDataModule, provenance

from lightning_lordo.models import CharGPT

K, ROUNDS, VOCAB = 32, 4, 4096


def zero_row_shares(path: str, tied: bool, weight_decay: float) -> list[float]:
    torch.manual_seed(0)
    data = WordDataModule(path=path, vocab=VOCAB, seq_len=64, batch_size=32, train_samples=K * ROUNDS * 32)
    data.setup()
    model = CharGPT(VOCAB, 64, 2, 4, 64, tie_weights=tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=weight_decay, betas=(0.9, 0.95))
    batches = iter(data.train_dataloader())
    shares = []
    for _ in range(ROUNDS):
        anchor = model.tok_emb.weight.detach().clone()
        for _ in range(K):
            x, y = next(batches)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        delta = anchor - model.tok_emb.weight.detach()
        shares.append(float((delta.abs().amax(dim=1) == 0).float().mean()))
    return shares


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", required=True, help="WikiText-2 validation text")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = {"header": provenance("python benchmarks/row_sparsity.py " + " ".join(argv)), "sync_every": K}
    for tied in (True, False):
        for wd in (0.1, 0.0):
            name = f"{'tied' if tied else 'untied'}, weight_decay={wd}"
            out[name] = zero_row_shares(args.words, tied, wd)
            print(f"{name}: share of embedding rows unchanged per round {out[name]}", flush=True)
    (ROOT / "results" / "row_sparsity.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
