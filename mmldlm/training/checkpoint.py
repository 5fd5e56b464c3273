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
        meta.json           step, world size, metrics line count
    latest                  text file naming the newest complete step directory

Atomicity: everything is written into `.tmp-step-0000500/`, flushed, and only then renamed to
`step-0000500/` (a rename within one directory is atomic), and `latest` is replaced atomically after
that. A kill at any moment therefore leaves `latest` naming a complete checkpoint; a stale `.tmp-*`
directory is removed on the next start. Old checkpoints are pruned only after `latest` moved on.

Collectives happen on every rank and in the foreground: the full state dicts are gathered (FSDP2
shards are all-gathered, cpu_offload puts the result on rank 0's CPU) and the small per-rank states
are gathered to rank 0. Rank 0 alone writes, so an asynchronous save needs no cross-rank
coordination: the snapshot is copied to CPU memory and a background thread writes it while training
goes on. Before the next snapshot the previous write is awaited, so two writes never overlap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from mmldlm.config import CheckpointConfig, save_config
from mmldlm.training.distributed import DistInfo, collective_guard

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{7})$")


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


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, info: DistInfo):
        self.cfg = cfg
        self.info = info
        self.dir = Path(run_dir) / "checkpoints"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if info.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".tmp-step-*"):  # left by a kill during a write
                shutil.rmtree(stale)

    # ---------------------------------------------------------------- finding

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := STEP_DIR.match(p.name)))

    def latest(self) -> Path | None:
        pointer = self.dir / "latest"
        if not pointer.is_file():
            return None
        return self.dir / pointer.read_text().strip()

    def resolve(self, resume: str | None) -> Path | None:
        """`None`/"none": start fresh; "auto": `latest` if there is one; else a checkpoint path."""
        if resume in (None, "none"):
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint directory "
                                    f"(expected {path}/meta.json); checkpoints live in {self.dir}/step-NNNNNNN")
        return path

    # ---------------------------------------------------------------- saving

    def save(self, step: int, model, optimizer, trainer_state: dict, rank_state: dict, config,
             metrics_lines: int, *, blocking: bool = False, ema=None) -> None:
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
        meta = {"step": step, "world_size": self.info.world_size, "metrics_lines": metrics_lines,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.cfg.async_save and not blocking:
            self._thread = threading.Thread(target=self._write_guarded, args=(step, snapshot, meta, config),
                                            name="checkpoint-writer", daemon=False)
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
            raise RuntimeError(f"writing a checkpoint in the background failed: {error}") from error

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as err:  # handed to the training thread by wait()
            self._error = err

    def _write(self, step: int, snapshot: dict, meta: dict, config) -> None:
        name = step_dir_name(step)
        final = self.dir / name
        tmp = self.dir / f".tmp-{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        # safetensors refuses tensors that share memory; the CPU copy gave each its own.
        save_file({k: v.contiguous() for k, v in snapshot["model"].items()}, str(tmp / "model.safetensors"))
        if snapshot["ema"] is not None:
            save_file({k: v.contiguous() for k, v in snapshot["ema"].items()}, str(tmp / "ema.safetensors"))
        torch.save(snapshot["optimizer"], tmp / "optimizer.pt")
        torch.save(snapshot["trainer"], tmp / "trainer.pt")
        save_config(config, tmp / "config.yaml")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.dir / "latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, self.dir / "latest")
        _fsync_dir(self.dir)
        self._prune()
        log.info("checkpoint: wrote %s", final)

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints plus every milestone (step % milestone_every == 0)."""
        steps = self.steps()
        keep = set(steps[-self.cfg.keep_last:])
        if self.cfg.milestone_every:
            keep |= {s for s in steps if s % self.cfg.milestone_every == 0}
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.dir / step_dir_name(step))

    # ---------------------------------------------------------------- loading

    def load(self, path: Path, model, optimizer, ema=None) -> tuple[dict, dict, dict]:
        """Load weights and optimizer state into (possibly wrapped) `model` / `optimizer`, and the EMA
        into `ema` if given, on every rank; returns (meta, trainer_state, this rank's state). A
        checkpoint without an EMA restarts the average from the weights at the next update."""
        meta = json.loads((path / "meta.json").read_text())
        if meta["world_size"] != self.info.world_size:
            raise RuntimeError(
                f"checkpoint {path} was written by {meta['world_size']} processes, this run has "
                f"{self.info.world_size}: the per-rank RNG states and data positions do not map; resume "
                f"with the same number of processes")
        options = StateDictOptions(full_state_dict=True)
        with collective_guard(f"checkpoint load of {path.name}", self.info):
            set_model_state_dict(model, load_file(str(path / "model.safetensors")), options=options)
            set_optimizer_state_dict(model, optimizer, torch.load(path / "optimizer.pt", weights_only=True),
                                     options=options)
            has_ema = (path / "ema.safetensors").is_file()
            if ema is not None and has_ema:
                set_model_state_dict(ema.module, load_file(str(path / "ema.safetensors")), options=options)
        state = torch.load(path / "trainer.pt", weights_only=True)
        if ema is not None:
            ema.averaged.n_averaged.fill_(state.get("ema_num_averaged", 0) if has_ema else 0)
            if not has_ema and self.info.is_main:
                log.warning("checkpoint %s holds no EMA of the weights; the average starts again from the "
                            "weights at the next step", path)
        return meta, state["trainer"], state["ranks"][self.info.rank]
