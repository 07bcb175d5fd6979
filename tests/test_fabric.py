"""``Fabric(strategy="lordo")``: two processes launched by fork (asserts inside the workers), one-process plumbing
in this process, the Trainer strategy on the same data, and the example script as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_lordo import LoRDO, LoRDOFabricStrategy
from lightning_lordo.strategy_knobs import LAUNCH_SUFFIXES, PRESETS, strategy_kwargs
from tests.strategy_helpers import TinyRegressor, flat_params, gather, loader, lordo, regression_data, trainer

ROOT = Path(__file__).resolve().parents[1]
K = 4


def fabric_for(devices: int = 2, precision: str = "32-true", **knobs: Any) -> Fabric:
    """Fork for two workers; one device runs in this process (no launcher process)."""
    if knobs.get("lowrank", True):  # "diloco" takes no optimizer knobs
        knobs.setdefault("rank", 4)
    strategy = LoRDOFabricStrategy(sync_every=knobs.pop("sync_every", K), start_method="fork" if devices > 1
                                   else "popen", timeout=30, **strategy_kwargs(**knobs))
    return Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)


def regression_model(seed: int = 0) -> nn.Module:
    """The network of the Trainer tests' ``TinyRegressor``, built the same way (same seed, same parameters)."""
    torch.manual_seed(seed)
    return TinyRegressor().net


def run_steps(fabric: Fabric, model: Any, optimizer: Any, batches: Any, after: Callable[[int], None] = lambda s: None,
              clip: bool = False) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        after(step)
    return losses


def ranks_identical(t: torch.Tensor) -> bool:
    copies = gather(t)
    return all(torch.equal(copies[0], c) for c in copies[1:])


# ---------------------------------------------------------------------------------------------------- two processes
@pytest.mark.timeout(120)
def test_two_processes_convert_adam_sync_every_k_and_end_identical() -> None:
    fabric = fabric_for()
    model = regression_model()

    def work(fabric: Fabric) -> None:
        data = fabric.setup_dataloaders(loader(n=512))
        net, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        strategy: LoRDOFabricStrategy = fabric.strategy  # type: ignore[assignment]
        assert type(optimizer.optimizer) is LoRDO and isinstance(optimizer, LoRDO)
        assert not isinstance(net._forward_module, DistributedDataParallel), "no DDP wrapper"
        params = [p for p in model.parameters() if p.requires_grad]
        first_batch = next(iter(data))
        eval_loss = lambda: nn.functional.mse_loss(model(first_batch[0]), first_batch[1]).item()  # noqa: E731
        start = eval_loss()
        with fabric.no_backward_sync(net):  # accepted: there is nothing to skip
            fabric.backward(nn.functional.mse_loss(net(first_batch[0] + fabric.global_rank), first_batch[1]))
        assert not ranks_identical(params[0].grad), "backward must not all-reduce the gradients"
        optimizer.zero_grad()

        def check(step: int) -> None:
            assert strategy.synchronizer.steps_since_sync == step % K
            identical = ranks_identical(flat_params(model))
            assert identical == (step % K == 0), f"step {step}: replicas identical={identical}"

        steps = 30  # 7 rounds of K=4, then 2 local steps for finish()
        run_steps(fabric, net, optimizer, (b for _, b in zip(range(steps), data)), after=check)
        assert [r.step for r in strategy.sync_reports] == list(range(K, steps + 1, K))
        assert strategy.finish().step == steps and strategy.finish() is None  # a second call: nothing left
        assert ranks_identical(flat_params(model))
        assert eval_loss() < 0.5 * start, (start, eval_loss())
        summary = strategy.communication_summary()
        pseudo = sum(p.numel() * 4 for p in params)  # float32, the full payload: every number of every parameter
        assert all(r.bytes_by_purpose["pseudo_gradients"] == pseudo for r in strategy.sync_reports)
        assert summary["syncs"] == len(strategy.sync_reports) == 8 and summary["optimizer_steps"] == steps
        assert summary["ddp_equivalent_bytes"] == steps * pseudo
        assert summary["bytes_by_purpose"]["pseudo_gradients"] == 8 * pseudo
        assert 0 < summary["bytes_sent_total"] < summary["ddp_equivalent_bytes"]
        assert summary["bytes_saving_vs_ddp"] == summary["ddp_equivalent_bytes"] / summary["bytes_sent_total"] > 1.5
        assert summary["bytes_sent_total"] == strategy.accountant.total_bytes == sum(summary["bytes_by_purpose"]
                                                                                     .values())

    fabric.launch(work)


