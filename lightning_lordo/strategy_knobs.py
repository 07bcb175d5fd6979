"""The strategies' knobs, each with one home, and their resolution (shared by the Trainer's and Fabric's strategies).

A knob lives in exactly one of three places:

* a named argument of the strategy: the distribution knobs (:data:`NAMED_SYNC_KNOBS`, with ``preset`` and
  ``monitor``);
* the ``optimizer`` mapping: LoRDO's knobs for the conversion of the user's Adam/AdamW
  (:data:`OPTIMIZER_MAPPING_KNOBS`); a ``LoRDO`` returned by ``configure_optimizers`` carries its own instead;
* :class:`Experimental`: research, ablation and rarely changed knobs, a typed dataclass LightningCLI reads.

A preset (:data:`PRESETS`) is a named set of knob values; what the user passes overrides it, knob by knob.
:func:`resolve_knobs` merges the three, validates them and refuses a knob passed in the wrong place with its home.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from lightning_lordo.checks import KnobError, check_choice, fail
from lightning_lordo.config import (
    LEAN_KNOBS,
    OPTIMIZER_DEFAULTS,
    SyncConfig,
    check_knob_combinations,
    check_optimizer_knobs,
)
from lightning_lordo.sync import bucketed

#: The registered strategy names (the Trainer's and Fabric's) and the values of ``preset``: name -> (knobs, by
#: name wherever they live, and a description). Each is registered as is and with the suffixes of
#: :data:`LAUNCH_SUFFIXES`.
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "lordo": ({}, "LoRDO: global basis from the averaged pseudo-gradient + full-rank QHM term, error feedback"),
    "lordo_local": ({"basis_scope": "local", "average_moments": False},
                    "LoRDO-Local: each worker computes its own basis"),
    "diloco": ({"lowrank": False}, "DiLoCo: the user's optimizer locally, averaged every K steps"),
    "lordo_lean": (dict(LEAN_KNOBS), "LoRDO without the error-feedback buffer: rank-r optimizer state only, at "
                                     "some loss"),
    "lordo_compressed": ({**LEAN_KNOBS, "payload": "lowrank", "payload_dtype": "int8", "fullrank_rank": 16,
                          "moments_every": 4, "average_fullrank_moments": True},
                         "LoRDO with everything compressed: int8 low-rank messages for every weight matrix, the "
                         "moments (the full-rank ones too) every 4th sync (lean optimizer knobs)"),
    "lowrank_ddp": ({"synchronous": True}, "low-rank DDP: gradients averaged every step, LoRDO's low-rank "
                                           "moments, bases from the averaged gradient every K steps"),
}
#: Suffix of a registered name -> its start method (as Lightning's ``ddp``, ``ddp_spawn``, ``ddp_fork``).
LAUNCH_SUFFIXES = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
#: The hyperparameters that come from the user's optimizer (its defaults too, on conversion), never a strategy's.
FROM_USER_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
#: The optimizer knobs a strategy converts with.
STRATEGY_OPTIMIZER_KNOBS = tuple(k for k in OPTIMIZER_DEFAULTS if k not in FROM_USER_OPTIMIZER)
#: The keys of the ``optimizer`` mapping: LoRDO's knobs and the names of the parameters kept full-rank.
OPTIMIZER_MAPPING_KNOBS = (*STRATEGY_OPTIMIZER_KNOBS, "full_rank_params")
#: The synchronization knobs that are named arguments of the strategies (the rest are :class:`Experimental`).
NAMED_SYNC_KNOBS = ("sync_every", "payload", "payload_dtype", "outer_optimizer", "outer_lr", "outer_momentum",
                    "overlap_steps", "anchor_device", "bucket_cap_mb", "timeout")
#: Named arguments a preset may set: their default is ``None``, "the preset's value".
PRESET_NAMED = ("payload", "payload_dtype")


def docstring_entries(doc: str, section: str = "Attributes:") -> dict[str, str]:
    """``name -> description`` from a section (``Args:``, ``Attributes:``) of a Google-style docstring; an entry
    naming several knobs (``power_iters, oversample: ...``) is given to each."""
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in doc.split(section, 1)[-1].splitlines():
        match = re.match(r"^ {8}(\*{0,2}\w+(?:, \w+)*): (.*)$", line)
        if match:
            names = [n.lstrip("*") for n in match[1].split(", ")]
            entries.update({n: match[2] for n in names})
        elif names and line.startswith(" " * 12):
            entries.update({n: entries[n] + " " + line.strip() for n in names})
        elif names and line.strip() and not line.startswith(" " * 8):
            break  # the section ended
    return entries


@dataclass(frozen=True)
class Experimental:
    lowrank: Optional[bool] = None
    basis_scope: Optional[Literal["global", "local"]] = None
    average_moments: Optional[bool] = None
    initial_basis: Optional[Literal["gradient", "random"]] = None
    broadcast_bases: Optional[bool] = None
    seed: Optional[int] = None
    average_fullrank_moments: Optional[bool] = None
    average_error_feedback: Optional[bool] = None
    warmup_steps: Optional[int] = None
    synchronous: Optional[bool] = None
    switch_betas: Optional[tuple[float, float]] = None
    switch_reset_moments: Optional[bool] = None
    switch_lr_scale: Optional[float] = None
    fullrank_rank: Optional[int] = None
    moments_every: Optional[int] = None
    basis_every: Optional[int] = None
    max_skipped_syncs: Optional[int] = None
    checkpoint_shards: Optional[bool] = None
    monitor_progress_bar: Optional[bool] = None


_OWN_DOCS = {
    "lowrank": "convert the user's Adam/AdamW into LoRDO (``True``), or keep any optimizer and only synchronize "
               "(``False``: the ``\"diloco\"`` preset).",
    "checkpoint_shards": "each rank writes its state beside the checkpoint (``<file>.lordo-<id>/rank-<r>.pt``); "
                         "``False``: gathered into the file (Trainer only; the gather is not counted).",
    "monitor_progress_bar": "the monitor the strategy adds shows ``lordo/saving_vs_ddp`` in the progress bar "
                            "(``None``: if a progress bar is shown; Trainer only).",
}
_SYNC_DOCS = docstring_entries(SyncConfig.__doc__ or "")
#: The ``optimizer`` mapping's key that is not a knob of LoRDO itself.
MAPPING_DOCS = {"full_rank_params": "regular expressions on parameter names that take AdamW, besides the embeddings "
                                    "and output heads found by the model's structure."}
Experimental.__doc__ = (
    "Research, ablation and rarely changed knobs of the strategies (``experimental=``). ``None``, the default of "
    "each, means the preset's value, else :class:`~lightning_lordo.config.SyncConfig`'s default.\n\n    Attributes:\n"
    + "".join(f"        {f.name}: {_OWN_DOCS.get(f.name) or _SYNC_DOCS[f.name]}\n"
              for f in dataclasses.fields(Experimental)))
EXPERIMENTAL_KNOBS = tuple(f.name for f in dataclasses.fields(Experimental))
NO_EXPERIMENTS = Experimental()  #: the strategies' default: every knob the preset's (or the default)
assert set(SyncConfig.__dataclass_fields__) == set(NAMED_SYNC_KNOBS) | (set(EXPERIMENTAL_KNOBS) - set(_OWN_DOCS))
assert all(k in PRESET_NAMED or k not in NAMED_SYNC_KNOBS for knobs, _ in PRESETS.values() for k in knobs)


def home_of(name: str, value: Any) -> Optional[str]:
    """Where the knob ``name`` is passed, written as the fix (``None``: no knob has that name)."""
    if name in FROM_USER_OPTIMIZER:
        return "your own optimizer (configure_optimizers, or the optimizer given to fabric.setup)"
    if name in OPTIMIZER_MAPPING_KNOBS:
        return f"optimizer={{{name!r}: {value!r}}}"
    if name in EXPERIMENTAL_KNOBS:
        return f"experimental={{{name!r}: {value!r}}} (or Experimental({name}={value!r}))"
    if name in NAMED_SYNC_KNOBS or name in ("preset", "monitor"):
        return f"{name}={value!r}"
    return None


@dataclass(frozen=True)
class Knobs:
    """A strategy's resolved knobs."""

    sync_config: SyncConfig
    optimizer_knobs: dict[str, Any]  # LoRDO knobs for the conversion, those that differ from the defaults
    lowrank: bool
    full_rank_params: Sequence[str]
    checkpoint_shards: bool
    monitor_progress_bar: Optional[bool]
    optimizer_given: tuple[str, ...] = ()  # the optimizer keys the user set (even to defaults)
    sync_given: tuple[str, ...] = ()  # the synchronization knobs the user set (named ones: to other than defaults)
    preset_optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)  # the preset's optimizer values


