"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread per process: two forked workers on a 2-core machine must not oversubscribe it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A 1-device fit runs in this process and leaves its process group behind (Lightning destroys it at exit);
    forked workers of a later test would inherit it and skip their own initialization."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
