"""`mmldlm train` at the edges of starting, resuming and stopping, in this process on the tiny
preset: a failed start leaves no trace, each resume keeps its config, a signal during start-up or
training ends with one line and a status that says the run is not done."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from data_support import prepared
from process_support import first_line
from torch.distributed.checkpoint import FileSystemReader

from mmldlm import cli
from mmldlm.runs.checkpoints import read_weights
from mmldlm.runs.files import current_run_config
from mmldlm.tools.monitor import total_steps
from mmldlm.training import run as run_module
from mmldlm.training.trainer import Trainer

TINY = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.log_every=1",
    "logging.progress_bar=false",
    "schedule.warmup_steps=1",
    "checkpoint.every=2",
    "data.num_workers=0",
]


@pytest.fixture
def train(tmp_path_factory, tmp_path, capsys):
    """mmldlm train on the small prepared corpus into tmp_path/run: (exit status, stderr lines)."""
    data = prepared(tmp_path_factory)

    def run(*args, steps=4):
        overrides = [*TINY, f"train.steps={steps}", f"data.path={data}", f"train.run_dir={tmp_path / 'run'}"]
        status = cli.main(["train", *overrides, *args])
        return status, capsys.readouterr().err.strip().splitlines()

    run.data = data
    return run


def steps_in(config_file):
    return yaml.safe_load(config_file.read_text())["train"]["steps"]


def test_the_progress_bar_ends_once_before_the_last_checkpoints_line(train, tmp_path):
    status, err = train("logging.progress_bar=true", steps=3)
    last = f"checkpoint: wrote {tmp_path / 'run' / 'checkpoints' / 'step-0000003'}"
    assert status == 0 and any(line.endswith(last) for line in err)
    after = err[[i for i, line in enumerate(err) if line.endswith(last)][0] + 1 :]
    assert not [line for line in after if "train:" in line]  # no bar drawn again after the run is done
    assert "3/3" in "\n".join(err)


def test_train_quiet_draws_no_progress_bar_as_the_other_commands_quiet_does(train, tmp_path):
    status, err = train("logging.progress_bar=true", "--quiet", steps=2)
    assert status == 0 and not [line for line in err if "train:" in line]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["logging"]["progress_bar"] is False


def test_the_runs_config_records_the_shape_it_took_from_the_data(train, tmp_path):
    """model.vocab_size, latent_dim and num_latents left null are the dataset's, written in config.yaml."""
    assert train(steps=1)[0] == 0
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    meta = json.loads((train.data / "meta.json").read_text())
    assert (model["vocab_size"], model["latent_dim"], model["num_latents"]) == (
        meta["vocab_size"],
        meta["latent_dim"],
        meta["num_latents"],
    )


def test_a_failed_start_leaves_no_trace_and_each_resume_keeps_its_config(train, tmp_path):
    run_dir = tmp_path / "run"
    status, err = train("--resume", str(tmp_path / "nope"))
    assert status == 2 and err[-1].startswith(f"mmldlm train: --resume {tmp_path / 'nope'}: no such directory")
    assert not run_dir.exists()  # no config.yaml, no empty checkpoints/

    assert train()[0] == 0
    (tmp_path / "not-a-checkpoint").mkdir()
    status, err = train("--resume", str(tmp_path / "not-a-checkpoint"), steps=6)
    assert status == 2 and f"{tmp_path / 'not-a-checkpoint'}/meta.json is missing" in err[-1]
    assert steps_in(run_dir / "config.yaml") == 4 and not list(run_dir.glob("config.resume-*"))

    assert train("--resume", "auto", steps=6)[0] == 0
    assert steps_in(run_dir / "config.yaml") == 4  # what the first checkpoints were trained with
    assert steps_in(run_dir / "config.resume-step-0000004.yaml") == 6
    assert total_steps(run_dir) == 6  # the monitor knows when the resumed run is complete


