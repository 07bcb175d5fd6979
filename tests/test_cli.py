"""LightningCLI and YAML configs reach every knob in its home (a named argument, ``optimizer``, ``experimental``):
flags, a config file, a preset overridden, ``--print_config`` round-tripping the values, ``--help`` listing them."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from strategy_helpers import TinyRegressor, loader

from lightning_lordo import LoRDOFabricStrategy, LoRDOStrategy
from lightning_lordo.strategy_knobs import EXPERIMENTAL_KNOBS, PRESETS


class CLIModel(TinyRegressor):
    def train_dataloader(self) -> Any:
        return loader()


BASE = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=4", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
#: A knob of each home: named distribution knobs, the optimizer mapping, the experimental dataclass.
NAMED = {"payload": "lowrank", "payload_dtype": "int8", "timeout": 60.0, "anchor_device": "cpu"}
OPTIMIZER = {"rank": 8, "omega": 0.9, "normalizer": "mean_denom", "error_feedback": False,
             "full_rank_input": "gradient", "power_iters": 2}
EXPERIMENTAL = {"warmup_steps": 2, "switch_betas": [0.99, 0.99], "switch_lr_scale": 0.5, "seed": 3}


def _cli(args: list[str]) -> LightningCLI:
    return LightningCLI(CLIModel, run=False, args=args, save_config_callback=None)


def _check(strategy: Any) -> None:
    assert isinstance(strategy, LoRDOStrategy)
    assert strategy.optimizer_knobs == OPTIMIZER
    config = strategy.sync_config
    assert (config.payload, config.payload_dtype, config.warmup_steps, config.switch_betas) == (
        "lowrank", "int8", 2, (0.99, 0.99))
    assert config.switch_lr_scale == 0.5 and config.timeout.total_seconds() == 60 and config.seed == 3
    assert config.anchor_device == "cpu"


def _value(v: Any) -> str:
    return {True: "true", False: "false"}[v] if isinstance(v, bool) else str(v).replace(" ", "")


def _flags() -> list[str]:
    return ["--trainer.strategy=lightning_lordo.LoRDOStrategy",
            *(f"--trainer.strategy.{k}={_value(v)}" for k, v in NAMED.items()),
            *(f"--trainer.strategy.optimizer.{k}={_value(v)}" for k, v in OPTIMIZER.items()),
            *(f"--trainer.strategy.experimental.{k}={_value(v)}" for k, v in EXPERIMENTAL.items())]


def test_flags_set_every_kind_of_knob_and_the_run_trains() -> None:
    cli = _cli(BASE + _flags())
    _check(cli.trainer.strategy)
    cli.trainer.fit(cli.model)
    assert cli.trainer.strategy.synchronizer.optimizer_steps == 4


def test_a_yaml_config_sets_the_knobs(tmp_path: Path) -> None:
    config = {"trainer": {"strategy": {"class_path": "lightning_lordo.LoRDOStrategy", "init_args": {
        "sync_every": 4, **NAMED, "optimizer": OPTIMIZER, "experimental": EXPERIMENTAL}}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = _cli(BASE + [f"--config={path}"])
    _check(cli.trainer.strategy)
    assert cli.trainer.strategy.sync_config.sync_every == 4


def test_a_preset_is_a_knob_the_other_knobs_override() -> None:
    """``--trainer.strategy.preset`` starts from a registered name; what else is given overrides it."""
    cli = _cli(BASE + ["--trainer.strategy=LoRDOStrategy", "--trainer.strategy.preset=lordo_compressed",
                       "--trainer.strategy.sync_every=8", "--trainer.strategy.payload_dtype=bfloat16",
                       "--trainer.strategy.experimental.moments_every=1", "--trainer.strategy.optimizer={rank: 4}"])
    strategy = cli.trainer.strategy
    config = strategy.sync_config
    assert strategy.preset == "lordo_compressed" and config.sync_every == 8
    assert (config.payload, config.payload_dtype, config.moments_every, config.fullrank_rank) == (
        "lowrank", "bfloat16", 1, 16)  # payload and fullrank_rank from the preset, the rest overridden
    assert strategy.optimizer_knobs["rank"] == 4 and strategy.optimizer_knobs["error_feedback"] is False


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_registered_name_takes_knobs_on_the_command_line(name: str) -> None:
    """``--trainer.strategy=NAME --trainer.strategy.KNOB=...``: the name's preset, the knobs over it (jsonargparse
    needs a class for knobs: ``lightning_lordo.lightning.cli_names``)."""
    knobs = [] if name == "diloco" else ["--trainer.strategy.optimizer.rank=4"]  # diloco takes no rank
    strategy = _cli(BASE + [f"--trainer.strategy={name}", "--trainer.strategy.sync_every=8", *knobs]).trainer.strategy
    expected = LoRDOStrategy(preset=name, sync_every=8, optimizer={"rank": 4} if knobs else None)
    assert isinstance(strategy, LoRDOStrategy) and strategy.preset == name
    assert strategy.sync_config == expected.sync_config and strategy.optimizer_knobs == expected.optimizer_knobs


def test_a_registered_name_alone_is_the_registry_s_and_a_yaml_name_takes_knobs(tmp_path: Path) -> None:
    alone = _cli(BASE + ["--trainer.strategy=lordo_lean"]).trainer.strategy
    assert type(alone) is LoRDOStrategy and alone.preset == "lordo_lean"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": {"class_path": "lordo_compressed",
                                                             "init_args": {"sync_every": 8}}}}))
    strategy = _cli(BASE + [f"--config={path}"]).trainer.strategy
    assert strategy.preset == "lordo_compressed" and strategy.sync_config.sync_every == 8
    assert strategy.sync_config.payload == "lowrank"


def test_print_config_round_trips_the_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli(BASE + _flags() + ["--print_config"])
    printed = capsys.readouterr().out
    init_args = yaml.safe_load(printed)["trainer"]["strategy"]["init_args"]
    for name, value in NAMED.items():
        assert init_args[name] == value, (name, init_args[name])
    assert init_args["optimizer"] == OPTIMIZER
    assert {k: init_args["experimental"][k] for k in EXPERIMENTAL} == EXPERIMENTAL
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    _check(_cli([f"--config={path}"]).trainer.strategy)


def test_help_lists_every_named_and_experimental_knob(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli(["--trainer.strategy.help=lightning_lordo.LoRDOStrategy"])
    text = capsys.readouterr().out
    names = [n for n in inspect.signature(LoRDOStrategy.__init__).parameters
             if n not in ("self", "ddp", "experimental")]
    missing = [n for n in names if f"--trainer.strategy.{n} " not in text]
    missing += [n for n in EXPERIMENTAL_KNOBS if f"--trainer.strategy.experimental.{n} " not in text]
    assert not missing, missing
    assert "PowerSGD-style" in text and "consecutive discarded rounds" in text  # the docstrings' words
    undescribed = [n for n in names  # each with its own description (jsonargparse skips "a, b: ..." entries)
                   if not re.search(rf"^  --trainer\.strategy\.{n}(?: \S+)?\n\s+(?!\(type:)\S", text, re.M)]
    assert not undescribed, undescribed


def test_a_backslash_a_dotted_flag_doubled_is_refused_not_silently_matched() -> None:
    """jsonargparse re-parses a dotted flag's list from its repr, which doubles each backslash: ``mid\\d`` became
    ``mid\\\\d``, which matches nothing, so ``inp|mid\\d`` silently kept ``mid2.weight`` low-rank."""
    with pytest.raises(ValueError, match=r"Invalid full_rank_params=.*matches a literal backslash.*"
                                         r"--trainer.strategy.optimizer='\{full_rank_params: \[...\]\}'"):
        _cli(BASE + ["--trainer.strategy=lightning_lordo.LoRDOStrategy",
                     "--trainer.strategy.optimizer.full_rank_params=[inp|mid\\d]"])
    cli = _cli(BASE + ["--trainer.strategy=lightning_lordo.LoRDOStrategy",
                       "--trainer.strategy.optimizer={full_rank_params: [net\\.0]}"])
    assert cli.trainer.strategy.core.knobs.full_rank_params == ["net\\.0"]
    with pytest.raises(ValueError, match=r"Invalid preset='lordo_fork'.*Pass preset='lordo', start_method='fork'"):
        _cli(BASE + ["--trainer.strategy=lightning_lordo.LoRDOStrategy", "--trainer.strategy.preset=lordo_fork"])


def test_the_strategy_has_at_most_15_named_arguments() -> None:
    for cls in (LoRDOStrategy, LoRDOFabricStrategy):
        named = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                 if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert len(named) <= 15, (cls.__name__, named)


def test_a_bad_value_from_the_command_line_names_the_knob() -> None:
    with pytest.raises(ValueError, match=r"Invalid rank=0: it must be an integer >= 1"):
        _cli(BASE + ["--trainer.strategy=lightning_lordo.LoRDOStrategy", "--trainer.strategy.optimizer.rank=0"])
