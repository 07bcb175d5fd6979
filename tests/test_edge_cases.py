"""Model shapes and training setups at the edges: 2 processes launched by fork, assertions inside the workers.

Each fit checks, inside every worker, something that fails if the feature is broken: the number and steps of
the synchronizations, replicas identical (``all_gather``) right after each sync and different between syncs,
parameters unchanged where they must be, the loss on the whole data set lower at the end than at the start.
Warnings raised inside forked workers do not reach the parent, so warning counts are checked in 1-device fits
that run in this process (``start_method="popen"``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, regression_data, trainer
from torch import Tensor, nn

from lightning_lordo import LoRDO

Check = Callable[[L.Trainer, L.LightningModule], None]


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """The same initial weights whatever ran before, so the loss thresholds below are deterministic."""
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------------ models
class Tiny(TinyRegressor):
    """TinyRegressor with a forward, a loss scale (to make gradients large) and an optionally frozen layer."""

    def __init__(self, loss_scale: float = 1.0, frozen: bool = False, optimize_frozen: bool = True,
                 width: int = 24, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if width != 24:
            self.net = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 32),
                                     nn.GELU(), nn.Linear(32, 3))
        self.loss_scale, self.optimize_frozen = loss_scale, optimize_frozen
        if frozen:
            self.net[3].requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y) * self.loss_scale

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw" and not self.optimize_frozen:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)
        return super().configure_optimizers()


class Regression(L.LightningModule):
    """Base of the custom models below: MSE on the helpers' regression data, AdamW."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class NoMatrices(Regression):
    """Only 3-D (convolution) and 1-D parameters: nothing the low-rank step applies to."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(1, 4, 3, padding=1), nn.Conv1d(4, 3, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(nn.functional.gelu(self.conv1(x[:, None, :]))).mean(-1) * self.scale


class Branchy(Regression):
    """A branch used only on batches whose index has the given parity: its parameters get no gradient otherwise."""

    def __init__(self, parity: int) -> None:
        super().__init__()
        self.parity = parity
        self.trunk, self.branch, self.head = nn.Linear(12, 24), nn.Linear(24, 24), nn.Linear(24, 3)

    def forward(self, x: Tensor, use_branch: bool = True) -> Tensor:
        h = nn.functional.gelu(self.trunk(x))
        if use_branch:
            h = h + nn.functional.gelu(self.branch(h))
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x, use_branch=batch_idx % 2 == self.parity), y)


class Tied(Regression):
    """Two Linear layers sharing one weight Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.gelu(self.inp(x))
        h = nn.functional.gelu(self.a(h))
        return self.out(nn.functional.gelu(self.b(h)))


def dataset_loss(module: L.LightningModule) -> float:
    x, y = regression_data().tensors
    with torch.no_grad():
        return nn.functional.mse_loss(module(x), y).item()


# ------------------------------------------------------------------------------------------------ checker
class FitChecker(L.Callback):
    """Runs in every worker. After each batch: the sync count follows the optimizer steps (not the batches) and
    replicas are identical exactly when no local step was taken since the last sync. At the end of fit (after the
    final sync): one model on all ranks, finite, lower loss on the whole data set, the expected sync steps, then
    ``extra``."""

    def __init__(self, sync_every: int, report_steps: Optional[list[int]] = None, extra: Optional[Check] = None,
                 loss_drops: bool = True) -> None:
        self.k, self.report_steps, self.extra, self.loss_drops = sync_every, report_steps, extra, loss_drops
        self.different = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_loss = dataset_loss(module)
        assert torch.equal(*gather(flat_params(module))), "replicas must start identical"

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        assert sync.optimizer_steps == trainer.global_step
        last = trainer.strategy.final_sync_done  # the final sync runs at the last step itself
        assert sync.syncs_done == (math.ceil if last else math.floor)(sync.optimizer_steps / self.k)
        same = torch.equal(*gather(flat_params(module)))
        if sync.steps_since_sync == 0:
            assert same, f"replicas differ right after sync {sync.syncs_done}"
        else:
            assert not same, "replicas identical between syncs: no local steps?"
            self.different += 1

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        copies = gather(flat_params(module))
        assert torch.equal(copies[0], copies[1]), "training must end with one model on all ranks"
        assert torch.isfinite(copies[0]).all()
        assert sync.steps_since_sync == 0 and sync.skipped_syncs == 0
        assert sync.syncs_done == math.ceil(sync.optimizer_steps / self.k) == len(trainer.strategy.sync_reports)
        if self.report_steps is not None:
            assert [r.step for r in trainer.strategy.sync_reports] == self.report_steps
        assert self.different > 0, "no local steps were observed"
        if self.loss_drops:
            end = dataset_loss(module)
            assert end < 0.98 * self.start_loss, (self.start_loss, end)
        if self.extra is not None:
            self.extra(trainer, module)


