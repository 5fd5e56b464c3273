"""The text tokenizer: a byte-level BPE trained here with `tokenizers`, or a local one loaded from a
`tokenizer.json` (or a Hugging Face tokenizer folder holding one).

Byte-level BPE without a normaliser or prefix space decodes back to exactly the input text, so a
sample's tokens are a lossless record of it. Two special tokens are always present: [PAD] (the
loader pads with it; never in a stored sample) and [MASK] (the absorbing state of masked
diffusion). A loaded tokenizer that lacks them gets them appended to its vocabulary. Text that
happens to contain the string "[MASK]" is tokenised as plain text, never as the special id (the
`encode_special_tokens` switch, which tokenizer.json does not store, so every tokenizer of the data
pipeline is made here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mmldlm.data.errors import DataError

PAD, MASK = "[PAD]", "[MASK]"
MIN_VOCAB_SIZE = 256 + 2  # every byte, plus [PAD] and [MASK]


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 byte symbols + {PAD} + {MASK})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, MASK],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return _plain_text_specials(tokenizer)


def _plain_text_specials(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizer.json`, or a folder that holds one; [PAD] and [MASK] are added when missing."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        hint = " (save a fast tokenizer with save_pretrained to get one)" if path.is_dir() else ""
        raise DataError(f"{file}: no such tokenizer file{hint}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"{file}: not a valid tokenizer.json: {err}") from None
    # Samples are stored unpadded and whole; the loader pads and truncates per batch.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    missing = [t for t in (PAD, MASK) if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
    return _plain_text_specials(tokenizer)


def from_json(text: str) -> Tokenizer:
    return _plain_text_specials(Tokenizer.from_str(text))


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {"pad_id": tokenizer.token_to_id(PAD), "mask_id": tokenizer.token_to_id(MASK)}


def vocab_size(tokenizer: Tokenizer) -> int:
    return tokenizer.get_vocab_size(with_added_tokens=True)


def token_dtype(num_ids: int) -> np.dtype:
    """The narrowest unsigned type holding every id: half the disk and page cache of uint32."""
    return np.dtype(np.uint16) if num_ids <= 2**16 else np.dtype(np.uint32)


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (a loaded tokenizer's [CLS]/[SEP] post-processing is skipped)."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
