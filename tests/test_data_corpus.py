"""Reading corpora: every format and its gzip, the length filter's counts, and one clear error per bad input."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmldlm.data.corpus import DEFAULT_CORPUS, filter_texts, read_texts, resolve_input
from mmldlm.data.errors import DataError

TEXTS = ["the first sample", "the second one, with ünïcödé", "third"]


def gzipped(path):
    out = path.with_name(path.name + ".gz")
    out.write_bytes(gzip.compress(path.read_bytes()))
    return out


def test_bundled_corpus_is_large_enough_and_licensed():
    lines = gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8").read().splitlines()
    assert len(lines) >= 40_000
    assert len(set(lines)) == len(lines) and all(line.strip() == line and line for line in lines)
    assert "Princeton University" in (DEFAULT_CORPUS.parent / "LICENSE.wordnet").read_text()
    assert resolve_input("default") == DEFAULT_CORPUS


@pytest.mark.parametrize("gz", [False, True])
def test_txt_lines_and_paragraphs(tmp_path, gz):
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(TEXTS) + "\n\n  \n", encoding="utf-8")
    paras = tmp_path / "paras.txt"
    paras.write_text("a hard-wrapped\npassage of two lines\n\n\nsecond passage\n", encoding="utf-8")
    if gz:
        lines, paras = gzipped(lines), gzipped(paras)
    assert read_texts(lines) == TEXTS
    assert read_texts(paras, paragraphs=True) == ["a hard-wrapped passage of two lines", "second passage"]


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_field(tmp_path, gz):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)), encoding="utf-8")
    assert read_texts(gzipped(path) if gz else path, text_field="body") == TEXTS


@pytest.mark.parametrize("gz", [False, True])
def test_a_byte_order_mark_is_not_part_of_the_first_sample(tmp_path, gz):
    lines, records = tmp_path / "bom.txt", tmp_path / "bom.jsonl"
    lines.write_text("\ufeff" + "\n".join(TEXTS) + "\n", encoding="utf-8")
    records.write_text("\ufeff" + "".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    if gz:
        lines, records = gzipped(lines), gzipped(records)
    assert read_texts(lines) == TEXTS and read_texts(records) == TEXTS


@pytest.mark.parametrize("gz", [False, True])
def test_parquet_column(tmp_path, gz):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(3)), "text": TEXTS}), path)
    assert read_texts(gzipped(path) if gz else path) == TEXTS


def test_length_filter_and_dedup_counts():
    texts = ["ab", "abcd", "abcd", "abcdefgh", "abcde"]
    kept, counts = filter_texts(texts, min_chars=3, max_chars=6)
    assert kept == ["abcd", "abcde"]
    assert counts == {"read": 5, "too_short": 1, "too_long": 1, "duplicates": 1, "kept": 2}
    assert filter_texts(texts, 3, 6, dedup=False)[0] == ["abcd", "abcd", "abcde"]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: no such file"):
        resolve_input(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(DataError, match=r"empty\.txt: empty"):
        read_texts(empty)
    with pytest.raises(DataError, match=r"x\.csv: cannot tell the format"):
        read_texts(tmp_path / "x.csv")


@pytest.mark.parametrize("gz", [False, True])
def test_non_utf8_names_file_and_line(tmp_path, gz):
    path = tmp_path / "latin1.txt"
    path.write_bytes("fine\nalso fine\ncaf\u00e9 au lait\n".encode("latin-1"))
    path = gzipped(path) if gz else path
    with pytest.raises(DataError, match=rf"{path.name}:3: not valid UTF-8 \(byte 0xe9 at byte 4"):
        read_texts(path)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text here", "id": 2}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: no field 'text' \(fields here: body, id\)"):
        read_texts(path)
    path.write_text('{"text": "ok"}\n\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:3: not valid JSON"):
        read_texts(path)
    path.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:1: field 'text' is int, expected a string"):
        read_texts(path)


def test_parquet_without_column_lists_columns(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [1], "sentence": ["x"]}), path)
    with pytest.raises(DataError, match=r"c\.parquet: no column 'text' \(columns: id, sentence\)"):
        read_texts(path)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"c\.parquet: cannot read as parquet"):
        read_texts(path)
