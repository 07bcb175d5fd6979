"""The LoRDO optimizer: param groups, which parameter takes which step, lazily created state, the local step of
SPEC §3 and the installation of new bases (SPEC §4.4-4.5). Pure tensor math: no ``torch.distributed``, no
Lightning. ``step`` gathers each group's tensors and calls the functional core
(:mod:`lightning_lordo.optim.functional`); the synchronizer calls :meth:`LoRDO.compute_bases` /
:meth:`LoRDO.set_bases` with the averaged pseudo-gradients.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo._tensors import canonical, mix_seed
from lightning_lordo.checks import check_group_keys, check_whole_optimizer
from lightning_lordo.config import (
    OPTIMIZER_DEFAULTS,
    check_knob_combinations,
    check_optimizer_knobs,
    ef_dtype_for,
)
from lightning_lordo.optim import bases as bases_module
from lightning_lordo.optim import compiled, conversion, fullrank, functional, reference, report
from lightning_lordo.optim.bases import check_sources, record_refresh, start_counting
from lightning_lordo.optim.functional import fold_error_feedback, is_factored, resolve_rank
from lightning_lordo.optim.projection import compute_basis, random_basis


class LoRDO(Optimizer):
    """Adam with moments in a shared rank-r subspace plus a full-rank quasi-hyperbolic term.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.AdamW`. Any knob below can be set
            per group, GaLore-style: ``{"params": ..., "rank": 0}`` runs that group full-rank (AdamW).
        lr, betas, eps, weight_decay: as in :class:`torch.optim.AdamW` (decoupled weight decay).
        rank: rank ``r`` of each low-rank matrix: an int >= 1, or a float in (0, 1] taken as a fraction of
            each matrix's smaller side (rounded down, at least 1). A 2-D parameter whose smaller side is not above
            ``r`` runs AdamW, with one warning; ``r`` is never lowered to fit it.
        omega: weight of the low-rank term; ``1 - omega`` weights the full-rank normalized term (SPEC §6).
        mu: scale of the full-rank term, or ``"auto"`` to give both terms the same RMS every step.
        update: ``"lordo"`` (SPEC §3), ``"subspace_qh"`` (the authors' low-rank DDP: the QH mix inside the
            subspace, no full-rank term; QHAdam for the AdamW parameters) or ``"unnormalized_lowrank"`` (the
            authors' training step, ``Q u_hat`` undivided; for ablations).
        normalizer: full-rank normalizer ``S``: ``"col_rms"``, ``"factored"``, ``"scalar"``, ``"lifted"`` or
            ``"mean_denom"`` (one scalar per matrix, the mean of ``sqrt(v_hat) + eps``, as the authors).
        full_rank_input: what the full-rank term normalizes: ``"gradient"`` or ``"accumulated"`` (``G + E``).
        lifted_floor: for ``"lifted"``, floor of ``S`` as a fraction of ``sqrt(mean(v_hat))``.
        projection: how a new basis is computed: ``"power"`` (warm-started block power iteration + QR),
            ``"randomized"`` (randomized SVD) or ``"svd"`` (exact).
        power_iters, oversample: power steps; the range finder's extra columns (``"power"``'s first basis too).
        transition: what happens to the moments when the basis changes: ``"rotate"`` (LDAdam),
            ``"reset"`` (zero them and restart bias correction) or ``"keep"`` (GaLore; for ablations only).
        variance_clamp: clamp the variance estimate ``v_hat - u_hat^2`` at 0 before rotating (LDAdam).
        error_feedback: keep what the projection drops in a full-size buffer and add it back next step.
        ef_dtype: dtype of that buffer, ``"auto"`` (bfloat16 on an accelerator, float32 on the CPU), ``"float32"``
            or ``"bfloat16"``.
        ef_decay: ``gamma``, the buffer's decay per step: ``"auto"`` (about one basis interval ``n``, the steps
            between a group's last two bases: ``1 - 1/n`` within ``[beta1, 0.99]``; 0.99 with a fixed basis) or a
            number in (0, 1]. Undecayed (1.0), the accumulated input re-applies every dropped gradient at every step
            (an integral wind-up: on a regression the loss falls, then rises).
        update_scale: each low-rank update's factor: ``"auto"``, ``sqrt(a / r)`` (smaller side ``a``, rank ``r``: an
            update about as large as AdamW's, so its LR carries over) or a number (``1.0``: the authors' step).
        fullrank_state: the state of the matrices that take AdamW (embeddings, heads): ``"adamw"`` (both moments in
            float32) or ``"factored"`` (bfloat16 first moment, Adafactor's factored second: a quarter of the bytes).
        seed: seed of random bases and randomized projections (use the same on every worker).
        full_rank: parameters that take the AdamW step whatever their group's rank, or a mapping from each to why
            (the strategies pass embeddings and output heads here, SPEC §2; :meth:`describe` shows the why).
        foreach: the grouped implementation (default); ``False`` runs the readable per-matrix reference
            (:mod:`lightning_lordo.optim.functional`), which tests compare the grouped one with.
        layout: the grouped step's (:func:`functional.lowrank_grouped`): ``"in_place"`` (matrix by matrix, the CPU's
            cost model), ``"stacked"`` (one batched op per shape, the accelerators'), ``"compiled"`` (stacked, its
            last full-size pass compiled: :mod:`~lightning_lordo.optim.compiled`) or ``None``: by device (compiled
            on CUDA where Triton is installed, :func:`~lightning_lordo.optim.compiled.on_cuda`).
        fused: for the AdamW parameters (with ``foreach``): torch's fused AdamW (``True``) or its foreach AdamW
            (``False``); ``None`` takes the fused one on the CPU and foreach elsewhere.

    A low-rank matrix without a basis at its first step gets one from its own gradient. Distributed, the
    synchronizer gives it one from the averaged gradient first (:meth:`missing_bases`, :meth:`install_bases`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = OPTIMIZER_DEFAULTS["lr"],
        betas: tuple[float, float] = OPTIMIZER_DEFAULTS["betas"],
        eps: float = OPTIMIZER_DEFAULTS["eps"],
        weight_decay: float = OPTIMIZER_DEFAULTS["weight_decay"],
        *,
        seed: int = 0,
        full_rank: Iterable[Tensor] = (),
        foreach: bool = True,
        fused: Optional[bool] = None,
        layout: Optional[str] = None,
        **knobs: Any,
    ) -> None:
        unknown = set(knobs) - set(OPTIMIZER_DEFAULTS)
        if unknown:
            raise TypeError(
                f"LoRDO got unknown arguments {sorted(unknown)}; the knobs are {sorted(OPTIMIZER_DEFAULTS)}."
            )
        defaults = {**OPTIMIZER_DEFAULTS, **knobs, "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        check_optimizer_knobs(defaults, in_group=False)
        check_knob_combinations(knobs, defaults)
        check_whole_optimizer(seed=seed, foreach=foreach, fused=fused, layout=layout)
        given = full_rank
        reasons = {id(p): why for p, why in full_rank.items()} if isinstance(full_rank, Mapping) else {}
        full_rank = list(full_rank) if isinstance(full_rank, Iterable) and not isinstance(full_rank, Tensor) else None
        if full_rank is None or not all(isinstance(p, Tensor) for p in full_rank):
            raise ValueError(f"Invalid full_rank={given!r}: it must be an iterable of parameters (tensors). "
                             "Pass e.g. full_rank=[model.lm_head.weight].")
        self.seed = seed
        self.foreach, self.fused, self.layout = foreach, fused, layout
        self._compiled_on_cuda = compiled.on_cuda(layout)  # Triton looked for once: a step compares devices only
        self._full_rank = {id(p): reasons.get(id(p), "listed in full_rank") for p in full_rank}  # id -> why
        self._random_bases = False  # set by init_random_bases: later bases are seeded random ones too
        self._warned: set[tuple[tuple[int, ...], int]] = set()
        self._stats: dict[str, Tensor] = {}
        self._record, self._stats_age = False, 0  # request_diagnostics: collect them in the next step; steps since
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        check_group_keys(param_group, OPTIMIZER_DEFAULTS, ("seed", "full_rank", "foreach", "fused", "layout"))
        merged = {**self.defaults, **param_group}  # validated before appending: a rejected group is not left behind
        check_optimizer_knobs(merged, in_group=True)
        check_knob_combinations({k: v for k, v in param_group.items() if k in OPTIMIZER_DEFAULTS}, merged)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        start_counting(group)
        for p in group["params"]:
            if p.ndim == 2 and group["rank"] != 0:
                r, a = resolve_rank(group["rank"], min(p.shape)), min(p.shape)
                if r >= a and (tuple(p.shape), r) not in self._warned:
                    self._warned.add((tuple(p.shape), r))
                    warnings.warn(f"LoRDO: rank={r} is not below the smaller side ({a}) of a {tuple(p.shape)} weight, "
                                  "so that weight runs full-rank AdamW (a basis of full rank saves nothing). Pass a "
                                  "smaller rank, or rank=0 in its param group to opt it out explicitly.", stacklevel=3)

    def lowrank_rank(self, p: Tensor, group: Mapping[str, Any]) -> int:
        """The rank this parameter runs at in this group, or 0 when it takes the AdamW step."""
        if p.ndim != 2 or group["rank"] == 0 or id(p) in self._full_rank:
            return 0
        r = resolve_rank(group["rank"], min(p.shape))
        return r if r < min(p.shape) else 0  # SPEC §2: low-rank where min(p, q) > r

    def lowrank_params(self) -> list[Tensor]:
        """All parameters that take the low-rank step, in param-group order."""
        return [p for g in self.param_groups for p in g["params"] if self.lowrank_rank(p, g)]

    def lowrank_ranks(self) -> dict[Tensor, int]:
        """``{param: rank}`` for the parameters that take the low-rank step, in param-group order."""
        return {p: r for p, _, r in self._lowrank_entries()}

    def describe(self, names: Optional[Mapping[Tensor, str]] = None) -> list[dict[str, Any]]:
        """Which parameter takes which step, and why: one row per parameter (print it, or log it)."""
        return report.describe(self, names)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One local step (SPEC §3) for every parameter that has a gradient (:mod:`~lightning_lordo.optim.
        functional`). No host synchronization with the parameters' device: step counters live on the CPU."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_bases()
        stats: Optional[dict[str, Tensor]] = {} if self._record else None
        for group in self.param_groups:
            lowrank, adamw = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.is_complex():  # (its real state would drop the imaginary part)
                    raise RuntimeError(f"LoRDO supports neither sparse gradients nor complex parameters: {p.shape}.")
                (lowrank if self.lowrank_rank(p, group) else adamw).append(p)
            h = functional.Hyper.of(group)
            self._adamw_step(adamw, h)
            self._lowrank_step(lowrank, h, stats)
            group["since_refresh"] += bool(lowrank)
        self._stats, self._record, self._stats_age = (stats, False, 0) if stats is not None else \
            (self._stats, self._record, self._stats_age + 1)
        return loss

    def _step_counts(self, params: list[Tensor]) -> list[float]:
        """Count this step for ``params`` (CPU counters) and return each one's count."""
        steps = [self.state[p]["step"] for p in params]
        if steps:
            torch._foreach_add_(steps, 1.0)
        return [s.item() for s in steps]

    def _lowrank_step(self, params: list[Tensor], h: functional.Hyper, stats: Optional[dict[str, Tensor]]) -> None:
        counts = self._step_counts(params)
        if not self.foreach:
            for p, t in zip(params, counts):
                reference.lowrank_reference(p, self.state[p], h, t, stats)
            return
        buckets: dict[tuple[Any, ...], list[Tensor]] = defaultdict(list)
        for p, t in zip(params, counts):  # one bucket: one shape, dtype, device and step count
            state = self.state[p]
            ef = state.get("error_feedback")
            buckets[(tuple(p.shape), p.dtype, p.device, t, ef.dtype if ef is not None else None)].append(p)
        for (_, _, _, t, _), bucket in buckets.items():
            functional.lowrank_grouped(bucket, [self.state[p] for p in bucket], h, t, stats,
                                       not self.stacked_layout(bucket[0]), self.layout == "compiled" or (
                                           self._compiled_on_cuda and bucket[0].device.type == "cuda"))

    def _adamw_step(self, params: list[Tensor], h: functional.Hyper) -> None:
        """The full-rank ``params``' step (state created or fit to ``fullrank_state`` first): torch's own AdamW where
        it applies, :mod:`~lightning_lordo.optim.fullrank` for the factored state, the QH mix, low-precision weights."""
        kinds = [is_factored(p, h) for p in params]
        for p, factored in zip(params, kinds):
            state = self.state[p]
            if not state:  # torch's fused AdamW keeps its step count on the device
                state.update(fullrank.new_state(p, h, self._fused_for(p) and not factored))
            elif ("exp_avg_sq" if factored else "factored_row") in state:  # fullrank_state changed
                fullrank.conform(p, state, h, self._fused_for(p) and not factored)
        factored = [p for p, f in zip(params, kinds) if f]
        counts = self._step_counts(factored)
        if self.foreach and factored:
            fullrank.factored_step(factored, [self.state[p] for p in factored], h, counts)
        elif factored:
            for p, t in zip(factored, counts):
                fullrank.factored_reference(p, self.state[p], h, t)
        params = [p for p, f in zip(params, kinds) if not f]
        if not self.foreach:
            for p, t in zip(params, self._step_counts(params)):
                reference.adamw_reference(p, self.state[p], h, t)
            return
        native: dict[tuple[Any, ...], list[Tensor]] = defaultdict(list)  # moments in p's dtype, no QH mix
        ours: dict[torch.device, list[Tensor]] = defaultdict(list)
        for p in params:
            if h.update != "subspace_qh" and p.dtype in (torch.float32, torch.float64):
                native[(p.device, p.dtype, self._fused_for(p))].append(p)
            else:
                ours[p.device].append(p)
        for (_, _, fused), bucket in native.items():
            functional.adamw_torch(bucket, [self.state[p] for p in bucket], h, fused=fused)
        for bucket in ours.values():
            fullrank.adamw_grouped(bucket, [self.state[p] for p in bucket], h, self._step_counts(bucket))

    def stacked_layout(self, p: Tensor) -> bool:
        """Whether ``p``'s matrices take the stacked layout (``layout``, else by device: stacked off the CPU)."""
        return self.foreach and (self.layout or ("stacked" if p.device.type != "cpu" else "in_place")) != "in_place"

    def _fused_for(self, p: Tensor) -> bool:
        """Whether ``p`` (an AdamW parameter) takes torch's fused AdamW: ``fused=True``, or ``None`` on the CPU."""
        if not self.foreach or p.dtype not in (torch.float32, torch.float64):  # moments in another dtype
            return False
        return self.fused if self.fused is not None else p.device.type == "cpu"

    def request_diagnostics(self) -> None:
        """Collect the sums behind :meth:`diagnostics` during the next step only (the synchronizer asks for the step
        before each sync); no step computes them otherwise."""
        self._record = True

    def diagnostics(self, age: Optional[int] = None) -> dict[str, float]:
        """What the last step that :meth:`request_diagnostics` asked for did: ``term_ratio``, RMS((1-omega) D_full) /
        RMS(omega D_low) over all low-rank matrices (which term drives the run); ``error_feedback_norm``, the
        Frobenius norm of all error-feedback buffers. ``age``: only if that step was ``age`` steps ago (else none)."""
        return report.diagnostics(self._stats) if age is None or age == self._stats_age else {}

    # ------------------------------------------------------------------ bases
    def _init_lowrank_state(self, p: Tensor, group: dict[str, Any], r: int) -> dict[str, Tensor]:
        """The state of a low-rank matrix, its missing entries created (zeros, step 0)."""
        state = self.state[p]
        a, b = sorted(p.shape)
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(r, b, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(r, b, dtype=torch.float32, device=p.device)
        if group["error_feedback"] and "error_feedback" not in state:
            state["error_feedback"] = canonical(torch.zeros_like(p, dtype=ef_dtype_for(group["ef_dtype"], p.device)), p)
        if group["normalizer"] == "factored" and "factored_row" not in state:
            state["factored_row"] = torch.zeros(a, dtype=torch.float32, device=p.device)
            state["factored_col"] = torch.zeros(b, dtype=torch.float32, device=p.device)
        return state

    def conform_state(self, names: Optional[Mapping[Tensor, str]] = None) -> list[str]:
        """Make each parameter's state fit its group's knobs as they are now (after knobs changed, e.g. on a resume),
        and return what changed, naming parameters by ``names`` (:func:`lightning_lordo.optim.conversion.
        conform_state`)."""
        return conversion.conform_state(self, names)

    def _seed_for(self, index: int, p: Tensor, generation: Optional[int]) -> int:
        """Seed of the random numbers of matrix ``index``'s next basis: from ``generation`` when given (the
        synchronizer passes its optimizer-step count, identical on every worker), else from the parameter's own
        step count (one process: the same thing)."""
        if generation is None:
            state = self.state.get(p, {})
            generation = int(state["step"].item()) if "step" in state else 0
        return mix_seed(self.seed, index, generation)

    def missing_bases(self) -> dict[Tensor, Tensor]:
        """``{param: gradient}`` (zeros where a parameter has none) for the trainable low-rank matrices without a
        basis yet, in param-group order. Frozen parameters (``requires_grad=False``, no gradient) never step: no
        basis, no state, no traffic."""
        missing = {}
        for group in self.param_groups:
            for p in group["params"]:
                if self.lowrank_rank(p, group) and _trainable(p) and "basis" not in self.state[p]:
                    missing[p] = p.grad if p.grad is not None else torch.zeros_like(p)
        return missing

    def _ensure_bases(self) -> None:  # a matrix without a gradient does not step: its basis waits for its first one
        missing = {p: g for p, g in self.missing_bases().items() if p.grad is not None}
        if missing and self._random_bases:  # e.g. a parameter unfrozen later: a seeded basis, as the others got
            self.init_random_bases()
        elif missing:
            self.install_bases(missing)

    @torch.no_grad()
    def init_random_bases(self, generation: int = 0) -> None:
        """Give every trainable low-rank matrix without a basis a seeded random one (identical on all workers);
        matrices that become trainable later get theirs the same way at their first step."""
        self._random_bases = True
        for index, (p, group, r) in enumerate(self._lowrank_entries()):
            if not _trainable(p) or "basis" in self.state.get(p, {}):
                continue
            basis = random_basis(min(p.shape), r, self._seed_for(index, p, generation), p.device)
            self._init_lowrank_state(p, group, r)["basis"] = basis

    @torch.no_grad()
    def compute_bases(self, sources: Mapping[Tensor, Tensor], generation: Optional[int] = None,
                      spans: Optional[Mapping[Tensor, Tensor]] = None) -> dict[Tensor, Tensor]:
        """New bases, without changing anything: ``{param: basis}`` (float32, ``a x r``, canonical orientation)
        for each low-rank parameter in ``sources`` (``{param: matrix}``, e.g. the averaged pseudo-gradient, whose
        top-r left singular subspace becomes the basis; warm-started from the current basis). With ``foreach``,
        same-shape matrices are stacked (:mod:`~lightning_lordo.optim.bases`). ``spans``: bases of some sources'
        column spaces, taken as they are where they apply (:func:`~lightning_lordo.optim.bases.spanned`)."""
        bases, stacked, warms = bases_module.spanned(self._lowrank_entries(), spans or {}), [], {}
        for index, (p, group, r) in enumerate(self._lowrank_entries()):
            if p not in sources or p in bases:
                continue
            warm = warms[p] = self.state.get(p, {}).get("basis")
            if self.stacked_layout(p) and bases_module.batchable(group, warm):
                stacked.append((p, group, r))
                continue
            bases[p] = compute_basis(
                canonical(sources[p], p), r, group["projection"], warm=warm, power_iters=group["power_iters"],
                oversample=group["oversample"], seed=self._seed_for(index, p, generation))
        bases.update(bases_module.compute_stacked(stacked, sources, warms))
        return {p: bases[p] for p, _, _ in self._lowrank_entries() if p in bases}  # in parameter order

    @torch.no_grad()
    def set_bases(self, bases: Mapping[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Install ``bases`` (from :meth:`compute_bases`) and move each matrix's moments into its new basis
        (``transition``). Local tensor math only (with ``foreach``, stacked by shape). Returns ``{param: movement}``,
        the fraction of the old subspace the new basis lost (0-d tensors; only for parameters that had a basis)."""
        entries = [(p, g, r) for p, g, r in self._lowrank_entries() if p in bases]
        bases_module.check_shapes(entries, bases)
        refreshed = [g for p, g, _ in entries if "basis" in self.state.get(p, {})]  # a first basis refreshes none
        states = [self._init_lowrank_state(p, g, r) for p, g, r in entries]
        stacked = bool(entries) and self.stacked_layout(entries[0][0])
        movement = (bases_module.install_stacked if stacked else bases_module.install_reference)(entries, states, bases)
        record_refresh(refreshed)
        return movement

    def fold_error_feedback(self, params: Iterable[Tensor]) -> None:
        """Fold the error-feedback buffers of ``params`` (:func:`~.functional.fold_error_feedback`)."""
        for p in params:
            if p in self.state:
                fold_error_feedback(self.state[p])

    def install_bases(self, sources: Mapping[Tensor, Tensor], generation: Optional[int] = None) -> dict[Tensor, Tensor]:
        """:meth:`compute_bases` then :meth:`set_bases`: new bases from ``sources``, moments moved into them."""
        return self.set_bases(self.compute_bases(check_sources(self._lowrank_entries(), sources), generation))

    def _lowrank_entries(self) -> list[tuple[Tensor, dict[str, Any], int]]:
        return [(p, g, r) for g in self.param_groups for p in g["params"] if (r := self.lowrank_rank(p, g))]

    # ------------------------------------------------------------------ state and accounting
    def load_state_dict(self, state_dict: dict[str, Any], names: Optional[Mapping[Tensor, str]] = None) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, but keeps each state tensor's saved dtype (PyTorch casts
        floating state to the parameter's dtype; LoRDO keeps its math state in float32, the error-feedback buffer in
        its own dtype), and makes the state fit the knobs (:meth:`conform_state`: e.g. AdamW's moments of a low-rank
        matrix restart); :attr:`load_notes` says what changed, naming parameters by ``names``."""
        super().load_state_dict(state_dict := conversion.with_knobs_kept(self, state_dict))
        conversion.restore_saved_state(self, state_dict)
        self.load_notes = conversion.conform_state(self, names)

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy, pickle: torch's keeps only defaults, state, groups
        return conversion.picklable(self, super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        conversion.unpickled(self)

    def memory_report(self) -> dict[str, int]:
        """Bytes of optimizer state by category (SPEC §8), and AdamW's for the same parameters (:mod:`.report`)."""
        return report.memory_report(self)


def _trainable(p: Tensor) -> bool:
    """False for a frozen parameter (``requires_grad=False`` and no gradient): it never steps."""
    return p.requires_grad or p.grad is not None
