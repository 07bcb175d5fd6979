"""Bad input is refused when the strategy or the optimizer is built, before any process is launched.

Every knob of ``LoRDOStrategy`` (optimizer knobs, ``SyncConfig`` fields, its own arguments) gets at least one
bad value (wrong type, out of range, a bool where a number is expected, NaN/inf where a number is expected)
and one good value. A bad value raises ``ValueError`` naming the argument, showing the value (its ``repr``) and
saying what is allowed; a good value is stored as given.
"""

from __future__ import annotations

import math
import multiprocessing
import re
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_lordo  # noqa: F401  (registers the strategy names)
from lightning_lordo import LoRDO, LoRDOStrategy, SyncConfig
from lightning_lordo.config import OPTIMIZER_DEFAULTS
from lightning_lordo.strategy_knobs import strategy_kwargs

NAN, INF = float("nan"), float("inf")
FROM_USER_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
STRATEGY_OPTIMIZER_KNOBS = tuple(k for k in OPTIMIZER_DEFAULTS if k not in FROM_USER_OPTIMIZER)
SYNC_KNOBS = tuple(SyncConfig.__dataclass_fields__)
OWN_ARGS = ("lowrank", "monitor", "start_method", "full_rank_params", "preset", "checkpoint_shards",
            "monitor_progress_bar")

