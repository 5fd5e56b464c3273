"""Progress on stderr: bars with an ETA for eval, sample and the API's batch calls where stderr is a
terminal, nothing when it is not or under --quiet; and every subcommand's --help naming its defaults."""

import argparse
import io
import sys

import pytest
import torch
from data_support import trained_run

from mmldlm import MMLDLM, cli, progress
from mmldlm.errors import OptionError

RUN = [
    "model=tiny",
    "model.hidden_size=64",
    "model.num_blocks=2",
    "model.timestep_embed_dim=32",
    "train.steps=2",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "logging.progress_bar=false",
    "data.num_workers=0",
    "eval.every=0",
]


class Terminal(io.StringIO):
    """What stderr is on a terminal, as far as deciding to draw bars goes."""

    def isatty(self) -> bool:
        return True


def main(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help of one option as `--help` prints it, on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_every_option_with_a_default_names_it_in_help():
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    unnamed = []
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
                continue  # flags are off unless given; None: worked out at run time, as the text says
            text = expanded_help(sub, action)
            value = action.default
            shown = {str(value), f"{value:g}" if isinstance(value, float) else str(value)}
            if "default" not in text or not any(v in text for v in shown):
                unnamed.append(f"{name} {action.option_strings[0]}")
    assert not unnamed
    (evaluate,) = [a for a in commands.choices["eval"]._actions if "--num-samples" in a.option_strings]
    assert expanded_help(commands.choices["eval"], evaluate).endswith("(default: 256)")


def test_bars_show_on_a_terminal_unless_turned_off():
    assert progress.shows("auto", Terminal())
    assert not progress.shows("auto", io.StringIO())  # a pipe or a file
    assert not progress.shows(False, Terminal()) and progress.shows(True, io.StringIO())
    with pytest.raises(OptionError, match="progress: got 'yes'; expected True, False or \"auto\""):
        progress.shows("yes")


def test_a_sampler_call_moves_the_bar_step_by_step_and_ends_on_its_rows(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress.reporting("auto"), progress.stage("l2t", total=8) as bar:
        with progress.share(8, num_steps=4):
            progress.step()
            progress.step()
            assert bar.n == 4
        assert bar.n == 8
        with progress.share(0, num_steps=2):  # more steps than planned never go past the rows
            progress.step()
        assert bar.n == 8
    with progress.reporting(False), progress.stage("l2t", total=8) as bar:
        assert bar is None


def test_best_of_decoding_draws_a_bar_on_a_terminal_only(run_dir, monkeypatch):
    model = MMLDLM.from_pretrained(run_dir, device="cpu")
    latents = torch.from_numpy(model.run.val[0][2][None].astype("float32"))
    for stream, progress_option, drawn in (
        (Terminal(), "auto", True),
        (io.StringIO(), "auto", False),
        (Terminal(), False, False),
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        model.decode(latents, lengths=4, steps=3, best_of=2, progress=progress_option)
        assert ("l2t: 100%" in stream.getvalue()) == drawn
        assert stream.getvalue() == "" or drawn
    # Within the one batch the bar moves at each of the 3 reverse steps, and ends on its one sample.
    moves = []
    original = progress.advance
    monkeypatch.setattr(progress, "advance", lambda amount: moves.append(amount) or original(amount))
    monkeypatch.setattr(sys, "stderr", Terminal())
    model.decode(latents, lengths=4, steps=3, best_of=2, remask_rounds=1)
    assert len([m for m in moves if m > 0]) >= 3 and sum(moves) == pytest.approx(1.0)


def test_eval_names_each_stage_from_its_first_line_and_is_silent_under_quiet(run_dir, tmp_path, monkeypatch):
    args = ["eval", "--run", run_dir, "--num-samples", "2", "--steps", "2", "--device", "cpu"]
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    assert main(*args, "--out", tmp_path / "a.json") == 0
    shown = stream.getvalue()
    assert shown.startswith(f"mmldlm eval: loading {run_dir}\n")
    stages = ["ELBO: 100%", "l2t: 100%", "t2l: 100%", "joint: 100%", "references:"]
    assert all(stage in shown for stage in stages)
    assert sorted(stages, key=shown.index) == stages
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(*args, "--out", tmp_path / "b.json", "--quiet") == 0
    assert "loading" not in quiet.getvalue() and "100%" not in quiet.getvalue()


def test_sample_shows_its_bar_on_a_terminal_and_nothing_under_quiet(run_dir, tmp_path, monkeypatch):
    args = ["sample", "--run", run_dir, "--mode", "joint", "--num", "2", "--steps", "2", "--device", "cpu"]
    for extra, drawn in (([], True), (["--quiet"], False)):
        stream = Terminal()
        monkeypatch.setattr(sys, "stderr", stream)
        assert main(*args, "--out", tmp_path / "out.jsonl", *extra) == 0
        assert stream.getvalue().startswith(f"mmldlm sample: loading {run_dir}\n") == drawn
        assert ("joint: 100%" in stream.getvalue()) == drawn
