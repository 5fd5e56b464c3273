import multiprocessing
import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """In-process tests run torch on one thread, as the subprocesses they start do (OMP_NUM_THREADS=1):
    their tiny ops gain nothing from a second thread, and on a 2-core machine shared with other jobs
    two threads ran them 4-6x slower (docs/testing.md). Tests of the thread setting set their own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread_each_test():
    """A run started in-process with `threads: auto` sets torch's threads for the whole process, also
    from a module's fixture that trains once for its tests: each test starts on one thread, as the
    session does, and the next one again."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def no_child_outlives_the_session():
    """A failed test can leave a loader's workers running (its frames, kept for the report, hold the
    loader). They ignore SIGTERM, so multiprocessing's exit handler would wait for them forever: the
    run would hang after its report instead of ending with its failures. What is left is killed."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """`mmldlm check` reads the machine's load average; on a test machine shared with other jobs that
    would change what a test of another rule sees. Every test sees an idle machine; tests of the load
    give it explicitly (Environment.load, `check --load`)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
