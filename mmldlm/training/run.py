"""`mmldlm train` as a library call: set up the process group, data, model and objective, then run
the loop. Used by the command (mmldlm/commands/train.py) under plain python or torchrun."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from mmldlm.config import RunConfig, save_config
from mmldlm.training.distributed import DistInfo, RankTimeout, init_distributed, shutdown
from mmldlm.training.trainer import Trainer, TrainingStopped, seed_everything

log = logging.getLogger(__name__)


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar apart."""

    def emit(self, record):
        from tqdm import tqdm

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


def build_model_and_objective(cfg: RunConfig, meta: dict):
    """The network and the objective for a prepared dataset's vocabulary, special ids and latent stats."""
    from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
    from mmldlm.model.mmdit import MultimodalMMDiT
    from mmldlm.objective import Objective

    model = MultimodalMMDiT(cfg.model, vocab_size=meta["vocab_size"])
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=meta["mask_id"], pad_token_id=meta["pad_id"])
    latent = GaussianDiffusion(cfg.latent_diffusion, mean=torch.tensor(meta["latent_mean"]),
                               std=torch.tensor(meta["latent_std"]))
    return model, Objective(cfg.objective, text, latent)


def open_train_data(cfg: RunConfig, info: DistInfo):
    """(meta, loader) of the training split, preparing the bundled corpus first if no dataset is given."""
    from mmldlm.data import build_loader, open_dataset

    dataset = open_dataset(cfg.data.path, "train")
    loader = build_loader(dataset, cfg.data, cfg.train.micro_batch_size, info.rank, info.world_size, cfg.train.seed)
    return dataset.meta, loader


def train(cfg: RunConfig, resume: str | None = None) -> int:
    """Train `cfg` (resuming per `resume`: None, "auto" or a checkpoint path); returns the exit status."""
    info = init_distributed(cfg.distributed, cfg.train.device)
    setup_logging(info)
    set_deterministic(cfg.train.deterministic)
    run_dir = Path(cfg.train.run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    try:
        meta, loader = open_train_data(cfg, info)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank (FSDP2 relies on it)
        model, objective = build_model_and_objective(cfg, meta)
        seed_everything(cfg.train.seed + info.rank)  # rank-local randomness (dropout) differs per rank
        trainer = Trainer(cfg, model, objective, loader, info)
        trainer.resume(resume)
        status = trainer.fit()
    except RankTimeout as err:
        # Do not wait on a process group whose peer is gone: report and leave at once.
        print(f"mmldlm train: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    except TrainingStopped as err:
        print(f"mmldlm train: {err}", file=sys.stderr, flush=True)
        status = 1
    shutdown(info)
    return status
