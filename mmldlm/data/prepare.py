"""Corpus -> prepared dataset directory (see format.py), on one process or sharded under torchrun.

1. Rank 0 looks at the output: complete with the same options -> nothing to do; else a fresh
   temporary directory `.NAME.partial` beside it.
2. Every rank reads and filters the corpus (cheap, identical everywhere) and draws the same
   train/val split from the seed: a seeded permutation, the first `val_fraction` of it is val, and
   each split keeps corpus order.
3. Rank 0 trains (or loads) the tokenizer once and broadcasts it, so every rank tokenises with
   the same merges whatever `tokenizers` does with threads; it then measures the texts' lengths
   and reports what the model and encoder limits would cut (long_texts.py).
4. Each split is cut into shards of `shard_size` consecutive texts; rank r tokenises, fits the long
   texts to the limits (cut, split or dropped), encodes and writes shards r, r + W, r + 2W, ... and
   reports per-shard latent sums.
5. Rank 0 adds the sums in shard order (float64), writes meta.json and the tokenizer, and renames
   the temporary directory onto the output. Shards and sums do not depend on W, so the output is
   the same for any number of processes.

A failure on any rank reaches every rank as the same DataError (no rank waits forever on a dead
peer), and rank 0 removes the temporary directory: no half-written output is ever left behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

from mmldlm import __version__
from mmldlm.config import DataConfig, load_config
from mmldlm.data import corpus, long_texts
from mmldlm.data.dataset import PreparedDataset, resolve_for_model
from mmldlm.data.encoders import DEFAULT_ENCODER, REGISTRY, load_encoder
from mmldlm.data.errors import DataError
from mmldlm.data.format import (
    FORMAT_VERSION,
    META,
    PARTIAL,
    PREPARED,
    SPLITS,
    TOKEN_LATENTS,
    TOKENIZER,
    files_of_partial,
    read_meta,
    shard_record,
    write_shard,
)
from mmldlm.data.legacy import ORDERS, LegacySource
from mmldlm.data.tokenizer import (
    MASK,
    MIN_VOCAB_SIZE,
    PAD,
    encode_texts,
    from_json,
    load_tokenizer,
    special_ids,
    token_dtype,
    train_bpe,
    vocab_size,
)
from mmldlm.device import pick_device
from mmldlm.errors import Interrupted, OptionError, UserError, require_positive
from mmldlm.outputs import publish, refuse_foreign, write_atomically
from mmldlm.wording import counted

LATENT_DTYPES = ("float16", "float32")
STD_FLOOR = 1e-6  # standardising by the std never divides by zero, even for a constant dimension
# Options that only change how the work runs, not what is written; a rerun may change them freely.
RUN_ONLY_OPTIONS = ("out", "overwrite", "device", "encode_batch_size", "progress")
# Options added after datasets were prepared without them: recorded only away from their default, so that
# those datasets (and the default corpus's cache entries) stay complete.
LATER_OPTIONS = {"legacy_order": "sorted"}
UNKNOWN_SHARE = 0.01  # prepare warns when the encoder reads more than this share of the word pieces as unknown
UNKNOWN_CHECKED_TEXTS = 10_000  # ... in an evenly spread sample of about this many texts


@dataclass
class PrepareOptions:
    """What `mmldlm prepare` takes; see mmldlm/commands/prepare.py for each option's help."""

    inputs: list[str] = field(default_factory=lambda: ["default"])
    out: str = "data/prepared/default"
    format: str = "auto"
    text_field: str = "text"
    paragraphs: bool = False
    min_chars: int = 1
    max_chars: int = 1000
    long_texts: str = "cut"  # what a text over --max-tokens or the encoder's limit becomes (long_texts.py)
    max_tokens: int | None = None  # the longest text the model reads; None: only the encoder's limit
    dedup: bool = True
    max_samples: int | None = None  # a seeded random subset of the filtered samples
    vocab_size: int = 8192
    tokenizer: str | None = None
    encoder: str = DEFAULT_ENCODER
    normalize: bool = True
    latent_dtype: str = "float16"
    val_fraction: float = 0.01
    seed: int = 0
    shard_size: int = 16384
    legacy_tokens: str | None = None
    legacy_latents: str | None = None
    legacy_order: str = "sorted"  # legacy.ORDERS: sorted; scan (the folder's own order, --max-samples the first N)
    encode_batch_size: int = 128
    device: str = "auto"
    overwrite: bool = False
    progress: bool = True

    def recorded(self) -> dict[str, Any]:
        """The options that decide the content, as stored in meta.json["prepare"]."""
        return {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in RUN_ONLY_OPTIONS and (k not in LATER_OPTIONS or v != LATER_OPTIONS[k])
        }

    def check(self) -> None:
        if self.latent_dtype not in LATENT_DTYPES:
            raise OptionError("--latent-dtype", self.latent_dtype, f"one of {', '.join(LATENT_DTYPES)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise OptionError("--val-fraction", self.val_fraction, "a number in [0, 1)")
        if self.max_samples is not None and self.max_samples < 2:
            raise OptionError("--max-samples", self.max_samples, "an integer >= 2 (train and val)")
        require_positive(
            {
                "--shard-size": self.shard_size,
                "--encode-batch-size": self.encode_batch_size,
                "--min-chars": self.min_chars,
            }
        )
        if self.long_texts not in long_texts.MODES:
            raise OptionError("--long-texts", self.long_texts, f"one of {', '.join(long_texts.MODES)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise OptionError("--max-tokens", self.max_tokens, "a positive integer (the model's max_seq_len)")
        if self.max_tokens is not None and self.legacy_tokens is not None:
            raise DataError("--max-tokens applies to text input; a legacy import keeps its token ids as they are")
        if self.max_chars < self.min_chars:
            raise OptionError("--max-chars", self.max_chars, f"an integer >= --min-chars ({self.min_chars})")
        if bool(self.inputs) == (self.legacy_tokens is not None or self.legacy_latents is not None):
            raise DataError("give either --input PATH|default or --legacy-tokens DIR --legacy-latents DIR")
        if (self.legacy_tokens is None) != (self.legacy_latents is None):
            raise DataError("--legacy-tokens and --legacy-latents go together: give both folders")
        if self.legacy_tokens is not None and self.tokenizer is None:
            raise DataError("--legacy-tokens needs --tokenizer: the tokenizer.json that produced the legacy ids")
        if self.legacy_order not in ORDERS:
            raise OptionError("--legacy-order", self.legacy_order, f"one of {', '.join(ORDERS)}")
        if self.legacy_order != "sorted" and self.legacy_tokens is None:
            raise DataError("--legacy-order applies to a legacy import: give --legacy-tokens DIR --legacy-latents DIR")
        if self.tokenizer is None and self.vocab_size < MIN_VOCAB_SIZE:
            raise OptionError(
                "--vocab-size",
                self.vocab_size,
                f"an integer >= {MIN_VOCAB_SIZE} for a byte-level BPE (256 byte symbols + {PAD} + {MASK})",
            )


def default_prepare_options(cfg: DataConfig) -> PrepareOptions:
    """The PrepareOptions that prepare the bundled corpus into the cache. The cache entry is named by
    what decides its content, so a changed option never reuses a stale one."""
    opts = PrepareOptions(
        inputs=["default"],
        vocab_size=cfg.vocab_size,
        val_fraction=cfg.val_fraction,
        encoder=cfg.encoder,
        max_samples=cfg.max_samples,
    )
    key = json.dumps([FORMAT_VERSION, opts.recorded(), corpus.DEFAULT_CORPUS.stat().st_size], sort_keys=True)
    cache = Path(cfg.cache_dir or os.environ.get("MMLDLM_CACHE") or Path.home() / ".cache" / "mmldlm")
    opts.out = str(cache / f"default-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
    return opts


def dataset_path(cfg: DataConfig, log=print, detail=None) -> Path:
    """The dataset directory of a run: `cfg.path`, or for a null path the bundled default corpus,
    prepared on first use into the cache (every rank must call this; the work is shared); `log` and
    `detail` as for prepare."""
    if cfg.path is not None:
        return Path(cfg.path)
    rebuild = "the cache holds one per set of data.* options: a changed option prepares another"
    return Path(prepare(default_prepare_options(cfg), log, detail, rebuild)["path"])


def options_like_run(run_dir: str | Path, recorded: Path | None = None) -> dict[str, Any]:
    """The PrepareOptions fields (tokenizer, encoder, normalize, max_tokens) that prepare new text the
    way a training run's own dataset was prepared: its tokenizer.json, reused as is (no new BPE, so the
    same text gets the same ids), its sentence encoder with the same normalisation, and the length its
    texts were cut to in training, so that the run can be evaluated on the result. Nothing is prepared
    here: the run's dataset must exist. With data.path null: `recorded`, the directory its newest
    checkpoint recorded (`mmldlm.runs.trained.recorded_run_dataset`), else the bundled corpus in the cache."""
    config_file = Path(run_dir) / "config.yaml"
    if not config_file.is_file():
        raise DataError(f"--like {run_dir}: no config.yaml there; expected a training run directory (train.run_dir)")
    cfg = load_config(config_file)
    data = cfg.data
    if data.path is not None:
        data_dir, origin = Path(data.path), f"data.path {data.path!r}"
    elif recorded is not None:
        data_dir, origin = recorded, "data.path null (the bundled corpus where its checkpoints recorded it)"
    else:  # the bundled corpus, prepared into the cache on the run's first use
        data_dir, origin = Path(default_prepare_options(data).out), "data.path null (the bundled corpus in the cache)"
    meta_file = data_dir / META
    if not meta_file.is_file():
        raise DataError(
            f"{config_file}: {origin}: no prepared dataset at {data_dir}; --like needs the run's "
            f"dataset on this machine (copy it there, or set data.path in {config_file} to where it is)"
        )
    meta = read_meta(data_dir)
    tokenizer = data_dir / meta["tokenizer"]
    if not tokenizer.is_file():
        raise DataError(
            f"{meta_file}: tokenizer {meta['tokenizer']!r}: no such file {tokenizer}; restore it from "
            f"where the run was trained (a rebuilt dataset may have another tokenizer)"
        )
    normalize = meta.get("encoder_normalize")
    if normalize is None:
        raise DataError(
            f"{meta_file}: encoder_normalize is null: the run's latents were imported, so the encoder that "
            f"made them is not known and new text cannot be encoded like them; prepare it without --like, "
            f"with --tokenizer {tokenizer} and the --encoder that made those latents"
        )
    encoder = meta["encoder"]
    if encoder not in REGISTRY and not Path(encoder).is_dir():
        raise DataError(
            f"{meta_file}: encoder {encoder!r} is not available here: neither a registered encoder "
            f"({', '.join(REGISTRY)}) nor a local sentence-transformers folder; to prepare text like this run, "
            f"put that encoder's folder at this path (or register the name in mmldlm/data/encoders.py)"
        )
    max_tokens = resolve_for_model(data, cfg.model, PreparedDataset(data_dir, "train")).max_length
    return {"tokenizer": str(tokenizer), "encoder": encoder, "normalize": normalize, "max_tokens": max_tokens}


# --------------------------------------------------------------------------------------------------
# Ranks. Every collective goes through these two helpers, which turn a DataError (or any other
# UserError, such as a bad --device) on any rank into the same DataError on all ranks.


class Ranks:
    """This process's place among the preparing processes (a gloo group when torch.distributed is up)."""

    def __init__(self):

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world_size = self.dist.get_world_size() if self.dist else 1
        # Object collectives need a CPU group; a trainer may have set up NCCL.
        self.group = None
        if self.dist and self.dist.get_backend() != "gloo":
            self.group = self.dist.new_group(backend="gloo")

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only and hand its result (or its DataError) to every rank."""
        box = [_attempt(fn) if self.rank == 0 else None]
        if self.dist:
            self.dist.broadcast_object_list(box, src=0, group=self.group)
        return _unwrap(box)

    def on_all(self, fn: Callable[[], Any], gather: bool = False) -> Any:
        """Run `fn` on every rank; returns this rank's result, or with `gather` all ranks' results in
        rank order. A DataError on any rank is raised on all."""
        error, value = _attempt(fn)
        outcomes = [(error, value if gather else None)]
        if self.dist:
            outcomes = [None] * self.world_size
            self.dist.all_gather_object(outcomes, (error, value if gather else None), group=self.group)
        _unwrap(outcomes)
        return [v for _, v in outcomes] if gather else value


def _attempt(fn: Callable[[], Any]) -> tuple[str | None, Any]:
    try:
        return None, fn()
    except UserError as err:
        return str(err), None


def _unwrap(results: list[tuple[str | None, Any]]) -> Any:
    for error, _ in results:
        if error is not None:
            raise DataError(error)
    return results[0][1]


# --------------------------------------------------------------------------------------------------
# Sources: where the samples of a shard come from.


class TextSource:
    """Corpus texts, tokenised, fitted to the limits (long_texts.py) and encoded shard by shard."""

    def __init__(self, texts: list[str], limits: long_texts.Limits, mode: str, batch_size: int):
        self.texts, self.limits, self.mode, self.batch_size = texts, limits, mode, batch_size
        self.encoder = limits.encoder

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self, indices: np.ndarray) -> str:
        """What the shard of `indices` is made from: a finished shard is reused only while this holds."""
        digest = hashlib.sha256()
        for i in indices:
            digest.update(self.texts[i].encode() + b"\0")
        return digest.hexdigest()

    def shard(self, indices: np.ndarray, progress: Callable[[int], None]) -> tuple[list, np.ndarray, dict]:
        """(token ids and latents (n, K, D) of the samples stored, counts of what became of the long
        texts). A split text adds samples: n may differ from len(indices)."""
        texts = [self.texts[i] for i in indices]
        token_ids = encode_texts(self.limits.tokenizer, texts)
        wordpieces = self.encoder.count_wordpieces(texts)
        stored, stored_ids, counts = long_texts.resolve(texts, token_ids, wordpieces, self.limits, self.mode)
        # The bar counts texts read, in whole texts; the encoder counts the samples stored.
        encoded, counted = 0, 0

        def advance(num_encoded: int) -> None:
            nonlocal encoded, counted
            encoded += num_encoded
            read = len(texts) * encoded // max(len(stored), 1)
            progress(read - counted)
            counted = read

        latents = self.encoder.encode(stored, self.batch_size, advance)
        return stored_ids, latents, counts


def split_indices(num_samples: int, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Disjoint train/val sample indices, each in corpus order; the same for a given seed."""
    num_val = 0 if val_fraction == 0 else max(1, round(num_samples * val_fraction))
    if num_val >= num_samples:
        raise DataError(
            f"{counted(num_samples, 'sample')} cannot be split into train and val (val_fraction "
            f"{val_fraction}); give more data or --val-fraction 0"
        )
    perm = np.random.default_rng(seed).permutation(num_samples)
    return {"train": np.sort(perm[num_val:]), "val": np.sort(perm[:num_val])}


def plan_shards(splits: dict[str, np.ndarray], shard_size: int) -> list[tuple[str, int, np.ndarray]]:
    """(split, shard index, sample indices) for every shard, in the order meta.json lists them."""
    return [
        (name, i, idx[start : start + shard_size])
        for name, idx in splits.items()
        for i, start in enumerate(range(0, len(idx), shard_size))
    ]


def _write_shards(
    source,
    work: list[tuple[str, int, np.ndarray]],
    root: Path,
    ids_dtype: np.dtype,
    latent_dtype: np.dtype,
    bar: tqdm,
) -> list[dict]:
    """Write this rank's shards; returns each one's meta entry plus its latent sums for the stats. A shard
    finished by an earlier, interrupted run into the same partial directory is read back, not redone,
    unless what it is made from changed since (`source.fingerprint`)."""
    done = []
    for split, index, indices in work:
        record = root / shard_record(split, index)
        fingerprint = source.fingerprint(indices)
        if record.is_file() and (entry := _read_record(record))["source"] == fingerprint:
            done.append(entry)
            bar.update(len(indices))
            continue
        token_lists, latents, long_counts = source.shard(indices, bar.update)
        stored = latents.astype(latent_dtype)
        info = write_shard(root, split, index, token_lists, stored, ids_dtype, latent_dtype)
        values = stored.astype(np.float64).reshape(-1, stored.shape[-1])  # statistics of what the loader will read
        entry = {
            "split": split,
            "index": index,
            "info": info,
            "shape": list(stored.shape[1:]),
            "max_tokens": max((len(ids) for ids in token_lists), default=0),
            "sum": values.sum(0),
            "sumsq": np.square(values).sum(0),
            "count": len(values),
            "long_counts": long_counts,
            "source": fingerprint,
        }
        _write_record(record, entry)
        done.append(entry)
    return done


def _write_record(path: Path, entry: dict) -> None:
    """The finished shard's entry, written after its files (and renamed into place): its presence says the
    shard is whole. Python floats print exactly, so the sums read back bit for bit."""
    plain = {**entry, "sum": entry["sum"].tolist(), "sumsq": entry["sumsq"].tolist()}
    write_atomically(path, json.dumps(plain))


def _read_record(path: Path) -> dict:
    entry = json.loads(path.read_text())
    entry["sum"], entry["sumsq"] = np.asarray(entry["sum"]), np.asarray(entry["sumsq"])
    if entry["long_counts"] is not None:
        entry["long_counts"] = Counter(entry["long_counts"])
    return entry


# --------------------------------------------------------------------------------------------------
# The output directory.


def _partial_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def output_state(opts: PrepareOptions) -> str:
    """'complete' (same options, nothing to do) or 'absent' (to be written); a UserError when the
    output, or the temporary folder beside it, holds something that must not be replaced (see
    mmldlm/outputs.py): said before the corpus is read, which takes minutes."""
    out = Path(opts.out)
    if _partial_dir(out).exists():
        refuse_foreign(_partial_dir(out), PREPARED, "remove it or choose another --out", marked=False)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return "absent"
    if opts.overwrite or not PREPARED.is_marked(out):
        refuse_foreign(out, PREPARED)
        return "absent"
    meta = read_meta(out)
    previous = meta.get("prepare", {})
    changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in opts.recorded().items() if previous.get(k) != v]
    if changed:
        raise DataError(
            f"{out}: already prepared with other options ({'; '.join(changed)}); pass --overwrite to "
            f"rebuild it or choose another --out"
        )
    return "complete"


def _open_partial(out: Path, opts: PrepareOptions, tokenizer_json: str, say: Callable[[str], None]) -> str:
    """The directory the shards are written into before they are published as `out`. One left by an
    interrupted run with the same options and tokenizer is continued (its finished shards are kept);
    any other is removed first."""
    partial = _partial_dir(out)
    started = {"prepare": opts.recorded(), "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest()}
    if partial.exists():  # left by a run that was killed or failed
        refuse_foreign(partial, PREPARED, "remove it or choose another --out", marked=False)
        record = partial / PARTIAL
        if record.is_file() and json.loads(record.read_text()) == started:
            kept = counted(len(_finished_shards(partial)), "finished shard")
            say(f"{partial}: continuing an interrupted prepare; {kept} kept")
            return str(partial)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / PARTIAL).write_text(json.dumps(started))
    return str(partial)


def _finished_shards(partial: Path) -> list[Path]:
    return [partial / name for name in files_of_partial(partial) if name != PARTIAL]


def token_latents(tokenizer, encoder, batch_size: int = 256) -> np.ndarray:
    """(V, K, D) float32: the encoder's latent of each vocabulary entry's own text, e.g. of " landing"
    for that token. Entries that decode to nothing (the special tokens, blank pieces) get zeros. The
    model's vocabulary prior (model.vocab_prior) scores tokens by their cosine to a sentence latent."""
    texts = [tokenizer.decode([i]) for i in range(vocab_size(tokenizer))]
    real = [i for i, text in enumerate(texts) if text.strip()]
    out = np.zeros((len(texts), encoder.num_latents, encoder.latent_dim), dtype=np.float32)
    out[real] = encoder.encode([texts[i] for i in real], batch_size)
    return out


def ensure_token_latents(path: str | Path, log: Callable[[str], None] = print) -> np.ndarray:
    """The dataset's token latents (see `token_latents`), computed with its own encoder and added to it
    (the file, then meta.json, each replaced atomically) when a dataset prepared before they existed
    lacks them. Call on one process at a time (training: rank 0, see `Ranks.on_rank0`)."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("token_latents") and (path / meta["token_latents"]).is_file():
        return np.load(path / meta["token_latents"])
    normalize = meta.get("encoder_normalize")
    if normalize is None:
        raise DataError(
            f"{path / META}: encoder_normalize is null (the latents were imported), so the latents "
            f"of the vocabulary tokens cannot be made with the same encoder; set model.vocab_prior=false"
        )
    log(
        f"{path}: adding the latents of the {meta['vocab_size']} vocabulary tokens (model.vocab_prior) "
        f"with {meta['encoder']}"
    )
    latents = token_latents(
        load_tokenizer(path / meta["tokenizer"]), load_encoder(meta["encoder"], _device("auto"), normalize)
    )
    write_atomically(path / TOKEN_LATENTS, lambda f: np.save(f, latents))
    meta["token_latents"] = TOKEN_LATENTS
    write_atomically(path / META, json.dumps(meta, indent=1) + "\n")
    return latents


def _merge(
    opts: PrepareOptions,
    tokenizer_json: str,
    counts: dict,
    shards: list[dict],
    partial: Path,
    extra: dict,
    encoder=None,
) -> dict:
    shards = sorted(shards, key=lambda s: (SPLITS.index(s["split"]), s["index"]))
    shapes = {tuple(s["shape"]) for s in shards}
    if len(shapes) > 1:
        raise DataError(f"latents of different shapes (K, D) across samples: {sorted(shapes)}")
    num_latents, latent_dim = shapes.pop()
    train = [s for s in shards if s["split"] == "train"]
    count = sum(s["count"] for s in train)
    emptied = [name for name in SPLITS if opts.val_fraction or name == "train"]
    emptied = [name for name in emptied if not any(s["info"]["num_samples"] for s in shards if s["split"] == name)]
    if emptied:
        raise DataError(
            f"{', '.join(opts.inputs)}: no {emptied[0]} sample left: --long-texts {opts.long_texts} dropped every "
            f"text of that split over the limits; use --long-texts split, or a larger --max-tokens"
        )
    total, total_sq = np.zeros(latent_dim), np.zeros(latent_dim)
    for s in train:  # a fixed order: the float64 sums are the same for any number of ranks
        total += s["sum"]
        total_sq += s["sumsq"]
    mean = total / count
    std = np.maximum(np.sqrt(np.maximum(total_sq / count - mean**2, 0.0)), STD_FLOOR)
    tokenizer = from_json(tokenizer_json)
    vocab = vocab_size(tokenizer)
    meta = {
        "format_version": FORMAT_VERSION,
        "created_by": f"mmldlm {__version__}",
        "tokenizer": TOKENIZER,
        "vocab_size": vocab,
        **special_ids(tokenizer),
        "token_dtype": token_dtype(vocab).name,
        "encoder": opts.encoder,
        **extra,
        "latent_dim": int(latent_dim),
        "num_latents": int(num_latents),
        "latent_dtype": opts.latent_dtype,
        "splits": {name: sum(s["info"]["num_samples"] for s in shards if s["split"] == name) for name in SPLITS},
        "num_tokens": {name: sum(s["info"]["num_tokens"] for s in shards if s["split"] == name) for name in SPLITS},
        "max_sample_tokens": {
            name: max((s["max_tokens"] for s in shards if s["split"] == name), default=0) for name in SPLITS
        },
        "latent_mean": mean.tolist(),
        "latent_std": std.tolist(),
        "counts": counts,
        "prepare": opts.recorded(),
        "shards": {name: [s["info"] for s in shards if s["split"] == name] for name in SPLITS},
    }
    if encoder is not None:  # imported latents: their encoder is not at hand
        np.save(partial / TOKEN_LATENTS, token_latents(tokenizer, encoder, opts.encode_batch_size))
        meta["token_latents"] = TOKEN_LATENTS
    (partial / TOKENIZER).write_text(tokenizer_json)
    (partial / META).write_text(json.dumps(meta, indent=1) + "\n")
    for name in files_of_partial(partial):  # the record of the work, not part of the dataset
        (partial / name).unlink()
    publish(partial, Path(opts.out), PREPARED)
    return meta


# --------------------------------------------------------------------------------------------------


def _device(requested: str) -> str:
    return str(pick_device(requested, key="--device"))


def prepare(
    opts: PrepareOptions,
    log: Callable[[str], None] = print,
    detail: Callable[[str], None] | None = None,
    rebuild: str = "pass --overwrite to rebuild",
) -> dict:
    """Prepare the dataset described by `opts` (on every rank of an initialised process group).
    Returns {"status": "created" | "exists", "path": str, "meta": dict}; `log` is called on rank 0 only,
    and `detail` (default: `log`) for the counts and length statistics of the texts read, which meta.json
    keeps ("lengths") and `mmldlm check` reads. `rebuild`: how the caller's user gets a complete dataset
    prepared again (said where it is complete already)."""
    opts.check()
    ranks = Ranks()
    say = log if ranks.rank == 0 else (lambda _msg: None)
    say_detail = (detail or log) if ranks.rank == 0 else (lambda _msg: None)
    out = Path(opts.out)
    if ranks.on_rank0(lambda: output_state(opts)) == "complete":
        say(f"{out}: already complete with these options; nothing to do ({rebuild})")
        return {"status": "exists", "path": str(out), "meta": read_meta(out)}

    read = _legacy_source if opts.legacy_tokens is not None else _text_source
    tokenizer_json, source, counts, splits, extra = read(opts, ranks, say, say_detail)
    meta = _write_dataset(opts, ranks, out, tokenizer_json, source, counts, splits, extra, say)
    if meta.get("lengths"):
        say_detail(long_texts.report_outcome(meta["lengths"]))
    say(
        f"{out}: {meta['splits']['train']} train + {meta['splits']['val']} val samples, "
        f"{meta['num_tokens']['train'] + meta['num_tokens']['val']} tokens, vocab {meta['vocab_size']}, "
        f"latents {meta['num_latents']}x{meta['latent_dim']}"
    )
    return {"status": "created", "path": str(out), "meta": meta}


def _legacy_source(opts: PrepareOptions, ranks: Ranks, say: Callable[[str], None], detail: Callable) -> tuple:
    """(tokenizer json, source, counts, splits, extra meta) of a legacy .npz/.npy folder: its samples
    as they are, with the given tokenizer; --max-samples keeps a seeded subset, or under --legacy-order
    scan the first pairs of the folder's own order."""
    tokenizer_json = ranks.on_rank0(lambda: load_tokenizer(opts.tokenizer).to_str())
    scan = opts.legacy_order == "scan"
    source = ranks.on_all(
        lambda: LegacySource(
            opts.legacy_tokens,
            opts.legacy_latents,
            vocab_size(from_json(tokenizer_json)),
            opts.tokenizer,
            opts.legacy_order,
            opts.max_samples if scan else None,
        )
    )
    counts = {"read": len(source), "kept": len(source)}
    if scan:
        say(
            f"took the first {len(source)} pairs of {opts.legacy_tokens} in the folder's own order (--legacy-order "
            "scan): on the filesystem the older loader read, the files it read; on a copy elsewhere, others"
        )
    elif opts.max_samples is not None and len(source) > opts.max_samples:
        source.keep(seeded_subset(len(source), opts.max_samples, opts.seed))
        counts.update(kept=len(source), over_max_samples=counts["read"] - len(source))
        say(f"read {counts['read']} samples: kept a seeded {len(source)} (--max-samples)")
    splits = split_indices(len(source), opts.val_fraction, opts.seed)
    extra = {"encoder_normalize": None, "lengths": None}  # not known: the legacy data were made elsewhere
    return tokenizer_json, source, counts, splits, extra


def _text_source(opts: PrepareOptions, ranks: Ranks, say: Callable[[str], None], detail: Callable) -> tuple:
    """(tokenizer json, source, counts, splits, extra meta) of a text corpus: read and filtered, split,
    its tokenizer trained or loaded, its sentence encoder loaded, and what the limits would cut reported."""
    texts, counts = ranks.on_all(lambda: _read_corpus(opts))
    detail(
        f"read {counts['read']} samples: kept {counts['kept']}, dropped {counts['too_short']} shorter than "
        f"{opts.min_chars} chars, {counts['too_long']} longer than {opts.max_chars}, "
        f"{counts['duplicates']} duplicates, "
        f"{counts.get('over_max_samples', 0)} over --max-samples"
    )
    splits = split_indices(len(texts), opts.val_fraction, opts.seed)

    def make_tokenizer() -> str:
        if opts.tokenizer is not None:
            return load_tokenizer(opts.tokenizer).to_str()
        num_train = len(splits["train"])
        say(f"training a byte-level BPE tokenizer (vocab {opts.vocab_size}) on {num_train} train samples")
        tokenizer = train_bpe([texts[i] for i in splits["train"]], opts.vocab_size)
        if (learned := vocab_size(tokenizer)) < opts.vocab_size:
            say(
                f"tokenizer: {learned} entries, not the {opts.vocab_size} asked for (--vocab-size): the "
                f"{num_train} train samples hold no more merges"
            )
        return tokenizer.to_str()

    tokenizer_json = ranks.on_rank0(make_tokenizer)
    encoder = ranks.on_all(lambda: load_encoder(opts.encoder, _device(opts.device), opts.normalize))
    if ranks.rank == 0 and (warning := unknown_pieces_warning(texts, encoder)):
        say(warning)
    limits = long_texts.Limits(from_json(tokenizer_json), encoder, opts.max_tokens)
    source = TextSource(texts, limits, opts.long_texts, opts.encode_batch_size)
    extra = {"encoder": encoder.name, "encoder_normalize": opts.normalize}
    extra["lengths"] = ranks.on_rank0(lambda: long_texts.measure(texts, limits))
    for line in long_texts.report(extra["lengths"], encoder.name):
        detail(line)
    return tokenizer_json, source, counts, splits, extra


def _write_dataset(
    opts: PrepareOptions, ranks: Ranks, out: Path, tokenizer_json, source, counts, splits, extra, say
) -> dict:
    """Every rank writes its shards into a temporary directory beside `out` (`_open_partial`), and rank 0
    merges them onto `out`; returns the meta. On a failure the shards finished so far stay there for a
    rerun of the same command to continue from (an empty temporary directory is removed)."""
    partial = Path(ranks.on_rank0(lambda: _open_partial(out, opts, tokenizer_json, say)))
    try:
        mine = plan_shards(splits, opts.shard_size)[ranks.rank :: ranks.world_size]
        ids_dtype = token_dtype(vocab_size(from_json(tokenizer_json)))
        desc = "prepare" if ranks.world_size == 1 else f"prepare (rank 0 of {ranks.world_size})"
        with tqdm(
            total=sum(len(idx) for _, _, idx in mine),
            desc=desc,
            unit="sample",
            disable=not (opts.progress and ranks.rank == 0),
        ) as bar:
            results = ranks.on_all(
                lambda: _write_shards(source, mine, partial, ids_dtype, np.dtype(opts.latent_dtype), bar), gather=True
            )
        shards = [s for rank_shards in results for s in rank_shards]
        if extra["lengths"] is not None:
            extra["lengths"].update(long_texts.outcome(opts.long_texts, [s["long_counts"] for s in shards]))
        meta = ranks.on_rank0(
            lambda: _merge(opts, tokenizer_json, counts, shards, partial, extra, getattr(source, "encoder", None))
        )
    except BaseException as err:
        if ranks.rank == 0 and partial.exists():
            _keep_finished_shards(partial, err, say)
        raise
    return meta


def _keep_finished_shards(partial: Path, err: BaseException, say: Callable[[str], None]) -> None:
    """After a failure or a signal (`err`): the shards finished in `partial` stay for a rerun of the same
    command to continue from, said in a line (for a signal, in the command's last line); none: removed."""
    kept = len(_finished_shards(partial))
    if not kept:
        shutil.rmtree(partial)
        return
    line = f"{partial}: {counted(kept, 'finished shard')} kept; the same command continues from them"
    if isinstance(err, Interrupted):
        err.kept = line
    else:
        say(line)


def unknown_pieces_warning(texts: list[str], encoder) -> str | None:
    """A warning when the sentence encoder reads more than UNKNOWN_SHARE of the word pieces of (an evenly
    spread sample of) `texts` as its unknown token, naming an example; else None."""
    sample = texts[:: max(1, len(texts) // UNKNOWN_CHECKED_TEXTS)]
    found = encoder.unknown_pieces(sample)
    if found.num_unknown <= UNKNOWN_SHARE * found.num_pieces:
        return None
    return (
        f"warning: the sentence encoder {encoder.name} reads {found.num_unknown / found.num_pieces:.1%} of the "
        f"word pieces as {found.token} ({found.num_texts} of {len(sample)} texts checked hold one, e.g. "
        f"{found.example!r}): the latents do not see those characters; an encoder whose vocabulary covers "
        f"them (--encoder) would"
    )


def _read_corpus(opts: PrepareOptions) -> tuple[list[str], dict]:
    texts: list[str] = []
    for name in opts.inputs:
        texts.extend(corpus.read_texts(corpus.resolve_input(name), opts.format, opts.text_field, opts.paragraphs))
    kept, counts = corpus.filter_texts(texts, opts.min_chars, opts.max_chars, opts.dedup)
    if not kept:
        raise DataError(
            f"{', '.join(opts.inputs)}: no sample left after the length filter "
            f"({counts['too_short']} shorter than {opts.min_chars} chars, "
            f"{counts['too_long']} longer than {opts.max_chars})"
        )
    if opts.max_samples is not None and len(kept) > opts.max_samples:
        chosen = seeded_subset(len(kept), opts.max_samples, opts.seed)
        counts["over_max_samples"] = len(kept) - opts.max_samples
        kept = [kept[i] for i in chosen]
        counts["kept"] = len(kept)
    return kept, counts


def seeded_subset(num_samples: int, max_samples: int, seed: int) -> np.ndarray:
    """--max-samples: a seeded subset in the input's order, the same N samples for a seed on every rank."""
    return np.sort(np.random.default_rng(seed).permutation(num_samples)[:max_samples])
