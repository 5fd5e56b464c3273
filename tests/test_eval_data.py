"""Evaluating a trained run on other text: `mmldlm prepare --like RUN` reuses the run's tokenizer and
encoder, `mmldlm eval --data DIR` evaluates on the result with the run's own latent statistics, and
both refuse data the run cannot read."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from data_support import trained_run

from mmldlm import cli
from mmldlm.config import load_config
from mmldlm.data.dataset import open_dataset
from mmldlm.data.format import META, TOKENIZER
from mmldlm.data.tokenizer import encode_texts, load_tokenizer
from mmldlm.runs.trained import load_run

RUN = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.steps=4",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.log_every=2",
    "logging.progress_bar=false",
    "schedule.warmup_steps=1",
    "data.num_workers=0",
    "checkpoint.every=1000",
    "eval.every=0",
]
ROOT = Path(__file__).resolve().parent.parent
FAST = ["--steps", "2", "--device", "cpu", "--batch-size", "4", "--retrieval-pool", "8", "--num-t-draws", "1"]
# Text the run never saw: plain words, a number, punctuation and non-ASCII the byte-level BPE must split alike.
TEXTS = [
    "a small brown dog ran across the wet field",
    "the act of reading aloud to a child",
    "an instrument for measuring the weight of 12 apples",
    "a feeling of deep calm after the storm",
    "someone who writes letters, poems and songs",
    "the café on the corner opens at dawn",
    "to move quickly on foot",
    "a large body of salt water",
    "the colour of the evening sky",
    "a person who repairs old clocks",
    "the sound a bell makes",
    "a word that means very happy",
]


def main(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "new.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def like_dir(run_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("like") / "new-text"
    assert (
        main("prepare", "--like", run_dir, "--input", text_file, "--out", out, "--val-fraction", "0.25", "--quiet") == 0
    )
    return out


def run_data(run_dir):
    return open_dataset(load_config(run_dir / "config.yaml").data.path, "val")


def fake_run(run_dir, tmp_path, **meta_changes):
    """A run directory whose config names a copy of the run's dataset with `meta_changes` in its meta.json."""
    data = tmp_path / "data"
    shutil.copytree(run_data(run_dir).path, data)
    meta = json.loads((data / META).read_text())
    (data / META).write_text(json.dumps({**meta, **meta_changes}))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"]["path"] = str(data)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "run"


def test_prepare_like_reuses_the_runs_tokenizer_and_encoder(run_dir, like_dir):
    ours = run_data(run_dir)
    assert (like_dir / TOKENIZER).read_text() == (ours.path / TOKENIZER).read_text()
    meta = json.loads((like_dir / META).read_text())
    assert (meta["encoder"], meta["encoder_normalize"]) == (ours.meta["encoder"], ours.meta["encoder_normalize"])
    assert (meta["vocab_size"], meta["pad_id"], meta["mask_id"]) == (ours.vocab_size, ours.pad_id, ours.mask_id)
    # The same ids for the same text: every stored sample is the run's tokenizer applied to one of the texts.
    expected = sorted(map(tuple, encode_texts(load_tokenizer(ours.path / TOKENIZER), TEXTS)))
    stored = [
        tuple(split[i][1].tolist())
        for split in (open_dataset(like_dir, "train"), open_dataset(like_dir, "val"))
        for i in range(len(split))
    ]
    assert sorted(stored) == expected
    # Texts longer than the run reads would be cut to the length its texts were cut to in training.
    assert meta["prepare"]["max_tokens"] == load_run(run_dir, device="cpu").max_length


