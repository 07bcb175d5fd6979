"""An anchor in host memory beside an accelerator copies on a side stream (``sync/staging.py``, issue 29): the next
bucket is read while this one is worked on, and the new anchor is written back without the host waiting for it.

There is no accelerator here, so the copies are exercised with a stand-in stream module on the CPU: the values must
be the unstaged anchor's bit for bit (a stream changes when a copy runs, never what it computes), and the stand-in
checks the order a device would need: the compute stream waits for a staged copy before it uses it, a write-back
waits for the compute stream's work, and the host waits for the writes before it reads the anchor."""

from __future__ import annotations

import contextlib
import functools
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from strategy_helpers import gloo_worker, run_fork_job, sync_rounds

from lightning_lordo import LoRDO
from lightning_lordo.config import SyncConfig
from lightning_lordo.sync.outer import Anchor, averaged_point
from lightning_lordo.sync.staging import SideStream

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


class _Event:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"host waits {self.name}")


class _Stream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.events = log, name, 0

    def record_event(self) -> _Event:
        self.events += 1
        event = _Event(self.log, f"{self.name}#{self.events}")
        self.log.append(f"{self.name} records {event.name}")
        return event

    def wait_event(self, event: _Event) -> None:
        self.log.append(f"{self.name} waits {event.name}")

    def synchronize(self) -> None:
        self.log.append(f"host waits {self.name}")


