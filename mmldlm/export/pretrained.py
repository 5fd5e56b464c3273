"""A trained model as a self-contained folder (the save_pretrained / from_pretrained layout of the
Hugging Face hub), and the Python API around a trained model.

    DIR/config.json               format_version, the model, diffusion and objective configs, special ids,
                                  encoder, latent shape (K, D), the text length cut and length distribution
    DIR/model.safetensors         the weights: the EMA where the run kept one, else the raw weights
                                  (config.json "weights" says which)
    DIR/tokenizer.json            the tokenizer the model was trained with
    DIR/latent_stats.safetensors  "mean" and "std" (D,) of the training latents, what the latent
                                  diffusion standardises with
    DIR/README.md                 the model card (mmldlm/export/card.py)

    m = MMLDLM.from_pretrained("exported/")        # or a run directory; local folders only
    z = m.encode(["a small dog that barks"])        # t2l: text -> latents (N, K, D), encoder space
    texts = m.decode(z)                              # l2t: latents -> text
    texts, z = m.generate(4)                         # joint
    m.save_pretrained("exported/")                   # the folder above (`mmldlm export` writes it atomically)

Loading never touches the network. An exported folder and the run it came from give the same
samples for the same seed: both become the same `TrainedRun` (mmldlm/runs/trained.py), sampled by
the same code, which `mmldlm sample` also uses. The file names and the card's metadata follow the hub
(`hf upload ID DIR` shares a folder), but the class is not a huggingface_hub ModelHubMixin: the mixin
loads hub ids over the network and records its config from the constructor's arguments, and here the
config is checked strictly, key by key, against a format version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mmldlm import __version__
from mmldlm.config import (
    ConfigError,
    LatentDiffusionConfig,
    ModelConfig,
    ObjectiveConfig,
    RunConfig,
    TextDiffusionConfig,
    from_dict,
    to_dict,
)
from mmldlm.data.errors import DataError
from mmldlm.data.format import read_format
from mmldlm.data.tokenizer import load_tokenizer, special_ids, vocab_size
from mmldlm.device import pick_device
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.errors import OptionError, require_positive
from mmldlm.export.card import model_card
from mmldlm.model import MultimodalMMDiT
from mmldlm.outputs import FolderKind, as_umask_allows
from mmldlm.progress import reporting, stage
from mmldlm.runs.trained import TrainedRun, load_run, load_weights
from mmldlm.sampling.sampler import SamplingOptions, length_masks

FORMAT_VERSION = 1
CONFIG, WEIGHTS, TOKENIZER, LATENT_STATS, CARD = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "latent_stats.safetensors",
    "README.md",
)
# What an exported folder holds (and the reports `mmldlm eval` wrote into one before it wrote them
# elsewhere): `mmldlm export --force` replaces a folder that holds nothing else.
EXPORTED = FolderKind(
    "an exported model",
    CONFIG,
    re.compile(
        "|".join(re.escape(name) for name in (CONFIG, WEIGHTS, TOKENIZER, LATENT_STATS, CARD))
        + r"|eval/[^/]+\.(json|md)"
    ),
)
SECTIONS = {
    "model": ModelConfig,
    "text_diffusion": TextDiffusionConfig,
    "latent_diffusion": LatentDiffusionConfig,
    "objective": ObjectiveConfig,
}
REQUIRED_KEYS = (
    "format_version",
    *SECTIONS,
    "pad_id",
    "mask_id",
    "encoder",
    "encoder_normalize",
    "latent_dim",
    "num_latents",
    "max_length",
    "length_counts",
    "weights",
)


def is_exported(path: Path) -> bool:
    """True for an exported folder (config.json), False for a training run directory (config.yaml)."""
    return (path / CONFIG).is_file() and not (path / "config.yaml").is_file()


# --------------------------------------------------------------------------------------------------
# Writing and reading the folder.


def folder_config(run: TrainedRun) -> dict:
    """config.json of `run`: everything needed to rebuild it without its dataset."""
    model = dataclasses.replace(run.cfg.model, vocab_size=run.model.vocab_size)
    sections = {name: to_dict(getattr(run.cfg, name)) for name in SECTIONS}
    return {
        "format_version": FORMAT_VERSION,
        "library_name": "mmldlm",
        "mmldlm_version": __version__,
        **sections,
        "model": to_dict(model),
        "vocab_size": run.model.vocab_size,
        "pad_id": run.text.pad_token_id,
        "mask_id": run.text.mask_token_id,
        "encoder": run.encoder_name,
        "encoder_normalize": run.encoder_normalize,
        "latent_dim": model.latent_dim,
        "num_latents": model.num_latents,
        "max_length": run.max_length,
        "length_counts": [int(c) for c in run.length_counts.tolist()],
        "weights": run.weights,
        "step": run.step,
    }


def write_folder(run: TrainedRun, directory: Path) -> None:
    """config.json, the weights, the tokenizer and the latent statistics of `run` into `directory`."""
    (directory / CONFIG).write_text(json.dumps(folder_config(run), indent=1) + "\n", encoding="utf-8")
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in run.model.state_dict().items()},
        str(directory / WEIGHTS),
        metadata={"format": "pt", "weights": run.weights},
    )
    if not (directory / TOKENIZER).exists() or not os.path.samefile(run.tokenizer_file, directory / TOKENIZER):
        shutil.copyfile(run.tokenizer_file, directory / TOKENIZER)  # (the same file when saved where it was loaded)
    save_file(
        {"mean": run.latent.mean.float().cpu().contiguous(), "std": run.latent.std.float().cpu().contiguous()},
        str(directory / LATENT_STATS),
    )
    for name in (WEIGHTS, LATENT_STATS):
        as_umask_allows(directory / name)


def read_config(directory: Path) -> dict:
    """config.json of an exported folder, checked: every file there, a format version this mmldlm
    reads, every key present; DataError naming the file and what is wrong otherwise."""
    missing = [name for name in (CONFIG, WEIGHTS, TOKENIZER, LATENT_STATS) if not (directory / name).is_file()]
    if missing:
        raise DataError(
            f"{directory}: missing {', '.join(missing)}; an exported model folder holds {CONFIG}, "
            f"{WEIGHTS}, {TOKENIZER} and {LATENT_STATS} (export it again with `mmldlm export`)"
        )
    versions, refused = range(1, FORMAT_VERSION + 1), "; expected an integer >= 1 (is this an mmldlm export?)"
    return read_format(directory / CONFIG, versions, REQUIRED_KEYS, refused, newer="upgrade mmldlm to load it")


def load_exported(directory: str | Path, device: str = "auto") -> TrainedRun:
    """The model of an exported folder on `device` ("auto": the GPU when there is one); DataError naming
    the file at fault when the folder is incomplete, from a newer mmldlm or inconsistent. Nothing is
    returned half-loaded: every file is read and checked before the model is handed back."""
    directory = Path(directory)
    config = read_config(directory)
    path = directory / CONFIG
    try:
        sections = {name: from_dict(cls, config[name], name) for name, cls in SECTIONS.items()}
        for section in sections.values():
            section.check()
    except ConfigError as err:
        raise DataError(f"{path}: {err}") from None
    cfg = RunConfig(**sections)
    for key in ("latent_dim", "num_latents"):
        if config[key] != getattr(cfg.model, key):
            raise DataError(
                f"{path}: {key} {config[key]!r} but model.{key} {getattr(cfg.model, key)!r}; the file was "
                f"edited or damaged, export it again"
            )
    counts = config["length_counts"]
    if not (isinstance(counts, list) and len(counts) == config["max_length"] and sum(counts) > 0):
        raise DataError(
            f"{path}: length_counts must list how many texts have each length 1..max_length "
            f"({config['max_length']}), some of them non-zero; export it again"
        )
    if config["weights"] not in ("ema", "raw"):
        raise DataError(f"{path}: weights {config['weights']!r}; expected 'ema' or 'raw'")
    tokenizer = load_tokenizer(directory / TOKENIZER)
    if vocab_size(tokenizer) > cfg.model.vocab_size:
        raise DataError(
            f"{directory / TOKENIZER}: {vocab_size(tokenizer)} tokens, more than model.vocab_size "
            f"{cfg.model.vocab_size} in {CONFIG}: not the model's tokenizer"
        )
    ids = special_ids(tokenizer)
    if (ids["pad_id"], ids["mask_id"]) != (config["pad_id"], config["mask_id"]):
        raise DataError(
            f"{directory / TOKENIZER}: [PAD] and [MASK] have ids {ids['pad_id']} and {ids['mask_id']}, "
            f"{CONFIG} says {config['pad_id']} and {config['mask_id']}: not the model's tokenizer"
        )
    stats = _latent_stats(directory / LATENT_STATS, cfg.model.latent_dim)
    model = MultimodalMMDiT(cfg.model, vocab_size=cfg.model.vocab_size)
    load_weights(model, directory / WEIGHTS)
    model.to(pick_device(device, key="device")).eval()
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=config["mask_id"], pad_token_id=config["pad_id"])
    run = TrainedRun(
        cfg,
        model,
        text,
        GaussianDiffusion(cfg.latent_diffusion, mean=stats["mean"], std=stats["std"]),
        tokenizer_file=directory / TOKENIZER,
        encoder_name=config["encoder"],
        encoder_normalize=config["encoder_normalize"],
        max_length=config["max_length"],
        checkpoint=directory,
        step=config.get("step"),
        weights=config["weights"],
    )
    run.tokenizer = tokenizer  # already loaded
    run.length_counts = torch.tensor(counts, dtype=torch.float32)
    return run


def _latent_stats(path: Path, latent_dim: int) -> dict[str, torch.Tensor]:
    try:
        stats = load_file(str(path))
    except SafetensorError as err:
        raise DataError(f"{path}: not a readable safetensors file ({err})") from None
    for key in ("mean", "std"):
        if key not in stats or tuple(stats[key].shape) != (latent_dim,):
            found = tuple(stats[key].shape) if key in stats else "missing"
            raise DataError(f"{path}: '{key}' {found}; expected a tensor of shape ({latent_dim},), the latent dim")
    return stats


def options_like_exported(directory: str | Path) -> dict:
    """The PrepareOptions fields (tokenizer, encoder, normalize, max_tokens) that prepare new text the way
    the exported model's training data was (`mmldlm prepare --like DIR`), so that it can be evaluated on it."""
    directory = Path(directory)
    config = read_config(directory)
    if config["encoder_normalize"] is None:
        raise DataError(
            f"{directory / CONFIG}: encoder_normalize is null: the model's latents were imported, so the "
            f"encoder that made them is not known and new text cannot be encoded like them"
        )
    return {
        "tokenizer": str(directory / TOKENIZER),
        "encoder": config["encoder"],
        "normalize": config["encoder_normalize"],
        "max_tokens": config["max_length"],
    }


