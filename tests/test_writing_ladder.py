"""scripts/writing_ladder.py: a two-rung smoke ladder on the small prepared corpus (trains and evaluates
four times in subprocesses, so it belongs to the slow tier)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_support import prepared

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_ladder_trains_each_rung_with_more_samples_evaluates_it_and_writes_table_json_and_plot(tmp_path_factory):
    data = prepared(tmp_path_factory)
    out = tmp_path_factory.mktemp("ladder")
    args = [
        sys.executable,
        str(ROOT / "scripts" / "writing_ladder.py"),
        "--minutes",
        "4",
        "--out",
        str(out),
        "--rungs",
        "tiny:1,tiny:3",
        "--timing-steps",
        "4",
        "--eval-args",
        "--num-samples 8 --no-writing --retrieval-pool 8 --threads 1",
        f"data.path={data}",
        "train.threads=1",
        "train.micro_batch_size=8",
        "train.global_batch_size=8",
        "data.max_samples=null",
        "data.val_fraction=0.1",
    ]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    ladder = json.loads((out / "ladder.json").read_text())
    rungs = ladder["rungs"]
    assert [(r["preset"], r["units"]) for r in rungs] == [("tiny", 1.0), ("tiny", 3.0)]
    assert rungs[1]["samples"] >= rungs[0]["samples"]
    for rung in rungs:
        assert rung["train_flops"] > 0
        assert rung["figures"]["eval_t2l_retrieval_at_1"] is not None
        assert Path(rung["run_dir"], "eval.json").is_file()
    table = (out / "ladder.md").read_text()
    assert "| tiny:1 |" in table and "| tiny:3 |" in table and "t2l retrieval@1" in table
    assert (out / "ladder.png").stat().st_size > 0


def test_the_ladder_refuses_a_directory_holding_an_earlier_ladders_runs_before_training(tmp_path):
    (tmp_path / "timing-tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "rung-0-tiny-1").mkdir()
    args = [sys.executable, str(ROOT / "scripts" / "writing_ladder.py"), "--minutes", "1", "--out", str(tmp_path)]
    done = subprocess.run([*args, "--rungs", "tiny:1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--out {tmp_path} already holds an earlier ladder's runs (rung-0-tiny-1, timing-tiny)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rung-0-tiny-1", "timing-tiny"]  # nothing written
