"""Every LoRDO knob in one place, validated with errors that say how to fix the value.

Two groups of knobs exist:

* optimizer knobs (:data:`OPTIMIZER_DEFAULTS`): what one local step computes (SPEC §3, §6, §6b) and how a
  new basis is installed (SPEC §4.4-4.5). They live in each param group, so they can differ per group.
* synchronization knobs (:class:`SyncConfig`): what happens every ``sync_every`` optimizer steps
  (SPEC §4-5). They belong to the strategy.

Every check raises ``ValueError`` naming the argument, the value given, what is allowed and how to fix it.
Nothing is silently clamped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch

from lightning_lordo.checks import (
    KnobError,
    check_choice,
    check_positive,
    check_positive_int,
    check_unit_interval,
    fail,
    is_number,
)

NORMALIZERS = ("col_rms", "factored", "scalar", "lifted", "mean_denom")
UPDATES = ("lordo", "subspace_qh", "unnormalized_lowrank")
FULL_RANK_INPUTS = ("gradient", "accumulated")
PROJECTIONS = ("power", "randomized", "svd")
TRANSITIONS = ("rotate", "reset", "keep")
EF_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
FULLRANK_STATES = ("adamw", "factored")
OUTER_OPTIMIZERS = ("average", "nesterov")
BASIS_SCOPES = ("global", "local")
INITIAL_BASES = ("gradient", "random")
PAYLOADS = ("full", "lowrank")
PAYLOAD_DTYPES = ("float32", "bfloat16", "int8")
ANCHOR_DEVICES = ("auto", "param", "cpu")
TIMEOUT_RANGE_S = (1.0, 365 * 24 * 3600.0)

#: Defaults of the optimizer knobs. ``lr``, ``betas``, ``eps`` and ``weight_decay`` mean what they mean in
#: :class:`torch.optim.AdamW`; the rest are LoRDO's (see :class:`lightning_lordo.LoRDO`). ``omega`` 0.97, the
#: accumulated input ``G + E``, error feedback and 3 power steps are the best configuration measured in the authors'
#: protocol (``benchmarks/authors.py``); :data:`LEAN_KNOBS` are the earlier defaults, without the full-size buffer.
OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "rank": 16,
    "omega": 0.97,
    "update": "lordo",
    "mu": 1.0,
    "normalizer": "col_rms",
    "full_rank_input": "accumulated",
    "lifted_floor": 0.1,
    "projection": "power",
    "power_iters": 3,
    "oversample": 4,
    "transition": "rotate",
    "variance_clamp": False,
    "error_feedback": True,
    "ef_dtype": "auto",
    "ef_decay": "auto",
    "update_scale": "auto",
    "fullrank_state": "adamw",
}
KNOBS_BEFORE_THEY_EXISTED: dict[str, Any] = {"update_scale": 1.0}  # what a checkpoint older than the knob ran
#: The optimizer knobs of the ``"lordo_lean"`` and ``"lordo_compressed"`` presets (the defaults before the authors'
#: protocol): no error-feedback buffer, so the optimizer state of a low-rank matrix is its rank-r moments only.
LEAN_KNOBS: dict[str, Any] = {"omega": 0.7, "full_rank_input": "gradient", "error_feedback": False, "power_iters": 1}


def check_rank(value: Any, *, allow_zero: bool) -> Union[int, float]:
    """An integer rank >= 1, a fraction in (0, 1] of each matrix's smaller side, or 0 (full-rank) in a group."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 1 or (allow_zero and value == 0):
            return value
    elif isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    zero = " or 0 in a param group to run that group full-rank" if allow_zero else ""
    raise fail("rank", value, f"it must be an integer >= 1, a float in (0, 1] (a fraction of each matrix's smaller "
               f"side){zero}", 'Pass e.g. rank=16, or rank=0.25; opt a group out with {"params": ..., "rank": 0}.')


