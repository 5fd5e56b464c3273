"""A trained run, ready to sample from: config + checkpoint -> model, the two diffusions with the
dataset's latent statistics, the tokenizer, the validation split and the sentence encoder.

    run = load_run("runs/default")                 # RUN/checkpoints/latest, GPU when present
    sampler = run.sampler(SamplingOptions(num_steps=64))
    texts = run.decode(*sampler.l2t(run.encode_latents(["a small dog"]), pad_mask))

The training loop builds the same object around the model it is training (`TrainedRun(...)`), so
evaluation during training and `mmldlm eval` share every line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmldlm.config import RunConfig, load_config
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths


@dataclass
class TrainedRun:
    """A model with everything needed to feed it and read its output; see the module docstring."""

    cfg: RunConfig
    model: torch.nn.Module
    text: MaskedDiffusion
    latent: GaussianDiffusion
    dataset_dir: Path
    checkpoint: Path | None = None  # where the weights came from (None: a model in training)
    step: int | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sampler(self, options: SamplingOptions) -> Sampler:
        return Sampler(self.model, self.text, self.latent, options)

    # --- data ------------------------------------------------------------------------------------

    @functools.cached_property
    def val(self):
        """The validation split of the run's dataset."""
        from mmldlm.data import open_dataset

        return open_dataset(self.dataset_dir, "val")

    @property
    def meta(self) -> dict:
        return self.val.meta

    @functools.cached_property
    def data_cfg(self):
        """The run's data config with max_length resolved for the model (what training cut texts to)."""
        from mmldlm.data import resolve_for_model

        return resolve_for_model(self.cfg.data, self.cfg.model, self.val)

    @functools.cached_property
    def tokenizer(self):
        return self.val.tokenizer()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, cut to the length training used."""
        from mmldlm.data.tokenizer import encode_texts

        return [ids[:self.data_cfg.max_length] for ids in encode_texts(self.tokenizer, texts)]

    def batch_of(self, token_lists: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, L) padded with the pad id, pad_mask (B, L)) of lists of token ids."""
        pad_mask = pad_mask_from_lengths([max(len(ids), 1) for ids in token_lists])
        tokens = torch.full(pad_mask.shape, self.text.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            tokens[row, :len(ids)] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return tokens, pad_mask

    def decode(self, tokens: torch.Tensor, pad_mask: torch.Tensor) -> list[str]:
        """Texts of a (B, L) batch: the real positions of each row, decoded."""
        return [self.tokenizer.decode(row[mask].tolist()) for row, mask in zip(tokens.cpu(), pad_mask.cpu())]

    def sample_lengths(self, num: int, generator: torch.Generator) -> list[int]:
        """Text lengths drawn from the validation split (as cut for training), for sources without text."""
        picks = torch.randint(len(self.val), (num,), generator=generator).tolist()
        return [min(len(self.val[i][1]), self.data_cfg.max_length) for i in picks]

    # --- the sentence encoder --------------------------------------------------------------------

    @functools.cached_property
    def encoder(self):
        """The encoder that made the dataset's latents, with the same normalisation."""
        from mmldlm.data.encoders import load_encoder
        from mmldlm.data.errors import DataError

        normalize = self.meta.get("encoder_normalize")
        if normalize is None:
            raise DataError(f"{self.dataset_dir}/meta.json: the latents were imported (encoder_normalize is null), "
                            f"so the encoder that made them is not known; give latents (.npy) instead of text")
        return load_encoder(self.meta["encoder"], str(self.device), normalize=normalize)

    def encode_latents(self, texts: list[str]) -> torch.Tensor:
        """Latents (B, K, D) of texts in the encoder's space."""
        return torch.from_numpy(self.encoder.encode(texts))


def find_checkpoint(run_dir: Path, checkpoint: str | Path | None) -> Path:
    if checkpoint is not None:
        path = Path(checkpoint)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"--checkpoint {path}: no model.safetensors there; checkpoints are "
                                    f"RUN/checkpoints/step-NNNNNNN directories")
        return path
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest; train the run first (mmldlm train) or pass "
                                f"--checkpoint PATH")
    return run_dir / "checkpoints" / pointer.read_text().strip()


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "auto") -> TrainedRun:
    """The model of `checkpoint` (default RUN/checkpoints/latest) with the config it was trained with,
    on `device`: "auto" (the GPU when there is one), "cpu" or "cuda"."""
    import json

    from safetensors.torch import load_file

    from mmldlm.data import dataset_path, open_dataset
    from mmldlm.model import MultimodalMMDiT
    from mmldlm.training.distributed import pick_device

    run_dir = Path(run_dir)
    path = find_checkpoint(run_dir, checkpoint)
    config_file = path / "config.yaml" if (path / "config.yaml").is_file() else run_dir / "config.yaml"
    cfg = load_config(config_file)
    data_dir = dataset_path(cfg.data, log=lambda _msg: None)
    val = open_dataset(data_dir, "val")
    model = MultimodalMMDiT(cfg.model, vocab_size=cfg.model.vocab_size or val.vocab_size)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    model.to(pick_device(device)).eval()
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=val.mask_id, pad_token_id=val.pad_id)
    mean, std = val.latent_stats()
    meta_file = path / "meta.json"
    step = json.loads(meta_file.read_text())["step"] if meta_file.is_file() else None
    run = TrainedRun(cfg, model, text, GaussianDiffusion(cfg.latent_diffusion, mean=mean, std=std), data_dir,
                     checkpoint=path, step=step)
    run.val = val  # already open
    return run
