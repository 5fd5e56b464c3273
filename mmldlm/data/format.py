"""The prepared dataset on disk, and the checks that refuse a damaged or foreign one.

    DIR/meta.json                   what is below (schema in docs/data.md), format_version first
    DIR/tokenizer.json              the tokenizer that produced the ids
    DIR/<split>/tokens-00000.bin    flat token ids of the shard's samples, no padding (uint16 or uint32)
    DIR/<split>/offsets-00000.npy   int64 (n + 1,): sample i is tokens[offsets[i]:offsets[i + 1]]
    DIR/<split>/latents-00000.npy   (n, K, D) float16 or float32, memory-mappable .npy
    DIR/token_latents.npy           (V, K, D) float32: the encoder's latent of each vocabulary entry's
                                    own text (zeros for special and blank entries); optional, named
                                    by meta.json "token_latents", for the model's vocabulary prior

A split is a list of shards of consecutive samples; shard boundaries depend only on the shard
size, never on how many processes prepared the data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from mmldlm import __version__
from mmldlm.data.errors import DataError
from mmldlm.outputs import FolderKind

FORMAT_VERSION = 1
META = "meta.json"
TOKENIZER = "tokenizer.json"
TOKEN_LATENTS = "token_latents.npy"
# Only in the partial directory `prepare` writes before publishing: the options and tokenizer it was
# started with, and one record per finished shard, so an interrupted prepare continues where it stopped.
PARTIAL = "partial.json"
SHARD_RECORD = re.compile(r"(train|val)/done-\d{5}\.json")
SPLITS = ("train", "val")
REQUIRED_KEYS = (
    "format_version",
    "tokenizer",
    "vocab_size",
    "pad_id",
    "mask_id",
    "token_dtype",
    "encoder",
    "latent_dim",
    "num_latents",
    "latent_dtype",
    "splits",
    "shards",
    "latent_mean",
    "latent_std",
)
# What `mmldlm prepare` writes in the directory (and ensure_token_latents' temporary files beside them):
# `prepare --overwrite` replaces a directory that holds nothing else.
PREPARED = FolderKind(
    "a prepared dataset",
    META,
    re.compile(
        r"(meta\.json|tokenizer\.json|token_latents\.npy|\.(meta\.json|token_latents\.npy)\.tmp"
        r"|(train|val)/(tokens|offsets|latents)-\d{5}\.(bin|npy)"
        r"|partial\.json|(train|val)/\.?done-\d{5}\.json(\.tmp)?)"
    ),
)


def shard_files(split: str, index: int) -> dict[str, str]:
    return {
        kind: f"{split}/{kind}-{index:05d}.{ext}"
        for kind, ext in (("tokens", "bin"), ("offsets", "npy"), ("latents", "npy"))
    }


def shard_record(split: str, index: int) -> str:
    return f"{split}/done-{index:05d}.json"


def files_of_partial(root: Path) -> list[str]:
    """The records of an unfinished prepare in `root` (relative paths): PARTIAL and the shard records."""
    records = [f"{split}/{p.name}" for split in SPLITS for p in sorted((root / split).glob("done-*.json"))]
    return ([PARTIAL] if (root / PARTIAL).is_file() else []) + [r for r in records if SHARD_RECORD.fullmatch(r)]


def write_shard(
    root: Path,
    split: str,
    index: int,
    token_lists: list,
    latents: np.ndarray,
    token_dtype: np.dtype,
    latent_dtype: np.dtype,
) -> dict:
    """Write one shard; returns its meta.json entry."""
    files = shard_files(split, index)
    (root / split).mkdir(parents=True, exist_ok=True)
    offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids in token_lists], out=offsets[1:])
    # Each sample's ids (a list or an array) converted on its own: no Python int per token of the shard.
    flat = np.concatenate([np.asarray(ids, dtype=token_dtype) for ids in token_lists] or [np.zeros(0, token_dtype)])
    flat.tofile(root / files["tokens"])
    np.save(root / files["offsets"], offsets)
    np.save(root / files["latents"], np.ascontiguousarray(latents, dtype=latent_dtype))
    return {**files, "num_samples": len(token_lists), "num_tokens": int(offsets[-1])}


def read_meta(root: str | Path) -> dict:
    root = Path(root)
    path = root / META
    if not path.is_file():
        what = "no such directory" if not root.exists() else f"not a prepared dataset (no {META})"
        raise DataError(f"{root}: {what}; create one with `mmldlm prepare --input PATH|default --out {root}`")
    rerun = "; re-run mmldlm prepare with --overwrite"
    refused = f", but this mmldlm reads format version {FORMAT_VERSION}{rerun} to rebuild it"
    return read_format(path, range(FORMAT_VERSION, FORMAT_VERSION + 1), REQUIRED_KEYS, refused, remedy=rerun)


def read_format(path: Path, versions: range, required: tuple, refused: str, newer: str = "", remedy: str = "") -> dict:
    """The JSON object in `path` (a prepared dataset's meta.json, an exported model's config.json) when its
    format_version is an integer in `versions` and it holds every key of `required`; DataError naming `path`
    otherwise, ending with `refused` for a version not read (`newer`, where given, for one above `versions`:
    from a newer mmldlm) and with `remedy` for the rest."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err}){remedy}") from None
    version = content.get("format_version") if isinstance(content, dict) else None
    if type(version) is not int or version not in versions:  # an int: true and 1.0 are no format version
        later = newer and type(version) is int and version > versions[-1]
        why = f", newer than this mmldlm {__version__} reads ({versions[-1]}); {newer}" if later else refused
        raise DataError(f"{path}: format_version {version!r}{why}")
    missing = [key for key in required if key not in content]
    if missing:
        raise DataError(f"{path}: missing keys {', '.join(missing)}{remedy}")
    return content