def _differs(value: Any, default: Any) -> bool:
    """Whether a knob was set to something other than its default: ``True`` is not ``1``, but ``64`` is ``64.0``
    (the command line's parser makes every float knob a float)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, default))
    return value != default if numbers else type(value) is not type(default) or value != default


#: Synchronization knobs that only shape what a sync does with LoRDO's low-rank state (refused with
#: ``lowrank=False``); ``seed`` also seeds ``fullrank_rank``'s bases, ``moments_every`` the full-rank moments' rounds.
_LOWRANK_SYNC_KNOBS = ("basis_scope", "initial_basis", "broadcast_bases", "average_moments", "average_error_feedback",
                       "basis_every", "seed", "moments_every")


def _mapping(argument: str, value: Any, allowed: Sequence[str], owner: str) -> dict[str, Any]:
    """The entries of the ``optimizer`` or ``experimental`` argument, every key checked against ``allowed``."""
    if value is None:
        return {}
    if isinstance(value, Experimental) and argument == "experimental":
        return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if not isinstance(value, Mapping):
        raise TypeError(f"{owner}({argument}={value!r}): it must be a mapping of knob names to values, e.g. "
                        f"{argument}={{{allowed[0]!r}: ...}}" + (", and an Experimental goes in experimental=."
                                                                 if isinstance(value, Experimental) else "."))
    for key in value:
        if key not in allowed:
            home = home_of(key, value[key])
            hint = (f" {key!r} is passed as {home}." if home else
                    "".join(f" Did you mean {m!r}?" for m in difflib.get_close_matches(str(key), allowed, n=1)))
            raise ValueError(f"{owner}({argument}=...) got {key!r}, which is not one of its keys.{hint} Its keys "
                             f"are: {', '.join(allowed)}.")
    return {k: v for k, v in value.items() if v is not None or argument == "optimizer"}


def resolve_knobs(owner: str, *, preset: str, named: Mapping[str, Any], optimizer: Any, experimental: Any,
                  misplaced: Mapping[str, Any], optimizer_source: str, trainer_only: bool) -> Knobs:
    """Merge a preset, the named arguments, ``optimizer`` and ``experimental`` into validated :class:`Knobs`.

    A preset's value that the knobs passed make meaningless gives way (``preset="lordo_lean"`` sets
    ``power_iters=1``, which ``projection="svd"`` has no use for); a knob passed that the preset's values make
    meaningless is refused, and the error names the preset.

    Args:
        owner: the strategy's class name, for the errors.
        preset: a key of :data:`PRESETS`; the other arguments override its values knob by knob.
        named: the strategy's named distribution arguments (``None``: the preset's value, else the default).
        optimizer, experimental: the two nested arguments (a mapping, an :class:`Experimental`, or ``None``).
        misplaced: keyword arguments the strategy does not take; each is refused with its home.
        optimizer_source: where lr, betas, eps and weight_decay come from, for the error that refuses them.
        trainer_only: whether the Trainer-only knobs (``checkpoint_shards``, ``monitor_progress_bar``) apply.
    """
    launched = [(preset[:-len(sfx)], how) for sfx, how in LAUNCH_SUFFIXES if sfx and str(preset).endswith(sfx)]
    if launched and launched[0][0] in PRESETS:
        raise fail("preset", preset, "a preset is a set of knobs, and the suffix names a launcher",
                   f"Pass preset={launched[0][0]!r}, start_method={launched[0][1]!r}.")
    check_choice("preset", preset, tuple(PRESETS))
    for key, value in misplaced.items():
        home = home_of(key, value)
        if key in FROM_USER_OPTIMIZER:
            raise ValueError(f"{owner} got {key}={value!r}: it comes from {optimizer_source}. Set it there.")
        if key == "monitor":
            raise TypeError(f"{owner} got monitor={value!r}: Fabric has no callbacks, so there is no monitor to add. "
                            "Drop it, and read strategy.accountant (bytes sent) and strategy.sync_reports.")
        if home:
            raise TypeError(f"{owner} got {key}={value!r}, which is not a named argument: pass it as {home}.")
        arguments = ["preset", *named, *(["monitor"] if trainer_only else []), "start_method", "optimizer",
                     "experimental"]
        every = [*arguments, *OPTIMIZER_MAPPING_KNOBS, *EXPERIMENTAL_KNOBS]
        hint = "".join(f" Did you mean {m!r}?" for m in difflib.get_close_matches(key, every, n=1))
        raise TypeError(f"{owner} got an unknown argument {key!r}.{hint} Its named arguments are: "
                        f"{', '.join(arguments)}.")
    experimental_knobs = _mapping("experimental", experimental, EXPERIMENTAL_KNOBS, owner)
    if not trainer_only:
        for key in ("checkpoint_shards", "monitor_progress_bar"):
            if key in experimental_knobs:
                raise ValueError(f"Invalid experimental {key}={experimental_knobs[key]!r}: {owner} has no such "
                                 "setting (it is the Trainer strategy's), so it would be ignored. Drop it.")
    passed = {k: v for k, v in named.items() if v is not None or k not in PRESET_NAMED}
    passed.update({**_mapping("optimizer", optimizer, OPTIMIZER_MAPPING_KNOBS, owner), **experimental_knobs})
    explicit = {k for k in passed if k not in named or k in PRESET_NAMED or _differs(passed[k], _default(k))}
    kept = {k: v for k, v in PRESETS[preset][0].items() if k not in passed}
    while True:
        try:
            return _validated(kept, passed, explicit)
        except KnobError as error:
            if error.knob not in kept:  # the user's knob: refused, naming the preset's values that made it so
                why = {k: v for k, v in kept.items() if k in str(error)}
                if not why:
                    raise
                try:
                    _validated({}, passed, explicit)
                except KnobError as own:  # the user's knobs conflict among themselves: the preset is not the cause
                    raise own from None
                raise KnobError(error.knob, f"{error} (preset={preset!r} sets {why})") from None
            del kept[error.knob]  # the preset's value that the user's knobs make meaningless gives way


def _default(name: str) -> Any:
    field = SyncConfig.__dataclass_fields__[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]


def _validated(preset_knobs: Mapping[str, Any], passed: Mapping[str, Any], explicit: set[str]) -> Knobs:
    """The knobs of a preset's values and the ones passed, validated. ``explicit``: the names the user set (a knob
    the user or the preset sets is refused where the others make it meaningless, even at its default value)."""
    flat = {**preset_knobs, **passed}
    set_by_either = explicit | set(preset_knobs)
    lowrank = flat.pop("lowrank", True)
    shards = flat.pop("checkpoint_shards", True)
    progress_bar = flat.pop("monitor_progress_bar", None)
    for name, flag in (("lowrank", lowrank), ("checkpoint_shards", shards)):
        if not isinstance(flag, bool):
            raise fail(name, flag, "it must be True or False", "Pass a bool.")
    given = tuple(k for k in OPTIMIZER_MAPPING_KNOBS if k in flat)
    unused = [k for k in _LOWRANK_SYNC_KNOBS if k in set_by_either and not (k == "seed" and flat.get("fullrank_rank"))
              and not (k == "moments_every" and flat.get("average_fullrank_moments"))]
    if unused and lowrank is False:
        raise fail(unused[0], flat[unused[0]], "with lowrank=False it would be ignored: it shapes what a sync does "
                   "with LoRDO's low-rank state, and your optimizer, which runs as it is, has none",
                   "Drop it, or use preset='lordo'.")
    full_rank = flat.pop("full_rank_params", ())
    if not isinstance(full_rank, (list, tuple)) or not all(isinstance(p, str) for p in full_rank):
        raise fail("full_rank_params", full_rank, "it must be a list of regular expressions on parameter names",
                   "Pass e.g. optimizer={'full_rank_params': ['decoder']}.")
    literal = [p for p in full_rank if "\\\\" in p]  # a pattern that needs a backslash in the name
    if literal:
        raise fail("full_rank_params", literal, "an escaped backslash matches a literal backslash, which no parameter "
                   "name holds (a dotted command-line flag doubles the backslashes of a list)",
                   "Write the pattern with single backslashes; on the command line pass the whole mapping, "
                   "--trainer.strategy.optimizer='{full_rank_params: [...]}', or use YAML.")
    chosen = {k: flat.pop(k) for k in STRATEGY_OPTIMIZER_KNOBS if k in flat}
    if given and lowrank is False:
        raise KnobError(given[0], f"Invalid optimizer {given[0]}={chosen.get(given[0], full_rank)!r} with "
                        f"lowrank=False: the optimizer knobs shape LoRDO's step, and without LoRDO your optimizer "
                        "runs as it is, so it would be ignored. Drop it, or use preset='lordo'.")
    check_optimizer_knobs(chosen, in_group=False)
    check_knob_combinations(chosen, {**OPTIMIZER_DEFAULTS, **chosen})
    config = SyncConfig(**flat)
    if config.payload == "lowrank" and lowrank is False:
        raise KnobError("payload", "Invalid payload='lowrank' with lowrank=False: the low-rank payload sends the "
                        "low-rank matrices of the LoRDO optimizer. Use payload='full' (payload_dtype may be 'bfloat16' "
                        "or 'int8'), or preset='lordo'.")
    if config.basis_scope == "local" and "average_moments" in set_by_either and config.average_moments:
        raise fail("average_moments", True, "with basis_scope='local' each worker's moments live in its own basis, "
                   "so they cannot be averaged and it would be ignored", "Drop it, or use basis_scope='global'.")
    if "bucket_cap_mb" in explicit and (config.overlap_steps or not bucketed.cap_applies(config)):
        raise fail("bucket_cap_mb", config.bucket_cap_mb, "it only shapes a blocking round (overlap_steps=0) that "
                   "averages the "
                   "pseudo-gradient bucket by bucket (outer_optimizer='average', basis_every=1, no broadcast_bases, "
                   "and payload='lowrank', or a float32 full payload without fullrank_rank), so it would be ignored",
                   "Drop it.")
    optimizer_knobs = {k: v for k, v in chosen.items() if _differs(v, OPTIMIZER_DEFAULTS[k])}
    sync_given = tuple(k for k in SyncConfig.__dataclass_fields__ if k in explicit)  # the user's, not the preset's
    return Knobs(config, optimizer_knobs, lowrank, full_rank, shards, progress_bar,
                 tuple(k for k in given if k in passed), sync_given,
                 {k: v for k, v in preset_knobs.items() if k in OPTIMIZER_MAPPING_KNOBS})


def strategy_kwargs(**knobs: Any) -> dict[str, Any]:
    """Knobs given by name wherever they live, as a strategy's arguments: ``strategy_kwargs(rank=8,
    basis_every=2)`` is ``{"optimizer": {"rank": 8}, "experimental": {"basis_every": 2}}`` (scripts that sweep
    knobs of every kind use it)."""
    out: dict[str, Any] = {}
    for key, value in knobs.items():
        if key in OPTIMIZER_MAPPING_KNOBS:
            out.setdefault("optimizer", {})[key] = value
        elif key in EXPERIMENTAL_KNOBS:
            out.setdefault("experimental", {})[key] = value
        else:
            out[key] = value
    return out
