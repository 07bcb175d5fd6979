"""``gpu_check.py``'s resume section: a checkpoint written between syncs on an accelerator, where the anchor lives in
host memory (``anchor_device="auto"``), resumed (the CPU tests cannot put the anchor on another device than the
parameters). One device with rounds (``synchronous=False``), rounds of 8 steps, the save at step 12."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lordo import LoRDOStrategy
from lightning_lordo.models import ByteDataModule, GPTLightningModule


def check_resume(device: torch.device) -> dict[str, Any]:
    def fit(max_steps: int, root: str, ckpt: Any = None, every: int = 0) -> L.Trainer:
        torch.manual_seed(0)
        callbacks = [ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=every, save_top_k=-1)] \
            if every else []
        trainer = L.Trainer(strategy=LoRDOStrategy(sync_every=8, experimental={"synchronous": False}),
                            accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision="bf16-mixed",
                            max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=bool(every), default_root_dir=root,
                            callbacks=callbacks)
        module = GPTLightningModule(d_model=64, n_layers=2, n_heads=4, seq_len=64, lr=3e-3, warmup_steps=4,
                                    total_steps=24)
        trainer.fit(module, datamodule=ByteDataModule(seq_len=64, batch_size=8, train_samples=24 * 8, val_batches=1),
                    ckpt_path=ckpt)
        return trainer

    with tempfile.TemporaryDirectory() as root:
        first = fit(12, root, every=12)
        anchor = str(first.strategy.synchronizer.anchor.tensors[0].device)
        resumed = fit(16, root, ckpt=str(Path(root) / "step=12.ckpt"))
    return {"anchor_device": anchor, "resumed_to": resumed.global_step, "ok": resumed.global_step == 16}
