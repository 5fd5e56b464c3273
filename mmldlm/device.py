"""Which torch device a process runs on: one rule for training, sampling and data preparation."""

from __future__ import annotations

import os

import torch


def pick_device(kind: str, key: str = "train.device") -> torch.device:
    """"auto": cuda:LOCAL_RANK when CUDA is present, else the CPU; "cuda": cuda:LOCAL_RANK; "cuda:N"
    and "cpu" as given. Asking for CUDA where there is none is an error naming `key` (the config key
    or command-line option the value came from)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not kind.startswith("cuda"):
        raise ValueError(f"{key}={kind}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{key}={kind} but no CUDA device is visible; use {key}=auto or cpu")
    return torch.device(kind) if ":" in kind else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