class Streams:
    """A stand-in for ``torch.cuda``'s streams: it logs what a device would order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute

    def Stream(self, device: Any) -> _Stream:  # noqa: N802 (torch.cuda's name)
        return _Stream(self.log, "side")

    def current_stream(self, device: Any) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Any:
        previous, self.current = self.current, stream
        self.log.append(f"on {stream.name}")
        try:
            yield
        finally:
            self.current = previous


class _LoggedSide(SideStream):
    """The side stream, logging each copy made on the compute stream (the stand-in cannot see ``Tensor.to``)."""

    def fetch(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        copy = super().fetch(source, dtype)
        self.streams.log.append("compute copies")
        return copy


def _stage(sync: Any) -> Streams:
    """Give ``sync`` an anchor of the same values that copies through the stand-in side stream (real copies on the
    CPU: a stale staged copy would show in the values)."""
    streams = Streams()
    saved = sync.anchor.state_dict()
    anchor = sync.anchor = Anchor(sync.params, "auto", side=_LoggedSide(torch.device("cpu"), streams))
    anchor.load_state_dict(saved)
    on_device = anchor._on_device

    def used(indices: Any) -> list[torch.Tensor]:  # the staged copies' events, logged as used once returned
        events = sorted({anchor._staged[i][1].name for i in indices if i in anchor._staged})
        copies = on_device(indices)
        streams.log.extend(f"compute uses {event}" for event in events)
        return copies

    anchor._on_device = used
    streams.log.clear()
    return streams


def _run(world: int, rank: int, staged: bool, knobs: dict[str, Any]) -> tuple[list[torch.Tensor], list[str]]:
    from lightning_lordo.comm.communicator import CommAccountant, Communicator
    from lightning_lordo.sync.synchronizer import Synchronizer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 8))
    params = list(net.parameters())
    opt = LoRDO(params, lr=1e-2, rank=4)
    comm = Communicator(CommAccountant(), timedelta(seconds=60))
    config = SyncConfig(**{"sync_every": 3, "synchronous": False, "bucket_cap_mb": 0.01, **knobs})
    sync = Synchronizer(params, [], opt, config, comm)
    streams = _stage(sync) if staged else None
    reports = [r for r, _ in sync_rounds(sync, opt, params, 10, rank)]
    assert len(reports) == 3
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params] + sync.anchor.state_dict() + state, streams.log if streams else []


def _check(log: list[str]) -> None:
    """A device would need this order: each write to the host waits for the compute stream's work so far; a copy
    made on the compute stream comes after the compute stream (or the host) waited for every earlier write; every
    staged copy is waited for before its use (the compute stream waits for its event before it is used)."""
    writes = [n for n, line in enumerate(log) if line.startswith("side waits compute#")]
    assert writes, log
    pending = None  # the event of the last write that nothing has waited for yet
    for n, line in enumerate(log):
        if line.startswith("side waits compute#"):
            pending = "write"
        elif pending == "write" and line.startswith("side records "):
            pending = line.split()[-1]
        elif pending is not None and line in (f"compute waits {pending}", "host waits side"):
            pending = None
        elif line == "compute copies":
            assert pending is None, (n, log[max(0, n - 8):n + 1])
        if line.startswith("compute uses "):  # a staged copy is used only after the compute stream waited for it
            assert f"compute waits {line.split()[-1]}" in log[:n], (n, log[max(0, n - 8):n + 1])


@pytest.mark.parametrize("knobs", [{}, {"outer_optimizer": "nesterov"}], ids=["bucketed", "general"])
def test_alone_a_staged_anchor_gives_the_unstaged_values(knobs: dict[str, Any]) -> None:
    plain, _ = _run(1, 0, False, knobs)
    staged, log = _run(1, 0, True, knobs)
    assert all(torch.equal(a, b) for a, b in zip(plain, staged, strict=True))
    _check(log)
    assert any(line.startswith("compute uses ") for line in log) == (not knobs), log  # bucketed: staged copies
    if not knobs:  # averaging alone: the commit takes the parameters as the anchor, and the compute stream waits for
        # that copy on the device before the next update writes them; the host does not wait for it
        first_write = next(n for n, line in enumerate(log) if line.startswith("side waits compute#"))
        assert log[first_write + 3].startswith("compute waits side#"), log[first_write:first_write + 4]
        assert not any(line.startswith("host waits") for line in log[first_write:first_write + 4])


def _both(knobs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    plain, _ = _run(world, rank, False, knobs)
    staged, log = _run(world, rank, True, knobs)
    return {"plain": plain, "staged": staged, "log": log}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("knobs", [{}, {"payload": "lowrank", "payload_dtype": "int8"},
                                   {"outer_optimizer": "nesterov"}], ids=["bucketed", "streamed", "general"])
def test_two_workers_with_a_staged_anchor_get_the_unstaged_values(tmp_path: Path, knobs: dict[str, Any]) -> None:
    worker = functools.partial(gloo_worker, body=functools.partial(_both, knobs))
    for run in run_fork_job(worker, 2, tmp_path, timeout=150):
        assert all(torch.equal(a, b) for a, b in zip(run["plain"], run["staged"], strict=True))
        _check(run["log"])
        staged = sum(line.startswith("side records") for line in run["log"]) - sum(
            line.startswith("side waits compute#") for line in run["log"])
        if not knobs:  # the bucketed path stages the next bucket ahead of its use, several a sync
            assert staged > 2 * 3 and any(line.startswith("compute uses ") for line in run["log"]), run["log"]
        else:  # streamed and general: their pseudo-gradients are copied on the compute stream, nothing staged
            assert staged == 0 and "compute copies" in run["log"], run["log"]


def test_a_staged_copy_is_released_once_used_and_dropped_when_the_anchor_changes() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    streams = Streams()
    anchor = Anchor(params, "auto", side=_LoggedSide(torch.device("cpu"), streams))
    anchor.take()
    anchor.prefetch([0, 1])
    assert sorted(anchor._staged) == [0, 1]
    staged = anchor._staged[1][0]
    assert staged is not anchor.tensors[1] and torch.equal(staged, anchor.tensors[1])  # a copy, as on a device
    anchor.deltas(indices=[0])
    assert sorted(anchor._staged) == [1]  # used: released
    with torch.no_grad():
        params[1].add_(1.0)
    point = anchor.new_point([1], anchor.deltas(indices=[1]))  # the new point copies the anchor again
    assert not anchor._staged and streams.log[-1] == "compute copies"
    expected = averaged_point([anchor.tensors[1]], [anchor.tensors[1] - params[1].detach()])
    assert torch.equal(point[0], expected[0]) and not torch.equal(point[0], anchor.tensors[1])
    anchor.prefetch([2])
    anchor.set([p.detach() * 2 for p in params])
    assert not anchor._staged  # stale after a write
    assert torch.equal(anchor.tensors[2], params[2].detach())
    assert streams.log[-1] == "host waits side"  # the host read the anchor: it waited for the write first
    anchor.set([p.detach() * 3 for p in params])
    anchor.deltas(indices=[0])  # a copy on the compute stream after a write: the compute stream waits for it first
    _check(streams.log)
    assert streams.log[-2].startswith("compute waits side#") and streams.log[-1] == "compute copies"


def test_on_the_cpu_the_anchor_sits_beside_the_parameters_without_a_side_stream() -> None:
    params = [torch.nn.Parameter(torch.randn(2, 2))]
    assert not Anchor(params, "auto").on_side  # the CPU: the anchor sits beside the parameters
    assert Anchor(params, "auto", side=SideStream(torch.device("cpu"), Streams())).on_side
