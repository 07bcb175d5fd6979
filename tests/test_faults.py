"""Faults during training: non-finite rounds, dead or hung workers, exceptions and Ctrl-C inside a sync.

Three levels: the :class:`Synchronizer` in one process (a communicator that raises on demand), two processes over
gloo with ``torch.distributed`` only (a worker that dies or hangs), and 2-process Lightning fits (fork, asserts in
the workers). Every multi-process test bounds itself: pytest-timeout, joins with a timeout, leftovers killed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from strategy_helpers import (
    TinyRegressor,
    assert_identical,
    flat_params,
    gather,
    loader,
    lordo,
    regression_data,
    trainer,
)
from torch import Tensor, nn

from lightning_lordo import CollectiveTimeout, LoRDO, LoRDOStrategy, NonFiniteTraining, SyncConfig
from lightning_lordo.comm.communicator import CommAccountant, Communicator
from lightning_lordo.sync import bucketed
from lightning_lordo.sync.faults import sigint_deferred
from lightning_lordo.sync.synchronizer import Synchronizer

NAN = float("nan")

# the models' (3, 16) head is smaller than the rank: LoRDO says so once per construction; not what is tested here
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:LoRDO. rank=4 is larger than the smaller side:UserWarning")]


# ---------------------------------------------------------------------------------------------------------------
# One process: the Synchronizer with a communicator that fails on demand
# ---------------------------------------------------------------------------------------------------------------
class FlakyCommunicator(Communicator):
    """Two identical workers simulated in one process (an average is the value itself, a broadcast changes nothing;
    with a world size of 1 the synchronizer would skip the buffers' and moments' collectives) that raises ``error``
    at the collective of ``purpose`` once armed."""

    def __init__(self, purpose: str = "", error: Optional[BaseException] = None, fail_at: int = 1) -> None:
        super().__init__(CommAccountant(), timedelta(seconds=5))
        self.purpose, self.error, self.armed, self.fail_at = purpose, error, False, fail_at
        self.seen = 0

    @property
    def world_size(self) -> int:
        return 2

    def _maybe_fail(self, purpose: str) -> None:
        if self.armed and purpose.partition(":")[0] == self.purpose:  # "pseudo_gradients:lowrank" too
            self.seen += 1  # the fail_at-th such collective fails (e.g. a later bucket's)
            if self.seen < self.fail_at:
                return
            self.armed = False
            assert self.error is not None
            raise self.error

    def all_reduce_mean(self, tensors: Sequence[Tensor], purpose: str, in_round: bool = True) -> None:
        self._maybe_fail(purpose)

    def mean(self, tensors: Sequence[Tensor], purpose: str) -> list[Tensor]:
        self._maybe_fail(purpose)
        return [t.detach().clone() for t in tensors]

    def average_temporaries(self, tensors: Sequence[Tensor], purpose: str) -> None:
        self._maybe_fail(purpose)

    def broadcast(self, tensors: Sequence[Tensor], purpose: str, src: int = 0, in_round: bool = True) -> None:
        self._maybe_fail(purpose)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.GELU(), nn.Linear(24, 16), nn.GELU(),
                         nn.Linear(16, 3))


def _optimizer(name: str, params: list[Tensor]) -> torch.optim.Optimizer:
    if name == "lordo":
        return LoRDO(params, lr=1e-2, rank=4, error_feedback=True, normalizer="factored")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _setup(optimizer: str = "lordo", comm: Optional[Communicator] = None, sync_every: int = 3, **knobs: Any):
    model = _model()
    params = list(model.parameters())
    opt = _optimizer(optimizer, params)
    comm = comm if comm is not None else FlakyCommunicator()
    sync = Synchronizer(params, list(model.buffers()), opt, SyncConfig(sync_every=sync_every, **knobs), comm)
    return model, opt, sync


@functools.lru_cache(maxsize=1)
def _data() -> tuple[Tensor, Tensor]:
    """Built inside a test (one thread, conftest), never at import: a 2-thread matmul in the pytest process starts
    an OpenMP pool, and a later forked ``devices=1`` worker (Lightning gives it 2 threads) then hangs in libgomp."""
    x, y = regression_data(64).tensors
    return x, y


def _step(model: nn.Module, opt: torch.optim.Optimizer, sync: Synchronizer, index: int,
          nan_grad: Optional[Tensor] = None, sync_after: bool = True) -> Any:
    x, y = (t[(index * 8) % 64:][:8] for t in _data())
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if nan_grad is not None:
        nan_grad.grad[0, 0] = NAN
    sync.before_optimizer_step()  # as the strategy does after each backward pass
    opt.step()
    return sync.on_optimizer_step() if sync_after else None


def _full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        x, y = _data()
        return nn.functional.mse_loss(model(x), y).item()


def _everything(model: nn.Module, opt: torch.optim.Optimizer, sync: Synchronizer) -> dict[str, Any]:
    """All state a sync may touch, cloned."""
    def clone(v: Any) -> Any:
        return v.clone() if isinstance(v, Tensor) else v
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "anchor": [a.clone() for a in sync.anchor.tensors],
        "outer_momentum": [m.clone() for m in sync.outer.momentum_buffers()],
        "state": [{k: clone(v) for k, v in opt.state.get(p, {}).items()} for p in model.parameters()],
        "counters": (sync.syncs_done, sync.steps_since_sync, sync.optimizer_steps, sync.skipped_syncs),
        "payloads": [t.clone() for s in sync.payloads.state_dict().values() for ts in s.values() for t in ts],
    }


@pytest.mark.parametrize(("optimizer", "purpose", "error", "knobs"), [
    ("lordo", "pseudo_gradients", CollectiveTimeout("LoRDO sync 2: injected"), {}),
    ("lordo", "buffers", CollectiveTimeout("LoRDO sync 2: injected"), {"outer_optimizer": "nesterov"}),
    ("lordo", "bases", CollectiveTimeout("LoRDO sync 2: injected"), {"broadcast_bases": True}),
    ("lordo", "moments", CollectiveTimeout("LoRDO sync 2: injected"), {"outer_optimizer": "nesterov"}),
    ("lordo", "moments", KeyboardInterrupt(), {"transition": "reset"}),
    ("adamw", "buffers", KeyboardInterrupt(), {"outer_optimizer": "nesterov"}),
    # the bucketed sync (float32 full payload): a later bucket fails after the first ones staged their new points
    ("lordo", "pseudo_gradients", CollectiveTimeout("LoRDO sync 2: injected"), {"bucket_cap_mb": 1e-3, "fail_at": 3}),
    ("lordo", "pseudo_gradients", KeyboardInterrupt(), {"bucket_cap_mb": 1e-3, "fail_at": 2}),
    # the streamed low-rank messages: the B message fails after the P message's round trip, or the next message
    ("lordo", "pseudo_gradients", CollectiveTimeout("LoRDO sync 2: injected"),
     {"payload": "lowrank", "bucket_cap_mb": 1e-3, "fail_at": 2}),
    ("lordo", "pseudo_gradients", KeyboardInterrupt(), {"payload": "lowrank", "bucket_cap_mb": 1e-3, "fail_at": 3}),
])
def test_an_exception_inside_a_sync_leaves_the_worker_as_before_and_a_retry_matches_an_unfailed_run(
    optimizer: str, purpose: str, error: BaseException, knobs: dict[str, Any]
) -> None:
    """Synchronizer level, one process: the communicator raises in one collective of sync 2 (before, or after the
    bases were installed and the moments rotated). The worker's parameters (its local replica, mid-round),
    anchor, buffers, outer momentum, counters and whole optimizer state are exactly as when sync() was called;
    retrying the sync then gives bit for bit what a run without the failure gives."""
    transition = knobs.pop("transition", None)
    fail_at = knobs.pop("fail_at", 1)
    results = []
    for fail in (True, False):
        model, opt, sync = _setup(optimizer, FlakyCommunicator(purpose, error, fail_at), **knobs)
        if transition is not None:
            opt.param_groups[0]["transition"] = transition
        for i in range(5):  # sync 1 at step 3, then two local steps
            _step(model, opt, sync, i)
        _step(model, opt, sync, 5, sync_after=False)  # step 6, whose sync we call by hand
        sync.optimizer_steps += 1
        sync.steps_since_sync += 1
        if fail:
            before = _everything(model, opt, sync)
            assert not torch.equal(before["params"][0], before["anchor"][0])  # mid-round: replica != anchor
            sync.comm.armed = True
            with pytest.raises(type(error)):
                sync.sync()
            assert sync.comm.seen == fail_at
            assert_identical(_everything(model, opt, sync), before, "state after the failed sync")
            assert bucketed.streams(sync) == (knobs.get("payload") == "lowrank")
            if bucketed.applies(sync) and not bucketed.streams(sync):  # the gradients that staged the round: released
                assert all(p.grad is None for p in model.parameters())
        report = sync.sync()  # the retry (the communicator works again), or the only try
        assert not report.skipped and report.index == 2
        results.append(_everything(model, opt, sync))
    assert_identical(results[0], results[1], "after sync 2")


def test_sigint_is_held_back_until_the_commit_is_done() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the interrupt would land here without the deferral
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("optimizer", ["lordo", "adamw", "sgd"])
def test_non_finite_round_is_discarded_and_only_poisoned_state_is_reset(optimizer: str) -> None:
    """A NaN gradient in one matrix at the last step of round 2: the round is discarded (parameters back to the
    anchor, anchor untouched), that matrix's optimizer state is reset (LoRDO: basis kept, moments, error feedback,
    factored statistics zeroed, step 0; torch optimizers: state cleared), the others keep theirs; later syncs work."""
    model, opt, sync = _setup(optimizer)
    first = model[0].weight
    start_loss = _full_loss(model)
    for i in range(5):
        _step(model, opt, sync, i)
    anchor_before = [a.clone() for a in sync.anchor.tensors]
    basis_before = opt.state[first]["basis"].clone() if optimizer == "lordo" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _step(model, opt, sync, 5, nan_grad=first)
    assert report is not None and report.skipped and report.index == 2 and sync.skipped_syncs == 1
    assert math.isnan(report.pseudo_gradient_norm) and report.extra["reset_params"] == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("sync 2 (optimizer step 6)" in m and "rank(s) [0]" in m and "discarded" in m for m in messages), \
        messages
    assert_identical([a.clone() for a in sync.anchor.tensors], anchor_before, "anchor")
    assert_identical([p.detach().clone() for p in model.parameters()], anchor_before, "params")
    state = opt.state[first]
    if optimizer == "lordo":
        assert torch.equal(state["basis"], basis_before) and torch.isfinite(state["basis"]).all()
        assert state["step"].item() == 0
        for key in ("exp_avg", "exp_avg_sq", "error_feedback", "factored_row", "factored_col"):
            assert not state[key].any(), key
    else:
        assert len(state) == 0
    for p in list(model.parameters())[1:]:  # untouched: their state holds 6 steps
        other = opt.state[p]
        assert all(torch.isfinite(v).all() for v in other.values() if isinstance(v, Tensor))
        if "step" in other:
            assert other["step"].item() == 6
    for i in range(6, 15):
        report = _step(model, opt, sync, i)
        assert report is None or not report.skipped
    assert sync.syncs_done == 5 and sync.skipped_syncs == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _full_loss(model) < start_loss


def test_non_finite_averaged_moments_are_reset_without_discarding_the_round() -> None:
    model, opt, sync = _setup("lordo")
    for i in range(5):
        _step(model, opt, sync, i)
    opt.state[model[0].weight]["exp_avg_sq"][0, 0] = float("inf")  # an overflow with finite updates
    report = _step(model, opt, sync, 5)
    assert report is not None and not report.skipped and report.extra["reset_moments"] == 1
    assert opt.state[model[0].weight]["step"].item() == 0 and opt.state[model[3].weight]["step"].item() == 6
    for i in range(6, 9):
        _step(model, opt, sync, i)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_buffers_do_not_discard_the_round_and_warn() -> None:
    model, opt, sync = _setup("adamw")
    for i in range(2):
        _step(model, opt, sync, i)
    model[1].running_mean[0] = NAN  # one worker: no finite value anywhere, so it stays, with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _step(model, opt, sync, 2)
    assert report is not None and not report.skipped
    assert any("buffers are not finite" in str(w.message) and "sync 1" in str(w.message) for w in caught)
    assert torch.equal(torch.cat([p.reshape(-1) for p in model.parameters()]),
                       torch.cat([a.reshape(-1) for a in sync.anchor.tensors]))


def test_non_finite_first_gradient_gives_seeded_random_bases() -> None:
    model, opt, sync = _setup("lordo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, opt, sync, 0, nan_grad=model[0].weight)
    assert any("initial basis" in str(w.message) for w in caught)
    basis = opt.state[model[0].weight]["basis"]
    assert torch.isfinite(basis).all()
    torch.testing.assert_close(basis.mT @ basis, torch.eye(basis.shape[1]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Two processes over gloo, torch.distributed only: a worker that dies, hangs, is late, or Ctrl-C
# ---------------------------------------------------------------------------------------------------------------
TIMEOUT_S = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout_worker(rank: int, port: int, mode: str, out: str) -> None:
    """Rank 1 misbehaves (``mode``) before sync 1; rank 0 syncs and reports what happened to ``out``. A mode ending
    in ``-poll`` makes the communicator wait as it does for device (NCCL) collectives: polling ``is_completed``."""
    result: dict[str, Any] = {}
    mode, _, poll = mode.partition("-")
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        torch.manual_seed(0)
        model = nn.Linear(6, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        timeout = 30 if mode == "interrupt" else TIMEOUT_S
        sync = Synchronizer(list(model.parameters()), [], opt, SyncConfig(sync_every=1),
                            Communicator(CommAccountant(), timedelta(seconds=timeout), poll=poll == "poll"))
        model(torch.randn(5, 6) * (rank + 1)).square().sum().backward()
        opt.step()  # the replicas now differ
        params, anchor = [p.detach().clone() for p in model.parameters()], [a.clone() for a in sync.anchor.tensors]
        dist.barrier()
        if rank == 1:
            if mode == "exit":
                os._exit(1)
            if mode in ("hang", "interrupt"):
                time.sleep(60)
                os._exit(0)
            time.sleep(1.0)  # "late": slower than several wait slices, well within the timeout
        if mode == "interrupt":
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            sync.on_optimizer_step()
            result["outcome"] = "synced"
        except CollectiveTimeout as err:
            result.update(outcome="CollectiveTimeout", message=str(err))
        except KeyboardInterrupt:
            result["outcome"] = "KeyboardInterrupt"
        result["seconds"] = time.monotonic() - start
        result["unchanged"] = all(torch.equal(a, b) for a, b in zip(params, model.parameters())) and \
            all(torch.equal(a, b) for a, b in zip(anchor, sync.anchor.tensors))
        result["params"] = flat_params(model).tolist()
        if result["outcome"] != "synced":  # the communicator refuses any further collective at once
            start = time.monotonic()
            try:
                sync.sync()
            except CollectiveTimeout as err:
                result.update(second_message=str(err), second_seconds=time.monotonic() - start)
    except BaseException as err:  # noqa: BLE001 - report anything to the test
        result["error"] = repr(err)
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        os._exit(0)  # no teardown: destroy_process_group would wait for the abandoned collective


def _run_two(mode: str, tmp_path: Path) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_timeout_worker, args=(r, port, mode, str(tmp_path)), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(30)
        if mode.startswith("late"):
            procs[1].join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
            if (tmp_path / f"rank{r}.json").exists()}


class PendingWork:
    """A gloo work handle whose peer never answers, on a fake clock: ``wait(t)`` advances the clock by ``t`` and
    raises as gloo does. A timeout under 1 ms would be c10d's "no timeout" (it would never return): refused."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timeouts: list[timedelta] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        assert timeout is not None and timeout >= timedelta(milliseconds=1), f"wait({timeout!r}) never returns"
        self.timeouts.append(timeout)
        self.now += timeout.total_seconds()
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


