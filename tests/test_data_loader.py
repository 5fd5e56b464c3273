"""The memory-mapped dataset and its loader: batch format and padding, the DistributedSampler order,
exact resumption (1 and 2 ranks, with workers), model/data checks and damaged datasets."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from data_support import prepared
from torch.utils.data import DistributedSampler

from mmldlm.config import ConfigError, DataConfig, ModelConfig, load_config
from mmldlm.data import DataError
from mmldlm.data.dataset import (
    PreparedDataset,
    build_loader,
    default_num_workers,
    model_for_dataset,
    open_dataset,
    padded_lengths,
    resolve_for_model,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared(tmp_path_factory)


@pytest.fixture(scope="module")
def train(data_dir):
    return open_dataset(data_dir, "train")


def cfg(**kw) -> DataConfig:
    base = DataConfig(num_workers=0)
    for key, value in kw.items():
        setattr(base, key, value)
    base.check()
    return base


def stream(loader, n):
    """The next n batches of `loader`, across epoch ends, as a training loop reads them."""
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def test_batches_are_padded_to_the_multiple(train):
    for multiple in (8, 64):
        for batch in build_loader(train, cfg(pad_to_multiple=multiple), micro_batch_size=8):
            lengths = torch.tensor([len(train[int(i)][1]) for i in batch["index"]])
            B, L = batch["tokens"].shape
            assert L % multiple == 0 and L - multiple < lengths.max() <= L
            assert batch["tokens"].dtype == torch.int64 and batch["pad_mask"].dtype == torch.bool
            assert torch.equal(batch["pad_mask"].sum(1), lengths)
            assert (batch["tokens"][~batch["pad_mask"]] == train.pad_id).all()
            first = int(batch["index"][0])
            assert batch["tokens"][0, : lengths[0]].tolist() == train[first][1].tolist()
            assert batch["latents"].shape == (B, 1, 384) and batch["latents"].dtype == torch.float32
            assert torch.equal(batch["latents"][0], torch.from_numpy(train[first][2].astype(np.float32)))


def test_length_buckets_pad_each_batch_to_the_shortest_bucket_that_holds_its_longest_text(train):
    """data.length_buckets: every batch's length is a bucket (data.max_length past the last), the
    shortest that holds its longest text; the lengths a batch can have are what `padded_lengths` lists."""
    buckets, max_length = [8, 24], 32
    config = cfg(length_buckets=buckets, max_length=max_length)
    seen = set()
    for batch in build_loader(train, config, micro_batch_size=1):
        longest, L = int(batch["pad_mask"].sum(1).max()), batch["tokens"].shape[1]
        expected = next((n for n in buckets if n >= longest), max_length)
        assert L == expected, (longest, L)
        seen.add(L)
    assert seen <= set(padded_lengths(config, max_length)) == {8, 24, 32}
    assert len(seen) >= 2  # the fixture's texts reach more than one bucket
    assert padded_lengths(cfg(pad_to_multiple=8), 32) == [8, 16, 24, 32]
    assert padded_lengths(cfg(pad_to_multiple=8), 30) == [8, 16, 24, 30]


def test_truncation_to_max_length(train):
    batch = next(iter(build_loader(train, cfg(max_length=8), micro_batch_size=16)))
    assert batch["tokens"].shape[1] == 8 and batch["pad_mask"].sum(1).max() == 8


@pytest.mark.parametrize("world_size", [1, 2])
def test_order_is_distributed_samplers(train, world_size):
    for rank in range(world_size):
        loader = build_loader(train, cfg(), micro_batch_size=5, rank=rank, world_size=world_size, seed=3)
        ours = [i for b in loader for i in b["index"].tolist()]
        sampler = DistributedSampler(train, world_size, rank, shuffle=True, seed=3, drop_last=True)
        assert ours == list(sampler)[: len(loader) * 5]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resumed_loader_yields_the_same_next_batches(train, num_workers, world_size):
    config = cfg(num_workers=num_workers, prefetch_factor=2 if num_workers else None)
    for rank in range(world_size):

        def make(rank=rank):
            return build_loader(train, config, micro_batch_size=4, rank=rank, world_size=world_size, seed=7)

        per_epoch = len(make())
        total = per_epoch + per_epoch // 2
        expected = stream(make(), total)
        for stop in (3, per_epoch, per_epoch + 2):  # inside an epoch, at its end, inside the next one
            first = make()
            seen = stream(first, stop)
            resumed = make()
            resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
            assert_same_batches(seen + stream(resumed, total - stop), expected)


def test_resume_reads_no_skipped_sample(train, monkeypatch):
    loader = build_loader(train, cfg(), micro_batch_size=4, seed=1)
    skipped = [b["index"].tolist() for b in stream(loader, 5)]
    state = loader.state_dict()
    read = []
    original = PreparedDataset.__getitem__
    monkeypatch.setattr(PreparedDataset, "__getitem__", lambda self, i: (read.append(i), original(self, i))[1])
    resumed = build_loader(train, cfg(), micro_batch_size=4, seed=1)
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    assert read == batch["index"].tolist() and not set(read) & {i for b in skipped for i in b}


def test_resume_on_another_world_size(train):
    two = [build_loader(train, cfg(), micro_batch_size=4, rank=r, world_size=2, seed=5) for r in range(2)]
    for loader in two:
        stream(loader, 3)
    state = two[0].state_dict()
    assert state["samples"] == 3 * 4 * 2
    nxt = [stream(loader, 1)[0]["index"].tolist() for loader in two]
    one = build_loader(train, cfg(), micro_batch_size=8, seed=5)  # 1 rank x 8 = 2 ranks x 4 per step
    one.load_state_dict(state)
    assert sorted(stream(one, 1)[0]["index"].tolist()) == sorted(nxt[0] + nxt[1])
    with pytest.raises(DataError, match="saved with seed=5, this loader has 6"):
        build_loader(train, cfg(), micro_batch_size=8, seed=6).load_state_dict(state)


def read_epoch(loaders, num_batches=None) -> list[int]:
    """The samples the ranks' `loaders` read, global batch by global batch, to the epoch's end or for
    `num_batches` batches of each."""
    read, passes = [], [iter(loader) for loader in loaders]
    for _ in range(num_batches or len(loaders[0])):
        batches = [next(p, None) for p in passes]
        if batches[0] is None:
            break
        read += [i for b in batches for i in b["index"].tolist()]
    return read


@pytest.mark.parametrize("bucket_batches", [1, 4])
def test_a_resume_on_other_world_and_batch_sizes_reads_each_sample_of_the_epoch_once(train, bucket_batches):
    """2 ranks x 4 for 3 batches, then 1 rank x 6 for 2, then 2 ranks x 3 to the epoch's end: every
    sample read at most once, and none left but the tail too small for a global batch. Unbucketed, the
    samples read are a prefix of the global order, a function of the seed and epoch alone."""
    config = cfg(bucket_batches=bucket_batches)

    def ranks(micro, world):
        return [build_loader(train, config, micro, rank=r, world_size=world, seed=9) for r in range(world)]

    first = ranks(4, 2)
    read = read_epoch(first, 3)
    state = json.loads(json.dumps(first[0].state_dict()))  # as a checkpoint stores it
    assert state["samples"] == 24
    second = ranks(6, 1)
    second[0].load_state_dict(state)
    read += read_epoch(second, 2)
    state = json.loads(json.dumps(second[0].state_dict()))
    third = ranks(3, 2)
    for loader in third:
        loader.load_state_dict(state)
    read += read_epoch(third)
    assert len(read) == len(set(read))
    assert len(train) - 6 < len(read) <= len(train)
    if bucket_batches == 1:  # the first len(read) samples of the epoch's permutation
        assert set(read) == set(first[0].order.permutation(0)[: len(read)].tolist())
    assert third[0].state_dict()["epoch"] == 1 and third[0].state_dict()["samples"] == 0


def test_length_bucketing_keeps_the_epoch_and_cuts_the_padding(train):
    plain = build_loader(train, cfg(), micro_batch_size=8, seed=2)
    bucketed = build_loader(train, cfg(bucket_batches=6), micro_batch_size=8, seed=2)
    a, b = list(plain), list(bucketed)
    assert sorted(i for x in a for i in x["index"].tolist()) == sorted(i for x in b for i in x["index"].tolist())
    positions = lambda batches: sum(x["tokens"].numel() for x in batches)  # noqa: E731
    real = sum(int(x["pad_mask"].sum()) for x in a)
    assert real == sum(int(x["pad_mask"].sum()) for x in b)
    assert positions(b) < 0.8 * positions(a), (real, positions(a), positions(b))
    lengths = train.lengths()
    assert lengths.tolist() == [len(train[i][1]) for i in range(len(train))]
    within = [np.ptp(lengths[x["index"].numpy()]) for x in b]
    across = [np.ptp(lengths[x["index"].numpy()]) for x in a]
    assert np.mean(within) < 0.5 * np.mean(across)  # a batch holds similar lengths


def test_bucketed_loader_resumes_exactly(train):
    config = cfg(bucket_batches=4)

    def make(micro=4):
        return build_loader(train, config, micro_batch_size=micro, seed=7)

    expected = stream(make(), len(make()) + 3)
    first = make()
    seen = stream(first, 5)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert_same_batches(seen + stream(resumed, len(expected) - 5), expected)
    with pytest.raises(DataError, match="bucket_batches=4, this loader has 1"):
        build_loader(train, cfg(), micro_batch_size=4, seed=7).load_state_dict(first.state_dict())


def test_ranks_share_an_epoch_without_overlap(train):
    config = cfg(drop_last=False, shuffle=False)
    parts = [
        [i for b in build_loader(train, config, 8, rank=r, world_size=2) for i in b["index"].tolist()] for r in range(2)
    ]
    assert len(parts[0]) == len(parts[1])
    assert set(parts[0]) | set(parts[1]) == set(range(len(train)))


def test_dataloader_settings_come_from_config(train, monkeypatch):
    loader = build_loader(train, DataConfig(num_workers=2, prefetch_factor=4, pin_memory=False), 8)
    dl = loader.dataloader
    assert (dl.num_workers, dl.prefetch_factor, dl.persistent_workers, dl.pin_memory) == (2, 4, True, False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_num_workers() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_num_workers() == 4
    assert build_loader(train, DataConfig(num_workers=None), 8).dataloader.num_workers == 4


def test_data_config_checks():
    with pytest.raises(
        ConfigError, match=r"'data.max_length': got 60; expected null or a positive multiple of data.pad_to_multiple=8"
    ):
        load_config(None, ["data.max_length=60"])
    with pytest.raises(ConfigError, match=r"'data.num_workers': got -1"):
        load_config(None, ["data.num_workers=-1"])
    assert load_config(None, ["data.path=/x", "data.pad_to_multiple=64"]).data.pad_to_multiple == 64
    for buckets in ("[16,8]", "[12]", "[]"):
        with pytest.raises(ConfigError, match=r"'data.length_buckets': got .*; expected null or a non-empty ascending"):
            load_config(None, [f"data.length_buckets={buckets}"])
    # packed, the buckets are the rows' widths (none past the rows' width: resolve_for_model)
    assert load_config(None, ["data.length_buckets=[8]", "data.packing=true"]).data.length_buckets == [8]


def test_model_must_match_the_dataset(train, data_dir):
    with pytest.raises(
        ConfigError,
        match=rf"'model.latent_dim': got 512; expected null or 384, the latent dim of the dataset {data_dir} "
        rf"\(encoder all-MiniLM-L6-v2\)",
    ):
        resolve_for_model(DataConfig(), ModelConfig(latent_dim=512), train)
    with pytest.raises(ConfigError, match=r"'model.num_latents': got 2; expected null or 1"):
        resolve_for_model(DataConfig(), ModelConfig(num_latents=2), train)
    with pytest.raises(ConfigError, match=r"'model.vocab_size': got 300; expected null or >= 400"):
        resolve_for_model(DataConfig(), ModelConfig(vocab_size=300), train)
    with pytest.raises(ConfigError, match=r"'data.max_length': got 256; expected <= model.max_seq_len=128"):
        resolve_for_model(DataConfig(max_length=256), ModelConfig(), train)
    resolved = resolve_for_model(DataConfig(pad_to_multiple=64), ModelConfig(max_seq_len=100), train)
    assert resolved.max_length == 64
    with pytest.raises(
        ConfigError, match=r"'data.length_buckets': got \[64, 256\]; expected lengths <= data.max_length=128"
    ):
        resolve_for_model(DataConfig(length_buckets=[64, 256]), ModelConfig(), train)
    # packed, the buckets are the rows' widths: up to data.pack_length, which is data.max_length when null
    packed = resolve_for_model(DataConfig(packing=True, pack_length=512, length_buckets=[256]), ModelConfig(), train)
    assert (packed.max_length, packed.length_buckets) == (128, [256])
    with pytest.raises(
        ConfigError,
        match=r"'data.length_buckets': got \[64, 256\]; expected packed rows' widths <= data.pack_length=128",
    ):
        resolve_for_model(DataConfig(packing=True, length_buckets=[64, 256]), ModelConfig(), train)
    with pytest.raises(
        ConfigError,
        match=r"'data.length_buckets': got \[64, 512\]; expected packed rows' widths <= data.pack_length=256",
    ):
        resolve_for_model(DataConfig(packing=True, pack_length=256, length_buckets=[64, 512]), ModelConfig(), train)


def test_a_null_latent_shape_is_the_datasets(train):
    """model.latent_dim and model.num_latents left null take the dataset's, as vocab_size does; set ones stay."""
    assert (ModelConfig().latent_dim, ModelConfig().num_latents) == (None, None)
    model = model_for_dataset(ModelConfig(), train)
    assert (model.latent_dim, model.num_latents) == (train.latent_dim, train.num_latents) == (384, 1)
    assert model_for_dataset(ModelConfig(latent_dim=32, num_latents=2), train).latent_dim == 32


