"""Structured metrics: RUN/metrics.jsonl (one JSON record per log step), plus optional TensorBoard
and W&B (offline) writers, and the memory / FLOP numbers the records carry.

The JSONL file is append-only. A resumed run continues it; only records past the resumed
checkpoint's line count are dropped first, because the steps they describe are trained again
(without that, a run killed between two checkpoints would list those steps twice).
Only rank 0 writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from mmldlm.config import LoggingConfig
from mmldlm.training.storage import WriteError, write_failure

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s of known accelerators, by a substring of torch.cuda.get_device_name().
# MFU is reported only for these; an unknown device gets no MFU rather than a made-up one.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS_BF16.items() if key in name), None)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX), where bf16
    autocast runs a training step about 2x faster than fp32 (docs/log/benchmarks.md). Without them
    oneDNN emulates bf16 and autocast is no faster than fp32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers: absent from other torch builds
        return False


def memory_stats(device: torch.device) -> dict:
    """GiB of CUDA memory allocated / reserved (peak since the last call), or process RSS on CPU."""
    if device.type == "cuda":
        stats = {
            "mem_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    with open("/proc/self/statm") as f:  # Linux; fields are in pages
        rss_pages = int(f.read().split()[1])
    return {"mem_rss_gib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}


class MachineLoad:
    """What tells a busy machine from a slow run, over the window since the last `read`: the CPU seconds
    this process got per second of wall clock (all its threads together: 1.0 is one core kept busy; its
    loader workers are processes of their own and not counted), beside the machine's 1-minute load
    average (the processes running or waiting for a CPU, every user's) and its number of CPUs. A run that
    shares its cores with another job gets less CPU time than before, or finds the load above what it
    puts there itself (`mmldlm monitor` reads both). The kernel's counters only: no device read-back."""

    def __init__(self):
        self._since = (time.perf_counter(), time.process_time())

    def read(self) -> dict:
        now = (time.perf_counter(), time.process_time())
        (wall, cpu), self._since = self._since, now
        try:
            load = os.getloadavg()[0]
        except OSError:  # a system without a load average
            load = None
        return {
            "cpu_s_per_s": (now[1] - cpu) / max(now[0] - wall, 1e-9),
            "load_1m": load,
            "num_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),  # at the record (train.threads=auto changes it)
        }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:  # Linux
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc malloc_trim), so the resident set shows what is in use."""
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (see `peak_memory_bytes`).

    CPU: freed heap pages are first handed back to the OS, so memory the last window freed does not
    count as in use in this one; then the kernel's RSS high-water mark is set to the current RSS
    (writing 5 to /proc/self/clear_refs, Linux >= 4.0)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process since `reset_peak_memory`: CUDA memory allocated by tensors, or
    on CPU the peak resident set size (VmHWM), which also counts the Python runtime and torch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def current_memory_bytes(device: torch.device) -> int:
    """CUDA memory allocated now, or on CPU the resident set size now."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kib("VmRSS") * 1024


def truncate_lines(path: Path, num_lines: int) -> None:
    """Keep the first `num_lines` complete lines of `path`, dropping what follows (a line cut by a kill
    included). One truncate in place: it needs no free space, so a resume on a full disk can do it."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = 0
    for _ in range(num_lines):
        newline = data.find(b"\n", end)
        if newline < 0:
            break
        end = newline + 1
    os.truncate(path, end)


class MetricsLogger:
    """Writes records to metrics.jsonl (and TensorBoard / W&B when configured) on rank 0."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, keep_lines: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.num_lines = keep_lines
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_lines(self.path, keep_lines)
        # Unbuffered: each record is one write the logger can undo (see `log`).
        self._file = open(self.path, "ab", buffering=0)
        self._end = self.path.stat().st_size
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # here: only logging.tensorboard needs it

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                log.warning("logging.wandb=true but wandb is not installed (pip install wandb); skipping W&B")
            else:
                self._wandb = wandb.init(
                    project=cfg.wandb_project,
                    dir=str(run_dir),
                    mode="offline",
                    resume="allow",
                    id=Path(run_dir).resolve().name,
                )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            rest = memoryview(line)
            while rest:  # unbuffered: a kill -9 loses nothing already logged
                rest = rest[self._file.write(rest) :]
        except OSError as err:  # a full disk: the line goes whole or not at all
            os.ftruncate(self._file.fileno(), self._end)
            raise WriteError(
                f"{write_failure(err, self.path)} (the record of step {record.get('step')} "
                f"was not written; the file ends with the one before)"
            ) from err
        self._end += len(line)
        self.num_lines += 1
        numeric = {
            k: v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(numeric, step=record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
