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

`--time R` also times the eager steps, dispatched as counted: each row runs R rounds of `--steps`
steps, the rows in turn within a round, and the table gains each row's median milliseconds per step
and the median of its per-round ratios to the reference. At a shape where the arithmetic is small,
that is the host's time the operation counts stand for, which tells a change that saves operations
but costs Python (an autograd Function's, say) from one that saves time:

    python scripts/step_operations.py --time 9 --vocab 512 --max-length 16 model.hidden_size=16 \
        model.num_heads=2 train.micro_batch_size=1 train.global_batch_size=1

`--stacked` counts (and times) the two-stream rows as if each pair of the streams' grouped weights
and each stream's q and k gains were stored as one parameter: `stacked_parameters` then hands over
that tensor where it now stacks a copy each step. A what-if for a parameter layout the model does not
have: the step's other operations are the model's own.

    python scripts/step_operations.py --stacked perf.grouped_linears=true

On a CPU the two-stream rows' QK-RMSNorm dispatches its fused operations from Python there
(`dispatch_as_on_a_gpu`), where a GPU does it in C++: their ratios are the higher for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = [
    "model=base-2k",
    "model.hidden_size=64",
    "model.num_heads=4",
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
    parser.add_argument("--time", type=int, default=0, metavar="R", help="also time R rounds of eager steps per row")
    parser.add_argument("--stacked", action="store_true", help="as if each pair of parameters were stored stacked")
    parser.add_argument("--steps", type=int, default=10, help="steps per row and round of --time (default 10)")
    parser.add_argument("--vocab", type=int, default=30522, help="the synthetic data's vocabulary (default 30522)")
    parser.add_argument("--max-length", type=int, default=256, help="its and the model's longest text (default 256)")
    args = parser.parse_args(argv)
    if args.host and args.sites:
        parser.error("--sites counts under a dispatch mode; --host under torch.profiler: one or the other")
    if args.time and args.host:
        parser.error("--time times eager steps as they are counted; --host counts compiled ones: one or the other")
    if args.stacked and args.host:
        parser.error("--stacked stands in for parameters outside compiled code: not with --host")

    if args.host:  # a profiler event for each kernel inductor generates, from the first compile on
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
    from mmldlm.data.synthetic import SyntheticShape, write_synthetic
    from mmldlm.tools.bench import build_reference, build_trainer
    from mmldlm.tools.operations import METADATA_OPS, host_operations, step_operations

    if args.stacked:
        store_stacked()

    with tempfile.TemporaryDirectory() as scratch:
        shape = SyntheticShape(
            vocab_size=args.vocab,
            min_length=min(60, args.max_length),
            max_length=args.max_length,
            latent_dim=32,
            num_samples=64,
        )
        data = write_synthetic(shape, Path(scratch) / "data")
        overrides = [f"data.path={data}", *DEFAULTS, f"model.max_seq_len={args.max_length}", *args.overrides]
        count = host_operations if args.host else lambda trainer: step_operations(trainer, args.sites > 0)
        _, _, trainer, _ = build_reference(args.config, overrides, str(Path(scratch) / "reference"))
        depth = len(trainer.raw_model.blocks)
        rows = {"reference: plain transformer": count(trainer)}
        trainers = {"reference: plain transformer": trainer} if args.time else {}  # else one alive at a time
        for mode in ("l2t", "t2l", "joint"):
            run_dir = str(Path(scratch) / mode)
            _, _, trainer, _ = build_trainer(args.config, [*overrides, f"objective.mode={mode}"], run_dir)
            rows[mode] = count(trainer)
            if args.time:
                trainers[mode] = trainer
        times = step_times(trainers, args.time, args.steps) if args.time else None
    if args.host:
        print_host_calls(rows, args.top)
        return 0
    reference = rows["reference: plain transformer"]
    timed = " ms per step | x reference |" if times else ""
    print("| row | operations | per block | x reference | kernels | per block | x reference |" + timed)
    print("|---|---|---|---|---|---|---|" + "---|---|" * bool(times))
    for name, ops in rows.items():
        if times:
            ratios = [t / r for t, r in zip(times[name], times["reference: plain transformer"])]
            timed = f" {statistics.median(times[name]) * 1e3:.1f} | {statistics.median(ratios):.2f} |"
        print(
            f"| {name} | {ops.total:,} | {ops.total / depth:.0f} | {ops.total / reference.total:.2f} "
            f"| {ops.kernels:,} | {ops.kernels / depth:.0f} | {ops.kernels / reference.kernels:.2f} |" + timed
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


def store_stacked() -> None:
    """`--stacked`: `mmdit.stacked_parameters` answers each group of parameters with one leaf tensor
    of their values, made at its first use, its gradient cleared at every use as zero_grad would: the
    operations of a step with those parameters stored as one. The leaves are not trained (the
    optimizer steps the model's own parameters, whose gradients stay None); the counts and host
    times are what this measures."""
    import weakref

    import torch

    from mmldlm.model import mmdit

    # keyed by the parameters' ids, each leaf beside weak references to its parameters: a row's
    # trainer freed, the next row's parameters may take their ids, and get a leaf of their own
    leaves: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], torch.Tensor]] = {}

    def stacked_parameters(*params: torch.Tensor) -> torch.Tensor:
        key = tuple(map(id, params))
        refs, leaf = leaves.get(key, ((), None))
        if leaf is None or any(ref() is not p for ref, p in zip(refs, params)):
            leaf = torch.stack([p.detach() for p in params]).requires_grad_()
            leaves[key] = tuple(map(weakref.ref, params)), leaf
        leaf.grad = None
        return leaf

    mmdit.stacked_parameters = stacked_parameters


def step_times(trainers: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per row, the mean seconds of an eager step (`Trainer.train_step`, dispatched as counted) in each
    of `rounds` rounds of `steps` steps, the rows taking turns within a round (a machine's slow spell
    then falls on every row alike)."""
    from mmldlm.model.attention import dispatch_as_on_a_gpu

    found: dict[str, list[float]] = {name: [] for name in trainers}
    with dispatch_as_on_a_gpu():
        for _ in range(rounds):
            for name, trainer in trainers.items():
                started = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                found[name].append((time.perf_counter() - started) / steps)
    return found


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
