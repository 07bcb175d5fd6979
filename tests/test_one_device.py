"""One device is the LoRDO optimizer alone (issue 30): no anchor, no rounds, bases from the gradient every
``sync_every`` steps, and less resident memory than AdamW on Lightning's demo Transformer. A knob of the rounds, or
``synchronous=False``, asks for the rounds (and their anchor) back."""

from __future__ import annotations

import re
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lordo import LoRDOStrategy
from lightning_lordo.config import SyncConfig
from lightning_lordo.strategy_knobs import strategy_kwargs


class DemoLM(L.LightningModule):
    """Lightning's demo Transformer with the user's AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(vocab_size=2000, ninp=128, nhead=2, nhid=256, nlayers=2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self.model(x, y)
        return nn.functional.nll_loss(out, y.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(strategy: Any, steps: int = 6, callbacks: Optional[list[L.Callback]] = None) -> tuple[L.Trainer, DemoLM]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 2000, (64, 33))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    module = DemoLM()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(module, loader)
    return trainer, module


def _storage_bytes(tensors: list[Tensor], params: list[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``, the parameters' own excluded."""
    seen = {p.untyped_storage().data_ptr() for p in params}
    total = 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _state_bytes(trainer: L.Trainer, module: DemoLM) -> int:
    """What the optimizer and the strategy hold beyond the parameters and their gradients."""
    params = list(module.parameters())
    held = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, Tensor)]
    sync = getattr(trainer.strategy, "synchronizer", None)
    if sync is not None:
        held += list(sync.anchor.tensors or []) + sync.outer.momentum_buffers()
    return _storage_bytes(held, params)


def test_one_device_holds_no_anchor_and_less_state_than_adamw() -> None:
    adamw_trainer, adamw_module = _fit("auto")
    trainer, module = _fit("lordo")
    sync = trainer.strategy.synchronizer
    assert sync.config.synchronous and not sync.anchor, "one device should run the optimizer alone, without an anchor"
    assert not trainer.strategy.sync_reports or all(r.bytes_sent == 0 for r in trainer.strategy.sync_reports)
    adamw, lordo = _state_bytes(adamw_trainer, adamw_module), _state_bytes(trainer, module)
    assert lordo < adamw, f"LoRDO alone holds {lordo} B of state, AdamW {adamw} B"
    lean_trainer, lean_module = _fit("lordo_lean")
    lean = _state_bytes(lean_trainer, lean_module)
    assert lean < lordo, f"lordo_lean holds {lean} B, more than lordo's {lordo} B"  # no error-feedback buffer


def test_the_summary_of_one_device_counts_basis_refreshes_not_synchronizations() -> None:
    from rich.console import Console

    from lightning_lordo.lightning.callbacks import summary_table

    refreshes = []

    class Count(L.Callback):  # the refreshes as they happen: new bases for matrices that had one
        def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
            lordo = trainer.strategy.synchronizer.lordo
            set_bases = lordo.set_bases

            def counted(bases: Any) -> Any:
                refreshes.extend(["refresh"] if bases and all("basis" in lordo.state[p] for p in bases) else [])
                return set_bases(bases)

            lordo.set_bases = counted

    trainer, _ = _fit(LoRDOStrategy(sync_every=2, monitor=False), callbacks=[Count()])
    console = Console(record=True, width=120)
    console.print(summary_table(trainer.strategy))
    text = console.export_text()
    assert "basis refreshes (skipped)" in text and "mean refresh time" in text and "synchronizations" not in text
    assert len(refreshes) == 2  # 6 steps, every 2: before steps 3 and 5 (3 report intervals)
    assert re.search(r"basis refreshes \(skipped\)\s*\S\s*2 \(0\)", text), text
    trainer, _ = _fit(LoRDOStrategy(preset="diloco", sync_every=2, monitor=False))  # your AdamW alone: no bases
    console = Console(record=True, width=120)
    console.print(summary_table(trainer.strategy))
    text = console.export_text()
    assert re.search(r"basis refreshes \(skipped\)\s*\S\s*0 \(0\)", text) and "refresh time" not in text, text


@pytest.mark.parametrize("knobs", [{"synchronous": False}, {"basis_every": 2}, {"outer_optimizer": "nesterov"}])
def test_a_knob_of_the_rounds_asks_one_device_for_rounds(knobs: dict[str, Any]) -> None:
    trainer, _ = _fit(LoRDOStrategy(sync_every=2, monitor=False, **strategy_kwargs(**knobs)))
    sync = trainer.strategy.synchronizer
    assert not sync.config.synchronous and sync.anchor and sync.syncs_done >= 2


class BasisLog(L.Callback):
    """The basis of the largest low-rank matrix after every optimizer step."""

    def __init__(self) -> None:
        self.bases: list[Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        lordo = trainer.optimizers[0]
        p = max(lordo.lowrank_params(), key=lambda t: t.numel())
        self.bases.append(lordo.state[p]["basis"].clone())


def test_the_bases_follow_the_gradient_every_sync_every_steps_alone() -> None:
    log = BasisLog()
    torch.manual_seed(0)
    tokens = torch.randint(0, 2000, (64, 33))
    trainer = L.Trainer(strategy=LoRDOStrategy(sync_every=2, monitor=False), accelerator="cpu", devices=1,
                        max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[log])
    trainer.fit(DemoLM(), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
    changes = [i for i in range(1, 8) if not torch.equal(log.bases[i], log.bases[i - 1])]
    assert changes == [2, 4, 6], f"the basis changed after the steps {changes}, not every 2 steps"


def test_the_resolution_alone_keeps_what_the_user_set() -> None:
    assert SyncConfig().alone().synchronous is True
    assert SyncConfig(synchronous=False).alone().synchronous is False
    assert SyncConfig(warmup_steps=4).alone().synchronous is False
    assert SyncConfig(basis_scope="local", average_moments=False).alone().basis_scope == "global"
    assert SyncConfig().synchronous is None  # several processes: local rounds


def test_one_device_dispatches_nothing_between_basis_refreshes() -> None:
    """Alone, the synchronous step's gradient "average" wrote one flag per parameter and read them back at every
    step (a host read per step on an accelerator): between refreshes the step's preparation now dispatches nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: list[int] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            counts[-1] += 1
            return func(*args, **(kwargs or {}))

    class Counted(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            sync = trainer.strategy.synchronizer
            prepare = sync.before_optimizer_step

            def counted() -> None:
                counts.append(0)
                with Count():
                    prepare()

            sync.before_optimizer_step = counted

    torch.manual_seed(0)
    tokens = torch.randint(0, 2000, (64, 33))
    L.Trainer(strategy=LoRDOStrategy(sync_every=4, monitor=False), accelerator="cpu", devices=1, max_steps=6,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[Counted()]).fit(DemoLM(), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                                              batch_size=8))
    assert counts[0] > 0 and counts[4] > 0, counts  # the first bases (step 1), the refresh before step 5
    assert counts[1:4] == [0, 0, 0], counts
