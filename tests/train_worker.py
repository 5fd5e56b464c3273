"""`mmldlm train` for the tests, run as a subprocess (plain python or torchrun), with optional fault
injection through MMLDLM_TEST_FAULT:
    nan:RANK:STEP[,STEP...]  the objective returns a NaN loss on RANK at those (0-based) steps
    stall:RANK:STEP:SECONDS  RANK sleeps before the forward of STEP
    kill:STEP                every rank SIGKILLs itself before the forward of STEP
and with MMLDLM_TEST_RECORD=DIR each rank appends "STEP INDEX INDEX ..." of every micro-batch it
trains on to DIR/rank-RANK.txt (which samples each step read).
Usage: python tests/train_worker.py [mmldlm train arguments]."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mmldlm import cli  # noqa: E402
from mmldlm import objective as objective_module  # noqa: E402


def _install_fault(spec: str) -> None:
    kind, *args = spec.split(":")
    rank = int(os.environ.get("RANK", 0))
    real_call = objective_module.Objective.__call__

    def faulty_call(self, model, batch, step, generator=None):
        if kind == "kill" and step == int(args[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stall" and rank == int(args[0]) and step == int(args[1]):
            time.sleep(float(args[2]))
        loss, metrics = real_call(self, model, batch, step, generator)
        if kind == "nan" and rank == int(args[0]) and step in {int(s) for s in args[1].split(",")}:
            loss = loss * torch.tensor(float("nan"))
        return loss, metrics

    objective_module.Objective.__call__ = faulty_call


def _record_samples(directory: str) -> None:
    record = Path(directory) / f"rank-{os.environ.get('RANK', 0)}.txt"
    real_call = objective_module.Objective.__call__

    def recording_call(self, model, batch, step, generator=None):
        with open(record, "a") as f:
            f.write(" ".join(map(str, [step, *batch["index"].tolist()])) + "\n")
        return real_call(self, model, batch, step, generator)

    objective_module.Objective.__call__ = recording_call


if __name__ == "__main__":
    if os.environ.get("MMLDLM_TEST_FAULT"):
        _install_fault(os.environ["MMLDLM_TEST_FAULT"])
    if os.environ.get("MMLDLM_TEST_RECORD"):
        _record_samples(os.environ["MMLDLM_TEST_RECORD"])
    sys.exit(cli.main(["train", *sys.argv[1:]]))
