"""The window a basis refresh looks at (``basis_every``): the averaged pseudo-gradients summed since the last one.

With ``basis_every = n`` the low-rank bases are recomputed at every n-th sync only (syncs numbered from 1), from
the sum of the n rounds' averaged pseudo-gradients: the movement of the synchronized model over the window (with
plain averaging as the outer step, exactly the anchor's change). Frequent syncs (small K, for a fast network) then
keep a basis estimated from as many local steps as infrequent ones, and the moments are rotated as rarely. The sum
is identical on every worker (it adds identical averages), lives in float32 beside each low-rank matrix, and is
saved in checkpoints with the rest of the synchronizer's shared state. A discarded round (non-finite on some worker)
adds nothing; if it was due to refresh, the refresh waits for the next due sync, n rounds later, and sees the longer
window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_lordo._tensors import math_dtype, nbytes


class BasisWindow:
    """The averaged pseudo-gradients of the low-rank matrices summed since the last basis refresh.

    Args:
        params: the low-rank matrices (in an order identical on all workers); none when ``every`` is 1.
        every: ``basis_every``: refresh at every ``every``-th sync.
    """

    def __init__(self, params: Sequence[Tensor], every: int) -> None:
        self.every = every
        self.sums: dict[Tensor, Tensor] = {}
        if every > 1:
            self.sums = {p: torch.zeros(p.shape, dtype=math_dtype(p.dtype), device=p.device) for p in params}

    def due(self, sync_index: int) -> bool:
        """Whether sync number ``sync_index`` (from 1) refreshes the bases."""
        return sync_index % self.every == 0

    def sources(self, averaged: Mapping[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """What a refresh computes the bases from: this round's averaged pseudo-gradients plus the window's sum
        (a pure function: the window changes only at :meth:`commit`)."""
        return {p: (self.sums[p] + a if p in self.sums else a) for p, a in averaged.items()}

    def commit(self, averaged: Mapping[Tensor, Tensor], refreshed: bool) -> None:
        """A round landed: after a refresh the window starts empty, otherwise it adds the round's averages."""
        for p, total in self.sums.items():
            if refreshed:
                total.zero_()
            elif p in averaged:
                total.add_(averaged[p])

    def state_dict(self) -> list[Tensor]:
        return list(self.sums.values())

    def load_state_dict(self, saved: Sequence[Tensor]) -> None:
        """The saved sums; an empty window when the checkpoint has none for these matrices (it was saved with
        ``basis_every=1``, or the matrices changed): the next refresh then looks at a shorter window."""
        matches = len(saved) == len(self.sums) and all(s.shape == t.shape for s, t in zip(saved, self.sums.values()))
        for i, total in enumerate(self.sums.values()):
            if matches:
                total.copy_(saved[i])
            else:
                total.zero_()

    def nbytes(self) -> int:
        return nbytes(self.sums.values())

    def __bool__(self) -> bool:
        return bool(self.sums)