def test_prepare_like_refuses_a_run_whose_encoder_is_unknown_or_missing(run_dir, text_file, tmp_path, capsys):
    imported = fake_run(run_dir, tmp_path / "imported", encoder_normalize=None)
    assert main("prepare", "--like", imported, "--input", text_file, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "meta.json: encoder_normalize is null: the run's latents were imported" in err
    assert "--tokenizer" in err and not (tmp_path / "out").exists()

    gone = str(tmp_path / "no-such-encoder")
    missing = fake_run(run_dir, tmp_path / "missing", encoder=gone)
    assert main("prepare", "--like", missing, "--input", text_file, "--out", tmp_path / "out") == 2
    assert f"encoder '{gone}' is not available here" in capsys.readouterr().err


def test_prepare_like_refuses_options_it_decides_and_a_run_without_its_dataset(run_dir, text_file, tmp_path, capsys):
    assert (
        main(
            "prepare",
            "--like",
            run_dir,
            "--input",
            text_file,
            "--out",
            tmp_path / "out",
            "--vocab-size",
            "300",
            "--no-normalize",
        )
        == 2
    )
    assert (
        "takes the tokenizer and the encoder from the run's dataset; drop --vocab-size, --no-normalize"
        in capsys.readouterr().err
    )
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"]["path"] = str(tmp_path / "elsewhere")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    assert main("prepare", "--like", tmp_path / "run", "--input", text_file, "--out", tmp_path / "out") == 2
    assert f"no prepared dataset at {tmp_path / 'elsewhere'}" in capsys.readouterr().err


def test_prepare_like_reads_the_dataset_a_runs_checkpoint_recorded_when_the_cache_is_another(
    run_dir, text_file, tmp_path
):
    """A run of the bundled corpus (data.path null) prepared into a cache this environment does not
    name (MMLDLM_CACHE then unset): --like takes the tokenizer of the dataset its checkpoint recorded,
    where it looked in the empty cache and refused before."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"].update(path=None, cache_dir=str(tmp_path / "another-cache"))
    bundled = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoints", bundled / "checkpoints")
    (bundled / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    assert (
        main("prepare", "--like", bundled, "--input", text_file, "--out", out, "--val-fraction", "0.25", "--quiet") == 0
    )
    assert (out / TOKENIZER).read_text() == (run_data(run_dir).path / TOKENIZER).read_text()
    assert not (tmp_path / "another-cache").exists()  # nothing prepared into the cache


def test_eval_data_refuses_a_dataset_with_another_tokenizer(run_dir, text_file, tmp_path, capsys):
    other = tmp_path / "other"
    assert (
        main(
            "prepare", "--input", text_file, "--out", other, "--vocab-size", "300", "--val-fraction", "0.25", "--quiet"
        )
        == 0
    )
    capsys.readouterr()
    reports = sorted(run_dir.glob("eval/*"))
    assert main("eval", "--run", run_dir, "--data", other, "--num-samples", "4", *FAST) == 2
    err = capsys.readouterr().err
    assert str(other / TOKENIZER) in err and str(run_data(run_dir).path / TOKENIZER) in err
    assert sorted(run_dir.glob("eval/*")) == reports  # refused before evaluating: no report


def test_eval_data_evaluates_the_new_texts_validation_split_and_names_it(run_dir, like_dir, capsys):
    assert main("eval", "--run", run_dir, "--data", like_dir, "--num-samples", "10", *FAST) == 0
    out = run_dir / "eval" / "step-0000004-new-text.json"  # the run's own step-0000004.json stays untouched
    report = json.loads(out.read_text())
    expected = {"path": str(like_dir.resolve()), "split": "val", "own_dataset": False, "in_training": 0}
    expected["in_training_of"] = 3
    assert report["data"] == expected and report["l2t"]["num_samples"] == 3  # its 3 validation samples
    assert report["elbo"]["l2t"]["num_samples"] == 3
    assert "3 new-text validation texts, each figure with its 95% interval" in capsys.readouterr().out
    summary = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "Texts: new-text validation" in summary and "(3 new-text validation latents)" in summary
    assert "Too few texts to mean much (ELBO 3, l2t 3, t2l 3, joint 10; below 30)" in summary  # joint: unconditional
    assert [p.name for p in (run_dir / "eval").glob("*.json")] == [out.name]

    assert main("eval", "--run", run_dir, "--data", like_dir, "--split", "all", "--num-samples", "10", *FAST) == 0
    report = json.loads(out.read_text())
    assert report["data"]["split"] == "all" and report["l2t"]["num_samples"] == 10  # more than either split holds
    assert report["t2l"]["pool_size"] == 10
    assert {e["source"] for e in report["l2t"]["examples"]} <= set(TEXTS)
    assert "Texts: new-text training + validation" in out.with_suffix(".md").read_text(encoding="utf-8")


def test_eval_data_counts_texts_the_run_trained_on_and_its_report_says_so_beside_the_figures(
    run_dir, tmp_path, caplog, capsys
):
    # The run's own training split given as other data: every text evaluated is one it trained on.
    own = run_data(run_dir).path
    out = tmp_path / "own.json"
    args = ["--run", run_dir, "--data", own, "--split", "train", "--num-samples", "6", "--no-writing", *FAST]
    assert main("eval", *args, "--out", out) == 0
    data = json.loads(out.read_text())["data"]
    assert (data["in_training"], data["in_training_of"]) == (8, 8)  # the first max(6, pool 8) texts
    assert "8 of the 8 texts evaluated" in caplog.text and "texts this run trained on" in caplog.text
    note = (
        "**Note:** 8 of the 8 data training texts evaluated (the figures' and the retrieval pool's) are texts this "
        "run trained on: their figures measure recall, not generalisation"
    )
    printed = capsys.readouterr().out
    assert note in printed and printed.index(note) < printed.index("| source |")  # after the headline figures
    summary = out.with_suffix(".md").read_text(encoding="utf-8")
    assert note in summary and summary.index(note) < summary.index("l2t reconstruction")


def test_use_eval_data_reads_all_samples_and_keeps_the_runs_latent_statistics(run_dir, like_dir):
    run = load_run(run_dir, device="cpu")
    mean, std = run.latent.mean.clone(), run.latent.std.clone()
    max_length = run.max_length
    run.use_eval_data(like_dir, "all")
    train, val = open_dataset(like_dir, "train"), open_dataset(like_dir, "val")
    assert len(run.val) == len(train) + len(val) == len(TEXTS)
    in_order = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    for i, (_, tokens, latents) in enumerate(in_order):
        index, got_tokens, got_latents = run.val[i]
        assert index == i and np.array_equal(got_tokens, tokens) and np.array_equal(got_latents, latents)
    # The model was trained with the run's statistics; the new text's own would shift every latent.
    assert torch.equal(run.latent.mean, mean) and torch.equal(run.latent.std, std)
    assert torch.equal(mean, run_data(run_dir).latent_stats()[0])
    assert not np.allclose(train.meta["latent_mean"], mean.numpy())
    assert run.max_length == max_length and run.encoder_name == run_data(run_dir).meta["encoder"]


def test_held_out_texts_keeps_the_validation_texts_no_given_run_trained_on(run_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from held_out_texts import main as held_out_main

    out = tmp_path / "held.jsonl"
    assert held_out_main([str(run_dir), str(run_dir), "--out", str(out)]) == 0
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    val = run_data(run_dir)
    decode = load_tokenizer(val.path / TOKENIZER).decode
    assert texts == [decode(val[i][1].tolist()) for i in range(len(val))]  # a run's val split is held out
    assert held_out_main([str(run_dir), "--out", str(out), "--limit", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    # A run that trained on the first validation text (as another run's split would): it is dropped.
    import mmldlm.runs.trained as run_module

    real = run_module.dataset_texts
    monkeypatch.setattr(
        run_module, "dataset_texts", lambda d, split: real(d, split) + ((texts[0],) if split == "train" else ())
    )
    assert held_out_main([str(run_dir), "--out", str(out)]) == 0
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == texts[1:]
