"""State that a fault attack found lost or corrupted (issue 31, items 1-3), each with 2 processes where it needs them:
moments of a parameter that only some workers train, a non-finite buffer under overlap, and a model edited between a
save and its resume."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, gather, loader, lordo, trainer
from torch import nn

from lightning_lordo.strategy_knobs import PRESETS

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them


class Branchy(TinyRegressor):
    """A trunk every worker trains and a second branch (a low-rank matrix, a full-rank head, biases) that only rank 1
    runs, as a conditional branch or an expert of a mixture would."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if self.global_rank == 1:
            out = out + self.branch(x)
        return nn.functional.mse_loss(out, y)


class StateCheck(L.Callback):
    """At the end of fit: no round was discarded, every moment is finite and every second moment >= 0; the trunk's
    averaged moments are identical on both workers, and the branch's are rank 1's own (the only worker holding them)."""

    def __init__(self, averaged_fullrank: bool) -> None:
        self.averaged_fullrank = averaged_fullrank
        self.before: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync = trainer.strategy.synchronizer
        assert sync.skipped_syncs == 0, f"{sync.skipped_syncs} rounds discarded"
        optimizer = trainer.optimizers[0]
        for name, p in module.named_parameters():
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    assert torch.isfinite(value).all(), (name, key)
            if "exp_avg_sq" in state:
                assert (state["exp_avg_sq"] >= 0).all(), f"{name}: a negative second moment"
        if not self.averaged_fullrank:
            return
        for name, p in module.named_parameters():
            if name.startswith("net.") and "basis" not in optimizer.state[p]:  # the trunk's full-rank moments
                avg = optimizer.state[p]["exp_avg"]
                assert torch.equal(*gather(avg)), f"{name}: averaged moments differ between the workers"


@pytest.mark.parametrize("preset", [*PRESETS, "lordo+fullrank"])
def test_a_branch_one_worker_never_runs_keeps_every_workers_state_consistent(preset: str) -> None:
    knobs: dict[str, Any] = dict(PRESETS[preset][0]) if preset in PRESETS else {"average_fullrank_moments": True}
    averaged = bool(knobs.get("average_fullrank_moments"))
    torch.manual_seed(0)
    trainer(lordo(sync_every=3, **knobs), callbacks=[StateCheck(averaged)], max_steps=10).fit(Branchy(), loader())


class AroundEverySync(L.Callback):
    """Rank 1's full-rank moments of the branch's head just before and just after every sync."""

    def __init__(self) -> None:
        self.pairs: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sync, state = trainer.strategy.synchronizer, trainer.optimizers[0].state
        head, original = module.branch[2].weight, sync.sync

        def recorded() -> Any:
            before = {k: v.clone() for k, v in state[head].items() if torch.is_tensor(v)}
            report = original()
            self.pairs.append((before, {k: v.clone() for k, v in state[head].items() if torch.is_tensor(v)}))
            return report

        sync.sync = recorded

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 1:  # only rank 1 holds the head's moments: their average is its own
            assert len(self.pairs) == 2
            for before, after in self.pairs:
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(after[key], before[key], rtol=1e-6, atol=0)


def test_only_the_workers_holding_a_moment_average_it() -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=3, average_fullrank_moments=True), callbacks=[AroundEverySync()],
            max_steps=6).fit(Branchy(), loader())


class LowRankAroundEverySync(L.Callback):
    """The branch's low-rank matrix (``branch[0]``, default knobs: its moments are averaged at every sync): on every
    rank, the moments this worker sends and the averages it gets back, read in ``average_state``."""

    def __init__(self, averages: Optional[int] = 2, rtol: float = 1e-6) -> None:
        self.averages = averages  # how many syncs average the moments (every sync by default; None: at least one)
        self.rtol = rtol  # bfloat16 moments: their rounding
        self.pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from lightning_lordo.sync import exchange

        matrix, original = module.branch[0].weight, exchange.average_state

        def recorded(comm: Any, state: Any, config: Any, shares: Any = None) -> Any:
            out = original(comm, state, config, shares)
            sent = [[t.clone() for t in ts] for p, ts in state.get("moments", []) if p is matrix]
            got = [[t.clone() for t in means] for p, _, means in out[0].get("moments", []) if p is matrix]
            if sent:
                self.pairs.append((sent[0], got[0]))
            return out

        exchange.average_state = recorded
        self.restore = lambda: setattr(exchange, "average_state", original)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.restore()
        assert len(self.pairs) == self.averages if self.averages is not None else self.pairs
        for sent, got in self.pairs:
            theirs = [torch.stack(gather(t)) for t in sent]  # (rank 0, rank 1)
            for ours, both in zip(got, theirs):  # rank 1 alone runs the branch: the average is its moment
                torch.testing.assert_close(ours, both[1], rtol=self.rtol, atol=0)
            if trainer.global_rank == 0:
                assert not torch.equal(sent[0], got[0]), "rank 0's moments were sent as if it held them"


