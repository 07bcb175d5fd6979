"""Each knob has one home (a named argument, ``optimizer=`` or ``experimental=``); a preset is a knob that the
others override knob by knob; a knob passed in the wrong place is refused with its home."""

from __future__ import annotations

import re
from typing import Any

import pytest

from lightning_lordo import Experimental, LoRDOFabricStrategy, LoRDOStrategy
from lightning_lordo.strategy_knobs import EXPERIMENTAL_KNOBS, OPTIMIZER_MAPPING_KNOBS, PRESETS

STRATEGIES = [LoRDOStrategy, LoRDOFabricStrategy]
SAMPLE = {"rank": 8, "full_rank_params": ["fc"], "basis_every": 2, "seed": 3, "lowrank": False}


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", [*OPTIMIZER_MAPPING_KNOBS, *EXPERIMENTAL_KNOBS])
def test_a_knob_passed_outside_its_home_is_refused_with_the_home(cls: Any, name: str) -> None:
    value = SAMPLE.get(name, 1)
    home = "optimizer=" if name in OPTIMIZER_MAPPING_KNOBS else "experimental="
    with pytest.raises(TypeError, match=re.escape(f"got {name}={value!r}, which is not a named argument: pass it as "
                                                  f"{home}{{{name!r}: {value!r}}}")):
        cls(**{name: value})


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_a_key_in_the_wrong_mapping_is_refused_with_its_home(cls: Any) -> None:
    with pytest.raises(ValueError, match=r"got 'basis_every'.* passed as experimental=\{'basis_every': 2\}"):
        cls(optimizer={"basis_every": 2})
    with pytest.raises(ValueError, match=r"got 'rank'.* passed as optimizer=\{'rank': 8\}"):
        cls(experimental={"rank": 8})
    with pytest.raises(ValueError, match=r"got 'payload'.* passed as payload='lowrank'"):
        cls(experimental={"payload": "lowrank"})
    with pytest.raises(ValueError, match=r"got 'rnak'.*Did you mean 'rank'\?"):
        cls(optimizer={"rnak": 8})
    with pytest.raises(TypeError, match=r"\(optimizer=\['rank'\]\): it must be a mapping"):
        cls(optimizer=["rank"])


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_preset_gives_its_knobs_and_what_is_passed_overrides_them(cls: Any, preset: str) -> None:
    plain = cls(preset=preset)
    knobs = PRESETS[preset][0]
    for name, value in knobs.items():
        where = plain.optimizer_knobs.get(name) if name in plain.optimizer_knobs else \
            plain.lowrank if name == "lowrank" else getattr(plain.sync_config, name)
        assert where == value, (preset, name)
    # an explicit value overrides the preset's, also when it is the knob's default value
    overridden = cls(preset=preset, sync_every=8, payload="full", payload_dtype="float32",
                     experimental=Experimental(moments_every=1, average_fullrank_moments=False))
    assert overridden.sync_config.sync_every == 8
    assert (overridden.sync_config.payload, overridden.sync_config.payload_dtype) == ("full", "float32")
    assert (overridden.sync_config.moments_every, overridden.sync_config.average_fullrank_moments) == (1, False)


def test_the_compressed_preset_keeps_what_is_not_overridden() -> None:
    strategy = LoRDOStrategy(preset="lordo_compressed", sync_every=8, optimizer={"rank": 4})
    config = strategy.sync_config
    assert (config.payload, config.payload_dtype, config.fullrank_rank, config.moments_every) == (
        "lowrank", "int8", 16, 4)
    assert strategy.optimizer_knobs["rank"] == 4 and strategy.optimizer_knobs["error_feedback"] is False


def test_experimental_takes_the_dataclass_or_a_mapping_and_none_means_the_presets() -> None:
    a = LoRDOStrategy(preset="lordo_compressed", experimental=Experimental(basis_every=2))
    b = LoRDOStrategy(preset="lordo_compressed", experimental={"basis_every": 2, "moments_every": None})
    assert a.sync_config == b.sync_config and a.sync_config.moments_every == 4 and a.sync_config.basis_every == 2


def test_the_trainer_only_knobs_are_refused_by_fabric() -> None:
    for name, value in (("checkpoint_shards", False), ("monitor_progress_bar", True)):
        with pytest.raises(ValueError, match=rf"experimental {name}={value}: LoRDOFabricStrategy has no such"):
            LoRDOFabricStrategy(experimental={name: value})
    with pytest.raises(TypeError, match=r"monitor=False: Fabric has no callbacks"):
        LoRDOFabricStrategy(monitor=False)


def test_the_registered_names_are_the_presets() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name in PRESETS:
        for suffix in ("", "_spawn", "_fork"):
            strategy = StrategyRegistry.get(name + suffix)
            assert isinstance(strategy, LoRDOStrategy) and strategy.preset == name
            assert strategy.sync_config == LoRDOStrategy(preset=name).sync_config


def test_optimizer_keys_given_beside_a_users_lordo_are_refused_even_at_their_defaults() -> None:
    """``optimizer={"rank": 16}`` (the default value) or ``full_rank_params`` would be dropped silently when
    ``configure_optimizers`` returns a LoRDO: refused, naming them."""
    import lightning as L
    from strategy_helpers import TinyRegressor, loader

    from lightning_lordo import LoRDO

    class ReturnsLoRDO(TinyRegressor):
        def configure_optimizers(self) -> LoRDO:
            return LoRDO(self.parameters(), rank=4)

    for given in ({"rank": 16}, {"full_rank_params": ["net"]}):
        fit = L.Trainer(strategy=LoRDOStrategy(start_method="popen", monitor=False, optimizer=given),
                        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(ValueError, match=rf"optimizer knobs \({next(iter(given))}, from optimizer=.*a LoRDO"):
            fit.fit(ReturnsLoRDO(), loader())
