"""Log lines of libraries we import that say nothing a user can act on, kept out of the output by logger
and message; every other record of those loggers passes.

When torchao is installed, sentence-transformers (through transformers) imports it, and so does the
low-bit AdamW. Its import then logs, at warning level:
- "Failed to load .../torchao/_C_*.so: ..." for each compiled extension this build cannot load (CUDA
  kernels for another Python or GPU), from the "torchao" logger;
- "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile ...
  Calling register_constant() on Enum subclasses is deprecated", from torch's "torch.utils._pytree"
  logger, for torchao's own enums.
`quiet_library_noise()` runs before those imports (mmldlm/data/encoders.py, mmldlm/training/optim.py).

transformers also draws a "Loading weights: 100%|...|103/103" bar on stderr each time it loads a model,
whatever the command's own --quiet; `quiet_loading_bars()` turns its bars off where the sentence encoder
is loaded (mmldlm/data/encoders.py). Nothing is downloaded, so no download bar is lost.
"""

from __future__ import annotations

import logging

ENUM_DEPRECATION = "%s is an Enum subclass and is now natively supported by torch.compile"


def is_library_noise(record: logging.LogRecord) -> bool:
    """Whether `record` is one of the lines of the module docstring."""
    if record.name == "torchao":
        message = record.getMessage()
        return message.startswith("Failed to load ") and "/torchao/_C" in message
    if record.name == "torch.utils._pytree" and str(record.msg).startswith(ENUM_DEPRECATION) and record.args:
        return getattr(record.args[0], "__module__", "").startswith("torchao")
    return False


def _keep(record: logging.LogRecord) -> bool:
    return not is_library_noise(record)


def quiet_library_noise() -> None:
    """Filter the lines of the module docstring out of their loggers (once per process)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _keep not in logger.filters:
            logger.addFilter(_keep)


def quiet_loading_bars() -> None:
    """Turn off the progress bars of transformers (and of huggingface_hub, which it switches with them)."""
    # Here, not at the top: transformers takes seconds to import, and only loading the encoder needs it.
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