@pytest.mark.timeout(120)
def test_a_non_finite_round_is_discarded_on_every_rank_and_the_next_one_lands() -> None:
    """The README's guarantees under Fabric: rank 1's NaN makes the round at step K discarded on both ranks, every
    worker back at the last synchronized model with finite optimizer state; the next round syncs as usual."""
    fabric = fabric_for()
    model = regression_model()

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        sync = fabric.strategy.synchronizer
        start = flat_params(model)  # the synchronized model of step 0

        def poison(step: int) -> None:
            if step == K - 1 and fabric.global_rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # a bad batch's update
            if step == K:
                assert sync.skipped_syncs == 1 and sync.syncs_done == 1
                assert torch.equal(flat_params(model), start), "the parameters are not back at the anchor"
                for p in model.parameters():
                    assert all(torch.isfinite(t).all() for t in optimizer.state[p].values() if torch.is_tensor(t))
            if step == 2 * K:
                assert sync.skipped_syncs == 1 and sync.syncs_done == 2
                assert ranks_identical(flat_params(model)) and torch.isfinite(flat_params(model)).all()
                assert not torch.equal(flat_params(model), start)

        run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())), after=poison)

    fabric.launch(work)


@pytest.mark.timeout(120)
def test_a_non_finite_buffer_takes_the_mean_of_the_workers_where_it_is_finite() -> None:
    """The README's guarantee under Fabric: rank 1's BatchNorm running mean turns NaN mid-round; after the sync every
    rank holds, entry by entry, the mean over the workers where it was finite (rank 0's value at the NaN)."""
    fabric = fabric_for()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.GELU(), nn.Linear(24, 3))

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        sync = fabric.strategy.synchronizer
        original, checked = sync.sync, []

        def recorded() -> Any:
            before = [torch.stack(gather(b)) for b in model.buffers() if b.is_floating_point()]
            report = original()
            after = [b for b in model.buffers() if b.is_floating_point()]
            for every, mine in zip(before, after):  # every: (workers, ...)
                finite = torch.isfinite(every)
                expected = torch.where(finite, every, torch.zeros_like(every)).sum(0) / finite.sum(0).clamp(min=1)
                torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)
            checked.append(not all(torch.isfinite(t).all() for t in before))
            return report

        sync.sync = recorded

        def poison(step: int) -> None:
            if step == K - 2 and fabric.global_rank == 1:
                model[1].running_mean[0] = float("nan")  # a bad input's statistics, mid-round

        run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())), after=poison)
        assert checked == [True, False], checked  # the first sync repaired it; the second had nothing to repair
        assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())

    fabric.launch(work)


@pytest.mark.timeout(120)
def test_a_failed_sync_leaves_every_worker_as_it_was() -> None:
    """The README's guarantee under Fabric: sync 2's moments collective fails on both ranks (before any data moves);
    each worker's replica, anchor, buffers and optimizer state are exactly as when the sync began, and a retry
    lands."""
    from lightning_lordo.comm.communicator import CollectiveTimeout

    fabric = fabric_for()
    model = regression_model()

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        sync = fabric.strategy.synchronizer
        comm, mean, real_sync = sync.comm, sync.comm.mean, sync.sync

        def everything() -> list[torch.Tensor]:
            state = [t for p in model.parameters() for t in optimizer.state[p].values() if torch.is_tensor(t)]
            return [t.detach().clone() for t in [*model.parameters(), *model.buffers(), *sync.anchor.tensors, *state]]

        def failing(tensors: Any, purpose: str) -> Any:
            if purpose == "moments" and sync.syncs_done == 1:
                raise CollectiveTimeout("LoRDO sync 2: injected")
            return mean(tensors, purpose)

        snapshots = []

        def recorded() -> Any:
            snapshots.append(everything())
            return real_sync()

        comm.mean, sync.sync = failing, recorded
        with pytest.raises(CollectiveTimeout, match="injected"):
            run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())))
        after = everything()
        assert sync.syncs_done == 1 and len(snapshots) == 2 and len(after) == len(snapshots[1])
        assert all(torch.equal(a, b) for a, b in zip(after, snapshots[1])), "the failed sync changed the worker"
        comm.mean, sync.sync = mean, real_sync
        assert sync.sync().index == 2 and ranks_identical(flat_params(model))  # the retry lands

    fabric.launch(work)


@pytest.mark.timeout(120)
def test_max_skipped_syncs_in_a_row_stop_the_run_naming_the_rank() -> None:
    """``max_skipped_syncs=1`` under Fabric: rank 1's NaN discards the round at step K, and every rank raises
    ``NonFiniteTraining`` naming rank 1 (the same decision everywhere: no rank waits for another)."""
    from lightning_lordo import NonFiniteTraining

    fabric = fabric_for(max_skipped_syncs=1)
    model = regression_model()

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

        def poison(step: int) -> None:
            if step == K - 1 and fabric.global_rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")

        with pytest.raises(NonFiniteTraining, match=r"rank\(s\) \[1\]"):
            run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())), after=poison)
        assert fabric.strategy.synchronizer.skipped_syncs == 1

    fabric.launch(work)


