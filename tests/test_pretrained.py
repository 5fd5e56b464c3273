"""An exported model folder: `mmldlm export` writes it atomically with its model card, `MMLDLM.from_pretrained`
loads it (or a run directory) with no dataset, and it samples exactly what the run samples; damaged
folders and missing runs fail with one line naming the file."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from data_support import prepared, trained_run

from mmldlm import MMLDLM, cli
from mmldlm.data.errors import DataError
from mmldlm.device import describe_device
from mmldlm.errors import OptionError
from mmldlm.export.card import model_card, writing_rows
from mmldlm.export.pretrained import CONFIG, TOKENIZER, WEIGHTS
from mmldlm.sampling.sampler import length_masks

RUN = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.steps=6",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.log_every=2",
    "logging.progress_bar=false",
    "schedule.warmup_steps=1",
    "data.num_workers=0",
    "checkpoint.every=1000",
    "eval.every=0",
    "train.ema_decay=0.9",
]
FAST = dict(steps=3, batch_size=2)


def main(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model"
    assert main("export", "--run", run_dir, "--out", out) == 0
    return out


def test_export_writes_a_self_contained_folder_with_its_model_card(run_dir, exported, tmp_path, capsys):
    assert {p.name for p in exported.iterdir()} == {CONFIG, WEIGHTS, TOKENIZER, "latent_stats.safetensors", "README.md"}
    assert not list(exported.parent.glob(".model.partial-*"))  # the temporary folder was renamed into place
    config = json.loads((exported / CONFIG).read_text())
    assert config["format_version"] == 1 and config["weights"] == "ema" and config["step"] == 6
    assert (config["encoder"], config["latent_dim"], config["num_latents"]) == ("all-MiniLM-L6-v2", 384, 1)
    assert (config["pad_id"], config["mask_id"]) == (0, 1) and config["model"]["vocab_size"] == config["vocab_size"]
    card = (exported / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: mmldlm" in card
    assert "6 optimizer steps, 48 samples seen" in card
    # The checkpoint records what trained it and for how long; the card says so.
    meta = json.loads((run_dir / "checkpoints" / "step-0000006" / "meta.json").read_text())
    assert meta["device"] == describe_device(torch.device("cpu")) and meta["wall_seconds"] > 0
    assert (
        "of training wall-clock time" in card
        and f"on {meta['device']}, 1 process" in card
        and "process(es)" not in card
    )
    assert "Not evaluated" in card and "licences of the inputs above apply" in card
    assert "the EMA of the weights (train.ema_decay 0.9)" in card and "ema_decay: 0.9" in card

    # With an evaluation of the checkpoint the card reports it; --force replaces the folder.
    assert (
        main(
            "eval",
            "--run",
            run_dir,
            "--num-samples",
            "4",
            "--batch-size",
            "4",
            "--retrieval-pool",
            "8",
            "--num-t-draws",
            "1",
            "--steps",
            "2",
            "--no-encoder",
            "--device",
            "cpu",
        )
        == 0
    )
    capsys.readouterr()
    out = tmp_path / "again"
    assert main("export", "--run", run_dir, "--out", out) == 0
    assert main("export", "--run", run_dir, "--out", out, "--force", "--no-ema") == 0
    card = (out / "README.md").read_text()
    assert "Not evaluated" not in card and "t2l retrieval@1 among 8" in card and "(step-0000006.json)" in card
    assert json.loads((out / CONFIG).read_text())["weights"] == "raw" and "the trained weights (no EMA)" in card


def test_the_card_of_a_model_of_the_bundled_corpus_carries_the_wordnet_licence(run_dir, tmp_path):
    model = MMLDLM.from_pretrained(run_dir, device="cpu")
    meta = json.loads((model.run.dataset_dir / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "prepare": {**meta["prepare"], "inputs": ["default"]}}))
    model.run.dataset_dir = tmp_path
    card = model_card(model.run, run_dir)
    assert "license: other\nlicense_name: wordnet-3.0" in card and "WordNet 3.0 Copyright 2006" in card
    assert "from the corpus bundled with mmldlm" in card


def test_the_card_reports_writing_beside_its_references_and_leaves_out_what_was_not_measured():
    report = {
        "l2t": {"bleu": 4.56, "repetition": 0.031},
        "nearest_training_text": {"bleu": 10.57},
        "joint": {"consistency": 0.556, "ngram_perplexity": 158.7},
        "references": {"other_sentence_bleu": 0.51, "real_repetition": 0.0, "real_ngram_perplexity": 306.3},
    }
    rows = {name: (value, reference) for name, value, reference in writing_rows(report)}
    assert rows["l2t BLEU"] == ("4.6", "another sentence 0.5; the training text with the nearest latent 10.6")
    assert rows["l2t repetition (rep-2)"] == ("0.031", "real text 0.000")
    assert rows["joint: text-latent consistency"] == ("0.556", "real pairs 1.000")
    assert rows["joint: word 3-gram perplexity"] == ("159", "real text 306")
    # A decoder that keeps the best of several candidates by consistency: the figure says so, and the
    # consistency of its plain samples stands beside it.
    report["joint"] = {"consistency": 0.688, "selected_on": {"consistency": "max over 16 candidates"}}
    report["joint_without_selection"] = {"consistency": 0.41, "consistency_interval": [0.38, 0.44]}
    rows = {name: (value, reference) for name, value, reference in writing_rows(report)}
    assert rows["joint: text-latent consistency (selected on: max over 16 candidates)"][0] == "0.688"
    assert rows["joint: consistency without selection (best of 1)"][0] == "0.410 [0.380, 0.440]"
    # A report taken with --no-writing has none of them, and the card says nothing it did not measure.
    assert writing_rows({"l2t": {"word_f1": 0.3}}) == []


def test_export_replaces_only_an_export_and_that_only_with_force(run_dir, exported, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    for flags in ([], ["--force"]):
        assert main("export", "--run", run_dir, "--out", tmp_path, *flags) == 2
        assert capsys.readouterr().err == (
            f"mmldlm export: refusing to replace {tmp_path}: is not an exported model (config.json) and it "
            f"holds keep.txt (1 file) that mmldlm did not write; choose another --out or remove it yourself\n"
        )
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    assert main("export", "--run", run_dir, "--out", copy) == 2
    assert f"--out {copy}: holds an exported model; choose another --out or pass --force" in capsys.readouterr().err
    (copy / "notes.md").write_text("mine")
    assert main("export", "--run", run_dir, "--out", copy, "--force") == 2
    assert "it holds notes.md (1 file) that mmldlm did not write" in capsys.readouterr().err
    assert (copy / "notes.md").is_file()
    # The reports that `mmldlm eval` once wrote into an exported folder are its own: --force replaces them.
    (copy / "notes.md").unlink()
    (copy / "eval").mkdir()
    for name in ("step-0000006.json", "step-0000006.md"):
        (copy / "eval" / name).write_text("{}")
    assert main("export", "--run", run_dir, "--out", copy, "--force") == 0
    assert not (copy / "eval").exists()
    # Not even --force replaces the model's own folder, or a folder that holds it.
    before = sorted(p.name for p in run_dir.iterdir())
    for out in (run_dir, run_dir.parent, exported):
        source = exported if out == exported else run_dir
        assert main("export", "--run", source, "--out", out, "--force") == 2
        assert "replacing it would delete what is being exported" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_model_saves_into_the_folder_it_was_loaded_from(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    model = MMLDLM.from_pretrained(copy, device="cpu")
    model.save_pretrained(copy)
    again = MMLDLM.from_pretrained(copy, device="cpu")
    assert torch.equal(again.encode(["blue"], seed=1, **FAST), model.encode(["blue"], seed=1, **FAST))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_and_a_saved_copy_have_the_permissions_the_umask_gives(run_dir, exported, tmp_path, umask):
    before = os.umask(umask)
    try:
        assert main("export", "--run", run_dir, "--out", tmp_path / "model") == 0
        MMLDLM.from_pretrained(exported, device="cpu").save_pretrained(tmp_path / "copy")
    finally:
        os.umask(before)
    for folder in (tmp_path / "model", tmp_path / "copy"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert modes == dict.fromkeys(modes, 0o666 & ~umask) and WEIGHTS in modes


def test_exported_model_samples_what_the_run_samples(run_dir, exported, tmp_path, capsys):
    ours, theirs = MMLDLM.from_pretrained(run_dir, device="cpu"), MMLDLM.from_pretrained(exported, device="cpu")
    assert theirs.run.dataset_dir is None and theirs.run.weights == ours.run.weights == "ema"
    texts = ["a small dog that barks", "to run fast", "blue"]
    z = ours.encode(texts, seed=1, **FAST)
    assert z.shape == (3, 1, 384) and torch.equal(z, theirs.encode(texts, seed=1, **FAST))
    assert not torch.equal(z, ours.encode(texts, seed=2, **FAST))
    decoded = ours.decode(z, seed=3, temperature=0.7, **FAST)
    assert len(decoded) == 3 and decoded == theirs.decode(z, seed=3, temperature=0.7, **FAST)
    with pytest.raises(DataError, match="lengths: 2 given for 3 samples"):
        ours.decode(z, lengths=[4, 5], **FAST)
    generated, latents = ours.generate(3, seed=4, **FAST)
    again, same = theirs.generate(3, seed=4, **FAST)
    assert generated == again and torch.equal(latents, same) and latents.shape == (3, 1, 384)
    embedded = theirs.embed(texts)
    assert embedded.shape == (3, 1, 384) and torch.allclose(embedded.norm(dim=-1), torch.ones(3, 1), atol=1e-4)

    # `mmldlm sample` takes either folder and writes the same lines.
    for source in (run_dir, exported):
        assert (
            main(
                "sample",
                "--run",
                source,
                "--mode",
                "joint",
                "--num",
                "3",
                "--steps",
                "3",
                "--seed",
                "5",
                "--device",
                "cpu",
                "--out",
                tmp_path / f"{source.name}.jsonl",
            )
            == 0
        )
    assert (tmp_path / "run.jsonl").read_text() == (tmp_path / "model.jsonl").read_text()
    capsys.readouterr()


def test_validation_data_of_an_exported_model_comes_from_data_and_its_report_goes_elsewhere(
    run_dir, exported, tmp_path, tmp_path_factory, capsys, monkeypatch
):
    assert main("eval", "--run", exported, "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "carries no validation data; give --data PATH" in err
    assert main("sample", "--run", exported, "--mode", "l2t", "--device", "cpu") == 2
    assert "give --data PATH" in capsys.readouterr().err

    data = prepared(tmp_path_factory)  # the run's own dataset
    for source, name in ((run_dir, "run"), (exported, "export")):
        extra = ["--data", data] if source == exported else []
        assert (
            main(
                "sample",
                "--run",
                source,
                "--mode",
                "l2t",
                "--num",
                "2",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--out",
                tmp_path / f"{name}.jsonl",
                *extra,
            )
            == 0
        )
    assert (tmp_path / "run.jsonl").read_text() == (tmp_path / "export.jsonl").read_text()
    # Other text, prepared with the export's tokenizer and encoder.
    (tmp_path / "new.txt").write_text(
        "".join(
            f"text number {i} about a {w} dog\n" for i, w in enumerate(["small", "big", "red", "old", "quick", "lazy"])
        )
    )
    like = tmp_path / "like"
    assert main("prepare", "--like", exported, "--input", tmp_path / "new.txt", "--out", like, "--quiet") == 0
    before = sorted(p.name for p in exported.iterdir())
    monkeypatch.chdir(tmp_path)  # without --out the report goes to ./eval-<folder name>/, not into the folder
    assert (
        main(
            "eval",
            "--run",
            exported,
            "--data",
            like,
            "--split",
            "all",  # its 6 texts: the default, its validation split, holds 1
            "--num-samples",
            "4",
            "--batch-size",
            "4",
            "--retrieval-pool",
            "8",
            "--num-t-draws",
            "1",
            "--steps",
            "2",
            "--no-encoder",
            "--device",
            "cpu",
        )
        == 0
    )
    out = tmp_path / "eval-model" / "step-0000006-like.json"
    assert "mmldlm eval: wrote eval-model/step-0000006-like.json" in capsys.readouterr().out
    assert sorted(p.name for p in exported.iterdir()) == before
    report = json.loads(out.read_text())
    assert report["step"] == 6 and report["weights"] == "ema" and report["t2l"]["pool_size"] == 6
    assert report["data"] == {"path": str(like.resolve()), "split": "all", "own_dataset": False}
    capsys.readouterr()


def damaged(exported, tmp_path, edit) -> str:
    """The DataError message of loading a copy of the export changed by `edit(folder)`."""
    folder = tmp_path / "damaged"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(exported, folder)
    edit(folder)
    with pytest.raises(DataError) as err:
        MMLDLM.from_pretrained(folder, device="cpu")
    return str(err.value)


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / CONFIG).read_text())
        for key, value in changes.items():
            section, _, name = key.partition("__")
            (config[section] if name else config)[name or section] = value
        (folder / CONFIG).write_text(json.dumps(config))

    return edit


def drop_max_length(folder):
    config = json.loads((folder / CONFIG).read_text())
    del config["max_length"]
    (folder / CONFIG).write_text(json.dumps(config))


def test_a_damaged_export_fails_naming_the_file_and_the_fault(exported, tmp_path):
    assert f"damaged: missing {TOKENIZER}" in damaged(exported, tmp_path, lambda f: (f / TOKENIZER).unlink())
    message = damaged(exported, tmp_path, edit_config(format_version=2))
    assert f"damaged/{CONFIG}: format_version 2, newer than this mmldlm" in message and "upgrade mmldlm" in message
    message = damaged(exported, tmp_path, edit_config(model__hidden_size=32))
    assert f"damaged/{WEIGHTS}: the weights do not match the model config: shape of" in message
    message = damaged(exported, tmp_path, edit_config(model__num_blocks=3))
    assert "missing blocks.2." in message
    truncate = lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:1000])  # noqa: E731
    assert f"damaged/{WEIGHTS}: not a readable safetensors file" in damaged(exported, tmp_path, truncate)
    assert "config key 'model.hidden_sise': unknown key" in damaged(
        exported, tmp_path, edit_config(model__hidden_sise=32)
    )
    assert f"damaged/{CONFIG}: missing keys max_length" in damaged(exported, tmp_path, drop_max_length)


def test_sample_and_eval_on_a_missing_run_or_one_without_checkpoints_say_so_in_one_line(tmp_path, capsys):
    for command in ("sample", "eval"):
        mode = ["--mode", "joint"] if command == "sample" else []
        assert main(command, "--run", tmp_path / "nowhere", *mode, "--device", "cpu") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"mmldlm {command}: {tmp_path / 'nowhere'}: no such directory" in err
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.yaml").write_text("model: tiny\n")
    assert main("sample", "--run", tmp_path / "untrained", "--mode", "joint", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "untrained: no checkpoints, so no trained weights" in err and "mmldlm train" in err


def test_the_api_import_leaves_torch_unloaded_for_the_cli():
    code = "import sys, mmldlm, mmldlm.cli; mmldlm.cli.build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_readme_snippet_runs_on_an_exported_model(exported, tmp_path):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    snippet = readme.split("```python\nfrom mmldlm import MMLDLM\n", 1)[1].split("```", 1)[0]
    snippet = snippet.replace('"exported/default"', repr(str(exported)))
    snippet = snippet.replace('"copy/"', repr(str(tmp_path / "copy")))
    scope = {"MMLDLM": MMLDLM}
    exec(snippet, scope)
    assert scope["z"].shape == (4, 1, 384) and len(scope["texts"]) == 4 and scope["e"].shape == (1, 1, 384)
    copy = json.loads((tmp_path / "copy" / CONFIG).read_text())
    assert copy == json.loads((exported / CONFIG).read_text())
    assert (tmp_path / "copy" / "README.md").read_text() == (exported / "README.md").read_text()


def test_decode_with_the_encoder_in_the_loop_picks_among_the_length_heads_candidates(exported):
    """length_candidates=3: each text has one of the head's three most likely lengths, chosen by the
    real sentence encoder's cosine; with best_of and correction rounds the chosen text is at least as
    close to its latent as the plain text at the head's own length."""
    model = MMLDLM.from_pretrained(exported, device="cpu")
    z = model.embed(["a small dog that barks", "to run fast", "a tall building"])
    candidates = model.run.candidate_lengths(z, 3)
    assert [row[0] for row in candidates] == model.run.predict_lengths(z)
    options = model.options(3, length_candidates=3, best_of=2, correction_rounds=1)
    tokens = model.run.sampler(options).l2t(z, length_masks(candidates), torch.Generator().manual_seed(0))
    lengths = (tokens != model.run.text.pad_token_id).sum(dim=1).tolist()
    assert all(n in row for n, row in zip(lengths, candidates))
    texts = model.decode(z, seed=3, length_candidates=3, best_of=2, correction_rounds=1, **FAST)
    plain = model.decode(z, seed=3, **FAST)
    cosine = lambda texts: torch.nn.functional.cosine_similarity(model.embed(texts).flatten(1), z.flatten(1))  # noqa: E731
    assert len(texts) == 3 and cosine(texts).mean() >= cosine(plain).mean()