def test_the_last_wait_slice_is_never_a_wait_without_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.2505 s = one 0.25 s slice + 0.5 ms: that last bit must end the wait, not become wait(0 ms) = forever."""
    import types

    from lightning_lordo.comm import communicator as accounting

    work = PendingWork()
    monkeypatch.setattr(accounting, "time", types.SimpleNamespace(monotonic=work.monotonic))
    comm = Communicator(CommAccountant(), timedelta(seconds=0.2505))
    comm.context = "sync 7 (optimizer step 70)"
    with pytest.raises(CollectiveTimeout, match=r"sync 7 .*did not complete within the timeout of 0.2505 s"):
        comm._run(lambda: work, "moments", "all_reduce", torch.device("cpu"))
    assert work.timeouts == [timedelta(milliseconds=250)]


def test_a_failed_collective_is_said_on_standard_error_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's launcher kills rank 0 within 5 s of a child's death, often before an exception is printed: the
    communicator writes what it knows (the sync, the collective, the peer's address) the moment it fails."""
    def dead_peer() -> Any:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:43521")

    comm = Communicator(CommAccountant(), timedelta(seconds=5))
    comm.context = "sync 7 (optimizer step 70)"
    with pytest.raises(CollectiveTimeout):
        try:
            comm._run(dead_peer, "moments", "all_reduce", torch.device("cpu"))
        finally:
            said = capsys.readouterr().err  # before the exception left the communicator
    assert said.startswith("[rank 0] LoRDO sync 7 (optimizer step 70): the all_reduce of moments failed"), said
    assert "Connection closed by peer [127.0.0.1]:43521" in said and said.count("\n") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["slices", "poll"], ids=["gloo wait", "polling (as on NCCL)"])
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dead_or_hung_worker_makes_the_other_fail_naming_the_sync_and_the_timeout(mode: str, wait: str,
                                                                                   tmp_path: Path) -> None:
    """The timeout holds whether the communicator waits in slices (gloo, CPU tensors) or polls the work's
    is_completed() (device tensors: NCCL's wait does not block the host, so polling is what bounds it)."""
    results = _run_two(mode if wait == "slices" else f"{mode}-poll", tmp_path)
    rank0 = results[0]
    assert "error" not in rank0, rank0
    assert rank0["outcome"] == "CollectiveTimeout", rank0
    assert "sync 1 (optimizer step 1)" in rank0["message"] and f"timeout of {TIMEOUT_S} s" in rank0["message"]
    assert "all_reduce of pseudo_gradients" in rank0["message"]
    if mode == "hang":  # gloo's wait(timeout) honours the timeout
        assert "did not complete within the timeout" in rank0["message"]
        assert TIMEOUT_S - 0.1 <= rank0["seconds"] < TIMEOUT_S + 2
    else:  # a dead peer is noticed at once (its sockets closed), not after the timeout
        assert "by peer" in rank0["message"]  # gloo: "Connection closed by peer" or "... reset by peer"
        assert rank0["seconds"] < TIMEOUT_S
    assert rank0["unchanged"], "a failed sync must leave parameters and anchor as they were"
    assert "earlier collective failed" in rank0["second_message"] and rank0["second_seconds"] < 0.1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["late", "late-poll"])
