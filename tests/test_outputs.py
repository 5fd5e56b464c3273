"""Replacing an output folder (mmldlm/outputs.py): a folder is swapped for a new one only while it holds
nothing but what mmldlm writes there, checked again at the swap."""

import re

import pytest

from mmldlm.errors import UserError
from mmldlm.outputs import FolderKind, publish

KIND = FolderKind("a test folder", "meta.json", re.compile(r"meta\.json|part-\d\.bin"))


def folder(path, files: dict):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_publish_swaps_in_the_new_folder_and_removes_the_old_one(tmp_path):
    out = folder(tmp_path / "out", {"meta.json": '{"format_version": 1}', "part-0.bin": "old"})
    partial = folder(tmp_path / ".out.partial", {"meta.json": '{"format_version": 1}', "part-0.bin": "new"})
    publish(partial, out, KIND)
    assert (out / "part-0.bin").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_refuses_a_folder_that_gained_a_foreign_file_and_keeps_both(tmp_path):
    out = folder(tmp_path / "out", {"meta.json": '{"format_version": 1}', "thesis.txt": "mine"})
    partial = folder(tmp_path / ".out.partial", {"meta.json": '{"format_version": 1}'})
    with pytest.raises(
        UserError,
        match=r"it holds thesis.txt \(1 file\) that mmldlm did not write; choose another --out or remove it yourself$",
    ):
        publish(partial, out, KIND)
    assert (out / "thesis.txt").read_text() == "mine" and partial.is_dir()


def test_a_folder_without_its_marker_is_foreign_whatever_its_file_names(tmp_path):
    out = folder(tmp_path / "out", {f"part-{i}.bin": "x" for i in range(5)})
    with pytest.raises(UserError) as err:
        publish(folder(tmp_path / "new", {}), out, KIND)
    assert "is not a test folder (meta.json) and it holds part-0.bin, part-1.bin, part-2.bin and 2 more (5 files)" in (
        str(err.value)
    )


def test_a_damaged_marker_beside_the_kinds_files_is_still_replaced(tmp_path):
    out = folder(tmp_path / "out", {"meta.json": "{not json", "part-0.bin": "old"})
    publish(folder(tmp_path / "new", {"meta.json": '{"format_version": 1}'}), out, KIND)
    assert (out / "meta.json").read_text() == '{"format_version": 1}'
    # A marker alone is not enough: it may be the user's own file of that name.
    alone = folder(tmp_path / "alone", {"meta.json": "{not json"})
    with pytest.raises(UserError, match=r"is not a test folder \(meta.json\) and it holds meta.json \(1 file\)"):
        publish(folder(tmp_path / "newer", {}), alone, KIND)
