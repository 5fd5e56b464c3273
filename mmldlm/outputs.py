"""Replacing a folder that mmldlm wrote (`mmldlm prepare --overwrite`, `mmldlm export --force`): the one
place that decides what a command may delete. A folder is replaced only when it is empty, or when it is
the kind of folder the command writes (its marker file, a JSON object with a format_version) and holds
nothing but the files mmldlm writes there; anything else is refused with the files a user would lose.
The new folder is written beside the old one under a temporary name and swapped in by renames, so a
failure before the swap leaves the old one as it was."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmldlm.errors import UserError

NAMES_SHOWN = 3  # a refusal names this many of the foreign files, then counts the rest
ELSEWHERE = "choose another --out or remove it yourself"  # what a refusal tells the user to do


@dataclass(frozen=True)
class FolderKind:
    """What mmldlm writes in one kind of output folder."""

    name: str  # "a prepared dataset"
    marker: str  # the file that says the folder is this kind: a JSON object with a format_version
    written: re.Pattern  # the paths (relative, '/'-separated) of the files mmldlm writes there

    def is_marked(self, folder: Path) -> bool:
        """Whether `folder` is of this kind: its marker holds a format_version, or (a damaged marker, which
        the refusals of a damaged folder tell to replace) the marker is there beside other files of the kind."""
        try:
            content = json.loads((folder / self.marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            content = None
        if isinstance(content, dict) and "format_version" in content:
            return True
        ours = [f for f in files_under(folder) if self.written.fullmatch(f)]
        return (folder / self.marker).is_file() and len(ours) > 1


def files_under(folder: Path) -> list[str]:
    """The files under `folder`, as sorted relative '/'-separated paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())


def foreign_files(folder: Path, kind: FolderKind, marked: bool = True) -> list[str]:
    """The files under `folder` (relative paths) that mmldlm did not write there: all of them when
    `marked` is asked for and the folder is not of the kind (FolderKind.is_marked)."""
    files = files_under(folder)
    if marked and files and not kind.is_marked(folder):
        return files
    return [f for f in files if not kind.written.fullmatch(f)]


def refuse_foreign(out: Path, kind: FolderKind, alternative: str = ELSEWHERE, marked: bool = True) -> None:
    """UserError unless `out` is missing, an empty folder, or a folder of `kind` holding only what mmldlm
    writes there; the message names what the user would lose and never suggests a flag that deletes it."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise UserError(f"refusing to replace {out}: it is a file that mmldlm did not write; {alternative}")
    foreign = foreign_files(out, kind, marked)
    if foreign:
        shown = ", ".join(foreign[:NAMES_SHOWN])
        more = f" and {len(foreign) - NAMES_SHOWN} more" if len(foreign) > NAMES_SHOWN else ""
        count = f"{len(foreign)} file{'s' if len(foreign) > 1 else ''}"
        what = "" if kind.is_marked(out) or not marked else f" is not {kind.name} ({kind.marker}) and"
        raise UserError(
            f"refusing to replace {out}:{what} it holds {shown}{more} ({count}) that mmldlm did not write; "
            f"{alternative}"
        )


def as_umask_allows(path: Path) -> None:
    """Give the file or folder `path` the permissions open() or mkdir() give under this process's umask.
    tempfile's folders (0700) and safetensors' files (0600) are private whatever the umask says, and a model
    meant to be shared must be readable by others wherever the umask lets it be."""
    umask = os.umask(0)  # reading the umask sets it: put it back at once
    os.umask(umask)
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def write_atomically(path: Path, content: str | Callable) -> None:
    """Write `path` whole or not at all: `content` (text, or a function writing into a binary file) goes
    into `.NAME.tmp` beside it, renamed over it when written, so no reader (nor a kill) sees half a file.
    The file gets the permissions open() gives under the umask, as any other file written here."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            with open(tmp, "wb") as f:
                content(f)
        os.replace(tmp, path)
    except BaseException:  # a failure or a signal midway: no half file beside it either
        tmp.unlink(missing_ok=True)
        raise


def publish(partial: Path, out: Path, kind: FolderKind) -> None:
    """Move the finished folder `partial` onto `out` by renames, so `out` is never half written. An existing
    `out` is checked again (files may have come since the work began), renamed aside, then removed."""
    refuse_foreign(out, kind)
    if not out.exists():
        partial.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old)  # onto the empty folder just made: a name no one else holds
    partial.rename(out)
    shutil.rmtree(old)