def test_damaged_or_foreign_datasets(data_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    meta = json.loads((copy / "meta.json").read_text())
    shard = meta["shards"]["train"][1]
    latents = copy / shard["latents"]
    latents.write_bytes(latents.read_bytes()[:-100])
    with pytest.raises(DataError, match=rf"{latents}: \d+ bytes, expected \d+ from meta.json \(truncated\)"):
        open_dataset(copy, "train")
    shutil.copy(data_dir / shard["latents"], latents)
    tokens = copy / shard["tokens"]
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{tokens}: .* \(truncated\)"):
        open_dataset(copy, "train")
    (copy / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(DataError, match=r"format_version 99, but this mmldlm reads format version 1; re-run"):
        open_dataset(copy, "val")
    with pytest.raises(DataError, match=r"not a prepared dataset \(no meta.json\)"):
        open_dataset(tmp_path, "train")
    with pytest.raises(DataError, match=r"no split 'test' \(splits: train, val\)"):
        open_dataset(data_dir, "test")


def pending_signals(pid: int) -> int:
    """The mask of signals sent to `pid` and not yet delivered, from /proc (its thread's and its
    process's)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def test_loader_workers_leave_stop_signals_to_the_main_process(train):
    """A SIGTERM or SIGINT to the whole process group (a scheduler's stop, Ctrl-C) also reaches the
    workers: they go on serving batches, so the trainer can finish its step and checkpoint."""
    loader = build_loader(train, cfg(num_workers=1, persistent_workers=True, prefetch_factor=2), micro_batch_size=4)
    batches = iter(loader)
    next(batches)
    (worker,) = loader.dataloader._iterator._workers
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(worker.pid, sig)
    deadline = time.monotonic() + 60  # until the signals are delivered (or discarded): then they have acted
    while worker.is_alive() and pending_signals(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.is_alive() and not pending_signals(worker.pid)
    assert next(batches)["tokens"].shape[0] == 4


def test_a_crash_while_workers_run_still_ends_the_process(data_dir):
    """Workers ignore SIGTERM (above), so they must be stopped the cooperative way when the main process
    dies of an exception nobody catches; multiprocessing's exit handler would wait for them forever."""
    script = (
        "import sys\n"
        "from mmldlm.config import DataConfig\n"
        "from mmldlm.data.dataset import build_loader, open_dataset\n"
        "cfg = DataConfig(num_workers=2, prefetch_factor=2, persistent_workers=False)\n"
        "loader = build_loader(open_dataset(sys.argv[1], 'train'), cfg, micro_batch_size=4)\n"
        "batches = iter(loader)\n"
        "next(batches)\n"
        "raise RuntimeError('a crash while the workers run')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(data_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "a crash while the workers run" in done.stderr
