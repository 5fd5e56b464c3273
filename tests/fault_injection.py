"""Faults put into a training process for the tests, chosen by MMLDLM_TEST_FAULT:
    nan:RANK:STEP[,STEP...]  the objective returns a NaN loss on RANK at those (0-based) steps
    stall:RANK:STEP:SECONDS  RANK sleeps before the forward of STEP
    kill:STEP                every rank SIGKILLs itself before the forward of STEP
    killrank:RANK:STEP       RANK alone SIGKILLs itself after the forward of STEP (mid-step)
    killsave:STEP            rank 0 SIGKILLs itself while writing the checkpoint of STEP, once its model
                             shard and its first small file are written (the step's directory is left
                             incomplete)
    fullsave:RANK:STEP       writing RANK's own small file of the checkpoint of STEP fails: no space left
    killpointer:STEP         the rank writing the checkpoint of STEP SIGKILLs itself after the step's
                             directory is complete and renamed, before `latest` names it
A fault fires in a worker group's first start only: under torchrun's restarts
(TORCHELASTIC_RESTART_COUNT > 0) the restarted workers run clean, as after a real crash. With
MMLDLM_TEST_FIRED=DIR the process a fault fires in first writes its pid to DIR/rank-RANK: a test waits
for that file, not for a time, and a worker started once it exists runs clean too (the launcher of
the other node restarts its workers with a restart count of 0, and ranks may move between nodes).
With MMLDLM_TEST_DUMP_SHARDS=DIR every rank writes DIR/rank-R.pt after training: its device-mesh
coordinate and the local shard of every parameter. With MMLDLM_TEST_RECORD=DIR each rank appends
"STEP INDEX INDEX ..." of every micro-batch it trains on to DIR/rank-RANK.txt (which samples each step read).
With MMLDLM_TEST_COMPILE=DIR what perf.compile compiles goes to a tracing backend (aot_eager: forward and
backward traced, run eagerly, seconds instead of inductor's minutes on a CPU), and after training each
rank writes DIR/rank-R.json: the graphs dynamo captured and the graph breaks it took.
Installed by tests/train_worker.py, and in the workers of scripts/launch.sh by
tests/launcher_faults/sitecustomize.py."""

import errno
import json
import os
import signal
import time
from pathlib import Path

import torch

from mmldlm import objective as objective_module
from mmldlm.runs.checkpoints import step_dir_name
from mmldlm.training import checkpoint as checkpoint_module
from mmldlm.training import parallelize as parallelize_module
from mmldlm.training import trainer as trainer_module


def _fired() -> None:
    """Tell the test that the fault fires now, in this process (MMLDLM_TEST_FIRED)."""
    if os.environ.get("MMLDLM_TEST_FIRED"):
        directory = Path(os.environ["MMLDLM_TEST_FIRED"])
        directory.mkdir(parents=True, exist_ok=True)
        marker = directory / f"rank-{os.environ.get('RANK', 0)}"
        partial = marker.with_name(f".{marker.name}.{os.getpid()}")
        partial.write_text(str(os.getpid()))
        partial.replace(marker)  # whole when it appears


def _fired_before() -> bool:
    directory = os.environ.get("MMLDLM_TEST_FIRED")
    return directory is not None and any(Path(directory).glob("rank-*"))


def _kill_self() -> None:
    _fired()
    os.kill(os.getpid(), signal.SIGKILL)


