"""Checkpoint manager (atomic writes, retention, async, kill during a write) and metrics.jsonl."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from process_support import first_line
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_filesystem

import mmldlm.training.checkpoint as ckpt
import mmldlm.training.storage as storage
from mmldlm.config import CheckpointConfig, LoggingConfig, OptimConfig, RunConfig
from mmldlm.runs.checkpoints import FULL_STATE_FILES, VERDICT, file_sha256, find_latest, read_weights
from mmldlm.runs.files import CheckpointError
from mmldlm.runs.trained import find_checkpoint
from mmldlm.training.checkpoint import CheckpointManager
from mmldlm.training.distributed import DistInfo
from mmldlm.training.metrics import MetricsLogger, truncate_lines
from mmldlm.training.optim import build_optimizer
from mmldlm.training.storage import WriteError

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
    manager.save(
        step,
        model,
        opt,
        {"step": step},
        {"rng": torch.get_rng_state(), "data": {"pos": step}},
        RunConfig(),
        metrics_lines=step,
    )


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


def test_async_snapshot_is_not_affected_by_later_updates(tmp_path, monkeypatch):
    """Once wait_for_snapshot returns, the weights, moments and learning rate may change: the checkpoint
    holds those of the step saved, although its copy was still running when save returned."""
    from torch.distributed.checkpoint.staging import StateDictStager

    copying, released, real_stage = threading.Event(), threading.Event(), StateDictStager.stage

    def slow_stage(self, state_dict, **kwargs):
        copying.set()
        released.wait(60)  # a large state: the copy outlasts save() and the next rate's setting
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", slow_stage)
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path, DistInfo())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = [s["exp_avg"].clone() for s in opt.state.values()]
    lr = opt.param_groups[0]["lr"]
    _save(manager, 1, model, opt)
    assert copying.wait(60) and manager._staging is not None and not manager._staging.done()
    opt.param_groups[0]["lr"] = lr * 7  # the next step's schedule sets the rate before the snapshot is done
    released.set()
    manager.wait_for_snapshot()
    with torch.no_grad():  # the next update
        for p in model.parameters():
            p.add_(1.0)
        for state in opt.state.values():
            state["exp_avg"].add_(1.0)
    manager.wait()
    fresh, fresh_opt = _trained_pair(seed=3)
    manager.load(manager.latest(), fresh, fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])
    for state, moment in zip(fresh_opt.state.values(), expected_moments):
        assert torch.equal(state["exp_avg"], moment)
    assert fresh_opt.param_groups[0]["lr"] == lr


def test_kill_during_write_leaves_latest_on_a_complete_checkpoint(tmp_path):
    """A writer killed with SIGKILL in the middle of step 2's files: latest still names step 1,
    which loads; the next manager removes the partial directory."""
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
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
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert first_line(proc) == "WRITING"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt_dir = tmp_path / "checkpoints"
    assert (ckpt_dir / ".tmp-step-0000002").is_dir()  # the write really was cut short
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    assert manager.resolve("auto").name == "step-0000001" and manager.steps() == [1]
    manager.claim()
    assert not (ckpt_dir / ".tmp-step-0000002").exists()
    model, opt = _trained_pair(seed=5)
    meta, _, _ = manager.load(manager.latest(), model, opt)
    assert meta["step"] == 1


def test_resume_path_that_is_not_a_checkpoint_is_one_line_naming_what_is_expected(tmp_path):
    manager = CheckpointManager(CheckpointConfig(), tmp_path / "run", DistInfo())
    assert manager.resolve("auto") is None
    assert not (tmp_path / "run").exists()  # finding nothing makes nothing
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    cases = {str(tmp_path / "nope"): "no such directory", str(garbage): f"{garbage}/meta.json is missing"}
    for resume, what in cases.items():
        with pytest.raises(CheckpointError) as err:
            manager.resolve(resume)
        message = str(err.value)
        assert message.startswith(f"--resume {resume}: {what}") and "\n" not in message
        assert "meta.json, .metadata, trainer.pt" in message
    (garbage / "meta.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(CheckpointError, match="meta.json is not readable JSON"):
        manager.resolve(str(garbage))


def _run_to_30_then_resume_from_10(tmp_path):
    """checkpoint.every=5, keep_last=2, milestone_every=10, trained to 30, then resumed from step 10."""
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(keep_last=2, milestone_every=10), tmp_path, DistInfo())
    for step in range(5, 31, 5):
        _save(manager, step, model, opt)
    assert manager.steps() == [10, 20, 25, 30]
    resumed = CheckpointManager(manager.cfg, tmp_path, DistInfo())
    path = resumed.resolve(str(tmp_path / "checkpoints/step-0000010"))
    resumed.continue_from(path, 10)
    return resumed, model, opt


def test_resume_from_an_older_milestone_moves_the_later_checkpoints_aside(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        manager, model, opt = _run_to_30_then_resume_from_10(tmp_path)
    abandoned = list((tmp_path / "checkpoints").glob("abandoned-*"))
    assert len(abandoned) == 1
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["step-0000020", "step-0000025", "step-0000030"]
    assert "moved the checkpoints of later steps (20, 25, 30)" in caplog.text
    assert manager.steps() == [10] and (tmp_path / "checkpoints/latest").read_text().strip() == "step-0000010"
    _save(manager, 15, model, opt)  # then a kill -9: --resume auto continues from step 15
    assert manager.steps() == [10, 15]
    assert CheckpointManager(manager.cfg, tmp_path, DistInfo()).resolve("auto").name == "step-0000015"


def test_retention_never_removes_the_checkpoint_latest_names(tmp_path):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(keep_last=1), tmp_path, DistInfo())
    for step in (1, 2, 3):
        _save(manager, step, model, opt)
    (tmp_path / "checkpoints/latest").write_text("step-0000003\n")
    shutil.copytree(tmp_path / "checkpoints/step-0000003", tmp_path / "checkpoints/step-0000009")
    manager._prune()  # step 9 is the newest, but latest names step 3
    assert manager.steps() == [3, 9]


def test_retention_removes_a_checkpoint_whose_verdict_a_reader_writes_meanwhile(tmp_path, monkeypatch):
    """`mmldlm sample` verifying the oldest checkpoint while training prunes it writes verified.json into
    it between rmtree's listing and its last rmdir: the removal is run again, and training goes on."""
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(keep_last=1), tmp_path, DistInfo())
    _save(manager, 1, model, opt)
    real, calls = shutil.rmtree, []

    def rmtree_beside_a_reader(path, *args, **kwargs):
        calls.append(Path(path).name)
        if len(calls) == 1:
            (Path(path) / VERDICT).write_text("{}")
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree_beside_a_reader)
    _save(manager, 2, model, opt)
    assert calls == ["step-0000001", "step-0000001"] and manager.steps() == [2]


