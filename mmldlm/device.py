"""Which torch device a process runs on: one rule for training, sampling and data preparation."""

from __future__ import annotations

import os
import platform

import torch

from mmldlm.config import DEVICE_KINDS
from mmldlm.errors import OptionError


def pick_device(kind: str, key: str = "config key 'train.device'") -> torch.device:
    """ "auto": cuda:LOCAL_RANK when CUDA is present, else the CPU; "cuda": cuda:LOCAL_RANK; "cuda:N"
    (N among the visible devices, which CUDA_VISIBLE_DEVICES chooses) and "cpu" as given. Anything
    else, or CUDA where there is none, is an OptionError naming `key` (the config key, command-line
    option or argument the value came from)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not DEVICE_KINDS.fullmatch(kind):
        raise OptionError(key, kind, "auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise OptionError(key, kind, "auto or cpu: no CUDA device is visible")
    if ":" not in kind:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    count = torch.cuda.device_count()
    if int(kind.split(":")[1]) >= count:
        raise OptionError(
            key, kind, f"cuda:N with N < {count}, the CUDA devices visible here (CUDA_VISIBLE_DEVICES chooses them)"
        )
    return torch.device(kind)


def describe_device(device: torch.device) -> str:
    """A device's name for records and model cards: the GPU's name, or the CPU's model and the number
    of CPUs this process may use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:  # Linux: the marketing name
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} CPU ({cpus} cores)"
