"""Import of the per-sample .npz/.npy layout, and that a failure leaves nothing behind."""

import re

import numpy as np
import pytest
from data_support import corpus_texts

from mmldlm.config import DataConfig
from mmldlm.data import DataError
from mmldlm.data.dataset import build_loader, open_dataset
from mmldlm.data.prepare import PrepareOptions, prepare
from mmldlm.data.tokenizer import train_bpe

PAD_ID = 7  # whatever the old tokenizer padded with; attention_mask says what is real


def make_legacy(root, num, dim=16, flat_every=2, num_latents=1):
    """A legacy folder pair: padded input_ids [1, 24] + attention_mask, latents [D] or [1, D]
    (or [K, D] with num_latents K > 1)."""
    tokenizer = train_bpe(corpus_texts(), 300)
    tokenizer.save(str(root / "tokenizer.json"))
    tokens_dir, latents_dir = root / "tokens", root / "latents"
    tokens_dir.mkdir()
    latents_dir.mkdir()
    rng = np.random.default_rng(0)
    samples = {}
    for i in range(num):
        stem = f"doc{i:04d}"
        ids = rng.integers(2, 300, size=rng.integers(3, 20))
        padded = np.full((1, 24), PAD_ID)
        padded[0, : len(ids)] = ids
        mask = (np.arange(24) < len(ids))[None].astype(np.int64)
        np.savez(tokens_dir / f"{stem}_tokens.npz", input_ids=padded, attention_mask=mask)
        latent = rng.standard_normal(dim).astype(np.float32)
        if num_latents > 1:
            latent = rng.standard_normal((num_latents, dim)).astype(np.float32)
        np.save(latents_dir / f"{stem}.npy", latent if i % flat_every or num_latents > 1 else latent[None])
        samples[stem] = (ids.tolist(), latent)
    return tokens_dir, latents_dir, samples


def legacy_options(root, out, **kw):
    return PrepareOptions(
        **{
            "inputs": [],
            "out": str(out),
            "legacy_tokens": str(root / "tokens"),
            "legacy_latents": str(root / "latents"),
            "tokenizer": str(root / "tokenizer.json"),
            "val_fraction": 0.25,
            "shard_size": 8,
            "latent_dtype": "float32",
            "progress": False,
            **kw,
        }
    )


def test_legacy_import_round_trips(tmp_path):
    _, _, samples = make_legacy(tmp_path, 30)
    meta = prepare(legacy_options(tmp_path, tmp_path / "out"), log=lambda _m: None)["meta"]
    assert meta["splits"] == {"train": 22, "val": 8} and (meta["latent_dim"], meta["num_latents"]) == (16, 1)
    assert meta["vocab_size"] == 300 and meta["encoder_normalize"] is None
    stems = sorted(samples)
    found = {}
    for split in ("train", "val"):
        dataset = open_dataset(tmp_path / "out", split)
        for i in range(len(dataset)):
            _, ids, latent = dataset[i]
            match = [s for s in stems if samples[s][0] == ids.tolist()]
            assert len(match) == 1
            np.testing.assert_array_equal(latent, samples[match[0]][1][None])  # float32 stored exactly
            found[match[0]] = split
    assert sorted(found) == stems


def test_legacy_errors_name_the_file(tmp_path):
    tokens_dir, latents_dir, _ = make_legacy(tmp_path, 4)
    (latents_dir / "doc0002.npy").unlink()
    with pytest.raises(DataError, match=r"doc0002_tokens.npz: no matching latent .*doc0002.npy"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    np.save(latents_dir / "doc0002.npy", np.zeros(32, np.float32))
    with pytest.raises(DataError, match=r"doc0002.npy: latent of shape \[1, 32\], but .*doc0000.npy has \[1, 16\]"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    np.save(latents_dir / "doc0002.npy", np.zeros(16, np.float32))
    np.savez(tokens_dir / "doc0001_tokens.npz", input_ids=np.array([5, 900]), attention_mask=np.ones(2))
    with pytest.raises(
        DataError, match=r"doc0001_tokens.npz: token id 900 outside the vocabulary of .*tokenizer.json \(size 300\)"
    ):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    np.savez(tokens_dir / "doc0001_tokens.npz", ids=np.array([5]))
    with pytest.raises(DataError, match=r"doc0001_tokens.npz: no key input_ids, attention_mask \(keys: ids\)"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_failure_midway_leaves_no_output(tmp_path):
    _, latents_dir, _ = make_legacy(tmp_path, 40)
    (latents_dir / "doc0035.npy").write_bytes(b"\x93NUMPY garbage")  # read only after earlier shards are written
    with pytest.raises(DataError, match=r"doc0035.npy: not a readable .npy"):
        prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents", "tokenizer.json", "tokens"]


def test_legacy_and_corpus_input_are_exclusive(tmp_path):
    with pytest.raises(
        DataError, match=re.escape("give either --input PATH|default or --legacy-tokens DIR --legacy-latents DIR")
    ):
        prepare(PrepareOptions(inputs=["default"], out=str(tmp_path / "o"), legacy_tokens="a", legacy_latents="b"))
    with pytest.raises(DataError, match="--legacy-tokens needs --tokenizer"):
        prepare(PrepareOptions(inputs=[], out=str(tmp_path / "o"), legacy_tokens="a", legacy_latents="b"))


def test_several_latents_per_sample_flow_through(tmp_path):
    _, _, samples = make_legacy(tmp_path, 12, dim=8, num_latents=3)
    meta = prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0), log=lambda _m: None)["meta"]
    assert (meta["num_latents"], meta["latent_dim"]) == (3, 8) and len(meta["latent_mean"]) == 8
    dataset = open_dataset(tmp_path / "out")
    batch = next(iter(build_loader(dataset, DataConfig(num_workers=0), micro_batch_size=4)))
    assert batch["latents"].shape == (4, 3, 8)
    first = sorted(samples)[int(batch["index"][0])]
    np.testing.assert_array_equal(batch["latents"][0].numpy(), samples[first][1])
