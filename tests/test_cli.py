"""LightningCLI and YAML configs set every knob of the strategy by name: flags, a config file, ``--print_config``
round-tripping the values, and ``--help`` listing them all."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from strategy_helpers import TinyRegressor, loader

from lightning_lordo import LoRDOStrategy


class CLIModel(TinyRegressor):
    def train_dataloader(self) -> Any:
        return loader()


BASE = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=4", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
KNOBS = {"rank": 8, "omega": 0.9, "normalizer": "mean_denom", "payload": "lowrank", "payload_dtype": "int8",
         "warmup_steps": 2, "switch_betas": [0.99, 0.99], "switch_lr_scale": 0.5, "timeout": 60.0, "seed": 3,
         "anchor_device": "cpu", "error_feedback": False, "full_rank_input": "gradient", "power_iters": 2}


def _cli(args: list[str]) -> LightningCLI:
    return LightningCLI(CLIModel, run=False, args=args, save_config_callback=None)


def _check(strategy: Any) -> None:
    assert isinstance(strategy, LoRDOStrategy)
    assert strategy.optimizer_knobs == {k: KNOBS[k] for k in ("rank", "omega", "normalizer", "error_feedback",
                                                              "full_rank_input", "power_iters")}
    config = strategy.sync_config
    assert (config.payload, config.payload_dtype, config.warmup_steps, config.switch_betas) == (
        "lowrank", "int8", 2, (0.99, 0.99))
    assert config.switch_lr_scale == 0.5 and config.timeout.total_seconds() == 60 and config.seed == 3
    assert config.anchor_device == "cpu"


def _flags(knobs: dict[str, Any]) -> list[str]:
    out = ["--trainer.strategy=lightning_lordo.LoRDOStrategy"]
    for k, v in knobs.items():
        value = {True: "true", False: "false"}.get(v, str(v).replace(" ", "")) if isinstance(v, bool) \
            else str(v).replace(" ", "")
        out.append(f"--trainer.strategy.{k}={value}")
    return out


def test_flags_set_every_kind_of_knob_and_the_run_trains() -> None:
    cli = _cli(BASE + _flags(KNOBS))
    _check(cli.trainer.strategy)
    cli.trainer.fit(cli.model)
    assert cli.trainer.strategy.synchronizer.optimizer_steps == 4


def test_a_yaml_config_sets_the_knobs(tmp_path: Path) -> None:
    config = {"trainer": {"strategy": {"class_path": "lightning_lordo.LoRDOStrategy",
                                       "init_args": {"sync_every": 4, **KNOBS}}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = _cli(BASE + [f"--config={path}"])
    _check(cli.trainer.strategy)
    assert cli.trainer.strategy.sync_config.sync_every == 4


def test_print_config_round_trips_the_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli(BASE + _flags(KNOBS) + ["--print_config"])
    printed = capsys.readouterr().out
    init_args = yaml.safe_load(printed)["trainer"]["strategy"]["init_args"]
    for name, value in KNOBS.items():
        assert init_args[name] == value, (name, init_args[name])
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    _check(_cli([f"--config={path}"]).trainer.strategy)


def test_help_lists_every_knob(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli(["--trainer.strategy.help=lightning_lordo.LoRDOStrategy"])
    text = capsys.readouterr().out
    names = [n for n in inspect.signature(LoRDOStrategy.__init__).parameters if n not in ("self", "unknown")]
    assert len(names) > 40
    missing = [n for n in names if f"--trainer.strategy.{n} " not in text]
    assert not missing, missing
    assert "rank r per matrix" in text and "consecutive non-finite rounds" in text  # the docstring's words


def test_a_bad_value_from_the_command_line_names_the_knob() -> None:
    with pytest.raises(ValueError, match=r"Invalid rank=0: it must be an integer >= 1"):
        _cli(BASE + ["--trainer.strategy=lightning_lordo.LoRDOStrategy", "--trainer.strategy.rank=0"])
