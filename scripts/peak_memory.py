"""Peak memory and step time of several configs in one process, one after the other: a few warm-up
steps, then the peak of the measured steps (CUDA: max allocated; CPU: peak RSS) and the memory held
between steps (weights and optimizer state). On CUDA the allocator's counters make this exact; on a
CPU the resident set of an earlier config can linger, so `mmldlm bench` (one process per config) is
the better instrument there.

    python scripts/peak_memory.py optimized lean --micro-batch 256 model=base data.path=DIR optim.grad_clip=0
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="config names or files; section.key=value items are overrides")
    parser.add_argument("--micro-batch", type=int, required=True, help="micro-batch = global batch of every config")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_intermixed_args(argv)
    configs = [c for c in args.configs if "=" not in c]
    overrides = [c for c in args.configs if "=" in c]

    from mmldlm.tools.bench import build_trainer
    from mmldlm.training.metrics import current_memory_bytes, peak_memory_bytes, reset_peak_memory

    for name in configs:
        with tempfile.TemporaryDirectory() as run_dir:
            _, info, trainer, _ = build_trainer(
                name,
                [
                    *overrides,
                    f"train.micro_batch_size={args.micro_batch}",
                    f"train.global_batch_size={args.micro_batch}",
                    "data.num_workers=0",
                ],
                run_dir,
            )
            for _ in range(args.warmup):
                trainer.train_step()
            reset_peak_memory(info.device)
            at_rest = current_memory_bytes(info.device)
            times = [trainer.train_step()["step_time_s"] for _ in range(args.steps)]
            peak = peak_memory_bytes(info.device)
            print(
                f"{name}: step {statistics.median(times):.3f} s (median of {args.steps}), peak {peak / 2**30:.2f} GiB, "
                f"between steps {at_rest / 2**30:.2f} GiB, checkpointing {trainer.activation_checkpointing}, "
                f"step in backward {trainer.step_in_backward}",
                flush=True,
            )
            del trainer
            gc.collect()
            if info.device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