class Branched(nn.Module):
    """The regression network and a branch (a low-rank matrix and a head) that only rank 1 runs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = regression_model()
        self.branch = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self.trunk(x) + (self.branch(x) if rank == 1 else 0)


@pytest.mark.timeout(120)
def test_a_branch_one_worker_never_runs_keeps_its_holders_moments() -> None:
    """The README's guarantee under Fabric: the branch's low-rank moments, averaged at every sync, are rank 1's own
    on both ranks (rank 0 never stepped it)."""
    from lightning_lordo.sync import exchange

    fabric = fabric_for()
    model = Branched()

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        matrix, original, pairs = model.branch[0].weight, exchange.average_state, []

        def recorded(comm: Any, state: Any, config: Any, shares: Any = None) -> Any:
            out = original(comm, state, config, shares)
            sent = [[t.clone() for t in ts] for p, ts in state.get("moments", []) if p is matrix]
            got = [[t.clone() for t in means] for p, _, means in out[0].get("moments", []) if p is matrix]
            pairs.extend(zip(sent, got))
            return out

        exchange.average_state = recorded
        try:
            run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())))
        finally:
            exchange.average_state = original
        assert len(pairs) == 2
        for sent, got in pairs:
            for ours, theirs in zip(got, sent):
                torch.testing.assert_close(ours, torch.stack(gather(theirs))[1], rtol=1e-6, atol=0)

    fabric.launch(work)


@pytest.mark.timeout(90)
def test_a_hung_worker_makes_the_others_raise_a_collective_timeout_naming_the_sync() -> None:
    """Rank 1 stalls past the timeout right before the optimizer step that syncs: rank 0 fails in sync 1 with the
    plugin's error (not a hang), as under the Trainer."""
    import time

    from test_faults import TIMEOUT_S

    strategy = LoRDOFabricStrategy(sync_every=K, start_method="fork", timeout=TIMEOUT_S, optimizer={"rank": 4})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    model = regression_model()

    def work(fabric: Fabric) -> None:
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for step, (x, y) in enumerate(loader(), start=1):
            fabric.backward(nn.functional.mse_loss(net(x), y))
            if step == K and fabric.global_rank == 1:
                time.sleep(TIMEOUT_S + 5)  # longer than the timeout; then it fails too (its peer is gone)
            optimizer.step()
            optimizer.zero_grad()

    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fabric.launch(work)
    assert time.monotonic() - start < 40
    text = str(info.value)
    assert "CollectiveTimeout" in text and "sync 1" in text and f"timeout of {TIMEOUT_S} s" in text, text


@pytest.mark.slow  # each waits for a timeout
@pytest.mark.parametrize("collective", ["barrier", "all_reduce"])
def test_fabrics_own_collectives_are_bounded_and_named(collective: str) -> None:
    """``fabric.barrier`` / ``fabric.all_reduce`` with a worker that never comes: the other raises the plugin's
    ``CollectiveTimeout`` naming the call, within the timeout, and a later collective is refused at once."""
    import time

    from lightning_lordo.comm.communicator import CollectiveTimeout

    def work(fabric: Fabric) -> str:
        if fabric.global_rank == 1:
            time.sleep(4)  # past rank 0's timeout of 2 s
            return ""
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=rf"fabric.{collective} failed or timed out \(timeout 2 s") as info:
            fabric.barrier() if collective == "barrier" else fabric.all_reduce(torch.ones(2))
        took = time.monotonic() - start
        with pytest.raises(CollectiveTimeout, match=r"fabric.barrier was not attempted because an earlier collective"):
            fabric.barrier()
        assert took < 6, took
        return str(info.value)

    strategy = LoRDOFabricStrategy(start_method="fork", timeout=2, optimizer={"rank": 4})
    said = Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(work)
    assert "Likely causes" in said, said


@pytest.mark.timeout(120)
def test_synchronous_phase_averages_once_per_step_before_clipping() -> None:
    fabric = fabric_for(synchronous=True)  # the "lowrank_ddp" preset
    model = regression_model()

    def work(fabric: Fabric) -> None:
        data = fabric.setup_dataloaders(loader())
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        strategy: LoRDOFabricStrategy = fabric.strategy  # type: ignore[assignment]
        per_step: list[int] = []

        def check(step: int) -> None:  # gradients averaged every step: the replicas never differ
            assert ranks_identical(flat_params(model)), f"step {step}"
            per_step.append(strategy.communication_summary()["bytes_by_purpose"]["gradients"])

        run_steps(fabric, net, optimizer, (b for _, b in zip(range(6), data)), after=check, clip=True)
        grads = sum(p.numel() * 4 for p in model.parameters())
        assert grads <= per_step[0] < 2 * grads, "clipping then stepping averages the gradients once"
        assert per_step == [per_step[0] * s for s in range(1, 7)]
        assert strategy.finish() is None  # nothing local to synchronize

    fabric.launch(work)


