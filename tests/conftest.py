"""Shared test setup."""

import os
import signal

# A suite started in the background of a non-interactive shell inherits SIGINT ignored, and so would every worker it
# starts: the Ctrl-C tests need Python's handler, which a child process gets back at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Before torch loads its OpenMP runtime: one thread, so no thread team ever exists in this process. A worker
# forked from a process whose OpenMP team has run deadlocks in its first parallel op (seen as both forked
# workers idle in ``Linear.forward``, after earlier tests had run ops on two threads in this process).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread per process: two forked workers on a 2-core machine must not oversubscribe it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _launcher_environment():
    """Each test ends with the environment it found. Lightning's and Fabric's launchers write ``MASTER_PORT``,
    ``WORLD_SIZE``, ``LOCAL_RANK``... into this process's environment, and a later fit would reuse that port: with two
    tests at a time (pytest-xdist), the other worker may have taken it since."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A 1-device fit runs in this process and leaves its process group behind (Lightning destroys it at exit);
    forked workers of a later test would inherit it and skip their own initialization."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