def test_a_resume_at_or_past_train_steps_says_that_nothing_was_trained(train, tmp_path):
    run_dir = tmp_path / "run"
    assert train()[0] == 0
    metrics = (run_dir / "metrics.jsonl").read_text()
    status, err = train("logging.progress_bar=true", "--resume", "auto", steps=2)
    assert status == 0 and err[-1].endswith(
        f"{run_dir} is at step 4, past train.steps=2: nothing was trained; raise train.steps above 4 to train it "
        "further"
    )
    assert not [line for line in err if "train:" in line]  # no bar of "4step"
    status, err = train("--resume", "auto", steps=4)  # the finished run started again, as `make train` twice
    assert status == 0 and err[-1].endswith(f"{run_dir} is complete at step 4 (train.steps=4): nothing to train")
    # Nothing was written: the metrics, the checkpoints and the config of the run are as it left them.
    assert (run_dir / "metrics.jsonl").read_text() == metrics and not list(run_dir.glob("config.resume-*"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-0000002", "step-0000004"]


def test_sigterm_during_start_up_exits_143_saying_nothing_was_written(train, tmp_path, monkeypatch):
    real_open = run_module.open_train_data

    def signal_while_opening_the_data(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_open(*args)

    monkeypatch.setattr(run_module, "open_train_data", signal_while_opening_the_data)
    status, err = train()
    assert status == 128 + signal.SIGTERM
    assert err[-1] == (
        f"mmldlm train: SIGTERM during start-up, before the first step; nothing was written to {tmp_path / 'run'}"
    )
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_run_stopped_by_a_signal_exits_143_and_ends_with_how_to_continue(train, tmp_path, monkeypatch):
    real_step = Trainer.run_step

    def signal_during_step_3(self, stop=None):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, stop)

    monkeypatch.setattr(Trainer, "run_step", signal_during_step_3)
    status, err = train(steps=10)
    assert status == 143
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000003"
    assert err[-1].startswith(
        f"mmldlm train: stopped by SIGTERM at step 3 of 10 (exit status 143); checkpoint "
        f"{checkpoint} written. Continue with: mmldlm train --config default model=tiny "
    )
    assert err[-1].endswith(f" train.steps=10 data.path={train.data} train.run_dir={tmp_path / 'run'} --resume auto")
    assert (checkpoint / "meta.json").is_file()
    monkeypatch.setattr(Trainer, "run_step", real_step)
    assert train("--resume", "auto", steps=10)[0] == 0


def test_a_signal_between_start_up_and_the_first_step_stops_after_that_step(train, tmp_path, monkeypatch):
    """No moment of a run is left to the default handler: a SIGTERM while the run's config is being
    recorded (after start-up, before the loop) stops the run at the end of its first step."""
    real_save = run_module.save_run_config

    def signal_while_recording_the_config(*args):
        real_save(*args)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_module, "save_run_config", signal_while_recording_the_config)
    status, err = train(steps=10)
    assert status == 143 and err[-1].startswith("mmldlm train: stopped by SIGTERM at step 1 of 10")
    assert (tmp_path / "run" / "checkpoints" / "step-0000001" / "meta.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_second_training_in_a_run_directory_in_use_is_refused_before_it_touches_anything(train, tmp_path):
    """Another process trains in RUN and has not written a checkpoint yet: a second `mmldlm train`
    there must not cut its metrics.jsonl back nor write beside it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from mmldlm.training.storage import "
            "lock_run_dir; lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first_line(holder) == "locked"
        status, err = train()
    finally:
        holder.kill()
        holder.wait()
    assert status == 2 and err[-1].endswith(
        "another process is training in this run directory; wait for it to "
        "end, stop it, or choose another train.run_dir"
    )
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_the_config_of_the_latest_start_is_the_one_written_last(tmp_path):
    """After a resume wrote config.resume-*.yaml, a fresh start (checkpoints removed) rewrites
    config.yaml: monitor and check must read that one, not the older resume's."""
    (tmp_path / "config.yaml").write_text("train: {steps: 1000}\n")
    resume = tmp_path / "config.resume-step-0000500.yaml"
    resume.write_text("train: {steps: 1000}\n")
    os.utime(tmp_path / "config.yaml", ns=(1, 1))
    assert current_run_config(tmp_path) == resume
    (tmp_path / "config.yaml").write_text("train: {steps: 200}\n")  # the fresh start, written last
    os.utime(resume, ns=(2, 2))
    assert current_run_config(tmp_path) == tmp_path / "config.yaml"


def test_a_checkpoint_written_before_every_parameter_had_a_gradient_resumes_exactly(train, tmp_path):
    """AdamW makes a parameter's state at its first gradient; after two t2l steps the text head has
    none yet. The checkpoint must load, and the head's state must still start at its first gradient:
    resumed at step 2, the run ends with the weights of the run that was never stopped."""
    exact = ["train.deterministic=true", "train.precision=fp32", "schedule.kind=constant", "checkpoint.every=100"]
    assert train(*exact, steps=4)[0] == 0
    straight = read_weights(tmp_path / "run" / "checkpoints" / "step-0000004")
    shutil.rmtree(tmp_path / "run")
    assert train(*exact, steps=2)[0] == 0
    saved = FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step-0000002")).read_metadata()
    keys = saved.state_dict_metadata
    assert "optim.state.text_final.head.weight.step" not in keys and any(k.startswith("optim.state.") for k in keys)
    status, err = train(*exact, "--resume", "auto", steps=4)
    assert status == 0, err[-1]
    resumed = read_weights(tmp_path / "run" / "checkpoints" / "step-0000004")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_a_run_with_dropout_resumed_midway_ends_with_the_weights_of_the_straight_run(train, tmp_path):
    """Dropout draws from the global RNG, which a checkpoint restores; starting a pass over the data
    must not draw from it too, or the resumed run's dropout masks differ from the straight run's."""
    exact = ["model.dropout=0.1", "train.deterministic=true", "train.precision=fp32", "schedule.kind=constant"]
    exact += ["checkpoint.every=100"]
    assert train(*exact, steps=6)[0] == 0
    straight = read_weights(tmp_path / "run" / "checkpoints" / "step-0000006")
    shutil.rmtree(tmp_path / "run")
    assert train(*exact, steps=3)[0] == 0
    status, err = train(*exact, "--resume", "auto", steps=6)
    assert status == 0, err[-1]
    resumed = read_weights(tmp_path / "run" / "checkpoints" / "step-0000006")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


@pytest.mark.slow  # a trainer and its loader worker started as processes: about 18 s
def test_a_trainer_killed_with_sigkill_leaves_its_run_directory_free_at_once(train, tmp_path):
    """A trainer SIGKILLed while its loader workers run (an OOM kill, a rank restarted by the launcher):
    the workers it forked must not keep the run directory locked after it, so the restart right after
    resumes instead of being refused as a second training."""
    run_dir = tmp_path / "run"
    # Its own TMPDIR, removed after: the killed processes cannot remove their multiprocessing folders.
    temp_dir = tempfile.mkdtemp(prefix="mmldlm-kill-")
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmldlm.cli",
            "train",
            *TINY,
            "data.num_workers=1",
            "train.steps=100000",
            f"data.path={train.data}",
            f"train.run_dir={run_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": temp_dir},
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "step-0000002").is_dir():
            assert trainer.poll() is None, "the trainer ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 180 s"
            time.sleep(0.05)
        workers = children(trainer.pid)
    finally:
        trainer.kill()
        trainer.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert workers
    status, err = train("data.num_workers=1", "--resume", "auto", steps=last_checkpoint_step(run_dir) + 1)
    assert status == 0, err[-1]
    assert not [pid for pid in workers if is_running(pid)]  # they died with the trainer, not seconds later


def children(pid):
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def is_running(pid):
    """Alive and not a zombie (a container's init may never reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def last_checkpoint_step(run_dir):
    return max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