# (argument, bad value, what the message must show of it). ``shown`` is repr(value) unless a part is blamed.
BAD: list[tuple[str, Any, str]] = [
    # optimizer knobs
    ("rank", 0, "0"), ("rank", -2, "-2"), ("rank", 1.5, "1.5"), ("rank", True, "True"), ("rank", NAN, "nan"),
    ("rank", INF, "inf"), ("rank", "16", "'16'"), ("rank", 0.0, "0.0"),
    ("omega", -0.1, "-0.1"), ("omega", 1.5, "1.5"), ("omega", True, "True"), ("omega", NAN, "nan"),
    ("omega", "0.7", "'0.7'"),
    ("mu", 0.0, "0.0"), ("mu", -1.0, "-1.0"), ("mu", NAN, "nan"), ("mu", INF, "inf"), ("mu", True, "True"),
    ("mu", "Auto", "'Auto'"),
    ("normalizer", "rms", "'rms'"), ("normalizer", None, "None"),
    ("lifted_floor", 0.0, "0.0"), ("lifted_floor", -0.1, "-0.1"), ("lifted_floor", NAN, "nan"),
    ("lifted_floor", INF, "inf"), ("lifted_floor", True, "True"),
    ("projection", "qr", "'qr'"), ("projection", 1, "1"),
    ("power_iters", 0, "0"), ("power_iters", 2.0, "2.0"), ("power_iters", True, "True"),
    ("oversample", -1, "-1"), ("oversample", 2.5, "2.5"), ("oversample", True, "True"),
    ("transition", "rotated", "'rotated'"),
    ("error_feedback", 1, "1"), ("error_feedback", "on", "'on'"),
    ("ef_dtype", "float16", "'float16'"), ("ef_dtype", torch.bfloat16, "torch.bfloat16"),
    ("fullrank_state", "adafactor", "'adafactor'"), ("fullrank_state", None, "None"),
    ("ef_decay", 0.0, "0.0"), ("ef_decay", 1.5, "1.5"), ("ef_decay", NAN, "nan"), ("ef_decay", True, "True"),
    ("ef_decay", "beta1", "'beta1'"), ("update_scale", 0.0, "0.0"), ("update_scale", -1.0, "-1.0"),
    ("update_scale", INF, "inf"), ("update_scale", "rms", "'rms'"), ("update_scale", True, "True"),
    ("update", "qh", "'qh'"), ("update", None, "None"),
    ("full_rank_input", "grad", "'grad'"), ("full_rank_input", True, "True"),
    ("variance_clamp", 1, "1"), ("variance_clamp", "yes", "'yes'"),
    # synchronization knobs
    ("sync_every", 0, "0"), ("sync_every", -4, "-4"), ("sync_every", 4.0, "4.0"), ("sync_every", True, "True"),
    ("sync_every", None, "None"),
    ("outer_optimizer", "adam", "'adam'"), ("outer_optimizer", None, "None"),
    ("outer_lr", 0.0, "0.0"), ("outer_lr", -0.7, "-0.7"), ("outer_lr", NAN, "nan"), ("outer_lr", INF, "inf"),
    ("outer_lr", True, "True"),
    ("outer_momentum", 1.0, "1.0"), ("outer_momentum", -0.1, "-0.1"), ("outer_momentum", NAN, "nan"),
    ("outer_momentum", True, "True"),
    ("average_moments", 1, "1"), ("average_moments", "yes", "'yes'"),
    ("basis_scope", "globl", "'globl'"),
    ("initial_basis", "zeros", "'zeros'"),
    ("payload", "powersgd", "'powersgd'"),
    ("payload_dtype", "float16", "'float16'"), ("payload_dtype", "fp8", "'fp8'"),
    ("broadcast_bases", 0, "0"),
    ("timeout", 0, "0"), ("timeout", -5.0, "-5.0"), ("timeout", NAN, "nan"), ("timeout", INF, "inf"),
    ("timeout", True, "True"), ("timeout", "30", "'30'"), ("timeout", timedelta(0), repr(timedelta(0))),
    ("timeout", timedelta(seconds=-1), repr(timedelta(seconds=-1))), ("timeout", 0.001, "0.001"),
    ("timeout", 1e15, "1000000000000000.0"), ("timeout", timedelta(days=400), repr(timedelta(days=400))),
    ("max_skipped_syncs", 0, "0"), ("max_skipped_syncs", 2.0, "2.0"),
    ("seed", 1.5, "1.5"), ("seed", True, "True"), ("seed", "0", "'0'"),
    ("average_fullrank_moments", 1, "1"), ("average_error_feedback", "no", "'no'"),
    ("warmup_steps", -1, "-1"), ("warmup_steps", 2.5, "2.5"), ("warmup_steps", True, "True"),
    ("synchronous", 1, "1"), ("switch_reset_moments", 1, "1"), ("preset", "lordo2", "'lordo2'"),
    ("checkpoint_shards", 1, "1"), ("monitor_progress_bar", 1, "1"),
    ("switch_betas", 0.9, "0.9"), ("switch_betas", (0.9, 1.0), "(0.9, 1.0)"),
    ("switch_betas", (NAN, 0.9), "(nan, 0.9)"),
    ("switch_lr_scale", 0.0, "0.0"), ("switch_lr_scale", -2.0, "-2.0"), ("switch_lr_scale", INF, "inf"),
    ("switch_lr_scale", True, "True"),
    ("anchor_device", "gpu", "'gpu'"), ("anchor_device", None, "None"),
    ("fullrank_rank", -1, "-1"), ("fullrank_rank", 2.0, "2.0"), ("fullrank_rank", True, "True"),
    ("moments_every", 0, "0"), ("moments_every", 1.5, "1.5"),
    ("basis_every", 0, "0"), ("basis_every", 2.0, "2.0"), ("basis_every", True, "True"),
    ("overlap_steps", -1, "-1"), ("overlap_steps", 16, "16"), ("overlap_steps", 1.0, "1.0"),
    ("bucket_cap_mb", 0, "0"), ("bucket_cap_mb", INF, "inf"), ("bucket_cap_mb", "25", "'25'"),
    # the strategy's own arguments
    ("lowrank", 1, "1"), ("lowrank", "yes", "'yes'"),
    ("monitor", 0, "0"), ("monitor", None, "None"),
    ("start_method", "thread", "'thread'"), ("start_method", None, "None"),
    ("full_rank_params", 5, "5"), ("full_rank_params", "head", "'head'"), ("full_rank_params", [3], "[3]"),
    ("full_rank_params", ["("], "['(']"),
]