def test_a_late_worker_within_the_timeout_is_waited_for(mode: str, tmp_path: Path) -> None:
    results = _run_two(mode, tmp_path)
    assert results[0]["outcome"] == results[1]["outcome"] == "synced", results
    assert results[0]["seconds"] > 0.8  # rank 0 waited through several slices of its wait
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_a_sync_waiting_on_a_hung_worker(tmp_path: Path) -> None:
    """A plain gloo wait ignores SIGINT until it returns; the communicator waits in slices, so Ctrl-C lands."""
    rank0 = _run_two("interrupt", tmp_path)[0]
    assert rank0["outcome"] == "KeyboardInterrupt", rank0
    assert rank0["seconds"] < 2.0  # the timeout is 30 s
    assert rank0["unchanged"]
    assert "interrupted" in rank0["second_message"]


# ---------------------------------------------------------------------------------------------------------------
# Lightning, 2 processes (fork): non-finite rounds
# ---------------------------------------------------------------------------------------------------------------
class NaNRegressor(TinyRegressor):
    """On global rank 1 at optimizer step ``at_step`` (0-based): the loss becomes NaN (``"loss"``), or one entry
    of ``net.0.weight``'s gradient does (``"grad"``)."""

    def __init__(self, inject: str, at_step: int, optimizer: str = "adamw") -> None:
        super().__init__(optimizer=optimizer)
        self.inject, self.at_step = inject, at_step

    def _now(self) -> bool:
        return self.global_rank == 1 and self.trainer.global_step == self.at_step

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if self.inject == "loss" and self._now() else loss

    def on_after_backward(self) -> None:
        if self.inject == "grad" and self._now():
            self.net[0].weight.grad[0, 0] = NAN


