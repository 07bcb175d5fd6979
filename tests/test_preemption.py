"""Preemption and dying workers, as a cluster does it: SIGTERM to the main process or to the whole process group
while a sync waits on a late worker, Ctrl-C inside a sync with an emergency checkpoint (the real popen launcher,
in a subprocess), and what a user reads when a worker dies between syncs or the ranks run uneven data (fork)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from strategy_helpers import TinyRegressor, loader, trainer
from torch.utils.data import DataLoader, Subset

from lightning_lordo import LoRDOStrategy
from lightning_lordo.comm.communicator import CollectiveTimeout
from lightning_lordo.lightning.shards import load_full

pytestmark = pytest.mark.slow  # multi-process or long runs; CI runs them, -m 'not slow' skips them

SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch, lightning as L
import lightning_lordo
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning_lordo import LoRDOStrategy
from lightning_lordo.sync import synchronizer
from strategy_helpers import TinyRegressor, loader

torch.set_num_threads(1)
marker, out = sys.argv[2], sys.argv[3]
real_sync = synchronizer.Synchronizer._sync

def late_rank1(self):  # sync 2: rank 0 waits in its first collective while rank 1 is 3 s late
    if self.syncs_done + 1 == 2:
        if self.comm.rank == 0:
            open(marker, "w").write(str(os.getpid()))
        else:
            time.sleep(3)
    return real_sync(self)

synchronizer.Synchronizer._sync = late_rank1
fit = L.Trainer(strategy=LoRDOStrategy(sync_every=int(sys.argv[1]), optimizer=dict(rank=4), timeout=20),
                accelerator="cpu", devices=2, max_steps=10_000, callbacks=[OnExceptionCheckpoint(out)], logger=False,
                enable_progress_bar=False, enable_model_summary=False)
fit.fit(TinyRegressor(), loader(n=20_000))
"""


