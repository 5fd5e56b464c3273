"""Which torch device a process runs on: one rule for training, sampling and data preparation."""

from __future__ import annotations

import contextlib
import ctypes
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


def auto_precision(device_type: str, native_bf16: bool) -> str:
    """What train.precision=auto is on a device of `device_type` whose hardware multiplies bf16
    natively or not: bf16 autocast there (a CUDA GPU without bf16 gets fp16 with loss scaling), fp32
    elsewhere, also on a device without autocast (meta). The trainer asks the hardware; `mmldlm check`
    passes the machine it describes."""
    if device_type == "cuda":
        return "bf16" if native_bf16 else "fp16"
    return "bf16" if device_type == "cpu" and native_bf16 else "fp32"


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


def keep_freed_memory() -> bool:
    """Let this process's C allocator keep the memory it frees instead of handing it back to the OS;
    True where that was set (glibc), False elsewhere (then nothing changes).

    glibc serves every block over its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it
    on free, so the next block of that size faults each of its pages in again. The samplers allocate
    vocabulary-wide tensors (candidates x positions x vocabulary, float64: about 1 GiB per step for a
    best-of-16 batch of 64) at every step; best-of-16 decoding on the CPU spent 22 of its 54 s in those
    page faults. With mmap off (M_MMAP_MAX 0) and no trimming (M_TRIM_THRESHOLD at its largest), freed
    blocks are reused: 1.47x the texts per second, the same texts, a peak RSS 6% higher (up to 29%)
    that stays with the process (docs/benchmarks.md). For the sampling commands and training on a CPU
    (the text head's logits of a batch of long texts, (N, V) float32, pass the threshold; the main job's
    peak RSS stayed the same). PyTorch's CPU tuning guide
    gets the same from jemalloc or tcmalloc; this needs no library beyond glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def has_autocast(device_type: str) -> bool:
    """Whether torch has autocast for `device_type`. CPU and CUDA always do, and are answered without
    asking torch: torch.compile before torch 2.13 cannot trace the question (a graph break in every
    compiled block that asks)."""
    return device_type in ("cpu", "cuda") or torch.amp.is_autocast_available(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype that products of x compute in: autocast's where it is on for x's device, else x's."""
    device = x.device.type
    autocast = has_autocast(device) and torch.is_autocast_enabled(device)
    return torch.get_autocast_dtype(device) if autocast else x.dtype


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off on `device_type` (nothing to turn off where it has no autocast)."""
    if has_autocast(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
