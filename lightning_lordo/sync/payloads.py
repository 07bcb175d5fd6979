"""How each parameter's pseudo-gradient travels at a sync (SPEC §5), and the per-worker state of those messages.

The parameters fall into up to three groups, each reduced by its own message, in this order (identical on every
worker):

1. ``lowrank``: the low-rank matrices of the LoRDO optimizer, by :class:`~lightning_lordo.comm.lowrank.LowRankPayload`
   (``payload="lowrank"``) or, with ``payload="full"``, by a
   :class:`~lightning_lordo.comm.quantization.QuantizedAverager`; with ``payload="lowrank"``, a matrix whose rank-r
   message would not be smaller than itself (``r (a + b) >= a b``, e.g. 16 x 24 at rank 16) travels in full instead,
   by a ``QuantizedAverager`` of its own (``lowrank_in_full``), as PowerSGD's minimum compression rate does;
2. ``fullrank_matrices`` (``fullrank_rank > 0``): the other 2-D parameters (embeddings, output heads) for which a
   rank-r message is smaller (``r (a + b) < a b``), by a ``LowRankPayload`` of rank ``fullrank_rank``. They keep
   their AdamW step and moments; only the message is compressed, with its own error feedback;
3. ``fullrank``: everything else (norms, biases, small matrices), by a ``QuantizedAverager``.

Every message counts its bytes under ``pseudo_gradients:lowrank`` (group 1) or ``pseudo_gradients:fullrank``
(groups 2 and 3), the parts of the monitor's per-sync breakdown. A message is all-reduced (or all-gathered /
reduce-scattered for int8) as :func:`~lightning_lordo.comm.quantization.quantized_mean` says. int8 messages that
are all-gathered (2 workers, ``"auto"``) travel joined, as
:func:`~lightning_lordo.comm.quantization.quantized_means` joins them: every low-rank payload's P message and the
messages sent in full in one collective, then every B message in another (two collectives a sync, not five; each
row coded as in its own message, each part's bytes counted under its own purpose).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_lordo._tensors import finite_flags, mix_seed, norm_list, norms
from lightning_lordo.comm.communicator import Communicator
from lightning_lordo.comm.lowrank import LowRankPayload
from lightning_lordo.comm.lowrank_phases import Source
from lightning_lordo.comm.quantization import QuantizedAverager, quantized_means, resolve_reduction
from lightning_lordo.config import SyncConfig

#: A streamed round's pseudo-gradients (:meth:`PseudoGradientPayloads.reduce`): ``(the parameters, source(positions),
#: a bucket's bytes)``.
Stream = tuple[Sequence[Tensor], Source, float]

LOWRANK_PART = "pseudo_gradients:lowrank"
FULLRANK_PART = "pseudo_gradients:fullrank"


def compressible(shape: Sequence[int], rank: int) -> bool:
    """Whether a rank-``rank`` message of a matrix shaped ``shape`` is smaller than the matrix itself."""
    return len(shape) == 2 and rank > 0 and rank * (shape[0] + shape[1]) < shape[0] * shape[1]


class PseudoGradientPayloads:
    """The messages of a sync's pseudo-gradients (module docstring).

    Args:
        params: the trainable parameters, in the synchronizer's order.
        lowrank_ranks: the LoRDO optimizer's low-rank matrices and their ranks (``None``: no LoRDO optimizer).
        config: the synchronization knobs (``payload``, ``payload_dtype``, ``fullrank_rank``, ``seed``).
        batched: the low-rank messages work on stacks of same-shape matrices (the optimizer's stacked layout).
    """

    def __init__(self, params: Sequence[Tensor], lowrank_ranks: Optional[dict[Tensor, int]],
                 config: SyncConfig, batched: bool = False) -> None:
        ranks = lowrank_ranks or {}
        if config.payload == "lowrank" and lowrank_ranks is None:
            raise ValueError("payload='lowrank' needs the LoRDO optimizer (strategy 'lordo' or 'lordo_local'); "
                             "with 'diloco' use payload='full' (payload_dtype may still be bfloat16 or int8, and "
                             "fullrank_rank compresses the 2-D parameters).")
        lowrank = [i for i, p in enumerate(params) if p in ranks]
        # the low-rank payload's guard, as the full-rank matrices': a matrix its rank does not compress travels in full
        sent_in_full = [i for i in lowrank if config.payload == "lowrank" and not compressible(params[i].shape,
                                                                                              ranks[params[i]])]
        lowrank = [i for i in lowrank if i not in set(sent_in_full)]
        matrices = [i for i, p in enumerate(params)
                    if p not in ranks and compressible(p.shape, config.fullrank_rank)]
        rest = [i for i in range(len(params)) if i not in set(lowrank) | set(sent_in_full) | set(matrices)]
        dtype = self.payload_dtype = config.payload_dtype
        #: ``(name, positions, message, purpose)`` per group that has parameters, in reduction order
        self.groups: list[tuple[str, list[int], Any, str]] = []
        if lowrank:
            message: Any = (LowRankPayload([ranks[params[i]] for i in lowrank], seed=config.seed, payload_dtype=dtype,
                                          batched=batched)
                            if config.payload == "lowrank" else QuantizedAverager(dtype))
            self.groups.append(("lowrank", lowrank, message, LOWRANK_PART))
        if sent_in_full:
            self.groups.append(("lowrank_in_full", sent_in_full, QuantizedAverager(dtype), LOWRANK_PART))
        if matrices:
            seed = mix_seed(config.seed, 0, offset=32_452_843)  # not the low-rank payload's right factors
            message = LowRankPayload([config.fullrank_rank] * len(matrices), seed=seed, payload_dtype=dtype,
                                     batched=batched)
            self.groups.append(("fullrank_matrices", matrices, message, FULLRANK_PART))
        self.groups.append(("fullrank", rest, QuantizedAverager(dtype), FULLRANK_PART))
        self.size = len(params)

    @property
    def lowrank_payload(self) -> Optional[LowRankPayload]:
        """The low-rank matrices' ``LowRankPayload`` (``payload="lowrank"``), else ``None``."""
        found = [m for name, _, m, _ in self.groups if name == "lowrank" and isinstance(m, LowRankPayload)]
        return found[0] if found else None

    @property
    def compressed(self) -> bool:
        """Whether any message is compressed (low-rank or reduced precision): then it keeps error feedback."""
        return any(isinstance(m, LowRankPayload) or m.payload_dtype != "float32" for _, _, m, _ in self.groups)

    def reduce(self, comm: Communicator, local: list[Optional[Tensor]], in_place: bool = False,
               stream: Optional[Stream] = None
               ) -> tuple[list[Optional[Tensor]], list[tuple[Any, Any]], Optional[Tensor]]:
        """The averaged pseudo-gradients (float32; float64 parameters' full-precision ones stay float64), the
        rounds to commit if the whole sync succeeds, and whether every message's averages are finite (a 0-d bool
        tensor, not read; ``None`` without messages). Changes nothing here. A non-finite round (NaN/Inf on any
        worker, so on every worker alike) has non-finite averages or a false flag. ``in_place``: ``local`` are
        temporaries that nothing reads afterwards: the messages sent in full may average them where they are, and
        ``local`` is emptied of the others as soon as their low-rank messages are made (each keeps its own sum with
        the error feedback), so a compressed sync does not also hold the pseudo-gradients.

        ``stream``: ``(the parameters, source, cap_bytes)``: the low-rank messages are streamed
        (:meth:`LowRankPayload.phases`; ``source(positions)`` makes those parameters' pseudo-gradients again, a bucket
        at a time). ``local`` then needs only the other groups' (``None`` elsewhere), and their averages are ``None``:
        their rounds' :meth:`~lightning_lordo.comm.lowrank.LowRankPhases.commit_bucket` makes them at the commit."""
        active = [(positions, message, purpose) for _, positions, message, purpose in self.groups if positions]
        dtypes = [t.dtype if t is not None else None for t in local]
        inputs: list[Any] = []  # per group: its phases (a low-rank message), else its tensors
        params, source, cap = stream if stream is not None else ([], None, None)
        for positions, message, _ in active:
            if not isinstance(message, LowRankPayload):
                inputs.append([local[i] for i in positions])
                continue
            if stream is None:
                inputs.append(message.phases([local[i] for i in positions]))
            else:
                inputs.append(message.phases(like=[params[i] for i in positions], cap_bytes=cap,
                                             source=lambda idx, at=positions: source([at[j] for j in idx])))
            if in_place or stream is not None:  # each keeps its own sum with the error feedback
                for i in positions:
                    local[i] = None
        joint: Optional[Tensor] = None
        if self.payload_dtype == "int8" and resolve_reduction("int8", "auto", comm.world_size) == "all_gather":
            results, joint = _reduce_together(comm, [(x, m, purpose) for x, (_, m, purpose) in zip(inputs, active)])
        else:  # each message by itself (a float payload may average in place; the int8 reduce-scatter's blocks)
            results = [message.run(comm, x, purpose) if isinstance(message, LowRankPayload)
                       else message.reduce(comm, x, purpose, in_place=in_place)
                       for x, (_, message, purpose) in zip(inputs, active)]
        averaged: list[Optional[Tensor]] = list(local)
        rounds: list[tuple[Any, Any]] = []
        flags = []
        for (positions, message, _), result in zip(active, results):
            rounds.append((message, result))
            flags.append(result.finite)
            if getattr(result, "streamed", None) is not None:
                continue
            for n, i in enumerate(positions):
                averaged[i] = result.averaged[n].to(dtypes[i]) if isinstance(message, QuantizedAverager) \
                    else result.averaged[n]
        finite = joint if joint is not None else torch.stack(flags).all() if flags else None
        return averaged, rounds, finite

    def norms(self, averaged: Sequence[Optional[Tensor]], rounds: Sequence[tuple[Any, Any]]) -> Tensor:
        """Each parameter's averaged pseudo-gradient's norm, stacked in the parameters' order (not read): a low-rank
        message's from its round (``|Q B| = |B|``, so that a streamed round need not make ``Q B`` for it), the
        others' from ``averaged``."""
        found: list[Optional[Tensor]] = [None] * self.size
        positions = {id(message): at for _, at, message, _ in self.groups}
        for message, result in rounds:
            if isinstance(message, LowRankPayload):
                for i, n in zip(positions[id(message)], result.norms, strict=True):
                    found[i] = n
        rest = [i for i, n in enumerate(found) if n is None]
        for i, n in zip(rest, norm_list([averaged[i] for i in rest])):  # type: ignore[misc]
            found[i] = n
        first = found[0].device  # type: ignore[union-attr]
        return torch.stack([n.to(first) for n in found])  # type: ignore[union-attr]

    def spans(self, params: Sequence[Tensor], rounds: Sequence[tuple[Any, Any]]) -> dict[Tensor, Tensor]:
        """``{param: Q}``: the new bases of the low-rank matrices that the ``lowrank`` payload sent, each an
        orthonormal basis of the column space of its averaged update ``Q B`` (SPEC §5), identical on every worker
        (:meth:`~lightning_lordo.optim.lordo.LoRDO.compute_bases`' ``spans``)."""
        lowrank = self.lowrank_payload
        at = next((at for name, at, message, _ in self.groups if message is lowrank), [])
        result = next((r for message, r in rounds if message is lowrank), None)
        return {} if result is None else {params[i]: q for i, q in zip(at, result.bases, strict=True)}

    @staticmethod
    def resolve(rounds: Sequence[tuple[Any, Any]], finite: bool) -> None:
        """Record the round's finiteness, read once by the synchronizer, on each message's round (their commits
        then read nothing)."""
        for _, result in rounds:
            result.finite = finite

    def error_norm(self) -> float:
        """Norm of this worker's sync-level error feedback (SPEC §5), over every message."""
        return float(self.error_norm_tensor())

    def error_norm_tensor(self) -> Tensor:
        """:meth:`error_norm` as a 0-d tensor where the buffers are, not read."""
        errors = [e for _, _, m, _ in self.groups for e in m.error_tensors()]
        return torch.linalg.vector_norm(norms(errors)) if errors else torch.zeros(())  # none: nothing compressed yet

    def state_dict(self) -> dict[str, Any]:
        """Per worker, for checkpoints: ``{"averager": the last group's, "lowrank": ..., "lowrank_averager": ...,
        "fullrank_matrices": ...}`` (each group that exists)."""
        return {_key(name, message): message.state_dict() for name, _, message, _ in self.groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; also one saved before the low-rank matrices of a ``full`` payload had their
        own message (one averager's error feedback for every parameter, split here by position).

        Raises:
            ValueError: the saved state does not fit these groups.
        """
        state = dict(state)
        names = [name for name, *_ in self.groups]
        old_full = ("lowrank_averager" not in state and "lowrank" in names and self.lowrank_payload is None
                    and len(state["averager"]["errors"]) == self.size)
        if old_full:  # one averager over every parameter, in parameter order
            errors = state["averager"]["errors"]
            for name, positions, message, _ in self.groups:
                state[_key(name, message)] = {"errors": [errors[i] for i in positions]}
        groups = {name: positions for name, positions, *_ in self.groups}
        if "lowrank_in_full" in groups and "lowrank_in_full" not in state and "lowrank" in state:
            # saved before a matrix its rank does not compress travelled in full: the low-rank payload's state then
            # covered it too (positions in parameter order); its own sync-level error feedback restarts from zero
            saved = sorted(groups["lowrank"] + groups["lowrank_in_full"])
            if len(state["lowrank"]["right"]) == len(saved):
                keep = [saved.index(i) for i in groups["lowrank"]]
                state["lowrank"] = {k: [v[j] for j in keep] if v else v for k, v in state["lowrank"].items()}
        for name, _, message, _ in self.groups:
            if _key(name, message) in state:
                message.load_state_dict(state[_key(name, message)])

    def memory_report(self) -> dict[str, int]:
        """Bytes of the messages' state (error feedback, right factors), summed by kind."""
        report: dict[str, int] = {}
        for _, _, message, _ in self.groups:
            for kind, nbytes in message.memory_report().items():
                report[kind] = report.get(kind, 0) + nbytes
        return report


def _reduce_together(comm: Communicator, groups: list[tuple[Any, Any, str]]) -> tuple[list[Any], Optional[Tensor]]:
    """Every group's round, its int8 all-gathered messages joined (:func:`quantized_means`): the P messages of the
    low-rank payloads with the averagers' messages in one collective, then the B messages in another, each part
    counted under its group's purpose; and whether every average is finite (one check for all: each round's flag).
    Every value is the one the groups' own rounds give. A group is ``(its phases or tensors, message, purpose)``."""
    states = [x if isinstance(message, LowRankPayload) else message.message(x) for x, message, _ in groups]
    firsts = quantized_means(comm, [(s.message if isinstance(m, LowRankPayload) else s, purpose)
                                    for s, (_, m, purpose) in zip(states, groups)], "int8")
    lowrank = [n for n, (_, m, _) in enumerate(groups) if isinstance(m, LowRankPayload)]
    for n in lowrank:
        states[n].take_p(firsts[n], check=False)
    seconds = dict(zip(lowrank, quantized_means(comm, [(states[n].message, groups[n][2]) for n in lowrank], "int8")))
    means = [m for r in [*firsts, *seconds.values()] for m in r.means]
    finite = finite_flags(means).all() if means else None
    return [states[n].finish(seconds[n], finite) if n in seconds else m.finish(states[n], firsts[n], finite)
            for n, (_, m, _) in enumerate(groups)], finite


def _key(name: str, message: Any) -> str:
    """A group's key in :meth:`PseudoGradientPayloads.state_dict` (``averager`` and ``lowrank`` as saved before)."""
    if name == "lowrank" and isinstance(message, QuantizedAverager):
        return "lowrank_averager"
    return "averager" if name == "fullrank" else name
