"""One checkpoint manager: save, find, load, rotate, optionally in the background.

Layout of `RUN/checkpoints/`:
    step-0000500/
        model.safetensors   full (unsharded) model weights, fp32
        ema.safetensors     the EMA of the weights (train.ema_decay > 0), same names; sample and eval
                            use it by default
        optimizer.pt        full AdamW state keyed by parameter name
        trainer.pt          {"trainer": step, schedule, skip counters, ...,
                             "ranks": [per-rank RNG states and data position, by rank],
                             "ema_num_averaged": updates in the EMA (with ema.safetensors)}
        config.yaml         the resolved run config
        meta.json           step, world size, metrics line count, and "files": the size and SHA-256
                            of every other file, taken at save time
    latest                  text file naming the newest complete step directory
    abandoned-<time>/       checkpoints newer than the step a run was resumed from (see `continue_from`)

Atomicity: everything is written into `.tmp-step-0000500/`, flushed, and only then renamed to
`step-0000500/` (a rename within one directory is atomic), and `latest` is replaced atomically after
that. A stale `.tmp-*` directory (a kill during a write) is removed on the next start; a write that
fails (a full disk) removes its own. Old checkpoints are pruned only after `latest` moved on, and
never the one `latest` names.

Trust: `latest` is a record of the last save, not the truth. `find_latest` takes the newest
complete checkpoint that verifies (every file of the manifest has its size, and on resume its
checksum) and says which it skipped and why, and where `latest` disagreed. A kill between the
rename and the pointer, a deleted `latest` or a truncated file therefore never stops a run from
continuing, nor sends it back to an older step.

Collectives happen on every rank and in the foreground: the full state dicts are gathered (FSDP2
shards are all-gathered, cpu_offload puts the result on rank 0's CPU) and the small per-rank states
are gathered to rank 0. Rank 0 alone writes, so an asynchronous save needs no cross-rank
coordination: the snapshot is copied to CPU memory and a background thread writes it while training
goes on. Before the next snapshot the previous write is awaited, so two writes never overlap.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mmldlm.config import CheckpointConfig, save_config
from mmldlm.device import describe_device
from mmldlm.training.distributed import DistInfo, collective_guard
from mmldlm.training.storage import CheckpointError, WriteError, free_bytes, lock_run_dir, write_failure

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{7})$")
# What every checkpoint holds, also one written before meta.json listed its files.
REQUIRED_FILES = ("meta.json", "model.safetensors", "optimizer.pt", "trainer.pt")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _cpu_copy(tree):
    """A deep copy of a state tree with every tensor in (private) CPU memory: the snapshot must not
    change while the model trains on."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu_copy(v) for v in tree)
    return tree


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _contiguous(state: dict) -> dict:
    return {k: v.contiguous() for k, v in state.items()}


def _tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def complete_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the renamed (complete) checkpoint directories in `checkpoint_dir`, ascending."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in checkpoint_dir.iterdir() if (m := STEP_DIR.match(p.name)))


def verify(path: Path, checksums: bool) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when it is whole: its meta.json reads,
    and every file its manifest lists has the size (with `checksums`, also the SHA-256) written at
    save time. A checkpoint from before the manifest is checked for its files only."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return f"{meta_file} is missing"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not text at all
        return f"{meta_file} is not readable JSON ({err})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return f"{meta_file} is not a checkpoint's meta.json (no integer 'step')"
    manifest = meta.get("files") or {name: None for name in REQUIRED_FILES[1:]}
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if expected is None:
            continue
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{file} has {size} bytes, {expected['bytes']} were written (truncated or replaced)"
        if checksums and _sha256(file) != expected["sha256"]:
            return f"{file} does not match the SHA-256 written in {meta_file} (corrupted)"
    return None


def _read_pointer(checkpoint_dir: Path) -> str | None:
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
    named = _read_pointer(checkpoint_dir)
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


def _torch_save(obj, path: Path) -> None:
    """torch.save, with a failed write raised as the OSError it is: torch's writer reports one as a
    RuntimeError without the errno ("unexpected pos ..."), so a full disk is recognised by the space
    left where the file was being written."""
    try:
        torch.save(obj, path)
    except RuntimeError as err:
        if free_bytes(path.parent) < 2**20:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({err})") from err
        raise OSError(f"torch.save failed: {err}") from err


