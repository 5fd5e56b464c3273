"""torch's CPU threads fitted to what else runs on the machine (`threads: auto`).

On two cores, two torch threads beside one other busy process wait for each other at every parallel
region: a training step ran about 25 times slower than on one thread. On an idle machine two threads
are about twice as fast as one. So `auto` reads, from /proc/stat, how busy this process's CPUs were
and takes off what this process itself used (`time.process_time`, all its threads): what remains is
other processes' work (its loader workers' too), and torch gets the CPUs they leave free, at least
one. The trainer reads it again every `interval` seconds of its loop, so a run started beside a job
that then ends comes back to every core, and one joined by a job steps aside.

Where /proc/stat is missing (not Linux) or OMP_NUM_THREADS is set (torchrun sets it for several
processes per node), torch's own setting is left as it is.
"""

from __future__ import annotations

import os
import time

import torch

from mmldlm.errors import OptionError


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds the given CPUs spent busy since boot (all processes), or None without /proc/stat."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def threads_for(free_cpus: float, cpus: int) -> int:
    """torch threads for `free_cpus` of `cpus` left free by other processes: rounded, at least one."""
    return max(1, min(cpus, round(free_cpus)))


class AutoThreads:
    """Keeps torch's intra-op threads at the CPUs other processes leave free (the module docstring).
    `cpus`: this process's share of the machine (several processes on one node share it)."""

    def __init__(self, interval: float = 5.0, cpus: int | None = None, log=None):
        self.cpu_ids = _cpus()
        self.cpus = cpus or len(self.cpu_ids)
        self.interval, self.log = interval, log
        self.enabled = "OMP_NUM_THREADS" not in os.environ and _busy_seconds(self.cpu_ids) is not None
        self._mark = self._reading()

    def _reading(self) -> tuple[float, float, float]:
        return time.perf_counter(), _busy_seconds(self.cpu_ids) or 0.0, time.process_time()

    def others_busy(self) -> float:
        """CPUs other processes kept busy since the last reading (and take a new reading)."""
        before, self._mark = self._mark, self._reading()
        wall = self._mark[0] - before[0]
        others = (self._mark[1] - before[1]) - (self._mark[2] - before[2])
        return max(0.0, others / wall) if wall > 0 else 0.0

    def start(self, settle: float = 0.5) -> int:
        """Set the threads from `settle` seconds of watching the machine; returns the count."""
        if not self.enabled:
            return torch.get_num_threads()
        time.sleep(settle)
        return self._set(self.others_busy())

    def follow(self) -> None:
        """Called in a loop: every `interval` seconds, the threads set anew for the last interval."""
        if self.enabled and time.perf_counter() - self._mark[0] >= self.interval:
            self._set(self.others_busy())

    def _set(self, others: float) -> int:
        threads = threads_for(len(self.cpu_ids) - others, self.cpus)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            if self.log is not None:
                self.log(f"threads: {threads} (other processes kept {others:.1f} of {len(self.cpu_ids)} CPUs busy)")
        return threads


def set_threads(
    threads: int | str | None, log=None, cpus: int | None = None, deterministic: bool = False
) -> AutoThreads | None:
    """Apply a `threads` setting: an int, None (torch's default, left alone) or "auto" (returns the
    AutoThreads for the caller's loop to `follow`). A `deterministic` run keeps torch's count under
    "auto": sums over another number of threads differ in their last bits, so a count that followed the
    machine would make a resumed run differ from the straight one."""
    if threads is None:
        return None
    if threads == "auto" and deterministic:
        if log is not None:
            log(f"threads: {torch.get_num_threads()}, fixed under train.deterministic (auto follows the machine)")
        return None
    if threads == "auto":
        auto = AutoThreads(cpus=cpus, log=log)
        auto.start()
        return auto
    torch.set_num_threads(int(threads))
    return None


def parse_threads(value: str | int | None, option: str = "--threads") -> int | str | None:
    """A threads option's value: "auto", 0 (torch's default: None) or a positive integer; a value parsed
    already comes back as it is."""
    if value is None or value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < 0:
        allowed = "auto (the CPUs other processes leave free), 0 (torch's default) or an integer >= 1"
        raise OptionError(option, value if number is None else number, allowed)
    return number or None
