"""Building blocks of the demo and the benchmarks: a byte-level GPT, its LightningModule and a byte DataModule.

* :class:`CharGPT`: a small pre-LayerNorm GPT over bytes (vocabulary 256). Every projection (attention q, k, v,
  out; MLP in, out) is an :class:`~torch.nn.Linear`, so each is a 2-D weight that LoRDO can treat as a matrix.
* :class:`GPTLightningModule`: next-byte cross-entropy, ``val_loss`` / ``val_ppl`` logging and AdamW with an
  optional linear-warmup cosine schedule.
* :class:`ByteDataModule`: seeded random training windows and consecutive validation windows over one byte
  string; plain DataLoaders, so Lightning's distributed sampler splits them across ranks.
* :func:`default_corpus`: 1.6-1.7 MB of English text taken from the Python standard library sources.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sysconfig
from inspect import cleandoc
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads, self.dropout = n_heads, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` of shape ``(B, T, d_model)``, each position seeing only itself and the past."""
        b, t, d = x.shape
        q, k, v = (
            proj(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``(B, T, d_model)``."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class CharGPT(nn.Module):
    """A small byte-level GPT.

    Args:
        vocab_size: number of token ids (256 for bytes).
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block (must divide ``d_model``).
        seq_len: longest input; the size of the learned positional embedding.
        dropout: dropout on embeddings, attention and residual branches.
        tie_weights: share the output head's weight with the token embedding.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb, self.pos_emb = nn.Embedding(vocab_size, d_model), nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: scale the residual projections by 1/sqrt(2 * n_layers)
            for w in (block.attn.out.weight, block.proj.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * n_layers))
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(B, T)`` with ``T <= seq_len`` to next-token logits ``(B, T, vocab_size)``."""
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input length {t} exceeds seq_len={self.seq_len}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, then cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(L.LightningModule):
    """Next-byte language modelling with :class:`CharGPT`.

    Args:
        vocab_size, d_model, n_layers, n_heads, seq_len, dropout, tie_weights: passed to :class:`CharGPT`.
        lr: peak learning rate of AdamW.
        weight_decay: decoupled weight decay of the 2-D weights (all other parameters get 0).
        betas: AdamW betas.
        lr_schedule: ``"cosine"`` (linear warmup, then cosine decay per optimizer step) or ``"constant"``
            (linear warmup if ``warmup_steps > 0``, then constant; no scheduler at all otherwise).
        warmup_steps: optimizer steps of linear warmup.
        total_steps: length of the cosine schedule; ``None`` uses ``trainer.estimated_stepping_batches``.
        min_lr_ratio: final learning rate of the cosine schedule as a fraction of ``lr``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        lr_schedule: str = "cosine",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"lr_schedule={lr_schedule!r}: use 'cosine' or 'constant'")
        self.save_hyperparameters()
        self.model = CharGPT(vocab_size, d_model, n_layers, n_heads, seq_len, dropout, tie_weights)
        self.val_ppl = Perplexity()

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` of the wrapped :class:`CharGPT`."""
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of one batch of ``(x, y)`` windows; logs ``train_loss``."""
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Logs ``val_loss`` (epoch mean, synced across ranks) and ``val_ppl`` (torchmetrics perplexity)."""
        loss, logits = self._loss(batch)
        self.val_ppl.update(logits.float(), batch[1])
        self.log("val_loss", loss, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("val_ppl", self.val_ppl, on_epoch=True)

    def param_groups(self) -> list[dict[str, Any]]:
        """Two groups: 2-D weights with ``weight_decay``, everything else (biases, LayerNorms) without."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        """AdamW over :meth:`param_groups`, plus the LR schedule chosen by ``lr_schedule`` (stepped per step)."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=tuple(hp.betas))
        if hp.lr_schedule == "constant" and hp.warmup_steps == 0:
            return optimizer
        total = hp.total_steps if hp.total_steps is not None else self.trainer.estimated_stepping_batches
        if hp.lr_schedule == "cosine" and not math.isfinite(total):
            raise ValueError("a cosine schedule needs total_steps or a Trainer with max_steps / max_epochs")
        if hp.lr_schedule == "constant":
            total, min_ratio = hp.warmup_steps, 1.0  # cosine from 1 to 1: constant after warmup
        else:
            total, min_ratio = int(total), hp.min_lr_ratio
        fn = functools.partial(warmup_cosine, warmup_steps=hp.warmup_steps, total_steps=total, min_lr_ratio=min_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RandomWindows(Dataset):
    """``num_samples`` windows of ``seq_len + 1`` bytes at offsets drawn once from a seeded generator."""

    def __init__(self, data: Tensor, seq_len: int, num_samples: int, seed: int = 0) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"{len(data)} training bytes are too few for seq_len={seq_len}")
        self.data, self.seq_len = data, seq_len
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - seq_len, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        o = int(self.offsets[i])
        chunk = self.data[o : o + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ConsecutiveWindows(Dataset):
    """Non-overlapping windows ``data[i*L : i*L+L]`` with targets shifted by one, at most ``max_windows``."""

    def __init__(self, data: Tensor, seq_len: int, max_windows: int | None = None) -> None:
        self.data, self.seq_len = data, seq_len
        n = (len(data) - 1) // seq_len
        self.n = n if max_windows is None else min(n, max_windows)
        if self.n < 1:
            raise ValueError(f"{len(data)} validation bytes are too few for seq_len={seq_len}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ByteDataModule(L.LightningDataModule):
    """Byte-level language-modelling data from one text: the last ``val_fraction`` of it is validation.

    Args:
        text: the corpus (encoded as UTF-8). Give ``text`` or ``path``; with neither, :func:`default_corpus`.
        path: a file whose raw bytes are the corpus.
        seq_len: window length; samples are int64 ``(x, y)`` of length ``seq_len``, ``y`` shifted by one.
        batch_size: batch size per process.
        val_fraction: trailing fraction of the bytes held out for validation (split by position).
        train_samples: training windows per epoch (random offsets, fixed by ``seed``).
        val_batches: cap on validation batches (``None``: every non-overlapping window).
        num_workers: DataLoader workers.
        seed: seed of the training offsets.
    """

    def __init__(
        self,
        text: str | None = None,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        train_samples: int = 10_000,
        val_batches: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if text is not None and path is not None:
            raise ValueError("give text or path, not both")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        if path is not None:
            with open(path, "rb") as f:
                raw = f.read()
        else:
            raw = (default_corpus() if text is None else text).encode("utf-8")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = int(len(data) * val_fraction)
        self.train_data, self.val_data = data[: len(data) - n_val], data[len(data) - n_val :]
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.train_samples, self.val_batches, self.seed = train_samples, val_batches, seed
        self.train_set: RandomWindows | None = None
        self.val_set: ConsecutiveWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        """Build the training and validation datasets (cheap; done in every process)."""
        self.train_set = RandomWindows(self.train_data, self.seq_len, self.train_samples, self.seed)
        cap = None if self.val_batches is None else self.val_batches * self.batch_size
        self.val_set = ConsecutiveWindows(self.val_data, self.seq_len, cap)

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, full batches of random windows; Lightning adds a DistributedSampler under DDP."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """Consecutive validation windows in order."""
        return self._loader(self.val_set, train=False)


#: Standard-library modules and packages whose sources make the default corpus (absent ones are skipped).
CORPUS_MODULES = tuple(
    sorted(
        "_pydatetime _pydecimal _pyio argparse ast asyncio bdb calendar codecs collections concurrent configparser "
        "contextlib csv dataclasses datetime difflib doctest email enum fractions ftplib functools http imaplib "
        "importlib inspect ipaddress json logging mailbox multiprocessing optparse os pathlib pdb pickle pickletools "
        "pydoc random re shutil smtplib socket socketserver ssl statistics string subprocess tarfile tempfile "
        "textwrap threading traceback typing unittest urllib uuid warnings wsgiref xml xmlrpc zipfile".split()
    )
)
# A docstring: a triple-quoted string opening a line at the top of a file (after comments / blank lines) or right
# after a line ending in ':' (a def or class header). A comment block: consecutive full-line comments.
_DOCSTRING = re.compile(r'(?:\A(?:[ \t]*(?:#[^\n]*)?\n)*|:[ \t]*\n)[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S)
_COMMENTS = re.compile(r"(?:^[ \t]*#[^\n]*(?:\n|\Z))+", re.M)
_COMMENT_LINE = re.compile(r"^[ \t]*#+[ \t]?", re.M)
_PROSE_LINE = re.compile(r"(?!!|.*-\*-)(?=.*[A-Za-z]{2})")  # has a word; not a shebang or a coding line


def _corpus_files(stdlib: str) -> list[str]:
    files = []
    for name in CORPUS_MODULES:
        base = os.path.join(stdlib, name)
        if os.path.isfile(base + ".py"):
            files.append(base + ".py")
        for root, dirs, names in os.walk(base):  # a package (nothing happens for a plain module)
            dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "__pycache__"))
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


def _prose(source: str) -> list[str]:
    pieces = [(m.start(2), cleandoc(m.group(2))) for m in _DOCSTRING.finditer(source)]
    for m in _COMMENTS.finditer(source):
        lines = [ln for ln in _COMMENT_LINE.sub("", m.group(0)).splitlines() if _PROSE_LINE.match(ln)]
        if lines:
            pieces.append((m.start(), "\n".join(lines)))
    return [text for _, text in sorted(pieces) if text.strip()]


@functools.lru_cache(maxsize=1)
def default_corpus() -> str:
    """English prose from the Python standard library's own sources: no download, no file outside Python.

    For each module or package of :data:`CORPUS_MODULES` (sorted; files of a package in sorted walk order,
    test folders skipped), the docstrings and full-line comment blocks of its ``.py`` sources, in source
    order, separated by blank lines. Docstrings are found with a regular expression (triple-quoted strings
    after a ``def``/``class`` header or at the top of a file), so escapes stay as written; it is ~15x faster
    than parsing every file with :mod:`ast` and nearly identical. 1.60 / 1.66 / 1.69 / 1.74 MB on CPython
    3.10 / 3.11 / 3.12 / 3.13, read in about 0.5 s and cached; the exact text depends on the Python version
    and is identical from call to call and process to process.

    Raises:
        RuntimeError: if the standard library ships without ``.py`` sources (under 1 MB found).
    """
    stdlib = sysconfig.get_path("stdlib") or os.path.dirname(os.__file__)
    parts = []
    for file in _corpus_files(stdlib):
        with open(file, encoding="utf-8", errors="replace") as f:
            parts += _prose(f.read())
    text = "\n\n".join(parts) + "\n"
    if len(text) < 1_000_000:
        raise RuntimeError(f"only {len(text)} characters of docstrings/comments found under {stdlib}")
    return text
