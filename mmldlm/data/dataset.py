"""Reading a prepared dataset: memory-mapped shards, a resumable distributed batch order, a
padding collate and the tuned DataLoader around them.

    dataset = open_dataset(path, "train")
    loader = build_loader(dataset, cfg.data, micro_batch_size=32, rank=0, world_size=1, seed=0)
    for batch in loader: ...          # one epoch from the current position
    state = loader.state_dict()       # {"epoch", "samples", ...}: where the next batch starts
    loader.load_state_dict(state)     # resume there; skipped batches are never read

A batch is {"tokens" (B, L) int64, "pad_mask" (B, L) bool, "latents" (B, K, D) float32, "index" (B,)
int64}, L the longest sample in the batch (at most max_length) rounded up to pad_to_multiple, or to
the shortest of data.length_buckets that holds it; with data.packing also the packed layout of its texts (PadCollate).
Latents are in raw encoder space; the objective standardises them with latent_mean/latent_std.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import os
import signal
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mmldlm.config import DataConfig, ModelConfig, _fail
from mmldlm.data.errors import DataError
from mmldlm.data.format import open_shard, read_meta
from mmldlm.data.tokenizer import load_tokenizer


class PreparedDataset(Dataset):
    """One split of a prepared dataset directory. Every shard is size-checked against meta.json
    when opened; samples are read through memory maps, so opening costs no reads of the data."""

    def __init__(self, path: str | Path, split: str = "train"):
        self.path, self.split = Path(path), split
        self.meta = read_meta(self.path)
        if split not in self.meta["shards"]:
            raise DataError(f"{self.path}: no split '{split}' (splits: {', '.join(self.meta['shards'])})")
        self.shards = self.meta["shards"][split]
        self.starts = np.cumsum(
            [0] + [s["num_samples"] for s in self.shards]
        )  # global index of each shard's first sample
        if self.starts[-1] == 0:
            raise DataError(f"{self.path}: split '{split}' is empty (prepared with --val-fraction 0?)")
        self._open()

    def _open(self) -> None:
        # Plain ndarray views of the maps: slicing them is cheaper than slicing np.memmap objects.
        self.arrays = [
            tuple(np.asarray(a).view(np.ndarray) for a in open_shard(self.path, shard, self.meta))
            for shard in self.shards
        ]

    # Worker processes started with "spawn" get the dataset pickled: send the path, not the pages.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "arrays"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(index, token ids (n,), latents (K, D)): views into the maps, no copy."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside split '{self.split}' of {len(self)} samples")
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        tokens, offsets, latents = self.arrays[shard]
        local = index - int(self.starts[shard])
        return index, tokens[offsets[local] : offsets[local + 1]], latents[local]

    def lengths(self) -> np.ndarray:
        """(N,) int64: every sample's token count, from the offsets alone (no token is read)."""
        return np.concatenate([np.diff(offsets) for _, offsets, _ in self.arrays])

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def pad_id(self) -> int:
        return self.meta["pad_id"]

    @property
    def mask_id(self) -> int:
        return self.meta["mask_id"]

    @property
    def latent_dim(self) -> int:
        return self.meta["latent_dim"]

    @property
    def num_latents(self) -> int:
        return self.meta["num_latents"]

    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-dimension (mean, std) of the train split's latents, float32 (D,), for GaussianDiffusion."""
        return (
            torch.tensor(self.meta["latent_mean"], dtype=torch.float32),
            torch.tensor(self.meta["latent_std"], dtype=torch.float32),
        )

    def tokenizer(self):
        return load_tokenizer(self.path / self.meta["tokenizer"])


def open_dataset(path: str | Path, split: str = "train") -> PreparedDataset:
    return PreparedDataset(path, split)


# --------------------------------------------------------------------------------------------------
# Batch order.


