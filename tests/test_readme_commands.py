"""Every command in the README (its fenced bash blocks, and the `mmldlm ...` commands its prose
quotes) runs as written, on a fresh tiny run, so that the README cannot drift from the code. COMMANDS
holds each one with the tiny sizes the slow test appends (the README's own words come first, so its
options and their placement are what is parsed), or the test that covers it where it cannot run here;
the fast test keeps that list equal to the README's. The Python snippet is run by
tests/test_pretrained.py."""

import re
import shlex
from pathlib import Path

import pytest
from data_support import prepared
from docs_support import (
    TINY_BATCH,
    TINY_EVAL,
    TINY_MODEL,
    TINY_RUN,
    TINY_SAMPLING,
    fenced_blocks,
    makefile_train_commands,
    shell_commands,
    train_fresh_runs,
    write_user_inputs,
)

from mmldlm import cli

REPO = Path(__file__).resolve().parent.parent
TINY = [*TINY_MODEL, *TINY_RUN, *TINY_BATCH]
TINY_DATA = ["data.path={data}"]  # the session's small prepared corpus

# README command -> the arguments appended to run it tiny here, or (a string) where it is covered instead.
COMMANDS = {
    # to the Makefile's train command (its eval: TINY_EVAL)
    "make train": [*TINY, *TINY_DATA],
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
    "mmldlm train --config optimized model=base": [*TINY, *TINY_DATA, "train.run_dir=runs/base"],
}


def readme_commands() -> list[str]:
    """The commands of the README: those of its ```bash blocks (a continued line joined, comments left
    out), then each `mmldlm ...` its prose quotes with arguments (a bare `mmldlm sample` names a command)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [cmd for block in fenced_blocks(text) if block.lang == "bash" for cmd in shell_commands(block.lines)]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [span for span in re.findall(r"`(mmldlm [^`]+)`", prose) if len(span.split()) > 2]
    return commands


def test_every_readme_command_is_run_by_the_slow_test_or_covered_by_a_named_one():
    assert readme_commands() == list(COMMANDS)
    assert [argv[0] for argv in makefile_train_commands()] == ["train", "eval"]


def _run(command: str, extra: list[str], data: Path) -> None:
    """`command` as the README writes it, with `extra` appended, in the current directory (each command
    the slow test runs is an `mmldlm` one; the others name the test that covers them)."""
    argv = [*shlex.split(command), *(arg.format(data=data) for arg in extra)]
    assert argv[0] == "mmldlm", f"{command}: run only `mmldlm` commands here, or name the test that covers it"
    assert cli.main(argv[1:]) == 0, command


@pytest.mark.slow  # every command of the README on a fresh tiny run: minutes, with spawned and torchrun workers
def test_every_readme_command_runs_as_written_on_a_fresh_tiny_run(tmp_path_factory, tmp_path, monkeypatch):
    data = prepared(tmp_path_factory)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MMLDLM_CACHE", str(tmp_path / "cache"))
    Path("configs").symlink_to(REPO / "configs")
    write_user_inputs(tmp_path)
    train_fresh_runs([arg.format(data=data) for arg in COMMANDS["make train"]], TINY_EVAL)
    for command, extra in COMMANDS.items():
        if command.startswith("make "):
            continue  # make test: this suite; make train: train_fresh_runs
        if isinstance(extra, str):
            continue  # covered by the test the entry names
        _run(command, extra, data)
    assert (tmp_path / "runs" / "my-texts" / "checkpoints").is_dir()
    assert (tmp_path / "exported" / "default" / "model.safetensors").is_file()
    assert (tmp_path / "health.json").is_file() and (tmp_path / "curves.png").is_file()
