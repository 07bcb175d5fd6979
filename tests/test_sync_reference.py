"""One synchronization of two workers trained on different data, against a float64 reference of SPEC §4 written
here from the spec: average the pseudo-gradients, step the anchor, take the new basis from the averaged
pseudo-gradient, average the moments and rotate them into it; the error feedback stays.

Two documented choices of the implementation are part of the reference (``sync/synchronizer.py``,
``optim/projection.py``): the moments are averaged in the old shared basis, before the rotation (the SPEC's order
differs for the second moment only), and a new direction the old basis did not see gets the old mean second moment
(LDAdam's rule would give it about 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from strategy_helpers import TinyRegressor, loader, lordo, trainer

pytestmark = pytest.mark.slow
K = 4
BETAS = (0.9, 0.999)


class RecordSync(L.Callback):
    """Each rank saves its state just before and just after its second synchronization (the first is from the
    first gradient; the second rotates non-trivial moments)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        sync, optimizer = strategy.synchronizer, strategy.optimizers[0]
        inner, calls = sync.sync, []

        def state() -> dict[str, Any]:
            lowrank = {i: {k: optimizer.state[p][k].double().clone() for k in
                           ("basis", "exp_avg", "exp_avg_sq", "error_feedback", "step")}
                       for i, p in enumerate(sync.params) if "basis" in optimizer.state[p]}
            return {"params": [p.detach().double().clone() for p in sync.params],
                    "anchor": [t.double().clone() for t in sync.anchor.tensors], "lowrank": lowrank}

        def recorded() -> Any:
            calls.append(None)
            before = state() if len(calls) == 2 else None
            report = inner()
            if before is not None:
                torch.save({"before": before, "after": state()}, self.folder / f"rank{trainer.global_rank}.pt")
            return report

        sync.sync = recorded


def _rotate(u: torch.Tensor, v: torch.Tensor, q_old: torch.Tensor, q_new: torch.Tensor, t: float) -> tuple:
    """SPEC §4.5 in float64: C = Q_new^T Q; u' = C u; v' = b2 |(C*C)(v/b2 - u*u/b1^2) + u'*u'/b1^2|, plus the
    unseen share of each new direction, max(0, 1 - sum_k C_ik^2), times the old mean of v per column."""
    b1, b2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
    c = q_new.T @ q_old
    u_new = c @ u
    v_new = b2 * ((c * c) @ (v / b2 - u * u / b1**2) + u_new * u_new / b1**2).abs()
    unseen = (1 - (c * c).sum(dim=1, keepdim=True)).clamp(min=0)
    return u_new, v_new + unseen * v.mean(dim=0, keepdim=True)


def _canonical(t: torch.Tensor) -> torch.Tensor:
    return t.T if t.shape[0] > t.shape[1] else t


def test_two_workers_sync_as_the_float64_reference_of_the_spec(tmp_path: Path) -> None:
    strategy = lordo(sync_every=K, rank=2, projection="svd", omega=0.9)
    trainer(strategy, callbacks=[RecordSync(tmp_path)], max_steps=3 * K).fit(TinyRegressor(), loader())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    before, after = [r["before"] for r in ranks], [r["after"] for r in ranks]
    assert not torch.equal(before[0]["params"][0], before[1]["params"][0])  # the workers trained apart

    for i, anchor in enumerate(before[0]["anchor"]):
        # 1-3: the averaged pseudo-gradient, and the anchor's plain-averaging step
        delta = torch.stack([anchor - b["params"][i] for b in before]).mean(0)
        expected = anchor - delta
        for a in after:
            torch.testing.assert_close(a["params"][i], expected, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(a["anchor"][i], expected, rtol=1e-6, atol=1e-7)
        if i not in before[0]["lowrank"]:
            continue
        # 4: the new basis spans the top-r left singular subspace of the averaged pseudo-gradient
        old = [b["lowrank"][i] for b in before]
        new = [a["lowrank"][i] for a in after]
        r = old[0]["basis"].shape[1]
        left = torch.linalg.svd(_canonical(delta), full_matrices=False)[0][:, :r]
        for n in new:
            torch.testing.assert_close(n["basis"] @ n["basis"].T, left @ left.T, rtol=0, atol=1e-5)
        torch.testing.assert_close(new[0]["basis"], new[1]["basis"], rtol=0, atol=0)  # identical on every rank
        # 5-6: the moments, averaged in the old basis the workers share, rotated into the new basis
        torch.testing.assert_close(old[0]["basis"], old[1]["basis"], rtol=0, atol=0)
        u_avg = torch.stack([o["exp_avg"] for o in old]).mean(0)
        v_avg = torch.stack([o["exp_avg_sq"] for o in old]).mean(0)
        u_ref, v_ref = _rotate(u_avg, v_avg, old[0]["basis"], new[0]["basis"], float(old[0]["step"]))
        for n in new:
            torch.testing.assert_close(n["exp_avg"], u_ref, rtol=1e-4, atol=1e-9)
            torch.testing.assert_close(n["exp_avg_sq"], v_ref, rtol=1e-4, atol=1e-12)
        # 7: the error feedback stays each worker's own, untouched by the sync
        for o, n in zip(old, new):
            torch.testing.assert_close(n["error_feedback"], o["error_feedback"], rtol=0, atol=0)
