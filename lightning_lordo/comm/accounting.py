r"""What a worker sent, by purpose and part: payload bytes and wire bytes, per round and in total (SPEC §8).

**Wire bytes.** The :class:`CommAccountant` keeps two figures per purpose. *Payload bytes* are
the sizes of the tensors a worker hands to a collective (numel x itemsize); they do not depend on the number of
workers M. *Wire bytes* are what the worker sends on the network, which does, by the standard bandwidth-optimal
algorithms (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005), for ``N`` bytes and M workers::

    collective        model                                          wire bytes per worker
    all-reduce        ring: reduce-scatter, then all-gather,         2 (M-1)/M * N      (N: the tensor)
                      each M-1 steps of one chunk of N/M
    all-gather        ring: M-1 steps, forwarding one chunk each     (M-1) * N          (N: this worker's chunk)
    all-to-all        direct: each foreign chunk sent once           N                  (N: the chunks it passes,
                                                                                        the M-1 foreign ones)
    broadcast         every receiver receives N once, whatever       (M-1)/M * N        (N: the tensor; the mean
                      the algorithm (chain, tree, star): (M-1) N                         over the workers, counted
                      in all, counted as its mean on every worker                        on every worker)

A worker receives as much as it sends in the first three (by symmetry), so the figures are also what it receives.
The all-reduce and broadcast figures are per-worker means rounded down to whole bytes per collective call (under
one byte per call): a ring's chunks differ by one element when M does not divide the tensor, and a broadcast's
sender sends more than a leaf (a chain's last worker sends nothing, a star's root sends ``(M-1) N``). No figure is
measured on the network: they are models, as :func:`~lightning_lordo.comm.communicator.ring_allreduce_seconds` is.
With one worker nothing travels: every figure is 0.

The DDP reference, :func:`ddp_wire_bytes`, prices DDP's per-step float32 gradient all-reduce by the same ring model,
so ``ddp_wire_bytes(...) / accountant.total_wire_bytes`` compares like with like.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Optional


class CommAccountant:
    """Bytes sent by this worker, by purpose: the current round and the running totals, twice.

    ``totals`` / ``round``: *payload* bytes, the tensors this worker hands to collectives (numel x itemsize).
    ``wire_totals`` / ``wire_round``: *wire* bytes, what it puts on the network by each collective's algorithm
    (:func:`wire_bytes`). ``last_round_wire``: the wire bytes of the round :meth:`end_round` ended.

    A purpose may name a part after a colon (``"pseudo_gradients:lowrank"``): the totals and rounds count it under
    the purpose before the colon, and ``parts`` / ``wire_parts`` count every label as given, from the end of one round
    to the end of the next (so between-round traffic such as Lightning's per-batch flags is in the next round's
    parts). ``last_parts`` / ``last_wire_parts``: those of the round :meth:`end_round` ended (the per-sync breakdown).
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = defaultdict(int)
        self.round: dict[str, int] = defaultdict(int)
        self.wire_totals: dict[str, int] = defaultdict(int)
        self.wire_round: dict[str, int] = defaultdict(int)
        self.last_round_wire: dict[str, int] = {}
        self.parts: dict[str, int] = defaultdict(int)
        self.wire_parts: dict[str, int] = defaultdict(int)
        self.last_parts: dict[str, int] = {}
        self.last_wire_parts: dict[str, int] = {}
        self._lock = threading.Lock()  # an overlapped round counts from its own thread

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the strategy: not its lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def add(self, purpose: str, nbytes: int, in_round: bool = True, wire: Optional[int] = None) -> None:
        """Count ``nbytes`` payload bytes and ``wire`` wire bytes (``None``: as many as ``nbytes``, a point-to-point
        send) under ``purpose``; ``in_round=False`` for traffic that belongs to no round (Lightning's own per-batch
        broadcast): it then counts in the totals (and the next round's parts) only."""
        self._count(self.parts, self.totals, self.round, purpose, nbytes, in_round)
        self.add_wire(purpose, nbytes if wire is None else wire, in_round)

    def add_wire(self, purpose: str, wire: int, in_round: bool = True) -> None:
        """Count ``wire`` wire bytes only (a broadcast's receiver: it hands nothing over, but forwards)."""
        self._count(self.wire_parts, self.wire_totals, self.wire_round, purpose, wire, in_round)

    def _count(self, parts: dict[str, int], totals: dict[str, int], round_: dict[str, int], purpose: str, n: int,
               in_round: bool) -> None:
        """``n`` bytes under ``purpose`` in ``parts`` and, under the purpose before any colon, in ``totals`` and
        (``in_round``) ``round_``."""
        base = purpose.partition(":")[0]
        with self._lock:
            parts[purpose] += n
            totals[base] += n
            if in_round:
                round_[base] += n

    def start_round(self, parts: bool = False) -> None:
        """Start counting a new round (bytes sent between rounds stay in the totals only); ``parts``: the parts too
        (what was sent before, e.g. the setup broadcast, is then in no round's breakdown)."""
        self.round = defaultdict(int)
        self.wire_round = defaultdict(int)
        if parts:
            self.parts, self.wire_parts = defaultdict(int), defaultdict(int)

    def end_round(self) -> dict[str, int]:
        """Return the payload bytes of the round that just ended, by purpose (its wire bytes are then in
        ``last_round_wire``), and start a new round."""
        finished = dict(self.round)
        self.last_round_wire = dict(self.wire_round)
        self.last_parts, self.last_wire_parts = dict(self.parts), dict(self.wire_parts)
        self.parts, self.wire_parts = defaultdict(int), defaultdict(int)
        self.start_round()
        return finished

    @property
    def total_bytes(self) -> int:
        """Payload bytes, all purposes."""
        return sum(self.totals.values())

    @property
    def total_wire_bytes(self) -> int:
        """Wire bytes, all purposes (the figure for ``lordo/wire_bytes_total``)."""
        return sum(self.wire_totals.values())

    def state_dict(self) -> dict[str, Any]:
        """The totals, and the round being counted (a round in flight at a save: its report, after the resume, has
        its bytes; the parts: the traffic since the last report)."""
        return {"totals": dict(self.totals), "wire_totals": dict(self.wire_totals), "round": dict(self.round),
                "wire_round": dict(self.wire_round), "parts": dict(self.parts), "wire_parts": dict(self.wire_parts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As saved (a state without the round, from an older version, starts an empty one)."""
        for key in ("totals", "wire_totals", "round", "wire_round", "parts", "wire_parts"):
            setattr(self, key, defaultdict(int, state.get(key, {})))


#: the collective kinds the accountant prices (``Communicator`` passes these names)
KINDS = ("all_reduce", "all_gather", "all_to_all", "broadcast")


def wire_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Wire bytes per worker of one collective call of ``kind`` (module docstring) on ``nbytes`` (the tensor for an
    all-reduce and a broadcast, this worker's chunk for an all-gather, the foreign chunks for an all-to-all).

    Raises:
        ValueError: an unknown ``kind``, or negative ``nbytes`` / ``world_size`` below 1.
    """
    if kind not in KINDS:
        raise ValueError(f"Invalid kind={kind!r}: choose one of {', '.join(KINDS)}.")
    if nbytes < 0 or world_size < 1:
        raise ValueError(f"Invalid nbytes={nbytes!r} or world_size={world_size!r}: nbytes must be >= 0 and "
                         "world_size >= 1.")
    m = world_size
    if m == 1:
        return 0
    if kind == "all_reduce":
        return 2 * (m - 1) * nbytes // m
    if kind == "all_gather":
        return (m - 1) * nbytes
    if kind == "all_to_all":
        return nbytes
    return (m - 1) * nbytes // m


def ddp_wire_bytes(gradient_bytes_per_step: int, world_size: int, steps: int = 1) -> int:
    """Wire bytes per worker of DDP's gradient all-reduce (one ring all-reduce of every gradient per optimizer step)
    for ``steps`` steps: ``steps * 2 (M-1)/M * gradient_bytes_per_step``, 0 on one worker.

    ``gradient_bytes_per_step`` is numel x itemsize of the trainable parameters' gradients (float32 for float32
    parameters), e.g. ``lightning_lordo._tensors.nbytes(trainable)`` as the strategies' ``ddp_equivalent_bytes`` use.

    Raises:
        ValueError: a negative ``steps``, ``gradient_bytes_per_step``, or ``world_size`` below 1.
    """
    if steps < 0:
        raise ValueError(f"Invalid steps={steps!r}: it must be >= 0 (optimizer steps taken).")
    return steps * wire_bytes("all_reduce", gradient_bytes_per_step, world_size)

