"""A new run from another run's weights (train.init_from, `mmldlm train --init-from`): from a run
directory, a checkpoint and an exported folder; what is refused; and `--resume` of what it cannot
continue pointing to it."""

import contextlib
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from data_support import prepared, trained_run

from mmldlm import cli
from mmldlm.config import ConfigError, load_config
from mmldlm.data.errors import DataError
from mmldlm.runs.checkpoints import find_latest, read_weights
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import build_trainer

SOURCE = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.steps=3",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "logging.progress_bar=false",
    "schedule.warmup_steps=1",
    "data.num_workers=0",
    "eval.every=0",
    "train.ema_decay=0.9",
]
NEW_TEXTS = [f"note {i}: the {w} cat sat by door number {i % 7}" for i, w in enumerate(["grey", "young", "calm"] * 20)]


def main(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return trained_run(tmp_path_factory, SOURCE)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model"
    assert main("export", "--run", source, "--out", out) == 0
    return out


@pytest.fixture(scope="module")
def new_data(source, tmp_path_factory):
    """Other text, prepared with the source's tokenizer and encoder (`prepare --like`)."""
    root = tmp_path_factory.mktemp("new-data")
    (root / "new.txt").write_text("\n".join(NEW_TEXTS) + "\n", encoding="utf-8")
    assert main("prepare", "--like", source, "--input", root / "new.txt", "--out", root / "data", "--quiet") == 0
    return root / "data"


def fine_tune_config(run_dir, data, init_from, *overrides):
    return load_config(
        None,
        [*SOURCE, "train.steps=2", f"data.path={data}", f"train.run_dir={run_dir}", f"train.init_from={init_from}"]
        + list(overrides),
    )


def started(cfg):
    trainer = build_trainer(cfg, DistInfo())
    trainer.resume(None)
    return trainer


@pytest.mark.parametrize("kind", ["run", "checkpoint", "export"])
def test_a_new_run_starts_from_the_sources_ema_weights_with_a_fresh_optimizer_at_step_0(
    source, exported, new_data, tmp_path, kind
):
    checkpoint = find_latest(source / "checkpoints")
    init_from = {"run": source, "checkpoint": checkpoint, "export": exported}[kind]
    trainer = started(fine_tune_config(tmp_path / "new", new_data, init_from))
    expected = read_weights(checkpoint, "ema")
    weights = trainer.raw_model.state_dict()
    assert expected.keys() == weights.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    raw = read_weights(checkpoint, "model")
    assert any(not torch.equal(expected[k], raw[k]) for k in expected)  # the EMA, not the trained weights
    ema = trainer.ema.module.state_dict()
    assert all(torch.equal(ema[k], expected[k]) for k in expected)
    assert trainer.ema.num_averaged == 0
    assert trainer.step == 0 and trainer.optimizer.state == {} and trainer.loader.samples == 0
    assert trainer.cfg.train.init_from == str((exported if kind == "export" else checkpoint).resolve())


def test_init_weights_raw_takes_the_trained_weights_and_an_export_refuses_it(source, exported, new_data, tmp_path):
    checkpoint = find_latest(source / "checkpoints")
    trainer = started(fine_tune_config(tmp_path / "raw", new_data, source, "train.init_weights=raw"))
    expected = read_weights(checkpoint, "model")
    assert all(torch.equal(trainer.raw_model.state_dict()[k], expected[k]) for k in expected)
    with pytest.raises(DataError, match="holds only the EMA of its weights; train.init_weights=raw needs the run"):
        started(fine_tune_config(tmp_path / "export-raw", new_data, exported, "train.init_weights=raw"))


def test_train_init_from_writes_a_new_run_whose_config_and_model_card_name_the_source(
    source, new_data, tmp_path, capsys
):
    out = tmp_path / "fine-tuned"
    overrides = ["train.steps=2", f"data.path={new_data}", f"train.run_dir={out}"]
    assert main("train", "--config", source / "config.yaml", *overrides, "--init-from", source) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    origin = str(find_latest(source / "checkpoints").resolve())
    assert config["train"]["init_from"] == origin
    assert find_latest(out / "checkpoints").name == "step-0000002"
    assert "initialized from" in capsys.readouterr().err
    assert main("export", "--run", out, "--out", tmp_path / "export") == 0
    assert f"Fine-tuned: started from the weights of `{origin}`." in (tmp_path / "export" / "README.md").read_text()


def test_a_model_of_another_shape_is_refused_naming_the_tensor_and_the_config_key(source, new_data, tmp_path):
    cfg = fine_tune_config(tmp_path / "wide", new_data, source, "model.hidden_size=32")
    with pytest.raises(ConfigError) as err:
        started(cfg)
    message = str(err.value)
    assert re.search(
        r"config key 'train.init_from': .*shape of \S+ \[\d+, 64\] \(the config makes \[\d+, 32\]\)", message
    )
    assert "model.hidden_size: 64 in the source, 32 here" in message


def test_data_of_another_tokenizer_is_refused_pointing_to_prepare_like(source, tmp_path, tmp_path_factory):
    other = prepared(tmp_path_factory, "other-tokenizer", vocab_size=300)
    with pytest.raises(DataError, match=r"train.init_from .*not the run's tokenizer.*mmldlm prepare --like"):
        started(fine_tune_config(tmp_path / "other", other, source))


def test_resume_of_an_export_or_onto_other_data_says_to_use_init_from(source, exported, new_data, tmp_path, capsys):
    overrides = ["--config", source / "config.yaml", f"data.path={new_data}", f"train.run_dir={tmp_path / 'new'}"]
    assert main("train", *overrides, "--resume", exported) == 2
    (line,) = refusals(capsys)
    assert "meta.json is missing" in line and line.endswith(f"use --init-from {exported}")
    checkpoint = find_latest(source / "checkpoints")
    assert main("train", *overrides, "--resume", checkpoint) == 2
    (line,) = refusals(capsys)
    assert "loader state: saved with num_samples" in line
    assert line.endswith(f"start a new run with --init-from {checkpoint}")
    assert not (tmp_path / "new").exists()  # refused before the run started: no empty run directory left
    (tmp_path / "mine").mkdir()  # a folder the user made is theirs: kept, empty as it was
    assert main("train", *overrides, f"train.run_dir={tmp_path / 'mine'}", "--resume", checkpoint) == 2
    assert refusals(capsys) and list((tmp_path / "mine").iterdir()) == []


def test_the_readme_fine_tuning_example_runs_on_50_sentences_under_a_config_of_a_larger_batch(
    tmp_path_factory, tmp_path, capsys
):
    """The README's commands as written, on 49 training texts, from a source that kept no EMA and trained
    with a global batch of 64: the batch is fitted to the data and said once, and nothing warns."""
    big_batch = [o for o in SOURCE if not o.startswith(("train.ema_decay", "train.micro", "train.global"))]
    source = trained_run(
        tmp_path_factory, [*big_batch, "train.steps=1", "train.micro_batch_size=64", "train.global_batch_size=64"]
    )
    (tmp_path / "my_texts.txt").write_text("\n".join(NEW_TEXTS[:50]) + "\n", encoding="utf-8")
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in readme.split("```bash\n")[1:]]
    (block,) = [b for b in blocks if "--init-from" in b]  # the fine-tuning example of "Your own data"
    commands = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines()]
    assert [c[:2] for c in commands] == [["mmldlm", "prepare"], ["mmldlm", "train"], ["mmldlm", "eval"]]
    names = {"runs/default": source, "train.steps=500": "train.steps=2"}
    local = [[str(names.get(a, a)).replace("runs/default/", f"{source}/") for a in c[1:]] for c in commands[:2]]
    with contextlib.chdir(tmp_path):
        assert main(*local[0], "--quiet") == 0
        capsys.readouterr()
        assert main(*local[1]) == 0
    log = capsys.readouterr().err.splitlines()
    assert [line for line in log if "global batch" in line] == [
        "INFO mmldlm.training.run: batch: the training split holds 49 samples, fewer than a global batch of 64; "
        "training with train.global_batch_size=49 train.micro_batch_size=49 (set both to choose)"
    ]
    assert not [line for line in log if line.startswith(("WARNING", "ERROR"))]
    config = yaml.safe_load((tmp_path / "runs" / "my-texts" / "config.yaml").read_text())
    assert (config["train"]["global_batch_size"], config["train"]["micro_batch_size"]) == (49, 49)
    assert find_latest(tmp_path / "runs" / "my-texts" / "checkpoints").name == "step-0000002"


def refusals(capsys) -> list[str]:
    """The command's own lines on stderr (the log lines aside)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("mmldlm train:")]
