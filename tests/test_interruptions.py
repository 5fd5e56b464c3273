"""Ctrl-C (SIGINT) and SIGTERM in the middle of each long command, in a subprocess held at a known point
of its work (tests/held_command.py): one line that says what was kept and how to go on, exit status
128 + the signal's number (130, 143) as `train` gives, no traceback, and nothing half-written. Each starts
Python and torch in a subprocess: the slow tier (tests/test_cli.py has the same in this process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_support import corpus_file, prepared, trained_run

REPO = Path(__file__).resolve().parent.parent
RUN = ["model=tiny", "train.steps=2", "train.micro_batch_size=4", "train.global_batch_size=4"]
RUN += ["logging.progress_bar=false", "data.num_workers=0", "eval.every=0"]
FAST = ["--steps", "2", "--device", "cpu", "--num-samples", "4", "--batch-size", "4"]
STARTS_OVER = "nothing was written; the same command starts over"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


def interrupted(tmp_path: Path, hold: str, args: list, signum: int = signal.SIGINT) -> tuple[int, list[str]]:
    """`mmldlm *args` held at `hold` (module:function), then sent `signum`: (exit status, stderr lines)."""
    held = tmp_path / "held"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update(MMLDLM_TEST_HOLD=hold, MMLDLM_TEST_HELD=str(held))
    command = [sys.executable, str(REPO / "tests" / "held_command.py"), *map(str, args)]
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not held.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"{args[0]} never reached {hold}"
            time.sleep(0.2)
        proc.send_signal(signum)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    return proc.returncode, err.strip().splitlines()


def assert_one_line(status: int, err: list[str], command: str, kept: str, signum: int = signal.SIGINT) -> None:
    name = signal.Signals(signum).name
    assert status == 128 + signum and err[-1] == f"mmldlm {command}: stopped by {name}; {kept}", err[-10:]
    assert not [line for line in err if "Traceback" in line or "KeyboardInterrupt" in line], err


@pytest.mark.slow
def test_prepare_stopped_keeps_its_finished_shards_for_the_same_command_to_continue(tmp_path_factory, tmp_path):
    corpus = corpus_file(tmp_path)
    out = tmp_path / "data"
    args = ["prepare", "--input", corpus, "--out", out, "--vocab-size", 300, "--shard-size", 16, "--quiet"]
    status, err = interrupted(tmp_path, "mmldlm.data.prepare:_merge", args)  # every shard written, none merged
    partial = tmp_path / ".data.partial"
    shards = len(list(partial.rglob("done-*.json")))
    assert shards > 1 and not out.exists()
    kept = f"{partial}: {shards} finished shards kept; the same command continues from them"
    assert_one_line(status, err, "prepare", kept)


@pytest.mark.slow
def test_migrate_stopped_ends_in_one_line(tmp_path):
    (tmp_path / "older.yaml").write_text("model: {}\n")
    args = ["migrate", tmp_path / "older.yaml", "--out", tmp_path / "ours.yaml"]
    status, err = interrupted(tmp_path, "mmldlm.tools.migrate:migrate", args)
    assert_one_line(status, err, "migrate", STARTS_OVER)
    assert not (tmp_path / "ours.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_eval_stopped_writes_no_report(run_dir, tmp_path, signum):
    out = tmp_path / "report.json"
    args = ["eval", "--run", run_dir, *FAST, "--no-writing", "--out", out]
    status, err = interrupted(tmp_path, "mmldlm.evaluation.evaluate:evaluate", args, signum)
    assert_one_line(status, err, "eval", STARTS_OVER, signum)
    assert list(tmp_path.iterdir()) == [tmp_path / "held"]


@pytest.mark.slow
def test_sample_stopped_writes_no_samples(run_dir, tmp_path):
    args = ["sample", "--run", run_dir, "--mode", "joint", "--num", 2, "--steps", 2, "--device", "cpu"]
    args += ["--out", tmp_path / "samples.jsonl", "--latents-out", tmp_path / "z.npy"]
    status, err = interrupted(tmp_path, "mmldlm.commands.sample:_records", args)
    assert_one_line(status, err, "sample", STARTS_OVER)
    assert list(tmp_path.iterdir()) == [tmp_path / "held"]


@pytest.mark.slow
def test_compare_stopped_writes_no_comparison(run_dir, tmp_path):
    args = ["compare", run_dir, run_dir, *FAST, "--no-writing", "--out", tmp_path / "comparison.json"]
    status, err = interrupted(tmp_path, "mmldlm.commands.evaluate:evaluate_loaded", args)
    assert_one_line(status, err, "compare", STARTS_OVER)
    assert list(tmp_path.iterdir()) == [tmp_path / "held"]


@pytest.mark.slow
def test_export_stopped_leaves_no_folder_and_no_partial_one(run_dir, tmp_path):
    args = ["export", "--run", run_dir, "--out", tmp_path / "exported"]
    status, err = interrupted(tmp_path, "mmldlm.export.pretrained:write_folder", args)
    assert_one_line(status, err, "export", STARTS_OVER)
    assert list(tmp_path.iterdir()) == [tmp_path / "held"]  # the partial folder beside it removed


@pytest.mark.slow
def test_bench_stopped_with_its_workers_running_ends_them_and_writes_no_report(tmp_path_factory, tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "model=tiny", "train.micro_batch_size=2", "train.global_batch_size=2", "data.num_workers=0"]
    args += [f"data.path={prepared(tmp_path_factory)}", "--steps", 2, "--warmup", 1, "--no-fit", "--out", out]
    status, err = interrupted(tmp_path, "mmldlm.tools.bench:_measure", args)  # both configs' workers started
    assert_one_line(status, err, "bench", STARTS_OVER)
    assert list(out.iterdir()) == []  # no bench.json, and the workers' scratch folder removed
