"""Imports of libraries that, on a CPU-only machine, log what they cannot use there.

torchao (imported by the sentence encoder's libraries and by the low-bit optimizer) logs, at warning
level, each CUDA extension a CPU build cannot load, and its registrations make torch log a deprecation
about Enum constants. Neither is about the user's run, and a user reads them as errors. `quiet_imports`
raises those two loggers to ERROR while such a library loads: a warning they log afterwards,
while the run works, is shown as usual.
"""

from __future__ import annotations

import contextlib
import logging

NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports():
    loggers = [logging.getLogger(name) for name in NOISY_AT_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
