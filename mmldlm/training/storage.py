"""Writing a run's files: the error of a write that failed (`mmldlm` prints it as one line, exit
status 2) and what it says, the free space where a path is or will be, and the lock that claims a run
directory."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

from mmldlm.errors import UserError
from mmldlm.runs.files import CheckpointError

log = logging.getLogger(__name__)


class WriteError(UserError, RuntimeError):
    """A run file (checkpoint, metrics.jsonl) could not be written whole; what was half-written is removed."""


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


def unlock_run_dir(run_dir: Path) -> None:
    """Let go of the lock that `lock_run_dir` took on `run_dir` (where it is removed again)."""
    fd = _HELD.pop(str(run_dir.resolve()), -1)
    if fd >= 0:
        os.close(fd)
