r"""Wire bytes: what one worker puts on the network for a collective, from the collective's algorithm.

The :class:`~lightning_lordo.comm.communicator.CommAccountant` keeps two figures per purpose. *Payload bytes* are
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