def _install_fault(fault: str) -> None:
    kind, *args = fault.split(":")
    rank = int(os.environ.get("RANK", 0))
    if kind == "killsave":
        real_torch_save = checkpoint_module._torch_save

        def killing_torch_save(obj, path):
            real_torch_save(obj, path)
            if rank == 0 and Path(path).parent.name.endswith(step_dir_name(int(args[0]))):
                _kill_self()

        checkpoint_module._torch_save = killing_torch_save
        return
    if kind == "fullsave":
        real_torch_save = checkpoint_module._torch_save

        def full_disk_torch_save(obj, path):
            step_dir = step_dir_name(int(args[1]))
            if rank == int(args[0]) and Path(path).parent.name.endswith(step_dir) and "rank-" in Path(path).name:
                _fired()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            real_torch_save(obj, path)

        checkpoint_module._torch_save = full_disk_torch_save
        return
    if kind == "killpointer":
        real_point_latest = checkpoint_module.CheckpointManager._point_latest

        def killing_point_latest(self, name):
            if name == step_dir_name(int(args[0])):
                _kill_self()
            real_point_latest(self, name)

        checkpoint_module.CheckpointManager._point_latest = killing_point_latest
        return
    real_call = objective_module.Objective.__call__

    def faulty_call(self, model, batch, step, generator=None):
        if kind == "kill" and step == int(args[0]):
            _kill_self()
        if kind == "stall" and rank == int(args[0]) and step == int(args[1]):
            _fired()
            time.sleep(float(args[2]))
        loss, metrics = real_call(self, model, batch, step, generator)
        if kind == "killrank" and rank == int(args[0]) and step == int(args[1]):
            _kill_self()
        if kind == "nan" and rank == int(args[0]) and step in {int(s) for s in args[1].split(",")}:
            _fired()
            loss = loss * torch.tensor(float("nan"))
        return loss, metrics

    objective_module.Objective.__call__ = faulty_call


def _dump_shards_after_fit(out: Path) -> None:
    real_fit = trainer_module.Trainer.fit

    def fit_then_dump(self, *fit_args, **fit_kwargs):
        status = real_fit(self, *fit_args, **fit_kwargs)
        mesh = self.info.mesh
        torch.save(
            {
                "coordinate": mesh.get_coordinate() if mesh is not None else None,
                "params": {
                    name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                    for name, p in self.raw_model.named_parameters()
                },
            },
            out / f"rank-{self.info.rank}.pt",
        )
        return status

    trainer_module.Trainer.fit = fit_then_dump


def _record_samples(directory: Path) -> None:
    record = directory / f"rank-{os.environ.get('RANK', 0)}.txt"
    real_call = objective_module.Objective.__call__

    def recording_call(self, model, batch, step, generator=None):
        with open(record, "a") as f:
            f.write(" ".join(map(str, [step, *batch["index"].tolist()])) + "\n")
        return real_call(self, model, batch, step, generator)

    objective_module.Objective.__call__ = recording_call


def _trace_compiles(directory: Path) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counter = CompileCounterWithBackend("aot_eager")
    real_apply = parallelize_module.apply_compile

    def apply_traced(model, backend="inductor", **options):
        real_apply(model, backend=counter, **options)

    parallelize_module.apply_compile = apply_traced
    real_fit = trainer_module.Trainer.fit

    def fit_then_write(self, *fit_args, **fit_kwargs):
        status = real_fit(self, *fit_args, **fit_kwargs)
        directory.mkdir(parents=True, exist_ok=True)
        found = {"graphs": counter.frame_count, "graph_breaks": sum(counters["graph_break"].values())}
        (directory / f"rank-{self.info.rank}.json").write_text(json.dumps(found))
        return status

    trainer_module.Trainer.fit = fit_then_write


def install_from_environment() -> None:
    """The fault of MMLDLM_TEST_FAULT (first start only, before it fired), the shard dump of MMLDLM_TEST_DUMP_SHARDS and
    the sample record of MMLDLM_TEST_RECORD and the compile trace of MMLDLM_TEST_COMPILE."""
    first_start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0 and not _fired_before()
    if os.environ.get("MMLDLM_TEST_FAULT") and first_start:
        _install_fault(os.environ["MMLDLM_TEST_FAULT"])
    if os.environ.get("MMLDLM_TEST_DUMP_SHARDS"):
        _dump_shards_after_fit(Path(os.environ["MMLDLM_TEST_DUMP_SHARDS"]))
    if os.environ.get("MMLDLM_TEST_RECORD"):
        _record_samples(Path(os.environ["MMLDLM_TEST_RECORD"]))
    if os.environ.get("MMLDLM_TEST_COMPILE"):
        _trace_compiles(Path(os.environ["MMLDLM_TEST_COMPILE"]))
