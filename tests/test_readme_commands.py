"""Every command in the README (its fenced bash blocks, and the `mmldlm ...` commands its prose
quotes) runs as written, on a fresh tiny run, so that the README cannot drift from the code. COMMANDS
holds each one with the tiny sizes the slow test appends (the README's own words come first, so its
options and their placement are what is parsed), or the test that covers it where it cannot run here;
the fast test keeps that list equal to the README's. The Python snippet is run by
tests/test_pretrained.py."""

import gzip
import json
import re
import shlex
from pathlib import Path

import pytest
from data_support import corpus_texts, prepared

from mmldlm import cli

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = ["model=tiny", "model.hidden_size=64", "model.num_blocks=2", "model.timestep_embed_dim=32"]
TINY_RUN = ["train.steps=2", "data.num_workers=0", "eval.every=0", "checkpoint.every=1000", "data.path={data}"]
TINY_BATCH = ["train.micro_batch_size=8", "train.global_batch_size=8"]
TINY_SAMPLING = ["--steps", "2", "--best-of", "1"]
TINY_EVAL = [*TINY_SAMPLING, "--num-samples", "4", "--retrieval-pool", "8", "--num-t-draws", "1", "--no-writing"]

# README command -> the arguments appended to run it tiny here, or (a string) where it is covered instead.
COMMANDS = {
    "make train": [*TINY_MODEL, *TINY_RUN, *TINY_BATCH],  # to the Makefile's train command; eval: TINY_EVAL
    "make test": "the test suite itself",
    "mmldlm prepare --like runs/default --input my_texts.txt --out data/prepared/my-texts": [],
    "mmldlm train --config runs/default/config.yaml data.path=data/prepared/my-texts "
    "train.run_dir=runs/my-texts train.steps=500 optim.lr=1e-4 --init-from runs/default": ["train.steps=2"],
    "mmldlm eval --run runs/my-texts": TINY_EVAL,
    "NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 scripts/launch.sh "
    "--config configs/default.yaml model=base train.run_dir=/shared/runs/base": (
        "tests/test_launcher.py starts it on two simulated nodes (these variables name a real cluster)"
    ),
    'mmldlm sample --run runs/default --mode l2t --text "a small dog that barks"': TINY_SAMPLING,
    "mmldlm sample --run runs/default --mode joint --num 4 --out pairs.jsonl --latents-out z.npy": TINY_SAMPLING,
    "mmldlm eval --run runs/default --num-samples 256 --out report.json": TINY_EVAL,
    "mmldlm compare runs/default runs/default-seed1 --num-samples 256 --out compare.json": TINY_EVAL,
    "mmldlm compare --a runs/default runs/default-seed1 --b runs/lr5e-4 runs/lr5e-4-seed1": TINY_EVAL,
    # The machine it audits for: 8 GPUs of 80 GiB (this one's memory would refuse the base model).
    "mmldlm check configs/default.yaml model=base --nproc-per-node 8 --fix fixed.yaml": ["--device-memory-gib", "80"],
    "mmldlm monitor runs/default --report health.json --plot curves.png": [],
    "mmldlm model-info runs/default": [],
    # The commands the prose quotes, in the README's order.
    "mmldlm export --run runs/default --out exported/default": [],
    "mmldlm prepare --input corpus.jsonl.gz --text-field text --out data/prepared/mine": [],
    "mmldlm train --config optimized model=base": [*TINY_MODEL, *TINY_RUN, *TINY_BATCH, "train.run_dir=runs/base"],
}


def readme_commands() -> list[str]:
    """The commands of the README: those of its ```bash blocks (a continued line joined, comments left
    out), then each `mmldlm ...` its prose quotes with arguments (a bare `mmldlm sample` names a command)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            command = re.split(r"\s+#", line.strip(), maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [span for span in re.findall(r"`(mmldlm [^`]+)`", prose) if len(span.split()) > 2]
    return commands


def makefile_train_commands() -> list[list[str]]:
    """The recipe of `make train`: the argv after `$(PY) -m mmldlm.cli` of each line."""
    recipe = (REPO / "Makefile").read_text(encoding="utf-8").split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    return [shlex.split(line.split("-m mmldlm.cli", 1)[1]) for line in recipe.splitlines() if "-m mmldlm.cli" in line]


def test_every_readme_command_is_run_by_the_slow_test_or_covered_by_a_named_one():
    assert readme_commands() == list(COMMANDS)
    assert [argv[0] for argv in makefile_train_commands()] == ["train", "eval"]


def _run(command: str, extra: list[str], data: Path) -> None:
    """`command` as the README writes it, with `extra` appended, in the current directory (each command
    the slow test runs is an `mmldlm` one; the others name the test that covers them)."""
    argv = [*shlex.split(command), *(arg.format(data=data) for arg in extra)]
    assert argv[0] == "mmldlm", f"{command}: run only `mmldlm` commands here, or name the test that covers it"
    assert cli.main(argv[1:]) == 0, command


# The runs `compare` names beside runs/default: another seed, and two seeds of another learning rate.
OTHER_RUNS = {
    "default-seed1": ["train.seed=1"],
    "lr5e-4": ["optim.lr=5e-4"],
    "lr5e-4-seed1": ["optim.lr=5e-4", "train.seed=1"],
}


def _fresh_runs(data: Path) -> None:
    """`make train`'s two commands, tiny, into runs/default; the other runs compare names beside it."""
    train, evaluate = makefile_train_commands()
    tiny = [arg.format(data=data) for arg in COMMANDS["make train"]]
    assert cli.main([*train, *tiny]) == 0
    assert cli.main([*evaluate, *TINY_EVAL]) == 0
    for name, changes in OTHER_RUNS.items():
        assert cli.main([*train, *tiny, f"train.run_dir=runs/{name}", *changes]) == 0


def _inputs() -> None:
    """What the README's commands read, as in the repository root: configs/, a 50-sentence corpus and a
    JSONL corpus."""
    Path("configs").symlink_to(REPO / "configs")
    texts = corpus_texts()
    Path("my_texts.txt").write_text("\n".join(texts[:50]) + "\n", encoding="utf-8")
    with gzip.open("corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts[50:120])


@pytest.mark.slow  # every command of the README on a fresh tiny run: minutes, with spawned and torchrun workers
def test_every_readme_command_runs_as_written_on_a_fresh_tiny_run(tmp_path_factory, tmp_path, monkeypatch):
    data = prepared(tmp_path_factory)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MMLDLM_CACHE", str(tmp_path / "cache"))
    _inputs()
    _fresh_runs(data)
    for command, extra in COMMANDS.items():
        if command.startswith("make "):
            continue  # make test: this suite; make train: _fresh_runs
        if isinstance(extra, str):
            continue  # covered by the test the entry names
        _run(command, extra, data)
    assert (tmp_path / "runs" / "my-texts" / "checkpoints").is_dir()
    assert (tmp_path / "exported" / "default" / "model.safetensors").is_file()
    assert (tmp_path / "health.json").is_file() and (tmp_path / "curves.png").is_file()
