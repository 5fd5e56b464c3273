"""threads: auto gives torch the CPUs other processes leave free, and follows them as a run goes."""

import pytest
import torch

from mmldlm import threads as threads_module
from mmldlm.errors import OptionError
from mmldlm.threads import AutoThreads, parse_threads, set_threads, threads_for


class Machine:
    """A 2-CPU machine's clocks: wall seconds, every process's busy CPU seconds, this process's own."""

    def __init__(self, monkeypatch):
        self.wall = self.busy = self.own = 0.0
        monkeypatch.setattr(threads_module, "_cpus", lambda: [0, 1])
        monkeypatch.setattr(threads_module, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(threads_module.time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(threads_module.time, "process_time", lambda: self.own)
        monkeypatch.setattr(threads_module.time, "sleep", self.run)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        self.others = 0.0  # CPUs other processes keep busy
        self.mine = 1.0  # CPUs this process keeps busy

    def run(self, seconds: float) -> None:
        self.wall += seconds
        self.own += self.mine * seconds
        self.busy += (self.mine + self.others) * seconds


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_takes_every_cpu_of_an_idle_machine_and_one_beside_a_busy_process(monkeypatch, restore_threads):
    machine = Machine(monkeypatch)
    torch.set_num_threads(1)  # a change is what is logged: start from one thread whatever the machine's default
    lines = []
    assert AutoThreads(log=lines.append).start() == 2 and torch.get_num_threads() == 2
    machine.others = 1.0  # another job keeps a core busy
    assert AutoThreads(log=lines.append).start() == 1 and torch.get_num_threads() == 1
    assert lines == [
        "threads: 2 (other processes kept 0.0 of 2 CPUs busy)",
        "threads: 1 (other processes kept 1.0 of 2 CPUs busy)",
    ]


def test_a_run_follows_the_machine_every_interval_and_not_between(monkeypatch, restore_threads):
    """Started beside a busy job: one thread; the job ends: both CPUs at the next reading, not before."""
    machine = Machine(monkeypatch)
    machine.others = 0.9
    auto = AutoThreads(interval=5.0)
    assert auto.start() == 1
    machine.others, machine.mine = 0.0, 1.0
    machine.run(4.0)
    auto.follow()
    assert torch.get_num_threads() == 1  # within the interval: no reading
    machine.run(1.0)
    auto.follow()
    assert torch.get_num_threads() == 2
    machine.others, machine.mine = 1.0, 1.2  # a job joins: this process gets less than its two threads ask
    machine.run(5.0)
    auto.follow()
    assert torch.get_num_threads() == 1


def test_auto_leaves_torch_alone_where_omp_num_threads_is_set(monkeypatch, restore_threads):
    Machine(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert AutoThreads().start() == 3 and torch.get_num_threads() == 3


def test_a_deterministic_run_keeps_torchs_count_under_auto(monkeypatch, restore_threads):
    """Another thread count sums in another order: a resumed run would not repeat the straight one."""
    machine = Machine(monkeypatch)
    torch.set_num_threads(1)
    lines = []
    assert set_threads("auto", log=lines.append, deterministic=True) is None  # nothing for the loop to follow
    assert torch.get_num_threads() == 1 and machine.wall == 0.0  # the idle machine was not even read
    assert lines == ["threads: 1, fixed under train.deterministic (auto follows the machine)"]
    assert set_threads("auto", deterministic=False).start() == 2


def test_threads_are_the_free_cpus_rounded_at_least_one_at_most_the_share():
    assert threads_for(2.0, 2) == 2 and threads_for(1.2, 2) == 1 and threads_for(0.2, 2) == 1
    assert threads_for(7.6, 4) == 4  # a process's share of a node with several processes
    assert parse_threads("auto") == "auto" and parse_threads("0") is None and parse_threads("3") == 3
    with pytest.raises(OptionError, match="--threads.*got 'many'.*auto"):
        parse_threads("many")
