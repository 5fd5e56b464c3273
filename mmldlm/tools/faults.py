"""Faults written into a real run's metrics records the way the trainer would have logged them, to
measure what `mmldlm monitor` catches, how soon, and what it says on the healthy original.

Each fault returns new records (the input is left as it is) with the fault in the records whose
step lies in [first_step, first_step + num_steps):

- `slowdown`: each step's compute takes 1 / (1 - drop) as long, so samples/s and tokens/s fall by
  `drop`; the loader's wait stays what it was, in seconds, and so do the CPU time the process got and
  the load average: a slowdown of the run itself (thermal throttling, a slower kernel), not of a busy
  machine.
- `loader_stall`: the loader makes each step wait `seconds` more: step time and data-wait share rise.
- `leak`: memory grows by `mib_per_step` MiB with every step (num_steps: until the end).
- `nonfinite`: the first record's loss and gradient norm are NaN and its update was skipped.
"""

from __future__ import annotations

import copy
import math

from mmldlm.tools.health import MEMORY_KEYS, Alert, HealthConfig
from mmldlm.tools.monitor import RunHistory


def _affected(records: list[dict], first_step: int, num_steps: int | None):
    out = copy.deepcopy(records)
    end = math.inf if num_steps is None else first_step + num_steps
    return out, [r for r in out if first_step <= r["step"] < end and "loss" in r]


def _retime(record: dict, step_time: float, wait: float) -> None:
    """A record with a new step time and data wait (seconds): the rates and share that follow."""
    old = record["step_time_s"]
    record["samples_per_s"] *= old / step_time
    record["tokens_per_s"] *= old / step_time
    record["step_time_s"] = step_time
    record["data_wait_share"] = wait / step_time


def slowdown(records: list[dict], first_step: int, num_steps: int, drop: float) -> list[dict]:
    out, hit = _affected(records, first_step, num_steps)
    for r in hit:
        wait = r["step_time_s"] * r["data_wait_share"]
        _retime(r, wait + (r["step_time_s"] - wait) / (1 - drop), wait)
    return out


def loader_stall(records: list[dict], first_step: int, num_steps: int, seconds: float) -> list[dict]:
    out, hit = _affected(records, first_step, num_steps)
    for r in hit:
        wait = r["step_time_s"] * r["data_wait_share"] + seconds
        _retime(r, r["step_time_s"] + seconds, wait)
    return out


def leak(records: list[dict], first_step: int, mib_per_step: float) -> list[dict]:
    out, hit = _affected(records, first_step, None)
    for r in hit:
        key = next(k for k in MEMORY_KEYS if k in r)
        r[key] += (r["step"] - first_step + 1) * mib_per_step / 1024
    return out


def nonfinite(records: list[dict], first_step: int) -> list[dict]:
    out, hit = _affected(records, first_step, None)
    hit[0].update(loss=math.nan, grad_norm=math.nan, skipped=True)
    for r in hit:
        r["num_skipped"] = r.get("num_skipped", 0) + 1
    return out


def alerts_of(records: list[dict], health: HealthConfig | None = None) -> list[Alert]:
    """The alerts `mmldlm monitor` raises over `records` (a whole metrics file, evaluations included)."""
    history = RunHistory(health or HealthConfig())
    history.extend(records)
    return history.alerts