# (argument, good value); a third element gives the other knobs it needs (e.g. ef_dtype needs error feedback)
GOOD: list[tuple[Any, ...]] = [
    ("rank", 8), ("rank", 0.25), ("rank", 1.0), ("omega", 0.0), ("omega", 1.0), ("omega", 1), ("mu", "auto"),
    ("mu", 2), ("normalizer", "lifted"), ("normalizer", "factored"), ("normalizer", "mean_denom"),
    ("lifted_floor", 0.05, {"normalizer": "lifted"}),
    ("projection", "randomized"), ("projection", "svd"), ("power_iters", 3),
    ("oversample", 0, {"projection": "randomized"}),
    ("transition", "reset"), ("transition", "keep"), ("error_feedback", True),
    ("ef_dtype", "bfloat16", {"error_feedback": True}), ("ef_decay", 0.9, {"error_feedback": True}),
    ("fullrank_state", "factored"),
    ("ef_decay", 1, {"error_feedback": True}), ("update_scale", 1.0, {}), ("update_scale", 2, {}),
    ("update", "subspace_qh"), ("update", "unnormalized_lowrank"), ("full_rank_input", "gradient"),
    ("full_rank_input", "accumulated", {"error_feedback": True}), ("variance_clamp", True),
    ("average_fullrank_moments", True), ("average_error_feedback", True), ("warmup_steps", 0),
    ("warmup_steps", 100), ("synchronous", True), ("switch_betas", (0.999, 0.999), {"warmup_steps": 8}),
    ("switch_reset_moments", True, {"warmup_steps": 8}), ("switch_lr_scale", 0.5, {"warmup_steps": 8}),
    ("anchor_device", "cpu"), ("anchor_device", "param"), ("anchor_device", "auto"), ("bucket_cap_mb", 25),
    ("bucket_cap_mb", 0.5), ("ef_dtype", "auto", {"error_feedback": True}),
    ("fullrank_rank", 0), ("fullrank_rank", 4), ("moments_every", 1), ("moments_every", 4),
    ("basis_every", 1), ("basis_every", 8),
    ("overlap_steps", 0), ("overlap_steps", 15),
    ("sync_every", 1), ("sync_every", 1000), ("outer_optimizer", "nesterov"),
    ("outer_lr", 1.0, {"outer_optimizer": "nesterov"}),
    ("outer_lr", 2, {"outer_optimizer": "nesterov"}), ("outer_momentum", 0.0, {"outer_optimizer": "nesterov"}),
    ("outer_momentum", 0.95, {"outer_optimizer": "nesterov"}), ("average_moments", False), ("basis_scope", "local"),
    ("initial_basis", "random"), ("payload", "full"), ("payload", "lowrank"),
    ("payload_dtype", "float32"), ("payload_dtype", "bfloat16"), ("payload_dtype", "int8"), ("broadcast_bases", True),
    ("timeout", 5), ("timeout", 1.0), ("timeout", timedelta(minutes=1)), ("timeout", 3600 * 24 * 365),
    ("seed", 7), ("seed", 0), ("max_skipped_syncs", 1), ("max_skipped_syncs", 10),
    ("lowrank", False), ("monitor", False), ("start_method", "spawn"), ("start_method", "fork"),
    ("full_rank_params", [r"fc\.weight$"]), ("full_rank_params", ()), ("preset", "lordo_compressed"),
    ("checkpoint_shards", False), ("monitor_progress_bar", True),
]


def _id(name: str, value: Any) -> str:
    return f"{name}={value!r}"


def test_the_lists_cover_every_knob() -> None:
    """Adding a knob without a bad and a good value here fails this test."""
    every = set(STRATEGY_OPTIMIZER_KNOBS) | set(SYNC_KNOBS) | set(OWN_ARGS)
    assert {name for name, _, _ in BAD} == every
    assert {good[0] for good in GOOD} == every