def _dataset_loss(module: L.LightningModule) -> float:
    x, y = regression_data().tensors
    with torch.no_grad():
        return nn.functional.mse_loss(module.net(x), y).item()


class FaultChecker(L.Callback):
    """Asserts inside each worker; K = 4, 20 steps, the NaN appears in round 2 (sync 2 at step 8)."""

    def __init__(self, inject: str, lowrank: bool) -> None:
        self.inject, self.lowrank = inject, lowrank
        self.checked_discard = False

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_loss = _dataset_loss(module)
        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        sync = trainer.strategy.synchronizer
        if sync.steps_since_sync:
            return
        anchor = torch.cat([a.reshape(-1) for a in sync.anchor.tensors])
        assert torch.isfinite(anchor).all(), f"anchor not finite after sync {sync.syncs_done}"
        assert torch.equal(*gather(anchor)), f"anchors differ after sync {sync.syncs_done}"
        assert torch.equal(flat_params(module), anchor)
        if sync.syncs_done != 2:
            return
        report = trainer.strategy.sync_reports[-1]
        assert report.index == 2 and report.skipped and sync.skipped_syncs == 1
        assert report.extra["bad_ranks"] == 1
        optimizer = sync.optimizer
        names = dict(module.named_parameters())
        reset = {"net.0.weight"} if self.inject == "grad" else set(names)
        assert report.extra["reset_params"] == len(reset)
        for name, p in names.items():
            state = optimizer.state.get(p, {})
            if name in reset and not self.lowrank:
                assert len(state) == 0, f"{name}: state not cleared"
            elif name in reset:
                assert state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
                if "error_feedback" in state:
                    assert not state["error_feedback"].any()
                if "basis" in state:
                    assert torch.equal(*gather(state["basis"])) and torch.isfinite(state["basis"]).all()
            elif "step" in state:
                assert state["step"].item() == 8, f"{name}: state reset although finite everywhere"
        self.checked_discard = True

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert self.checked_discard
        assert [r.skipped for r in strategy.sync_reports] == [False, True, False, False, False]
        assert strategy.synchronizer.skipped_syncs == 1
        final = flat_params(module)
        assert torch.isfinite(final).all() and torch.equal(*gather(final)), "final models differ or not finite"
        assert _dataset_loss(module) < self.start_loss
        messages = [str(w.message) for w in self.caught]
        named = [m for m in messages if "sync 2 (optimizer step 8)" in m and "discarded" in m]
        if trainer.global_rank == 0:
            assert len(named) == 1 and "rank(s) [1]" in named[0], messages
        else:
            assert not named


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("preset", "knobs", "inject", "optimizer"), [
    ("lordo", {}, "loss", "adamw"),
    ("lordo", {"error_feedback": True}, "grad", "adamw"),
    ("lordo", {"error_feedback": True, "normalizer": "factored"}, "loss", "adamw"),
    ("diloco", {}, "loss", "adamw"),
    ("diloco", {}, "loss", "sgd"),
])
def test_non_finite_pseudo_gradient_on_one_rank_is_skipped_consistently(
    preset: str, knobs: dict[str, Any], inject: str, optimizer: str, tmp_path: Path
) -> None:
    from lightning.pytorch.loggers import CSVLogger

    strategy = lordo(sync_every=4, **knobs) if preset == "lordo" else \
        LoRDOStrategy(preset="diloco", sync_every=4, start_method="fork", timeout=60)
    at_step = 7 if inject == "grad" else 5  # grad: the last step of round 2; loss: mid-round
    csv = CSVLogger(tmp_path, name="csv", version=0)
    module = NaNRegressor(inject, at_step, optimizer)
    trainer(strategy, callbacks=[FaultChecker(inject, lowrank=preset == "lordo")], max_steps=20,
            logger=csv).fit(module, loader())
    header, *rows = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()
    columns = header.split(",")
    skipped = {int(r.split(",")[columns.index("step")]): float(r.split(",")[columns.index("lordo/skipped_syncs")])
               for r in rows if r.split(",")[columns.index("lordo/skipped_syncs")]}
    assert skipped == {3: 0.0, 7: 1.0, 11: 1.0, 15: 1.0, 19: 1.0}  # at Lightning's step (one less)