def _interrupt_in_sync(tmp_path: Path, k: int, signum: int, whole_group: bool) -> tuple[float, str]:
    """Start the script, wait until rank 0 waits in sync 2, send ``signum``; return the seconds until the run
    exited and its output."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent))))
    marker = tmp_path / "in_sync_2"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")}
    run = subprocess.Popen([sys.executable, str(script), str(k), str(marker), str(tmp_path / "ckpt")], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.stdout else ""
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is now waiting in sync 2's first collective
    sent = time.monotonic()
    if whole_group:
        os.killpg(run.pid, signum)
    else:
        os.kill(run.pid, signum)
    try:
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    return time.monotonic() - sent, output


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("k", "whole_group"), [(2, False), (1, True)], ids=["main process", "process group, K=1"])
def test_sigterm_inside_a_sync_stops_the_run_within_seconds_with_a_checkpoint(tmp_path: Path, k: int,
                                                                             whole_group: bool) -> None:
    """SIGTERM is held back while a round runs (Lightning's own SIGTERM handler issues a collective, which would
    pair with the round's), then Lightning's preemption path runs on every rank: the run stops within seconds of
    the late worker catching up, not after the 20 s timeout, and the emergency checkpoint is complete."""
    seconds, output = _interrupt_in_sync(tmp_path, k, signal.SIGTERM, whole_group)
    assert seconds < 12, f"stopped after {seconds:.1f} s:\n{output[-3000:]}"
    assert "CollectiveTimeout" not in output, output[-3000:]
    saved = load_full(tmp_path / "ckpt" / "on_exception.ckpt")
    assert not saved["lordo"]["partial"] and len(saved["lordo"]["ranks"]) == 2


@pytest.mark.timeout(200)
def test_ctrl_c_inside_a_sync_writes_the_emergency_checkpoint_without_waiting_for_the_timeout(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the process group) while rank 0 waits in a sync: the collective is abandoned, and the
    emergency checkpoint (OnExceptionCheckpoint) is written from rank 0's state without any collective (none can
    be trusted now), within seconds; it resumes like a checkpoint of another world size."""
    seconds, output = _interrupt_in_sync(tmp_path, 2, signal.SIGINT, whole_group=True)
    assert seconds < 12, f"stopped after {seconds:.1f} s:\n{output[-3000:]}"
    saved = load_full(tmp_path / "ckpt" / "on_exception.ckpt")
    assert saved["lordo"]["partial"] and len(saved["lordo"]["ranks"]) == 1
    assert saved["state_dict"] and saved["optimizer_states"]


class RaisesOnRankOne(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if dist.get_rank() == 1 and self.trainer.global_step == 5:
            raise ValueError("the user's error on rank 1")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_with_on_exception_checkpoint_ends_within_seconds(tmp_path: Path) -> None:
    """OnExceptionCheckpoint's save on the failing rank is not a collective, but Lightning's barrier after it was:
    the failing rank waited the whole timeout for a peer that never came, and its last error was the barrier's
    CollectiveTimeout, not the user's."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    start = time.monotonic()
    with pytest.raises(Exception, match="the user's error on rank 1") as failed:
        trainer(_strategy(8, 30), callbacks=[OnExceptionCheckpoint(tmp_path)], max_steps=20,
                enable_checkpointing=True).fit(RaisesOnRankOne(), loader())
    assert time.monotonic() - start < 15, f"ended after {time.monotonic() - start:.1f} s: {failed.value}"
    assert "Lightning's barrier (Trainer.save_checkpoint)" not in str(failed.value)
    # the fork launcher's main process writes the callback's file last, without optimizer state; a fit with the
    # callback resumes it ("last"): the optimizer starts afresh, as under DDP (it failed with an IndexError)
    assert torch.load(tmp_path / "on_exception.ckpt", weights_only=True)["optimizer_states"] == []
    trainer(_strategy(8, 30), callbacks=[OnExceptionCheckpoint(tmp_path)], max_steps=3,
            enable_checkpointing=True).fit(TinyRegressor(), loader())


def _strategy(k: int, timeout: float) -> LoRDOStrategy:
    return LoRDOStrategy(sync_every=k, start_method="fork", timeout=timeout, optimizer={"rank": 4})


class HangsAtStep(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if dist.get_rank() == 1 and self.trainer.global_step == 2:
            time.sleep(8)  # hangs between syncs (K = 8), longer than the 3 s timeout
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_a_worker_that_hangs_between_syncs_is_reported_with_the_check_that_noticed() -> None:
    with pytest.raises(Exception) as info:  # noqa: B017 - rank 0's error, reported by the fork launcher
        trainer(_strategy(8, 3), max_steps=12).fit(HangsAtStep(), loader())
    message = str(info.value)  # rank 0 fails first (after 3 s), so the launcher reports rank 0's traceback
    assert "CollectiveTimeout" in message, message
    # the check rank 0 posted before step 4 (rank 1 never posted it), read, pipelined, before step 5
    assert "SIGTERM check before optimizer step 4 (between syncs; read before optimizer step 5)" in message, message
    assert "timeout of 3 s" in message and "a worker died" in message and "different numbers of batches" in message


@pytest.mark.timeout(200)
def test_a_worker_that_dies_between_syncs_is_named_by_the_others(tmp_path: Path) -> None:
    """The real popen launcher (rank 1 is a process of its own): rank 1 exits between syncs; rank 0's next
    collective (Lightning's per-batch check, through the plugin) reports it, not as raw gloo text."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch, lightning as L
        import lightning_lordo
        from lightning_lordo import LoRDOStrategy
        from strategy_helpers import TinyRegressor, loader

        class Dies(TinyRegressor):
            def training_step(self, batch, batch_idx):
                if self.global_rank == 1 and self.trainer.global_step == 2:
                    os._exit(3)
                return super().training_step(batch, batch_idx)

        torch.set_num_threads(1)
        L.Trainer(strategy=LoRDOStrategy(sync_every=8, optimizer=dict(rank=4), timeout=20), accelerator="cpu",
                  devices=2, max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(Dies(), loader())
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path,
                          env=env)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and time.monotonic() - start < 60, output[-3000:]
    # rank 1 dies in its third batch, after posting the check before step 3: rank 0 notices reading that check (if
    # rank 1's half of it never completed) or the next one, which rank 1 never posted
    assert re.search(r"CollectiveTimeout: LoRDO Lightning's per-batch SIGTERM check before optimizer step (3|4) "
                     r"\(between syncs; read before optimizer step (4|5)\)", output), output[-3000:]
    assert "a worker died" in output and "different numbers of batches" in output, output[-3000:]


class RecordsCheckErrors(LoRDOStrategy):
    """Each rank's error from the per-batch check, in ``path`` (the launcher reports only the first to fail); rank
    1 waits a moment after its own, so that the launcher does not stop rank 0 before it gets there."""

    def __init__(self, path: Path, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.path = path

    def _sigterm_check(self, finished: bool = False) -> None:
        try:
            super()._sigterm_check(finished)
        except CollectiveTimeout as err:
            (self.path / f"rank{self.global_rank}.txt").write_text(str(err))
            if self.global_rank == 1:
                time.sleep(3)
            raise


@pytest.mark.timeout(120)
def test_a_rank_whose_next_step_syncs_names_uneven_batches_before_the_sync(tmp_path: Path) -> None:
    """Rank 1 has 3 batches, rank 0 more: rank 0's fourth step is a sync (K = 4). Its check is read before that step,
    so rank 0 stops with the uneven-batches error instead of entering a sync that rank 1 never joins."""

    class RankData(TinyRegressor):
        def train_dataloader(self) -> DataLoader:
            rows = range(64 if dist.get_rank() == 0 else 24)
            return DataLoader(Subset(loader(n=64).dataset, list(rows)), batch_size=8)

    strategy = RecordsCheckErrors(tmp_path, sync_every=4, optimizer={"rank": 4}, start_method="fork", timeout=10)
    with pytest.raises(Exception):  # noqa: B017 - the first failing worker's error, from the launcher
        trainer(strategy, max_epochs=1, use_distributed_sampler=False).fit(RankData())
    message = (tmp_path / "rank0.txt").read_text()
    assert "the workers ran different numbers of batches: this rank was about to take optimizer step 4" in message, \
        message


@pytest.mark.timeout(120)
def test_uneven_data_per_rank_is_named_as_a_likely_cause() -> None:
    """Rank 1 gets fewer batches than rank 0: it reaches the end of fit (and its final sync) while rank 0 is still
    training, so their collectives do not pair. The error says that the workers may not be at the same point."""

    class RankData(TinyRegressor):
        def train_dataloader(self) -> DataLoader:
            data = loader(n=96).dataset
            rows = range(96 if dist.get_rank() == 0 else 40)
            return DataLoader(Subset(data, list(rows)), batch_size=8)

    with pytest.raises(Exception) as info:  # noqa: B017 - the first failing worker's error, from the launcher
        trainer(_strategy(4, 3), max_epochs=1, use_distributed_sampler=False).fit(RankData())
    message = str(info.value)
    assert "CollectiveTimeout" in message and "the workers ran different numbers of batches: this rank" in message, \
        message[-3000:]


class RecordsCheckOrder(TinyRegressor):
    """Each rank's order of events: a per-batch check posted ("post", steps so far) and waited for ("wait", ...),
    and its training steps ("step", global step)."""

    def on_train_start(self) -> None:
        self.events: list[tuple[str, int]] = []
        control = self.trainer.strategy._control_comm
        begin = control.begin_all_reduce_mean

        def recorded(flat: torch.Tensor, purpose: str) -> Any:
            posted = self.trainer.global_step
            self.events.append(("post", posted))
            wait = begin(flat, purpose)

            def waited() -> None:
                self.events.append(("wait", posted))
                wait()

            return waited

        control.begin_all_reduce_mean = recorded

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.events.append(("step", self.trainer.global_step))
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        local = [event for n in (1, 2) for event in (("post", n), ("step", n), ("wait", n))]
        # the first step (the first bases), the sync step (4) and the last step wait for their check first; the sync
        # step's own check of the step counts (inside it) goes before its round; then the final check (inside the
        # last step, which has not been counted yet) is posted and waited for
        assert self.events == [("post", 0), ("wait", 0), ("step", 0), *local, ("post", 3), ("wait", 3), ("step", 3),
                               ("post", 3), ("wait", 3), ("post", 4), ("wait", 4), ("step", 4), ("post", 4),
                               ("wait", 4)], self.events


def test_the_per_batch_check_is_read_a_batch_later_so_no_step_waits_for_the_others() -> None:
    """Lightning's check before a batch of local steps is posted and read before the next one (pipelined), so that
    batch's forward, backward and step run while the others' flags travel; before a step that waits for the others
    anyway (the first, a sync, the last) and at the end of training the check is read at once."""
    trainer(_strategy(4, 20), max_steps=5).fit(RecordsCheckOrder(), loader())


ONE_RANK_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch, lightning as L
import torch.distributed as dist
import lightning_lordo
from lightning_lordo import LoRDOStrategy
from strategy_helpers import TinyRegressor, loader

class SigtermOnRank1(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if dist.get_rank() == 1 and self.trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # rank 1 alone, between syncs (K = 8)
        return super().training_step(batch, batch_idx)

class RecordsStop(L.Callback):
    def on_exception(self, trainer, module, exception):
        with open(os.path.join(sys.argv[1], f"rank{{trainer.global_rank}}.txt"), "w") as f:
            f.write(f"{{type(exception).__name__}} {{trainer.global_step}}")

torch.set_num_threads(1)
L.Trainer(strategy=LoRDOStrategy(sync_every=8, optimizer=dict(rank=4), timeout=20), accelerator="cpu", devices=2,
          max_steps=12,
          callbacks=[RecordsStop()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(SigtermOnRank1(), loader())
"""


@pytest.mark.timeout(200)
def test_a_sigterm_to_one_rank_only_stops_every_rank_at_the_same_batch(tmp_path: Path) -> None:
    """The signal reaches rank 1 alone (a process of its own, the popen launcher): its next per-batch check carries
    it, every rank reads it and all stop at the same step through Lightning's preemption path."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(ONE_RANK_SCRIPT.format(tests=str(Path(__file__).parent))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env=env)
    output = done.stdout + done.stderr
    stops = [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else None
             for r in (0, 1)]
    assert stops[0] is not None and stops[0] == stops[1], (stops, output[-3000:])
    assert stops[0].startswith("SIGTERMException") and int(stops[0].split()[1]) in (6, 7), (stops, output[-3000:])


OVERLAP_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch, lightning as L
import torch.distributed as dist
import lightning_lordo
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning_lordo import LoRDOStrategy
from strategy_helpers import TinyRegressor, loader

class SigtermOnRank1(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if dist.get_rank() == 1 and self.trainer.global_step == 7 and sys.argv[2] == "stop":
            os.kill(os.getpid(), signal.SIGTERM)  # rank 1 alone; the check carries it a batch later, at step 8 or 9
        return super().training_step(batch, batch_idx)

class RecordsStop(L.Callback):
    def on_exception(self, trainer, module, exception):
        with open(os.path.join(sys.argv[1], f"rank{{trainer.global_rank}}.txt"), "w") as f:
            f.write(f"{{type(exception).__name__}} {{trainer.global_step}}")

    def on_train_end(self, trainer, module):
        with open(os.path.join(sys.argv[1], f"end{{trainer.global_rank}}.txt"), "w") as f:
            f.write(str(trainer.global_step))

torch.set_num_threads(1)
stop = sys.argv[2] == "stop"
L.Trainer(strategy=LoRDOStrategy(sync_every=4, overlap_steps=2, optimizer=dict(rank=4), timeout=20),
          accelerator="cpu", devices=2, max_steps=12, logger=False,
          callbacks=[RecordsStop(), OnExceptionCheckpoint(sys.argv[1], filename="stopped")],
          enable_progress_bar=False, enable_model_summary=False).fit(
    SigtermOnRank1(), loader(), ckpt_path=None if stop else os.path.join(sys.argv[1], "stopped.ckpt"))
"""


@pytest.mark.timeout(300)
def test_a_sigterm_with_an_overlapped_round_in_flight_stops_every_rank_with_a_checkpoint_that_resumes(
        tmp_path: Path) -> None:
    """``overlap_steps``: SIGTERM to rank 1 alone while a round is in flight; every rank stops at the same batch, the
    emergency checkpoint holds the round in flight on every rank, and a new run resumes it to the end."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(OVERLAP_SCRIPT.format(tests=str(Path(__file__).parent))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "stop"], capture_output=True, text=True,
                          timeout=150, cwd=tmp_path, env=env)
    output = done.stdout + done.stderr
    stops = [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else None
             for r in (0, 1)]
    assert stops[0] is not None and stops[0] == stops[1], (stops, output[-3000:])
    assert stops[0].startswith("SIGTERMException") and int(stops[0].split()[1]) in (8, 9), (stops, output[-3000:])
    saved = load_full(tmp_path / "stopped.ckpt")["lordo"]  # the round launched at step 8 lands at step 10
    assert all("overlap" in rank for rank in saved["ranks"]), [sorted(r) for r in saved["ranks"]]
    resumed = subprocess.run([sys.executable, str(script), str(tmp_path), "resume"], capture_output=True, text=True,
                             timeout=150, cwd=tmp_path, env=env)
    ends = [(tmp_path / f"end{r}.txt").read_text() if (tmp_path / f"end{r}.txt").exists() else None for r in (0, 1)]
    assert resumed.returncode == 0 and ends == ["12", "12"], (ends, (resumed.stdout + resumed.stderr)[-3000:])
