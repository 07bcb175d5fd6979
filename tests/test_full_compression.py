"""Everything a sync sends, compressed (issue 14): the full-rank 2-D parameters' low-rank messages
(``fullrank_rank``), the first gradient in ``payload_dtype``, ``moments_every``, and the per-sync byte breakdown.
2 processes (fork), assertions in the workers."""

from __future__ import annotations

import pickle
from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, trainer
from torch import nn

from lightning_lordo import LoRDOStrategy
from lightning_lordo.comm.communicator import CommAccountant
from lightning_lordo.comm.int8 import quantize_int8
from lightning_lordo.config import SyncConfig
from lightning_lordo.lightning.callbacks import figures
from lightning_lordo.strategy_knobs import PRESETS
from lightning_lordo.sync.payloads import FULLRANK_PART, LOWRANK_PART, PseudoGradientPayloads, compressible
from lightning_lordo.sync.report import breakdown

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

FIRST_LAYER = [r"net\.0\.weight$"]  # TinyRegressor's 24 x 12 input layer, kept full-rank here
RANK = 2


def _groups(module: nn.Module, optimizer: Any) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """The parameters by how they travel: low-rank (LoRDO), full-rank compressed at RANK, sent in full."""
    lowrank = {id(p) for p in optimizer.lowrank_params()}
    params = list(module.parameters())
    low = [p for p in params if id(p) in lowrank]
    squeezed = [p for p in params if id(p) not in lowrank and compressible(p.shape, RANK)]
    full = [p for p in params if id(p) not in lowrank and not compressible(p.shape, RANK)]
    return low, squeezed, full


# ------------------------------------------------------------------------------------------------ units
def test_compressible_only_when_the_message_is_smaller() -> None:
    assert compressible((100, 16), 2) and compressible((3, 16), 2)  # 2 * 19 = 38 < 48
    assert not compressible((4, 4), 2)  # 2 * 8 = 16: not smaller, sent in full
    assert not compressible((16,), 2) and not compressible((2, 3, 4), 1) and not compressible((100, 16), 0)


def test_payload_groups_follow_the_parameters_and_load_the_old_single_averager_state() -> None:
    """The groups by position; a state saved when a ``full`` payload had one averager for every parameter (before
    the low-rank matrices got a message of their own) loads, split by position."""
    params = [torch.zeros(8, 6), torch.zeros(50, 4), torch.zeros(4, 4), torch.zeros(6)]
    config = SyncConfig(payload_dtype="bfloat16", fullrank_rank=2)
    payloads = PseudoGradientPayloads(params, {params[0]: 2}, config)
    assert [(name, positions) for name, positions, _, _ in payloads.groups] == [
        ("lowrank", [0]), ("fullrank_matrices", [1]), ("fullrank", [2, 3])]
    assert [purpose for *_, purpose in payloads.groups] == [LOWRANK_PART, FULLRANK_PART, FULLRANK_PART]
    errors = [torch.full(p.shape, float(i + 1)) for i, p in enumerate(params)]
    plain = PseudoGradientPayloads(params, {params[0]: 2}, SyncConfig(payload_dtype="bfloat16"))
    plain.load_state_dict({"averager": {"errors": errors}})
    state = plain.state_dict()
    assert [e[0, 0].item() for e in state["lowrank_averager"]["errors"]] == [1.0]
    assert [e.reshape(-1)[0].item() for e in state["averager"]["errors"]] == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="payload='lowrank' needs the LoRDO optimizer"):
        PseudoGradientPayloads(params, None, SyncConfig(payload="lowrank"))


def test_accountant_counts_parts_under_their_purpose_and_between_rounds() -> None:
    acc = CommAccountant()
    acc.add("setup_broadcast", 1000)
    acc.start_round(parts=True)  # the setup is in no round's breakdown
    acc.add("lightning_sigterm_check", 4, in_round=False)
    acc.add(LOWRANK_PART, 100, wire=150)
    acc.add(FULLRANK_PART, 60)
    acc.add("moments", 40)
    assert acc.end_round() == {"pseudo_gradients": 160, "moments": 40}
    assert acc.totals["pseudo_gradients"] == 160 and acc.wire_totals["pseudo_gradients"] == 210
    assert breakdown(acc.last_parts) == {"lowrank_pseudo_gradients": 100, "fullrank_pseudo_gradients": 60,
                                         "moments": 40, "control": 4}
    assert breakdown(acc.last_wire_parts)["lowrank_pseudo_gradients"] == 150
    assert acc.end_round() == {} and acc.last_parts == {}