def test_latent_first_generation_gives_finite_latents_and_repeats_for_a_seed(exported):
    model = MMLDLM.from_pretrained(exported, device="cpu")
    texts, latents = model.generate(3, lengths=[4, 6, 5], seed=2, joint_order="latent_first", **FAST)
    assert len(texts) == 3 and latents.shape == (3, 1, 384) and torch.isfinite(latents).all()
    assert [len(ids) > 0 for ids in model.run.tokenize(texts)] == [True] * 3
    again, same = model.generate(3, lengths=[4, 6, 5], seed=2, joint_order="latent_first", **FAST)
    assert again == texts and torch.equal(same, latents)


def test_decoding_with_the_encoder_is_refused_in_one_line_for_imported_latents(exported):
    model = MMLDLM.from_pretrained(exported, device="cpu")
    model.run.encoder_normalize = None  # as for a run trained on imported latents: no known encoder
    with pytest.raises(OptionError, match=r"best_of.*got \(2, 0, 1\).*latents were imported"):
        model.run.sampler(model.options(best_of=2))
    assert model.run.sampler(model.options(best_of=1)).reencode is None


def test_the_api_names_its_own_arguments_in_its_errors(exported, monkeypatch, capsys):
    model = MMLDLM.from_pretrained(exported, device="cpu")
    for call, message in (
        (lambda: model.generate(0), "num: got 0; expected an integer >= 1"),
        (lambda: model.generate(2, 0), "lengths: got 0; expected an integer >= 1"),
        (lambda: model.generate(2, [3, 0]), r"lengths: got \[3, 0\]; expected text lengths in tokens, each >= 1"),
        (lambda: model.encode("a dog", batch_size=0), "batch_size: got 0; expected an integer >= 1"),
        (lambda: model.generate(2, steps=0), "sampling option 'steps': got 0; expected an integer >= 1"),
    ):
        with pytest.raises(OptionError, match=f"^{message}$"):
            call()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptionError, match=r"^MMLDLM.from_pretrained\(device=...\): got 'cuda'; expected auto or cpu"):
        MMLDLM.from_pretrained(exported, device="cuda")
    assert main("sample", "--run", exported, "--mode", "joint", "--device", "cuda") == 2
    assert capsys.readouterr().err.startswith("mmldlm sample: --device: got 'cuda'; expected auto or cpu")
    for command in (["sample", "--mode", "joint"], ["eval"]):  # cuda:N is read, as the README lists it
        assert main(*command, "--run", exported, "--device", "cuda:1") == 2
        assert capsys.readouterr().err.startswith(f"mmldlm {command[0]}: --device: got 'cuda:1'; expected auto or cpu")


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory):
    """A run that kept no EMA of its weights (train.ema_decay 0, the default)."""
    return trained_run(tmp_path_factory, [*(o for o in RUN if not o.startswith("train.ema_decay")), "train.steps=2"])


