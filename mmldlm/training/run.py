"""`mmldlm train` as a library call: set up the process group, data, model and objective, then run
the loop. Used by the command (mmldlm/commands/train.py) under plain python or torchrun."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from mmldlm.config import RunConfig
from mmldlm.data import build_loader, dataset_path, heaviest_batch, model_for_dataset, open_dataset, resolve_for_model
from mmldlm.data.long_texts import cut_is_worth_a_warning, cut_line
from mmldlm.data.prepare import Ranks, ensure_token_latents
from mmldlm.device import keep_freed_memory
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.errors import UserError, signals_raise
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.objective import Objective
from mmldlm.runs.checkpoints import step_dir_name
from mmldlm.runs.files import save_run_config
from mmldlm.threads import set_threads
from mmldlm.training.batch_size import fit_to_data, global_batch_sizes
from mmldlm.training.distributed import DistInfo, RankTimeout, continue_command, init_distributed, leave
from mmldlm.training.trainer import StopRequest, Trainer, TrainingStopped, seed_everything

log = logging.getLogger(__name__)


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar apart."""

    def emit(self, record):

        tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(info: DistInfo) -> None:
    """INFO on rank 0; other ranks only report errors (one voice, not N copies of every line)."""
    handler = _TqdmHandler()
    prefix = f"[rank {info.rank}] " if info.distributed else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mmldlm")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if info.is_main else logging.ERROR)
    root.propagate = False


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels everywhere (cuBLAS needs its workspace setting before first use)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def dataset_token_latents(dataset) -> torch.Tensor:
    """(V, K, D) token latents of the dataset's vocabulary (model.vocab_prior): rank 0 adds them to a
    dataset prepared before they existed, the other ranks wait for it."""

    Ranks().on_rank0(lambda: ensure_token_latents(dataset.path, log=log.info) is not None)
    return torch.from_numpy(ensure_token_latents(dataset.path))


def build_model_and_objective(cfg: RunConfig, dataset):
    """The network and the objective for a prepared dataset's vocabulary, special ids and latent stats."""

    model_cfg = model_for_dataset(cfg.model, dataset)
    if cfg.model.vocab_prior and not model_cfg.vocab_prior:
        log.info(
            "model.vocab_prior: off, as the latents of %s were imported from an encoder that is not known "
            "(encoder_normalize null): no encoder to place the vocabulary's tokens in their space",
            dataset.path,
        )
    model = MultimodalMMDiT(model_cfg, vocab_size=cfg.model.vocab_size or dataset.vocab_size)
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=dataset.mask_id, pad_token_id=dataset.pad_id)
    mean, std = dataset.latent_stats()
    latent = GaussianDiffusion(cfg.latent_diffusion, mean=mean, std=std)
    if model_cfg.vocab_prior:
        model.set_token_latents(latent.standardize(dataset_token_latents(dataset)))
    return model, Objective(
        cfg.objective,
        text,
        latent,
        self_condition=cfg.model.self_condition,
        length_head=cfg.model.length_head,
        fused_text_loss=cfg.perf.fused_text_loss,
        text_row_buckets=cfg.perf.text_row_buckets,
    )


def open_train_data(cfg: RunConfig, info: DistInfo):
    """(dataset, make_loader, data config) of the training split: make_loader(micro_batch_size)
    builds this rank's loader. With data.path null the bundled corpus is prepared first (once,
    into the cache; every rank takes part)."""

    # The counts and length statistics of the bundled corpus go to the debug log: the first screen of the
    # main job shows progress; `mmldlm check` reports what the lengths cut.
    dataset = open_dataset(dataset_path(cfg.data, log=log.info, detail=log.debug), "train")
    data_cfg = resolve_for_model(cfg.data, cfg.model, dataset)
    line = cut_line(dataset.lengths(), data_cfg.max_length, str(dataset.path))
    if line is not None:  # logged on rank 0 only (setup_logging)
        worth_a_warning = cut_is_worth_a_warning(dataset.lengths(), data_cfg.max_length)
        log.log(logging.WARNING if worth_a_warning else logging.INFO, line)

    def make_loader(micro_batch_size: int):
        return build_loader(dataset, data_cfg, micro_batch_size, info.rank, info.world_size)

    return dataset, make_loader, data_cfg


def fit_batches_to_data(cfg: RunConfig, num_samples: int, info: DistInfo) -> RunConfig:
    """`cfg` with global batches of more samples than the training split holds lowered to what it holds
    (fit_to_data), said once in the log: a config written for a large corpus, fine-tuned on a small one.
    With data.drop_last=false such a batch is filled by reading samples twice, and kept."""
    train = cfg.train
    sizes = global_batch_sizes(train.global_batch_size, train.batch_schedule)
    micro, fitted = fit_to_data(train.micro_batch_size, sizes, num_samples, info.world_size)
    if not cfg.data.drop_last or fitted == sizes:
        return cfg
    if info.is_main:
        log.info(
            "batch: the training split holds %d samples, fewer than a global batch of %d; training with "
            "train.global_batch_size=%d train.micro_batch_size=%s (set both to choose)",
            num_samples,
            max(sizes),
            fitted[0],
            micro,
        )
    schedule = [[step, size] for (step, _), size in zip(train.batch_schedule, fitted[1:])]
    fitted_train = dataclasses.replace(
        train, global_batch_size=fitted[0], micro_batch_size=micro, batch_schedule=schedule
    )
    return dataclasses.replace(cfg, train=fitted_train)