def test_a_step_skipped_after_clipping_leaves_the_next_one_prepared() -> None:
    """A loss-spike guard (clip, then skip the step): the next step's gradients are averaged again (they were
    not: the skipped step's preparation counted for it, and the synchronous replicas drifted apart)."""
    fabric = fabric_for(synchronous=True)
    model = regression_model()

    def work(fabric: Fabric) -> None:
        data = fabric.setup_dataloaders(loader())
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        strategy: LoRDOFabricStrategy = fabric.strategy  # type: ignore[assignment]
        taken, first = 0, 0
        for step, (x, y) in zip(range(1, 7), data):
            fabric.backward(nn.functional.mse_loss(net(x), y))
            fabric.clip_gradients(net, optimizer, max_norm=1.0)
            if step == 3:  # skipped on every rank
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
            first = first or strategy.communication_summary()["bytes_by_purpose"]["gradients"]
            assert ranks_identical(flat_params(model)), f"step {step}"
        averaged = strategy.communication_summary()["bytes_by_purpose"]["gradients"]
        assert averaged == 6 * first and taken == 5  # each backward's gradients averaged once, the skipped one's too

    fabric.launch(work)


def test_finish_refuses_ranks_one_step_apart() -> None:
    """One rank a step ahead (a variance of exactly 0.25 across two ranks, which the check let pass): both raise."""
    fabric = fabric_for()
    model = regression_model()

    def work(fabric: Fabric) -> None:
        data = list(zip(range(9), fabric.setup_dataloaders(loader())))
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        run_steps(fabric, net, optimizer, (b for _, b in data[:9 if fabric.global_rank == 0 else 8]))
        with pytest.raises(RuntimeError, match=r"different numbers of optimizer steps \(this rank (9|8), the mean "
                                               r"8.5\)"):
            fabric.strategy.finish()

    fabric.launch(work)


def test_loading_the_optimizer_alone_between_syncs_is_refused(tmp_path: Path) -> None:
    """Between syncs each rank's model is its own: loading the optimizer state without the model would make each
    rank's own model its synchronized point (the replicas then stayed apart for good)."""
    fabric = fabric_for()
    model = regression_model()
    path = tmp_path / "sync.ckpt"

    def work(fabric: Fabric) -> None:
        data = list(zip(range(6), fabric.setup_dataloaders(loader())))
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        run_steps(fabric, net, optimizer, (b for _, b in data[:K]))
        fabric.save(path, {"model": net, "optimizer": optimizer})
        run_steps(fabric, net, optimizer, (b for _, b in data[K:]))
        with pytest.raises(RuntimeError, match=r"optimizer without the model between syncs.*finish\(\) first"):
            fabric.load(path, {"optimizer": optimizer})
        fabric.strategy.finish()
        fabric.load(path, {"optimizer": optimizer})  # at a sync every rank holds one model: allowed
        assert ranks_identical(flat_params(model))

    fabric.launch(work)


def _train_and_save(fabric: Fabric, model: nn.Module, path: Path, result: Path) -> None:
    data = list(zip(range(16), fabric.setup_dataloaders(loader())))
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run_steps(fabric, net, optimizer, (b for _, b in data[:9]))
    why = r"optimizer step 9, 1 local step" if not fabric.strategy.sync_config.overlap_steps else \
        r"optimizer step 9 the round launched at step 8 is still in flight"  # it lands at step 10
    with pytest.raises(RuntimeError, match=why + r".*fabric.strategy.finish\(\)"):
        fabric.save(path, {"model": net, "optimizer": optimizer})
    fabric.strategy.finish()  # a synchronization at step 9 (a round in flight lands first): now it can be saved
    assert fabric.strategy.synchronizer.in_flight is None
    fabric.save(path, {"model": net, "optimizer": optimizer, "step": 9})
    run_steps(fabric, net, optimizer, (b for _, b in data[9:]))
    fabric.strategy.finish()
    if fabric.global_rank == 0:
        torch.save({"params": flat_params(model), "summary": fabric.strategy.communication_summary()}, result)


def _load_and_continue(fabric: Fabric, model: nn.Module, path: Path) -> dict[str, Any]:
    data = list(zip(range(16), fabric.setup_dataloaders(loader())))
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state: dict[str, Any] = {"model": net, "optimizer": optimizer, "step": 0}
    strategy: LoRDOFabricStrategy = fabric.strategy  # type: ignore[assignment]
    if strategy.sync_config.overlap_steps:  # load while a round is in flight: it finishes and is dropped
        run_steps(fabric, net, optimizer, (b for _, b in data[:K]))
        assert strategy.communication_summary()["round_in_flight"]
        other = path.with_name("counter.ckpt")  # a file without the synchronized model: the round goes on
        fabric.save(other, {"counter": 4})
        assert fabric.load(other, {"counter": 0}) == {} and strategy.communication_summary()["round_in_flight"]
    fabric.load(path, state)
    assert not strategy.communication_summary()["round_in_flight"]
    assert state["step"] == 9 and strategy.synchronizer.optimizer_steps == 9 and strategy.synchronizer.syncs_done == 3
    assert strategy.synchronizer.synchronized_step == 9  # saved with the model (a sync at step 9)
    assert ranks_identical(flat_params(model))
    run_steps(fabric, net, optimizer, (b for _, b in data[9:]))
    strategy.finish()
    return {"params": flat_params(model).tolist(), "summary": strategy.communication_summary()}  # no tensors:
    # tensors in the return value travel as shared memory the exiting worker takes with it


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("window", "overlap"), [(1, 0), (2, 0), (1, 2)],
                         ids=["bases-every-sync", "basis_every-2", "overlap_steps-2"])
