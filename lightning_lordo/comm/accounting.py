"""What a worker sent, by purpose and part: payload bytes and wire bytes, per round and in total (SPEC §8)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Optional


class CommAccountant:
    """Bytes sent by this worker, by purpose: the current round and the running totals, twice.

    ``totals`` / ``round``: *payload* bytes, the tensors this worker hands to collectives (numel x itemsize).
    ``wire_totals`` / ``wire_round``: *wire* bytes, what it puts on the network by each collective's algorithm
    (:mod:`lightning_lordo.comm.wire`). ``last_round_wire``: the wire bytes of the round :meth:`end_round` ended.
    ``wire_complete``: ``False`` after loading a state dict saved before wire bytes were kept (its wire totals then
    count from the resume only).

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
        self.wire_complete = True
        self._lock = threading.Lock()  # an overlapped round counts from its own thread

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
        return {"totals": dict(self.totals), "wire_totals": dict(self.wire_totals),
                "wire_complete": self.wire_complete}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; one saved before wire bytes were kept (``totals`` only) loads with wire
        totals from zero and ``wire_complete = False``."""
        self.totals = defaultdict(int, state["totals"])
        self.wire_totals = defaultdict(int, state.get("wire_totals", {}))
        self.wire_complete = "wire_totals" in state and bool(state.get("wire_complete", True))