def test_use_ema_true_is_refused_in_one_line_where_no_ema_was_kept(run_dir, raw_run, exported, tmp_path, capsys):
    assert MMLDLM.from_pretrained(run_dir, use_ema=True, device="cpu").run.weights == "ema"
    assert MMLDLM.from_pretrained(raw_run, device="cpu").run.weights == "raw"  # by default: the EMA where kept
    with pytest.raises(OptionError) as err:
        MMLDLM.from_pretrained(raw_run, use_ema=True, device="cpu")
    message = str(err.value)
    assert message.startswith("use_ema: got True; expected None or False: ") and "\n" not in message
    assert f"{raw_run / 'checkpoints' / 'step-0000002'} holds no EMA of the weights" in message
    # An exported folder holds one set of weights: asking for the other is refused, naming the one it holds.
    with pytest.raises(DataError, match="its ema weights"):
        MMLDLM.from_pretrained(exported, use_ema=False, device="cpu")
    assert main("export", "--run", raw_run, "--out", tmp_path / "raw") == 0
    assert "raw weights of step 2" in capsys.readouterr().out
    with pytest.raises(DataError, match="its raw weights"):
        MMLDLM.from_pretrained(tmp_path / "raw", use_ema=True, device="cpu")


def test_a_runs_config_records_the_values_it_trained_with_and_model_info_reads_it(run_dir, exported, capsys):
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    vocab_size = json.loads((exported / CONFIG).read_text())["vocab_size"]
    assert (config["model"]["vocab_size"], config["data"]["max_length"]) == (vocab_size, 64)  # not null
    outputs = []
    for target in (run_dir, run_dir / "config.yaml", exported):
        assert main("model-info", target) == 0
        outputs.append(capsys.readouterr().out.split("\n", 1))
    assert all(f"vocab_size {vocab_size}\n" in head + "\n" for head, _ in outputs)
    assert outputs[0][1] == outputs[1][1] == outputs[2][1]  # the same counts and FLOPs
    assert main("model-info", run_dir / "checkpoints") == 2
    assert "checkpoints: a directory without config.yaml; expected a model preset" in capsys.readouterr().err