class BatchOrder:
    """The order in which an epoch's samples are read, and rank `rank`'s batches of it.

    The global order of an epoch is a function of the seed and the epoch alone: a permutation of the
    samples (seeded by seed + epoch; the identity without shuffle). Reading consumes it in global
    batches of G = batch size x world size: global batch k is positions [kG, (k+1)G), of which rank r
    takes positions r, r + W, ... (DistributedSampler's scheme). A position is therefore a count of
    samples seen: a run resumed after S samples continues at the S-th sample of the order, dealt out to
    the ranks it has now, whatever its batch size or world size, and no sample is repeated or skipped.
    The epoch ends with the last whole global batch (drop_last) or fills the last one by wrapping
    around to the epoch's start.

    Length bucketing (`lengths` given, `bucket_batches` = n > 1): each window of n global batches is
    sorted by length, cut into n global batches of similar lengths, and those are read in a seeded
    random order. A batch is padded to its longest sample, so with random batches of the default
    corpus (mean 12.5 tokens, a long tail to 76) about 70% of the text positions computed are padding;
    bucketed, about 25%. The samples of the epoch are the same; their grouping depends on G. A resume
    with another G after S samples: what was read is the first S positions of the old grouping, and the
    samples not read yet, in the order of the permutation, are grouped anew with the new G. Each such
    grouping of an epoch is a layout (first position, G), which the loader's state keeps, so a chain of
    resumes on changing world sizes stays exact."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        lengths: np.ndarray | None = None,
        bucket_batches: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.lengths = lengths if bucket_batches > 1 else None
        self.bucket_batches = bucket_batches if self.lengths is not None else 1
        self.global_batch = batch_size * world_size
        whole, partial = divmod(num_samples, self.global_batch)
        self.num_batches = whole + (partial > 0 and not drop_last)  # of an epoch read in one layout
        if self.num_batches == 0:
            raise DataError(
                f"{num_samples} samples do not fill one micro-batch of {batch_size} on each of {world_size} "
                f"{'process' if world_size == 1 else 'processes'}; lower train.global_batch_size and "
                "train.micro_batch_size together, or set data.drop_last=false"
            )

    def permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch)).numpy()

    def epoch_order(self, epoch: int, layouts: list[list[int]]) -> np.ndarray:
        """The global read order of `epoch` (sample indices, whole global batches), read in `layouts`:
        [[first position, G], ...], oldest first; the last is this order's own G."""
        rest, read = self.permutation(epoch), []
        for i, (start, size) in enumerate(layouts):
            grouped = self._grouped(rest, size, epoch, i)
            if i == len(layouts) - 1:
                read.append(grouped)
                break
            taken = grouped[: layouts[i + 1][0] - start]
            read.append(taken)
            rest = rest[~np.isin(rest, taken)]  # the permutation's order is kept
        return np.concatenate(read)

    def _grouped(self, samples: np.ndarray, size: int, epoch: int, layout: int) -> np.ndarray:
        """`samples` cut into global batches of `size` (the class docstring), bucketed when asked."""
        whole, partial = divmod(len(samples), size)
        if partial and not self.drop_last:
            samples = np.resize(samples, (whole + 1) * size)  # resize wraps around to the start
        else:
            samples = samples[: whole * size]
        if self.bucket_batches == 1:
            return samples
        out = samples.copy()
        g = np.random.default_rng([self.seed, epoch, layout])
        window = self.bucket_batches * size
        for first in range(0, len(samples), window):
            part = samples[first : first + window]
            batches = part[np.argsort(self.lengths[part], kind="stable")].reshape(-1, size)
            out[first : first + part.size] = batches[g.permutation(len(batches))].reshape(-1)
        return out

    def batches(self, order: np.ndarray, start: int):
        """This rank's batches of the global order `order` from position `start` on."""
        for first in range(start, len(order) - self.global_batch + 1, self.global_batch):
            yield order[first : first + self.global_batch][self.rank :: self.world_size].tolist()


class _EpochBatches:
    """The batch_sampler handed to DataLoader: this rank's batches of one epoch's order from a start
    position. The Loader sets both before each pass; DataLoader reads it ahead for prefetching."""

    def __init__(self, order: BatchOrder):
        self.order, self.epoch_order, self.start = order, np.empty(0, dtype=np.int64), 0

    def __iter__(self):
        return self.order.batches(self.epoch_order, self.start)

    def __len__(self) -> int:
        return max(0, len(self.epoch_order) - self.start) // self.order.global_batch