def check_optimizer_knobs(knobs: dict[str, Any], *, in_group: bool) -> None:
    """Validate the optimizer knobs present in ``knobs`` (a param group or the constructor's defaults)."""
    lr = knobs.get("lr", 0.0)
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or not torch.isfinite(lr).all() or lr.item() < 0):
        raise fail("lr", lr, "a tensor lr must hold one finite number >= 0", "Pass e.g. lr=torch.tensor(1e-3).")
    if not isinstance(lr, torch.Tensor):
        check_positive("lr", lr, allow_zero=True)
    if "betas" in knobs:
        betas = knobs["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise fail("betas", betas, "it must be a pair (beta1, beta2)", "Pass e.g. betas=(0.9, 0.999).")
        check_unit_interval("betas[0]", betas[0], closed_right=False)
        check_unit_interval("betas[1]", betas[1], closed_right=False)
    if "eps" in knobs:
        check_positive("eps", knobs["eps"])
    if "weight_decay" in knobs:
        check_positive("weight_decay", knobs["weight_decay"], allow_zero=True)
    if "rank" in knobs:
        check_rank(knobs["rank"], allow_zero=in_group)
    if "omega" in knobs:
        check_unit_interval("omega", knobs["omega"], closed_right=True)
    for name, fix in (("update_scale", 'update_scale="auto" (AdamW\'s LR carries over) or 1.0 (the authors\')'),
                      ("mu", 'mu=1.0 or mu="auto"')):
        value = knobs.get(name, "auto")
        if value != "auto" and (not is_number(value) or not math.isfinite(value) or value <= 0):
            raise fail(name, value, 'it must be a finite number > 0 or "auto"', f"Pass e.g. {fix}.")
    if "update" in knobs:
        check_choice("update", knobs["update"], UPDATES)
    if "normalizer" in knobs:
        check_choice("normalizer", knobs["normalizer"], NORMALIZERS)
    if "full_rank_input" in knobs:
        check_choice("full_rank_input", knobs["full_rank_input"], FULL_RANK_INPUTS)
    if "lifted_floor" in knobs:
        check_positive("lifted_floor", knobs["lifted_floor"])
    if "projection" in knobs:
        check_choice("projection", knobs["projection"], PROJECTIONS)
    if "power_iters" in knobs:
        check_positive_int("power_iters", knobs["power_iters"])
    if "oversample" in knobs:
        check_positive_int("oversample", knobs["oversample"], minimum=0)
    if "transition" in knobs:
        check_choice("transition", knobs["transition"], TRANSITIONS)
    for flag in ("error_feedback", "variance_clamp"):
        if flag in knobs and not isinstance(knobs[flag], bool):
            raise fail(flag, knobs[flag], "it must be True or False", "Pass a bool.")
    for name, allowed in (("ef_dtype", tuple(EF_DTYPES)), ("fullrank_state", FULLRANK_STATES)):
        if name in knobs:
            check_choice(name, knobs[name], allowed)
    if "ef_decay" in knobs and knobs["ef_decay"] != "auto":
        decay = knobs["ef_decay"]
        if not is_number(decay) or not 0.0 < decay <= 1.0:
            raise fail("ef_decay", decay, 'it must be "auto" (beta1) or a number in (0, 1]',
                        'Pass ef_decay="auto", or 1.0 to keep all feedback (it can wind up: see LoRDO\'s docs).')


#: Knobs that only shape the full-rank term (none exists with ``update="subspace_qh"`` or ``omega=1``).
_FULL_RANK_TERM_KNOBS = ("mu", "normalizer", "lifted_floor", "full_rank_input")
_ERROR_FEEDBACK_KNOBS = ("ef_dtype", "ef_decay")
_APPLIES_ONLY_WITH = (("power_iters", "projection", ("power", "randomized")),  # (knob, the knob it needs, values)
                      ("oversample", "projection", ("power", "randomized")),  # power's first basis: a range finder
                      ("lifted_floor", "normalizer", ("lifted",)),
                      ("variance_clamp", "transition", ("rotate",)))


def check_knob_combinations(explicit: Mapping[str, Any], merged: Mapping[str, Any]) -> None:
    """Refuse knobs passed explicitly (``explicit``) that the effective configuration (``merged``) would ignore.

    Nothing is silently ignored: a knob of the full-rank term where there is none (``update="subspace_qh"``, or
    ``omega=1``), a knob of a projection, normalizer or transition not chosen, an error-feedback knob without error
    feedback, or ``full_rank_input="accumulated"`` without error feedback (it would equal the gradient)."""
    no_term = "update='subspace_qh'" if merged.get("update") == "subspace_qh" else \
        "omega=1.0" if merged.get("omega") == 1.0 else None
    ignored = [k for k in _FULL_RANK_TERM_KNOBS if k in explicit]
    if no_term and ignored:
        raise KnobError(ignored[0], f"Invalid {ignored[0]}={explicit[ignored[0]]!r} with {no_term}: there is no "
                        f"full-rank term then (1 - omega weights it; subspace_qh mixes the gradient in inside the "
                        f"subspace), so {', '.join(ignored)} would be ignored. Drop it, or use update='lordo' with "
                        "omega < 1.")
    for knob, needs, allowed in _APPLIES_ONLY_WITH:
        if knob in explicit and merged.get(needs) not in allowed:
            raise KnobError(knob, f"Invalid {knob}={explicit[knob]!r} with {needs}={merged.get(needs)!r}: it only "
                            f"applies to {needs}={' or '.join(map(repr, allowed))}, so it would be ignored. Drop it, "
                            f"or pass {needs}={allowed[0]!r}.")
    if not merged.get("error_feedback"):
        ignored = [k for k in _ERROR_FEEDBACK_KNOBS if k in explicit]
        if explicit.get("full_rank_input") == "accumulated":
            ignored.append("full_rank_input")
        if ignored:
            raise KnobError(ignored[0], f"Invalid {ignored[0]}={explicit[ignored[0]]!r} with error_feedback=False: "
                            "it only applies to the error-feedback buffer (without one the accumulated input is the "
                            "gradient itself). Pass error_feedback=True, or drop it.")


@dataclass
class SyncConfig:
    """Synchronization knobs of the strategy (SPEC §4-5).

    Attributes:
        sync_every: K, the number of optimizer steps between synchronizations.
        outer_optimizer: ``"average"`` (plain parameter averaging) or ``"nesterov"`` (DiLoCo's outer SGD).
        outer_lr: learning rate of the Nesterov outer step (ignored by ``"average"``).
        outer_momentum: momentum of the Nesterov outer step (ignored by ``"average"``).
        average_moments: average the low-rank Adam moments across workers at each sync.
        basis_scope: ``"global"`` (basis from the averaged pseudo-gradient) or ``"local"`` (each worker's own
            pseudo-gradient, the paper's LoRDO-Local).
        initial_basis: ``"gradient"`` (from the averaged first gradient, one extra all-reduce) or ``"random"``
            (a seeded random orthonormal basis, identical on all ranks, no traffic).
        payload: what travels for the pseudo-gradients (SPEC §5): ``"full"`` (every number) or ``"lowrank"``
            (PowerSGD-style: ``r (a + b)`` numbers per low-rank matrix, two all-reduces, with per-worker
            sync-level error feedback; the new bases still come from the averaged pseudo-gradient).
        payload_dtype: ``"float32"``, ``"bfloat16"`` or ``"int8"`` (per-row scales, sent by all-gather), with
            per-worker error feedback for the reduced precisions; applies to every pseudo-gradient message. The
            averaged moments travel in :attr:`moments_dtype`.
        broadcast_bases: compute bases on rank 0 and broadcast them (a*r numbers per matrix) instead of
            relying on identical computation on every rank; use it on clusters with mixed hardware.
        timeout: timeout of every collective the plugin issues; a rank that does not answer in time makes
            the others fail with an error instead of hanging.
        seed: seed of random bases and randomized projections (identical on all ranks).
        average_fullrank_moments: also average the optimizer state of the full-rank parameters (AdamW moments of
            embeddings, norms, biases; any floating state tensor shaped like its parameter) at each sync.
        average_error_feedback: also average the optimizer's error-feedback buffers at each sync.
        warmup_steps: the first ``warmup_steps`` optimizer steps are synchronous low-rank DDP (gradients averaged
            every step, bases refreshed every ``sync_every`` steps from the averaged gradient); local steps follow.
        synchronous: every step synchronous (low-rank DDP for the whole run, the ``"lowrank_ddp"`` preset), or
            local rounds (``False``). ``None`` (the default): local rounds on several processes; on one process, the
            LoRDO optimizer alone (bases from the gradient every ``sync_every`` steps, no anchor, no rounds) unless a
            knob of the rounds is set (:data:`ROUND_KNOBS_ALONE`), which asks for rounds and their anchor.
        switch_betas: at the end of the warm-up, set the optimizer's betas to this pair (``None``: keep them).
        switch_reset_moments: at the end of the warm-up, zero the optimizer's moments (bases are kept).
        switch_lr_scale: at the end of the warm-up, multiply the learning rate (and the LR schedulers' base LRs).
        anchor_device: where the anchor (the last synchronized parameters) lives: ``"auto"`` (the default: pinned
            host memory when the parameters are on an accelerator, where it saves one model of device memory, else
            beside the parameters), ``"param"`` (the parameters' device, also on an accelerator: no host-to-device
            copy at a sync) or ``"cpu"`` (host memory, pinned on an accelerator; the same as ``"auto"``).
        fullrank_rank: compress the pseudo-gradients of the full-rank 2-D parameters (embeddings, output heads)
            with a low-rank message of this rank (PowerSGD-style, warm-started, per-worker error feedback; they keep
            their AdamW step and moments, only the message is compressed). A matrix where ``r (a + b) >= a b``
            travels in full. ``0`` (the default): every full-rank parameter's pseudo-gradient travels in full.
        moments_every: average the moments (the low-rank ones, and the full-rank ones with
            ``average_fullrank_moments``) at every ``moments_every``-th sync only (DES-LOC-style); between, each
            worker keeps its own, rotated into the shared bases. ``1``: at every sync.
        basis_every: recompute the low-rank bases at every ``basis_every``-th sync only, from the averaged
            pseudo-gradients summed over the rounds since the last refresh (one float32 copy of the low-rank
            matrices holds that sum); between, the moments stay in their basis. Frequent syncs then keep a basis
            as stable as infrequent ones. ``1``: at every sync, from that round's pseudo-gradient.
        overlap_steps: ``0`` (the default): every sync blocks. ``tau`` in ``[1, sync_every)``: a round's collectives
            run on a thread (a side process group) while the worker takes ``tau`` more local steps; the averaged
            result then lands on every worker at the same step, each keeping its local progress since the round
            began (:mod:`lightning_lordo.sync.overlap`). The ``tau`` steps start from each worker's own point, not
            from the average still in flight. With the default optimizer knobs that costs loss that grows with
            ``tau`` (+0.31 % at 1, +2.29 % at 4 on the benchmark model; benchmarks/README.md, "What overlapping costs").
        bucket_cap_mb: the most pseudo-gradient (float32 MB) a blocking sync holds at once: it works bucket by
            bucket, as DDP's gradient buckets, and low-rank messages stream when their matrices pass one bucket
            (:mod:`lightning_lordo.sync.bucketed` says when).
        max_skipped_syncs: after this many consecutive discarded rounds (non-finite values on some worker every
            time) the run stops with an error naming the ranks, instead of training on with a frozen model.
    """

    sync_every: int = 16
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    average_moments: bool = True
    basis_scope: str = "global"
    initial_basis: str = "gradient"
    payload: str = "full"
    payload_dtype: str = "float32"
    broadcast_bases: bool = False
    timeout: timedelta = field(default_factory=lambda: timedelta(minutes=30))
    seed: int = 0
    average_fullrank_moments: bool = False
    average_error_feedback: bool = False
    warmup_steps: int = 0
    synchronous: Optional[bool] = None
    switch_betas: Optional[tuple[float, float]] = None
    switch_reset_moments: bool = False
    switch_lr_scale: float = 1.0
    anchor_device: str = "auto"
    fullrank_rank: int = 0
    moments_every: int = 1
    basis_every: int = 1
    overlap_steps: int = 0
    max_skipped_syncs: int = 3
    bucket_cap_mb: float = 64.0

    def __post_init__(self) -> None:
        check_positive_int("sync_every", self.sync_every)
        check_choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        check_positive("outer_lr", self.outer_lr)
        check_unit_interval("outer_momentum", self.outer_momentum, closed_right=False)
        for name in ("outer_lr", "outer_momentum"):
            if self.outer_optimizer == "average" and getattr(self, name) != getattr(SyncConfig, name):
                raise fail(name, getattr(self, name), "it only applies to outer_optimizer='nesterov' (plain averaging "
                           "has no outer step size or momentum), so it would be ignored", "Pass "
                           "outer_optimizer='nesterov', or drop it.")
        for name in ("average_moments", "broadcast_bases", "average_fullrank_moments", "average_error_feedback",
                     "synchronous", "switch_reset_moments"):
            if not isinstance(getattr(self, name), bool) and not (name == "synchronous" and self.synchronous is None):
                raise fail(name, getattr(self, name), "it must be True or False" + (
                    " (or None: decided by the number of processes)" if name == "synchronous" else ""), "Pass a bool.")
        check_choice("basis_scope", self.basis_scope, BASIS_SCOPES)
        check_choice("initial_basis", self.initial_basis, INITIAL_BASES)
        check_choice("payload", self.payload, PAYLOADS)
        check_choice("payload_dtype", self.payload_dtype, PAYLOAD_DTYPES)
        given = self.timeout
        seconds = given.total_seconds() if isinstance(given, timedelta) else given
        if not is_number(seconds) or not TIMEOUT_RANGE_S[0] <= seconds <= TIMEOUT_RANGE_S[1]:
            raise fail("timeout", given, f"it must be a timedelta or a number of seconds from {TIMEOUT_RANGE_S[0]:g} "
                        f"s (the process group's setup needs that) to {TIMEOUT_RANGE_S[1]:g} s (one year)",
                        "Pass e.g. timeout=timedelta(minutes=5).")
        self.timeout = given if isinstance(given, timedelta) else timedelta(seconds=float(seconds))
        check_positive_int("max_skipped_syncs", self.max_skipped_syncs)
        self.bucket_cap_mb = check_positive("bucket_cap_mb", self.bucket_cap_mb)
        check_positive_int("fullrank_rank", self.fullrank_rank, minimum=0)
        check_positive_int("moments_every", self.moments_every)
        check_positive_int("basis_every", self.basis_every)
        if self.basis_every > 1 and self.basis_scope == "local":
            raise fail("basis_every", self.basis_every, "it must be 1 with basis_scope='local' (each worker computes "
                        "its own bases from its own pseudo-gradient at every sync)", "Drop basis_every, or use "
                        "basis_scope='global'.")
        check_positive_int("overlap_steps", self.overlap_steps, minimum=0)
        if self.overlap_steps >= self.sync_every:
            raise fail("overlap_steps", self.overlap_steps, f"it must be below sync_every={self.sync_every} (a round "
                        "lands before the next one starts)", f"Pass overlap_steps < {self.sync_every}, or 0.")
        if self.moments_every > 1 and not (self.average_moments or self.average_fullrank_moments):
            raise fail("moments_every", self.moments_every, "it must be 1 when no moments are averaged "
                        "(average_moments=False, average_fullrank_moments=False)", "Drop moments_every, or average "
                        "the moments.")
        if self.broadcast_bases and self.basis_scope == "local":
            raise fail("broadcast_bases", True, "it must be False with basis_scope='local' (each worker keeps its own "
                        "bases there, so there is nothing to broadcast)", "Drop broadcast_bases, or use "
                        "basis_scope='global'.")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise fail("seed", self.seed, "it must be an integer", "Pass e.g. seed=0.")
        check_positive_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.switch_betas is not None:
            betas = self.switch_betas
            ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                is_number(b) and 0.0 <= b < 1.0 for b in betas)
            if not ok:
                raise fail("switch_betas", betas, "it must be None or a pair (beta1, beta2) of numbers in [0, 1)",
                            "Pass e.g. switch_betas=(0.999, 0.999).")
            self.switch_betas = (float(betas[0]), float(betas[1]))
        self.switch_lr_scale = check_positive("switch_lr_scale", self.switch_lr_scale)
        check_choice("anchor_device", self.anchor_device, ANCHOR_DEVICES)
        self._check_phase_knobs()

    def _check_phase_knobs(self) -> None:
        """Refuse knobs the phases chosen would ignore (compared with their defaults)."""
        changed = [name for name in _SWITCH_KNOBS if getattr(self, name) != SYNC_DEFAULTS[name].default]
        if changed and self.warmup_steps == 0:
            raise fail(changed[0], getattr(self, changed[0]), "it must be left at its default without a warm-up "
                        "(the switch happens at the end of warmup_steps)", "Pass warmup_steps=N, or drop it.")
        if self.synchronous:
            local = [name for name in (*_LOCAL_ROUND_KNOBS, "warmup_steps", *_SWITCH_KNOBS)
                     if getattr(self, name) != SYNC_DEFAULTS[name].default]
            if local:
                raise fail(local[0], getattr(self, local[0]), "it must be left at its default with synchronous=True "
                            "(every step is synchronous low-rank DDP: no local rounds, no switch)",
                            "Drop it, or pass synchronous=False for local rounds (warmup_steps=N keeps N "
                            "synchronous steps first).")

    def alone(self) -> SyncConfig:
        """The knobs one process runs with: nothing travels, so nothing is compressed, averaged or broadcast.
        ``synchronous=None`` becomes ``True`` (the optimizer alone: bases from the gradient every ``sync_every``
        steps, no anchor) unless a knob of :data:`ROUND_KNOBS_ALONE` is set; then, as with ``synchronous=False``, a
        sync is the outer step and the basis refresh from the pseudo-gradient. ``"lordo_compressed"`` trains exactly
        as ``"lordo_lean"``, whose optimizer knobs it shares."""
        rounds_asked = [n for n in ROUND_KNOBS_ALONE if getattr(self, n) != SYNC_DEFAULTS[n].default]
        synchronous = not rounds_asked if self.synchronous is None else self.synchronous
        # alone, a local basis is the global one, and the outer step is averaging unless a round knob says otherwise
        rounds = {} if not synchronous else {n: SYNC_DEFAULTS[n].default for n in (
            "basis_scope", "outer_lr", "outer_momentum", "average_moments", "max_skipped_syncs", "bucket_cap_mb")}
        return dataclasses.replace(self, payload="full", payload_dtype="float32", fullrank_rank=0, moments_every=1,
                                   average_fullrank_moments=False, average_error_feedback=False,
                                   broadcast_bases=False, synchronous=synchronous, **rounds)

    @property
    def moments_dtype(self) -> str:
        """The precision the averaged low-rank moments travel in: ``"bfloat16"`` whenever the payload is reduced
        (``bfloat16`` or ``int8``), else ``"float32"``. Never int8: one scale per row cannot hold the range of
        Adam's second moment (small entries would round to zero and blow up the step). Moments are state, not
        updates, so they have no error feedback: each worker's moments are rounded to bfloat16 (``2^-8``
        relative) and the backend's bfloat16 sum rounds each of its ``M - 1`` additions again."""
        return "float32" if self.payload_dtype == "float32" else "bfloat16"