def test_a_run_on_the_bundled_corpus_finds_the_dataset_it_trained_on_whatever_the_cache_then(
    run_dir, tmp_path, monkeypatch
):
    """A checkpoint records the absolute directory of its dataset. A run with data.path null (the
    bundled corpus, prepared into the cache) loads from there when the cache this environment names
    is another (MMLDLM_CACHE unset since training, say), instead of preparing the corpus again; where
    the recorded directory is gone, it prepares as before."""
    import dataclasses

    from mmldlm.config import load_config as real_load_config
    from mmldlm.runs import trained

    checkpoint = run_dir / "checkpoints" / "step-0000006"
    recorded = Path(json.loads((checkpoint / "meta.json").read_text())["dataset"])
    assert recorded.is_absolute() and (recorded / "meta.json").is_file()

    def as_if_bundled(path):
        cfg = real_load_config(path)
        data = dataclasses.replace(cfg.data, path=None, cache_dir=str(tmp_path / "another-cache"))
        return dataclasses.replace(cfg, data=data)

    prepared_again = []
    monkeypatch.setattr(trained, "load_config", as_if_bundled)
    monkeypatch.setattr(trained, "dataset_path", lambda data, log=None: prepared_again.append(data) or recorded)
    assert trained.load_run(run_dir).dataset_dir == recorded and prepared_again == []
    cfg = as_if_bundled(run_dir / "config.yaml")
    assert trained.recorded_dataset(checkpoint, cfg) == recorded
    assert trained.recorded_dataset(checkpoint, real_load_config(run_dir / "config.yaml")) is None  # data.path set
    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    meta = json.loads((moved / "meta.json").read_text())
    (moved / "meta.json").write_text(json.dumps({**meta, "dataset": str(tmp_path / "gone")}))
    assert trained.recorded_dataset(moved, cfg) is None  # gone: the caller prepares, as before
