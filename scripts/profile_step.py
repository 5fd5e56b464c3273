"""Profile training steps of one config and print where the time goes: the top operators by device
(GPU kernel) time and by host time, and how busy the device was.

    python scripts/profile_step.py optimized model=base data.path=DIR --warmup 5 --steps 4 --out DIR
    python scripts/profile_step.py configs/default.yaml data.path=DIR --shapes   # + matrix products by shape

The config is built exactly as `mmldlm bench` builds it; the warm-up steps (compile, allocator,
loader workers) are not recorded. OUT gets the tables (profile.txt) and a trace (trace.json, for
https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="config name or file, e.g. optimized")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--warmup", type=int, default=5, help="steps before recording (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="recorded steps (default 4)")
    parser.add_argument("--rows", type=int, default=25, help="operators per table (default 25)")
    parser.add_argument("--out", default="runs/profile", help="directory for profile.txt and trace.json")
    parser.add_argument(
        "--shapes", action="store_true", help="also the matrix products by input shape, host time per step"
    )
    args = parser.parse_args(argv)

    from mmldlm.tools.bench import build_trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg, info, trainer, _ = build_trainer(args.config, args.overrides, run_dir)
        cuda = info.device.type == "cuda"
        for _ in range(args.warmup):
            trainer.train_step()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
            started = time.perf_counter()
            # Queued as training queues them: the record (the read-back) only after the last.
            pending = [trainer.run_step() for _ in range(args.steps)]
            record = trainer.read_record(pending[-1])
            if cuda:
                torch.cuda.synchronize(info.device)
            wall = time.perf_counter() - started
    averages = prof.key_averages()
    # Kernels are the events of device type CUDA; an operator's row repeats its kernels' time.
    device_us = (
        sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
        if cuda
        else 0.0
    )
    lines = [
        f"# profile: {args.config} {' '.join(args.overrides)}",
        f"device {info.device}, torch {torch.__version__}, {args.steps} steps after {args.warmup} warm-up, "
        f"modes {[p.mode for p in pending]}, real tokens {record['real_token_share']:.0%} of the text positions",
        f"wall {wall / args.steps * 1e3:.1f} ms per step (profiler on; one read-back, after the last step)",
    ]
    if cuda:
        lines.append(
            f"device busy {device_us / 1e3 / args.steps:.1f} ms per step = "
            f"{device_us / 1e6 / wall:.0%} of wall (sum of kernel times)"
        )
        lines += ["", "## by device time", averages.table(sort_by="self_device_time_total", row_limit=args.rows)]
    lines += ["", "## by host time", averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
    if args.shapes:
        lines += ["", "## matrix products by input shape (host time)", *matmul_shapes(prof, args.steps, args.rows)]
    text = "\n".join(lines)
    (out / "profile.txt").write_text(text + "\n")
    prof.export_chrome_trace(str(out / "trace.json"))
    print(text)
    print(f"wrote {out / 'profile.txt'} and {out / 'trace.json'} (open it in chrome://tracing or ui.perfetto.dev)")
    return 0


def matmul_shapes(prof, steps: int, rows: int) -> list[str]:
    """The matrix products (mm, addmm, bmm) grouped by their inputs' shapes, largest host time first:
    on a CPU, where the products run on the host, the table of what a step's time is made of."""
    products = [
        e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm", "aten::bmm")
    ]
    products.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in products) / steps / 1e3
    lines = [f"all: {total:.1f} ms per step", "", "| operation | ms per step | calls per step | input shapes |"]
    lines.append("|---|---|---|---|")
    for e in products[:rows]:
        lines.append(
            f"| {e.key} | {e.self_cpu_time_total / steps / 1e3:.2f} | {e.count / steps:.1f} | {e.input_shapes} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