# ---------------------------------------------------------------------------------------------------------------
# Lightning, 2 processes (fork): a dead or hung worker; an exception inside a sync and the checkpoint on disk
# ---------------------------------------------------------------------------------------------------------------
class Misbehave(L.Callback):
    """Rank 1, right before the optimizer step that syncs (step 4 of K = 4): dies, or stalls ``stall_s``."""

    def __init__(self, mode: str, stall_s: float = 8.0) -> None:
        self.mode, self.stall_s = mode, stall_s

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3:
            if self.mode == "exit":
                os._exit(1)
            time.sleep(self.stall_s)  # longer than the timeout; then it fails too (its peer is gone)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_fit_fails_instead_of_hanging_when_a_worker_dies_or_hangs(mode: str) -> None:
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        trainer(LoRDOStrategy(sync_every=4, start_method="fork", timeout=TIMEOUT_S, optimizer={"rank": 4}),
                callbacks=[Misbehave(mode)], max_steps=12).fit(TinyRegressor(), loader())
    assert time.monotonic() - start < 30
    if mode == "hang":  # rank 0 waited in sync 1's all-reduce and failed with the plugin's error
        text = str(info.value)
        assert "CollectiveTimeout" in text and "sync 1" in text and f"timeout of {TIMEOUT_S} s" in text, text