@pytest.mark.parametrize(("overlap", "dtype"), [(0, "float32"), (1, "float32"), (0, "bfloat16")])
def test_a_low_rank_branch_that_one_worker_never_runs_keeps_its_holders_moments(overlap: int, dtype: str) -> None:
    """Blocking, overlapped (the round's average made on its thread from the launch's copies), and with the moments
    averaged in bfloat16 (a reduced payload: one bfloat16 rounding of the holder's moment)."""
    torch.manual_seed(0)
    check = LowRankAroundEverySync(None if overlap else 2, rtol=2**-7 if dtype == "bfloat16" else 1e-6)
    trainer(lordo(sync_every=3, overlap_steps=overlap, payload_dtype=dtype), callbacks=[check],
            max_steps=6).fit(Branchy(), loader())


class BranchyOnce(Branchy):
    """Rank 1 runs the branch in the first round only (optimizer steps 1-3)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if self.global_rank == 1 and self.trainer.global_step < 3:
            out = out + self.branch(x)
        return nn.functional.mse_loss(out, y)


def test_a_worker_holds_what_it_stepped_since_the_moments_were_last_averaged() -> None:
    """``moments_every=2``: the moments are averaged at the second sync only; rank 1 stepped the branch in the first
    round, not the second, and still holds its moments there (the flags cover every round since the last average)."""
    torch.manual_seed(0)
    trainer(lordo(sync_every=3, moments_every=2), callbacks=[LowRankAroundEverySync(averages=1)], max_steps=6).fit(
        BranchyOnce(), loader())


def test_moments_are_averaged_over_the_workers_that_hold_them_float64() -> None:
    """``average_state`` against float64 arithmetic, two workers (the other one's messages given): a moment both hold
    is their mean; one only this worker holds is its own; one only the other holds is the other's; one nobody
    stepped keeps its values."""
    from lightning_lordo.config import SyncConfig
    from lightning_lordo.sync.exchange import average_state

    g = torch.Generator().manual_seed(0)
    mine = [[torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(2)] for _ in range(4)]
    other = [[torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(2)] for _ in range(4)]
    held_here, held_there = [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]
    other[3] = [t.clone() for t in mine[3]]  # nobody stepped it: both have the last average
    sent_there = [t * h for ts, h in zip(other, held_there) for t in ts]

    class OtherWorker:  # the all-reduce mean with the other worker's messages
        world_size = 2

        def mean(self, tensors: list[torch.Tensor], purpose: str) -> list[torch.Tensor]:
            assert purpose == "moments" and len(tensors) == len(sent_there)
            return [(a + b) / 2 for a, b in zip(tensors, sent_there)]

    params = [nn.Parameter(torch.zeros(1)) for _ in range(4)]
    state = {"moments": list(zip(params, mine)), "holders": [(None, [torch.tensor(held_here, dtype=torch.float64)])]}
    shares = [(a + b) / 2 for a, b in zip(held_here, held_there)]
    out, _, _ = average_state(OtherWorker(), state, SyncConfig(), shares)
    expected = [[(a + b) / 2 for a, b in zip(mine[0], other[0])], mine[1], other[2], mine[3]]
    for (_, _, got), want in zip(out["moments"], expected):
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-15, atol=0)


def test_averaging_the_moments_of_an_optimizer_whose_layout_is_unknown_is_refused() -> None:
    from datetime import timedelta

    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.config import SyncConfig
    from lightning_lordo.sync.synchronizer import Synchronizer

    w = nn.Parameter(torch.randn(4, 4))
    config = SyncConfig(average_fullrank_moments=True)
    comm = Communicator(CommAccountant(), timedelta(seconds=5))
    with pytest.raises(ValueError, match="average_fullrank_moments=True with RMSprop"):
        Synchronizer([w], [], torch.optim.RMSprop([w]), config, comm)


class PoisonedBuffer(TinyRegressor):
    """A BatchNorm whose running mean turns NaN on rank 1 at one step (as a bad input leaves it), with overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.GELU(), nn.Linear(24, 16), nn.GELU(),
                                 nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx in (5, 14):  # once mid-round, once while a round is in flight
            self.net[1].running_mean[0] = float("nan")
        return super().training_step(batch, batch_idx)


class BuffersAtTheEnd(L.Callback):
    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for name, b in module.named_buffers():
            assert torch.isfinite(b.float()).all(), f"{name} is not finite on rank {trainer.global_rank}"
            assert torch.equal(*gather(b)), f"{name} differs between the workers"


@pytest.mark.parametrize("overlap", [0, 1, 2])
def test_a_non_finite_buffer_is_repaired_with_or_without_overlap(overlap: int) -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, overlap_steps=overlap), callbacks=[BuffersAtTheEnd()], max_steps=20).fit(
        PoisonedBuffer(), loader())


