"""Progress of the long commands (`eval`, `sample`) and of the API's batch calls (MMLDLM.encode, decode,
generate): tqdm bars with an ETA on stderr, where a person is watching.

    with reporting("auto"):                  # True, False, or "auto": only when stderr is a terminal
        note("mmldlm eval: loading runs/x")  # one line: what starts now
        with stage("l2t", total=256):        # a bar over 256 samples while the block runs
            for batch in ...:
                with share(len(batch), num_steps):   # one sampler call: its rows, in num_steps parts
                    for ...: step()                    # one reverse step done

A sampler call advances the bar by its rows in equal parts, one per reverse step, and by whatever is
left when it returns: a batch of best-of-16 decoding runs for minutes, and its bar moves all along.
Outside `reporting` (and inside `reporting(False)`) every function does nothing, so the library
prints nothing of its own: evaluation during training and tests stay quiet. The state is held in
context variables, so the sampler's loops tick the bar of whoever called them without a bar being
passed through every function between.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar

from tqdm import tqdm

from mmldlm.errors import OptionError

_shown: ContextVar[bool] = ContextVar("progress shown", default=False)
_bar: ContextVar[tqdm | None] = ContextVar("progress bar", default=None)
_share: ContextVar[dict | None] = ContextVar("progress share of one sampler call", default=None)

# Fractions of a sample move the bar during a batch; the count shows whole samples.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}]"


def shows(progress: bool | str, stream=None) -> bool:
    """Whether bars are drawn: `progress` True or False, or "auto": when `stream` (default stderr) is
    a terminal. OptionError for anything else."""
    if progress == "auto":
        stream = sys.stderr if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        return bool(isatty is not None and isatty())
    if isinstance(progress, bool):
        return progress
    raise OptionError("progress", progress, 'True, False or "auto" (bars only when stderr is a terminal)')


@contextlib.contextmanager
def reporting(progress: bool | str = "auto"):
    """Bars and notes inside this block where `shows(progress)`."""
    token = _shown.set(shows(progress))
    try:
        yield
    finally:
        _shown.reset(token)


def note(text: str) -> None:
    """One line on stderr (between bars, not through one), inside a `reporting` that shows."""
    if _shown.get():
        tqdm.write(text, file=sys.stderr)


@contextlib.contextmanager
def stage(desc: str, total: float, unit: str = "samples"):
    """A bar named `desc` over `total` units for the duration of the block (yielded; None where nothing
    shows), inside a `reporting` that shows; the bar of an enclosing stage waits meanwhile."""
    if not _shown.get():
        yield None
        return
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, bar_format=BAR_FORMAT)
    token = _bar.set(bar)
    try:
        yield bar
    finally:
        _bar.reset(token)
        bar.close()


def advance(amount: float) -> None:
    """Move the current stage's bar by `amount` units (no-op without one)."""
    bar = _bar.get()
    if bar is not None:
        bar.update(amount)


@contextlib.contextmanager
def share(amount: float, num_steps: int):
    """One call of `num_steps` steps worth `amount` units of the current bar: each `step()` adds
    amount / num_steps, the end adds what is left (never more than `amount` in all)."""
    if _bar.get() is None:
        yield
        return
    state = {"per_step": amount / max(num_steps, 1), "left": float(amount)}
    token = _share.set(state)
    try:
        yield
    finally:
        _share.reset(token)
        advance(state["left"])


def step() -> None:
    """One step of the current `share` done (no-op outside one)."""
    state = _share.get()
    if state is None:
        return
    amount = min(state["per_step"], state["left"])
    state["left"] -= amount
    advance(amount)
