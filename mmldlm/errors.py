"""The errors a user can fix. `mmldlm CMD` prints one of them as a single line `mmldlm CMD: message`
and exits 2; `mmldlm --debug CMD` (or MMLDLM_DEBUG=1) shows the traceback too. Any other exception
is a bug and keeps its traceback. Free of heavy imports, so that the CLI can catch these without
importing torch."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any


class UserError(ValueError):
    """Input that cannot be used; the message names the file, key or option at fault, the value
    and what was expected."""


class OptionError(UserError):
    """One option with a value that cannot be used: a config key, a command-line option or a
    threshold. Every such message has one shape: `<key>: got <value>; expected <what is allowed>`."""

    def __init__(self, key: str, value: Any, expected: str):
        super().__init__(f"{key}: got {value!r}; expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def require_positive(options: dict[str, int | None]) -> None:
    """OptionError for the first of `options` (name -> value; None: not given) that is below 1."""
    for key, value in options.items():
        if value is not None and value < 1:
            raise OptionError(key, value, "an integer >= 1")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while a command runs: `mmldlm CMD` raises it from both signals and ends with one
    line, `mmldlm CMD: stopped by SIGINT; <what is kept, how to continue>`, and exit status 128 + the
    signal's number, as `train` does. A KeyboardInterrupt, so that code where Ctrl-C ends a loop
    (`monitor` following a run) goes on as before. Code that keeps its work for a rerun says so in `kept`
    on the way up, instead of a line of its own."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.kept: str | None = None  # None: nothing was written


@contextlib.contextmanager
def signals_raise(exception: Callable[[int], BaseException]):
    """While the block runs, SIGINT and SIGTERM raise `exception(signum)`; the handlers before it come back
    after. Where signals cannot be set (a thread other than the main one), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise exception(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
