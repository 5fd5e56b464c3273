import os

import pytest


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """`mmldlm check` reads the machine's load average; on a test machine shared with other jobs that
    would change what a test of another rule sees. Every test sees an idle machine; tests of the load
    give it explicitly (Environment.load, `check --load`)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