class AroundRepairs(L.Callback):
    """Every worker's floating buffers just before each (blocking) sync, gathered, and this worker's just after."""

    def __init__(self) -> None:
        self.pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.warnings = warnings.catch_warnings(record=True)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.caught = self.warnings.__enter__()  # in this worker: the warning is rank 0's
        warnings.simplefilter("always")
        sync, original = trainer.strategy.synchronizer, trainer.strategy.synchronizer.sync
        buffers = [b for b in module.buffers() if b.is_floating_point()]

        def recorded() -> Any:
            before = [torch.stack(gather(b)) for b in buffers]
            report = original()
            self.pairs.append((before, [b.detach().clone() for b in buffers]))
            return report

        sync.sync = recorded

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.warnings.__exit__(None, None, None)
        said = [str(w.message) for w in self.caught if "where they are finite" in str(w.message)]
        assert len(said) == (2 if trainer.global_rank == 0 else 0), said
        repaired = 0
        for before, after in self.pairs:
            for every, mine in zip(before, after):  # every: (workers, ...)
                finite = torch.isfinite(every)
                repaired += int(not finite.all())
                count = finite.sum(dim=0)
                expected = torch.where(finite, every, torch.zeros_like(every)).sum(dim=0) / count.clamp(min=1)
                torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)
        assert repaired == 2, f"{repaired} syncs saw a non-finite buffer"  # batches 5 and 14: the syncs at 8 and 16


def test_a_non_finite_buffer_takes_the_mean_of_the_workers_where_it_is_finite() -> None:
    torch.manual_seed(0)
    trainer(lordo(sync_every=4), callbacks=[AroundRepairs()], max_steps=20).fit(PoisonedBuffer(), loader())


class StartWeights(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("step", [4, 6], ids=["at-a-sync", "mid-round"])
def test_a_model_edited_between_save_and_resume_is_followed_and_said(tmp_path: Path, step: int) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    save = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=step, save_top_k=-1)
    strategy = lordo(sync_every=4, start_method="popen", synchronous=False)  # one device, with rounds
    torch.manual_seed(0)
    trainer(strategy, devices=1, callbacks=[save], max_steps=step, enable_checkpointing=True).fit(
        TinyRegressor(), loader())
    path = tmp_path / f"step={step}.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"]["net.3.weight"] = torch.zeros_like(checkpoint["state_dict"]["net.3.weight"])  # surgery
    torch.save(checkpoint, path)
    start = StartWeights()
    with pytest.warns(UserWarning, match="follows the loaded weights") as caught:
        trainer(lordo(sync_every=4, start_method="popen", synchronous=False), devices=1, callbacks=[start],
                max_steps=step + 2).fit(TinyRegressor(), loader(), ckpt_path=str(path))
    assert not start.weights["net.3.weight"].any(), "the edit was overwritten by the saved synchronized model"
    assert any("net.3.weight" in str(w.message) for w in caught)


