"""A damaged checkpoint on every path that loads weights: `sample`, `eval` and `export --checkpoint`,
`MMLDLM.from_pretrained(run, checkpoint=...)`, `train --init-from` and the automatic choice of the newest
checkpoint all verify it (sizes and SHA-256 of the manifest in meta.json) before reading a tensor, and
refuse a truncated one or one with 4 KiB overwritten in one line naming the file, exit status 2. The
verdict on a checkpoint that verifies is remembered beside it, and a later change of a file is caught."""

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
from data_support import prepared, trained_run
from docs_support import TINY_BATCH, TINY_MODEL

import mmldlm.runs.checkpoints as checkpoints
from mmldlm import MMLDLM, cli
from mmldlm.errors import UserError
from mmldlm.runs.checkpoints import VERDICT, verify
from mmldlm.runs.trained import load_run

# Two checkpoints, steps 2 and 4: the newest is damaged, the other is what the automatic choice falls back to.
RUN = [
    *TINY_MODEL,
    *TINY_BATCH,
    "train.steps=4",
    "checkpoint.every=2",
    "logging.progress_bar=false",
    "schedule.warmup_steps=1",
    "data.num_workers=0",
    "eval.every=0",
]
SHARD = "__0_0.distcp"
REPO = Path(__file__).resolve().parent.parent


def main(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_run(tmp_path_factory, RUN)


def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def overwrite_4_kib(file):
    """4 KiB in the middle of the file overwritten with other bytes (each inverted): its size is what the
    manifest says."""
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        block = f.read(4096)
        f.seek(-len(block), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))


DAMAGE = {"truncated": (truncate, "has"), "4 KiB overwritten": (overwrite_4_kib, "does not match the SHA-256")}


@pytest.fixture(params=DAMAGE)
def damaged(request, trained, tmp_path):
    """A copy of the run whose newest checkpoint (step 4) is damaged: (run, that checkpoint, what the line says)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    newest = run / "checkpoints" / "step-0000004"
    damage, says = DAMAGE[request.param]
    assert verify(newest, checksums=True) is None  # whole before the damage
    damage(newest / SHARD)
    return run, newest, f"{newest / SHARD} {says}"


def refused_in_one_line(capsys, command: str, says: str) -> str:
    """The one line of a refusal on stderr (after the log lines of what came before it, for `train`)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(("INFO ", "WARNING "))]
    assert len(lines) == 1 and lines[0].startswith(f"mmldlm {command}: "), err
    assert says in lines[0] and "Traceback" not in err
    return lines[0]


def test_sample_eval_and_export_of_a_damaged_checkpoint_named_explicitly_exit_2_naming_the_file(
    damaged, tmp_path, capsys
):
    run, newest, says = damaged
    args = ["--run", run, "--checkpoint", newest, "--device", "cpu"]
    assert main("sample", *args, "--mode", "joint", "--num", "1", "--steps", "2") == 2
    refused_in_one_line(capsys, "sample", says)
    assert main("eval", *args, "--num-samples", "2", "--steps", "2", "--retrieval-pool", "4") == 2
    refused_in_one_line(capsys, "eval", says)
    assert not (run / "eval").exists()
    assert main("export", "--run", run, "--checkpoint", newest, "--out", tmp_path / "exported") == 2
    refused_in_one_line(capsys, "export", says)
    assert not (tmp_path / "exported").exists()


def test_from_pretrained_of_a_damaged_checkpoint_raises_one_line_naming_the_file(damaged):
    run, newest, says = damaged
    with pytest.raises(UserError) as err:
        MMLDLM.from_pretrained(run, checkpoint=newest, device="cpu")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_init_from_a_damaged_checkpoint_is_refused_in_one_line_before_the_new_run_starts(
    damaged, tmp_path_factory, tmp_path, capsys
):
    run, newest, says = damaged
    data = prepared(tmp_path_factory)
    new_run = tmp_path / "fine-tuned"
    overrides = [*RUN, f"data.path={data}", f"train.run_dir={new_run}"]
    assert main("train", "--config", "default", *overrides, "--init-from", newest) == 2
    assert f"train.init_from {newest}: " in refused_in_one_line(capsys, "train", says)
    assert not new_run.exists()


def test_the_automatic_choice_skips_a_damaged_newest_checkpoint_and_says_why(damaged, caplog):
    run, newest, says = damaged
    with caplog.at_level(logging.WARNING, logger="mmldlm"):
        loaded = load_run(run, device="cpu")
    assert loaded.checkpoint.name == "step-0000002" and loaded.step == 2
    assert f"skipped step-0000004: {says}" in caplog.text


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_in_one_line(damaged, capsys):
    run, newest, says = damaged
    overwrite_4_kib(run / "checkpoints" / "step-0000002" / SHARD)
    assert main("sample", "--run", run, "--mode", "joint", "--num", "1", "--device", "cpu") == 2
    refused_in_one_line(capsys, "sample", says)


def test_a_verified_checkpoint_is_not_hashed_again_until_a_file_of_it_changes(trained, tmp_path, monkeypatch):
    checkpoint = tmp_path / "step-0000004"
    shutil.copytree(trained / "checkpoints" / "step-0000004", checkpoint)
    hashed = []
    real = checkpoints.file_sha256
    monkeypatch.setattr(checkpoints, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    manifest = json.loads((checkpoint / "meta.json").read_text())["files"]
    assert verify(checkpoint, checksums=True) is None
    assert sorted(hashed) == sorted(manifest) and (checkpoint / VERDICT).is_file()
    hashed.clear()
    assert verify(checkpoint, checksums=True) is None
    assert hashed == []  # remembered: sizes and times unchanged
    # 4 KiB overwritten, the modification time put back as it was: the change time still tells.
    shard = checkpoint / SHARD
    before = shard.stat()
    overwrite_4_kib(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (
        verify(checkpoint, checksums=True)
        == f"{shard} does not match the SHA-256 written in {checkpoint}/meta.json (corrupted)"
    )
    assert hashed == [SHARD]


def test_a_checkpoint_in_a_folder_that_cannot_be_written_is_verified_all_the_same(trained, tmp_path, monkeypatch):
    checkpoint = tmp_path / "step-0000004"
    shutil.copytree(trained / "checkpoints" / "step-0000004", checkpoint)
    monkeypatch.setattr(
        checkpoints,
        "write_atomically",
        lambda path, content: (_ for _ in ()).throw(PermissionError(13, "Permission denied")),
    )
    assert verify(checkpoint, checksums=True) is None and not (checkpoint / VERDICT).exists()
    overwrite_4_kib(checkpoint / SHARD)
    assert "does not match the SHA-256" in verify(checkpoint, checksums=True)


def test_the_verification_benchmark_writes_the_base_presets_size_and_times_each_way_of_verifying(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import verify_bench
    finally:
        sys.path.pop(0)
    assert verify_bench.preset_bytes("base") == (931_186_560, 931_186_560 * 16)  # `mmldlm model-info base`
    assert verify_bench.main(["--dir", str(tmp_path), "--gib", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("verify of a checkpoint of 0.01 GiB: 0.01 GB in 2 shards; load average")
    labels = ["checksums, cold page cache", "checksums, warm page cache", "verdict remembered", "sizes only"]
    assert [line.split(":")[0].strip() for line in lines[1:]] == labels
    assert list(tmp_path.iterdir()) == []  # the synthetic checkpoint is removed
