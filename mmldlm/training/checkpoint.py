"""One checkpoint manager: save, find, load, rotate, optionally in the background. The layout of
`RUN/checkpoints/`, finding the checkpoint to continue from and reading weights outside training are
mmldlm/runs/checkpoints.py's.

Writing: every rank writes its own shard with `torch.distributed.checkpoint` (DCP) into
`.tmp-step-0000500/`, then its own small file, and hashes the files it wrote; the lists are gathered
to rank 0, which writes meta.json last, flushes, renames the directory to `step-0000500/` (a rename
within one directory is atomic) and then replaces `latest` atomically. No rank ever holds the whole
state: this is what lets a model whose state does not fit one host checkpoint at all. Before writing,
rank 0 checks the free space for the whole checkpoint and every rank hears its verdict. A stale
`.tmp-*` directory (a kill during a write) is removed on the next start; a write that fails (a full
disk) removes its own. Old checkpoints are pruned only after `latest` moved on, and never the one
`latest` names.

Asynchronous (checkpoint.async_save): `save` returns at once. A staging thread copies the state to
CPU memory (DCP's DefaultStager with background staging) while the next forward and backward run; the
trainer calls `wait_for_snapshot` before the next update changes the weights, moments or EMA, so the
copy is the state of the step saved. A writer thread then plans and writes the shards over a gloo
process group of its own (the training group may be NCCL, and must stay free for the training
collectives), and the rest (small files, checksums, meta.json, rename, `latest`, pruning) runs in that
thread when the write completes. The next save and the end of the run wait for it; its failure is
raised on the training thread after the step it is noticed in.

Loading: `dcp.load` into the state dicts of the model and optimizer of the *current* run, then
`set_state_dict`: DCP reads for each rank the pieces its own shards need, so a checkpoint written by
2 processes resumes on 1 or 4, and DDP on FSDP2 and back. The per-rank RNG states are restored only
on the same number of processes (the trainer derives them otherwise). Sampling, evaluation and
export read the weights in one process (`read_weights` in mmldlm/runs/checkpoints.py). Checkpoints of
the earlier full-state format (model.safetensors, optimizer.pt) are still read for sampling and
export, not for resuming training.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mmldlm.config import CheckpointConfig, save_config
from mmldlm.device import describe_device
from mmldlm.outputs import write_atomically
from mmldlm.runs.checkpoints import (
    REQUIRED_FILES,
    complete_steps,
    file_sha256,
    find_latest,
    is_full_state,
    quiet_single_process_warning,
    read_pointer,
    saved_keys,
    step_dir_name,
    verify,
)
from mmldlm.runs.files import CheckpointError
from mmldlm.training.distributed import DistInfo, collective_guard
from mmldlm.training.storage import WriteError, free_bytes, lock_run_dir, unlock_run_dir, write_failure

log = logging.getLogger(__name__)

# The flat optimizer state dict ("state.NAME.exp_avg", "param_groups.NAME.lr"): DCP stores each entry
# under its own key, so a parameter the checkpoint holds no state for is told by a missing key.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# checkpoint.every_minutes reads the clock on every this many steps: a step is well under a minute, and
# the broadcast that makes the ranks agree is paid once per this many steps.
CLOCK_CHECK_STEPS = 10


def _background_stager(device: torch.device) -> DefaultStager:
    """DCP's stager copying the state to CPU memory in a thread of its own; pinned memory and
    non-blocking copies where the state lives on a GPU. Shared memory is for a writer process, and the
    writer here is a thread."""
    cuda = device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
    )


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_checkpoint(path: Path, attempts: int = 3) -> None:
    """Remove the complete checkpoint at `path`. A process loading it meanwhile (sample, eval) may write its
    verdict into it (VERDICT in mmldlm/runs/checkpoints.py): rmtree then fails on the file it did not list,
    or on the temporary one it listed, already renamed, and is run again."""
    for attempt in range(attempts):
        try:
            shutil.rmtree(path)
            return
        except OSError as err:
            if not path.exists():
                return
            if err.errno not in (errno.ENOTEMPTY, errno.ENOENT) or attempt == attempts - 1:
                raise


def _tensor_bytes(tree) -> int:
    """Bytes of every tensor in a state tree; a DTensor counts with its global size, so on any rank
    this is the size of the whole checkpoint."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


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


def training_state_dict(model, optimizer, ema=None) -> dict:
    """What DCP saves and loads: {"model", "optim", "ema"}, each rank's view (FSDP2: DTensor shards;
    DDP: whole tensors). On an optimizer with no state yet (a fresh run, before loading) torch first
    gives every parameter one (a step with zero gradients and lr 0), so there is a tensor to load into."""
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema.module)
    return state


