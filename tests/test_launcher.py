"""scripts/launch.sh on 2 simulated nodes of 2 processes each: two launchers on 127.0.0.1 (c10d
rendezvous, gloo), HSDP with one node per shard group. A rank is SIGKILLed mid-step, killed while it
writes a checkpoint, or hangs until the collective timeout; each time the launchers restart the worker
groups with --resume auto, the run continues from the newest checkpoint that verifies, and it ends
with every optimizer step trained once and logged once, the losses of an uninterrupted run.

The faults come from tests/fault_injection.py, put into the launcher's workers by
tests/launcher_faults/sitecustomize.py; they fire in the first start only."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_training_distributed import (  # noqa: F401  (dataset: the module's prepared data set)
    BASE,
    PYTHON,
    REPO,
    _env,
    dataset,
    free_port,
    kill_trees,
    records,
)

STEPS = 10
# 2 nodes x 2 processes, HSDP (shard groups: one node's 2 processes, the default), every step logged,
# checkpoints at steps 4, 8 and 10. A collective waits 9 s at most: a hung rank is found out soon.
ARGS = [
    f"train.steps={STEPS}",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "checkpoint.every=4",
    "distributed.strategy=hsdp",
    "distributed.timeout_minutes=0.15",
]


def launch_two_nodes(out: Path, fault: str | None = None) -> list[int]:
    """Run the launcher once per simulated node until both end; their exit codes. The run is in
    out/run, each node's log in out/logs/node-R.log."""
    env = {
        **_env(fault),
        "NNODES": "2",
        "NPROC_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "MAX_RESTARTS": "2",
        "LOG_DIR": str(out / "logs"),
        "RUN_ID": f"launcher-{out.name}",
        "PYTHON": PYTHON,
    }
    if fault:
        env["PYTHONPATH"] = f"{REPO / 'tests' / 'launcher_faults'}{os.pathsep}{env['PYTHONPATH']}"
    args = [*BASE, f"train.run_dir={out / 'run'}", *ARGS]
    nodes = [
        subprocess.Popen(
            ["bash", str(REPO / "scripts" / "launch.sh"), *args],
            cwd=REPO,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        return [n.wait(timeout=300) for n in nodes]
    finally:
        kill_trees(nodes)  # whatever is left (a launcher that timed out), its workers too


def log_of(out: Path) -> str:
    return "".join((out / "logs" / f"node-{r}.log").read_text() for r in (0, 1))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert launch_two_nodes(out) == [0, 0], log_of(out)[-5000:]
    recs = records(out / "run")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    return recs


def assert_continued_from(out: Path, step: int, uninterrupted: list[dict]) -> None:
    """Both launchers succeeded after a restart that resumed from step-`step`; every step was trained
    and logged once, with the losses of the uninterrupted run."""
    log = log_of(out)
    checkpoints = out / "run" / "checkpoints"
    assert f"resumed from {checkpoints / f'step-{step:07d}'} at step {step}" in log
    recs = records(out / "run")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == [r["loss"] for r in uninterrupted]
    assert (checkpoints / "latest").read_text().strip() == f"step-{STEPS:07d}"
    assert json.loads((checkpoints / f"step-{STEPS:07d}" / "meta.json").read_text())["step"] == STEPS
    assert not list(checkpoints.glob(".tmp-*"))


def test_a_rank_killed_mid_step_restarts_from_the_last_checkpoint(uninterrupted, tmp_path):
    # Rank 3 (node 1) dies after the forward of step 6: the peers' collectives fail, both groups restart.
    assert launch_two_nodes(tmp_path, fault="killrank:3:5") == [0, 0], log_of(tmp_path)[-5000:]
    assert_continued_from(tmp_path, 4, uninterrupted)


@pytest.mark.parametrize(
    "fault,step",
    [
        ("killsave:8", 4),  # step 8's directory is incomplete: removed, step 4 is the newest that verifies
        ("killpointer:8", 8),  # step 8 is complete but `latest` still names step 4: step 8 is taken
    ],
)
def test_a_rank_killed_while_saving_restarts_from_the_newest_checkpoint_that_verifies(
    uninterrupted, tmp_path, fault, step
):
    assert launch_two_nodes(tmp_path, fault=fault) == [0, 0], log_of(tmp_path)[-5000:]
    assert_continued_from(tmp_path, step, uninterrupted)


def test_a_hung_rank_times_out_and_the_run_restarts_from_the_last_checkpoint(uninterrupted, tmp_path):
    # Rank 3 sleeps for good before the forward of step 6; its peers give up after 9 s, the launcher
    # of its node stops it: SIGTERM does not wake it, SIGKILL 30 s later does (torchrun's fixed grace
    # when it stops a worker group to restart it).
    assert launch_two_nodes(tmp_path, fault="stall:3:5:3600") == [0, 0], log_of(tmp_path)[-5000:]
    assert "did not complete within distributed.timeout_minutes=0.15" in log_of(tmp_path)
    assert_continued_from(tmp_path, 4, uninterrupted)