@pytest.mark.parametrize(("name", "value", "shown"), BAD, ids=[_id(n, v) for n, v, _ in BAD])
def test_strategy_refuses_a_bad_value_naming_it(name: str, value: Any, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        LoRDOStrategy(**strategy_kwargs(**{name: value}))
    message = str(info.value)
    assert f"{name}={shown}" in message, message  # the argument and the value as the user wrote it
    assert re.search(r"must be|allowed values|Pass valid", message), message  # and what is allowed


@pytest.mark.parametrize("good", GOOD, ids=[_id(g[0], g[1]) for g in GOOD])
def test_strategy_accepts_a_good_value(good: tuple[Any, ...]) -> None:
    name, value = good[:2]
    strategy = LoRDOStrategy(**strategy_kwargs(**{name: value}, **(good[2] if len(good) > 2 else {})))
    if name in STRATEGY_OPTIMIZER_KNOBS:  # the knobs passed on to LoRDO: those set to another value than its default
        assert strategy.optimizer_knobs.get(name, OPTIMIZER_DEFAULTS[name]) == value
    elif name == "timeout":
        expected = value if isinstance(value, timedelta) else timedelta(seconds=value)
        assert strategy.sync_config.timeout == expected
        assert strategy._timeout == expected  # the process group gets the same timeout
    elif name in SYNC_KNOBS:
        assert getattr(strategy.sync_config, name) == value
    elif name == "full_rank_params":
        assert [p.pattern for p in strategy.core.full_rank_patterns] == list(value)
    elif name == "start_method":
        assert strategy._start_method == value
    else:
        assert getattr(strategy, name) == value


@pytest.mark.parametrize("name", FROM_USER_OPTIMIZER)
def test_strategy_refuses_knobs_that_come_from_the_users_optimizer(name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b.*configure_optimizers") as info:
        LoRDOStrategy(**{name: OPTIMIZER_DEFAULTS[name]})
    assert "LR schedulers" in str(info.value) or "Set them there" in str(info.value)


@pytest.mark.parametrize("name", ["sync_evry", "rnak", "learning_rate", "find_unused_parameters"])
def test_strategy_refuses_unknown_keywords_with_type_error(name: str) -> None:
    with pytest.raises(TypeError, match=name) as info:
        LoRDOStrategy(**{name: 1})
    assert "sync_every" in str(info.value) and "optimizer" in str(info.value)  # it lists what is known


IGNORED_COMBINATIONS: list[tuple[dict[str, Any], str]] = [
    ({"update": "subspace_qh", "normalizer": "scalar"}, "normalizer='scalar'"),
    ({"update": "subspace_qh", "mu": "auto"}, "mu='auto'"),
    ({"update": "subspace_qh", "full_rank_input": "gradient"}, "full_rank_input='gradient'"),
    ({"error_feedback": False, "ef_dtype": "bfloat16"}, "ef_dtype='bfloat16'"),
    ({"error_feedback": False, "ef_decay": 0.5}, "ef_decay=0.5"),
    ({"switch_lr_scale": 2.0}, "switch_lr_scale=2.0"),
    ({"switch_betas": (0.99, 0.99)}, "switch_betas=(0.99, 0.99)"),
    ({"switch_reset_moments": True}, "switch_reset_moments=True"),
    ({"synchronous": True, "payload": "lowrank"}, "payload='lowrank'"),
    ({"synchronous": True, "outer_optimizer": "nesterov"}, "outer_optimizer='nesterov'"),
    ({"synchronous": True, "warmup_steps": 10}, "warmup_steps=10"),
    ({"synchronous": True, "basis_scope": "local"}, "basis_scope='local'"),
    ({"broadcast_bases": True, "basis_scope": "local"}, "broadcast_bases=True"),
    ({"omega": 1.0, "normalizer": "scalar"}, "normalizer='scalar' with omega=1.0"),
    ({"omega": 1.0, "mu": 5.0}, "mu=5.0 with omega=1.0"),
    ({"transition": "keep", "variance_clamp": True}, "variance_clamp=True with transition='keep'"),
    ({"projection": "svd", "oversample": 4}, "oversample=4 with projection='svd'"),  # its default value, passed
    ({"synchronous": True, "average_moments": False}, "average_moments=False"),
    ({"synchronous": True, "max_skipped_syncs": 1}, "max_skipped_syncs=1"),
    ({"synchronous": True, "bucket_cap_mb": 1.0}, "bucket_cap_mb=1.0"),
    ({"overlap_steps": 1, "bucket_cap_mb": 1.0}, "bucket_cap_mb=1.0"),
    ({"lowrank": False, "initial_basis": "random"}, "initial_basis='random'"),
    ({"lowrank": False, "average_moments": True}, "average_moments=True"),
    ({"lowrank": False, "seed": 5}, "seed=5"),
    ({"lowrank": False, "basis_every": 1}, "basis_every=1"),  # the default, passed
    ({"lowrank": False, "moments_every": 1}, "moments_every=1"),
    ({"error_feedback": False, "full_rank_input": "accumulated"}, "full_rank_input='accumulated'"),
    ({"basis_scope": "local", "average_moments": True}, "average_moments=True"),
    ({"outer_optimizer": "nesterov", "bucket_cap_mb": 1.0}, "bucket_cap_mb=1.0"),
    ({"basis_every": 2, "bucket_cap_mb": 1.0}, "bucket_cap_mb=1.0"),
    ({"payload_dtype": "bfloat16", "bucket_cap_mb": 1.0}, "bucket_cap_mb=1.0"),
    ({"synchronous": True, "anchor_device": "param"}, "anchor_device='param'"),
    ({"lowrank": False, "rank": 16}, "rank=16 with lowrank=False"),  # the default rank, passed
]


def test_the_accumulated_input_without_error_feedback_is_refused_by_the_optimizer() -> None:
    """``full_rank_input="accumulated"`` is the default, and passed it is refused (the strategy's case is in
    :data:`IGNORED_COMBINATIONS`)."""
    w = nn.Parameter(torch.randn(8, 8))
    given = {"error_feedback": False, "full_rank_input": "accumulated"}
    with pytest.raises(ValueError, match=r"full_rank_input='accumulated' with error_feedback=False"):
        LoRDO([w], rank=2, **given)
    with pytest.raises(ValueError, match=r"full_rank_input='accumulated' with error_feedback=False"):
        LoRDO([{"params": [w], **given}], rank=2)
    LoRDO([w], rank=2, error_feedback=False)  # the default input with the buffer off is the gradient: accepted


@pytest.mark.parametrize(("knobs", "shown"), IGNORED_COMBINATIONS, ids=[s for _, s in IGNORED_COMBINATIONS])
def test_a_knob_the_configuration_would_ignore_is_refused(knobs: dict[str, Any], shown: str) -> None:
    """Nothing is silently ignored: a knob that has no effect with the other knobs given is refused, naming it."""
    with pytest.raises(ValueError) as info:
        LoRDOStrategy(**strategy_kwargs(**knobs))
    assert shown in str(info.value) and re.search(r"must be|would be ignored|only applies", str(info.value))
    optimizer_knobs = {k: v for k, v in knobs.items() if k in OPTIMIZER_DEFAULTS}
    if optimizer_knobs == knobs:  # the optimizer alone refuses it too, and in a param group
        w = nn.Parameter(torch.randn(8, 8))
        with pytest.raises(ValueError, match=re.escape(shown)):
            LoRDO([w], rank=2, **knobs)
        with pytest.raises(ValueError, match=re.escape(shown)):
            LoRDO([{"params": [w], **knobs}], rank=2)


def test_sync_config_alone_validates_the_same_way() -> None:
    with pytest.raises(ValueError, match=re.escape("sync_every=0")):
        SyncConfig(sync_every=0)
    with pytest.raises(ValueError, match=re.escape("outer_momentum=nan")):
        SyncConfig(outer_momentum=NAN)
    assert SyncConfig(timeout=3).timeout == timedelta(seconds=3)


# ------------------------------------------------------------------------------------------ the optimizer
OPTIMIZER_BAD: list[tuple[str, Any, str]] = [
    ("lr", -1e-3, "lr=-0.001"), ("lr", NAN, "lr=nan"), ("lr", INF, "lr=inf"), ("lr", True, "lr=True"),
    ("lr", "1e-3", "lr='1e-3'"),
    ("betas", (NAN, 0.999), "betas[0]=nan"), ("betas", (0.9, True), "betas[1]=True"), ("betas", 0.9, "betas=0.9"),
    ("betas", (0.9, 0.99, 0.9), "betas=(0.9, 0.99, 0.9)"),
    ("eps", INF, "eps=inf"), ("eps", NAN, "eps=nan"), ("eps", True, "eps=True"),
    ("weight_decay", NAN, "weight_decay=nan"), ("weight_decay", INF, "weight_decay=inf"),
    ("weight_decay", True, "weight_decay=True"),
    ("seed", 1.5, "seed=1.5"), ("seed", "0", "seed='0'"), ("seed", True, "seed=True"),
    ("full_rank", None, "full_rank=None"), ("full_rank", 3, "full_rank=3"), ("full_rank", [3], "full_rank=[3]"),
] + [(n, v, f"{n}={s}") for n, v, s in BAD if n in STRATEGY_OPTIMIZER_KNOBS]


@pytest.mark.parametrize(("name", "value", "shown"), OPTIMIZER_BAD, ids=[_id(n, v) for n, v, _ in OPTIMIZER_BAD])
def test_optimizer_refuses_a_bad_value_naming_it(name: str, value: Any, shown: str) -> None:
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError) as info:
        LoRDO([w], **{name: value})
    assert shown in str(info.value), str(info.value)
    assert re.search(r"must be|allowed values", str(info.value)), str(info.value)


def test_optimizer_refuses_a_bad_value_in_a_param_group_before_any_step() -> None:
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=re.escape("omega=nan")):
        LoRDO([{"params": [w], "omega": NAN}], rank=2)
    opt = LoRDO([{"params": [w], "rank": 0}], rank=2, seed=-3, full_rank=(p for p in [w]))  # good values
    w.grad = torch.ones_like(w)
    opt.step()
    assert torch.isfinite(w).all()


