"""Collectives that count what they send, and the communication model of SPEC §8.

Every byte the plugin puts on the wire goes through :class:`Communicator` (but for the gather of every rank's state
into a single-file checkpoint, ``checkpoint_shards=False``: not counted), which counts the tensors it
passes to ``torch.distributed`` (numel x itemsize, per worker) under a *purpose* (``pseudo_gradients``,
``moments``, ``bases``, ``buffers``, ``setup_broadcast``, ...). Beside these *payload* bytes it counts *wire*
bytes, what the worker puts on the network by each collective's algorithm (:mod:`lightning_lordo.comm.accounting`).
With one process nothing travels, so nothing is sent and nothing is counted.

Failure semantics of :class:`Communicator` (checked on gloo, torch 2.13, see ``tests/test_faults.py``):

* gloo's ``work.wait(timeout)`` honours the timeout: a peer that hangs makes it raise
  ``RuntimeError("Operation timed out!")`` after exactly ``timeout``; a peer that died (its sockets closed) makes
  it raise ``RuntimeError("... Connection closed by peer ...")`` at once. It never returns ``False``. The timed-out
  work itself stays pending (it can be waited on again), so a timeout of ``wait`` is not an error of the work.
* a gloo ``wait`` blocks in C++ and ignores Ctrl-C until it returns. So on CPU tensors the communicator waits in
  slices of ``_WAIT_SLICE_S`` seconds up to its timeout: Ctrl-C is handled between slices.
* a ``wait`` timeout under 1 ms means *no* timeout (c10d's 0 ms is "wait forever"): no wait here is shorter.
* NCCL (CUDA tensors): ``wait`` only makes the current stream wait and returns at once, so it bounds nothing.
  The communicator therefore polls the work's ``is_completed()`` (it reads the collective's CUDA event without
  blocking) until it completes or the deadline passes, sleeping a little longer each time (up to
  ``_POLL_MAX_S``), then calls ``wait`` to surface the collective's own error. A hung NCCL peer thus raises
  :class:`CollectiveTimeout` on the host within the timeout; NCCL's watchdog (the process group's timeout, the
  same value) then aborts the communicator. The polling path is tested on gloo (``poll=True``); CI has no GPU.
* after a failed or interrupted collective the process group cannot be trusted (a late peer would pair its
  pending collective with our next one and exchange the wrong tensors), so every later collective of this
  communicator raises :class:`CollectiveTimeout` at once, naming the first failure (printed at once too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_lordo._tensors import FlatLayout, digest
from lightning_lordo.comm.accounting import CommAccountant, wire_bytes

__all__ = ["CollectiveTimeout", "CommAccountant", "Communicator", "side_communicator", "translate"]

_MESSAGE_BYTES = 128 * 1024 * 1024  # at most this many bytes per collective call (buckets and chunks)
# the name changed in torch 2.x; all_gather_into_tensor warns (deprecated) in recent versions
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_WAIT_SLICE_S = 0.25  # CPU collectives are waited on in slices this long, so that Ctrl-C gets through
_POLL_MAX_S = 0.01  # device collectives: the longest sleep between two is_completed() polls


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time or failed: another worker died, hangs, or the network is down.

    The message names the context (e.g. ``"sync 3 (optimizer step 48)"``), the collective, its purpose and the
    timeout.
    """


class _WaitTimedOut(Exception):
    """Internal: our own deadline for one collective passed."""


