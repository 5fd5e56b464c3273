"""A run's checkpoints, read: their layout, which one to continue from, whether one is whole, and
its weights in one process (sampling, evaluation, export, --init-from). Writing, loading into a
training run and rotating them is the manager's (mmldlm/training/checkpoint.py).

Layout of `RUN/checkpoints/` (one format whatever the number of processes; one process is world size 1):
    step-0000500/
        .metadata           torch.distributed.checkpoint's index: every tensor's global shape and
                            where each of its pieces lies in the shard files (relative names)
        __0_0.distcp ...    rank r's shard __r_0.distcp: under FSDP2 its slices of the weights, AdamW
                            moments and EMA; under DDP the replicated tensors are written once
                            ("model.*", "optim.state.*", "optim.param_groups.*", "ema.*" in .metadata)
        rank-00000.pt ...   rank r's own state: its RNG states
        trainer.pt          {"trainer": step, schedule, skip counters, data position (samples seen), ...,
                             "ema_num_averaged": updates in the EMA (when the run keeps one)}
        config.yaml         the resolved run config
        meta.json           step, world size, strategy, metrics line count, and "files": the size and
                            SHA-256 of every other file, each rank's taken by that rank at save time
        verified.json       written by the first load that verifies the checksums (`VERDICT`)
    latest                  text file naming the newest complete step directory
    abandoned-<time>/       checkpoints newer than the step a run was resumed from (CheckpointManager.continue_from)

Trust: `latest` is a record of the last save, not the truth. `find_latest` takes the newest
complete checkpoint that verifies (every file of the manifest has its size and its checksum) and says
which it skipped and why, and where `latest` disagreed. A kill between the rename and the pointer, a
deleted `latest` or a truncated file therefore never stops a run from continuing, nor sends it back to
an older step. Every load verifies the checksums first, named checkpoint or not (resume, sampling,
evaluation, export, --init-from: `verify`); hashing the base preset's 14.9 GB takes 12-24 s, so the
verdict is remembered beside the checkpoint and a file is read again only when it changed
(docs/benchmarks.md, "Verifying a checkpoint before its weights load").
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mmldlm.outputs import write_atomically
from mmldlm.runs.files import CheckpointError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{7})$")
# What every checkpoint holds; a checkpoint without a manifest (written before meta.json listed its
# files) is of the full-state format and is checked for those.
REQUIRED_FILES = ("meta.json", ".metadata", "trainer.pt")
FULL_STATE_FILES = ("model.safetensors", "optimizer.pt", "trainer.pt")
# The verdict of `verify` on a checkpoint whose checksums matched: each file's size, modification and
# change times and checksum when it was read whole. A file written to since has other times (the change
# time cannot be set back, not even by `touch -d`), and is read again; a copy of the checkpoint is too.
VERDICT = "verified.json"
# DCP warns at every save and load in one process, where no_dist=True is what is asked for.
SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def quiet_single_process_warning() -> None:
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def is_full_state(path: Path) -> bool:
    """A checkpoint of the earlier format: rank 0 wrote the gathered state (model.safetensors)."""
    return not (path / ".metadata").is_file() and (path / "model.safetensors").is_file()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def complete_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the renamed (complete) checkpoint directories in `checkpoint_dir`, ascending."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in checkpoint_dir.iterdir() if (m := STEP_DIR.match(p.name)))


def verify(path: Path, checksums: bool) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when it is whole: its meta.json reads,
    and every file its manifest lists has the size (with `checksums`, also the SHA-256) written at
    save time. A checkpoint from before the manifest is checked for its files only. With `checksums`,
    a file whose checksum matched and whose size and times have not changed since (the verdict
    remembered beside it, `VERDICT`) is not read again; a new verdict is remembered where the folder
    can be written."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return f"{meta_file} is missing"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not text at all
        return f"{meta_file} is not readable JSON ({err})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return f"{meta_file} is not a checkpoint's meta.json (no integer 'step')"
    manifest = meta.get("files") or {name: None for name in FULL_STATE_FILES}
    remembered = _remembered(path) if checksums else {}
    verified = {}
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if expected is None:
            continue
        stat = file.stat()  # before reading: a change while the file is hashed leaves other times
        if stat.st_size != expected["bytes"]:
            return f"{file} has {stat.st_size} bytes, {expected['bytes']} were written (truncated or replaced)"
        if not checksums:
            continue
        seen = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, **expected}
        if remembered.get(name) != seen and file_sha256(file) != expected["sha256"]:
            return f"{file} does not match the SHA-256 written in {meta_file} (corrupted)"
        verified[name] = seen
    if verified and verified != remembered:
        _remember(path, verified)
    return None


def _remembered(path: Path) -> dict:
    """The files of the checkpoint at `path` found whole before, by name: their size, modification and
    change times then, and the checksum they matched (nothing where there is no readable verdict)."""
    try:
        verdict = json.loads((path / VERDICT).read_text())
    except (OSError, ValueError):
        return {}
    return verdict.get("files", {}) if isinstance(verdict, dict) else {}


def _remember(path: Path, verified: dict) -> None:
    """Write the verdict beside the checkpoint; a folder this process cannot write (another user's run, a
    read-only mount) keeps none, and its checksums are read at every load."""
    try:
        write_atomically(path / VERDICT, json.dumps({"files": verified}, indent=1) + "\n")
    except OSError as err:
        log.debug("%s: the verdict is not remembered (%s)", path / VERDICT, err)


def read_pointer(checkpoint_dir: Path) -> str | None:
    pointer = checkpoint_dir / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


RESUME_HINT = "start elsewhere (another train.run_dir) or resume from a checkpoint you trust with --resume PATH"


def find_latest(checkpoint_dir: Path, checksums: bool = False, hint: str = RESUME_HINT) -> Path | None:
    """The checkpoint to continue from in `checkpoint_dir`: the newest complete one that verifies.
    `latest` is only a record of the last save: a kill between a checkpoint's rename and the pointer's
    update leaves it one save behind, and after a resume from an older step the newer checkpoints were
    moved aside (CheckpointManager.continue_from). A warning names what was skipped and why, and a
    pointer that disagrees. None when there is no checkpoint at all; CheckpointError (ending with
    `hint`) when there are some and none verifies."""
    named = read_pointer(checkpoint_dir)
    skipped = []
    for step in reversed(complete_steps(checkpoint_dir)):
        path = checkpoint_dir / step_dir_name(step)
        reason = verify(path, checksums)
        if reason is not None:
            skipped.append(f"skipped {path.name}: {reason}")
            continue
        if path.name != named or skipped:
            pointer = f"latest names {named}" if named else "latest is missing"
            log.warning(
                "%s: %s; using the newest checkpoint that verifies, %s%s",
                checkpoint_dir,
                pointer,
                path.name,
                "".join(f"; {s}" for s in skipped),
            )
        return path
    if skipped:
        raise CheckpointError(f"{checkpoint_dir}: no checkpoint verifies ({'; '.join(skipped)}); {hint}")
    return None


def saved_keys(path: Path) -> set[str]:
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def read_weights(path: Path, which: str = "model") -> dict[str, torch.Tensor]:
    """The whole weights ("model" or "ema") of the checkpoint at `path`, in this one process,
    whatever the number of processes that wrote it (sampling, evaluation, export). A checkpoint of
    the full-state format is read from its safetensors file."""
    if is_full_state(path):
        return load_file(str(path / f"{which}.safetensors"))
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = f"{which}."
    state = {
        key[len(prefix) :]: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{path}: holds no {which} weights")
    quiet_single_process_warning()
    dcp.load({which: state}, checkpoint_id=str(path), no_dist=True)
    return state


def has_ema(path: Path) -> bool:
    if is_full_state(path):
        return (path / "ema.safetensors").is_file()
    return any(key.startswith("ema.") for key in saved_keys(path))
