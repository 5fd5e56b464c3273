"""Process group setup from the torchrun environment, and failing loudly instead of hanging.

A single process (no torchrun) runs with world size 1 and no process group. Under torchrun the
group uses NCCL on CUDA and gloo on CPU, with a finite timeout (default 30 minutes, not the days
that let a dead rank freeze a job): a collective that waits longer raises on the waiting ranks,
and `collective_guard` turns that into `RankTimeout`, whose message says which collective of which
step timed out and what to look at.

Under `distributed.strategy=hsdp` the ranks also form a 2-D device mesh (replicate, shard): rank r
sits in shard group r // shard_group_size, and FSDP2 over that mesh shards each parameter within
its group and all-reduces gradients across the groups (hybrid sharding).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmldlm.config import DistributedConfig
from mmldlm.device import pick_device
from mmldlm.errors import OptionError

# How gloo/NCCL describe a peer that stopped answering (timeout) or went away (connection lost).
_PEER_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe", re.IGNORECASE)


class RankTimeout(RuntimeError):
    """A collective did not complete within the process-group timeout (another rank stalled or died)."""


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    timeout_s: float = 1800.0
    mesh: DeviceMesh | None = None  # hsdp: the (replicate, shard) mesh FSDP2 shards over

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def set_nccl_env_defaults(timeout_s: float) -> None:
    """Sane NCCL watchdog settings unless the user already chose: async error handling tears the
    process down when a collective times out (so torchrun sees a failure and can restart), and the
    heartbeat monitor, which kills a rank whose watchdog itself is stuck, waits a little longer than
    the collective timeout so the clearer collective-timeout message comes first."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(int(timeout_s + 60)))


def init_distributed(cfg: DistributedConfig, device_kind: str = "auto") -> DistInfo:
    """Join the torchrun process group (if launched by torchrun) and pick this rank's device."""
    timeout_s = cfg.timeout_minutes * 60
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and ":" in device_kind:  # every rank would take the same GPU
        raise OptionError(
            "config key 'train.device'",
            device_kind,
            "auto or cuda under torchrun, where each rank takes cuda:LOCAL_RANK "
            "(CUDA_VISIBLE_DEVICES chooses the GPUs)",
        )
    device = pick_device(device_kind)
    if world_size == 1:
        return DistInfo(device=device, timeout_s=timeout_s)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shard_group_size = cfg.num_shards(world_size, local_world_size)  # a bad size fails before any collective
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        if device.type != "cuda":
            raise RuntimeError("distributed.backend=nccl needs CUDA devices; use distributed.backend=auto or gloo")
        set_nccl_env_defaults(timeout_s)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None
        )
    mesh = hsdp_mesh(world_size, shard_group_size, device.type, timeout_s) if cfg.strategy == "hsdp" else None
    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
        timeout_s=timeout_s,
        mesh=mesh,
    )


def hsdp_mesh(world_size: int, shard_group_size: int, device_type: str, timeout_s: float) -> DeviceMesh:
    """The (replicate, shard) mesh of HSDP: rank r in shard group r // shard_group_size. Its groups are
    made here with the job's timeout and handed to DeviceMesh.from_group: init_device_mesh would make
    them with torch's default timeout (30 minutes), so a hung rank would hold its peers that long
    whatever distributed.timeout_minutes says."""
    layout = torch.arange(world_size).view(world_size // shard_group_size, shard_group_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    shard_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout)
    replicate_group, _ = dist.new_subgroups_by_enumeration(layout.T.tolist(), timeout=timeout)
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


@contextlib.contextmanager
def collective_guard(what: str, info: DistInfo):
    """Re-raise a backend failure inside the block as `RankTimeout` naming `what` (e.g. "gradient
    all-reduce of step 12") and the timeout, so a stalled peer reads as such, not as a C++ trace."""
    try:
        yield
    except RuntimeError as err:
        # DDP's gradient all-reduce fails inside backward as a plain RuntimeError from the backend.
        if not (isinstance(err, dist.DistError) or _PEER_FAILURE.search(str(err))):
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if re.search(r"timed out|timeout", message, re.IGNORECASE):
            happened = (
                f"did not complete within distributed.timeout_minutes={info.timeout_s / 60:g} "
                f"({info.timeout_s:g} s): another rank stalled"
            )
        else:
            happened = "failed: another rank closed its connection (it died or was killed)"
        raise RankTimeout(
            f"rank {info.rank}/{info.world_size}: {what} {happened}; look at that rank's log. "
            f"The last checkpoint is untouched. Backend said: {message}"
        ) from err


def barrier(info: DistInfo, what: str) -> None:
    if info.distributed:
        with collective_guard(what, info):
            dist.barrier()


def leave(info: DistInfo, status: int) -> int:
    """End a rank's part in the job with `status`. Under torch.distributed the ranks pass a barrier
    (all work, the last checkpoint included, is done), flush and leave with os._exit: tearing gloo
    down at interpreter exit sometimes aborted a rank ("terminate called without an active
    exception", SIGABRT) after the run had finished, which failed the job. One process: returns."""
    if info.distributed and dist.is_initialized():
        barrier(info, "the final barrier")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def continue_command(command: str) -> str:
    """The line that continues a stopped run that this process trains, started as `command` (`mmldlm
    train ...`): under scripts/launch.sh the launcher's own line (MMLDLM_LAUNCH_COMMAND; each of its
    starts resumes), under torchrun torchrun's line, else `command`; with --resume auto where it needs it."""
    launcher = os.environ.get("MMLDLM_LAUNCH_COMMAND")
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if launcher:
        return launcher + (" (on every node, each with its own NODE_RANK)" if nodes > 1 else "")
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # no torchrun: this process is the whole run
        return f"{command} --resume auto"
    argv = torchrun_argv()
    if argv is None:  # no /proc here: torchrun's line as its environment tells it
        argv = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', 1)}"]
        argv += ["-m", *shlex.split(command)]
    return f"{shlex.join(without_resume(argv))} --resume auto" + (" (on every node)" if nodes > 1 else "")


def torchrun_argv() -> list[str] | None:
    """The command line of the torchrun that started this process (its parent), as typed: `torchrun ...`
    or `python -m torch.distributed.run ...`; None where /proc cannot tell, or the parent is no torchrun."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        return None
    if len(argv) > 1 and Path(argv[1]).name == "torchrun":
        return ["torchrun", *argv[2:]]
    return argv if "torch.distributed.run" in argv or "torch.distributed.launch" in argv else None


def without_resume(argv: list[str]) -> list[str]:
    """`argv` without its --resume option (`--resume X` or `--resume=X`), which a continuation replaces."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            out.append(arg)
    return out
