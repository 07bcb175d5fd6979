"""The anchor (the parameters of the last synchronization, SPEC §4's theta_0) and the outer step applied to it.

:class:`Anchor` keeps one copy of the trainable parameters, in their dtype, on their device or (``device="cpu"``)
in CPU memory, pinned when the parameters are on a GPU: local-update methods need it, and on a GPU the CPU copy
saves one model of device memory at the cost of one host-to-device copy of the model per sync (and, between syncs,
of a copy for every validation or checkpoint of the synchronized model).

:class:`OuterStep` moves the anchor by the averaged pseudo-gradient ``delta``: plain averaging (``anchor - delta``,
an outer SGD step with learning rate 1 and no momentum) or DiLoCo's Nesterov momentum, which is a real
:class:`torch.optim.SGD` on the anchor tensors (so its momentum has a ``state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import math_dtype, nbytes
from lightning_lordo.sync.staging import SideStream


class Anchor:
    """The synchronized parameters. Empty until :meth:`take` (the synchronous phase needs none).

    Args:
        params: the trainable parameters, in the order every worker uses.
        device: ``"param"`` (each parameter's device), or ``"auto"`` / ``"cpu"``: host memory, pinned where the
            parameters are on an accelerator (on the CPU that is the parameters' own device).
    """

    def __init__(self, params: Sequence[Tensor], device: str = "auto", side: Optional[SideStream] = None) -> None:
        self.params = list(params)
        self.device = device
        self._tensors: list[Tensor] = []
        self._saved: Optional[list[Tensor]] = None  # the local replicas while the anchor is in the model
        # in host memory beside an accelerator: its copies on a stream of their own (tests pass a stand-in)
        devices = {p.device for p in self.params}  # one CUDA device (a model split over devices copies as before)
        cuda = next(iter(devices)) if len(devices) == 1 and next(iter(devices)).type == "cuda" else None
        self._side = side if side is not None else SideStream(cuda) if cuda is not None and device != "param" else None
        self._staged: dict[int, tuple[Tensor, Any]] = {}  # index -> (its copy on the device, the copy's event)
        self.on_side = self._side is not None  # in host memory beside an accelerator (plain attributes: read per step)
        self.taken = False  # whether there are tensors (taken or loaded)

    @property
    def tensors(self) -> list[Tensor]:
        """The anchor's tensors, once the copies between host and device issued so far are done (the reader may be
        the host)."""
        if self._side is not None:
            self._side.settle()
        return self._tensors

    @tensors.setter
    def tensors(self, values: list[Tensor]) -> None:
        if self._side is not None:
            self._side.settle()
        self._staged.clear()
        self._tensors, self.taken = values, bool(values)

    def __bool__(self) -> bool:
        return self.taken

    def _storage(self, p: Tensor) -> Tensor:
        if self.device == "param" or p.device.type == "cpu":
            return torch.empty_like(p, memory_format=torch.contiguous_format)
        return torch.empty(p.shape, dtype=p.dtype, pin_memory=True)

    @torch.no_grad()
    def take(self) -> None:
        """The anchor becomes the parameters as they are now (allocated on first use)."""
        if not self._tensors:
            self.tensors = [self._storage(p) for p in self.params]
        self._write(self._tensors, self.params, sources_change=True)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start copying the anchor at ``indices`` to the parameters' device on the side stream (host memory beside
        an accelerator; else nothing), for :meth:`deltas` and :meth:`new_point` of those indices."""
        if self._side is None or not self._tensors or not indices:
            return
        indices = [i for i in indices if i not in self._staged]
        copies, done = self._side.prefetch([self._tensors[i] for i in indices],
                                           [math_dtype(self.params[i].dtype) for i in indices])
        self._staged.update((i, (c, done)) for i, c in zip(indices, copies))

    def _on_device(self, indices: Sequence[int]) -> list[Tensor]:
        """The anchor at ``indices`` on the parameters' device, in the dtype LoRDO computes in: the staged copies
        (the compute stream waits for them once; then they are released here), else copied now on the compute
        stream after the side stream's writes."""
        assert self._side is not None
        staged = {i: self._staged.pop(i) for i in indices if i in self._staged}
        waiting: dict[int, tuple[Any, list[Tensor]]] = {}
        for copy, done in staged.values():
            waiting.setdefault(id(done), (done, []))[1].append(copy)
        for done, copies in waiting.values():
            self._side.join(copies, done)
        return [staged[i][0] if i in staged else self._side.fetch(self._tensors[i], math_dtype(self.params[i].dtype))
                for i in indices]

    def _write(self, targets: Sequence[Tensor], sources: Sequence[Tensor], sources_change: bool = False) -> None:
        """Copy ``sources`` into anchor tensors ``targets`` (their staged copies are stale from now on)."""
        self._staged.clear()
        if self._side is not None:
            self._side.write(targets, sources, sources_change)
            return
        _copy(targets, sources)

    @staticmethod
    def _beside(anchors: Sequence[Tensor], params: Sequence[Tensor]) -> bool:
        """Whether the anchor has the parameters' device and dtype, and that dtype is the one LoRDO computes in:
        then a whole-model operation is one ``foreach`` op."""
        return all(a.device == p.device and a.dtype == p.dtype == math_dtype(p.dtype) for a, p in zip(anchors, params))

    @torch.no_grad()
    def deltas(self, params: Optional[Sequence[Tensor]] = None, indices: Optional[Sequence[int]] = None
               ) -> list[Tensor]:
        """Each worker's pseudo-gradient ``anchor - params`` (old minus new, as DiLoCo), on the parameters'
        device, in float32 (float64 for float64 parameters); ``params``: copies of them to use instead;
        ``indices``: only those parameters' (a bucket)."""
        params = self.params if params is None else list(params)
        indices = range(len(params)) if indices is None else indices
        params = [params[i] for i in indices]
        if self._side is not None:  # one tensor at a time, as below, from the staged copies where there are some
            return [a - p.detach().to(a.dtype) for i, p in zip(indices, params) for a in self._on_device([i])]
        anchors = [self.tensors[i] for i in indices]
        if self._beside(anchors, params):
            return list(torch._foreach_sub(anchors, params))
        out = []
        for a, p in zip(anchors, params):
            dtype = math_dtype(p.dtype)
            out.append(a.to(device=p.device, dtype=dtype, non_blocking=True) - p.detach().to(dtype))
        return out

    @torch.no_grad()
    def set(self, values: Sequence[Tensor], indices: Optional[Sequence[int]] = None) -> None:
        """Anchor and parameters become ``values`` (the new synchronized point); ``indices``: only those
        parameters'."""
        if self._tensors:
            anchors, params = (self._tensors, self.params) if indices is None else \
                ([self._tensors[i] for i in indices], [self.params[i] for i in indices])
            _copy(params, list(values))
            self._write(anchors, list(values))

    @torch.no_grad()
    def new_point(self, indices: Sequence[int], delta: Sequence[Tensor]) -> list[Tensor]:
        """Plain averaging's new synchronized point ``anchor - delta`` at ``indices`` (:func:`averaged_point`, into
        ``delta``); an anchor in host memory is read onto the device first (staged, or copied now)."""
        anchors = self._on_device(indices) if self._side is not None else [self.tensors[i] for i in indices]
        return averaged_point(anchors, delta)

    @torch.no_grad()
    def restore(self) -> None:
        """The parameters go back to the anchor (a discarded round)."""
        _copy(self.params, self.tensors)

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the anchor into the model (validation, checkpoints of the synchronized model) until :meth:`swap_out`:
        O(1) by exchanging storages where dtype and device match, else through a copy of the local replicas kept
        where the anchor is (host memory: the device holds no second model meanwhile)."""
        if all(a.dtype == p.dtype and a.device == p.device for a, p in zip(self.tensors, self.params)):
            self._exchange()
            return
        self._saved = [self._storage(p) for p in self.params]
        _copy(self._saved, self.params)
        self.restore()

    @torch.no_grad()
    def swap_out(self) -> None:
        if self._saved is None:
            self._exchange()
            return
        _copy(self.params, self._saved)
        self._saved = None

    def _exchange(self) -> None:
        for a, p in zip(self.tensors, self.params):  # storages change hands; the tensor objects stay
            local = p.data
            p.data = a.data
            a.data = local

    def state_dict(self) -> list[Tensor]:
        return [a.clone() for a in self.tensors]

    def load_state_dict(self, saved: Sequence[Tensor]) -> None:
        """Restore :meth:`state_dict` (empty: saved in the synchronous phase, no anchor kept there)."""
        if saved and [tuple(a.shape) for a in saved] != [tuple(p.shape) for p in self.params]:
            raise ValueError("the saved anchor does not match the parameters' shapes; resume with the model the "
                             "checkpoint was written for.")
        self.tensors = [self._storage(p).copy_(a) for p, a in zip(self.params, saved)]

    def nbytes(self) -> int:
        return nbytes(self._tensors)  # sizes only: no wait for pending copies


def averaged_point(anchors: Sequence[Tensor], delta: Sequence[Tensor]) -> list[Tensor]:
    """``anchor - delta`` (plain averaging's new synchronized point), computed in place into ``delta``:
    ``delta <- -(delta - anchor)``, which is ``anchor - delta`` bit for bit."""
    delta = list(delta)
    if all(a.device == d.device for a, d in zip(anchors, delta)):
        torch._foreach_sub_(delta, list(anchors))
    else:  # the anchor in host memory: one tensor at a time on the device
        for a, d in zip(anchors, delta):
            d.sub_(a.to(d.device, non_blocking=True))
    torch._foreach_neg_(delta)
    return delta


def _copy(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``targets[i].copy_(sources[i])``: one ``foreach`` op where every pair shares a device, else (the anchor in
    host memory) one asynchronous copy per tensor, and, when CUDA tensors were copied to the host, one wait for the
    stream at the end (the host's readers, e.g. a checkpoint, do not wait for the device themselves)."""
    if all(t.device == s.device for t, s in zip(targets, sources)):
        torch._foreach_copy_(list(targets), list(sources))
        return
    waits = set()
    for t, s in zip(targets, sources):
        to_host = t.device.type == "cpu" and s.device.type != "cpu"
        asynchronous = not to_host or (s.device.type == "cuda" and t.is_pinned())
        t.copy_(s, non_blocking=asynchronous)
        if to_host and asynchronous:
            waits.add(s.device)
    for device in waits:
        torch.cuda.current_stream(device).synchronize()


class OuterStep:
    """``average`` (the new anchor is ``anchor - delta``) or ``nesterov`` (DiLoCo: torch's SGD with Nesterov
    momentum on the anchor, ``lr`` and ``momentum`` from the config)."""

    def __init__(self, kind: str, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self._sgd: Optional[torch.optim.SGD] = None
        self._buffers: list[Tensor] = []  # restored momentum, installed when the SGD is built on the anchor

    def apply(self, anchor: Anchor, delta: Sequence[Tensor]) -> list[Tensor]:
        """The new synchronized point from the averaged ``delta``; the SGD momentum moves (call it at commit).
        Averaging computes it in place, into ``delta`` (the commit's last use of it), so a sync holds no second
        copy of the model: ``delta <- -(delta - anchor)``, which is ``anchor - delta`` bit for bit."""
        if self.kind == "average":
            return averaged_point(anchor.tensors, delta)
        sgd = self._optimizer(anchor)
        for a, d in zip(anchor.tensors, delta):  # a copy: SGD's foreach Nesterov path adds the momentum into grad
            a.grad = d.to(device=a.device, dtype=a.dtype, copy=True)
        sgd.step()
        for a in anchor.tensors:
            a.grad = None
        return [a.to(p.device) for a, p in zip(anchor.tensors, anchor.params)]

    def _optimizer(self, anchor: Anchor) -> torch.optim.SGD:
        if self._sgd is None or self._sgd.param_groups[0]["params"][0] is not anchor.tensors[0]:
            buffers = self._buffers or self.momentum_buffers()
            self._sgd = torch.optim.SGD(anchor.tensors, lr=self.lr, momentum=self.momentum, nesterov=True)
            for a, b in zip(anchor.tensors, buffers):
                self._sgd.state[a]["momentum_buffer"] = b.to(device=a.device, dtype=a.dtype)
            self._buffers = []
        return self._sgd

    def momentum_buffers(self) -> list[Tensor]:
        """The outer momentum, one tensor per parameter (empty before the first Nesterov step)."""
        if self._sgd is None:
            return list(self._buffers)
        state = self._sgd.state
        return [state[a]["momentum_buffer"] for a in self._sgd.param_groups[0]["params"]
                if "momentum_buffer" in state.get(a, {})]

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": [b.clone() for b in self.momentum_buffers()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (installed in the SGD when it is built on the anchor)."""
        self._sgd = None
        self._buffers = [b.clone() for b in state["momentum"]]