def test_moments_every_refuses_a_run_that_averages_no_moments() -> None:
    with pytest.raises(ValueError, match=r"moments_every=2.*average_moments=False"):
        LoRDOStrategy(experimental={"moments_every": 2, "average_moments": False})
    # the full-rank moments are averaged
    LoRDOStrategy(experimental={"moments_every": 2, "average_moments": False, "average_fullrank_moments": True})


# ------------------------------------------------------------------------------------------------ 2 processes
class CheckCompressedBytes(L.Callback):
    """Every sync's pseudo-gradient bytes, by part, are what the messages hold; its breakdown is in the monitor's
    figures; the full-rank compressed matrices keep error feedback; moments travel every 2nd sync only."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        optimizer = strategy.synchronizer.optimizer
        low, squeezed, full = _groups(module, optimizer)
        assert low and squeezed and full, "the model must have all three kinds"
        ranks = optimizer.lowrank_ranks()
        size = {"float32": 4, "bfloat16": 2}[self.dtype]
        lowrank_bytes = size * sum(ranks[p] * sum(p.shape) for p in low)
        fullrank_bytes = size * (sum(RANK * sum(p.shape) for p in squeezed) + sum(p.numel() for p in full))
        reports = strategy.sync_reports
        assert len(reports) == 4
        for report in reports:
            assert report.bytes_by_part[LOWRANK_PART] == lowrank_bytes
            assert report.bytes_by_part[FULLRANK_PART] == fullrank_bytes
            assert report.bytes_by_purpose["pseudo_gradients"] == lowrank_bytes + fullrank_bytes
            # moments_every=2: syncs 2 and 4 average the moments, 1 and 3 do not
            assert ("moments" in report.bytes_by_part) == (report.index % 2 == 0), report.index
            logged = figures(strategy, report)
            assert logged["bytes_sync/lowrank_pseudo_gradients"] == lowrank_bytes
            assert logged["bytes_sync/fullrank_pseudo_gradients"] == fullrank_bytes
            assert logged["bytes_sync/control"] > 0  # Lightning's per-batch flags since the previous sync
            assert logged["wire_bytes_sync/fullrank_pseudo_gradients"] > 0
            # the breakdown holds the round's bytes and what was sent since the previous sync (flags, first gradient)
            assert sum(report.bytes_by_part.values()) >= report.bytes_sent
        accountant = strategy.accountant  # every byte is in one breakdown, or the setup, or after the last sync
        # the setup: the plugin's broadcast, and Lightning's log_dir broadcast (its payload on the sender, rank 0)
        lightning_setup = 8 + len(pickle.dumps(trainer.default_root_dir)) if trainer.global_rank == 0 else 0
        assert sum(sum(r.bytes_by_part.values()) for r in reports) + accountant.totals["setup_broadcast"] + \
            lightning_setup + sum(accountant.parts.values()) == accountant.total_bytes
        assert reports[0].bytes_by_part["initial_gradients"] > 0
        state = strategy.synchronizer.payloads.state_dict()
        assert set(state) == {"lowrank", "fullrank_matrices", "averager"}
        assert [tuple(e.shape) for e in state["fullrank_matrices"]["errors"]] == [tuple(sorted(p.shape))
                                                                                   for p in squeezed]
        errors = torch.stack([e.norm() for e in state["fullrank_matrices"]["errors"]])
        assert (errors > 0).all(), "the compressed full-rank messages keep what they did not send"
        assert torch.equal(*gather(flat_params(module)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fullrank_matrices_travel_as_lowrank_messages_and_every_part_is_counted(dtype: str) -> None:
    torch.manual_seed(0)
    strategy = lordo(sync_every=4, payload="lowrank", payload_dtype=dtype, fullrank_rank=RANK, moments_every=2,
                     full_rank_params=FIRST_LAYER)
    module = TinyRegressor()
    trainer(strategy, callbacks=[CheckCompressedBytes(dtype)], max_steps=16).fit(module, loader())


class CheckFirstGradient(L.Callback):
    """The first gradient of every low-rank matrix travels once, as int8 with one float32 scale per row."""

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        low = list(strategy.synchronizer.optimizer.lowrank_params())
        packed = [quantize_int8(torch.zeros(p.shape)) for p in low]
        expected = sum(q.numel() + 4 * s.numel() for q, s in packed)
        assert strategy.accountant.totals["initial_gradients"] == expected
        assert expected < sum(4 * p.numel() for p in low) / 3  # against the float32 all-reduce it replaced


def test_first_gradient_travels_in_the_payload_dtype() -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, payload="lowrank", payload_dtype="int8"), callbacks=[CheckFirstGradient()],
            max_steps=8).fit(TinyRegressor(), loader())


class CheckDiLoCo(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        params = list(module.parameters())
        squeezed = [p for p in params if compressible(p.shape, RANK)]
        full = [p for p in params if not compressible(p.shape, RANK)]
        expected = 4 * (sum(RANK * sum(p.shape) for p in squeezed) + sum(p.numel() for p in full))
        assert [r.bytes_by_part[FULLRANK_PART] for r in strategy.sync_reports] == [expected] * 3
        assert LOWRANK_PART not in strategy.sync_reports[0].bytes_by_part
        assert expected < 4 * sum(p.numel() for p in params) / 2
        assert torch.equal(*gather(flat_params(module)))


def test_diloco_compresses_its_matrices_with_fullrank_rank() -> None:
    """Without the LoRDO optimizer every weight matrix is a full-rank parameter: DiLoCo with compressed messages."""
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, lowrank=False, fullrank_rank=RANK), callbacks=[CheckDiLoCo()],
            max_steps=12).fit(TinyRegressor(), loader())


class CheckPreset(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        config, preset = strategy.sync_config, PRESETS["lordo_compressed"][0]
        assert (config.payload, config.payload_dtype) == ("lowrank", "int8") and config.fullrank_rank > 0
        synced = {k: v for k, v in preset.items() if k in SyncConfig.__dataclass_fields__}
        assert synced and {k: getattr(config, k) for k in synced} == synced
        assert strategy.optimizer_knobs == {k: v for k, v in preset.items() if k not in synced}
        assert strategy.accountant.totals["pseudo_gradients"] < sum(p.numel() for p in module.parameters()) * 3
        assert torch.equal(*gather(flat_params(module)))


def test_lordo_compressed_is_a_registered_name_that_trains() -> None:
    torch.manual_seed(0)
    trainer("lordo_compressed_fork", callbacks=[CheckPreset()], max_steps=12).fit(TinyRegressor(), loader())


class CheckLean(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy: LoRDOStrategy = trainer.strategy
        optimizer = strategy.optimizers[0]
        group = optimizer.param_groups[0]
        assert (group["omega"], group["full_rank_input"], group["error_feedback"], group["power_iters"]) == \
            (0.7, "gradient", False, 1)
        lowrank = optimizer.lowrank_params()
        assert lowrank and not any("error_feedback" in optimizer.state[p] for p in lowrank)
        assert torch.equal(*gather(flat_params(module)))


class CheckDefaults(L.Callback):
    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        group = optimizer.param_groups[0]
        assert (group["omega"], group["full_rank_input"], group["error_feedback"], group["power_iters"]) == \
            (0.97, "accumulated", True, 3)
        lowrank = optimizer.lowrank_params()
        assert lowrank and all("error_feedback" in optimizer.state[p] for p in lowrank)


class WideRegressor(TinyRegressor):
    """TinyRegressor with a 32 x 32 middle layer: the registered names' rank (16) is below its smaller side, so it
    takes the low-rank step (no matrix of TinyRegressor does at rank 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                                 nn.Linear(32, 3))


def test_lordo_trains_with_error_feedback_by_default() -> None:
    torch.manual_seed(0)
    trainer("lordo_fork", callbacks=[CheckDefaults()], max_steps=12).fit(WideRegressor(), loader())


def test_lordo_lean_is_a_registered_name_that_trains_without_the_buffer() -> None:
    torch.manual_seed(0)
    trainer("lordo_lean_fork", callbacks=[CheckLean()], max_steps=12).fit(WideRegressor(), loader())
