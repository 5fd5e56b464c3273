"""A prepared dataset of random tokens and latents, for measuring speed and memory at a given shape
without a corpus, a tokenizer or a sentence encoder (`mmldlm bench --synthetic-*`).

    shape = SyntheticShape(vocab_size=30522, min_length=600, max_length=2048, latent_dim=32)
    write_synthetic(shape, Path("runs/bench/synthetic-data"))   # an ordinary prepared dataset

Every text's length is drawn uniformly from [min_length, max_length], its ids uniformly from the
vocabulary's non-special entries, its one latent from N(0, I). A step's cost depends on the lengths,
the vocabulary and the latent width, not on what the ids say, so these measure what real data of
the same shape would; the losses mean nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models

from mmldlm.data.format import FORMAT_VERSION, META, PREPARED, TOKENIZER, write_shard
from mmldlm.data.tokenizer import MASK, PAD, special_ids, token_dtype
from mmldlm.errors import OptionError
from mmldlm.outputs import publish

VAL_SAMPLES = 16  # a validation split must exist; nothing here evaluates on it


@dataclasses.dataclass(frozen=True)
class SyntheticShape:
    vocab_size: int = 30522  # entries, [PAD] and [MASK] included
    min_length: int = 600  # tokens per text, drawn uniformly from [min_length, max_length]
    max_length: int = 2048
    latent_dim: int = 32
    num_samples: int = 1024  # train texts
    seed: int = 0

    def check(self, option: str = "--synthetic") -> None:
        if self.vocab_size < 3:
            raise OptionError(f"{option}-vocab", self.vocab_size, "an integer >= 3 ([PAD], [MASK] and one word)")
        if not 1 <= self.min_length <= self.max_length:
            raise OptionError(
                f"{option}-lengths", f"{self.min_length}:{self.max_length}", "MIN:MAX with 1 <= MIN <= MAX"
            )
        if self.latent_dim < 1:
            raise OptionError(f"{option}-latent-dim", self.latent_dim, "an integer >= 1")
        if self.num_samples < 1:
            raise OptionError(f"{option}-samples", self.num_samples, "an integer >= 1")

    def describe(self) -> str:
        mean = (self.min_length + self.max_length) / 2
        return (
            f"synthetic tokens: {self.num_samples} texts of uniformly random length {self.min_length}-"
            f"{self.max_length} tokens (mean {mean:g}), ids uniform over a {self.vocab_size}-entry vocabulary, "
            f"one {self.latent_dim}-d N(0, 1) latent each"
        )


def parse_lengths(text: str, option: str = "--synthetic-lengths") -> tuple[int, int]:
    """ "600:2048" -> (600, 2048); "2048" -> (2048, 2048)."""
    try:
        low, _, high = text.partition(":")
        return int(low), int(high or low)
    except ValueError:
        raise OptionError(option, text, "MIN:MAX token counts, e.g. 600:2048") from None


def _tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer of [PAD], [MASK] and words w2 .. w{V-1}: the dataset's ids decode."""
    vocab = {PAD: 0, MASK: 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    return Tokenizer(models.WordLevel(vocab, unk_token=MASK))


def _split(rng: np.random.Generator, shape: SyntheticShape, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    lengths = rng.integers(shape.min_length, shape.max_length + 1, size=count)
    token_lists = [rng.integers(2, shape.vocab_size, size=n) for n in lengths]
    latents = rng.standard_normal((count, 1, shape.latent_dim)).astype(np.float32)  # (N, K=1, D)
    return token_lists, latents


def write_synthetic(shape: SyntheticShape, out: Path) -> Path:
    """Write the dataset of `shape` as a prepared dataset at `out` (replacing one written before)."""
    shape.check()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted run
    rng = np.random.default_rng(shape.seed)
    ids_dtype = token_dtype(shape.vocab_size)
    shards, num_tokens, longest = {}, {}, {}
    for split, count in (("train", shape.num_samples), ("val", VAL_SAMPLES)):
        token_lists, latents = _split(rng, shape, count)
        shards[split] = [write_shard(partial, split, 0, token_lists, latents, ids_dtype, np.dtype(np.float32))]
        num_tokens[split] = shards[split][0]["num_tokens"]
        longest[split] = max(map(len, token_lists))
    tokenizer = _tokenizer(shape.vocab_size)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": TOKENIZER,
        "vocab_size": shape.vocab_size,
        **special_ids(tokenizer),
        "token_dtype": ids_dtype.name,
        "encoder": "none (synthetic N(0, 1) latents)",
        "encoder_normalize": None,
        "synthetic": dataclasses.asdict(shape),
        "latent_dim": shape.latent_dim,
        "num_latents": 1,
        "latent_dtype": "float32",
        "splits": {"train": shape.num_samples, "val": VAL_SAMPLES},
        "num_tokens": num_tokens,
        "max_sample_tokens": longest,
        "latent_mean": [0.0] * shape.latent_dim,
        "latent_std": [1.0] * shape.latent_dim,
        "shards": shards,
    }
    (partial / TOKENIZER).write_text(tokenizer.to_str())
    (partial / META).write_text(json.dumps(meta, indent=1) + "\n")
    publish(partial, out, PREPARED)
    return out
