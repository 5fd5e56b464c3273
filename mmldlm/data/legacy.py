"""Import of a per-sample preprocessed layout (one file per text), so data kept that way can be migrated:

    TOKENS_DIR/<stem>_tokens.npz   keys input_ids, attention_mask: (L,) or (1, L), padded
    LATENTS_DIR/<stem>.npy         float32 (D,) or (1, D) (or (K, D))

In two orders (ORDERS): `sorted` takes every <stem>_tokens.npz in sorted stem order, each with its latent;
`scan` walks the token folder as the older loader did, in the folder's own order (os.scandir: the
order the filesystem lists it, not sorted), keeps each .npz whose latent exists (NAME_tokens.npz pairs
with NAME.npy, else NAME.npz with NAME.npy) and stops at the limit: on the filesystem the older loader
read, the same files it read; on a copy elsewhere, other files. Padding (attention_mask 0) is dropped,
because our shards store each sample unpadded and the loader pads per batch.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmldlm.data.errors import DataError
from mmldlm.wording import counted

SUFFIX = "_tokens.npz"
ORDERS = ("sorted", "scan")
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


def sorted_pairs(tokens_dir: Path, latents_dir: Path) -> list[tuple[Path, Path]]:
    """Every <stem>_tokens.npz in sorted order with its <stem>.npy; a token file without one is an error."""
    stems = sorted(p.name[: -len(SUFFIX)] for p in tokens_dir.glob(f"*{SUFFIX}"))
    missing = [s for s in stems if not (latents_dir / f"{s}.npy").is_file()]
    if missing:
        raise DataError(
            f"{tokens_dir / (missing[0] + SUFFIX)}: no matching latent {latents_dir / (missing[0] + '.npy')} "
            f"({counted(len(missing), 'token file')} without one)"
        )
    return [(tokens_dir / f"{s}{SUFFIX}", latents_dir / f"{s}.npy") for s in stems]


def scanned_pairs(tokens_dir: Path, latents_dir: Path, limit: int | None) -> list[tuple[Path, Path]]:
    """The older loader's walk: os.scandir's order, each .npz whose latent exists, at most `limit` pairs."""
    pairs = []
    with os.scandir(tokens_dir) as entries:
        for entry in entries:
            if limit is not None and len(pairs) == limit:
                break
            if not entry.name.endswith(".npz"):
                continue
            name = entry.name[: -len(".npz")]
            names = [name.removesuffix("_tokens"), name] if name.endswith("_tokens") else [name]
            latent = next((latents_dir / f"{n}.npy" for n in names if (latents_dir / f"{n}.npy").is_file()), None)
            if latent is not None:
                pairs.append((Path(entry.path), latent))
    return pairs


class LegacySource:
    """The pairs of a legacy folder, in `order` (ORDERS; `limit`: scan stops there); read shard by shard
    like a corpus."""

    def __init__(
        self,
        tokens_dir: str | Path,
        latents_dir: str | Path,
        vocab_size: int,
        tokenizer_path: str,
        order: str = "sorted",
        limit: int | None = None,
    ):
        self.tokens_dir, self.latents_dir = Path(tokens_dir), Path(latents_dir)
        self.vocab_size, self.tokenizer_path = vocab_size, tokenizer_path
        for folder in (self.tokens_dir, self.latents_dir):
            if not folder.is_dir():
                raise DataError(f"{folder}: no such folder")
        if order == "scan":
            self.pairs = scanned_pairs(self.tokens_dir, self.latents_dir, limit)
            expected = f".npz files with a latent in {self.latents_dir}"
        else:
            self.pairs = sorted_pairs(self.tokens_dir, self.latents_dir)
            expected = f"<stem>{SUFFIX} files"
        if not self.pairs:
            raise DataError(f"{self.tokens_dir}: no {expected}")
        first = self.pairs[0][1]
        self.latent_shape = _as_kd(first, _load(first, ".npy")).shape  # (K, D) every sample must have

    def __len__(self) -> int:
        return len(self.pairs)

    def keep(self, indices: np.ndarray) -> None:
        """Only the samples at `indices` (sorted) from now on: a --max-samples subset."""
        self.pairs = [self.pairs[i] for i in indices]

    def fingerprint(self, indices: np.ndarray) -> str:
        """The names, sizes and modification times of the files of `indices`: a finished shard is reused
        only while none of its files changed (one stat per file, no read)."""
        digest = hashlib.sha256()
        for i in indices:
            for path in self.pairs[i]:
                try:
                    stat = path.stat()
                except OSError:  # gone since: the shard is redone, and its read names the file
                    digest.update(f"{path}:missing".encode())
                    continue
                digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
        return digest.hexdigest()

    def _tokens(self, path: Path) -> np.ndarray:
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

    def _latent(self, path: Path) -> np.ndarray:
        latent = _as_kd(path, _load(path, ".npy"))
        if latent.shape != self.latent_shape:
            raise DataError(
                f"{path}: latent of shape {list(latent.shape)}, but "
                f"{self.pairs[0][1]} has {list(self.latent_shape)}; "
                f"all samples need the same latent dim"
            )
        return latent.astype(np.float32)

    def shard(self, indices: np.ndarray, progress: Callable[[int], None]) -> tuple[list, np.ndarray, None]:
        """(token ids, one int32 array per sample; latents (n, K, D); None: nothing is cut, the ids are kept as
        they are)."""
        token_lists, latents = [], []
        for i in indices:
            tokens, latent = self.pairs[i]
            token_lists.append(self._tokens(tokens))
            latents.append(self._latent(latent))
            progress(1)
        return token_lists, np.stack(latents), None  # (n, K, D)