@pytest.mark.parametrize(
    "damage",
    [
        "no latest",
        "latest names nothing",
        "latest one save behind",
        "truncated shard",
        "flipped byte in the shard",
    ],
)
def test_newest_usable_checkpoint_is_found_whatever_happened_to_latest(tmp_path, caplog, damage):
    """A kill between the rename and `latest`, a deleted or dangling `latest`, a corrupt newest
    checkpoint: --resume auto and sampling continue from the newest checkpoint that verifies, and say so."""
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    for step in (1, 2):
        _save(manager, step, model, opt)
    ckpt_dir = tmp_path / "checkpoints"
    newest = ckpt_dir / "step-0000002"
    expected, reason = "step-0000002", "latest is missing"
    if damage == "no latest":
        (ckpt_dir / "latest").unlink()
    elif damage == "latest names nothing":
        (ckpt_dir / "latest").write_text("step-0000009\n")
        reason = "latest names step-0000009"
    elif damage == "latest one save behind":  # a kill between step 2's rename and the pointer's update
        (ckpt_dir / "latest").write_text("step-0000001\n")
        reason = "latest names step-0000001; using the newest checkpoint that verifies, step-0000002"
    elif damage == "truncated shard":
        data = (newest / "__0_0.distcp").read_bytes()
        (newest / "__0_0.distcp").write_bytes(data[: len(data) // 2])
        expected, reason = "step-0000001", f"skipped step-0000002: {newest}/__0_0.distcp has {len(data) // 2} bytes"
    else:  # same size, other content: only the checksum, read on resume, sees it
        data = bytearray((newest / "__0_0.distcp").read_bytes())
        data[-1] ^= 0xFF
        (newest / "__0_0.distcp").write_bytes(bytes(data))
        assert manager.latest() == newest  # sizes only
        expected, reason = "step-0000001", f"{newest}/__0_0.distcp does not match the SHA-256"
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        assert manager.resolve("auto").name == expected
    assert reason in caplog.text
    if "latest" in damage:
        assert find_checkpoint(tmp_path, None).name == expected
    else:
        with pytest.raises(CheckpointError, match=f"--resume {newest}: {newest}/"):
            manager.resolve(str(newest))


def test_no_checkpoint_that_verifies_is_an_error_listing_each(tmp_path):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    for step in (1, 2):
        _save(manager, step, model, opt)
        (tmp_path / f"checkpoints/step-000000{step}/trainer.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match="no checkpoint verifies .*skipped step-0000002: .*trainer.pt is missing; skipped step-0000001",
    ):
        manager.resolve("auto")


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(
    "failing", ["__0_0.distcp", "__0_0.distcp in the background", "rank-00000.pt", "rank-00000.pt as torch reports it"]
)
def test_full_disk_during_a_save_removes_the_partial_checkpoint_and_says_what_is_left(tmp_path, monkeypatch, failing):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(async_save="background" in failing), tmp_path, DistInfo())
    _save(manager, 1, model, opt)
    manager.wait()
    real_save = torch.save

    def failing_save(error):  # torch.save fails for the files the manager writes, not inside DCP's shards
        return lambda obj, f, **kw: (_ for _ in ()).throw(error) if isinstance(f, Path) else real_save(obj, f, **kw)

    if failing == "rank-00000.pt":
        monkeypatch.setattr(ckpt.torch, "save", failing_save(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    elif failing == "rank-00000.pt as torch reports it":  # a RuntimeError without errno; the disk is then full
        free = iter([10 * 2**30])  # the check before writing sees space, the one after the failure none
        error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        monkeypatch.setattr(ckpt.torch, "save", failing_save(error))
        monkeypatch.setattr(ckpt, "free_bytes", lambda path: next(free, 0))
        failing = "rank-00000.pt"
    else:  # DCP's writer hits the full disk; DCP hands the OSError on inside a CheckpointException
        monkeypatch.setattr(dcp_filesystem, "_write_item", _enospc)
        failing = "__0_0.distcp"
    with pytest.raises(WriteError) as err:
        _save(manager, 2, model, opt)
        manager.wait()
    message = str(err.value)
    assert message.startswith("no space left on device /") and "\n" not in message
    assert f"while writing {tmp_path}/checkpoints/.tmp-step-0000002/{failing}" in message
    assert f"the last good checkpoint is {tmp_path}/checkpoints/step-0000001" in message
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")) and manager.steps() == [1]
    assert find_latest(tmp_path / "checkpoints").name == "step-0000001"


def test_a_save_that_cannot_fit_is_refused_before_writing_and_retention_warns_at_start(tmp_path, monkeypatch, caplog):
    model, opt = _trained_pair()
    manager = CheckpointManager(CheckpointConfig(keep_last=3), tmp_path, DistInfo())
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 100)
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        manager.warn_if_retention_cannot_fit(1000)
    assert "checkpoint.keep_last=3 (+1 being written) needs" in caplog.text
    with pytest.raises(
        WriteError,
        match="not enough space for checkpoint step-0000001 .* nothing was written, no checkpoint was written yet",
    ):
        _save(manager, 1, model, opt)
    assert manager.steps() == [] and not list((tmp_path / "checkpoints").iterdir())


def test_a_full_state_checkpoint_is_read_for_its_weights_and_refused_for_resuming_in_one_line(tmp_path):
    """The earlier format: rank 0 wrote model.safetensors, optimizer.pt and trainer.pt, listed in meta.json."""
    model, opt = _trained_pair()
    path = tmp_path / "checkpoints" / "step-0000003"
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    torch.save(opt.state_dict(), path / "optimizer.pt")
    torch.save({"trainer": {"step": 3}, "ranks": [{}]}, path / "trainer.pt")
    files = {n: {"bytes": (path / n).stat().st_size, "sha256": file_sha256(path / n)} for n in FULL_STATE_FILES}
    (path / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1, "metrics_lines": 3, "files": files}))
    manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
    assert manager.resolve("auto") == path
    weights = read_weights(path)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError) as err:
        manager.load(path, *_trained_pair(seed=1))
    assert str(err.value).startswith(f"checkpoint {path} is of the earlier full-state format")
    assert "sample, evaluate or export it" in str(err.value) and "\n" not in str(err.value)


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
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # cut by a kill, before the checkpoint's line count was reached
    truncate_lines(tmp_path / "metrics.jsonl", 6)
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"loss": 4.5}\n')


