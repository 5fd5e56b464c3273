"""Every command speaks of a bad option in one shape, `mmldlm CMD: <key>: got <value>; expected <what is
allowed>`, on one line of stderr with exit status 2 and no traceback (unless --debug), before any work
starts. The refusals of `sample`, `eval` and `monitor` on real runs are in test_sample_eval_cli.py and
test_monitor.py."""

import pytest

from mmldlm.cli import main
from mmldlm.config import ConfigError, load_config
from mmldlm.errors import OptionError

REFUSED = {
    "compare-one-run": (
        ["compare", "A"],
        "got 1 run (A); expected two, A and B, or --a RUN [RUN ...] and --b RUN [RUN ...]",
    ),
    "compare-num-samples": (
        ["compare", "A", "B", "--num-samples", "0"],
        "--num-samples: got 0; expected an integer >= 1",
    ),
    "prepare-val-fraction": (
        ["prepare", "--input", "default", "--out", "OUT", "--val-fraction", "1.5"],
        "--val-fraction: got 1.5; expected a number in [0, 1)",
    ),
    "prepare-vocab-size": (
        ["prepare", "--input", "default", "--out", "OUT", "--vocab-size", "100"],
        "--vocab-size: got 100; expected an integer >= 258 for a byte-level BPE (256 byte symbols + [PAD] + [MASK])",
    ),
    "prepare-shard-size": (
        ["prepare", "--input", "default", "--out", "OUT", "--shard-size", "0"],
        "--shard-size: got 0; expected an integer >= 1",
    ),
    "prepare-max-chars": (
        ["prepare", "--input", "default", "--out", "OUT", "--min-chars", "5", "--max-chars", "2"],
        "--max-chars: got 2; expected an integer >= --min-chars (5)",
    ),
    "model-info-seq-len": (
        ["model-info", "tiny", "--seq-len", "0"],
        "--seq-len: got 0; expected an integer in [1, 64] (model.max_seq_len of 'tiny')",
    ),
    "bench-steps": (["bench", "--steps", "0"], "--steps: got 0; expected an integer >= 1"),
    "migrate-nnodes": (
        ["migrate", "old.yaml", "--out", "OUT", "--nnodes", "0"],
        "--nnodes: got 0; expected an integer >= 1",
    ),
    "migrate-gpu-memory": (
        ["migrate", "old.yaml", "--out", "OUT", "--gpu-memory-mib", "0"],
        "--gpu-memory-mib: got 0; expected an integer >= 1",
    ),
    "bench-memory-cap": (
        ["bench", "--memory-cap-gib", "-1"],
        "--memory-cap-gib: got -1.0; expected a number of GiB > 0",
    ),
    "bench-synthetic-lengths": (
        ["bench", "--synthetic-lengths", "2048:600"],
        "--synthetic-lengths: got '2048:600'; expected MIN:MAX with 1 <= MIN <= MAX",
    ),
    "bench-synthetic-lengths-not-numbers": (
        ["bench", "--synthetic-lengths", "long"],
        "--synthetic-lengths: got 'long'; expected MIN:MAX token counts, e.g. 600:2048",
    ),
    "bench-synthetic-vocab": (
        ["bench", "--synthetic-vocab", "2"],
        "--synthetic-vocab: got 2; expected an integer >= 3 ([PAD], [MASK] and one word)",
    ),
    "train-config-key": (["train", "train.steps=-5"], "config key 'train.steps': got -5; expected an integer >= 1"),
    "train-global-batch-below-micro": (
        ["train", "train.global_batch_size=16", "train.micro_batch_size=64"],
        "config key 'train.global_batch_size': got 16; expected a multiple of train.micro_batch_size=64; for a "
        "smaller global batch set both, e.g. train.global_batch_size=16 train.micro_batch_size=16",
    ),
    "train-sampling-shift": (
        ["train", "latent_diffusion.sampling_shift=0"],
        "config key 'latent_diffusion.sampling_shift': got 0.0; expected a number > 0, or null (equal steps of t)",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_option_is_one_line_in_the_shared_shape(tmp_path, capsys, case):
    argv, message = REFUSED[case]
    out = tmp_path / "out"
    assert main([arg.replace("OUT", str(out)) for arg in argv]) == 2
    assert capsys.readouterr().err == f"mmldlm {argv[0]}: {message}\n"
    assert not out.exists()  # refused before any work


def test_debug_flag_and_variable_add_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["prepare", "--input", "default", "--out", str(tmp_path / "out"), "--val-fraction", "1.5"]
    assert main(["--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "mmldlm/data/prepare.py" in err
    assert err.splitlines()[-1] == "mmldlm prepare: --val-fraction: got 1.5; expected a number in [0, 1)"
    monkeypatch.setenv("MMLDLM_DEBUG", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("Traceback")


# A config file that is not valid YAML: (its text, what the one line says after the file's name).
BROKEN_YAML = {
    "tab": (
        "train:\n\tsteps: 3\n",
        "not valid YAML, line 2, column 1: found character '\\t' that cannot start any token (while scanning for "
        "the next token); YAML indents with spaces, not tabs",
    ),
    "indent back to no level": (
        "train:\n  steps: 3\n lr: 2\n",
        "not valid YAML, line 3, column 2: expected <block end>, but found '<block mapping start>' (while parsing "
        "a block mapping opened at line 1, column 1); line 3 is indented to no level of the lines above it",
    ),
    "indent deeper": (
        "train:\n  steps: 3\n    seed: 2\n",
        "not valid YAML, line 3, column 9: mapping values are not allowed here; line 3 is indented deeper than the "
        "key above it, or a value holds ': ' (quote it)",
    ),
    "unclosed list": (
        "train:\n  batch_schedule: [[10, 8]\n",
        "not valid YAML, line 3, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow "
        "sequence opened at line 2, column 19)",
    ),
}


@pytest.mark.parametrize("case", BROKEN_YAML)
def test_a_config_file_that_is_not_yaml_is_one_line_naming_the_file_line_and_column(tmp_path, capsys, case):
    text, message = BROKEN_YAML[case]
    config = tmp_path / "broken.yaml"
    config.write_text(text)
    assert main(["train", "--config", str(config), f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == f"mmldlm train: config file '{config}': {message}\n"
    assert not (tmp_path / "run").exists()


def test_a_config_value_error_is_both_a_config_error_and_an_option_error():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.steps=0"])
    assert isinstance(caught.value, OptionError)
    assert (caught.value.key, caught.value.value) == ("config key 'train.steps'", 0)


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch):
    import mmldlm.commands.model_info as model_info

    def broken(_args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(model_info, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["model-info", "tiny"])
