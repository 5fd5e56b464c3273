"""A trained model, ready to sample from: config + weights -> model, the two diffusions with the
training data's latent statistics, the tokenizer, the sentence encoder and (for a run) its dataset.

    run = load_run("runs/default")                 # its newest checkpoint that verifies, GPU when present
    sampler = run.sampler(SamplingOptions(num_steps=64))
    texts = run.decode(*sampler.l2t(run.encode_latents(["a small dog"]), pad_mask))

The training loop builds the same object around the model it is training (`TrainedRun.on_dataset`), so
evaluation during training and `mmldlm eval` share every line; an exported model folder
(mmldlm/export/pretrained.py) builds it from its own files, with no dataset. `run.use_eval_data(DIR,
"all")` makes evaluation read another prepared dataset (made with `mmldlm prepare --like RUN`) in place of
`run.val`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mmldlm.config import RunConfig, load_config
from mmldlm.data.dataset import PreparedDataset, model_for_dataset, resolve_for_model
from mmldlm.data.errors import DataError
from mmldlm.data.format import META, SPLITS, read_meta
from mmldlm.data.prepare import dataset_path
from mmldlm.data.tokenizer import encode_texts, load_tokenizer
from mmldlm.device import pick_device
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.errors import OptionError
from mmldlm.model import MultimodalMMDiT
from mmldlm.model.mmdit import upgrade_state_dict
from mmldlm.runs.checkpoints import find_latest, has_ema, is_full_state, read_weights, verify
from mmldlm.runs.files import CheckpointError
from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths


@dataclass
class TrainedRun:
    """A model with everything needed to feed it and read its output; see the module docstring."""

    cfg: RunConfig
    model: torch.nn.Module
    text: MaskedDiffusion
    latent: GaussianDiffusion
    tokenizer_file: Path  # the tokenizer the model was trained with
    encoder_name: str  # the sentence encoder that made the latents (a registered name or a local folder)
    encoder_normalize: bool | None  # its normalisation; None: the latents were imported, the encoder is unknown
    max_length: int  # texts are cut to the length training used
    dataset_dir: Path | None = None  # the training dataset (validation split, training words); None: an export
    checkpoint: Path | None = None  # where the weights came from (None: a model in training)
    step: int | None = None
    weights: str = "raw"  # "ema": the checkpoint's EMA of the weights, "raw": the trained weights

    @classmethod
    def on_dataset(
        cls,
        cfg: RunConfig,
        model: torch.nn.Module,
        text: MaskedDiffusion,
        latent: GaussianDiffusion,
        dataset_dir: str | Path,
        **fields,
    ) -> TrainedRun:
        """The model of a run trained on the prepared dataset at `dataset_dir`: tokenizer, encoder and
        cut length are the dataset's (ConfigError when the model cannot read it)."""
        dataset_dir = Path(dataset_dir)
        val = PreparedDataset(dataset_dir, "val")
        run = cls(
            cfg,
            model,
            text,
            latent,
            tokenizer_file=dataset_dir / val.meta["tokenizer"],
            encoder_name=val.meta["encoder"],
            encoder_normalize=val.meta.get("encoder_normalize"),
            max_length=resolve_for_model(cfg.data, cfg.model, val).max_length,
            dataset_dir=dataset_dir,
            **fields,
        )
        run.val = val  # already open
        return run

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sampler(self, options: SamplingOptions) -> Sampler:
        """A sampler of this model; it re-encodes texts with the run's sentence encoder where its options
        ask for it (best-of-N, correction rounds, length candidates). OptionError where they do and the
        latents were imported (no known encoder to re-encode with)."""
        if options.uses_encoder and self.encoder_normalize is None:
            raise OptionError(
                "sampling options best_of, correction_rounds, length_candidates",
                (options.best_of, options.correction_rounds, options.length_candidates),
                "1, 0, 1 for this model: its latents were imported, so no sentence encoder is known to "
                "re-encode candidates with (--best-of 1, or text_diffusion.sampling_best_of: 1)",
            )
        reencode = (
            (lambda tokens, pad_mask: self.encode_latents(self.decode(tokens, pad_mask)))
            if options.uses_encoder
            else None
        )
        return Sampler(self.model, self.text, self.latent, options, reencode)

    # --- data ------------------------------------------------------------------------------------

    @functools.cached_property
    def val(self):
        """The validation split of the run's dataset (what `use_eval_data` set, for an exported model)."""
        if self.dataset_dir is None:
            raise self.no_dataset()
        return PreparedDataset(self.dataset_dir, "val")

    def no_dataset(self) -> DataError:
        """The error of asking an exported model (no dataset of its own) for validation data."""
        return DataError(
            f"{self.checkpoint}: an exported model carries no validation data; give --data PATH, a "
            f"prepared dataset made with its tokenizer and encoder (the run's own, or `mmldlm prepare "
            f"--like {self.checkpoint} --input FILE --out PATH`)"
        )

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.tokenizer_file)

    @functools.cached_property
    def length_counts(self) -> torch.Tensor:
        """(max_length,) float: how many validation texts have each length 1..max_length (as cut for
        training), the distribution text lengths are drawn from where nothing else gives them."""
        lengths = np.clip(self.val.lengths(), 1, self.max_length)
        return torch.from_numpy(np.bincount(lengths - 1, minlength=self.max_length)).float()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, cut to the length training used (`tokens_cut` says how much went)."""
        return [ids[: self.max_length] for ids in encode_texts(self.tokenizer, texts)]

    def tokens_cut(self, texts: list[str]) -> list[int]:
        """How many tokens of each text `tokenize` cuts: those past the length training used."""
        return [max(len(ids) - self.max_length, 0) for ids in encode_texts(self.tokenizer, texts)]

    def cut_note(self, tokens_cut: list[int]) -> str | None:
        """One line saying how many of the texts were cut and how many tokens went (`tokens_cut`), or
        None when none was."""
        num_cut = sum(n > 0 for n in tokens_cut)
        if not num_cut:
            return None
        return (
            f"{num_cut} of {len(tokens_cut)} texts longer than the model's {self.max_length} tokens were cut to "
            f"their first {self.max_length} ({sum(tokens_cut)} tokens left out); split a long text into passages "
            f"to use all of it"
        )

    def batch_of(self, token_lists: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, L) padded with the pad id, pad_mask (B, L)) of lists of token ids."""
        pad_mask = pad_mask_from_lengths([max(len(ids), 1) for ids in token_lists])
        tokens = torch.full(pad_mask.shape, self.text.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            tokens[row, : len(ids)] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return tokens, pad_mask

    def decode(self, tokens: torch.Tensor, pad_mask: torch.Tensor) -> list[str]:
        """Texts of a (B, L) batch: the real positions of each row, decoded."""
        return [self.tokenizer.decode(row[mask].tolist()) for row, mask in zip(tokens.cpu(), pad_mask.cpu())]

    def latents_of(self, array, where: str) -> torch.Tensor:
        """float32 latents (N, K, D) of an array (N, K, D), or (N, D) for K = 1; DataError naming `where`
        when the shape is not the model's."""
        latents = torch.as_tensor(np.asarray(array, dtype=np.float32))
        if latents.dim() == 2:
            latents = latents[:, None, :]
        K, D = self.cfg.model.num_latents, self.cfg.model.latent_dim
        if latents.dim() != 3 or tuple(latents.shape[1:]) != (K, D):
            raise DataError(f"{where}: latents of shape {tuple(latents.shape)}; this model expects (N, {K}, {D})")
        return latents

    def use_eval_data(self, path: str | Path, split: str = "all") -> None:
        """Evaluate on the prepared dataset at `path` in place of the run's validation split: its
        "train" or "val" split, or "all" (train then val, in order). Only the samples change: latents
        are still standardised with the run's own training statistics (`self.latent`, what the model
        learnt with) and texts are still cut to the length training used. DataError when the dataset
        was not made with the run's tokenizer and encoder (`mmldlm prepare --like RUN` makes one that is)."""
        path = Path(path)
        check_compatible(self, path)
        # The length distribution is the run's own: settle it from the run's dataset before `val` is replaced.
        _ = self.length_counts if self.dataset_dir is not None else None
        self.val = AllSplits(path) if split == "all" else PreparedDataset(path, split)

    def predict_lengths(self, latents: torch.Tensor) -> list[int]:
        """The length head's most likely text length for each latent (N, K, D) in encoder space, among
        1..the length training cut texts to."""
        return [lengths[0] for lengths in self.candidate_lengths(latents, 1)]

    @torch.no_grad()
    def candidate_lengths(self, latents: torch.Tensor, num: int) -> list[list[int]]:
        """The length head's `num` most likely text lengths for each latent (N, K, D) in encoder space,
        most likely first, among 1..the length training cut texts to."""
        logits = self.model.length_logits(self.latent.standardize(latents.to(self.device, torch.float32)))
        logits = logits[:, : self.max_length]
        return (logits.topk(min(num, logits.shape[1]), dim=1).indices + 1).tolist()

    def sample_lengths(self, num: int, generator: torch.Generator) -> list[int]:
        """Text lengths drawn from the validation split's (`length_counts`), for sources without text."""
        return (torch.multinomial(self.length_counts, num, replacement=True, generator=generator) + 1).tolist()

    @torch.no_grad()
    def joint_batch(self, sampler: Sampler, lengths: list[int], generator=None) -> tuple[list[str], torch.Tensor]:
        """One batch of joint samples at the given lengths: texts and latents (B, K, D) in encoder space
        (on the CPU). With joint_order "latent_first" the latents come first and are decoded as l2t."""
        pad_mask = pad_mask_from_lengths(lengths)
        if sampler.options.joint_order == "latent_first":
            latents = sampler.latent_prior(pad_mask, generator)
            tokens = sampler.l2t(latents, pad_mask, generator)
        else:
            tokens, latents = sampler.joint(pad_mask, generator)
        return self.decode(tokens, pad_mask), latents.cpu()

    # --- the sentence encoder --------------------------------------------------------------------

    @functools.cached_property
    def encoder(self):
        """The encoder that made the dataset's latents, with the same normalisation."""
        from mmldlm.data.encoders import load_encoder  # here: only embedding texts needs the encoder

        if self.encoder_normalize is None:
            raise DataError(
                f"{self.tokenizer_file.parent}: the latents were imported (encoder_normalize is null), "
                f"so the encoder that made them is not known; give latents (.npy) instead of text"
            )
        return load_encoder(self.encoder_name, str(self.device), normalize=self.encoder_normalize)

    def encode_latents(self, texts: list[str]) -> torch.Tensor:
        """Latents (B, K, D) of texts in the encoder's space."""
        return torch.from_numpy(self.encoder.encode(texts))


@functools.lru_cache(maxsize=4)
def dataset_texts(dataset_dir: str, split: str) -> tuple[str, ...]:
    """Every text of a split ("all": both) of a prepared dataset, decoded (once per process: evaluation
    during training asks at every evaluation)."""
    data = AllSplits(dataset_dir) if split == "all" else PreparedDataset(dataset_dir, split)
    tokenizer = load_tokenizer(Path(dataset_dir) / data.meta["tokenizer"])
    return tuple(tokenizer.decode_batch([data[i][1].tolist() for i in range(len(data))]))


class AllSplits(torch.utils.data.ConcatDataset):
    """Every sample of a prepared dataset, its train split then its val split, as one sequence: the
    part of PreparedDataset that evaluation reads through `run.val` (len, [i] and meta). No
    latent_stats: statistics come from the run's own train split, never from data evaluated on."""

    split = "all"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        super().__init__([PreparedDataset(self.path, name) for name in SPLITS if self.meta["splits"].get(name)])

    def __getitem__(self, index: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(index, token ids (n,), latents (K, D)), as PreparedDataset's, the index counted over both splits."""
        _, tokens, latents = super().__getitem__(index)
        return index, tokens, latents


def check_compatible(run: TrainedRun, path: Path) -> None:
    """DataError unless the dataset at `path` reads as the run's own data does to the model: the same
    tokenizer (the same ids for the same text), the same encoder and normalisation (latents in the
    same space), the same latent shape (K, D)."""
    theirs = read_meta(path)
    theirs_tok = path / theirs["tokenizer"]
    fix = "prepare the text with `mmldlm prepare --like RUN_DIR --input FILE --out DIR`"
    if theirs_tok.read_text(encoding="utf-8") != run.tokenizer_file.read_text(encoding="utf-8"):
        raise DataError(
            f"{theirs_tok}: not the run's tokenizer {run.tokenizer_file} (the files differ, so the same "
            f"text would get other ids); {fix}"
        )
    ours = {
        "encoder": run.encoder_name,
        "encoder_normalize": run.encoder_normalize,
        "latent_dim": run.cfg.model.latent_dim,
        "num_latents": run.cfg.model.num_latents,
    }
    for key, value in ours.items():
        if theirs.get(key) != value:
            raise DataError(f"{path / META}: {key} {theirs.get(key)!r}, but the run's model has {value!r}; {fix}")


def find_checkpoint(run_dir: Path, checkpoint: str | Path | None) -> Path:
    """The checkpoint directory to load: `checkpoint`, else the run's newest that verifies
    (runs/checkpoints.py find_latest); either verified, checksums included, before a tensor is read."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not (path / ".metadata").is_file() and not is_full_state(path):
            raise DataError(
                f"--checkpoint {path}: no checkpoint there (no .metadata); checkpoints are "
                f"RUN/checkpoints/step-NNNNNNN directories"
            )
        reason = verify(path, checksums=True)
        if reason is not None:
            raise DataError(
                f"{reason}; the weights of {path} cannot be trusted: use another checkpoint, or leave the "
                f"choice to the run (its newest that verifies)"
            )
        return path
    if not run_dir.is_dir():
        raise DataError(
            f"{run_dir}: no such directory; expected a training run directory (train.run_dir) or an "
            f"exported model folder (mmldlm export) on this machine (nothing is downloaded)"
        )
    try:
        path = find_latest(
            run_dir / "checkpoints", checksums=True, hint="pass --checkpoint PATH of a checkpoint you trust"
        )
    except CheckpointError as err:
        raise DataError(str(err)) from None
    if path is None:
        raise DataError(
            f"{run_dir}: no checkpoints, so no trained weights; train the run first (mmldlm train) "
            f"or pass --checkpoint PATH"
        )
    return path


def weight_mismatches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """What keeps `state` from loading into `model` (its missing, unexpected and differently shaped
    tensors, the first three of each, in words), or None when it fits. A sharded model's tensors count
    with their whole shape."""
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    shapes = [
        f"{k} {list(state[k].shape)} (the config makes {list(expected[k].shape)})"
        for k in sorted(expected.keys() & state.keys())
        if state[k].shape != expected[k].shape
    ]
    problems = [
        f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape of", shapes))
        if keys
    ]
    return "; ".join(problems) or None


def load_weights(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Load a safetensors file (or `state`, the weights read from `path`) into `model`, or DataError
    naming the file and what does not match the model's config (missing, unexpected or differently
    shaped tensors); the model is untouched then."""
    if state is None:
        if not path.is_file():
            raise DataError(f"{path}: no such file; the model's weights are missing")
        try:
            state = load_file(str(path))
        except SafetensorError as err:
            raise DataError(f"{path}: not a readable safetensors file ({err})") from None
    state = upgrade_state_dict(state, model.cfg.num_heads)  # weights of an earlier mmldlm's layout
    problems = weight_mismatches(model, state)
    if problems:
        raise DataError(f"{path}: the weights do not match the model config: {problems}")
    model.load_state_dict(state)


def recorded_dataset(checkpoint: Path, cfg: RunConfig) -> Path | None:
    """The bundled corpus a run with data.path null trained on, where its checkpoint recorded it and it
    is still there: the cache it was prepared into may not be the one this environment names
    (MMLDLM_CACHE then unset, say), which would prepare the same corpus again. None otherwise."""
    if cfg.data.path is not None:
        return None
    meta_file = checkpoint / "meta.json"
    recorded = json.loads(meta_file.read_text()).get("dataset") if meta_file.is_file() else None
    if recorded is None or not (Path(recorded) / META).is_file():
        return None
    return Path(recorded)


def recorded_run_dataset(run_dir: Path) -> Path | None:
    """`recorded_dataset` of the newest checkpoint of the run in `run_dir` (None without a checkpoint
    that reads or a config.yaml)."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        return None
    try:
        checkpoint = find_latest(run_dir / "checkpoints")
    except CheckpointError:
        return None  # no checkpoint that reads: the caller looks in the cache, as without one
    return recorded_dataset(checkpoint, load_config(config_file)) if checkpoint is not None else None


def load_run(
    run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "auto", use_ema: bool | None = None
) -> TrainedRun:
    """The model of `checkpoint` (default the run's newest that verifies) with the config it was trained with,
    on `device`: "auto" (the GPU when there is one), "cpu" or "cuda". `use_ema`: None, the checkpoint's EMA
    of the weights where it holds one (train.ema_decay > 0), else the raw weights; True, the EMA (OptionError
    where the checkpoint holds none); False, the raw weights."""
    run_dir = Path(run_dir)
    path = find_checkpoint(run_dir, checkpoint)
    weights = "ema" if use_ema is not False and has_ema(path) else "raw"
    if use_ema and weights == "raw":
        raise OptionError(
            "use_ema",
            use_ema,
            f"None or False: {path} holds no EMA of the weights (its run kept none, train.ema_decay 0); None "
            f"takes the EMA where a checkpoint holds one, else the raw weights",
        )
    config_file = path / "config.yaml" if (path / "config.yaml").is_file() else run_dir / "config.yaml"
    cfg = load_config(config_file)
    data_dir = recorded_dataset(path, cfg) or dataset_path(cfg.data, log=lambda _msg: None)
    val = PreparedDataset(data_dir, "val")
    cfg = dataclasses.replace(cfg, model=model_for_dataset(cfg.model, val))
    model = MultimodalMMDiT(cfg.model, vocab_size=cfg.model.vocab_size or val.vocab_size)
    # In this one process, whatever the number of processes that wrote the checkpoint.
    load_weights(model, path, read_weights(path, "ema" if weights == "ema" else "model"))
    model.to(pick_device(device, key="device")).eval()
    text = MaskedDiffusion(cfg.text_diffusion, mask_token_id=val.mask_id, pad_token_id=val.pad_id)
    mean, std = val.latent_stats()
    meta_file = path / "meta.json"
    step = json.loads(meta_file.read_text())["step"] if meta_file.is_file() else None
    return TrainedRun.on_dataset(
        cfg,
        model,
        text,
        GaussianDiffusion(cfg.latent_diffusion, mean=mean, std=std),
        data_dir,
        checkpoint=path,
        step=step,
        weights=weights,
    )