@pytest.mark.parametrize(("group", "shown"), [({"seed": 3}, "seed=3"), ({"foreach": False}, "foreach=False"),
                                               ({"amsgrad": True}, "amsgrad")])
def test_a_param_group_key_that_would_be_ignored_is_refused_and_the_group_not_added(group: dict[str, Any],
                                                                                    shown: str) -> None:
    """An argument of the whole optimizer, or an Adam mode LoRDO lacks; other keys (a scheduler's, the user's own)
    pass as torch's optimizers let them."""
    w, v = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    opt = LoRDO([w], rank=2)
    with pytest.raises(ValueError, match=re.escape(shown)):
        opt.add_param_group({"params": [v], **group})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [v], "initial_lr": 0.1, "name": "mine", "amsgrad": False})


def test_a_key_close_to_a_knob_name_is_kept_with_a_warning_not_refused() -> None:
    """A misspelt knob (``rnak``) and the user's own tag that looks like a knob (``no_decay``, ``lr_decay``: layer-wise
    decay schedules read them) are indistinguishable: torch keeps both, so LoRDO keeps them too and names the knob
    it may have meant, in the user's line."""
    w, v = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    with pytest.warns(UserWarning, match="'no_decay' is not a knob.*Did you mean 'ef_decay'") as caught:
        opt = LoRDO([{"params": [w], "no_decay": True, "lr_decay": 0.75}], rank=2)
    assert all(r.filename == __file__ for r in caught)
    with pytest.warns(UserWarning, match="'rnak' is not a knob.*Did you mean 'rank'"):
        opt.add_param_group({"params": [v], "rnak": 0})
    assert [g.get("no_decay") for g in opt.param_groups] == [True, None] and opt.param_groups[1]["rnak"] == 0
    assert opt.param_groups[1]["rank"] == 2  # the misspelt knob is not read