class PadCollate:
    """Samples -> batch dict, padded with pad_id to a multiple of `multiple` and cut at `max_length`.

    With `pack_length` (data.packing) the batch also says where each text goes in packed rows of
    that many positions (`pack_rows`; the model runs its blocks on those rows, mmldlm/model/mmdit.py
    `Packing`), or with `buckets` as wide as the shortest bucket that holds the fullest row:
    "pack_doc" (R, P) the text (row of the padded batch) of each packed position, -1
    for padding; "pack_position" (R, P) its position in its text; "pack_latent_doc" (R, M) the text
    of each row's m-th group of latent slots, -1 for padding (M: the most texts in one row)."""

    def __init__(
        self,
        pad_id: int,
        multiple: int,
        max_length: int | None,
        pack_length: int | None = None,
        buckets: Sequence[int] | None = None,
        pack_rows: Sequence[int] | None = None,
    ):
        self.pad_id, self.multiple, self.max_length, self.pack_length = pad_id, multiple, max_length, pack_length
        self.buckets = np.asarray(buckets, dtype=np.int64) if buckets else None  # ascending (DataConfig.check)
        self.pack_rows = tuple(pack_rows) if pack_rows else None  # ascending (DataConfig.check)

    def kept_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """The token counts the batch keeps of samples of these lengths (cut at max_length)."""
        return np.minimum(lengths, self.max_length) if self.max_length is not None else lengths

    def padded_length(self, lengths: np.ndarray) -> int:
        """L of a batch of samples of these (kept) lengths: the longest, rounded up to the multiple, or
        with buckets the shortest bucket that holds it (max_length past the last; packed, the buckets
        are the rows' widths, and L only lays the texts out for the packing to gather from)."""
        longest = max(int(lengths.max()), 1)
        if self.buckets is not None and self.pack_length is None:
            if longest <= self.buckets[-1]:
                return int(self.buckets[np.searchsorted(self.buckets, longest)])
            if self.max_length is not None:
                return self.max_length
        length = -(-longest // self.multiple) * self.multiple
        return min(length, self.max_length) if self.max_length is not None else length

    def positions(self, lengths: np.ndarray) -> int:
        """Positions the model's blocks compute for a batch of samples of these lengths: B x L text
        positions, or packed, R x (P + M): text positions and latent groups (padding included)."""
        lengths = self.kept_lengths(lengths)
        if self.pack_length is not None:
            rows = pack_rows(lengths, self.pack_length)
            slots = _rounded_up(max(map(len, rows)), self.multiple)
            width = packed_width(rows, lengths, self.pack_length, self.buckets)
            return packed_row_count(len(rows), len(lengths), self.pack_rows) * (width + slots)
        return len(lengths) * self.padded_length(lengths)

    def __call__(self, samples: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        lengths = self.kept_lengths(np.array([len(tokens) for _, tokens, _ in samples]))
        length = self.padded_length(lengths)
        tokens = np.full((len(samples), length), self.pad_id, dtype=np.int64)  # (B, L)
        for row, ((_, ids, _), n) in enumerate(zip(samples, lengths)):
            tokens[row, :n] = ids[:n]
        batch = {
            "tokens": torch.from_numpy(tokens),
            "pad_mask": torch.from_numpy(np.arange(length)[None, :] < lengths[:, None]),  # (B, L)
            "latents": torch.from_numpy(np.stack([lat for _, _, lat in samples]).astype(np.float32)),  # (B, K, D)
            "index": torch.tensor([i for i, _, _ in samples], dtype=torch.int64),  # (B,)
        }
        if self.pack_length is not None:
            batch.update(packed_layout(lengths, self.pack_length, self.multiple, self.pack_rows, self.buckets))
        return batch


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """The samples of each packed row: first-fit decreasing (longest first, each into the first row
    with room), which leaves little more than one part-filled row. Every length must be <= capacity."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(int(i))
        room[row] -= n
    return rows


def _rounded_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_row_count(num_rows: int, num_texts: int, buckets: Sequence[int] | None) -> int:
    """The rows a packed micro-batch of `num_texts` texts that fill `num_rows` is padded to: the fewest of
    `buckets` (data.pack_rows) that holds them, one row per text past the last; without buckets, num_rows."""
    if buckets is None:
        return num_rows
    return next((n for n in buckets if n >= num_rows), num_texts)  # first-fit fills at most one row per text


def packed_width(rows: list[list[int]], lengths: np.ndarray, pack_length: int, widths: Sequence[int] | None) -> int:
    """P of packed rows: pack_length, or with `widths` (data.length_buckets, ascending) the shortest
    that holds the fullest row's tokens, pack_length past the last."""
    if widths is None:
        return pack_length
    fill = max((int(lengths[row].sum()) for row in rows if row), default=1)
    return next((int(w) for w in widths if fill <= w), pack_length)  # none past pack_length (resolve_for_model)


def packed_layout(
    lengths: np.ndarray,
    pack_length: int,
    multiple: int = 1,
    row_buckets: Sequence[int] | None = None,
    widths: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """pack_doc, pack_position (R, P) and pack_latent_doc (R, M) of texts of these lengths (PadCollate),
    M the most texts in a row rounded up to `multiple`: like the padded length, it bounds the number
    of distinct shapes the kernels see (oneDNN keeps memory per matrix shape on CPU). With
    `row_buckets` (data.pack_rows) R is padded with empty rows (`packed_row_count`); with `widths`
    (data.length_buckets) P is the shortest that holds the fullest row (`packed_width`)."""
    if lengths.max(initial=0) > pack_length:
        raise DataError(f"a text of {int(lengths.max())} tokens does not fit data.pack_length={pack_length}")
    rows = pack_rows(lengths, pack_length)
    width = packed_width(rows, lengths, pack_length, widths)
    rows += [[] for _ in range(packed_row_count(len(rows), len(lengths), row_buckets) - len(rows))]
    doc = np.full((len(rows), width), -1, dtype=np.int64)  # (R, P)
    position = np.zeros((len(rows), width), dtype=np.int64)
    latent_doc = np.full((len(rows), _rounded_up(max(map(len, rows)), multiple)), -1, dtype=np.int64)  # (R, M)
    for r, row in enumerate(rows):
        start = 0
        for m, i in enumerate(row):
            n = int(lengths[i])
            doc[r, start : start + n] = i
            position[r, start : start + n] = np.arange(n)
            latent_doc[r, m] = i
            start += n
    return {
        "pack_doc": torch.from_numpy(doc),
        "pack_position": torch.from_numpy(position),
        "pack_latent_doc": torch.from_numpy(latent_doc),
    }


# --------------------------------------------------------------------------------------------------
# The loader.


def default_num_workers(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """min(8, cpus // local ranks): enough to keep ahead of a step, never more processes than cores.
    By default this process's CPUs and torchrun's LOCAL_WORLD_SIZE (`mmldlm check` passes others)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return min(8, cpus // local_ranks)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _start_worker(parent_pid: int, worker_id: int) -> None:
    """The loader's worker_init_fn: each worker dies with the process it serves and leaves the stop
    signals to it."""
    die_with_the_main_process(parent_pid)
    _leave_stop_signals_to_the_main_process()


def die_with_the_main_process(parent_pid: int) -> None:
    """A worker of a SIGKILLed trainer would live on for seconds (torch's watchdog looks for its parent
    every 5 s) with its memory and open files. On Linux the kernel sends it SIGKILL as soon as the
    trainer's thread that started it ends (the trainer iterates its loaders on the main thread);
    elsewhere torch's watchdog stays the only guard. SIGKILL, as the worker ignores SIGTERM (below).
    `mmldlm bench`'s config workers call it too: a bench stopped by a signal leaves no worker holding
    memory (a GPU's, above all) for whatever runs next."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the request was made
        os._exit(1)


def _leave_stop_signals_to_the_main_process() -> None:
    """SIGINT and SIGTERM sent to the whole process group (Ctrl-C in a terminal, a scheduler stopping
    the job) reach the loader's workers too. They ignore them: the main process decides (the trainer
    checkpoints at the end of the step) and then shuts the workers down. A worker that died of the
    signal instead would fail the next batch, and with it the checkpoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _shut_down_workers(loader_ref: weakref.ref) -> None:
    """At interpreter exit (an exception nobody caught, a second Ctrl-C), stop the loader's workers
    the cooperative way, before multiprocessing's own exit handler would SIGTERM them, which they
    ignore (above), and wait for them forever. A loader already gone, or never iterated: nothing."""
    loader = loader_ref()
    iterator = loader._live_iterator() if loader is not None and loader._live_iterator is not None else None
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):  # torch's own shutdown of its workers
        iterator._shutdown_workers()


class Loader:
    """Iterates one epoch per pass from the current position; `state_dict()` tells where the next
    batch starts (counted when a batch is handed out, not when a worker prefetches it). A pass left
    early (a `break`) resumes at the next batch on the next `iter()`; use one pass at a time."""

    def __init__(
        self,
        dataset: PreparedDataset,
        order: BatchOrder,
        collate: PadCollate,
        num_workers: int,
        prefetch_factor: int | None,
        persistent_workers: bool,
        pin_memory: bool,
    ):
        self.dataset, self.order = dataset, order
        self.epoch, self.samples = 0, 0  # samples of the epoch read (handed out) so far, over all ranks
        self.layouts = [[0, order.global_batch]]  # the epoch's groupings (BatchOrder)
        self._batches = _EpochBatches(order)
        # Starting a pass draws the workers' base seed; from a generator of the loader's own it is a
        # function of the seed and the epoch, and the global RNG (dropout, noise), which a checkpoint
        # restores, sees no draw that a resumed run would take at another point than the straight run.
        self._worker_seeds = torch.Generator()
        workers = num_workers > 0
        self.dataloader = DataLoader(
            dataset,
            batch_sampler=self._batches,
            collate_fn=collate,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=persistent_workers and workers,
            pin_memory=pin_memory,
            generator=self._worker_seeds,
            worker_init_fn=functools.partial(_start_worker, os.getpid()) if workers else None,
        )
        self._live_iterator: weakref.ref | None = None  # the iterator whose workers run, for _shut_down_workers
        if workers:
            atexit.register(_shut_down_workers, weakref.ref(self))

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.order.num_batches

    def __iter__(self):
        self._batches.epoch_order = self.order.epoch_order(self.epoch, self.layouts)
        self._batches.start = self.samples
        self._worker_seeds.manual_seed(self.order.seed + self.epoch)
        iterator = iter(self.dataloader)
        self._live_iterator = weakref.ref(iterator)
        for batch in iterator:
            self.samples += self.order.global_batch
            yield batch
        self.epoch, self.samples, self.layouts = self.epoch + 1, 0, [[0, self.order.global_batch]]

    def state_dict(self) -> dict:
        """Where the next batch starts: the epoch and the samples of it read by all ranks together."""
        return {
            "epoch": self.epoch,
            "samples": self.samples,
            "layouts": [list(layout) for layout in self.layouts],
            "num_samples": self.order.num_samples,
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
            "bucket_batches": self.order.bucket_batches,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was taken, with this loader's batch size and world size (BatchOrder)."""
        state = {"bucket_batches": 1, **state}
        for key in ("num_samples", "seed", "shuffle", "bucket_batches"):
            if state[key] != getattr(self.order, key):
                raise DataError(
                    f"loader state: saved with {key}={state[key]!r}, this loader has "
                    f"{getattr(self.order, key)!r} ({self.dataset.path}, split {self.dataset.split}); "
                    f"resume with the same dataset, seed and data.bucket_batches"
                )
        layouts = [list(layout) for layout in state.get("layouts", [[0, self.order.global_batch]])]
        if layouts[-1][1] != self.order.global_batch:  # another batch size x world size from here on
            layouts.append([state["samples"], self.order.global_batch])
        self.epoch, self.samples, self.layouts = state["epoch"], state["samples"], layouts


def build_loader(
    dataset: PreparedDataset,
    cfg: DataConfig,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int | None = None,
) -> Loader:
    """The loader of this rank's share of `dataset`; `seed` (default cfg.seed) fixes the shuffle order."""
    lengths = dataset.lengths() if cfg.bucket_batches > 1 else None
    order = _batch_order(dataset, cfg, micro_batch_size, rank, world_size, lengths, seed)
    collate = _collate(dataset, cfg)
    num_workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
    pin_memory = torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory
    return Loader(dataset, order, collate, num_workers, cfg.prefetch_factor, cfg.persistent_workers, pin_memory)


def _batch_order(
    dataset: PreparedDataset,
    cfg: DataConfig,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    lengths: np.ndarray | None,
    seed: int | None = None,
) -> BatchOrder:
    """The batch order of `build_loader`; `lengths` (the samples' token counts) needed only to bucket."""
    if lengths is not None and cfg.max_length is not None:
        lengths = np.minimum(lengths, cfg.max_length)  # what the collate keeps
    return BatchOrder(
        len(dataset),
        micro_batch_size,
        rank,
        world_size,
        cfg.seed if seed is None else seed,
        shuffle=cfg.shuffle,
        drop_last=cfg.drop_last,
        lengths=lengths,
        bucket_batches=cfg.bucket_batches,
    )


def padded_lengths(cfg: DataConfig, max_length: int) -> list[int]:
    """Every text length a batch of the loader can have (unpacked rows), `max_length` the longest text
    kept: data.length_buckets (and max_length past the last), else each multiple of data.pad_to_multiple."""
    if cfg.length_buckets is not None:
        return sorted({*(n for n in cfg.length_buckets if n < max_length), max_length})
    multiple = cfg.pad_to_multiple
    return sorted({*range(multiple, max_length, multiple), max_length})


def _collate(dataset: PreparedDataset, cfg: DataConfig) -> PadCollate:
    pack_length = (cfg.pack_length or cfg.max_length) if cfg.packing else None
    return PadCollate(
        dataset.pad_id, cfg.pad_to_multiple, cfg.max_length, pack_length, cfg.length_buckets, cfg.pack_rows
    )


def batch_shape_count(cfg: DataConfig, max_length: int) -> int | None:
    """How many shapes the blocks' inputs can take over the loader's batches: the text lengths
    (`padded_lengths`), or packed, the row counts of data.pack_rows and one row per text, times the
    rows' widths (data.length_buckets up to data.pack_length, and it; None: packed rows without
    data.pack_rows, as many as the texts fill)."""
    if cfg.packing:
        if cfg.pack_rows is None:
            return None
        width = cfg.pack_length or max_length
        widths = len({*(n for n in cfg.length_buckets or () if n < width), width})
        return (len(cfg.pack_rows) + 1) * widths
    return len(padded_lengths(cfg, max_length))


# --------------------------------------------------------------------------------------------------
# The batch that sizes memory.


def heaviest_batch_lengths(lengths: np.ndarray, order: BatchOrder, collate: PadCollate, epoch: int = 0) -> np.ndarray:
    """The sample lengths of the batch of `epoch` (in `order`, this rank's) for which the model
    computes the most text positions (`collate.positions`): the batch whose activations a memory
    probe must fit. The most, not a quantile: a batch over the probed size runs out of memory on CUDA
    every epoch, and with padding the heaviest batch is the one that holds the longest sample (every
    epoch has it). Bucketed, it is that sample's bucket (similar lengths); unbucketed, one long
    sample among short ones, padded alike."""
    batches = list(order.batches(order.epoch_order(epoch, [[0, order.global_batch]]), 0))  # a fresh run's grouping
    costs = [collate.positions(lengths[batch]) for batch in batches]
    return lengths[batches[int(np.argmax(costs))]]


def batch_of_lengths(
    lengths: np.ndarray, collate: PadCollate, vocab_size: int, num_latents: int, latent_dim: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A batch as the loader makes it (`collate`) of samples of these lengths: random token ids in
    [2, vocab_size), random latents. A memory probe runs it: memory depends on shapes, not values."""
    g = np.random.default_rng(seed)
    samples = [
        (i, g.integers(2, vocab_size, int(n)), g.standard_normal((num_latents, latent_dim), dtype=np.float32))
        for i, n in enumerate(lengths)
    ]
    return collate(samples)


def heaviest_batch(
    dataset: PreparedDataset,
    cfg: DataConfig,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """A batch shaped like the heaviest one this rank's loader yields in its first epoch at this
    micro-batch size (`heaviest_batch_lengths`, the data's real lengths under cfg's bucketing), with
    random tokens below `vocab_size` (default the dataset's); cfg's max_length must be resolved."""
    order = _batch_order(dataset, cfg, micro_batch_size, rank, world_size, dataset.lengths())
    collate = _collate(dataset, cfg)
    lengths = heaviest_batch_lengths(collate.kept_lengths(dataset.lengths()), order, collate)
    vocab = vocab_size if vocab_size is not None else dataset.vocab_size
    return batch_of_lengths(lengths, collate, vocab, dataset.num_latents, dataset.latent_dim)


# --------------------------------------------------------------------------------------------------
# Model <-> data.


def latent_source(meta: dict) -> str:
    """Where a prepared dataset's latents came from, as a message names it."""
    imported = meta.get("prepare", {}).get("legacy_latents")
    if imported:
        return f"latents imported from {imported}"
    if "synthetic" in meta:  # mmldlm/data/synthetic.py
        return "synthetic N(0, 1) latents"
    return f"encoder {meta['encoder']}"


def model_for_dataset(model: ModelConfig, dataset: PreparedDataset) -> ModelConfig:
    """`model` with the keys it leaves null (latent_dim, num_latents) set to the dataset's, and the
    vocabulary prior off where the dataset cannot give it (`has_token_latents`); vocab_size stays null
    here, since the model takes it from the tokenizer when it is built."""
    return dataclasses.replace(
        model,
        latent_dim=dataset.latent_dim if model.latent_dim is None else model.latent_dim,
        num_latents=dataset.num_latents if model.num_latents is None else model.num_latents,
        vocab_prior=model.vocab_prior and has_token_latents(dataset.meta),
    )


def has_token_latents(meta: dict) -> bool:
    """Whether the dataset of meta.json `meta` holds its vocabulary's token latents (model.vocab_prior), or
    can have them made by its encoder: not where its latents were imported (encoder_normalize null) from
    an encoder that is not known."""
    return bool(meta.get("token_latents")) or meta.get("encoder_normalize") is not None


def resolve_for_model(data: DataConfig, model: ModelConfig, dataset: PreparedDataset) -> DataConfig:
    """Check that `model` can be trained on `dataset` (ConfigError naming the key, the value and the
    dataset's value and path; a null latent_dim, num_latents or vocab_size is the dataset's) and return
    `data` with max_length resolved: null becomes the longest multiple of pad_to_multiple that fits
    model.max_seq_len."""
    where = f"the dataset {dataset.path}"
    if model.latent_dim is not None and model.latent_dim != dataset.latent_dim:
        _fail(
            "model.latent_dim",
            model.latent_dim,
            f"null or {dataset.latent_dim}, the latent dim of {where} ({latent_source(dataset.meta)})",
        )
    if model.num_latents is not None and model.num_latents != dataset.num_latents:
        _fail(
            "model.num_latents",
            model.num_latents,
            f"null or {dataset.num_latents}, the latents per sample of {where}",
        )
    if model.vocab_size is not None and model.vocab_size < dataset.vocab_size:
        _fail(
            "model.vocab_size",
            model.vocab_size,
            f"null or >= {dataset.vocab_size}, the vocab size of {where}/{dataset.meta['tokenizer']}",
        )
    if data.max_length is None:
        max_length = model.max_seq_len // data.pad_to_multiple * data.pad_to_multiple
        if max_length == 0:
            _fail("data.pad_to_multiple", data.pad_to_multiple, f"<= model.max_seq_len={model.max_seq_len}")
        data = dataclasses.replace(data, max_length=max_length)
    if data.max_length > model.max_seq_len:
        _fail("data.max_length", data.max_length, f"<= model.max_seq_len={model.max_seq_len}")
    if data.packing and data.pack_length is not None and data.pack_length < data.max_length:
        _fail("data.pack_length", data.pack_length, f"null or >= data.max_length={data.max_length} (the longest text)")
    if data.length_buckets is not None:
        if not data.packing and data.length_buckets[-1] > data.max_length:
            _fail("data.length_buckets", data.length_buckets, f"lengths <= data.max_length={data.max_length}")
        width = data.pack_length or data.max_length
        if data.packing and data.length_buckets[-1] > width:
            _fail("data.length_buckets", data.length_buckets, f"packed rows' widths <= data.pack_length={width}")
    return data