class SyncFailure(L.Callback):
    """Sync 2 raises inside its last collective (the moments, after the bases were installed) on both ranks.

    Each worker checks that the failed sync left its parameters, anchor and optimizer state as they were, and
    writes the result; rank 0 records the checkpoint written at step 4 (digest and directory listing)."""

    def __init__(self, error: str, ckpt_dir: Path, out: Path) -> None:
        self.error, self.ckpt_dir, self.out = error, ckpt_dir, out

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        comm, sync = strategy.communicator, strategy.synchronizer
        original_run, original_sync = comm._run, sync.sync

        def run(issue: Any, purpose: str, op: str, device: torch.device) -> None:
            # every collective (float32 all_reduce_mean, and the bfloat16/int8 messages) goes through _run
            if comm.context.startswith("sync 2") and purpose == "moments":
                raise KeyboardInterrupt() if self.error == "interrupt" else CollectiveTimeout("injected failure")
            original_run(issue, purpose, op, device)

        def checked_sync() -> Any:
            before = _everything(module, sync.optimizer, sync)
            try:
                return original_sync()
            except BaseException as err:
                after = _everything(module, sync.optimizer, sync)
                assert_identical(after, before, "state after the failed sync")
                (self.out / f"rollback{trainer.global_rank}.txt").write_text(type(err).__name__)
                if isinstance(err, KeyboardInterrupt):  # torch's worker wrapper would swallow it: the parent
                    raise RuntimeError("KeyboardInterrupt inside sync 2") from err  # would then wait forever
                raise

        comm._run, sync.sync = run, checked_sync

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 5:
            files = sorted(p.name for p in self.ckpt_dir.iterdir())
            digest = hashlib.sha256((self.ckpt_dir / "early.ckpt").read_bytes()).hexdigest()
            (self.out / "before.json").write_text(json.dumps({"files": files, "sha256": digest}))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("error", "payload_dtype"), [("timeout", "float32"), ("interrupt", "float32"),
                                                      ("timeout", "int8")])