@pytest.mark.parametrize("lr", [torch.tensor(-1.0), torch.tensor(NAN), torch.tensor([1e-3, 1e-3])], ids=str)
def test_a_tensor_lr_must_hold_one_finite_number_at_least_zero(lr: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"Invalid lr=.*a tensor lr must hold one finite number >= 0"):
        LoRDO([nn.Parameter(torch.randn(8, 8))], lr=lr, rank=2)
    LoRDO([nn.Parameter(torch.randn(8, 8))], lr=torch.tensor(1e-3), rank=2)


def test_optimizer_seed_reaches_random_bases() -> None:
    """The validated seed is the one random bases come from: same seed, same basis; another seed, another."""
    def basis(seed: int) -> torch.Tensor:
        w = nn.Parameter(torch.randn(8, 8))
        opt = LoRDO([w], rank=2, seed=seed)
        opt.init_random_bases()
        return opt.state[w]["basis"]

    assert torch.equal(basis(3), basis(3)) and not torch.equal(basis(3), basis(4))


# ------------------------------------------------------------------------------------------ strategy names
PRESETS = {"lordo": dict(lowrank=True, basis_scope="global", average_moments=True, synchronous=False),
           "lordo_local": dict(lowrank=True, basis_scope="local", average_moments=False, synchronous=False),
           "diloco": dict(lowrank=False, basis_scope="global", average_moments=True, synchronous=False),
           "lowrank_ddp": dict(lowrank=True, basis_scope="global", average_moments=True, synchronous=True),
           "lordo_compressed": dict(lowrank=True, basis_scope="global", average_moments=True, synchronous=False),
           "lordo_lean": dict(lowrank=True, basis_scope="global", average_moments=True, synchronous=False)}