def load_trained(
    path: str | Path, checkpoint: str | Path | None = None, device: str = "auto", use_ema: bool | None = None
) -> TrainedRun:
    """A run directory (its `checkpoint`, default the latest; `use_ema` as `load_run` takes it) or an
    exported folder, whichever `path` is."""
    path = Path(path)
    if not is_exported(path):
        return load_run(path, checkpoint, device, use_ema)
    weights = read_config(path)["weights"]
    if checkpoint is not None or use_ema not in (None, weights == "ema"):
        raise DataError(
            f'{path}: an exported model holds one set of weights, its {weights} weights ({CONFIG} "weights"); '
            f"--checkpoint and --no-ema (use_ema) choose among a run's checkpoints: give the run directory"
        )
    return load_exported(path, device)


# --------------------------------------------------------------------------------------------------
# The Python API.


class MMLDLM:
    """A trained MM-LDLM model: text -> latents (`encode`), latents -> text (`decode`), both (`generate`),
    and the sentence encoder itself (`embed`). Sampler options are keyword arguments: `steps` (every
    sampler; default the run's num_sampling_steps), and the fields of SamplingOptions (latent_steps,
    temperature, strategy, guidance_scale, latent_sampler, reuse_output). The same `seed` gives the same
    samples; a batch b of `batch_size` rows draws from the seed `seed * 1_000_003 + b`. `progress`: a bar
    with an ETA on stderr, True, False or "auto" (only when stderr is a terminal; mmldlm/progress.py)."""

    def __init__(self, run: TrainedRun, run_dir: Path | None = None, card: str | None = None):
        """`run` loaded from the training run `run_dir` (whose files the model card is written from), or
        from an exported folder whose model card is `card`."""
        self.run, self.run_dir, self.card = run, run_dir, card

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        checkpoint: str | Path | None = None,
        device: str = "auto",
        use_ema: bool | None = None,
    ) -> MMLDLM:
        """An exported folder or a run directory (then `checkpoint`, default its newest that verifies, and
        `use_ema`: by default the EMA of the weights where the checkpoint holds one, else the raw weights;
        True asks for the EMA and is refused where there is none, False takes the raw weights). Local folders
        only: nothing is downloaded."""
        device = str(pick_device(device, key="MMLDLM.from_pretrained(device=...)"))  # before the weights load
        path = Path(path)
        run = load_trained(path, checkpoint, device, use_ema)
        if not is_exported(path):
            return cls(run, run_dir=path)
        return cls(run, card=(path / CARD).read_text(encoding="utf-8") if (path / CARD).is_file() else None)

    def save_pretrained(self, directory: str | Path) -> None:
        """The exported folder (module docstring) into `directory`, created when missing. The model card is
        the one an exported folder carried, else one written from the run directory (card.py); none for a
        model built in memory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_folder(self.run, directory)
        card = self.card if self.card is not None or self.run_dir is None else model_card(self.run, self.run_dir)
        if card is not None:
            (directory / CARD).write_text(card, encoding="utf-8")

    # --- sampling --------------------------------------------------------------------------------

    def options(self, steps: int | None = None, **options) -> SamplingOptions:
        """The run's sampler defaults with `steps` (both samplers) and the SamplingOptions fields given."""
        latent_steps = options.pop("latent_steps", None)
        sampling = SamplingOptions.defaults(
            self.run.cfg.text_diffusion, self.run.cfg.latent_diffusion, steps, **options
        )
        if latent_steps is not None:
            sampling.latent_steps = latent_steps
        sampling.check({"num_steps": "sampling option 'steps'"})  # the API's name of the field
        return sampling

    def text_lengths(
        self, num: int, lengths: int | list[int] | None = None, latents: torch.Tensor | None = None, seed: int = 0
    ) -> list[int]:
        """Text lengths in tokens (the model has no end-of-text token): `lengths` as given (one number for
        all), else the length head's prediction from `latents`, else drawn from the training data's
        validation lengths with the generator of `seed`."""
        if isinstance(lengths, int):
            require_positive({"lengths": lengths})
            return [lengths] * num
        if lengths is not None:
            if len(lengths) != num:
                raise DataError(f"lengths: {len(lengths)} given for {num} samples")
            if min(lengths, default=1) < 1:
                raise OptionError("lengths", lengths, "text lengths in tokens, each >= 1")
            return list(lengths)
        if latents is not None and getattr(self.run.model, "length_head", None) is not None:
            return self.run.predict_lengths(latents)
        return self.run.sample_lengths(num, torch.Generator().manual_seed(seed))

    def _batches(self, num: int, batch_size: int, seed: int):
        """(rows, generator) of each batch; the generator depends only on the seed and the first row."""
        require_positive({"batch_size": batch_size})
        for b in range(0, num, batch_size):
            yield range(b, min(b + batch_size, num)), torch.Generator().manual_seed(seed * 1_000_003 + b)

    def _stack(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """The latents of every batch as one (N, K, D) tensor (N = 0 without batches)."""
        return (
            torch.cat(batches)
            if batches
            else torch.empty(0, self.run.cfg.model.num_latents, self.run.cfg.model.latent_dim)
        )

    def embed(self, texts: str | list[str]) -> torch.Tensor:
        """The sentence encoder's latents (N, K, D) of `texts` (one string: N = 1): what the model learnt
        to produce. A warning says when a text is longer than the encoder reads (its rest is ignored)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        encoder = self.run.encoder
        over = [max(n - encoder.max_wordpieces, 0) for n in encoder.count_wordpieces(texts)]
        if any(over):
            warnings.warn(
                f"{sum(n > 0 for n in over)} of {len(texts)} texts longer than the sentence encoder's "
                f"{encoder.max_wordpieces} wordpieces: their last {sum(over)} wordpieces are not in the latent",
                stacklevel=2,
            )
        return self.run.encode_latents(texts)

    def encode(
        self, texts: str | list[str], *, batch_size: int = 64, seed: int = 0, progress: bool | str = "auto", **options
    ) -> torch.Tensor:
        """t2l: latents (N, K, D) in the encoder's space sampled for `texts` (one string: N = 1). A warning
        says when a text is longer than the model reads (it is cut; the latent describes its start).
        latent_sampler="mean" gives the posterior mean instead (one model call; for retrieval)."""
        sampler = self.run.sampler(self.options(**options))
        texts = [texts] if isinstance(texts, str) else list(texts)
        note = self.run.cut_note(self.run.tokens_cut(texts))
        if note is not None:
            warnings.warn(note, stacklevel=2)
        ids = self.run.tokenize(texts)
        out = []
        with reporting(progress), stage("t2l", total=len(ids)):
            for rows, generator in self._batches(len(ids), batch_size, seed):
                tokens, pad_mask = self.run.batch_of(ids[rows.start : rows.stop])
                out.append(sampler.t2l(tokens, pad_mask, generator).cpu())
        return self._stack(out)

    def decode(
        self,
        latents,
        lengths: int | list[int] | None = None,
        *,
        batch_size: int = 64,
        seed: int = 0,
        progress: bool | str = "auto",
        **options,
    ) -> list[str]:
        """l2t: a text for each latent (N, K, D), or (N, D) for K = 1, in the encoder's space; `lengths`
        in tokens (`text_lengths`)."""
        sampler = self.run.sampler(self.options(**options))
        latents = self.run.latents_of(latents, "latents")
        candidates = sampler.options.length_candidates
        if lengths is None and candidates > 1 and getattr(self.run.model, "length_head", None) is not None:
            lengths = self.run.candidate_lengths(latents, candidates)  # the encoder picks among them
        else:
            lengths = [[n] for n in self.text_lengths(len(latents), lengths, latents, seed)]
        texts = []
        with reporting(progress), stage("l2t", total=len(latents)):
            for rows, generator in self._batches(len(latents), batch_size, seed):
                pad_mask = length_masks([lengths[i] for i in rows])
                tokens = sampler.l2t(latents[rows.start : rows.stop], pad_mask, generator)
                texts += self.run.decode(tokens, tokens != self.run.text.pad_token_id)
        return texts

    def generate(
        self,
        num: int,
        lengths: int | list[int] | None = None,
        *,
        batch_size: int = 64,
        seed: int = 0,
        progress: bool | str = "auto",
        **options,
    ) -> tuple[list[str], torch.Tensor]:
        """joint: `num` (text, latent (K, D)) pairs sampled together; `lengths` in tokens (`text_lengths`).
        With joint_order="latent_first" the latents are sampled first (given the lengths) and decoded at
        those lengths as `decode` does."""
        require_positive({"num": num})
        sampler = self.run.sampler(self.options(**options))
        lengths = self.text_lengths(num, lengths, seed=seed)
        texts, latents = [], []
        with reporting(progress), stage("joint", total=num):
            for rows, generator in self._batches(num, batch_size, seed):
                batch_texts, z = self.run.joint_batch(sampler, [lengths[i] for i in rows], generator)
                texts += batch_texts
                latents.append(z)
        return texts, self._stack(latents)
