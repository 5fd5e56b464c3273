"""checkpoint.every_minutes: a save once that much wall clock has passed since the last one, on a step
every rank agrees on (rank 0's clock decides), read only on every CLOCK_CHECK_STEPS-th step."""

import datetime

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ema import make_trainer

import mmldlm.training.checkpoint as ckpt
from mmldlm.config import CheckpointConfig, ConfigError, load_config
from mmldlm.training.checkpoint import CLOCK_CHECK_STEPS, CheckpointManager
from mmldlm.training.distributed import DistInfo


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(ckpt.time, "monotonic", fake.monotonic)
    return fake


def test_the_clock_is_read_only_on_check_steps_and_a_save_restarts_it(tmp_path, clock):
    manager = CheckpointManager(CheckpointConfig(every=1000, every_minutes=30), tmp_path, DistInfo())
    check = CLOCK_CHECK_STEPS
    clock.now += 29 * 60
    assert not manager.due(check)  # 29 minutes: not yet
    clock.now += 2 * 60
    assert not manager.due(check + 1)  # 31 minutes, but not a step the clock is read on
    assert manager.due(2 * check)
    assert manager.due(1000)  # checkpoint.every still saves on its own
    manager._saved_at = clock.now  # what save() does first
    clock.now += 10 * 60
    assert not manager.due(3 * check)


def test_without_every_minutes_only_the_step_interval_saves(tmp_path, clock):
    manager = CheckpointManager(CheckpointConfig(every=50), tmp_path, DistInfo())
    clock.now += 10**6
    assert [s for s in range(1, 101) if manager.due(s)] == [50, 100]


def test_every_minutes_must_be_a_number_of_minutes_at_least_zero():
    with pytest.raises(ConfigError, match="checkpoint.every_minutes"):
        load_config(None, ["checkpoint.every_minutes=-1"])
    assert load_config(None, ["checkpoint.every_minutes=30"]).checkpoint.every_minutes == 30


def test_a_run_saves_on_the_first_check_step_after_the_interval(tmp_path, clock, monkeypatch):
    trainer = make_trainer(tmp_path, steps=2 * CLOCK_CHECK_STEPS + 3)
    trainer.cfg.checkpoint.every = 1000
    trainer.cfg.checkpoint.every_minutes = 1.0
    real_step = trainer.run_step

    def step_of_forty_seconds(stop=None):
        clock.now += 40
        return real_step(stop)

    monkeypatch.setattr(trainer, "run_step", step_of_forty_seconds)
    assert trainer.fit() == 0
    # 40 s a step: a minute has passed at step 2; the clock is read at 10 (save), then at 20 (400 s later)
    # and the last step is always saved.
    check = CLOCK_CHECK_STEPS
    assert trainer.checkpoints.steps() == [check, 2 * check, 2 * check + 3]


def _rank_decides(rank: int, store_path: str, offsets: list[float], verdicts) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    manager = CheckpointManager(CheckpointConfig(every=1000, every_minutes=1), "unused", info)
    for i, offset in enumerate(offsets):  # this rank's clock reads `offset` seconds after its start
        manager._saved_at = ckpt.time.monotonic() - offset[rank]
        verdicts.put((rank, i, manager.due(CLOCK_CHECK_STEPS * (i + 1))))
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes
def test_every_rank_saves_on_rank_0s_verdict_whatever_its_own_clock_says(tmp_path):
    # (rank 0's elapsed seconds, rank 1's): rank 1 late alone, rank 0 late alone
    offsets = [(10.0, 600.0), (600.0, 10.0)]
    verdicts = mp.get_context("spawn").Queue()
    mp.start_processes(_rank_decides, args=(str(tmp_path / "store"), offsets, verdicts), nprocs=2, start_method="spawn")
    seen = sorted(verdicts.get(timeout=10) for _ in range(4))
    assert seen == [(0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)]
