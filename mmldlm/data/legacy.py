"""Import of a per-sample preprocessed layout (one file per text), so data kept that way can be migrated:

    TOKENS_DIR/<stem>_tokens.npz   keys input_ids, attention_mask: (L,) or (1, L), padded
    LATENTS_DIR/<stem>.npy         float32 (D,) or (1, D) (or (K, D))

Samples are taken in sorted stem order; padding (attention_mask 0) is dropped, because our shards
store each sample unpadded and the loader pads per batch.
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmldlm.data.errors import DataError

SUFFIX = "_tokens.npz"
UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def _load(path: Path, what: str):
    try:
        return np.load(path)
    except UNREADABLE as err:
        raise DataError(f"{path}: not a readable {what} ({err})") from None


def _as_kd(path: Path, latent: np.ndarray) -> np.ndarray:
    """(D,) -> (1, D); (K, D) stays."""
    if latent.ndim not in (1, 2) or latent.size == 0:
        raise DataError(f"{path}: latent of shape {list(latent.shape)}, expected [D] or [1, D]")
    return latent.reshape(1, -1) if latent.ndim == 1 else latent


class LegacySource:
    """The pairs of a legacy folder; read shard by shard like a corpus."""

    def __init__(self, tokens_dir: str | Path, latents_dir: str | Path, vocab_size: int, tokenizer_path: str):
        self.tokens_dir, self.latents_dir = Path(tokens_dir), Path(latents_dir)
        self.vocab_size, self.tokenizer_path = vocab_size, tokenizer_path
        for folder in (self.tokens_dir, self.latents_dir):
            if not folder.is_dir():
                raise DataError(f"{folder}: no such folder")
        self.stems = sorted(p.name[: -len(SUFFIX)] for p in self.tokens_dir.glob(f"*{SUFFIX}"))
        if not self.stems:
            raise DataError(f"{self.tokens_dir}: no <stem>{SUFFIX} files")
        missing = [s for s in self.stems if not (self.latents_dir / f"{s}.npy").is_file()]
        if missing:
            raise DataError(
                f"{self.tokens_dir / (missing[0] + SUFFIX)}: no matching latent "
                f"{self.latents_dir / (missing[0] + '.npy')} ({len(missing)} token file(s) lack one)"
            )
        first = self.latents_dir / f"{self.stems[0]}.npy"
        self.latent_shape = _as_kd(first, _load(first, ".npy")).shape  # (K, D) every sample must have

    def __len__(self) -> int:
        return len(self.stems)

    def keep(self, indices: np.ndarray) -> None:
        """Only the samples at `indices` (sorted) from now on: a --max-samples subset."""
        self.stems = [self.stems[i] for i in indices]

    def fingerprint(self, indices: np.ndarray) -> str:
        """The names, sizes and modification times of the files of `indices`: a finished shard is reused
        only while none of its files changed (one stat per file, no read)."""
        digest = hashlib.sha256()
        for i in indices:
            stem = self.stems[i]
            for path in (self.tokens_dir / f"{stem}{SUFFIX}", self.latents_dir / f"{stem}.npy"):
                try:
                    stat = path.stat()
                except OSError:  # gone since: the shard is redone, and its read names the file
                    digest.update(f"{path}:missing".encode())
                    continue
                digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
        return digest.hexdigest()

    def _tokens(self, stem: str) -> np.ndarray:
        path = self.tokens_dir / f"{stem}{SUFFIX}"
        archive = _load(path, ".npz")
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise DataError(f"{path}: a single array, expected an .npz archive with input_ids and attention_mask")
        with archive as npz:
            missing = [k for k in ("input_ids", "attention_mask") if k not in npz.files]
            if missing:
                raise DataError(f"{path}: no key {', '.join(missing)} (keys: {', '.join(npz.files)})")
            ids, mask = npz["input_ids"].reshape(-1), npz["attention_mask"].reshape(-1)
        if ids.shape != mask.shape:
            raise DataError(f"{path}: input_ids has {ids.size} entries, attention_mask {mask.size}")
        if not np.isin(mask, (0, 1)).all():
            bad = mask[~np.isin(mask, (0, 1))][0]
            raise DataError(f"{path}: attention_mask holds {bad.item()}; expected only 0 (padding) and 1 (a token)")
        ids = ids[mask.astype(bool)]
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
            raise DataError(
                f"{path}: token id {bad} outside the vocabulary of {self.tokenizer_path} (size "
                f"{self.vocab_size}); give the tokenizer that produced these ids"
            )
        return ids.astype(np.int32)  # an array, not a list: a shard of 2048-token texts holds no Python ints

    def _latent(self, stem: str) -> np.ndarray:
        path = self.latents_dir / f"{stem}.npy"
        latent = _as_kd(path, _load(path, ".npy"))
        if latent.shape != self.latent_shape:
            raise DataError(
                f"{path}: latent of shape {list(latent.shape)}, but "
                f"{self.latents_dir / (self.stems[0] + '.npy')} has {list(self.latent_shape)}; "
                f"all samples need the same latent dim"
            )
        return latent.astype(np.float32)

    def shard(self, indices: np.ndarray, progress: Callable[[int], None]) -> tuple[list, np.ndarray, None]:
        """(token ids, one int32 array per sample; latents (n, K, D); None: nothing is cut, the ids are kept as
        they are)."""
        token_lists, latents = [], []
        for i in indices:
            token_lists.append(self._tokens(self.stems[i]))
            latents.append(self._latent(self.stems[i]))
            progress(1)
        return token_lists, np.stack(latents), None  # (n, K, D)
