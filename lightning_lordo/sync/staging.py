"""Copies between an anchor in host memory and the parameters' accelerator, on a stream of their own.

With ``anchor_device="auto"`` on an accelerator the anchor lives in pinned host memory (one model of device memory
saved). A sync then reads it onto the device, a bucket at a time, and writes the new synchronized point back. Made on
the compute stream with a wait for the device at the end, those copies stall both the device and the host (60 ms and
30 ms for a 406 M model on an H200). :class:`SideStream` makes them on a stream of their own, as torchft stages its
backups:

* **reads** (host to device): :meth:`SideStream.prefetch` issues a bucket's copies on the side stream, so that they
  run while the compute stream works on the previous bucket (or, for the first bucket, on the optimizer step of the
  step that syncs); :meth:`SideStream.join` makes the compute stream wait for them, on the device, before it uses
  them;
* **writes** (device to host): :meth:`SideStream.write` issues them after the compute stream's work so far and
  returns at once. A copy to the device made on the compute stream (:meth:`SideStream.fetch`) first waits for them on
  the device, and the host waits for them (:meth:`SideStream.settle`) only when it reads the anchor itself (a
  checkpoint, validation of the synchronized model), by when they have long finished.

The caching allocator is told which stream uses each tensor (``record_stream``), so no memory is reused while a copy
still reads or writes it. Where there is no accelerator nothing of this runs: the anchor sits beside the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class SideStream:
    """A copy stream on ``device`` (an accelerator's) and the events of its pending reads and writes.

    Args:
        device: the parameters' device.
        streams: the device's stream module (``torch.cuda`` for CUDA; tests pass a stand-in).
    """

    def __init__(self, device: torch.device, streams: Any = None) -> None:
        self.device = device
        self.streams = streams if streams is not None else torch.get_device_module(device)
        self.stream = self.streams.Stream(device)
        self._pending = False  # copies issued that the host has not waited for
        self._written: Any = None  # the event of the last writes that the compute stream has not waited for

    def prefetch(self, sources: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> tuple[list[Tensor], Any]:
        """Host tensors ``sources`` copied to the device in ``dtypes`` on the side stream, after its pending writes
        (the same stream: in order); ``(the copies, their event)`` for :meth:`join`."""
        with self.streams.stream(self.stream):
            copies = [s.to(self.device, dt, non_blocking=True, copy=True) for s, dt in zip(sources, dtypes)]
            self._pending = True
            done = self.stream.record_event()
        return copies, done

    def fetch(self, source: Tensor, dtype: torch.dtype) -> Tensor:
        """Host tensor ``source`` copied to the device now, on the compute stream, after the side stream's writes
        (the compute stream waits for them on the device, once: later work on it is ordered after that wait)."""
        if self._written is not None:
            self.streams.current_stream(self.device).wait_event(self._written)
            self._written = None
        return source.to(device=self.device, dtype=dtype, non_blocking=True, copy=True)

    def join(self, copies: Sequence[Tensor], done: Any) -> None:
        """The compute stream waits (on the device) for ``copies`` and then owns them."""
        current = self.streams.current_stream(self.device)
        current.wait_event(done)
        for c in copies:
            _own(c, current)

    def write(self, targets: Sequence[Tensor], sources: Sequence[Tensor], sources_change: bool) -> None:
        """``targets[i].copy_(sources[i])`` (host from device) on the side stream, after the compute stream's work so
        far; returns at once. ``sources_change``: the compute stream will write to ``sources`` (the parameters) and
        waits for the copies first, on the device; other sources are only kept from reuse until the copies end."""
        current = self.streams.current_stream(self.device)
        self.stream.wait_event(current.record_event())
        with self.streams.stream(self.stream):
            for t, s in zip(targets, sources):
                t.copy_(s, non_blocking=True)
                _own(s, self.stream)
            self._pending = True
            done = self._written = self.stream.record_event()
        if sources_change:
            current.wait_event(done)
            self._written = None

    def settle(self) -> None:
        """The host waits for the side stream's copies, if any was issued since (before it reads or writes the host
        tensors itself: a pending write would be lost or a pending read would see the host's new values)."""
        if self._pending:
            self.stream.synchronize()
            self._pending, self._written = False, None


def _own(t: Tensor, stream: Any) -> None:
    """The caching allocator keeps ``t``'s memory until ``stream``'s work so far is done (an accelerator's only)."""
    if t.device.type != "cpu":
        t.record_stream(stream)
