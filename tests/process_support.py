"""Waiting on a child process in the tests with a bound: a child that hangs fails the test loudly
instead of hanging the suite."""

import select
import subprocess


def first_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The first line `proc` writes to its stdout pipe (opened with text=True), stripped; waits
    `timeout` seconds at most."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"{proc.args[:3]}: no line on stdout within {timeout} s"
    return proc.stdout.readline().strip()
