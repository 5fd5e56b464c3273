"""Reading a text corpus: .txt (one sample per line, or blank-line separated passages), .jsonl (a
named field), .parquet (a named column), and gzip of each; then a length filter and exact
deduplication with counts of what was dropped.

Every problem raises DataError naming the file and the line, row or field, before anything is
written."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from mmldlm.data.errors import DataError

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus" / "default.txt.gz"
FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


def resolve_input(path: str | Path) -> Path:
    """`default` names the bundled corpus; anything else is a path that must exist."""
    if str(path) == "default":
        return DEFAULT_CORPUS
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file (give one corpus file per --input)")
    return path


def detect_format(path: Path) -> str:
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    fmt = FORMATS.get(suffixes[0].lower()) if suffixes else None
    if fmt is None:
        raise DataError(
            f"{path}: cannot tell the format from the file name; expected one of "
            f"{', '.join(FORMATS)} (optionally + .gz), or pass --format"
        )
    return fmt


def _raw_bytes(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) over a plain or gzipped UTF-8 file; a byte order mark that
    starts the file (Windows editors write one) is not part of the first line."""
    try:
        with _raw_bytes(path) as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at "
                        f"byte {err.start + 1} of the line); re-encode the file as UTF-8"
                    ) from None
    except (gzip.BadGzipFile, EOFError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise DataError(f"{path}: no such file") from None
        raise DataError(f"{path}: cannot read as {'gzip' if path.suffix == '.gz' else 'a file'}: {err}") from None


def read_txt(path: Path, paragraphs: bool = False) -> list[str]:
    """One sample per non-blank line, or with `paragraphs` one per blank-line separated passage
    (its lines stripped and joined by a space: hard-wrapped prose becomes one passage)."""
    if not paragraphs:
        return [text for _, line in _lines(path) if (text := line.strip())]
    texts, current = [], []
    for _, line in _lines(path):
        if line.strip():
            current.append(line.strip())
        elif current:
            texts.append(" ".join(current))
            current = []
    if current:
        texts.append(" ".join(current))
    return texts


def read_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise DataError(
                f"{path}:{lineno}: expected a JSON object with a '{field}' field, got {type(record).__name__}"
            )
        if field not in record:
            raise DataError(
                f"{path}:{lineno}: no field '{field}' (fields here: {', '.join(record) or 'none'}); "
                f"name the text field with --text-field"
            )
        value = record[field]
        if not isinstance(value, str):
            raise DataError(f"{path}:{lineno}: field '{field}' is {type(value).__name__}, expected a string")
        texts.append(value.strip())
    return [t for t in texts if t]


def read_parquet(path: Path, column: str) -> list[str]:
    import pyarrow as pa  # here: only .parquet inputs need it
    import pyarrow.parquet as pq

    try:
        with _raw_bytes(path) as f:
            source = io.BytesIO(f.read()) if path.suffix == ".gz" else path
            schema = pq.read_schema(source)
            if column not in schema.names:
                raise DataError(
                    f"{path}: no column '{column}' (columns: {', '.join(schema.names)}); "
                    f"name the text column with --text-field"
                )
            table = pq.read_table(source, columns=[column])
    except (pa.ArrowException, gzip.BadGzipFile, EOFError) as err:
        raise DataError(f"{path}: cannot read as parquet: {err}") from None
    if not (
        pa.types.is_string(table.schema.field(column).type) or pa.types.is_large_string(table.schema.field(column).type)
    ):
        raise DataError(f"{path}: column '{column}' holds {table.schema.field(column).type}, expected strings")
    return [t.strip() for t in table.column(column).to_pylist() if t is not None and t.strip()]


def read_texts(path: Path, fmt: str = "auto", text_field: str = "text", paragraphs: bool = False) -> list[str]:
    """All non-empty samples of one corpus file, in file order."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "txt":
        texts = read_txt(path, paragraphs)
    elif fmt == "jsonl":
        texts = read_jsonl(path, text_field)
    else:
        texts = read_parquet(path, text_field)
    if not texts:
        raise DataError(f"{path}: empty: no non-blank sample in it")
    return texts


def filter_texts(
    texts: list[str], min_chars: int, max_chars: int, dedup: bool = True
) -> tuple[list[str], dict[str, int]]:
    """Keep samples with min_chars <= len <= max_chars, dropping exact repeats of an earlier sample
    (a repeat could land in train and val at once). Returns the kept samples and the counts."""
    counts = {"read": len(texts), "too_short": 0, "too_long": 0, "duplicates": 0}
    seen: set[str] = set()
    kept = []
    for text in texts:
        if len(text) < min_chars:
            counts["too_short"] += 1
        elif len(text) > max_chars:
            counts["too_long"] += 1
        elif dedup and text in seen:
            counts["duplicates"] += 1
        else:
            seen.add(text)
            kept.append(text)
    counts["kept"] = len(kept)
    return kept, counts