def test_save_at_a_boundary_and_load_resume_the_same_run(tmp_path: Path, window: int, overlap: int) -> None:
    """With every optimizer state averaged at each sync (the error-feedback buffers too), the resumed run is
    bit-identical to the uninterrupted one; with ``basis_every=2`` the save (after sync 3) holds a window of one
    round, which the resumed run's next refresh must add; with ``overlap_steps`` a save while a round is in flight
    is refused, and after ``finish()`` (which lands it) the resumed run overlaps its rounds as the uninterrupted one;
    its load comes while a round of its own is in flight (dropped, and its bytes do not reach the restored totals)."""
    path, result = tmp_path / "fabric.ckpt", tmp_path / "uninterrupted.pt"
    averaged = dict(average_fullrank_moments=True, average_error_feedback=True, basis_every=window,
                    overlap_steps=overlap)
    fabric_for(**averaged).launch(_train_and_save, regression_model(0), path, result)
    assert torch.load(path, weights_only=True)["lordo"]["sync"]["anchor_step"] == 9
    resumed = fabric_for(**averaged).launch(_load_and_continue, regression_model(1), path)
    uninterrupted = torch.load(result, weights_only=False)
    assert resumed["params"] == uninterrupted["params"].tolist()
    for key in ("syncs", "optimizer_steps", "ddp_equivalent_bytes"):
        assert resumed["summary"][key] == uninterrupted["summary"][key], key
    assert resumed["summary"]["bytes_by_purpose"]["pseudo_gradients"] == \
        uninterrupted["summary"]["bytes_by_purpose"]["pseudo_gradients"]


# ---------------------------------------------------------------------------------------------------- the Trainer
class _WriteResults(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            s = trainer.strategy
            torch.save({"params": flat_params(pl_module), "totals": dict(s.accountant.totals),
                        "reports": [(r.step, r.bytes_by_purpose) for r in s.sync_reports]}, self.path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("overlap", "precision"), [(0, "32-true"), (2, "32-true"), (0, "bf16-mixed")],
                         ids=["blocking", "overlap_steps-2", "bf16-mixed"])
def test_same_syncs_bytes_and_model_as_the_trainer_strategy(tmp_path: Path, overlap: int, precision: str) -> None:
    """Overlapped, rounds launch at steps 4 and 8 and land at 6 and 10, then ``finish()`` syncs the last 2 steps.
    ``bf16-mixed``: autocast in the forward pass on both, the same optimizer and syncs in float32."""
    torch.manual_seed(0)
    module = TinyRegressor()  # AdamW(lr=1e-2, weight_decay=0.01), as below
    trainer(lordo(sync_every=K, overlap_steps=overlap), callbacks=[_WriteResults(tmp_path / "trainer.pt")],
            max_steps=10, precision=precision).fit(module, loader())
    expected = torch.load(tmp_path / "trainer.pt", weights_only=False)

    def work(fabric: Fabric) -> dict[str, Any]:
        model = regression_model(0)
        net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
        # the Trainer's distributed sampler always shuffles training data (seed 0); Fabric's follows the loader
        data = fabric.setup_dataloaders(DataLoader(regression_data(), batch_size=8, shuffle=True))
        seen = []  # the first layer's output dtype (Fabric casts the model's output back to float32)
        hook = model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        net(torch.randn(2, 12))
        hook.remove()
        assert seen == [torch.bfloat16 if precision == "bf16-mixed" else torch.float32]
        assert all(p.dtype == torch.float32 for p in model.parameters())
        run_steps(fabric, net, optimizer, (b for _, b in zip(range(10), data)))
        fabric.strategy.finish()
        assert ranks_identical(flat_params(model))
        s = fabric.strategy
        if overlap:  # the rounds ran on the side group (on the main one they would give the same numbers)
            assert s.synchronizer.overlap_comm.group is not None
            assert s.synchronizer.overlap_comm.group is not s.synchronizer.comm.group
        return {"params": flat_params(model).tolist(), "totals": dict(s.accountant.totals),
                "reports": [(r.step, r.bytes_by_purpose) for r in s.sync_reports]}

    got = fabric_for(overlap_steps=overlap, precision=precision).launch(work)
    # blocking: syncs at steps 4, 8 and 10; overlapped: landings at 6 and 10, then the final sync of steps 9-10
    assert got["reports"] == expected["reports"]  # the same steps and bytes for each purpose
    ours = {k: v for k, v in got["totals"].items() if k != "step_count_check"}  # finish()'s check
    theirs = {k: v for k, v in expected["totals"].items()  # Lightning's per-batch check and its own collectives
              if k not in ("lightning_sigterm_check", "lightning_collectives")}
    assert ours == theirs
    assert got["params"] == expected["params"].tolist()  # bit for bit


# ---------------------------------------------------------------------------------------------------- one process
def test_names_are_registered_with_fabric() -> None:
    for name in PRESETS:
        for suffix, start_method in LAUNCH_SUFFIXES:
            entry = STRATEGY_REGISTRY[name + suffix]
            assert entry["strategy"] is LoRDOFabricStrategy
            assert entry["init_params"] == {"start_method": start_method, "preset": name}
    assert Fabric(strategy="diloco", accelerator="cpu", devices=1).strategy.lowrank is False
    assert Fabric(strategy="lowrank_ddp", accelerator="cpu", devices=1).strategy.sync_config.synchronous is True
    local = Fabric(strategy="lordo_local_fork", accelerator="cpu", devices=1).strategy.sync_config
    assert local.basis_scope == "local" and local.average_moments is False
    lean = Fabric(strategy="lordo_lean", accelerator="cpu", devices=1).strategy.optimizer_knobs
    assert lean == {"omega": 0.7, "full_rank_input": "gradient", "error_feedback": False, "power_iters": 1}


def _launched(**knobs: Any) -> Fabric:
    fabric = fabric_for(devices=1, **knobs)
    fabric.launch()
    return fabric


def test_bad_input_gets_errors_naming_the_value_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"unknown argument 'rnak'\. Did you mean 'rank'\?"):
        LoRDOFabricStrategy(rnak=4)
    with pytest.raises(ValueError, match=r"got lr=0.001: it comes from the optimizer you pass to fabric.setup"):
        LoRDOFabricStrategy(lr=1e-3)
    with pytest.raises(ValueError, match=r"Invalid payload='lowrank' with lowrank=False"):
        LoRDOFabricStrategy(preset="diloco", payload="lowrank")
    with pytest.raises(ValueError, match=r"Invalid sync_every=0"):
        LoRDOFabricStrategy(sync_every=0)
    fabric, model = _launched(), regression_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"one optimizer, but fabric.setup got 2 \(AdamW, SGD\).*one optimizer"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()), sgd)
    fabric = _launched()
    with pytest.raises(TypeError, match=r"converts torch.optim.Adam or AdamW.*got SGD.*strategy='diloco'"):
        fabric.setup(model, sgd)
    fabric = _launched()
    with pytest.raises(RuntimeError, match=r"set the model up first.*fabric.setup_module\(model\)"):
        fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))


