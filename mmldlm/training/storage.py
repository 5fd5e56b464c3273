"""A run's files on disk: the errors the user acts on (`mmldlm` prints each as one line, exit status
2), what a failed write says, and the free space where a path is or will be. Imports nothing heavy,
so the command line can catch these errors without loading torch."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: not a checkpoint, incomplete, corrupt, from another world size."""


class WriteError(RuntimeError):
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


def is_disk_full(err: BaseException) -> bool:
    """An OSError with ENOSPC, or safetensors' error, which carries the OS error only in its text
    ('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')."""
    return getattr(err, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(err)


def write_failure(err: BaseException, path: Path) -> str:
    """What went wrong writing `path`, in the user's words: a full disk is named as such, with its mount."""
    if is_disk_full(err):
        return f"no space left on device {_mount_point(path)} while writing {path}"
    return f"writing {path} failed: {err}"
