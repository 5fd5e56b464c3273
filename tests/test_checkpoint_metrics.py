"""Checkpoint manager (atomic writes, retention, async, kill during a write) and metrics.jsonl."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from mmldlm.config import CheckpointConfig, OptimConfig, RunConfig
from mmldlm.training.checkpoint import CheckpointManager
from mmldlm.training.distributed import DistInfo
from mmldlm.training.metrics import MetricsLogger, truncate_lines
from mmldlm.config import LoggingConfig
from mmldlm.training.optim import build_optimizer

REPO = Path(__file__).resolve().parent.parent


def _trained_pair(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    opt = build_optimizer(model, OptimConfig(fused=False))
    for _ in range(3):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(manager, step, model, opt):
    manager.save(step, model, opt, {"step": step}, {"rng": torch.get_rng_state(), "data": {"pos": step}},
                 RunConfig(), metrics_lines=step)


def test_round_trip_restores_model_optimizer_and_states(tmp_path):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    _save(manager, 7, model, opt)
    fresh, fresh_opt = _trained_pair(seed=1)
    meta, state, rank_state = manager.load(manager.resolve("auto"), fresh, fresh_opt)
    assert meta["step"] == 7 and meta["metrics_lines"] == 7 and state == {"step": 7}
    assert rank_state["data"] == {"pos": 7}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])
    assert (tmp_path / "checkpoints/step-0000007/config.yaml").is_file()


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keeps_last_n_plus_milestones(tmp_path, async_save):
    model, opt = _trained_pair()
    cfg = CheckpointConfig(keep_last=2, milestone_every=4, async_save=async_save)
    manager = CheckpointManager(cfg, tmp_path, DistInfo())
    for step in range(1, 11):
        _save(manager, step, model, opt)
    manager.wait()
    assert manager.steps() == [4, 8, 9, 10]
    assert manager.latest().name == "step-0000010"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_async_snapshot_is_not_affected_by_later_updates(tmp_path):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path, DistInfo())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _save(manager, 1, model, opt)
    with torch.no_grad():  # training goes on while the writer thread runs
        for p in model.parameters():
            p.add_(1.0)
    manager.wait()
    fresh, fresh_opt = _trained_pair(seed=3)
    manager.load(manager.latest(), fresh, fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])


def test_kill_during_write_leaves_latest_on_a_complete_checkpoint(tmp_path):
    """A writer killed with SIGKILL in the middle of step 2's files: latest still names step 1,
    which loads; the next manager removes the partial directory."""
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_checkpoint_metrics import _trained_pair, _save
        from mmldlm.config import CheckpointConfig
        from mmldlm.training.checkpoint import CheckpointManager
        from mmldlm.training.distributed import DistInfo
        import mmldlm.training.checkpoint as ckpt
        model, opt = _trained_pair()
        manager = CheckpointManager(CheckpointConfig(), {str(tmp_path)!r}, DistInfo())
        _save(manager, 1, model, opt)
        real_save = torch.save
        def slow_save(obj, path):
            real_save(obj, path)
            print("WRITING", flush=True)
            time.sleep(60)
        ckpt.torch.save = slow_save
        _save(manager, 2, model, opt)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "WRITING"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt_dir = tmp_path / "checkpoints"
    assert (ckpt_dir / ".tmp-step-0000002").is_dir()  # the write really was cut short
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    assert manager.resolve("auto").name == "step-0000001" and manager.steps() == [1]
    assert not (ckpt_dir / ".tmp-step-0000002").exists()
    model, opt = _trained_pair(seed=5)
    meta, _, _ = manager.load(manager.latest(), model, opt)
    assert meta["step"] == 1


def test_resume_path_errors_name_what_is_expected(tmp_path):
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    assert manager.resolve("auto") is None
    with pytest.raises(FileNotFoundError, match="meta.json"):
        manager.resolve(str(tmp_path / "nope"))


def test_metrics_resume_drops_only_records_past_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(), enabled=True)
    for step in range(1, 6):
        logger.log({"step": step, "loss": float(step)})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a record cut by a kill
    resumed = MetricsLogger(tmp_path, LoggingConfig(), enabled=True, keep_lines=3)
    resumed.log({"step": 4, "loss": 4.5})
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and resumed.num_lines == 4
    truncate_lines(tmp_path / "missing.jsonl", 2)  # nothing to do, no error