def test_exception_inside_a_sync_leaves_the_checkpoint_intact(error: str, payload_dtype: str, tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="early", every_n_train_steps=4, save_top_k=-1)
    with pytest.raises(Exception) as info:
        failure = SyncFailure(error, ckpt_dir, tmp_path)
        trainer(lordo(sync_every=4, payload_dtype=payload_dtype), callbacks=[saver, failure], max_steps=12,
                enable_checkpointing=True).fit(TinyRegressor(), loader())
    expected = "KeyboardInterrupt inside sync 2" if error == "interrupt" else "injected failure"
    assert expected in str(info.value)
    names = {"interrupt": "KeyboardInterrupt", "timeout": "CollectiveTimeout"}
    assert {(tmp_path / f"rollback{r}.txt").read_text() for r in (0, 1)} == {names[error]}
    before = json.loads((tmp_path / "before.json").read_text())
    shards = f"early.ckpt.lordo-{torch.load(ckpt_dir / 'early.ckpt', weights_only=True)['lordo']['shards']['id']}"
    assert before["files"] == ["early.ckpt", shards]  # the file and its per-rank shards
    assert sorted(p.name for p in (ckpt_dir / shards).iterdir()) == ["rank-0.pt", "rank-1.pt"]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before["files"]  # no partial or temporary files
    data = (ckpt_dir / "early.ckpt").read_bytes()
    assert hashlib.sha256(data).hexdigest() == before["sha256"]
    checkpoint = torch.load(ckpt_dir / "early.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4 and checkpoint["lordo"]["sync"]["syncs_done"] == 1
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    assert not list(tmp_path.glob("**/*.tmp")) and not list(tmp_path.glob("**/.*ckpt*"))


class AlwaysNaNOnRank1(TinyRegressor):
    """Rank 1's loss is NaN at every step: every round is non-finite."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if self.global_rank == 1 else loss


@pytest.mark.parametrize(("limit", "overlap"), [(1, 0), (3, 0), (3, 1)])
def test_a_run_that_is_non_finite_at_every_sync_stops_naming_the_rank(limit: int, overlap: int) -> None:
    """After ``max_skipped_syncs`` consecutive discarded rounds the run stops with NonFiniteTraining (on every
    rank alike) instead of returning with a model frozen since the last good round; with ``overlap_steps`` at the
    landing of the last of them."""
    strategy = lordo(sync_every=2, max_skipped_syncs=limit, **({"overlap_steps": overlap} if overlap else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception) as info:
            trainer(strategy, max_steps=20).fit(AlwaysNaNOnRank1(), loader())
    message = str(info.value)
    assert "NonFiniteTraining" in message or isinstance(info.value, NonFiniteTraining), message
    assert f"{limit} consecutive syncs were discarded" in message and "rank(s) [1]" in message, message
    where = "landing" if overlap else f"optimizer step {2 * limit}"
    assert f"sync {limit} ({where})" in message and "since optimizer step 0" in message


def test_a_non_finite_gradient_in_the_synchronous_steps_stops_the_run_at_the_switch() -> None:
    """A synchronous step averages gradients as DDP does: rank 1's NaN loss at step 3 reaches both replicas. The
    switch to local rounds (step 6) stops with the cause, instead of taking a NaN anchor and then discarding every
    round back to it, each blaming every rank."""
    strategy = lordo(sync_every=4, warmup_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception) as info:
            trainer(strategy, max_steps=24).fit(NaNRegressor("loss", at_step=2), loader())
    message = str(info.value)
    assert "not finite at the end of the synchronous steps (optimizer step 6, warmup_steps=6)" in message, message


def test_a_discarded_round_keeps_the_parameters_each_worker_stepped_for_the_next_one() -> None:
    """The holders of a round that is discarded (a NaN) still hold their moments at the next sync, which averages
    them: the set of stepped parameters is cleared only by a sync that averaged the moments."""
    model, opt, sync = _setup("lordo", sync_every=3)
    params = list(model.parameters())
    for i in range(2):
        _step(model, opt, sync, i)
    assert sync.stepped == set(range(len(params)))
    report = _step(model, opt, sync, 2, nan_grad=params[0])  # step 3: its round is discarded
    assert report.skipped and sync.stepped == set(range(len(params)))
    for i in range(3, 6):  # the next round syncs at step 6, and clears the set
        report = _step(model, opt, sync, i)
    assert not report.skipped and sync.stepped == set()


class SteppedAround(TinyRegressor):
    """``how``: ``"wrapped"`` steps the optimizer inside Lightning's wrapper, ``"twice"`` steps twice per batch,
    ``"one_rank"`` skips batch ``skipped``'s step on rank 1 only, ``"all_ranks"`` on every rank."""

    def __init__(self, how: str, skipped: int = 2) -> None:
        super().__init__()
        self.how, self.skipped = how, skipped

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.how == "wrapped":
            optimizer.optimizer.step(closure=optimizer_closure)
        elif self.how == "twice":  # Lightning counts one step for the batch
            optimizer.step(closure=optimizer_closure)
            optimizer.step(closure=optimizer_closure)
        elif batch_idx == self.skipped and (self.how == "all_ranks" or self.global_rank == 1):
            optimizer_closure()  # the forward and backward passes, and no step
        else:
            optimizer.step(closure=optimizer_closure)


def test_a_step_the_strategy_does_not_drive_or_one_rank_skips_is_an_error_at_once() -> None:
    """A step of the wrapped optimizer never synchronized (the ranks ended apart without a word), and a step skipped
    on one rank hung the other in the next sync for ``timeout`` and then blamed a dead worker. Skipped on every
    rank alike, the fit goes on."""
    with pytest.raises(Exception, match=r"the optimizer took a step the strategy did not drive.*optimizer\.step\("
                                        r"closure=optimizer_closure\) on the optimizer it is given"):
        trainer(lordo(sync_every=4), max_steps=6).fit(SteppedAround("wrapped"), loader())
    # a local step; the step a sync follows (the other rank checks before its round); the same with a validation
    # after that batch (the skipping rank answers at the batch's end, before the validation's collectives)
    for skipped, validation in ((2, False), (3, False), (3, True)):
        started = time.monotonic()
        with pytest.raises(Exception, match=r"the workers took different numbers of optimizer steps \(this rank: "
                                            r"[2-4]\).*reduce_boolean_decision"):
            trainer(lordo(sync_every=4), max_steps=6, val_check_interval=4, num_sanity_val_steps=0).fit(
                SteppedAround("one_rank", skipped), loader(), loader(n=32) if validation else None)
        assert time.monotonic() - started < 30  # not the 60 s timeout
    trainer(lordo(sync_every=4), max_steps=6, callbacks=[OneModelAtTheEnd(5)]).fit(SteppedAround("all_ranks"),
                                                                                  loader())


def test_two_steps_in_one_batch_end_in_one_model_and_the_optimizer_steps_on_its_own_after_the_fit() -> None:
    """Two steps in the last batch: the final sync ran after the first (Lightning's step count is the batch's) and
    the ranks ended apart. After a fit the optimizer is the user's again (the check of undriven steps refused every
    later step of a cached optimizer)."""
    trainer(lordo(sync_every=4), max_steps=6, callbacks=[OneModelAtTheEnd(12)]).fit(SteppedAround("twice"),
                                                                                   loader())

    class Cached(TinyRegressor):
        def configure_optimizers(self) -> Any:
            self.cached = getattr(self, "cached", None) or torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return self.cached

    module = Cached()
    trainer(lordo(sync_every=2, start_method="popen", lowrank=False), devices=1, max_steps=4).fit(module, loader())
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    module.cached.step()  # on its own
    trainer("auto", devices=1, max_steps=2).fit(module, loader())  # and under another strategy


class OneModelAtTheEnd(L.Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps  # the optimizer steps taken in Lightning's 6

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert torch.equal(*gather(flat_params(module))), "the ranks ended apart"
        assert trainer.strategy.synchronizer.optimizer_steps == self.steps and trainer.global_step == 6
