"""A run directory's own files: its config files (the one it started with and one per resume), whether
a directory is a run's, and the error a checkpoint or run directory that cannot be used raises
(`mmldlm` prints it as one line, exit status 2). Imports nothing heavy, so the command line and the
monitor use it without loading torch."""

from __future__ import annotations

from pathlib import Path

from mmldlm.config import RunConfig, save_config
from mmldlm.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used: not a checkpoint, incomplete, corrupt, from another world size."""


def save_run_config(cfg: RunConfig, run_dir: Path, resumed_from: Path | None) -> None:
    """RUN/config.yaml is the config the run started with and stays so: a resume from checkpoint
    step-N that finds it writes its own beside it, config.resume-step-N.yaml. What each checkpoint
    was trained with is never lost (every checkpoint also holds its config.yaml)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if resumed_from is not None and path.exists():
        path = run_dir / f"config.resume-{resumed_from.name}.yaml"
    save_config(cfg, path)


def current_run_config(run_dir: Path) -> Path:
    """The config of the run's latest start: whichever of config.yaml and the config.resume-*.yaml was
    written last (a fresh start after the checkpoints were removed rewrites config.yaml)."""
    written = [p for p in (run_dir / "config.yaml", *run_dir.glob("config.resume-*.yaml")) if p.is_file()]
    return max(written, key=lambda p: p.stat().st_mtime_ns) if written else run_dir / "config.yaml"


def is_run_dir(path: Path) -> bool:
    """Whether `mmldlm train` writes in `path`: it opens metrics.jsonl as it claims the directory, writes
    config.yaml when the run has started, and checkpoints/ at the first save (a resume finds it)."""
    return any((path / name).exists() for name in ("metrics.jsonl", "config.yaml", "checkpoints"))