def _load_optimizer_state(model, optimizer, saved: dict) -> None:
    """Load a full optimizer state dict (parameter names as keys) into `optimizer`, the parameters
    the checkpoint holds no state for included. AdamW makes a parameter's state at its first gradient,
    so a checkpoint of the first steps lacks those that no mode has trained yet (the text head after
    t2l steps): hence not strict (the model was loaded strictly, so the parameters are the same).
    set_optimizer_state_dict first gives every parameter a state (a zero-gradient step: step 1, zero
    moments); the ones the checkpoint has none for are dropped again, to be made at their first
    gradient as in the run that wrote it (else their bias correction would be one step off)."""
    names_by_group = [group["params"] for group in saved["param_groups"]]
    saved_names = set(saved["state"])
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True, strict=False))
    for group, names in zip(optimizer.param_groups, names_by_group, strict=True):
        for param, name in zip(group["params"], names, strict=True):
            if name not in saved_names:
                optimizer.state.pop(param, None)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, info: DistInfo):
        self.cfg = cfg
        self.info = info
        self.dir = Path(run_dir) / "checkpoints"  # made by the first write, not before the run starts
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def claim(self) -> None:
        """Take the run directory for this process, on the main rank, before anything of the run is
        changed: create and lock it (another process training there is refused, see lock_run_dir),
        then remove the `.tmp-*` that a kill during a write left, which only now are surely stale."""
        if not self.info.is_main:
            return
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        lock_run_dir(self.dir.parent)
        for stale in self.dir.glob(".tmp-step-*"):
            shutil.rmtree(stale)

    # ---------------------------------------------------------------- finding

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return complete_steps(self.dir)

    def latest(self) -> Path | None:
        """The checkpoint to continue from (see `find_latest`), sizes verified."""
        return find_latest(self.dir)

    def resolve(self, resume: str | None) -> Path | None:
        """`None`/"none": start fresh; "auto": the newest checkpoint that verifies, if any; else a
        checkpoint path, which must verify. Decided on rank 0 (checksums read once) and broadcast,
        so every rank loads the same checkpoint or raises the same CheckpointError."""
        if resume in (None, "none"):
            return None
        decision = [None, None]  # (path, error)
        if self.info.is_main:
            try:
                path = find_latest(self.dir, checksums=True) if resume == "auto" else self._check_path(resume)
                decision[0] = str(path) if path is not None else None
            except CheckpointError as err:
                decision[1] = str(err)
        if self.info.distributed:
            with collective_guard("checkpoint choice", self.info):
                dist.broadcast_object_list(decision, src=0)
        if decision[1] is not None:
            raise CheckpointError(decision[1])
        return Path(decision[0]) if decision[0] is not None else None

    def _check_path(self, resume: str) -> Path:
        path = Path(resume)
        expected = (
            f"expected a checkpoint directory holding {', '.join(REQUIRED_FILES)}, such as "
            f"{self.dir}/step-NNNNNNN (or --resume auto)"
        )
        if not path.is_dir():
            raise CheckpointError(f"--resume {resume}: no such directory; {expected}")
        reason = verify(path, checksums=True)
        if reason is not None:
            raise CheckpointError(f"--resume {resume}: {reason}; {expected}")
        return path

    def continue_from(self, path: Path, step: int) -> None:
        """After resuming from `path` (at `step`), the checkpoints of later steps describe a
        continuation this run abandons: they move, whole, to RUN/checkpoints/abandoned-<time>/, out of
        retention's reach and out of `latest`'s, and `latest` names `path` when it is one of this run's."""
        if not self.info.is_main:
            return
        newer = [s for s in self.steps() if s > step]
        if newer:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            abandoned, n = self.dir / f"abandoned-{stamp}", 1
            while abandoned.exists():  # two resumes within a second
                n += 1
                abandoned = self.dir / f"abandoned-{stamp}-{n}"
            abandoned.mkdir()
            # All or none: a SIGINT/SIGTERM waits until every later checkpoint has moved, or a
            # `--resume auto` after it would continue the abandoned continuation with steps missing.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                for s in newer:
                    os.replace(self.dir / step_dir_name(s), abandoned / step_dir_name(s))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            log.warning(
                "resumed from step %d: moved the checkpoints of later steps (%s) to %s; they belong to "
                "the continuation this run replaces",
                step,
                ", ".join(map(str, newer)),
                abandoned,
            )
        if path.resolve().parent == self.dir.resolve() and _read_pointer(self.dir) != path.name:
            self._point_latest(path.name)

    def last_good(self) -> str:
        """The checkpoint a run would continue from now, in words (for error messages)."""
        named = _read_pointer(self.dir)
        if named is None or not (self.dir / named).is_dir():
            return "no checkpoint was written yet"
        return f"the last good checkpoint is {self.dir / named}"

    def warn_if_retention_cannot_fit(self, checkpoint_bytes: int) -> None:
        """A warning at start-up when keeping checkpoint.keep_last checkpoints of about
        `checkpoint_bytes` each, plus the one being written, needs more than the disk has free."""
        if not self.info.is_main:
            return
        on_disk = len(self.steps()[-self.cfg.keep_last :])
        need = (self.cfg.keep_last + 1 - on_disk) * checkpoint_bytes
        free = free_bytes(self.dir)
        if need > free:
            log.warning(
                "checkpoints of about %.2f GiB each: checkpoint.keep_last=%d (+1 being written) needs "
                "%.2f GiB more, %.2f GiB are free at %s; a save will fail with a full disk (lower "
                "checkpoint.keep_last or free space)",
                checkpoint_bytes / 2**30,
                self.cfg.keep_last,
                need / 2**30,
                free / 2**30,
                self.dir,
            )

    # ---------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        model,
        optimizer,
        trainer_state: dict,
        rank_state: dict,
        config,
        metrics_lines: int,
        *,
        blocking: bool = False,
        ema=None,
    ) -> None:
        """Checkpoint after `step` optimizer steps. Call on every rank. Asynchronous when
        checkpoint.async_save is on, unless `blocking` (the final and the signal-triggered save).
        `ema`: the run's WeightEMA, if any."""
        self.wait()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with collective_guard(f"checkpoint gather of step {step}", self.info):
            model_state = get_model_state_dict(model, options=options)
            optim_state = get_optimizer_state_dict(model, optimizer, options=options)
            ema_state = get_model_state_dict(ema.module, options=options) if ema is not None else None
            rank_states = [None] * self.info.world_size if self.info.is_main else None
            if self.info.distributed:
                dist.gather_object(rank_state, rank_states, dst=0)
            else:
                rank_states = [rank_state]
        if not self.info.is_main:
            return
        trainer = {"trainer": trainer_state, "ranks": rank_states}
        if ema is not None:
            trainer["ema_num_averaged"] = ema.num_averaged
        snapshot = _cpu_copy({"model": model_state, "optimizer": optim_state, "ema": ema_state, "trainer": trainer})
        meta = {
            "step": step,
            "world_size": self.info.world_size,
            "metrics_lines": metrics_lines,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # What trained it, for a model card: the device's name and the training wall-clock time.
            "device": describe_device(self.info.device),
            "wall_seconds": trainer_state.get("wall_seconds"),
        }
        if self.cfg.async_save and not blocking:
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, snapshot, meta, config), name="checkpoint-writer", daemon=False
            )
            self._thread.start()
        else:
            self._write(step, snapshot, meta, config)

    def wait(self) -> None:
        """Block until a background write is done; re-raise its error here, on the training thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, WriteError):
                raise error
            raise RuntimeError(f"writing a checkpoint in the background failed: {error}") from error

    def raise_background_error(self) -> None:
        """Called after every step: a background write that has failed is reported now, not at the next save."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err

    def _write(self, step: int, snapshot: dict, meta: dict, config) -> None:
        name = step_dir_name(step)
        final = self.dir / name
        tmp = self.dir / f".tmp-{name}"
        # safetensors refuses tensors that share memory; the CPU copy gave each its own.
        files = {"model.safetensors": lambda f: save_file(_contiguous(snapshot["model"]), str(f))}
        if snapshot["ema"] is not None:
            files["ema.safetensors"] = lambda f: save_file(_contiguous(snapshot["ema"]), str(f))
        files["optimizer.pt"] = lambda f: _torch_save(snapshot["optimizer"], f)
        files["trainer.pt"] = lambda f: _torch_save(snapshot["trainer"], f)
        files["config.yaml"] = lambda f: save_config(config, f)
        file = tmp
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._check_free_space(name, _tensor_bytes(snapshot))
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            manifest = {}
            for file_name, write in files.items():
                file = tmp / file_name
                write(file)
                manifest[file_name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
            file = tmp / "meta.json"
            file.write_text(json.dumps({**meta, "files": manifest}, indent=1) + "\n")
            for written in tmp.iterdir():
                with open(written, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
        except (OSError, SafetensorError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteError(
                f"{write_failure(err, file)}; the partial checkpoint was removed, "
                f"{self.last_good()}; free space, then continue with --resume auto"
            ) from err
        if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        try:
            self._point_latest(name)
        except OSError as err:  # the checkpoint is whole; --resume auto finds it without the pointer
            raise WriteError(
                f"{write_failure(err, self.dir / 'latest')}; {final} is complete and --resume auto continues from it"
            ) from err
        self._prune()
        log.info("checkpoint: wrote %s", final)

    def _check_free_space(self, name: str, num_bytes: int) -> None:
        free = free_bytes(self.dir)
        if num_bytes > free:
            raise WriteError(
                f"not enough space for checkpoint {name} in {self.dir}: it needs about "
                f"{num_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free; nothing was "
                f"written, {self.last_good()}; free space, then continue with --resume auto"
            )

    def _point_latest(self, name: str) -> None:
        pointer_tmp = self.dir / "latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, self.dir / "latest")
        _fsync_dir(self.dir)

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints, every milestone (step % milestone_every == 0) and,
        whatever else holds, the one `latest` names."""
        steps = self.steps()
        keep = {step_dir_name(s) for s in steps[-self.cfg.keep_last :]}
        if self.cfg.milestone_every:
            keep |= {step_dir_name(s) for s in steps if s % self.cfg.milestone_every == 0}
        keep.add(_read_pointer(self.dir))
        for step in steps:
            if step_dir_name(step) not in keep:
                shutil.rmtree(self.dir / step_dir_name(step))

    # ---------------------------------------------------------------- loading

    def load(self, path: Path, model, optimizer, ema=None) -> tuple[dict, dict, dict]:
        """Load weights and optimizer state into (possibly wrapped) `model` / `optimizer`, and the EMA
        into `ema` if given, on every rank; returns (meta, trainer_state, this rank's state). A
        checkpoint without an EMA restarts the average from the weights at the next update."""
        meta = json.loads((path / "meta.json").read_text())
        if meta["world_size"] != self.info.world_size:
            raise CheckpointError(
                f"checkpoint {path} was written by {meta['world_size']} processes, this run has "
                f"{self.info.world_size}: the per-rank RNG states and data positions do not map; resume "
                f"with the same number of processes"
            )
        options = StateDictOptions(full_state_dict=True)
        with collective_guard(f"checkpoint load of {path.name}", self.info):
            set_model_state_dict(model, load_file(str(path / "model.safetensors")), options=options)
            _load_optimizer_state(model, optimizer, torch.load(path / "optimizer.pt", weights_only=True))
            has_ema = (path / "ema.safetensors").is_file()
            if ema is not None and has_ema:
                set_model_state_dict(ema.module, load_file(str(path / "ema.safetensors")), options=options)
        state = torch.load(path / "trainer.pt", weights_only=True)
        if ema is not None:
            ema.averaged.n_averaged.fill_(state.get("ema_num_averaged", 0) if has_ema else 0)
            if not has_ema and self.info.is_main:
                log.warning(
                    "checkpoint %s holds no EMA of the weights; the average starts again from the "
                    "weights at the next step",
                    path,
                )
        return meta, state["trainer"], state["ranks"][self.info.rank]