def _drop_unsaved_optimizer_state(model, optimizer, saved: set[str]) -> None:
    """AdamW makes a parameter's state at its first gradient, so a checkpoint of the first steps lacks
    those that no mode has trained yet (the text head after t2l steps). Loading kept the zero state
    torch made for them (training_state_dict); it is dropped again, to be made at their first gradient
    as in the run that wrote it (else their bias correction would be one step off)."""
    names_by_group = [group["params"] for group in get_optimizer_state_dict(model, optimizer)["param_groups"]]
    for group, names in zip(optimizer.param_groups, names_by_group, strict=True):
        for param, name in zip(group["params"], names, strict=True):
            if f"optim.state.{name}.step" not in saved:
                optimizer.state.pop(param, None)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, info: DistInfo):
        self.cfg = cfg
        self.info = info
        self.dir = Path(run_dir) / "checkpoints"  # made by the first write, not before the run starts
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: futures.Future | None = None  # an asynchronous save's copy of the state, until it is done
        self._made_run_dir = False  # claim created the run directory (unclaim may remove it again)
        # The checkpoint's own process group (gloo: CPU tensors, and a background write must not
        # share the training group's queue); made now, as every rank builds its manager at the same point.
        self._group = dist.new_group(backend="gloo") if info.distributed else None
        # checkpoint.every_minutes: rank 0's clock, broadcast over a gloo group of its own (a background
        # write may be using the one above) so that every rank saves at the same step.
        self._clock_group = dist.new_group(backend="gloo") if info.distributed and cfg.every_minutes else None
        self._saved_at = time.monotonic()
        if not info.distributed:
            quiet_single_process_warning()

    def claim(self) -> None:
        """Take the run directory for this process, on the main rank, before anything of the run is
        changed: create and lock it (another process training there is refused, see lock_run_dir),
        then remove the `.tmp-*` that a kill during a write left, which only now are surely stale."""
        if not self.info.is_main:
            return
        self._made_run_dir = not self.dir.parent.exists()
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        lock_run_dir(self.dir.parent)
        for stale in self.dir.glob(".tmp-step-*"):
            shutil.rmtree(stale)

    def unclaim(self) -> None:
        """Undo `claim` for a start that failed before the run wrote anything: the run directory that
        claim made is removed again where it is still empty (a refused start leaves no trace)."""
        run_dir = self.dir.parent
        if self.info.is_main and self._made_run_dir and not any(run_dir.iterdir()):
            unlock_run_dir(run_dir)
            run_dir.rmdir()

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
        if reason is not None and not (path / "meta.json").exists():  # an exported folder, a run directory
            expected += (
                f"; to start a new run from the weights of another run, a checkpoint or an exported model, "
                f"use --init-from {resume}"
            )
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
        if path.resolve().parent == self.dir.resolve() and read_pointer(self.dir) != path.name:
            self._point_latest(path.name)

    def last_good(self) -> str:
        """The checkpoint a run would continue from now, in words (for error messages)."""
        named = read_pointer(self.dir)
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

    def due(self, step: int) -> bool:
        """Whether to save after `step` optimizer steps: a multiple of checkpoint.every, or, on every
        CLOCK_CHECK_STEPS-th step, checkpoint.every_minutes since the last save by rank 0's clock. Call on
        every rank. The clock's verdict is a one-byte CPU broadcast: no device work, no host sync."""
        if step % self.cfg.every == 0:
            return True
        if not self.cfg.every_minutes or step % CLOCK_CHECK_STEPS:
            return False
        late = torch.tensor([time.monotonic() - self._saved_at >= 60 * self.cfg.every_minutes], dtype=torch.uint8)
        if self._clock_group is not None:
            dist.broadcast(late, src=0, group=self._clock_group)
        return bool(late.item())

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
        dataset: str | None = None,
    ) -> None:
        """Checkpoint after `step` optimizer steps. Call on every rank. Asynchronous when
        checkpoint.async_save is on, unless `blocking` (the final and the signal-triggered save).
        `ema`: the run's WeightEMA, if any. `rank_state` is this rank's own; the rest is the same on
        every rank and rank 0's is written. `dataset`: the directory of the dataset it trained on."""
        self.wait()
        self._saved_at = time.monotonic()
        name = step_dir_name(step)
        tmp = self.dir / f".tmp-{name}"
        with collective_guard(f"checkpoint state of step {step}", self.info):
            state = training_state_dict(model, optimizer, ema)
            self._prepare(tmp, name, _tensor_bytes(state))
        trainer = {"trainer": trainer_state}
        if ema is not None:
            trainer["ema_num_averaged"] = ema.num_averaged
        meta = {
            "step": step,
            "world_size": self.info.world_size,
            "strategy": config.distributed.strategy if self.info.distributed else "single",
            "metrics_lines": metrics_lines,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # What trained it, for a model card: the device's name and the training wall-clock time.
            "device": describe_device(self.info.device),
            "wall_seconds": trainer_state.get("wall_seconds"),
            # Where its data was (data.path null: the cache entry it was prepared into), so that
            # sampling and evaluation find it whatever the cache's environment then.
            "dataset": dataset,
        }
        small = {rank_file_name(self.info.rank): lambda f: _torch_save(rank_state, f)}
        if self.info.is_main:
            small["trainer.pt"] = lambda f: _torch_save(trainer, f)
            small["config.yaml"] = lambda f: save_config(config, f)
        writer = dcp.FileSystemWriter(str(tmp))
        if self.cfg.async_save and not blocking:
            stager = _background_stager(self.info.device)
            try:  # returns at once: the copy to CPU memory and the write both run in the background
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self._group,
                    async_stager=stager,
                    no_dist=not self.info.distributed,
                )
            except CheckpointException as err:
                stager.close()
                self._fail(tmp, err)
            self._staging = response.staging_completion
            self._thread = threading.Thread(
                target=self._finish_guarded,
                args=(response.upload_completion, stager, tmp, small, meta),
                name="checkpoint-writer",
                daemon=False,
            )
            self._thread.start()
        else:
            try:
                dcp.save(state, storage_writer=writer, process_group=self._group, no_dist=not self.info.distributed)
            except CheckpointException as err:
                self._fail(tmp, err)
            self._finish(tmp, small, meta)

    def _prepare(self, tmp: Path, name: str, num_bytes: int) -> None:
        """On rank 0: check the free space for the whole checkpoint and make an empty `tmp`; every
        rank hears the verdict, so all write or all raise the same WriteError."""
        verdict = [None]
        if self.info.is_main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._check_free_space(name, num_bytes)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except WriteError as err:
                verdict[0] = str(err)
            except OSError as err:
                verdict[0] = f"{write_failure(err, tmp)}; nothing was written, {self.last_good()}"
        if self.info.distributed:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise WriteError(verdict[0])

    def _fail(self, tmp: Path, err: BaseException, file: Path | None = None):
        """Remove the partial checkpoint and raise the WriteError that says what happened and what is left.
        A failure inside DCP comes as a CheckpointException listing each rank's error; the first names
        the shard: the rank's __r_0.distcp, unless the OS error carries its own file name."""
        if isinstance(err, CheckpointException):
            rank, (err, _) = min(err.failures.items())
            file = Path(err.filename) if getattr(err, "filename", None) else tmp / f"__{rank}_0.distcp"
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(
            f"{write_failure(err, file or tmp)}; the partial checkpoint was removed, "
            f"{self.last_good()}; free space, then continue with --resume auto"
        ) from err

    def _finish_guarded(self, future, stager, *args) -> None:
        try:
            try:
                future.result()
            except CheckpointException as err:
                self._fail(args[0], err)
            finally:
                stager.close()  # frees the staged copy
            self._finish(*args)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err

    def _finish(self, tmp: Path, small: dict, meta: dict) -> None:
        """After the shards are written: every rank writes its small files and hashes what it wrote;
        the lists go to every rank (a failure stops them all), and rank 0 writes meta.json, renames,
        moves `latest` and prunes."""
        files, failure = {}, None
        file = tmp
        try:
            for file_name, write in small.items():
                file = tmp / file_name
                write(file)
            own = [tmp / n for n in small] + sorted(tmp.glob(f"__{self.info.rank}_*.distcp"))
            if self.info.is_main:
                own.append(tmp / ".metadata")
            for file in own:
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
                files[file.name] = {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
        except OSError as err:
            failure = write_failure(err, file)
        # Every rank hears every rank's failure: all stop at the same step, none waits on a dead peer.
        gathered = [None] * self.info.world_size
        if self.info.distributed:
            dist.all_gather_object(gathered, (files, failure), group=self._group)
        else:
            gathered = [(files, failure)]
        failures = [f for _, f in gathered if f is not None]
        if not self.info.is_main:
            if failures:
                raise WriteError(f"{failures[0]}; rank 0 removes the partial checkpoint, {self.last_good()}")
            return
        manifest = dict(sorted(item for listed, _ in gathered for item in listed.items()))
        file = tmp / "meta.json"
        try:
            if failures:
                raise OSError(failures[0])
            file.write_text(json.dumps({**meta, "files": manifest}, indent=1) + "\n")
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            _fsync_dir(tmp)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            said = failures[0] if failures else write_failure(err, file)
            raise WriteError(
                f"{said}; the partial checkpoint was removed, {self.last_good()}; free space, then continue "
                f"with --resume auto"
            ) from err
        final = self.dir / tmp.name.removeprefix(".tmp-")
        if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
            _remove_checkpoint(final)
        os.replace(tmp, final)
        try:
            self._point_latest(final.name)
        except OSError as err:  # the checkpoint is whole; --resume auto finds it without the pointer
            raise WriteError(
                f"{write_failure(err, self.dir / 'latest')}; {final} is complete and --resume auto continues from it"
            ) from err
        self._prune()
        log.info("checkpoint: wrote %s", final)

    def wait_for_snapshot(self) -> None:
        """Block until an asynchronous save has copied the state it saves. Call before anything changes
        the weights, the optimizer's state or the EMA; the copy runs during the forward and backward
        after the save, so this is usually free. A failed copy is reported by `wait`, as is any failure
        of the write."""
        if self._staging is not None:
            futures.wait([self._staging])
            self._staging = None

    def wait(self) -> None:
        """Block until a background write is done; re-raise its error here, on the training thread."""
        self._staging = None
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

    def _check_free_space(self, name: str, num_bytes: int) -> None:
        free = free_bytes(self.dir)
        if num_bytes > free:
            raise WriteError(
                f"not enough space for checkpoint {name} in {self.dir}: it needs about "
                f"{num_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free; nothing was "
                f"written, {self.last_good()}; free space, then continue with --resume auto"
            )

    def _point_latest(self, name: str) -> None:
        write_atomically(self.dir / "latest", name + "\n")
        _fsync_dir(self.dir)

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints, every milestone (step % milestone_every == 0) and,
        whatever else holds, the one `latest` names."""
        steps = self.steps()
        keep = {step_dir_name(s) for s in steps[-self.cfg.keep_last :]}
        if self.cfg.milestone_every:
            keep |= {step_dir_name(s) for s in steps if s % self.cfg.milestone_every == 0}
        keep.add(read_pointer(self.dir))
        for step in steps:
            if step_dir_name(step) not in keep:
                _remove_checkpoint(self.dir / step_dir_name(step))

    # ---------------------------------------------------------------- loading

    def load(self, path: Path, model, optimizer, ema=None) -> tuple[dict, dict, dict | None]:
        """Load weights and optimizer state into (possibly wrapped) `model` / `optimizer`, and the EMA
        into `ema` if given, on every rank, resharded for this run's world size and strategy; returns
        (meta, trainer_state, this rank's state), the last None when the checkpoint was written by
        another number of processes. A checkpoint without an EMA restarts the average from the weights
        at the next update."""
        meta = json.loads((path / "meta.json").read_text())
        if is_full_state(path):
            raise CheckpointError(
                f"checkpoint {path} is of the earlier full-state format (model.safetensors, optimizer.pt), "
                f"which training no longer resumes from; sample, evaluate or export it, or resume it with "
                f"the mmldlm that wrote it"
            )
        saved = saved_keys(path)
        if "model.blocks.0.text.modulation.1.weight" in saved:
            raise CheckpointError(
                f"checkpoint {path} was written by an earlier mmldlm, whose blocks each had their own adaLN "
                f"modulation; training no longer resumes from it: sample, evaluate or export it, or start a "
                f"run from its weights with --init-from {path}"
            )
        with collective_guard(f"checkpoint load of {path.name}", self.info):
            state = training_state_dict(model, optimizer, ema)
            saved_ema = any(key.startswith("ema.") for key in saved)
            if not saved_ema:
                state.pop("ema", None)
            missing = sorted(f"{part}.{key}" for part in ("model", "ema") for key in state.get(part, {}))
            missing = [key for key in missing if key not in saved]
            if missing:
                raise CheckpointError(
                    f"checkpoint {path} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                    f"it is of another model; resume with the config it was written with ({path / 'config.yaml'})"
                )
            # Partial: the optimizer states of parameters that had none keep torch's zero ones, dropped below.
            dcp.load(
                state,
                checkpoint_id=str(path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                process_group=self._group,
                no_dist=not self.info.distributed,
            )
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=STATE_OPTIONS,
            )
            _drop_unsaved_optimizer_state(model, optimizer, saved)
            if "ema" in state:
                set_model_state_dict(ema.module, state["ema"])
        trainer = torch.load(path / "trainer.pt", weights_only=True)
        if ema is not None:
            ema.averaged.n_averaged.fill_(trainer.get("ema_num_averaged", 0) if saved_ema else 0)
            if not saved_ema and self.info.is_main:
                log.warning(
                    "checkpoint %s holds no EMA of the weights; the average starts again from the "
                    "weights at the next step",
                    path,
                )
        own = None
        if meta["world_size"] == self.info.world_size:
            own = torch.load(path / rank_file_name(self.info.rank), weights_only=True)
        return meta, trainer["trainer"], own
