"""The symptoms of docs/troubleshooting.md reproduced on the tiny preset, each shown the way the
guide says `monitor` or `check` shows it. The commands are the guide's own."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from data_support import prepared

from mmldlm import cli
from mmldlm.config import load_config
from mmldlm.tools.monitor import Monitor, follow

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "train_worker.py"
TINY_RUN = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.steps=16",
    "train.log_every=1",
    "train.deterministic=true",
    "logging.progress_bar=false",
    "schedule.warmup_steps=2",
    "checkpoint.every=5",
    "data.num_workers=0",
]


def check(capsys, *args) -> tuple[int, str]:
    status = cli.main(["check", "default", *args])
    return status, capsys.readouterr().out


def train(run_dir, dataset, fault, resume=None, extra=()) -> subprocess.CompletedProcess:
    """tests/train_worker.py is `mmldlm train` with a fault injected (MMLDLM_TEST_FAULT)."""
    cmd = [sys.executable, str(WORKER), *TINY_RUN, *extra, f"data.path={dataset}", f"train.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MMLDLM_TEST_FAULT": fault}
    return subprocess.run(
        cmd + (["--resume", resume] if resume else []), env=env, capture_output=True, text=True, timeout=180, cwd=REPO
    )


@pytest.mark.slow  # `mmldlm train` subprocesses with a fault injected, killed and resumed
def test_nan_and_a_resume_in_a_live_tiny_run_are_followed_to_completion(tmp_path_factory, tmp_path):
    """NaN and 'resumed loss not matching': a live run is killed at step 8 and resumed from its
    step-5 checkpoint; the resumed run gets a NaN loss at step 12. The monitor follows it all."""
    dataset = prepared(tmp_path_factory)
    run = tmp_path / "run"
    run.mkdir()  # followed while empty: a missing directory is refused at once as a mistyped path
    monitor = Monitor(run, stall_seconds=float("inf"))  # no stall alert, however slow the machine
    lines, statuses = [], []
    follower = threading.Thread(
        target=lambda: statuses.append(follow(monitor, interval=0.05, out=lines.append)), daemon=True
    )
    follower.start()
    killed = train(run, dataset, fault="kill:8")  # SIGKILL before the forward of step 9
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    deadline = time.monotonic() + 30
    while not (monitor.history.records and monitor.history.records[-1]["step"] == 8) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert monitor.history.records[-1]["step"] == 8  # the monitor saw steps 6-8 before the resume dropped them
    resumed = train(run, dataset, fault="nan:0:11", resume="auto")  # 0-based step 11 = logged step 12
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    follower.join(timeout=60)
    assert not follower.is_alive() and statuses == ["critical"]
    assert monitor.complete and [r["step"] for r in monitor.history.records] == list(range(1, 17))
    assert monitor.history.num_resumes == 1  # deterministic: the re-trained step 6 matched, no resume_mismatch
    assert [(a.kind, a.step, a.severity) for a in monitor.alerts] == [("nonfinite", 12, "critical")]
    assert any(line.startswith("[CRITICAL] step 12 nonfinite") for line in lines)
    assert lines[-1].startswith("run complete; status: critical")


def test_out_of_memory_is_flagged_and_fixed_before_the_run(capsys, tmp_path):
    args = ["train.micro_batch_size=65536", "train.global_batch_size=65536", "--device-memory-gib", "16"]
    status, out = check(capsys, *args, "--fix", str(tmp_path / "fixed.yaml"))
    assert status == 2 and "ERROR   [memory]" in out and "fix: train.micro_batch_size=" in out
    status, out = check(capsys, *args[:2], "train.micro_batch_size=1024", "--device-memory-gib", "16")
    assert status == 0 and "[memory]" not in out
    assert cli.main(["check", str(tmp_path / "fixed.yaml"), "--device-memory-gib", "16", "--strict"]) == 0


def test_slow_data_settings_are_flagged(capsys):
    status, out = check(
        capsys,
        "data.num_workers=16",
        "data.persistent_workers=false",
        "data.prefetch_factor=null",
        "train.micro_batch_size=32",
        "--nproc-per-node",
        "2",
        "--strict",
    )
    assert status == 1
    for rule in ("loader_workers", "loader_prefetch", "loader_persistence"):
        assert f"WARNING [{rule}]" in out


def test_threads_waiting_on_a_busy_machine_are_flagged(capsys, tmp_path):
    cpus = len(os.sched_getaffinity(0))  # $(nproc): a load of one per CPU leaves none free
    out = tmp_path / "threads.yaml"
    status, printed = check(
        capsys, "train.device=cpu", "train.threads=2", "--load", str(cpus), "--strict", "--fix", str(out)
    )
    assert status == 1
    assert f"WARNING [busy_cpus] load average {cpus:.1f} on {cpus} CPUs leaves about 0 free for 2 torch" in printed
    assert "fix: set train.threads=1 or stop the other job" in printed
    assert "-  threads: 2\n+  threads: 1" in (tmp_path / "threads.yaml.diff").read_text()
    assert load_config(out).train.threads == 1


def test_distributed_hang_settings_are_flagged(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "11923200")
    status, out = check(capsys, "distributed.timeout_minutes=198720")
    assert status == 2
    assert "ERROR   [timeout] distributed.timeout_minutes=198720 (138.0 days)" in out
    assert "ERROR   [nccl_env] TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=11923200" in out


def test_idle_heads_of_the_mode_mix_are_explained(capsys):
    status, out = check(
        capsys,
        "objective.mode=sequential",
        "objective.mode_schedule=[[0, l2t], [300, t2l]]",
        "train.micro_batch_size=32",
        "--nproc-per-node",
        "2",
    )
    assert status == 0
    assert "INFO    [unused_parameters] modes l2t, t2l: the latent head and the text head" in out


def test_flat_loss_from_a_schedule_that_never_leaves_warmup_is_flagged(capsys):
    status, out = check(capsys, "train.steps=2000", "schedule.warmup_steps=2000")
    assert status == 2 and "ERROR   [lr_schedule] schedule.warmup_steps=2000 >= train.steps=2000" in out


@pytest.mark.slow  # `mmldlm train` subprocesses with a fault injected, killed and resumed
def test_a_resume_from_an_older_checkpoint_survives_a_kill_and_a_corrupt_file(tmp_path_factory, tmp_path):
    """The guide's commands: a run resumed from its step-10 milestone sets steps 15-16 aside, is killed
    after writing a new step 15, whose weights are then truncated; --resume auto goes on from step 10."""
    dataset = prepared(tmp_path_factory)
    run, keep = tmp_path / "run", "checkpoint.milestone_every=5"
    ckpt = run / "checkpoints"
    assert train(run, dataset, fault="", extra=[keep]).returncode == 0
    killed = train(run, dataset, fault="kill:15", resume=str(ckpt / "step-0000010"), extra=[keep])
    assert killed.returncode == -signal.SIGKILL
    assert "moved the checkpoints of later steps (15, 16)" in killed.stderr
    (first_branch,) = ckpt.glob("abandoned-*")
    assert sorted(p.name for p in first_branch.iterdir()) == ["step-0000015", "step-0000016"]
    assert (ckpt / "latest").read_text().strip() == "step-0000015"
    weights = ckpt / "step-0000015" / "__0_0.distcp"
    size = weights.stat().st_size
    os.truncate(weights, 100)
    resumed = train(run, dataset, fault="", resume="auto", extra=[keep])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"latest names step-0000015; using the newest checkpoint that verifies, step-0000010; skipped "
        f"step-0000015: {weights} has 100 bytes, {size} were written (truncated or replaced)"
    ) in resumed.stderr
    assert "resumed from step 10: moved the checkpoints of later steps (15)" in resumed.stderr
    assert len(list(ckpt.glob("abandoned-*"))) == 2 and (ckpt / "latest").read_text().strip() == "step-0000016"
