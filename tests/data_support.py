"""Shared helpers of the data tests: a small corpus and its prepared dataset, made once per session.
(A plain module, not a conftest, so that it stays the data tests' own.)"""

from __future__ import annotations

import gzip
from pathlib import Path

from mmldlm.data.corpus import DEFAULT_CORPUS
from mmldlm.data.prepare import PrepareOptions, prepare

# Texts the tokenizer must round-trip although they are rare in the corpus.
EXTRA_TEXTS = [
    "  leading and trailing spaces are stripped, inner  double  spaces kept",
    "unicode: naïve café, Ελληνικά, 日本語, emoji 😀",
    "a literal [MASK] and [PAD] in the text stay plain text",
    "tabs\tinside",
]
SMALL = dict(vocab_size=400, shard_size=32, val_fraction=0.1, seed=0, progress=False)
_cache: dict[str, Path] = {}


def corpus_texts() -> list[str]:
    """About 170 samples: every 1000th line of the bundled corpus plus EXTRA_TEXTS."""
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return lines[::1000] + EXTRA_TEXTS


def distributed_corpus_texts() -> list[str]:
    """240 samples, every 500th line of the bundled corpus: the data of the multi-process scenarios."""
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[::500][:240]


def corpus_file(root: Path, texts: list[str] | None = None) -> Path:
    path = root / "corpus.txt"
    if not path.exists():
        path.write_text("\n".join(texts or corpus_texts()) + "\n", encoding="utf-8")
    return path


def prepared(tmp_path_factory, name: str = "single", texts: list[str] | None = None, **overrides) -> Path:
    """`texts` (by default the small corpus) prepared in this process, once per session and name: the
    modules that ask for the same name share one prepared dataset."""
    if name not in _cache:
        root = tmp_path_factory.mktemp(f"prepared-{name}")
        opts = PrepareOptions(inputs=[str(corpus_file(root, texts))], out=str(root / "data"), **{**SMALL, **overrides})
        prepare(opts, log=lambda _msg: None)
        _cache[name] = root / "data"
    return _cache[name]


def trained_run(tmp_path_factory, overrides: list[str]) -> Path:
    """A run of `mmldlm train` (config defaults + `overrides`) on the small prepared corpus, trained in
    this process (on one torch thread, tests/conftest.py)."""
    from mmldlm.config import load_config
    from mmldlm.training.run import train

    out = tmp_path_factory.mktemp("run") / "run"
    data = prepared(tmp_path_factory)
    assert train(load_config(None, [*overrides, f"data.path={data}", f"train.run_dir={out}"])) == 0
    return out
