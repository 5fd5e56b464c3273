"""ATen operations of one training step of each mode, beside those of the plain transformer of the same
text-stream dimensions (`mmldlm bench --reference`): the host's work per step, which a GPU pays per
launch. Counted on any device; the default shape is the older codebase's depth at a width that runs
in seconds on a CPU.

    python scripts/step_operations.py                       # depth 24, width 64, bf16 autocast
    python scripts/step_operations.py model=small train.precision=fp32

Prints, per row, every operation and the kernels (operations that are not views), per step and per
block, and the ratios to the reference; `--top N` lists the most frequent operations of each row, and
`--sites N` the N lines of the package that cause the most (forward: the line that runs it;
backward: the forward line whose gradient it computes), with each line's operations per block.

A dispatch mode runs compiled code eagerly. `--host` counts instead what the host calls in a step,
compiled or not (torch.profiler, `mmldlm.tools.operations.host_operations`): the outermost ATen
operations outside compiled code and inside it, the compiled calls, and the kernels the compiled
code runs (inductor's generated ones, profiled, and the external ones that are not views: what a GPU
launches, or replays under CUDA graphs):

    python scripts/step_operations.py --host --config compiled data.pad_to_multiple=256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

DEFAULTS = [
    "model=base-2k",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.max_seq_len=256",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.precision=bf16",
    "data.num_workers=0",
    "perf.activation_checkpointing=none",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="after the defaults above")
    parser.add_argument("--config", default="optimized", help="config name or file (default optimized)")
    parser.add_argument("--top", type=int, default=0, help="the N most frequent operations of each row")
    parser.add_argument("--sites", type=int, default=0, help="the N lines causing the most operations, per row")
    parser.add_argument("--host", action="store_true", help="the host's calls, compiled steps too (torch.profiler)")
    args = parser.parse_args(argv)
    if args.host and args.sites:
        parser.error("--sites counts under a dispatch mode; --host under torch.profiler: one or the other")

    if args.host:  # a profiler event for each kernel inductor generates, from the first compile on
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
    from mmldlm.data.synthetic import SyntheticShape, write_synthetic
    from mmldlm.tools.bench import build_reference, build_trainer
    from mmldlm.tools.operations import METADATA_OPS, host_operations, step_operations

    with tempfile.TemporaryDirectory() as scratch:
        shape = SyntheticShape(vocab_size=30522, min_length=60, max_length=256, latent_dim=32, num_samples=64)
        overrides = [f"data.path={write_synthetic(shape, Path(scratch) / 'data')}", *DEFAULTS, *args.overrides]
        _, _, trainer, _ = build_reference(args.config, overrides, str(Path(scratch) / "reference"))
        count = host_operations if args.host else lambda trainer: step_operations(trainer, args.sites > 0)
        rows = {"reference: plain transformer": count(trainer)}
        for mode in ("l2t", "t2l", "joint"):
            run_dir = str(Path(scratch) / mode)
            _, _, trainer, _ = build_trainer(args.config, [*overrides, f"objective.mode={mode}"], run_dir)
            rows[mode] = count(trainer)
    if args.host:
        print_host_calls(rows, args.top)
        return 0
    depth = len(trainer.raw_model.blocks)
    reference = rows["reference: plain transformer"]
    print("| row | operations | per block | x reference | kernels | per block | x reference |")
    print("|---|---|---|---|---|---|---|")
    for name, ops in rows.items():
        print(
            f"| {name} | {ops.total:,} | {ops.total / depth:.0f} | {ops.total / reference.total:.2f} "
            f"| {ops.kernels:,} | {ops.kernels / depth:.0f} | {ops.kernels / reference.kernels:.2f} |"
        )
    for name, ops in rows.items() if args.top else ():
        top = sorted(ops.counts.items(), key=lambda item: -item[1])[: args.top]
        print(f"{name}: " + ", ".join(f"{op} {n}" for op, n in top))
    for name, ops in rows.items() if args.sites else ():
        print(f"\n{name}: the {args.sites} lines causing the most operations (of {ops.total:,})\n")
        print("| line | operations | per block | kernels | operations |")
        print("|---|---|---|---|---|")
        by_line: dict[str, dict[str, int]] = {}
        for (site, op), n in ops.sites.items():
            by_line.setdefault(site, {})[op] = n
        for site, counts in sorted(by_line.items(), key=lambda item: -sum(item[1].values()))[: args.sites]:
            total = sum(counts.values())
            kernels = sum(n for op, n in counts.items() if op not in METADATA_OPS)
            listed = ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda item: -item[1]))
            print(f"| {site} | {total} | {total / depth:.1f} | {kernels} | {listed} |")
    return 0


def print_host_calls(rows: dict, top: int) -> None:
    """The table of `--host`: per row, the host's calls of one step and their parts."""
    reference = rows["reference: plain transformer"]
    print(
        "| row | host calls | x reference | eager ATen operations | ATen operations in compiled code "
        "| compiled calls | kernels in compiled code | x reference |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, calls in rows.items():
        kernels = calls.compiled_kernels
        print(
            f"| {name} | {calls.total:,} | {calls.total / reference.total:.2f} | {sum(calls.eager.values()):,} "
            f"| {sum(calls.in_compiled.values()):,} | {calls.compiled_calls} | {kernels:,} "
            f"| {kernels / max(reference.compiled_kernels, 1):.2f} |"
        )
    for name, calls in rows.items() if top else ():
        for part, counts in (("eager", calls.eager), ("in compiled code", calls.in_compiled)):
            print(f"{name}, {part}: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))


if __name__ == "__main__":
    sys.exit(main())