def test_diloco_keeps_any_optimizer_and_setup_module_then_setup_optimizers_works() -> None:
    fabric, model = _launched(lowrank=False), regression_model()
    net = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert type(optimizer.optimizer) is torch.optim.SGD
    with pytest.raises(ValueError, match=r"one model with one optimizer, and one is set up already"):
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(2 * K), loader())))
    summary = fabric.strategy.communication_summary()
    assert summary["syncs"] == 2 and summary["bytes_sent_total"] == 0  # one process: nothing travels
    assert summary["ddp_equivalent_bytes"] == 0 and summary["bytes_saving_vs_ddp"] is None  # nor with DDP


def test_closure_step_and_scheduler_keep_driving_the_converted_optimizer() -> None:
    fabric, model = _launched(), regression_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    net, optimizer, scheduler = fabric.setup(model, adamw, scheduler=schedule)
    assert scheduler.optimizer is optimizer.optimizer and isinstance(scheduler.optimizer, LoRDO)
    x, y = next(iter(loader()))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        fabric.backward(loss)
        return loss

    lrs = []
    for _ in range(K):
        assert isinstance(optimizer.step(closure), torch.Tensor)
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-2 * 0.5**s for s in range(1, K + 1)])
    assert fabric.strategy.synchronizer.optimizer_steps == K and fabric.strategy.synchronizer.syncs_done == 1


def test_an_optimizer_state_not_written_by_lordo_is_converted_and_the_model_alone_becomes_the_anchor(
        tmp_path: Path) -> None:
    model = regression_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 3)).backward()
    adamw.step()
    torch.save({"model": model.state_dict(), "optimizer": adamw.state_dict()}, tmp_path / "ddp.ckpt")
    fabric = _launched()
    other = regression_model(1)
    net, optimizer = fabric.setup(other, torch.optim.AdamW(other.parameters()))
    with pytest.warns(UserWarning, match=r"another strategy \(no LoRDO state\).*moments restart"):
        fabric.load(tmp_path / "ddp.ckpt", {"model": net, "optimizer": optimizer})
    lowrank = set(optimizer.optimizer.lowrank_params())
    assert lowrank and len(lowrank) < len(list(net.parameters()))
    for p, q in zip(model.parameters(), net.parameters()):  # AdamW's moments kept where the step is full-rank
        if q in lowrank:
            assert not optimizer.state[q], "a low-rank matrix's moments restart at its next step"
        else:
            assert torch.equal(optimizer.state[q]["exp_avg"], adamw.state[p]["exp_avg"])
    fabric.load(tmp_path / "ddp.ckpt", {"model": net}, strict=False)  # the model alone: it becomes the anchor
    assert torch.equal(flat_params(net), flat_params(model))
    assert all(torch.equal(a, p) for a, p in zip(fabric.strategy.synchronizer.anchor.tensors, net.parameters()))