def test_metrics_line_is_written_whole_or_not_at_all_on_a_full_disk(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(), enabled=True)
    logger.log({"step": 1, "loss": 1.0})
    real = logger._file

    class HalfThenFull:  # the disk fills in the middle of the line
        def write(self, data):
            real.write(bytes(data[:7]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def fileno(self):
            return real.fileno()

    logger._file = HalfThenFull()
    with pytest.raises(
        WriteError,
        match=f"no space left on device /.* while writing {tmp_path}/metrics.jsonl "
        r"\(the record of step 2 was not written",
    ):
        logger.log({"step": 2, "loss": 2.0})
    logger._file = real
    logger.log({"step": 3, "loss": 3.0})  # space freed: the file goes on from the last whole line
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]
    assert logger.num_lines == 2


def test_a_run_directory_in_use_by_another_process_is_refused_and_its_partial_checkpoint_kept(tmp_path):
    """A second trainer on a run that another process is training (a mistaken second `mmldlm train`,
    a requeued job) must not remove that process's half-written checkpoint as stale, nor write beside it."""
    partial = tmp_path / "checkpoints" / ".tmp-step-0000007"
    partial.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from mmldlm.training.storage import "
            "lock_run_dir; lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first_line(holder) == "locked"
        with pytest.raises(CheckpointError, match="another process is training in this run directory"):
            CheckpointManager(CheckpointConfig(), tmp_path, DistInfo()).claim()
        assert partial.is_dir()
    finally:
        holder.kill()
        holder.wait()
    CheckpointManager(CheckpointConfig(), tmp_path, DistInfo()).claim()  # the lock went with the process
    assert not partial.exists()  # now stale, and removed


def test_the_run_directory_lock_dies_with_its_process_though_a_forked_child_lives_on(tmp_path):
    """The processes a trainer forks (loader workers) outlive a SIGKILLed trainer; they must not hold
    its run directory, or the restart right after would be refused as a second training."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; from pathlib import Path; from mmldlm.training.storage import lock_run_dir; "
            "lock_run_dir(Path(sys.argv[1])); child = os.fork(); "
            # The child speaks once it runs (after the fork handlers), so the kill below never races them.
            "child or print(os.getpid(), flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(first_line(holder))
    holder.kill()
    holder.wait()
    try:
        os.kill(child, 0)  # the child is still alive
        CheckpointManager(CheckpointConfig(), tmp_path, DistInfo()).claim()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_filesystem_without_locks_trains_on_with_a_warning(tmp_path, monkeypatch, caplog):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(storage.fcntl, "flock", no_locks)
    (tmp_path / "checkpoints").mkdir()
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        manager = CheckpointManager(CheckpointConfig(), tmp_path, DistInfo())
        manager.claim()
    assert "cannot lock the run directory" in caplog.text
    model, opt = _trained_pair()
    _save(manager, 1, model, opt)
    assert manager.steps() == [1]


def test_the_checkpoint_benchmark_writes_a_checkpoint_that_verifies(tmp_path, capsys):
    """scripts/checkpoint_bench.py builds its model with no dataset (a null latent shape is the default
    encoder's) and saves with the run's manager: the checkpoint it writes is one a resume would take."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import checkpoint_bench
    finally:
        sys.path.pop(0)
    assert checkpoint_bench.main(["--method", "sharded", "--dir", str(tmp_path), "model.num_blocks=1"]) == 0
    assert "sharded (1 process, ddp)" in capsys.readouterr().out
    assert find_latest(tmp_path / "checkpoints", checksums=True).name == "step-0000001"
