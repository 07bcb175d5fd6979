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
    # an explicit value overrides the preset's, also when it is the knob's default value (moments_every shapes the
    # low-rank moments' rounds, which DiLoCo's optimizer has not: refused there, test_inputs.py)
    moments_every = {"moments_every": 1} if knobs.get("lowrank", True) else {}
    overridden = cls(preset=preset, sync_every=8, payload="full", payload_dtype="float32",
                     experimental=Experimental(**moments_every, average_fullrank_moments=False))
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


@pytest.mark.parametrize(("preset", "passed", "gone", "kept"), [
    ("lordo_lean", {"optimizer": {"projection": "svd"}}, "power_iters", {"omega": 0.7, "error_feedback": False}),
    ("lordo_lean", {"optimizer": {"update": "subspace_qh"}}, "full_rank_input", {"power_iters": 1}),
    ("lordo_compressed", {"experimental": {"synchronous": True}}, "payload", {"error_feedback": False}),
    ("lordo_compressed", {"experimental": {"average_moments": False, "average_fullrank_moments": False}},
     "moments_every", {"payload": "lowrank", "payload_dtype": "int8"}),
])
def test_a_presets_value_that_the_knobs_passed_make_meaningless_gives_way(preset: str, passed: dict[str, Any],
                                                                         gone: str, kept: dict[str, Any]) -> None:
    """The preset's value is not blamed on the user (who could not drop it): it gives way, and the rest stays."""
    strategy = LoRDOStrategy(preset=preset, **passed)
    config, knobs = strategy.sync_config, strategy.optimizer_knobs
    assert gone not in knobs and getattr(config, gone, None) in (None, LoRDOStrategy().sync_config.__dict__.get(gone))
    for name, value in kept.items():
        assert (knobs[name] if name in knobs else getattr(config, name)) == value, name


def test_a_knob_the_presets_values_make_meaningless_is_refused_naming_the_preset() -> None:
    with pytest.raises(ValueError, match=re.escape("ef_dtype='bfloat16' with error_feedback=False") + ".*" +
                       re.escape("(preset='lordo_compressed' sets {'error_feedback': False})")):
        LoRDOStrategy(preset="lordo_compressed", optimizer={"ef_dtype": "bfloat16"})
    with pytest.raises(ValueError, match=re.escape("(preset='lordo_local' sets {'basis_scope': 'local'})")):
        LoRDOStrategy(preset="lordo_local", experimental={"average_moments": True})


def test_a_conflict_among_the_users_own_knobs_does_not_name_the_preset() -> None:
    with pytest.raises(ValueError) as info:
        LoRDOStrategy(preset="lordo_lean", optimizer={"omega": 1.0, "normalizer": "scalar"})
    assert "normalizer='scalar' with omega=1.0" in str(info.value) and "preset=" not in str(info.value)


def test_a_default_value_passed_as_an_int_is_the_default() -> None:
    """``bucket_cap_mb=64`` is the default 64.0, as the command line's parser passes it: not refused as set."""
    assert LoRDOStrategy(outer_optimizer="nesterov", bucket_cap_mb=64).sync_config.bucket_cap_mb == 64
    with pytest.raises(ValueError, match=r"bucket_cap_mb=65"):
        LoRDOStrategy(outer_optimizer="nesterov", bucket_cap_mb=65)


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_an_experimental_passed_as_optimizer_is_refused(cls: Any) -> None:
    with pytest.raises(TypeError, match=r"optimizer=Experimental\(.*an Experimental goes in experimental="):
        cls(optimizer=Experimental(basis_every=2))


def test_every_strategy_and_optimizer_the_readme_builds_builds() -> None:
    """The README's examples are run as written (those with ``...`` are sketches), so that none goes stale."""
    from pathlib import Path

    import torch

    from lightning_lordo import LoRDO

    text = (Path(__file__).parents[1] / "README.md").read_text()
    found = []
    for match in re.finditer(r"\b(LoRDOStrategy|LoRDOFabricStrategy|LoRDO)\(", text):
        end, depth = match.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        found.append(text[match.start():end])
    runnable = [call for call in found if "..." not in call]
    assert len(runnable) >= 3, found
    model = torch.nn.Linear(64, 64)
    for call in runnable:
        eval(call, {"LoRDOStrategy": LoRDOStrategy, "LoRDOFabricStrategy": LoRDOFabricStrategy, "LoRDO": LoRDO,
                    "Experimental": Experimental, "model": model})


def test_a_sync_knob_the_optimizer_that_trains_would_ignore_is_refused_at_setup() -> None:
    """What the strategy cannot tell before it sees the optimizer: averaging error feedback that a lean LoRDO does
    not keep, a seed beside a returned LoRDO's own, ``oversample`` of a returned LoRDO whose first bases are random,
    a ``full_rank_params`` pattern that matches nothing; on one process, one warning for what only travels; and a
    preset's optimizer values beside a returned LoRDO give way, with a warning."""
    import lightning as L
    from strategy_helpers import TinyRegressor, loader

    from lightning_lordo import LoRDO

    class ReturnsLoRDO(TinyRegressor):
        def configure_optimizers(self) -> LoRDO:
            return LoRDO(self.parameters(), rank=2, seed=1)

    def fit(model: Any, **kwargs: Any) -> None:
        L.Trainer(strategy=LoRDOStrategy(start_method="popen", monitor=False, **kwargs), accelerator="cpu", devices=1,
                  max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(model, loader())

    class Oversampled(TinyRegressor):
        def configure_optimizers(self) -> LoRDO:
            return LoRDO(self.parameters(), rank=2, oversample=8)

    refused = [
        (Oversampled, {"experimental": {"initial_basis": "random"}}, "oversample with initial_basis='random'"),
        (TinyRegressor, {"preset": "lordo_lean", "experimental": {"average_error_feedback": True}},
         "average_error_feedback=True: it shapes what a sync does with LoRDO's error-feedback buffers"),
        (ReturnsLoRDO, {"experimental": {"seed": 5}}, "the LoRDO you return has seed=1"),
        (TinyRegressor, {"optimizer": {"full_rank_params": ["no_such_layer"]}}, "['no_such_layer'] match no"),
    ]
    for model, kwargs, shown in refused:
        with pytest.raises(ValueError, match=re.escape(shown)):
            fit(model(), **kwargs)
    fit(TinyRegressor(), preset="diloco", experimental={"seed": 5, "fullrank_rank": 2})  # the messages' seed: used
    fit(ReturnsLoRDO(), experimental={"seed": 1})  # the same seed in both places
    fit(Oversampled())  # the first bases come from the gradient: oversample shapes them
    with pytest.warns(UserWarning, match=r"one process: payload_dtype='int8' shape what travels"):
        fit(TinyRegressor(), payload_dtype="int8")
    with pytest.warns(UserWarning, match=r"one process: average_moments=False, bucket_cap_mb=1.0 shape what"):
        fit(TinyRegressor(), bucket_cap_mb=1.0, experimental={"average_moments": False})
    with pytest.warns(UserWarning, match=r"returned a LoRDO, whose own knobs train: the preset's optimizer values "
                      r"\{'omega': 0.7, .*\} give way"):
        fit(ReturnsLoRDO(), preset="lordo_lean")
