"""Import of the per-sample .npz/.npy layout, and that a failure leaves nothing behind."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from data_support import corpus_texts
from test_data_prepare import free_port

from mmldlm import cli
from mmldlm.config import ConfigError, DataConfig, ModelConfig
from mmldlm.data import DataError
from mmldlm.data.dataset import build_loader, model_for_dataset, open_dataset, resolve_for_model
from mmldlm.data.legacy import LegacySource
from mmldlm.data.prepare import PrepareOptions, prepare
from mmldlm.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parent.parent
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


def test_the_model_takes_the_imported_latent_width_and_a_mismatch_names_the_import(tmp_path):
    make_legacy(tmp_path, 12, dim=32)
    prepare(legacy_options(tmp_path, tmp_path / "out"), log=lambda _m: None)
    dataset = open_dataset(tmp_path / "out")
    assert (model_for_dataset(ModelConfig(), dataset).latent_dim, dataset.latent_dim) == (32, 32)
    with pytest.raises(
        ConfigError,
        match=rf"'model.latent_dim': got 384; expected null or 32, the latent dim of the dataset .*out "
        rf"\(latents imported from {re.escape(str(tmp_path / 'latents'))}\)",
    ):
        resolve_for_model(DataConfig(), ModelConfig(latent_dim=384), dataset)


def test_the_default_preset_trains_on_imported_latents_with_the_vocabulary_prior_off_said_once(tmp_path, capsys):
    # The default preset asks for the vocabulary prior, which needs the encoder that made the latents.
    make_legacy(tmp_path, 12, dim=32)
    prepare(legacy_options(tmp_path, tmp_path / "out"), log=lambda _m: None)
    run = tmp_path / "run"
    overrides = [f"data.path={tmp_path / 'out'}", f"train.run_dir={run}", "train.steps=1", "eval.every=0"]
    assert cli.main(["train", "--config", "default", *overrides, "data.num_workers=0", "--quiet"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "vocab_prior" in line]
    assert len(said) == 1 and said[0].startswith("INFO ") and "model.vocab_prior: off" in said[0]
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["vocab_prior"] is False
    assert model_for_dataset(ModelConfig(vocab_prior=True), open_dataset(tmp_path / "out")).vocab_prior is False


def test_max_samples_imports_a_seeded_subset(tmp_path):
    _, _, samples = make_legacy(tmp_path, 30)
    meta = prepare(legacy_options(tmp_path, tmp_path / "out", max_samples=12), log=lambda _m: None)["meta"]
    assert meta["counts"] == {"read": 30, "kept": 12, "over_max_samples": 18}
    assert meta["splits"]["train"] + meta["splits"]["val"] == 12
    again = prepare(legacy_options(tmp_path, tmp_path / "again", max_samples=12), log=lambda _m: None)["meta"]
    assert again["latent_mean"] == meta["latent_mean"]  # the same seeded subset
    datasets = [open_dataset(tmp_path / "out", split) for split in ("train", "val")]
    imported = {tuple(d[i][1].tolist()) for d in datasets for i in range(len(d))}
    assert len(imported) == 12 and imported <= {tuple(ids) for ids, _ in samples.values()}


def test_the_scan_order_imports_the_first_pairs_the_folder_lists_and_trains_on_all_of_them(tmp_path):
    # The older loader's walk: os.scandir's order, NAME.npz pairs with NAME.npy too, a token file without
    # its latent skipped, stopped after --max-samples pairs.
    tokens_dir, latents_dir, samples = make_legacy(tmp_path, 30)
    ids = np.array([[5, 6, 7, PAD_ID]])
    np.savez(tokens_dir / "plain.npz", input_ids=ids, attention_mask=(ids != PAD_ID).astype(np.int64))
    np.save(latents_dir / "plain.npy", np.ones(16, dtype=np.float32))
    samples["plain"] = ([5, 6, 7], None)
    np.savez(tokens_dir / "orphan_tokens.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    listed = [e.name.removesuffix(".npz").removesuffix("_tokens") for e in os.scandir(tokens_dir)]
    first = [name for name in listed if name != "orphan"][:12]
    options = legacy_options(tmp_path, tmp_path / "out", legacy_order="scan", max_samples=12, val_fraction=0.0)
    meta = prepare(options, log=lambda _m: None)["meta"]
    assert meta["splits"] == {"train": 12, "val": 0} and meta["prepare"]["legacy_order"] == "scan"
    train = open_dataset(tmp_path / "out", "train")
    assert sorted(tuple(train[i][1].tolist()) for i in range(12)) == sorted(tuple(samples[n][0]) for n in first)


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
    np.savez(tokens_dir / "doc0001_tokens.npz", input_ids=np.array([5, 6]), attention_mask=np.array([1, 2]))
    with pytest.raises(DataError, match=r"doc0001_tokens.npz: attention_mask holds 2; expected only 0 .* and 1"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    np.savez(tokens_dir / "doc0001_tokens.npz", input_ids=np.array([5, 6, 7]), attention_mask=np.array([1, 1]))
    with pytest.raises(DataError, match=r"doc0001_tokens.npz: input_ids has 3 entries, attention_mask 2"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    np.savez(tokens_dir / "doc0001_tokens.npz", ids=np.array([5]))
    with pytest.raises(DataError, match=r"doc0001_tokens.npz: no key input_ids, attention_mask \(keys: ids\)"):
        prepare(legacy_options(tmp_path, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_failure_midway_keeps_the_finished_shards_and_a_rerun_continues_from_them(tmp_path, monkeypatch):
    _, latents_dir, samples = make_legacy(tmp_path, 40)
    good = (latents_dir / "doc0035.npy").read_bytes()
    (latents_dir / "doc0035.npy").write_bytes(b"\x93NUMPY garbage")  # read only after earlier shards are written
    with pytest.raises(DataError, match=r"doc0035.npy: not a readable .npy"):
        prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "latents", "tokenizer.json", "tokens"]

    (latents_dir / "doc0035.npy").write_bytes(good)  # the user mends the file and runs the same command
    read = []
    original = LegacySource._tokens
    monkeypatch.setattr(LegacySource, "_tokens", lambda self, path: read.append(path.name) or original(self, path))
    lines = []
    meta = prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0), log=lines.append)["meta"]
    assert read == [f"doc{i:04d}_tokens.npz" for i in range(32, 40)]  # only the shard that failed is read again
    assert any("continuing an interrupted prepare; 4 finished shards kept" in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents", "out", "tokenizer.json", "tokens"]
    assert not list((tmp_path / "out").rglob("*.json*"))[2:]  # meta.json and tokenizer.json only: no records

    fresh = prepare(legacy_options(tmp_path, tmp_path / "fresh", val_fraction=0.0), log=lambda _m: None)["meta"]
    continued = {k: v for k, v in meta.items() if k != "prepare"}
    assert continued == {k: v for k, v in fresh.items() if k != "prepare"}  # the same dataset, stats included
    assert meta["splits"]["train"] == len(samples)


def test_a_partial_of_other_options_is_not_continued(tmp_path):
    _, latents_dir, _ = make_legacy(tmp_path, 24)
    good = (latents_dir / "doc0020.npy").read_bytes()
    (latents_dir / "doc0020.npy").write_bytes(b"broken")
    with pytest.raises(DataError):
        prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0))
    (latents_dir / "doc0020.npy").write_bytes(good)
    lines = []
    meta = prepare(legacy_options(tmp_path, tmp_path / "out", val_fraction=0.0, seed=1), log=lines.append)["meta"]
    assert not any("continuing" in line for line in lines) and meta["splits"]["train"] == 24


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


def legacy_command(root, out, *extra):
    return [
        "prepare",
        "--legacy-tokens",
        str(root / "tokens"),
        "--legacy-latents",
        str(root / "latents"),
        "--tokenizer",
        str(root / "tokenizer.json"),
        "--out",
        str(out),
        "--shard-size",
        "8",
        "--val-fraction",
        "0.25",
        "--latent-dtype",
        "float32",
        "--quiet",
        *extra,
    ]


@pytest.mark.slow  # a killed process, then torchrun on 2 processes
def test_an_import_killed_midway_continues_on_two_processes_to_the_same_dataset(tmp_path):
    """SIGKILL while a sample cannot be read (a FIFO that nobody writes blocks its read), after the shards
    before it were written: torchrun on 2 processes then continues from the finished shards, and the
    result is byte for byte the dataset of one uninterrupted process."""
    tokens_dir, _, _ = make_legacy(tmp_path, 64)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "mmldlm.cli"]
    reference = subprocess.run([*cli, *legacy_command(tmp_path, tmp_path / "reference")], env=env, timeout=300)
    assert reference.returncode == 0

    blocked = tokens_dir / "doc0040_tokens.npz"
    content = blocked.read_bytes()
    blocked.unlink()
    os.mkfifo(blocked)
    partial = tmp_path / ".out.partial"
    first = subprocess.Popen([*cli, *legacy_command(tmp_path, tmp_path / "out")], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(partial.glob("*/done-*.json"))) < 3 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        finished = len(list(partial.glob("*/done-*.json")))
        assert finished >= 3, "the shards before the blocked sample were not written"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    blocked.unlink()
    blocked.write_bytes(content)
    assert not (tmp_path / "out").exists()

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "mmldlm.cli"]
    result = subprocess.run(
        [*torchrun, *legacy_command(tmp_path, tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"continuing an interrupted prepare; {finished} finished shard{'' if finished == 1 else 's'} kept"
        in result.stdout + result.stderr
    )
    files = sorted(p.relative_to(tmp_path / "reference") for p in (tmp_path / "reference").rglob("*") if p.is_file())
    assert sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file()) == files
    for rel in files:
        if rel.name != "meta.json":  # it records --out
            assert (tmp_path / "out" / rel).read_bytes() == (tmp_path / "reference" / rel).read_bytes(), rel
    assert not partial.exists()