def test_a_model_edited_after_a_save_with_a_round_in_flight_is_refused(tmp_path: Path) -> None:
    """2 processes, ``overlap_steps``: the round in flight at the save lands on the saved model, so an edited model
    cannot be followed; the resume is refused with the fix before training starts."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    save = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    torch.manual_seed(0)
    trainer(lordo(sync_every=4, overlap_steps=2), callbacks=[save], max_steps=7, enable_checkpointing=True).fit(
        TinyRegressor(), loader())  # the round launched at step 4 lands at step 6: in flight at step 5's save
    path = tmp_path / "step=5.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"]["net.3.weight"] = torch.zeros_like(checkpoint["state_dict"]["net.3.weight"])  # surgery
    torch.save(checkpoint, path)
    with pytest.raises(Exception, match=r"differs from the checkpoint's synchronized model \(net.3.weight.*resume "
                                        r"from a checkpoint written at a sync"):
        trainer(lordo(sync_every=4, overlap_steps=2), max_steps=8).fit(TinyRegressor(), loader(), ckpt_path=str(path))


class Lazy(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(24), nn.GELU(), nn.Linear(24, 3))


def test_a_lazy_module_gets_the_fix_in_its_error() -> None:
    with pytest.raises(RuntimeError, match=r"\['net.0.weight', 'net.0.bias'\] are not initialized.*forward pass"):
        trainer(lordo(start_method="popen"), devices=1, max_steps=3).fit(Lazy(), loader())
    module = Lazy()
    module.net(torch.randn(2, 12))  # the dry forward pass the message asks for
    trainer(lordo(start_method="popen"), devices=1, max_steps=3).fit(module, loader())


class LazyNorm(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 24), nn.LazyBatchNorm1d(affine=False), nn.GELU(), nn.Linear(24, 3))


def test_a_lazy_module_with_buffers_only_gets_the_same_fix() -> None:
    """``nn.LazyBatchNorm1d(affine=False)`` has no parameter, only uninitialized buffers: with 2 processes it failed
    deep in the setup broadcast ("Can't access the shape of an uninitialized parameter or buffer")."""
    with pytest.raises(RuntimeError, match=r"\['net.1.running_mean', 'net.1.running_var'\] are not initialized.*"
                                           r"forward pass"):
        trainer(lordo(start_method="popen"), devices=1, max_steps=3).fit(LazyNorm(), loader())
    module = LazyNorm()
    module.net(torch.randn(2, 12))
    trainer(lordo(start_method="popen"), devices=1, max_steps=3).fit(module, loader())


class SparseEmbedding(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(10, 12, mode="mean", sparse=True)
        self.net = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        codes = (x[:, :4].abs() * 3).long().clamp(max=9)
        return nn.functional.mse_loss(self.net(x + self.embed(codes)), y)


def test_a_sparse_embedding_is_refused_at_setup_with_the_fix() -> None:
    """Its gradients are sparse, which LoRDO (as torch's Adam/AdamW) cannot step: refused before training, naming
    the module, not at the first step with the shape alone."""
    with pytest.raises(ValueError, match=r"\['embed'\] is an nn.Embedding or nn.EmbeddingBag with sparse=True\. "
                                         r"Pass sparse=False"):
        trainer(lordo(start_method="popen"), devices=1, max_steps=3).fit(SparseEmbedding(), loader())


def test_a_lazy_module_under_fabric_gets_the_same_fix() -> None:
    import os

    from lightning.fabric import Fabric

    from lightning_lordo import LoRDOFabricStrategy

    environment = dict(os.environ)
    try:
        fabric = Fabric(accelerator="cpu", devices=1, strategy=LoRDOFabricStrategy(start_method="popen"))
        fabric.launch()
        net = Lazy().net
        with pytest.raises(RuntimeError, match="not initialized.*forward pass"):
            fabric.setup(net, torch.optim.AdamW(net.parameters()))
    finally:
        os.environ.clear()
        os.environ.update(environment)


@pytest.mark.parametrize("entry", ["trainer", "fabric"])
def test_a_worker_that_does_not_join_in_time_gets_an_error_naming_the_timeout_knob(entry: str) -> None:
    import os
    import subprocess
    import sys

    from strategy_helpers import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    script = Path(__file__).with_name("late_worker_script.py")
    done = subprocess.run([sys.executable, str(script), *(["fabric"] if entry == "fabric" else [])], env=env,
                          capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    owner = "LoRDOFabricStrategy" if entry == "fabric" else "LoRDOStrategy"
    assert done.returncode != 0 and "within timeout=2 s" in last and f" {owner}(timeout=" in last, last


def test_a_fabric_loop_that_fails_with_a_round_in_flight_ends_with_the_users_exception() -> None:
    import os
    import subprocess
    import sys

    from strategy_helpers import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    script = Path(__file__).with_name("fabric_exception_script.py")
    done = subprocess.run([sys.executable, str(script)], env={**env, "MASTER_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])  # not -6 / 134: an abort
    assert "ValueError: the user's own error" in done.stderr and "terminate called" not in done.stderr


def test_a_round_in_flight_saved_before_the_holders_flags_averages_over_every_worker() -> None:
    """A checkpoint of an older version holds one ``holders`` flag per full-rank parameter (none without
    ``average_fullrank_moments``); resumed, its round counts every worker as a holder, as that version averaged."""
    from lightning_lordo.sync.overlap import _saved

    live = [(None, [torch.zeros(3)])]  # today's: one flag per averaged moment, here three
    for old in ([], [[torch.ones(1)]], [[torch.ones(1)], [torch.zeros(1)]]):  # none, one, two full-rank parameters
        assert [[t.tolist() for t in ts] for ts in _saved({"holders": old}, "holders", live)] == [[[1.0, 1.0, 1.0]]]
    today = [[torch.tensor([1.0, 0.0, 1.0])]]
    assert _saved({"holders": today}, "holders", live) is today