def fit2(module: L.LightningModule, strategy: Any, checker: L.Callback, *more: L.Callback, **kwargs: Any) -> None:
    trainer(strategy, devices=2, callbacks=[checker, *more], **kwargs).fit(module, loader())


def lowrank_bases_identical(trainer: L.Trainer, module: L.LightningModule) -> None:
    optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
    assert optimizer.lowrank_params()
    for p in optimizer.lowrank_params():
        q = optimizer.state[p]["basis"]
        assert torch.equal(*gather(q)), "bases differ between ranks"
        torch.testing.assert_close(q.mT @ q, torch.eye(q.shape[1]), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ shapes
def lordo_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and str(w.message).startswith("LoRDO")]


SHAPES = {
    "no 2-D weights": (NoMatrices, 4, 0, "no parameter of this model takes the low-rank step"),
    "all matrices below the rank": (Tiny, 32, 0, "no parameter of this model takes the low-rank step"),
    "one matrix below the rank": (Tiny, 14, 1, "1 weight matrices are not larger than the rank"),  # 12 x 24; head AdamW
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_the_method_cannot_help_warn_once_and_train_full_rank(shape: str) -> None:
    model_class, rank, lowrank, message = SHAPES[shape]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(lordo(sync_every=3, rank=rank, start_method="popen"), devices=1, max_steps=7)
        module = model_class()
        before = dataset_loss(module)
        fit.fit(module, loader())
    found = lordo_warnings(caught)
    assert len(found) == 1, found
    assert message in found[0]
    plan = fit.strategy.parameter_plan()
    assert [row["step"] for row in plan].count("lowrank") == lowrank
    assert fit.strategy.synchronizer.syncs_done == 2  # one device: bases refreshed at steps 3 and 6, no rounds
    assert dataset_loss(module) < before


def test_a_weight_norm_magnitude_is_not_called_a_matrix_below_the_rank() -> None:
    """weight_norm's magnitude is a (d, 1) column: no rank can help it, so it is not in the warning that asks for a
    lower rank (every weight_norm user got it)."""
    module = Tiny()
    module.net[3] = nn.utils.parametrizations.weight_norm(module.net[3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(lordo(sync_every=3, start_method="popen"), devices=1, max_steps=3)
        fit.fit(module, loader())
    assert not [m for m in lordo_warnings(caught) if "not larger than the rank" in m]
    assert (16, 1) in [tuple(row["shape"]) for row in fit.strategy.parameter_plan()]  # it is there, on AdamW


@pytest.mark.parametrize(("model_class", "rank"), [(NoMatrices, 4), (Tiny, 32)], ids=["no 2-D", "all below rank"])
def test_shapes_the_method_cannot_help_train_on_two_processes(model_class: type, rank: int) -> None:
    def full_rank_only(trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert [row["step"] for row in strategy.parameter_plan()] == ["adamw"] * len(list(module.parameters()))
        totals = strategy.accountant.totals
        assert totals["pseudo_gradients"] > 0 and "moments" not in totals and "initial_gradients" not in totals

    fit2(model_class(), lordo(sync_every=4, rank=rank), FitChecker(4, [4, 8, 10], full_rank_only), max_steps=10)


# ------------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize(("k", "max_steps", "accumulate", "report_steps"), [
    (50, 10, 1, [10]),        # K beyond the run: only the final sync at the end of fit
    (4, 10, 1, [4, 8, 10]),   # max_steps not a multiple of K: the final sync takes the remainder
    (3, 7, 2, [3, 6, 7]),     # accumulation: K counts optimizer steps, not batches
], ids=["K>steps", "steps%K!=0", "accumulate2"])
def test_sync_schedule(k: int, max_steps: int, accumulate: int, report_steps: list[int]) -> None:
    batches = []

    def counted_in_batches(trainer: L.Trainer, module: L.LightningModule) -> None:
        assert trainer.global_step == max_steps and len(batches) == max_steps * accumulate
        # syncs happen on the batch that completes the K-th optimizer step, not on the K-th batch, and the final
        # one on the batch of the last optimizer step (so the checkpoints written at the end hold it)
        synced_at = [i for i, (before, after) in enumerate(zip([0, *batches], batches)) if after > before]
        assert synced_at == [s * accumulate - 1 for s in report_steps]

    class BatchLog(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            batches.append(trainer.strategy.synchronizer.syncs_done)

    fit2(Tiny(), lordo(sync_every=k), FitChecker(k, report_steps, counted_in_batches), BatchLog(),
         max_steps=max_steps, accumulate_grad_batches=accumulate)


# ------------------------------------------------------------------------------------------------ clipping
class GradProbe(L.Callback):
    """Gradient size before clipping (``on_before_optimizer_step``) and as the optimizer sees it (after the
    closure, which includes Lightning's clipping, inside the optimizer's ``step``)."""

    def __init__(self) -> None:
        self.before: list[tuple[float, float]] = []
        self.after: list[tuple[float, float]] = []

    @staticmethod
    def stats(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        return norm, max(g.abs().max().item() for g in grads)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        assert isinstance(optimizer, LoRDO)
        inner = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            def probed() -> Any:
                out = closure()
                self.after.append(self.stats(optimizer))
                return out

            return inner(probed, **kwargs)

        optimizer.step = step  # type: ignore[method-assign]

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.before.append(self.stats(optimizer))


@pytest.mark.parametrize("algorithm", ["norm", "value", None], ids=["norm", "value", "off"])
def test_gradient_clipping(algorithm: Optional[str]) -> None:
    probe = GradProbe()
    clip = 0.5

    def clipped(trainer: L.Trainer, module: L.LightningModule) -> None:
        assert len(probe.before) == len(probe.after) == trainer.global_step == 10
        index = {"norm": 0, "value": 1, None: 0}[algorithm]
        assert max(b[index] for b in probe.before) > 2 * clip  # clipping has something to do
        for (norm_b, max_b), (norm_a, max_a) in zip(probe.before, probe.after):
            if algorithm is None:
                assert (norm_a, max_a) == (norm_b, max_b)
            elif algorithm == "norm":
                assert norm_a <= clip * (1 + 1e-4) and (norm_b <= clip or math.isclose(norm_a, clip, rel_tol=1e-3))
            else:
                assert max_a <= clip and (max_b <= clip or max_a == clip)

    kwargs = {} if algorithm is None else dict(gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    fit2(Tiny(loss_scale=20.0, lr=3e-3), lordo(sync_every=4), FitChecker(4, [4, 8, 10], clipped), probe,
         max_steps=10, **kwargs)


# ------------------------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize(("optimize_frozen", "initial_basis"), [(True, "gradient"), (False, "gradient"),
                                                                (True, "random")],
                         ids=["frozen in AdamW", "frozen not in AdamW", "frozen in AdamW, random bases"])
def test_frozen_parameters_never_change_and_never_travel(optimize_frozen: bool, initial_basis: str) -> None:
    module = Tiny(frozen=True, optimize_frozen=optimize_frozen)
    frozen = list(module.net[3].parameters())
    initial_frozen = [p.detach().clone() for p in frozen]
    initial_other = flat_params(module.net[0])

    def unchanged(trainer: L.Trainer, module: L.LightningModule) -> None:
        live = list(module.net[3].parameters())
        for p, p0 in zip(live, initial_frozen):
            assert not p.requires_grad and torch.equal(p, p0), "a frozen parameter changed"
            assert torch.equal(*gather(p.detach()))
        assert not torch.equal(flat_params(module.net[0]), initial_other), "trainable parameters did not train"
        strategy = trainer.strategy
        optimizer: LoRDO = strategy.optimizers[0]
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        assert all((id(p) in in_optimizer) == optimize_frozen for p in live)
        assert not {id(p) for p in live} & {id(p) for p in strategy.synchronizer.params}
        assert all(not optimizer.state.get(p) for p in live), "optimizer state kept for a frozen parameter"
        # frozen parameters never travel: not in the pseudo-gradients, the first gradients or the moments
        totals = strategy.accountant.totals
        trainable = [p for p in module.parameters() if p.requires_grad]
        lowrank = [p for p in optimizer.lowrank_params() if p.requires_grad]
        assert len(lowrank) == 1  # net[0] (24 x 12); net[3] is frozen, the (3, 16) head is below the rank
        assert totals["pseudo_gradients"] == 3 * sum(p.numel() * 4 for p in trainable)
        assert totals.get("initial_gradients", 0) == (lowrank[0].numel() * 4 if initial_basis == "gradient" else 0)
        assert totals["moments"] == 3 * 2 * 4 * max(lowrank[0].shape) * 4  # 3 syncs, u and v, rank 4, float32

    fit2(module, lordo(sync_every=4, initial_basis=initial_basis), FitChecker(4, [4, 8, 10], unchanged),
         max_steps=10)


@pytest.mark.parametrize("parity", [0, 1, 2], ids=["branch on even batches", "branch on odd batches",
                                                   "branch never used"])
def test_parameters_without_gradient_on_some_steps(parity: int) -> None:
    """No deadlock, syncs on schedule, and the branch's optimizer state counts only the steps it had a gradient
    (parity 1: none at the first step, where the other bases are made; parity 2: never)."""
    module = Branchy(parity)
    branch0 = module.branch.weight.detach().clone()

    def branch_trained(trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
        assert any(p is module.branch.weight for p in optimizer.lowrank_params())
        used = 5 if parity < 2 else 0  # of the 10 batches
        assert optimizer.state[module.branch.weight]["step"].item() == used
        assert optimizer.state[module.trunk.weight]["step"].item() == 10
        assert torch.equal(module.branch.weight, branch0) == (used == 0)  # no gradient, no decay either
        lowrank_bases_identical(trainer, module)

    fit2(module, lordo(sync_every=4), FitChecker(4, [4, 8, 10], branch_trained), max_steps=10)


def test_tied_weights_stay_tied_and_identical() -> None:
    module = Tied()
    a0 = module.a.weight.detach().clone()

    def still_tied(trainer: L.Trainer, module: L.LightningModule) -> None:
        assert module.a.weight is module.b.weight, "the tie was broken"
        assert not torch.equal(module.a.weight, a0)
        strategy = trainer.strategy
        assert sum(p is module.a.weight for p in strategy.synchronizer.params) == 1
        assert sum(p is module.a.weight for g in strategy.optimizers[0].param_groups for p in g["params"]) == 1
        state = strategy.lightning_module_state_dict()
        assert torch.equal(state["a.weight"], state["b.weight"])
        lowrank_bases_identical(trainer, module)

    fit2(module, lordo(sync_every=4), FitChecker(4, [4, 8, 10], still_tied), max_steps=10)


class MidRoundCheckpoint(L.Callback):
    """A checkpoint taken between syncs holds the synchronized model (the anchor) under every name of a tied
    parameter, not the local replica under the second name."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.steps_since_sync == 0:
            return
        anchor = sync.anchor.tensors[[i for i, p in enumerate(sync.params) if p is module.a.weight][0]]
        assert not torch.equal(anchor, module.a.weight)  # mid-round: the replica moved away from the anchor
        state = trainer.strategy.lightning_module_state_dict()
        assert torch.equal(state["a.weight"], anchor)
        assert torch.equal(state["b.weight"], anchor), "b.weight (tied to a.weight) saved from the local replica"
        self.checked += 1


def test_tied_weights_mid_round_checkpoint_holds_the_anchor_under_both_names() -> None:
    checker = MidRoundCheckpoint()
    trainer(lordo(sync_every=4, start_method="popen", synchronous=False), devices=1, callbacks=[checker],
            max_steps=6).fit(
        Tied(), loader())
    assert checker.checked == 4  # steps 1, 2, 3 and 5 end mid-round (K = 4; the final sync runs at step 6)


# ------------------------------------------------------------------------------------------------ presets
def test_lordo_local_preset_trains_with_each_workers_own_bases() -> None:
    def local(trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert strategy.sync_config.basis_scope == "local" and strategy.sync_config.average_moments is False
        optimizer: LoRDO = strategy.synchronizer.optimizer
        assert optimizer.lowrank_params()
        for p in optimizer.lowrank_params():  # each worker's basis is from its own pseudo-gradient
            q0, q1 = gather(optimizer.state[p]["basis"])
            overlap = (q0.mT @ q1).square().sum().item() / q0.shape[1]
            assert overlap < 0.999, overlap
        totals = strategy.accountant.totals
        assert "moments" not in totals and "initial_gradients" not in totals

    fit2(Tiny(width=48), "lordo_local_fork", FitChecker(16, [16, 20], local), max_steps=20)


def test_lordo_local_preset_with_the_lowrank_int8_payload() -> None:
    """Local bases (each worker's own pseudo-gradient) with the compressed payload: one model after every sync,
    bases that differ between workers, and the payload's bytes (two int8 messages per matrix)."""
    def local_lowrank(trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        optimizer: LoRDO = strategy.synchronizer.optimizer
        for p in optimizer.lowrank_params():
            q0, q1 = gather(optimizer.state[p]["basis"])
            assert (q0.mT @ q1).square().sum().item() / q0.shape[1] < 0.999
        assert strategy.synchronizer.payloads.lowrank_payload is not None
        assert strategy.synchronizer.payloads.error_norm() > 0 and "moments" not in strategy.accountant.totals

    strategy = lordo(sync_every=16, basis_scope="local", average_moments=False, payload="lowrank",
                     payload_dtype="int8")
    fit2(Tiny(width=48), strategy, FitChecker(16, [16, 20], local_lowrank), max_steps=20)


def test_diloco_preset_trains_with_sgd() -> None:
    def sgd(trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert type(strategy.optimizers[0]) is torch.optim.SGD and strategy.lowrank is False
        assert set(strategy.accountant.totals) <= {"pseudo_gradients", "setup_broadcast", "lightning_sigterm_check",
                                                   "lightning_collectives", "buffers"}

    fit2(Tiny(optimizer="sgd", lr=0.05), "diloco_fork", FitChecker(16, [16, 20], sgd), max_steps=20)


# ------------------------------------------------------------------------------------------------ options
def _nesterov(trainer: L.Trainer, module: L.LightningModule) -> None:
    momentum = trainer.strategy.synchronizer.outer.momentum_buffers()
    assert len(momentum) == len(list(module.parameters())) and any(m.abs().sum() > 0 for m in momentum)
    assert torch.equal(*gather(torch.cat([m.reshape(-1) for m in momentum])))


def _random_basis(trainer: L.Trainer, module: L.LightningModule) -> None:
    assert "initial_gradients" not in trainer.strategy.accountant.totals  # no extra all-reduce at step 1


def _broadcast_bases(trainer: L.Trainer, module: L.LightningModule) -> None:
    optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
    per_sync = sum(optimizer.state[p]["basis"].numel() * 4 for p in optimizer.lowrank_params())
    sent = trainer.strategy.accountant.totals.get("bases", 0)
    # the first bases and those of the 3 syncs; a broadcast counts on its sender
    assert sent == (4 * per_sync if trainer.global_rank == 0 else 0)


def _error_feedback(trainer: L.Trainer, module: L.LightningModule) -> None:
    optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
    for p in optimizer.lowrank_params():
        ef = optimizer.state[p]["error_feedback"]
        assert torch.isfinite(ef).all() and ef.abs().sum() > 0


def _factored(trainer: L.Trainer, module: L.LightningModule) -> None:
    optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
    for p in optimizer.lowrank_params():
        for key in ("factored_row", "factored_col"):
            assert (optimizer.state[p][key] > 0).all()


def _svd(trainer: L.Trainer, module: L.LightningModule) -> None:
    assert all(r.subspace_movement is not None for r in trainer.strategy.sync_reports)


def _mu_auto(trainer: L.Trainer, module: L.LightningModule) -> None:
    # both terms get the same RMS per matrix, so omega alone sets their ratio: (1 - omega) / omega
    optimizer = trainer.strategy.synchronizer.optimizer
    omega = optimizer.param_groups[0]["omega"]
    ratio = optimizer.diagnostics()["term_ratio"]
    assert omega < 1 and math.isclose(ratio, (1 - omega) / omega, rel_tol=1e-3), (ratio, omega)


def _no_error_feedback(trainer: L.Trainer, module: L.LightningModule) -> None:
    optimizer: LoRDO = trainer.strategy.synchronizer.optimizer
    assert optimizer.lowrank_params()
    assert not any("error_feedback" in optimizer.state[p] for p in optimizer.lowrank_params())
    assert optimizer.memory_report()["error_feedback"] == 0


OPTIONS: dict[str, tuple[dict[str, Any], Check]] = {
    "nesterov": ({"outer_optimizer": "nesterov"}, _nesterov),
    "random initial basis": ({"initial_basis": "random"}, _random_basis),
    "broadcast bases": ({"broadcast_bases": True}, _broadcast_bases),
    "error feedback (the default)": ({}, _error_feedback),
    "no error feedback": ({"error_feedback": False}, _no_error_feedback),
    "factored": ({"normalizer": "factored"}, _factored),
    "svd": ({"projection": "svd"}, _svd),
    "mu auto": ({"mu": "auto"}, _mu_auto),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_trains_on_two_processes(option: str) -> None:
    knobs, check = OPTIONS[option]

    def both(trainer: L.Trainer, module: L.LightningModule) -> None:
        lowrank_bases_identical(trainer, module)
        check(trainer, module)

    fit2(Tiny(), lordo(sync_every=4, **knobs), FitChecker(4, [4, 8, 10], both, loss_drops=True),
         max_steps=10)


@pytest.mark.parametrize("random_bases", [False, True], ids=["gradient bases", "random bases"])
def test_optimizer_keeps_no_state_for_a_frozen_matrix_until_it_is_unfrozen(random_bases: bool) -> None:
    frozen, live = nn.Parameter(torch.randn(8, 12), requires_grad=False), nn.Parameter(torch.randn(8, 12))
    optimizer = LoRDO([frozen, live], rank=2)
    sources: list[set[int]] = []

    def step() -> None:  # as the synchronizer does: first bases for the matrices that lack one, then the step
        missing = {} if random_bases else optimizer.missing_bases()
        if missing:
            sources.append({id(p) for p in missing})  # what the synchronizer would average
            optimizer.install_bases(missing)
        optimizer.step()

    if random_bases:
        optimizer.init_random_bases()
    live.grad = torch.randn(8, 12)
    step()
    assert not optimizer.state[frozen] and "basis" in optimizer.state[live]
    assert sources == ([] if random_bases else [{id(live)}])  # the frozen matrix is not averaged at step 1
    frozen.requires_grad_(True)
    frozen.grad, live.grad = torch.randn(8, 12), torch.randn(8, 12)
    step()
    assert optimizer.state[frozen]["step"].item() == 1 and optimizer.state[live]["step"].item() == 2
    if random_bases:  # the seeded basis every worker computes alike, without any traffic
        twin = LoRDO([nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(8, 12))], rank=2)
        twin.init_random_bases()
        assert torch.equal(optimizer.state[frozen]["basis"], twin.state[twin.param_groups[0]["params"][0]]["basis"])
        assert sources == []
    else:  # its first basis comes from the (averaged) gradient, like the others' did
        assert sources == [{id(live)}, {id(frozen)}]