def build_trainer(cfg: RunConfig, info: DistInfo) -> Trainer:
    """The data, model, objective and trainer of `cfg` on this rank; the memory probes run the
    heaviest batch of the real data (mmldlm.data.dataset.heaviest_batch)."""
    dataset, make_loader, data_cfg = open_train_data(cfg, info)
    cfg = fit_batches_to_data(cfg, len(dataset), info)
    seed_everything(cfg.train.seed)  # the same initial weights on every rank (FSDP2 relies on it)
    model, objective = build_model_and_objective(cfg, dataset)
    seed_everything(cfg.train.seed + info.rank)  # rank-local randomness (dropout) differs per rank
    heaviest = functools.partial(
        heaviest_batch, dataset, data_cfg, rank=info.rank, world_size=info.world_size, vocab_size=model.vocab_size
    )
    # The trainer's config holds the values used where `cfg` left them to the data (null: the dataset's
    # vocabulary and latent shape, the model's length), so the run's config.yaml and every checkpoint's
    # record them.
    resolved = dataclasses.replace(
        cfg, data=data_cfg, model=dataclasses.replace(model.cfg, vocab_size=model.vocab_size)
    )
    return Trainer(
        resolved, model, objective, make_loader, info, max_seq_len=data_cfg.max_length, heaviest_batch=heaviest
    )


class StartUpInterrupted(Exception):
    """SIGTERM or SIGINT before the first step: nothing is written, the process leaves with 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def train(cfg: RunConfig, resume: str | None = None, command: str = "mmldlm train") -> int:
    """Train `cfg` (resuming per `resume`: None, "auto" or a checkpoint path); returns the exit status:
    0 when train.steps are done, 128 + the signal's number when a signal stopped the run first.
    `command` is how the run was started, for the line that says how to continue it."""
    info = init_distributed(cfg.distributed, cfg.train.device)
    setup_logging(info)
    # Before any work (data preparation included); inter-op threads: unused by training, left as they are.
    share = max(1, len(os.sched_getaffinity(0)) // info.local_world_size)
    threads = set_threads(cfg.train.threads, log=log.info, cpus=share, deterministic=cfg.train.deterministic)
    set_deterministic(cfg.train.deterministic)
    if info.device.type == "cpu":
        # The text head's (N, V) logits of a batch of long texts outgrow glibc's mmap threshold: without
        # this each step faults their pages in anew (the main job: 2.2-2.4 million faults in 300 fp32
        # steps, 0.3 million with it; peak RSS unchanged; docs/benchmarks.md).
        keep_freed_memory()
    run_dir = Path(cfg.train.run_dir)
    try:
        # Signals: the loop's handler (checkpoint at the end of the step) is entered first, the start-up's
        # (end at once, nothing written) inside it; leaving start-up hands back to the loop's with no gap.
        with StopRequest() as stop:
            with signals_raise(StartUpInterrupted):  # until the loop takes signals over: end at once
                trainer = build_trainer(cfg, info)
                trainer.auto_threads = threads
                trainer.resume(resume)
            if info.is_main and not trainer.nothing_to_train:  # the run has started: what it runs with is recorded
                save_run_config(trainer.cfg, run_dir, trainer.resumed_from)
            status = trainer.fit(stop)
    except StartUpInterrupted as err:
        if info.is_main:
            print(
                f"mmldlm train: {err} during start-up, before the first step; nothing was written to {run_dir}",
                file=sys.stderr,
                flush=True,
            )
        if info.distributed:  # the peers may be inside a start-up collective: do not wait on them
            os._exit(128 + err.signum)
        status = 128 + err.signum
    except RankTimeout as err:
        # Do not wait on a process group whose peer is gone: report and leave at once.
        print(f"mmldlm train: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    except TrainingStopped as err:
        print(f"mmldlm train: {err}", file=sys.stderr, flush=True)
        status = 1
    except UserError as err:
        if not info.distributed:
            raise  # the command line prints it (one line, or the traceback with --debug)
        # A checkpoint no rank can use (rank 0 chose and told the others: all raise it), a write that
        # failed on rank 0 (the others see it leave), a config or data error every rank raises: one
        # line, and no wait on the peers (tearing gloo down at interpreter exit can abort a rank).
        if info.is_main:
            print(f"mmldlm train: {err}", file=sys.stderr, flush=True)
        os._exit(2)
    else:
        if trainer.stopped_by and info.is_main:
            print(
                f"mmldlm train: stopped by {trainer.stopped_by} at step {trainer.step} of {cfg.train.steps} "
                f"(exit status {status}); checkpoint {trainer.checkpoints.dir / step_dir_name(trainer.step)} "
                f"written. Continue with: {continue_command(command)}",
                file=sys.stderr,
                flush=True,
            )
    return leave(info, status)