SYNC_DEFAULTS = SyncConfig.__dataclass_fields__  #: the synchronization knobs' fields, with their defaults
#: Knobs that ask one process for local rounds (an anchor and bases from the pseudo-gradient) when ``synchronous`` is
#: left unset: the outer step, basis windows, overlap, a warm-up, and where the anchor lives.
ROUND_KNOBS_ALONE = ("outer_optimizer", "basis_every", "overlap_steps", "warmup_steps", "anchor_device")
#: Knobs of the switch at the end of the warm-up.
_SWITCH_KNOBS = ("switch_betas", "switch_reset_moments", "switch_lr_scale")
#: Knobs that only shape the local rounds (no such round exists with ``synchronous=True``).
_LOCAL_ROUND_KNOBS = ("outer_optimizer", "outer_lr", "outer_momentum", "basis_scope", "payload", "payload_dtype",
                      "average_fullrank_moments", "average_error_feedback", "fullrank_rank", "moments_every",
                      "basis_every", "overlap_steps", "anchor_device", "average_moments", "max_skipped_syncs",
                      "bucket_cap_mb")


def ef_dtype_for(ef_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype of an error-feedback buffer on ``device``: ``"auto"`` is bfloat16 on an accelerator (measured: no
    loss beyond the seeds' spread, ``benchmarks/ef_dtype.py``; half the bytes) and float32 on the CPU."""
    if ef_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return EF_DTYPES[ef_dtype]