# ---------------------------------------------------------------------------------------------------- the example
@pytest.mark.timeout(240)
def test_example_script_trains_with_two_processes(tmp_path: Path) -> None:
    """Fabric's default launcher re-runs the command line for rank 1: only ever as a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "examples/fabric_lordo.py", "--steps", "64", "--checkpoint",
                          str(tmp_path / "final.ckpt")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["world_size"] == 2 and result["optimizer_steps"] == 64 and result["syncs"] == 4
    assert result["last_loss"] < result["first_loss"] - 0.5
    assert 0 < result["bytes_sent_total"] < result["ddp_equivalent_bytes"] / 4
    saved = torch.load(tmp_path / "final.ckpt", weights_only=True)
    assert saved["step"] == 64 and saved["lordo"]["optimizer"] == "LoRDO"


def _save_in_warmup(fabric: Fabric, model: nn.Module, path: Path) -> None:
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(3), fabric.setup_dataloaders(loader()))))
    assert fabric.strategy.synchronizer.synchronous_now
    fabric.save(path, {"model": net, "optimizer": optimizer})


def _load_past_the_warmup(fabric: Fabric, model: nn.Module, path: Path) -> dict[str, Any]:
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load(path, {"model": net, "optimizer": optimizer})
    sync = fabric.strategy.synchronizer
    out = {"lr": optimizer.param_groups[0]["lr"], "betas": list(optimizer.param_groups[0]["betas"]),
           "synchronized_step": sync.synchronized_step, "anchor_is_model": all(
               torch.equal(a, p.detach()) for a, p in zip(sync.anchor.tensors, sync.params))}
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(K), fabric.setup_dataloaders(loader()))))
    fabric.strategy.finish()
    out["identical"] = ranks_identical(flat_params(model))
    fabric.load(path, {"model": net})  # the model alone, after the switch: the optimizer is not scaled again
    out["lr_after"] = optimizer.param_groups[0]["lr"]
    return out


@pytest.mark.timeout(120)
def test_loading_a_warmup_checkpoint_past_the_warmup_switches_to_local_steps(tmp_path: Path) -> None:
    """Saved at step 3 of a 20-step warm-up, loaded with a 2-step one: the switch to local steps happens at the load
    (anchor = the loaded model, switch knobs applied), not never."""
    path = tmp_path / "warmup.ckpt"
    fabric_for(warmup_steps=20).launch(_save_in_warmup, regression_model(0), path)
    out = fabric_for(warmup_steps=2, switch_lr_scale=0.5, switch_betas=(0.8, 0.9)).launch(
        _load_past_the_warmup, regression_model(1), path)
    assert out["lr"] == pytest.approx(5e-3) and out["betas"] == [0.8, 0.9] and out["lr_after"] == pytest.approx(5e-3)
    assert out["synchronized_step"] == 3 and out["anchor_is_model"] and out["identical"]
    # format 1 (the first released) kept the synchronizer's counters at the top of Fabric's entry: it is migrated
    saved = torch.load(path, weights_only=True)
    lordo = saved["lordo"]
    assert lordo["format"] == 2 and lordo["sync"]["anchor"] == [] and lordo["sync"]["synchronous"]
    sync = lordo.pop("sync")
    counters = {k: v for k, v in sync.items() if k not in ("anchor", "steps_since_sync")}
    saved["lordo"] = {**lordo, "format": 1, **counters}
    torch.save(saved, path)
    again = fabric_for(warmup_steps=2, switch_lr_scale=0.5, switch_betas=(0.8, 0.9)).launch(
        _load_past_the_warmup, regression_model(1), path)
    assert again == out
    older = torch.load(path, weights_only=True)
    del older["lordo"]["format"]  # as a development version wrote it: refused, with the fix
    torch.save(older, path)
    with pytest.raises(ValueError, match=r"written by a development version of lightning-lordo.*load_from_checkpoint"):
        fabric_for(devices=1, warmup_steps=2, switch_lr_scale=0.5).launch(_load_only, regression_model(1), path)


def _load_only(fabric: Fabric, model: nn.Module, path: Path) -> None:
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load(path, {"model": net, "optimizer": optimizer})


def test_fabric_logs_the_parameter_plan_at_setup(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    fabric, model = _launched(), regression_model()
    with caplog.at_level(logging.INFO):
        fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    said = [r.getMessage() for r in caplog.records if "take the low-rank step" in r.getMessage()]
    assert len(said) == 1 and "largest" in said[0] and "parameter_plan()" in said[0], caplog.text


def test_setup_optimizers_attaches_to_the_model_holding_its_parameters() -> None:
    """A student and a teacher set up one after the other: the optimizer's parameters are the student's, so the
    student is what the rounds synchronize (the last model set up was: never the student, or a bare torch error
    when the teacher was frozen). An optimizer over parameters no model holds is refused, naming them."""
    fabric = _launched(synchronous=False)
    student, teacher = regression_model(0), regression_model(1)
    teacher.requires_grad_(False)
    net = fabric.setup_module(student)
    fabric.setup_module(teacher)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(student.parameters(), lr=1e-2))
    assert fabric.strategy.core.module is student
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(K), loader())))
    assert fabric.strategy.synchronizer.syncs_done == 1
    fabric = _launched()
    with pytest.raises(ValueError, match=r"holding 1 parameter\(s\) that the model does not \(shapes \[\(3,\)\]\).*"
                                         r"never be synchronized"):
        fabric.setup(regression_model(), torch.optim.AdamW([*regression_model().parameters()][-1:]))


def test_the_save_refusal_names_the_next_sync_after_a_finish_mid_run(tmp_path: Path) -> None:
    """finish() is a sync: the rounds count from it, so the refusal names the step the next sync comes after (it
    said "a multiple of sync_every", which is no longer one), and a save there works."""
    fabric, model = _launched(synchronous=False), regression_model()
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = iter(loader())
    run_steps(fabric, net, optimizer, (next(batches) for _ in range(K + 2)))
    fabric.strategy.finish()
    run_steps(fabric, net, optimizer, (next(batches) for _ in range(2)))
    with pytest.raises(RuntimeError, match=rf"optimizer step {K + 4}, 2 local step\(s\) after the last "
                                           rf"synchronization.*the next is after optimizer step {2 * K + 2};"):
        fabric.save(tmp_path / "mid.ckpt", {"model": net, "optimizer": optimizer})
    run_steps(fabric, net, optimizer, (next(batches) for _ in range(K - 2)))
    fabric.save(tmp_path / "at_sync.ckpt", {"model": net, "optimizer": optimizer})


def test_the_optimizer_passed_in_refuses_to_step_and_its_scheduler_stays_quiet(recwarn: Any) -> None:
    """The user's AdamW, converted, shares LoRDO's param groups: stepping it raised torch's bare KeyError('fused').
    A scheduler not handed over (setup_optimizers takes none) keeps driving the LR and does not warn that it
    stepped before the optimizer."""
    fabric, model = _launched(), regression_model()
    net = fabric.setup_module(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    optimizer = fabric.setup_optimizers(adamw)
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(2), loader())), after=lambda step: schedule.step())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    with pytest.raises(RuntimeError, match=r"This AdamW was converted to lightning_lordo.LoRDO.*Step the optimizer "
                                           r"that fabric.setup / fabric.setup_optimizers returned"):
        adamw.step()


def test_switch_lr_scale_without_a_scheduler_handed_over_warns() -> None:
    """switch_lr_scale scales the param groups' LR; a scheduler Fabric was not given would set it back at its next
    step, so the setup says where to pass it."""
    fabric, model = _launched(warmup_steps=2, switch_lr_scale=0.5), regression_model()
    with pytest.warns(UserWarning, match=r"switch_lr_scale=0.5 .*fabric.setup\(model, optimizer, scheduler="):
        fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_with_overlap_the_save_refusal_asks_for_finish(tmp_path: Path) -> None:
    """With overlap_steps a round is in flight after each sync, so the next sync is no place to save either: the
    refusal asks for finish(), and a save after it works."""
    fabric, model = _launched(synchronous=False, overlap_steps=1), regression_model()
    net, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run_steps(fabric, net, optimizer, (b for _, b in zip(range(K + 2), loader())))
    with pytest.raises(RuntimeError, match=r"With overlap_steps a round is in flight after each sync, so call "
                                           r"fabric.strategy.finish\(\)") as refused:
        fabric.save(tmp_path / "mid.ckpt", {"model": net, "optimizer": optimizer})
    assert "the next is after" not in str(refused.value)
    fabric.strategy.finish()
    fabric.save(tmp_path / "finished.ckpt", {"model": net, "optimizer": optimizer})


def test_a_step_of_the_optimizer_inside_the_one_fabric_set_up_is_refused_until_finish() -> None:
    """Fabric's loop stepping the optimizer inside the wrapper fabric.setup returned: no sync would ever see it. The
    error names Fabric's way; after finish() the optimizer is the user's own again."""
    fabric, model = _launched(lowrank=False), regression_model()
    net, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    x, y = next(iter(loader()))
    fabric.backward(nn.functional.mse_loss(net(x), y))
    with pytest.raises(RuntimeError, match=r"did not drive.*step the optimizer fabric\.setup returned, not the one "
                                           r"inside it"):
        optimizer.optimizer.step()
    fabric.backward(nn.functional.mse_loss(net(x), y))
    optimizer.step()  # the driven step
    fabric.strategy.finish()
    optimizer.optimizer.step()  # the user's own after finish()
