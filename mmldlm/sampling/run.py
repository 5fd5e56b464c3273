"""A trained run, ready to sample from: config + checkpoint -> model, the two diffusions with the
dataset's latent statistics, the tokenizer, the validation split and the sentence encoder.

    run = load_run("runs/default")                 # RUN/checkpoints/latest, GPU when present
    sampler = run.sampler(SamplingOptions(num_steps=64))
    texts = run.decode(*sampler.l2t(run.encode_latents(["a small dog"]), pad_mask))

The training loop builds the same object around the model it is training (`TrainedRun(...)`), so
evaluation during training and `mmldlm eval` share every line. `run.use_eval_data(DIR, "all")` makes
evaluation read another prepared dataset (made with `mmldlm prepare --like RUN`) in place of `run.val`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmldlm.config import RunConfig, load_config
from mmldlm.data import format as fmt
from mmldlm.data.dataset import PreparedDataset
from mmldlm.data.errors import DataError
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths
from mmldlm.training.checkpoint import find_latest


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
    weights: str = "raw"  # "ema": the checkpoint's EMA of the weights, "raw": the trained weights

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

    def use_eval_data(self, path: str | Path, split: str = "all") -> None:
        """Evaluate on the prepared dataset at `path` in place of the run's validation split: its
        "train" or "val" split, or "all" (train then val, in order). Only the samples change: latents
        are still standardised with the run's own training statistics (`self.latent`, what the model
        learnt with) and texts are still cut to the length training used. DataError when the dataset
        was not made with the run's tokenizer and encoder (`mmldlm prepare --like RUN` makes one that is)."""
        path = Path(path)
        check_compatible(self.dataset_dir, path)
        # The cut length and the tokenizer are the run's own: settle both cached properties from its
        # dataset before `val` is replaced.
        _ = self.data_cfg, self.tokenizer
        self.val = AllSplits(path) if split == "all" else PreparedDataset(path, split)

    @property
    def known_words(self) -> frozenset[str]:
        """The lowercase words of the run's training texts (the real-word rate of evaluation)."""
        return training_words(str(self.dataset_dir))

    @torch.no_grad()
    def predict_lengths(self, latents: torch.Tensor) -> list[int]:
        """The length head's most likely text length for each latent (N, K, D) in encoder space, at
        most the length training cut texts to."""
        logits = self.model.length_logits(self.latent.standardize(latents.to(self.device, torch.float32)))
        return (logits.argmax(dim=1) + 1).clamp(max=self.data_cfg.max_length).tolist()

    def sample_lengths(self, num: int, generator: torch.Generator) -> list[int]:
        """Text lengths drawn from the validation split (as cut for training), for sources without text."""
        picks = torch.randint(len(self.val), (num,), generator=generator).tolist()
        return [min(len(self.val[i][1]), self.data_cfg.max_length) for i in picks]

    # --- the sentence encoder --------------------------------------------------------------------

    @functools.cached_property
    def encoder(self):
        """The encoder that made the dataset's latents, with the same normalisation."""
        from mmldlm.data.encoders import load_encoder

        normalize = self.meta.get("encoder_normalize")
        if normalize is None:
            raise DataError(f"{self.dataset_dir}/meta.json: the latents were imported (encoder_normalize is null), "
                            f"so the encoder that made them is not known; give latents (.npy) instead of text")
        return load_encoder(self.meta["encoder"], str(self.device), normalize=normalize)

    def encode_latents(self, texts: list[str]) -> torch.Tensor:
        """Latents (B, K, D) of texts in the encoder's space."""
        return torch.from_numpy(self.encoder.encode(texts))


@functools.lru_cache(maxsize=4)
def training_words(dataset_dir: str) -> frozenset[str]:
    """The lowercase letter runs of every training text of a prepared dataset, decoded (once per process:
    evaluation during training asks at every evaluation)."""
    from mmldlm.sampling.evaluate import words

    train = PreparedDataset(dataset_dir, "train")
    texts = train.tokenizer().decode_batch([train[i][1].tolist() for i in range(len(train))])
    return frozenset(words(" ".join(texts)))


