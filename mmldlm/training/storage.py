"""A run's files on disk: its config files, the errors the user acts on (`mmldlm` prints each as one
line, exit status 2), what a failed write says, and the free space where a path is or will be.
Imports nothing heavy, so the command line and the monitor use it without loading torch."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

from mmldlm.config import RunConfig, save_config
from mmldlm.errors import UserError

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used: not a checkpoint, incomplete, corrupt, from another world size."""


class WriteError(UserError, RuntimeError):
    """A run file (checkpoint, metrics.jsonl) could not be written whole; what was half-written is removed."""


def save_run_config(cfg: RunConfig, run_dir: Path, resumed_from: Path | None) -> None:
    """RUN/config.yaml is the config the run started with and stays so: a resume from checkpoint
    step-N that finds it writes its own beside it, config.resume-step-N.yaml. What each checkpoint
    was trained with is never lost (every checkpoint also holds its config.yaml)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if resumed_from is not None and path.exists():
        path = run_dir / f"config.resume-{resumed_from.name}.yaml"
    save_config(cfg, path)


def current_run_config(run_dir: Path) -> Path:
    """The config of the run's latest start: whichever of config.yaml and the config.resume-*.yaml was
    written last (a fresh start after the checkpoints were removed rewrites config.yaml)."""
    written = [p for p in (run_dir / "config.yaml", *run_dir.glob("config.resume-*.yaml")) if p.is_file()]
    return max(written, key=lambda p: p.stat().st_mtime_ns) if written else run_dir / "config.yaml"


def is_run_dir(path: Path) -> bool:
    """Whether `mmldlm train` writes in `path`: it opens metrics.jsonl as it claims the directory, writes
    config.yaml when the run has started, and checkpoints/ at the first save (a resume finds it)."""
    return any((path / name).exists() for name in ("metrics.jsonl", "config.yaml", "checkpoints"))


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path`, or will hold it (its nearest existing parent)."""
    where = Path(path).absolute()
    while not where.exists():
        where = where.parent
    return shutil.disk_usage(where).free


def _mount_point(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _is_disk_full(err: BaseException) -> bool:
    """An OSError with ENOSPC, or safetensors' error, which carries the OS error only in its text
    ('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')."""
    return getattr(err, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(err)


def write_failure(err: BaseException, path: Path) -> str:
    """What went wrong writing `path`, in the user's words: a full disk is named as such, with its mount."""
    if _is_disk_full(err):
        return f"no space left on device {_mount_point(path)} while writing {path}"
    return f"writing {path} failed: {err}"


_HELD: dict[str, int] = {}  # run directory (resolved) -> the descriptor whose flock this process holds


def _leave_run_dir_locks_to_the_parent() -> None:
    """In a forked child (a DataLoader worker): close the inherited descriptors of the
    run-directory locks. An flock belongs to the open file, which a fork shares, so a child that kept
    its copy would hold the run directory after the trainer died (a SIGKILLed trainer's workers live
    on for seconds). Closing, not unlocking: LOCK_UN here would release the parent's lock too."""
    for fd in _HELD.values():
        if fd >= 0:
            os.close(fd)
    _HELD.clear()


# Once per process, as `random` and `logging` register theirs: any fork, whoever makes it, lets go.
os.register_at_fork(after_in_child=_leave_run_dir_locks_to_the_parent)


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on an existing run directory for the rest of this process, or raise
    CheckpointError when another process holds it: a second `mmldlm train` on a run that is training
    would otherwise remove the first one's half-written checkpoint as stale, and both would write.
    The lock (flock on the directory) goes with the process, however it ends, and is not held by the
    processes it forks (see _leave_run_dir_locks_to_the_parent); taking it again in the same process
    is a no-op."""
    key = str(run_dir.resolve())
    if key in _HELD:
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"{run_dir}: another process is training in this run directory; wait for it to end, stop it, "
            f"or choose another train.run_dir"
        ) from None
    except OSError as err:  # a filesystem without flock (some network mounts): train on, unprotected
        os.close(fd)
        log.warning("%s: cannot lock the run directory (%s); a second training there would not be stopped", key, err)
        fd = -1
    _HELD[key] = fd
