r"""The LoRDO optimizer: the local step of SPEC §3 and the basis installation of SPEC §4.4-4.5.

Pure tensor math: no ``torch.distributed``, no Lightning. The synchronization (``lightning_lordo.sync``)
calls :meth:`LoRDO.install_bases` with the averaged pseudo-gradients; everything else happens in
:meth:`LoRDO.step`.

For a low-rank matrix (canonical orientation ``a x b``, ``a <= b``, basis ``Q`` of shape ``a x r``):

.. math::
    \begin{aligned}
    A &= \hat G + \gamma E, \qquad \hat g = Q^\top A, \qquad E \leftarrow A - Q\hat g
        \quad\text{(error feedback, optional)}\\
    u &\leftarrow \beta_1 u + (1-\beta_1)\hat g, \qquad v \leftarrow \beta_2 v + (1-\beta_2)\hat g^2\\
    D_{low} &= Q\,\frac{u/b_1}{\sqrt{v/b_2}+\epsilon}, \qquad
    D_{full} = \frac{\hat G}{\mu\,(S+\epsilon)}\\
    W &\leftarrow W(1-\eta\lambda) - \eta\left[(1-\omega)D_{full} + \omega D_{low}\right]
    \end{aligned}

with :math:`b_i = 1-\beta_i^t` and :math:`S` the full-rank normalizer of SPEC §6. Every other parameter
(1-D, embeddings, matrices opted out with ``rank=0``) takes a plain AdamW step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lordo.config import (
    EF_DTYPES,
    OPTIMIZER_DEFAULTS,
    check_knob_combinations,
    check_optimizer_knobs,
    resolve_rank,
)
from lightning_lordo.optim.projection import compute_basis, random_basis, rotate_moments, subspace_movement

_LOWRANK_MOMENTS = ("exp_avg", "exp_avg_sq")


class LoRDO(Optimizer):
    """Adam with moments in a shared rank-r subspace plus a full-rank quasi-hyperbolic term.

    Args:
        params: parameters or param groups, as for :class:`torch.optim.AdamW`. Any knob below can be set
            per group, GaLore-style: ``{"params": ..., "rank": 0}`` runs that group full-rank (AdamW).
        lr, betas, eps, weight_decay: as in :class:`torch.optim.AdamW` (decoupled weight decay).
        rank: rank ``r`` of each low-rank matrix: an int >= 1, or a float in (0, 1] taken as a fraction of
            each matrix's smaller side. A 2-D parameter whose smaller side is below ``r`` runs AdamW, with one
            warning; it is never silently clamped.
        omega: weight of the low-rank term; ``1 - omega`` weights the full-rank normalized term (SPEC §6).
        mu: scale of the full-rank term, or ``"auto"`` to give both terms the same RMS every step.
        normalizer: full-rank normalizer ``S``: ``"col_rms"``, ``"factored"``, ``"scalar"`` or ``"lifted"``.
        lifted_floor: for ``"lifted"``, floor of ``S`` as a fraction of ``sqrt(mean(v_hat))``.
        projection: how a new basis is computed: ``"power"`` (warm-started block power iteration + QR),
            ``"randomized"`` (randomized SVD) or ``"svd"`` (exact).
        power_iters: power steps of ``"power"`` and ``"randomized"``.
        oversample: extra columns of the randomized range finder.
        transition: what happens to the moments when the basis changes: ``"rotate"`` (LDAdam),
            ``"reset"`` (zero them and restart bias correction) or ``"keep"`` (GaLore; for ablations only).
        error_feedback: keep what the projection drops in a full-size buffer and add it back next step.
        ef_dtype: dtype of that buffer, ``"float32"`` or ``"bfloat16"``.
        ef_decay: ``gamma``, the buffer's decay per step (1 keeps everything).
        seed: seed of random bases and randomized projections (use the same on every worker).
        full_rank: parameters that take the AdamW step whatever their group's rank (the strategy passes
            embeddings and output heads here, SPEC §2).

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
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"Invalid seed={seed!r}: it must be an integer. Pass e.g. seed=0.")
        given = full_rank
        full_rank = list(full_rank) if isinstance(full_rank, Iterable) and not isinstance(full_rank, Tensor) else None
        if full_rank is None or not all(isinstance(p, Tensor) for p in full_rank):
            raise ValueError(f"Invalid full_rank={given!r}: it must be an iterable of parameters (tensors). "
                             "Pass e.g. full_rank=[model.lm_head.weight].")
        self.seed = seed
        self._full_rank = {id(p) for p in full_rank}
        self._random_bases = False  # set by init_random_bases: later bases are seeded random ones too
        self._warned: set[tuple[tuple[int, ...], int]] = set()
        self._stats: dict[str, Tensor] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ layout
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # validate before appending, so a rejected group is not left behind in ``param_groups``
        merged = {**self.defaults, **param_group}
        check_optimizer_knobs(merged, in_group=True)
        check_knob_combinations({k: v for k, v in param_group.items() if k in OPTIMIZER_DEFAULTS}, merged)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.ndim == 2 and group["rank"] != 0:
                r, a = resolve_rank(group["rank"], min(p.shape)), min(p.shape)
                if r > a and (tuple(p.shape), r) not in self._warned:
                    self._warned.add((tuple(p.shape), r))
                    warnings.warn(
                        f"LoRDO: rank={r} is larger than the smaller side ({a}) of a {tuple(p.shape)} weight, so "
                        "that weight runs full-rank AdamW (no memory saving). Pass a smaller rank, or rank=0 in "
                        "its param group to opt it out explicitly.",
                        stacklevel=3,
                    )

    def lowrank_rank(self, p: Tensor, group: Mapping[str, Any]) -> int:
        """The rank this parameter runs at in this group, or 0 when it takes the AdamW step."""
        if p.ndim != 2 or group["rank"] == 0 or id(p) in self._full_rank:
            return 0
        r = resolve_rank(group["rank"], min(p.shape))
        return r if r <= min(p.shape) else 0

    def lowrank_params(self) -> list[Tensor]:
        """All parameters that take the low-rank step, in param-group order."""
        return [p for g in self.param_groups for p in g["params"] if self.lowrank_rank(p, g)]

    def describe(self, names: Optional[Mapping[Tensor, str]] = None) -> list[dict[str, Any]]:
        """Which parameter takes which step, and why: one row per parameter (print it, or log it)."""
        rows = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                r = self.lowrank_rank(p, group)
                if r:
                    reason = f"2-D, rank {r} <= smaller side {min(p.shape)}"
                elif p.ndim != 2:
                    reason = f"{p.ndim}-D"
                elif id(p) in self._full_rank:
                    reason = "listed in full_rank (embedding or output head)"
                elif group["rank"] == 0:
                    reason = "opted out (rank=0)"
                else:
                    reason = f"rank {resolve_rank(group['rank'], min(p.shape))} > smaller side {min(p.shape)}"
                name = names.get(p, "") if names is not None else ""
                rows.append({"name": name, "group": gi, "shape": tuple(p.shape),
                             "step": "lowrank" if r else "adamw", "rank": r, "reason": reason})
        return rows

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One local step (SPEC §3) for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_bases()
        self._stats = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LoRDO does not support sparse gradients; use a dense embedding.")
                r = self.lowrank_rank(p, group)
                if r:
                    self._lowrank_step(p, group, r)
                else:
                    self._adamw_step(p, group)
        return loss

    def _adamw_step(self, p: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        grad = p.grad.float()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
        momentum = state["exp_avg"] / (1 - beta1**t)
        if group["update"] == "subspace_qh":  # QHAdam: ((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)
            momentum = momentum.mul_(group["omega"]).add_(grad, alpha=1 - group["omega"])
        self._apply(p, momentum.div_(denom), group)

    def _lowrank_step(self, p: Tensor, group: dict[str, Any], r: int) -> None:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        eps, omega = group["eps"], group["omega"]
        state["step"] += 1
        t = state["step"].item()
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        grad = _canonical(p.grad, p).float()
        q = state["basis"]

        accumulated = grad
        if group["error_feedback"]:
            ef = state["error_feedback"]
            accumulated = grad + ef.float() * group["ef_decay"]
        projected = q.mT @ accumulated
        if group["error_feedback"]:
            residual = accumulated - q @ projected
            ef.copy_(residual)
            self._add_stat("ef_sq", ef.float().square().sum())  # the stored buffer (maybe bf16), not the residual

        state["exp_avg"].lerp_(projected, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(projected, projected, value=1 - beta2)
        v_hat = state["exp_avg_sq"] / bias2
        u_hat = state["exp_avg"] / bias1
        kind = group["update"]
        if kind == "subspace_qh":  # the QH mix inside the subspace, no full-rank term
            mixed = u_hat.mul_(omega).add_(projected, alpha=1 - omega)
            self._apply(p, _canonical(q @ mixed.div_(v_hat.sqrt().add_(eps)), p), group)
            return
        d_low = q @ (u_hat / (v_hat.sqrt() + eps) if kind == "lordo" else u_hat)
        update = d_low  # omega == 1: pure low-rank step
        if omega < 1.0:
            full_input = accumulated if group["full_rank_input"] == "accumulated" else grad
            d_full = full_input / (self._normalizer(state, group, grad, v_hat, bias2) + eps)
            if group["mu"] == "auto":  # mu = RMS(G/(S+eps)) / RMS(D_low): both terms get the same size
                d_full.mul_(_rms(d_low) / _rms(d_full).clamp(min=torch.finfo(torch.float32).tiny))
            else:
                d_full.div_(group["mu"])
            d_full.mul_(1.0 - omega)
            self._add_stat("full_sq", d_full.square().sum())
            update = d_full.add_(d_low, alpha=omega)
        self._add_stat("low_sq", d_low.square().sum() * omega**2)
        self._apply(p, _canonical(update, p), group)

    def _normalizer(
        self, state: dict[str, Tensor], group: dict[str, Any], grad: Tensor, v_hat: Tensor, bias2: float
    ) -> Tensor:
        """The full-rank normalizer S of SPEC §6, broadcastable to ``a x b``."""
        kind = group["normalizer"]
        if kind == "col_rms":
            return v_hat.mean(dim=0, keepdim=True).sqrt()
        if kind == "scalar":
            return v_hat.mean().sqrt()
        if kind == "mean_denom":  # S + eps = mean over all entries of (sqrt(v_hat) + eps)
            return v_hat.sqrt().mean()
        if kind == "lifted":
            floor = v_hat.mean().sqrt() * group["lifted_floor"]
            return torch.maximum((state["basis"].square() @ v_hat).sqrt(), floor)
        beta2 = group["betas"][1]  # factored: Adafactor's row/column second moments of the gradient itself
        squared = grad.square()
        state["factored_row"].mul_(beta2).add_(squared.mean(dim=1), alpha=1 - beta2)
        state["factored_col"].mul_(beta2).add_(squared.mean(dim=0), alpha=1 - beta2)
        row, col = state["factored_row"] / bias2, state["factored_col"] / bias2
        return (row[:, None] * col[None, :] / row.mean().clamp(min=torch.finfo(torch.float32).tiny)).sqrt()

    def _apply(self, p: Tensor, update: Tensor, group: dict[str, Any]) -> None:
        """Decoupled weight decay, then ``W -= lr * update`` (``update`` shaped like ``p``)."""
        lr = group["lr"]
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-lr)

    def _add_stat(self, key: str, value: Tensor) -> None:
        self._stats[key] = self._stats[key] + value if key in self._stats else value

    def diagnostics(self) -> dict[str, float]:
        """What the last step did, from sums collected during it (no extra pass over the tensors).

        ``term_ratio`` is RMS((1-omega) D_full) / RMS(omega D_low) over all low-rank matrices (which term
        drives the run); ``error_feedback_norm`` is the Frobenius norm of all error-feedback buffers.
        """
        out: dict[str, float] = {}
        if "low_sq" in self._stats and "full_sq" in self._stats:
            low = self._stats["low_sq"].item()
            out["term_ratio"] = (self._stats["full_sq"].item() / low) ** 0.5 if low > 0 else float("inf")
        if "ef_sq" in self._stats:
            out["error_feedback_norm"] = self._stats["ef_sq"].item() ** 0.5
        return out

    # ------------------------------------------------------------------ bases
    def _init_lowrank_state(self, p: Tensor, group: dict[str, Any], r: int) -> dict[str, Tensor]:
        state = self.state[p]
        if "exp_avg" in state:
            return state
        a, b = sorted(p.shape)
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros(r, b, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(r, b, dtype=torch.float32, device=p.device)
        if group["error_feedback"]:
            state["error_feedback"] = torch.zeros(a, b, dtype=EF_DTYPES[group["ef_dtype"]], device=p.device)
        if group["normalizer"] == "factored":
            state["factored_row"] = torch.zeros(a, dtype=torch.float32, device=p.device)
            state["factored_col"] = torch.zeros(b, dtype=torch.float32, device=p.device)
        return state

    def _seed_for(self, index: int, state: dict[str, Tensor]) -> int:
        return (self.seed * 1_000_003 + index * 7_919 + int(state["step"].item())) % (2**63)

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

    def _ensure_bases(self) -> None:
        missing = self.missing_bases()
        if missing and self._random_bases:  # e.g. a parameter unfrozen later: a seeded basis, as the others got
            self.init_random_bases()
        elif missing:
            self.install_bases(missing)

    @torch.no_grad()
    def init_random_bases(self) -> None:
        """Give every trainable low-rank matrix without a basis a seeded random one (identical on all workers);
        matrices that become trainable later get theirs the same way at their first step."""
        self._random_bases = True
        for index, (p, group, r) in enumerate(self._lowrank_entries()):
            if not _trainable(p):
                continue
            state = self._init_lowrank_state(p, group, r)
            if "basis" not in state:
                state["basis"] = random_basis(min(p.shape), r, self._seed_for(index, state), p.device)

    @torch.no_grad()
    def install_bases(self, sources: Mapping[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Compute a new basis for each low-rank parameter in ``sources`` and move its moments into it.

        Args:
            sources: ``{param: matrix}``, the matrix (same shape as the parameter, e.g. the averaged
                pseudo-gradient) whose top-r left singular subspace (canonical orientation) becomes the basis.

        Returns:
            ``{param: movement}``, the fraction of the old subspace the new basis lost (0-d tensors; only for
            parameters that had a basis before).
        """
        movement = {}
        for index, (p, group, r) in enumerate(self._lowrank_entries()):
            if p not in sources:
                continue
            state = self._init_lowrank_state(p, group, r)
            old = state.get("basis")
            new = compute_basis(
                _canonical(sources[p], p), r, group["projection"], warm=old, power_iters=group["power_iters"],
                oversample=group["oversample"], seed=self._seed_for(index, state),
            )
            if old is not None:
                self._transition(state, group, old, new)
                movement[p] = subspace_movement(old, new)
            state["basis"] = new
        return movement

    def _lowrank_entries(self) -> list[tuple[Tensor, dict[str, Any], int]]:
        return [(p, g, r) for g in self.param_groups for p in g["params"] if (r := self.lowrank_rank(p, g))]

    def _transition(self, state: dict[str, Tensor], group: dict[str, Any], old: Tensor, new: Tensor) -> None:
        kind = group["transition"]
        t = state["step"].item()
        if kind == "keep" or t == 0:
            return
        if kind == "reset":
            for key in (*_LOWRANK_MOMENTS, "factored_row", "factored_col"):
                if key in state:
                    state[key].zero_()
            state["step"].zero_()
            return
        beta1, beta2 = group["betas"]
        u, v = rotate_moments(state["exp_avg"], state["exp_avg_sq"], new.mT @ old, 1 - beta1**t, 1 - beta2**t,
                              clamp=group["variance_clamp"])
        state["exp_avg"].copy_(u)
        state["exp_avg_sq"].copy_(v)

    # ------------------------------------------------------------------ state and accounting
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, but keeps each state tensor's saved dtype.

        PyTorch casts floating state to the parameter's dtype; LoRDO keeps its math state in float32 (and the
        error-feedback buffer in its own dtype), so for bf16 parameters that cast would lose precision.
        """
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                for key, value in saved.get(index, {}).items():
                    if isinstance(value, Tensor) and key != "step":
                        self.state[p][key] = value.to(device=p.device, copy=True)
                index += 1

    def memory_report(self) -> dict[str, int]:
        """Bytes of optimizer state by category (SPEC §8), and AdamW's for the same parameters.

        Keys: ``lowrank_moments``, ``bases``, ``fullrank_moments``, ``error_feedback``, ``other`` (step
        counters, factored normalizer), ``adamw_equivalent`` (2 moments per parameter element, all params) and
        ``adamw_equivalent_lowrank`` (the same for the low-rank matrices alone).
        """
        report = dict.fromkeys(("lowrank_moments", "bases", "fullrank_moments", "error_feedback", "other",
                                "adamw_equivalent", "adamw_equivalent_lowrank"), 0)
        for group in self.param_groups:
            for p in group["params"]:
                lowrank = bool(self.lowrank_rank(p, group))
                adamw = 2 * p.numel() * torch.float32.itemsize
                report["adamw_equivalent"] += adamw
                report["adamw_equivalent_lowrank"] += adamw if lowrank else 0
                for key, value in self.state.get(p, {}).items():
                    report[_category(key, lowrank)] += value.numel() * value.element_size()
        return report


def _category(key: str, lowrank: bool) -> str:
    if key in _LOWRANK_MOMENTS:
        return "lowrank_moments" if lowrank else "fullrank_moments"
    return {"basis": "bases", "error_feedback": "error_feedback"}.get(key, "other")


def _canonical(t: Tensor, p: Tensor) -> Tensor:
    """``t`` (shaped like ``p``) as an ``a x b`` view with ``a <= b``; applied twice it gives ``t`` back."""
    return t.mT if p.shape[0] > p.shape[1] else t


def _trainable(p: Tensor) -> bool:
    """False for a frozen parameter (``requires_grad=False`` and no gradient): it never steps."""
    return p.requires_grad or p.grad is not None


def _rms(t: Tensor) -> Tensor:
    return t.square().mean().sqrt()