class AllSplits(torch.utils.data.ConcatDataset):
    """Every sample of a prepared dataset, its train split then its val split, as one sequence: the
    part of PreparedDataset that evaluation reads through `run.val` (len, [i] and meta). No
    latent_stats: statistics come from the run's own train split, never from data evaluated on."""

    split = "all"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = fmt.read_meta(self.path)
        super().__init__([PreparedDataset(self.path, name) for name in fmt.SPLITS if self.meta["splits"].get(name)])

    def __getitem__(self, index: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(index, token ids (n,), latents (K, D)), as PreparedDataset's, the index counted over both splits."""
        _, tokens, latents = super().__getitem__(index)
        return index, tokens, latents


def check_compatible(run_data: Path, path: Path) -> None:
    """DataError unless the dataset at `path` reads as the run's own dataset `run_data` does to the
    model: the same tokenizer (the same ids for the same text), the same encoder and normalisation
    (latents in the same space), the same latent shape (K, D)."""
    ours, theirs = fmt.read_meta(run_data), fmt.read_meta(path)
    ours_tok, theirs_tok = run_data / ours["tokenizer"], path / theirs["tokenizer"]
    fix = "prepare the text with `mmldlm prepare --like RUN_DIR --input FILE --out DIR`"
    if theirs_tok.read_text(encoding="utf-8") != ours_tok.read_text(encoding="utf-8"):
        raise DataError(f"{theirs_tok}: not the run's tokenizer {ours_tok} (the files differ, so the same text "
                        f"would get other ids); {fix}")
    for key in ("encoder", "encoder_normalize", "latent_dim", "num_latents"):
        if theirs.get(key) != ours.get(key):
            raise DataError(f"{path / fmt.META}: {key} {theirs.get(key)!r}, but the run's dataset "
                            f"{run_data / fmt.META} has {ours.get(key)!r}; {fix}")


def find_checkpoint(run_dir: Path, checkpoint: str | Path | None) -> Path:
    if checkpoint is not None:
        path = Path(checkpoint)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"--checkpoint {path}: no model.safetensors there; checkpoints are "
                                    f"RUN/checkpoints/step-NNNNNNN directories")
        return path
    path = find_latest(run_dir / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoints; train the run first (mmldlm train) or pass "
                                f"--checkpoint PATH")
    return path


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "auto",
             use_ema: bool = True) -> TrainedRun:
    """The model of `checkpoint` (default RUN/checkpoints/latest) with the config it was trained with,
    on `device`: "auto" (the GPU when there is one), "cpu" or "cuda". The checkpoint's EMA of the
    weights where it has one (train.ema_decay > 0) unless `use_ema` is false, else the raw weights."""
    import json

    from safetensors.torch import load_file

    from mmldlm.data import dataset_path, open_dataset
    from mmldlm.model import MultimodalMMDiT
    from mmldlm.device import pick_device

    run_dir = Path(run_dir)
    path = find_checkpoint(run_dir, checkpoint)
    config_file = path / "config.yaml" if (path / "config.yaml").is_file() else run_dir / "config.yaml"
    cfg = load_config(config_file)
    data_dir = dataset_path(cfg.data, log=lambda _msg: None)
    val = open_dataset(data_dir, "val")
    model = MultimodalMMDiT(cfg.model, vocab_size=cfg.model.vocab_size or val.vocab_size)
    weights = "ema" if use_ema and (path / "ema.safetensors").is_file() else "raw"
    model.load_state_dict(load_file(str(path / ("ema.safetensors" if weights == "ema" else "model.safetensors"))))
    model.to(pick_device(device, key="--device")).eval()
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=val.mask_id, pad_token_id=val.pad_id)
    mean, std = val.latent_stats()
    meta_file = path / "meta.json"
    step = json.loads(meta_file.read_text())["step"] if meta_file.is_file() else None
    run = TrainedRun(cfg, model, text, GaussianDiffusion(cfg.latent_diffusion, mean=mean, std=std), data_dir,
                     checkpoint=path, step=step, weights=weights)
    run.val = val  # already open
    return run