#: The optimizer knobs a preset sets (the others set none): the lean ones, spelled out (not read from the package).
LEAN = {"omega": 0.7, "full_rank_input": "gradient", "error_feedback": False, "power_iters": 1}
PRESET_OPTIMIZER_KNOBS = {"lordo_lean": LEAN, "lordo_compressed": LEAN}
LAUNCHERS = {"": "popen", "_fork": "fork", "_spawn": "spawn"}


@pytest.mark.parametrize("suffix", list(LAUNCHERS))
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_names_build_a_trainer_without_launching_anything(name: str, suffix: str) -> None:
    fit = L.Trainer(strategy=name + suffix, accelerator="cpu", devices=2, max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    strategy = fit.strategy
    assert isinstance(strategy, LoRDOStrategy)
    assert strategy._start_method == LAUNCHERS[suffix]
    preset = PRESETS[name]
    assert strategy.lowrank is preset["lowrank"]
    assert strategy.sync_config.basis_scope == preset["basis_scope"]
    assert strategy.sync_config.average_moments is preset["average_moments"]
    assert bool(strategy.sync_config.synchronous) is preset["synchronous"]  # None: decided by the world size
    assert strategy.sync_config.sync_every == 16
    assert strategy.optimizer_knobs == PRESET_OPTIMIZER_KNOBS.get(name, {})
    assert strategy.num_processes == 2 and strategy.launcher is not None
    # nothing was launched: no process group, no child process, no synchronizer yet
    assert not (dist.is_available() and dist.is_initialized())
    assert multiprocessing.active_children() == []
    assert strategy.synchronizer is None and strategy.accountant.total_bytes == 0


def test_each_trainer_gets_its_own_strategy_instance() -> None:
    first = L.Trainer(strategy="lordo", accelerator="cpu", devices=1, logger=False)
    second = L.Trainer(strategy="lordo", accelerator="cpu", devices=1, logger=False)
    assert first.strategy is not second.strategy
    assert first.strategy.sync_config is not second.strategy.sync_config
    assert math.isclose(first.strategy.sync_config.timeout.total_seconds(), 1800.0)


@pytest.mark.parametrize(("knobs", "named"), [
    ({"outer_lr": 1.0}, "outer_lr=1.0: it only applies to outer_optimizer"),
    ({"outer_momentum": 0.5}, "outer_momentum=0.5: it only applies"),
    ({"projection": "svd", "power_iters": 2}, "power_iters=2 with projection='svd'"),
    ({"projection": "svd", "oversample": 8}, "oversample=8 with projection='svd'"),
    ({"lifted_floor": 0.2}, "lifted_floor=0.2 with normalizer='col_rms'"),
    ({"lowrank": False, "rank": 8}, "rank=8 with lowrank=False"), ({"lowrank": False, "omega": 0.5}, "omega=0.5"),
], ids=["outer_lr", "outer_momentum", "power_iters", "oversample", "lifted_floor", "diloco-rank", "diloco-omega"])
def test_a_knob_that_the_others_make_meaningless_is_refused(knobs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        LoRDOStrategy(**strategy_kwargs(**knobs))


def test_the_strategys_optimizer_knobs_are_refused_when_the_module_returns_a_lordo() -> None:
    import lightning as L
    from strategy_helpers import TinyRegressor, loader

    from lightning_lordo import LoRDO

    class ReturnsLoRDO(TinyRegressor):
        def configure_optimizers(self) -> LoRDO:
            return LoRDO(self.parameters(), rank=4, omega=0.5)

    fit = L.Trainer(strategy=LoRDOStrategy(start_method="popen", monitor=False, optimizer={"rank": 8, "omega": 0.9}),
                    accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"optimizer knobs \(rank, omega, from optimizer=.*returned a LoRDO"):
        fit.fit(ReturnsLoRDO(), loader())