class Communicator:
    """``all_reduce`` (mean, sum), ``all_gather``, ``all_to_all`` and ``broadcast`` over a process group, counted
    (payload and wire bytes) and bounded by a timeout.

    Args:
        accountant: where the bytes are counted.
        timeout: how long one collective may take before :class:`CollectiveTimeout` is raised.
        group: the process group (``None``: the default group).

    Attributes:
        context: what the collectives are for, named in errors (the synchronizer sets e.g. ``"sync 12 ..."``).
        failure: ``None``, or the message of the first collective that failed or was interrupted; from then on
            every collective raises :class:`CollectiveTimeout` without touching the process group.
    """

    def __init__(self, accountant: CommAccountant, timeout: timedelta, group: Optional[Any] = None,
                 poll: Optional[bool] = None) -> None:
        self.accountant = accountant
        self.timeout = timeout
        self.group = group
        self.poll = poll  # None: poll is_completed() for device tensors (NCCL), wait in slices on the CPU (gloo)
        self.context = "setup"  # named in timeout errors, e.g. "sync 12"
        self.failure: Optional[str] = None

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def all_reduce_mean(self, tensors: Sequence[Tensor], purpose: str, in_round: bool = True) -> None:
        """Average ``tensors`` across workers in place (flattened into buckets of one dtype and device);
        ``in_round=False``: counted in the totals only (traffic that belongs to no synchronization round). Every
        collective runs before anything is written, so a failed one leaves the tensors as they were."""
        for bucket, means in self._bucket_means(tensors, purpose, in_round):
            torch._foreach_copy_(bucket, means)

    def average_temporaries(self, tensors: Sequence[Tensor], purpose: str) -> None:
        """Average ``tensors``, which the caller owns and nothing else reads, in place one bucket at a time: at most
        one bucket's flat buffer exists at once (:meth:`all_reduce_mean` holds all of them until every collective has
        succeeded, so that a failure changes nothing). After a failure some of them hold averages."""
        for bucket in _buckets(tensors) if self.world_size > 1 else []:
            for original, mean in self._bucket_means(bucket, purpose, True):
                torch._foreach_copy_(original, mean)

    def mean(self, tensors: Sequence[Tensor], purpose: str) -> list[Tensor]:
        """The average of ``tensors`` across workers as new tensors (the inputs are not changed): each bucket is
        flattened into one new buffer, averaged in place, and returned as views of it, so no copy is made besides
        the flattening. Alone: the inputs themselves (nothing to average)."""
        return list(tensors) if self.world_size == 1 else [m for _, means in self._bucket_means(tensors, purpose, True)
                                                           for m in means]

    def _bucket_means(self, tensors: Sequence[Tensor], purpose: str, in_round: bool
                      ) -> list[tuple[list[Tensor], list[Tensor]]]:
        """Per bucket (one dtype and device, at most ``_MESSAGE_BYTES``), its tensors and their averages (views of
        one flat buffer, all-reduced); nothing alone."""
        if self.world_size == 1 or not tensors:
            return []
        out = []
        for bucket in _buckets(tensors):
            layout = FlatLayout([t.shape for t in bucket])
            flat = layout.pack(bucket)
            self._run(partial(dist.all_reduce, flat, group=self.group, async_op=True), purpose, "all_reduce",
                      flat.device)
            nbytes = flat.numel() * flat.element_size()
            self.accountant.add(purpose, nbytes, in_round, wire_bytes("all_reduce", nbytes, self.world_size))
            out.append((bucket, layout.unpack(flat.div_(self.world_size))))
        return out

    def all_reduce_sum(self, flat: Tensor, purpose: str) -> int:
        """Sum the 1-D contiguous ``flat`` across workers in place, in its own dtype (a bfloat16 sum is rounded to
        bfloat16 by the backend). Counted: ``numel x itemsize``. Returns the bytes counted (0 alone)."""
        if self.world_size == 1:
            return 0
        for start, stop in _chunks(flat):
            piece = flat[start:stop]
            self._run(partial(dist.all_reduce, piece, group=self.group, async_op=True), purpose, "all_reduce",
                      piece.device)
            nbytes = piece.numel() * piece.element_size()
            self.accountant.add(purpose, nbytes, wire=wire_bytes("all_reduce", nbytes, self.world_size))
        return flat.numel() * flat.element_size()

    def all_gather(self, flat: Tensor, purpose: str, parts: Sequence[tuple[str, int]] = ()) -> tuple[Tensor, int]:
        """Every worker's 1-D ``flat`` (same size on all), as ``world x numel`` (row ``k``: rank ``k``'s), and the bytes
        counted (0 alone): ``numel x itemsize``, what this worker passes, under ``purpose`` or by ``parts``."""
        world, total = self.world_size, flat.numel() * flat.element_size()
        if world == 1:
            return flat.reshape(1, -1), 0
        chunks = _chunks(flat)
        whole = len(chunks) == 1 and flat.is_contiguous()  # gathered where it is received: no copy
        out = None if whole else torch.empty(world, flat.numel(), dtype=flat.dtype, device=flat.device)
        for start, stop in chunks:
            piece = flat if whole else flat[start:stop].contiguous()
            received = torch.empty(world * piece.numel(), dtype=flat.dtype, device=flat.device)
            self._run(partial(_all_gather_single, received, piece, group=self.group, async_op=True), purpose,
                      "all_gather", piece.device)
            if out is not None:
                out[:, start:stop] = received.view(world, -1)
        for part, nbytes in (parts or [(purpose, total)]) if total else ():  # wire bytes: linear in the bytes
            self.accountant.add(part, nbytes, wire=wire_bytes("all_gather", nbytes, world))
        return (received.view(world, -1) if out is None else out), total

    def all_to_all(self, chunks: Tensor, purpose: str) -> tuple[Tensor, int]:
        """Exchange rows: ``chunks`` is ``world x numel`` (row ``j`` is for rank ``j``, same shape on all workers);
        returns ``world x numel`` whose row ``k`` is rank ``k``'s row for this worker (this worker's own row is
        copied locally, never handed to the collective). Counted: the ``world - 1`` foreign rows, ``numel x
        itemsize`` each (the wire bytes too: each is sent once). Returns the exchanged tensor and the bytes
        counted (0 alone)."""
        world, me = self.world_size, self.rank
        if chunks.dim() != 2 or chunks.shape[0] != world:
            raise ValueError(f"Communicator.all_to_all: chunks has shape {tuple(chunks.shape)}; pass a world_size x "
                             f"numel tensor ({world} rows, one per rank).")
        out = torch.empty_like(chunks)
        out[me] = chunks[me]
        if world == 1:
            return out, 0
        others = [j for j in range(world) if j != me]
        step = max(1, _MESSAGE_BYTES // max(1, (world - 1) * chunks.element_size()))
        for start in range(0, chunks.shape[1], step):
            stop = min(start + step, chunks.shape[1])
            piece = chunks[others, start:stop].contiguous().reshape(-1)
            received = torch.empty_like(piece)
            splits = [0 if j == me else stop - start for j in range(world)]
            issue = partial(dist.all_to_all_single, received, piece, output_split_sizes=splits,
                            input_split_sizes=splits, group=self.group, async_op=True)
            self._run(issue, purpose, "all_to_all", piece.device)
            nbytes = piece.numel() * piece.element_size()
            self.accountant.add(purpose, nbytes, wire=wire_bytes("all_to_all", nbytes, world))
            out[others, start:stop] = received.view(world - 1, -1)
        return out, (world - 1) * chunks.shape[1] * chunks.element_size()

    def broadcast(self, tensors: Sequence[Tensor], purpose: str, src: int = 0, in_round: bool = True) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values. Counted on the sender only (it is what it sends);
        ``in_round=False``: in the totals only (traffic that belongs to no synchronization round)."""
        if self.world_size == 1:
            return
        for t in tensors:
            buffer = t if t.is_contiguous() else t.contiguous()
            self._run(partial(dist.broadcast, buffer, src=src, group=self.group, async_op=True), purpose, "broadcast",
                      buffer.device)
            if buffer is not t:
                t.copy_(buffer)
            nbytes = t.numel() * t.element_size()
            wire = wire_bytes("broadcast", nbytes, self.world_size)
            if self.rank == src:
                self.accountant.add(purpose, nbytes, in_round, wire)
            else:
                self.accountant.add_wire(purpose, wire, in_round)

    def broadcast_unless_identical(self, tensors: Sequence[Tensor], purpose: str, src: int = 0) -> bool:
        """Make ``tensors`` rank ``src``'s values, sending them only when some worker's differ: every worker first
        shares the SHA-256 digest of its tensors (32 bytes each, an all-gather counted under ``purpose``); when all
        equal rank ``src``'s, the tensors are already bitwise identical and nothing more travels, else
        :meth:`broadcast` sends them. Every worker gets the same answer. Returns whether the broadcast ran.

        Hashing reads each tensor once through host memory (about a second per GB on a CPU core): on a slow link a
        model the workers built identically (seeded, or loaded from one checkpoint) starts without its transfer.
        """
        if self.world_size == 1 or not tensors:
            return False
        mine = torch.tensor(list(digest(tensors)), dtype=torch.uint8, device=tensors[0].device)
        gathered, _ = self.all_gather(mine, purpose)
        if bool((gathered == gathered[src]).all()):
            return False
        self.broadcast(tensors, purpose, src=src)
        return True

    def begin_all_reduce_mean(self, flat: Tensor, purpose: str) -> Callable[[], None]:
        """Start averaging the 1-D CPU tensor ``flat`` in place without waiting (counted in the totals only); returns
        the function that waits for it, at most ``timeout`` from when it is called, and completes the average."""
        if self.world_size == 1:
            return lambda: None
        issue = partial(dist.all_reduce, flat, group=self.group, async_op=True)
        work = self._run(issue, purpose, "all_reduce", flat.device, wait=False)
        nbytes = flat.numel() * flat.element_size()
        self.accountant.add(purpose, nbytes, False, wire_bytes("all_reduce", nbytes, self.world_size))

        def finish() -> None:
            self._run(lambda: work, purpose, "all_reduce", flat.device)
            flat.div_(self.world_size)

        return finish

    def _run(self, issue: Callable[[], Any], purpose: str, op: str, device: torch.device, wait: bool = True) -> Any:
        """Issue one collective (``issue`` returns its work handle) and wait for it, at most ``timeout``; with
        ``wait=False`` only issue it and return the handle (its failure to issue named the same way)."""
        if self.failure is not None:
            raise CollectiveTimeout(
                f"LoRDO {self.context}: the {op} of {purpose} was not attempted because an earlier collective "
                f"failed, after which the process group cannot be trusted: {self.failure}"
            )
        start = time.monotonic()
        try:
            work = issue()  # NCCL (and gloo, for a peer known to be gone) may raise here already
            if not wait:
                return work
            poll = self.poll if self.poll is not None else device.type != "cpu"
            if poll:
                self._poll(work, start)
            else:
                self._wait_in_slices(work, start)
        except (RuntimeError, _WaitTimedOut) as err:  # gloo and NCCL raise RuntimeError (DistBackendError, ...)
            message = self._message(purpose, op, err, time.monotonic() - start)
            self.failure = message
            # said at once: a launcher may kill this process within seconds of a peer's death (Lightning's: 5 s)
            peer = f" (the other worker is rank {1 - self.rank})" if self.world_size == 2 else ""
            print(f"[rank {self.rank}] {message.split(' Likely causes')[0]}{peer}", file=sys.stderr, flush=True)
            raise CollectiveTimeout(message) from (err if isinstance(err, RuntimeError) else None)
        except BaseException:  # KeyboardInterrupt, SystemExit: the collective is abandoned half-way
            self.failure = (f"the {op} of {purpose} in {self.context} was interrupted after "
                            f"{time.monotonic() - start:.1f} s")
            raise

    def _poll(self, work: Any, start: float) -> None:
        """Wait for ``work`` by polling ``is_completed()`` up to the deadline (NCCL's ``wait`` does not block)."""
        deadline = start + self.timeout.total_seconds()
        pause = 1e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise _WaitTimedOut()
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        work.wait()  # completed: returns, or raises the collective's own error

    def _wait_in_slices(self, work: Any, start: float) -> None:
        deadline = start + self.timeout.total_seconds()
        while True:
            remaining = deadline - time.monotonic()
            if remaining < 0.002:  # a shorter wait would be rounded to 0 ms, which c10d takes as "no timeout"
                raise _WaitTimedOut()
            try:
                if work.wait(_at_least_1ms(min(_WAIT_SLICE_S, remaining))) is not False:
                    return
            except RuntimeError:
                if not work.is_completed():
                    continue  # only this slice ran out; Python handles pending signals (Ctrl-C) here
                work.wait()  # completed: returns, or raises the collective's own error (e.g. peer gone)
                return

    def _message(self, purpose: str, op: str, err: BaseException, elapsed: float) -> str:
        limit = _seconds(self.timeout)
        detail = str(err).strip()
        if isinstance(err, _WaitTimedOut) or "timed out" in detail.lower() or elapsed >= self.timeout.total_seconds():
            what = f"did not complete within the timeout of {limit}: another worker died, hangs or cannot be reached"
        else:
            what = (f"failed after {elapsed:.1f} s (within its timeout of {limit}), usually because another worker "
                    "died or cannot be reached")
        why = f" ({detail})" if detail and not isinstance(err, _WaitTimedOut) else ""
        return f"LoRDO {self.context}: the {op} of {purpose} {what}{why}. {LIKELY_CAUSES}"


#: What a failed or timed-out collective usually means, and what to do (the end of every such error message).
LIKELY_CAUSES = (
    "Likely causes: a worker died (see its log), hangs, or cannot be reached; or the workers are not at the same "
    "point: different numbers of batches (give every rank as many: a DistributedSampler with drop_last) or of "
    "optimizer steps (an optimizer_step skipping a step on some ranks only). If the workers are only slow, raise "
    "the timeout with LoRDOStrategy(timeout=...) (Fabric: LoRDOFabricStrategy(timeout=...)).")


def translate(err: BaseException, what: str, timeout: timedelta) -> CollectiveTimeout:
    """A collective's raw backend error (gloo's ``Connection closed by peer``, a process-group timeout) as a
    :class:`CollectiveTimeout` naming what was running (``what``)."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return CollectiveTimeout(f"LoRDO: {what} failed or timed out (timeout {_seconds(timeout)}: {detail}). "
                             f"{LIKELY_CAUSES}")


def _at_least_1ms(seconds: float) -> timedelta:
    """A ``wait`` timeout c10d will honour: whole milliseconds, at least 1 (0 ms would mean no timeout)."""
    return timedelta(milliseconds=max(1, int(seconds * 1000)))


def _seconds(timeout: timedelta) -> str:
    seconds = timeout.total_seconds()
    return f"{seconds:g} s" if seconds < 120 else f"{seconds:g} s ({timeout})"


def _chunks(flat: Tensor) -> list[tuple[int, int]]:
    step = max(1, _MESSAGE_BYTES // max(1, flat.element_size()))
    return [(start, min(start + step, flat.numel())) for start in range(0, flat.numel(), step)]


def _buckets(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each at most ``_MESSAGE_BYTES`` bytes."""
    buckets: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if not same_kind or size + nbytes > _MESSAGE_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


@contextmanager
def joining(timeout: timedelta, owner: str) -> Iterator[None]:
    """The process group's setup: a worker that does not join within ``timeout`` (started late, or dead) makes the
    others raise :class:`CollectiveTimeout` naming the knob, instead of the store's bare ``DistStoreError``."""
    try:
        yield
    except dist.DistStoreError as err:
        seconds = timeout.total_seconds()
        raise CollectiveTimeout(
            f"LoRDO setup: not every worker joined the process group within timeout={seconds:g} s ({owner}'s "
            f"timeout, which also bounds the setup). A worker started late, died, or cannot reach the master "
            f"address. Start them together, or pass a larger timeout, e.g. {owner}(timeout={max(seconds * 4, 600):g})."
        ) from err


def side_communicator(accountant: CommAccountant, timeout: timedelta) -> Communicator:
    """A communicator on a new gloo process group of every rank (all ranks call this together), for collectives
    issued from another thread (overlapped syncs) that must never pair with the default group's; on one process,
    one without a group."""
    group = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo", timeout=timeout)
    return Communicator(accountant, timeout, group=group)


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Time of one ring all-reduce of ``nbytes`` (SPEC §8): ``2(M-1)/M * bytes/B + 2(M-1) * alpha``."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth_bytes_per_s + 2 * (workers - 1) * latency_s
