"""A torch.profiler window on request (perf.profiler): skip some steps, warm up, record a few, and
write one trace per rank to RUN/profiler/ (open it in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from mmldlm.config import ProfilerConfig

log = logging.getLogger(__name__)


def profiler_window(cfg: ProfilerConfig, run_dir: Path, device: torch.device, rank: int):
    """A context manager yielding a profiler whose `.step()` the loop calls after every step, or None."""
    if not cfg.enabled:
        return contextlib.nullcontext()
    out = Path(run_dir) / "profiler"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    log.info("profiler: skipping %d steps, warming up %d, recording %d into %s", cfg.skip, cfg.warmup, cfg.active, out)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(skip_first=cfg.skip, wait=0, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
    )
