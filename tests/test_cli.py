"""The `mmldlm` command line itself: the help of the top level and of every command prints, and a
command's overrides are read wherever they stand among its options."""

import ast
import os
import signal
import time
from pathlib import Path

import pytest

from mmldlm.cli import COMMANDS, main, parse_arguments


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)], ids=" ".join)
def test_the_help_of_the_top_level_and_of_every_command_prints(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mmldlm") and "options:" in out
    if argv == ["--help"]:
        assert all(name in out for name in COMMANDS) and "paired 95% interval" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "default", "--init-from", "runs/default", "train.steps=5", "optim.lr=1e-4"],
        ["train", "train.steps=5", "--init-from", "runs/default", "optim.lr=1e-4"],
        ["train", "train.steps=5", "optim.lr=1e-4", "--init-from", "runs/default", "--config", "default"],
    ],
)
def test_train_reads_overrides_before_between_and_after_its_options(argv):
    args = parse_arguments(argv)
    assert args.overrides == ["train.steps=5", "optim.lr=1e-4"]
    assert (args.config, args.init_from, args.command) == ("default", "runs/default", "train")


def test_other_commands_read_positionals_after_options_too():
    check = parse_arguments(["--debug", "check", "--nproc-per-node", "8", "default", "model=base", "--strict"])
    assert (check.config, check.overrides, check.nproc_per_node, check.strict, check.debug) == (
        "default",
        ["model=base"],
        8,
        True,
        True,
    )
    compare = parse_arguments(["compare", "--num-samples", "16", "runs/a", "--seed", "3", "runs/b"])
    assert (compare.runs, compare.num_samples, compare.seed) == (["runs/a", "runs/b"], 16, 3)
    arms = parse_arguments(["compare", "--a", "r1", "r2", "--b", "r3", "r4"])
    assert (arms.arm_a, arms.arm_b, arms.runs) == (["r1", "r2"], ["r3", "r4"], [])


def test_an_unknown_option_is_refused_with_the_commands_own_usage(capsys):
    with pytest.raises(SystemExit) as done:
        parse_arguments(["train", "--init-from", "runs/default", "--no-such-option"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mmldlm train") and "unrecognized arguments: --no-such-option" in err


def test_every_function_of_the_command_modules_reads_in_one_screen():
    # A command's parser grows by options: past about 60 lines its groups get functions of their own
    # (bench: what is compared, the synthetic data, how each row is measured).
    long = []
    for path in sorted((Path(__file__).resolve().parent.parent / "mmldlm" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_a_signal_during_a_command_ends_it_in_one_line_with_128_plus_the_signals_number(monkeypatch, capsys):
    def signalled(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler ends the sleep at once

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("mmldlm.commands.model_info.run", signalled)
    assert main(["model-info", "tiny"]) == 128 + signal.SIGTERM
    assert (
        capsys.readouterr().err
        == "mmldlm model-info: stopped by SIGTERM; nothing was written; the same command starts over\n"
    )
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handlers go with it
