"""From a text corpus to token and latent shards, and the loader that reads them.

    corpus.py     read .txt / .jsonl / .parquet (and .gz of each), filter by length, deduplicate
    tokenizer.py  train a byte-level BPE or load a local tokenizer; the reserved [PAD] and [MASK]
    encoders.py   the sentence-encoder registry (default all-MiniLM-L6-v2) -> latents (N, K, D)
    format.py     the on-disk format: meta.json, token/offset/latent shards, their checks
    prepare.py    corpus -> prepared dataset directory, sharded across torchrun ranks; a run's dataset
                  directory (data.path, or the bundled corpus prepared into the cache)
    legacy.py     import of a per-sample .npz/.npy layout
    synthetic.py  a prepared dataset of random tokens and latents of a given shape (bench)
    dataset.py    memory-mapped dataset, resumable distributed batch order, padding collate, loader

The names below load their module on first use (PEP 562), so `from mmldlm.data import DataError`
(as the CLI does) does not import torch.
"""

from __future__ import annotations

import importlib

from mmldlm.data.errors import DataError

_EXPORTS = {
    "open_dataset": "dataset",
    "build_loader": "dataset",
    "resolve_for_model": "dataset",
    "model_for_dataset": "dataset",
    "heaviest_batch": "dataset",
    "PreparedDataset": "dataset",
    "Loader": "dataset",
    "prepare": "prepare",
    "PrepareOptions": "prepare",
    "dataset_path": "prepare",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mmldlm.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'mmldlm.data' has no attribute '{name}'")