def _npy_header(path: Path) -> tuple[tuple, np.dtype, int]:
    """(shape, dtype, header bytes) of a .npy file without reading its data."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)
        except ValueError as err:
            raise DataError(f"{path}: not a valid .npy file ({err}); re-run mmldlm prepare with --overwrite") from None
        return shape, dtype, f.tell()


def _expect_size(path: Path, expected: int) -> None:
    if not path.is_file():
        raise DataError(f"{path}: missing shard file; re-run mmldlm prepare with --overwrite")
    size = os.path.getsize(path)
    if size != expected:
        raise DataError(
            f"{path}: {size} bytes, expected {expected} from meta.json "
            f"({'truncated' if size < expected else 'longer than recorded'}); "
            f"re-run mmldlm prepare with --overwrite"
        )


def open_shard(root: Path, shard: dict, meta: dict) -> tuple[np.memmap, np.ndarray, np.ndarray]:
    """Memory-map one shard after checking every file's size against meta.json.
    Returns (tokens (T,), offsets (n + 1,), latents (n, K, D)); nothing is read into memory."""
    n, num_tokens = shard["num_samples"], shard["num_tokens"]
    token_dtype = np.dtype(meta["token_dtype"])
    checks = {
        "offsets": ((n + 1,), np.dtype(np.int64)),
        "latents": ((n, meta["num_latents"], meta["latent_dim"]), np.dtype(meta["latent_dtype"])),
    }
    arrays = {}
    for kind, (shape, dtype) in checks.items():
        path = root / shard[kind]
        if not path.is_file():
            raise DataError(f"{path}: missing shard file; re-run mmldlm prepare with --overwrite")
        found_shape, found_dtype, header = _npy_header(path)
        if found_shape != shape or found_dtype != dtype:
            raise DataError(
                f"{path}: holds {found_dtype} {list(found_shape)}, meta.json says {dtype} {list(shape)}; "
                f"re-run mmldlm prepare with --overwrite"
            )
        _expect_size(path, header + int(np.prod(shape)) * dtype.itemsize)
        arrays[kind] = np.load(path, mmap_mode="r")
    _expect_size(root / shard["tokens"], num_tokens * token_dtype.itemsize)
    if n and int(arrays["offsets"][-1]) != num_tokens:
        raise DataError(
            f"{root / shard['offsets']}: ends at {int(arrays['offsets'][-1])}, meta.json records "
            f"{num_tokens} tokens; re-run mmldlm prepare with --overwrite"
        )
    tokens = (
        np.memmap(root / shard["tokens"], dtype=token_dtype, mode="r") if num_tokens else np.zeros(0, dtype=token_dtype)
    )  # mmap cannot map an empty file
    return tokens, arrays["offsets"], arrays["latents"]
