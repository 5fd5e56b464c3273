"""scripts/launch.sh on 2 simulated nodes of 2 processes each: two launchers on 127.0.0.1 (c10d
rendezvous, gloo), HSDP with one node per shard group. A rank is SIGKILLed mid-step, killed after it
wrote a checkpoint but before `latest` names it, or hangs until the collective timeout; each time the
launchers restart the worker groups with --resume auto, the run continues from the newest checkpoint
that verifies, and it ends with every optimizer step trained once and logged once, the losses of an
uninterrupted run. Also a worker killed from outside on 2 nodes of 1 process.

The faults come from tests/fault_injection.py, put into the launcher's workers by
tests/launcher_faults/sitecustomize.py; they fire in the first start only. All of it is the slow tier."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_training_distributed import (  # noqa: F401  (dataset: the prepared dataset of the runs)
    BASE,
    PYTHON,
    REPO,
    _env,
    dataset,
    free_port,
    records,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dataset")]

STEPS = 10
# 2 nodes x 2 processes, HSDP (shard groups: one node's 2 processes, the default), every step logged,
# checkpoints at steps 4, 8 and 10. A collective waits 15 s at most: a hung rank is found out soon,
# and 4 workers on a busy 2-core machine still finish every other collective within it.
ARGS = [
    f"train.steps={STEPS}",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "checkpoint.every=4",
    "distributed.strategy=hsdp",
    "distributed.timeout_minutes=0.25",
]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_trees(nodes: list[subprocess.Popen]) -> None:
    """SIGKILL every process the launchers `nodes` started, and them: a torchrun agent killed alone
    leaves its workers orphaned, blocked in a collective."""
    for n in nodes:
        for pid in [n.pid, *_descendants(n.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        n.wait()


def start_two_nodes(
    out: Path, args: list[str], fault: str | None = None, nproc_per_node: int = 2, max_restarts: int = 2
) -> list[subprocess.Popen]:
    """One launcher per simulated node, training `args` into out/run; each node's log in
    out/logs/node-R.log. The rank a fault fires on writes out/fired/rank-R then."""
    env = {
        **_env(fault),
        "NNODES": "2",
        "NPROC_PER_NODE": str(nproc_per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "MAX_RESTARTS": str(max_restarts),
        "LOG_DIR": str(out / "logs"),
        "RUN_ID": f"launcher-{out.name}",
        "PYTHON": PYTHON,
    }
    if fault:
        env["PYTHONPATH"] = f"{REPO / 'tests' / 'launcher_faults'}{os.pathsep}{env['PYTHONPATH']}"
        env["MMLDLM_TEST_FIRED"] = str(out / "fired")
    return [
        subprocess.Popen(
            ["bash", str(REPO / "scripts" / "launch.sh"), *BASE, f"train.run_dir={out / 'run'}", *args],
            cwd=REPO,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


def launch_two_nodes(out: Path, fault: str | None = None) -> list[int]:
    """Run the launcher once per simulated node (2 x 2 processes, ARGS) until both end; their exit codes."""
    nodes = start_two_nodes(out, ARGS, fault)
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


def test_a_rank_killed_while_saving_restarts_from_the_newest_checkpoint_that_verifies(uninterrupted, tmp_path):
    # Step 8 is complete but `latest` still names step 4: step 8 is taken. (A directory left incomplete
    # by a writer killed mid-write, and a truncated shard, are test_checkpoint_metrics.py's, in process.)
    assert launch_two_nodes(tmp_path, fault="killpointer:8") == [0, 0], log_of(tmp_path)[-5000:]
    assert_continued_from(tmp_path, 8, uninterrupted)


def test_a_hung_rank_times_out_and_the_run_restarts_from_the_last_checkpoint(uninterrupted, tmp_path):
    # Rank 3 sleeps for good before the forward of step 6; its peers give up after 15 s, the launcher
    # of its node stops it: SIGTERM does not wake it, SIGKILL 30 s later does (torchrun's fixed grace
    # when it stops a worker group to restart it).
    assert launch_two_nodes(tmp_path, fault="stall:3:5:3600") == [0, 0], log_of(tmp_path)[-5000:]
    assert "did not complete within distributed.timeout_minutes=0.25" in log_of(tmp_path)
    assert_continued_from(tmp_path, 4, uninterrupted)


def test_a_worker_killed_from_outside_is_restarted_on_one_process_per_node(tmp_path):
    # The kill comes from outside the worker (as the kernel's OOM killer or an operator would), once the
    # checkpoint of step 5 exists: rank 1 waits before the forward of step 7 until it is killed, so the
    # run cannot end first however fast the machine. One process per node, one restart allowed.
    args = ["train.steps=10", "train.global_batch_size=4", "checkpoint.every=5", "distributed.timeout_minutes=2"]
    nodes = start_two_nodes(tmp_path, args, fault="stall:1:6:3600", nproc_per_node=1, max_restarts=1)
    run_dir, fired = tmp_path / "run", tmp_path / "fired" / "rank-1"
    try:
        deadline = time.monotonic() + 150
        while not fired.exists() and time.monotonic() < deadline and all(n.poll() is None for n in nodes):
            time.sleep(0.2)
        assert fired.exists(), "rank 1 never reached step 7"
        stalled = int(fired.read_text())  # on either node: the rendezvous places the ranks
        assert stalled in [pid for n in nodes for pid in _descendants(n.pid)]
        os.kill(stalled, signal.SIGKILL)
        assert [n.wait(timeout=240) for n in nodes] == [0, 0]
    finally:
        kill_trees(nodes)
    assert [r["step"] for r in records(run_dir)] == list(range(1, 11))
    assert f"resumed from {run_dir / 'checkpoints' / 'step-0000005'} at step 5" in log_of(tmp_path)
    assert (run_dir / "checkpoints" / "step-0000010" / ".metadata").is_file()
