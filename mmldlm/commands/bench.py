"""`mmldlm bench [section.key=value ...]`: baseline vs optimized (or any two configs) on the same model
and data, interleaved in one run; `--ladder` adds one optimization at a time. Writes OUT/bench.json
and OUT/bench.md (see mmldlm/tools/bench.py for how each figure is measured)."""

from __future__ import annotations

import argparse
import shlex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides applied to every config, e.g. model=small data.path=DIR",
    )
    parser.add_argument(
        "--baseline",
        default="baseline",
        help="first config, optionally with overrides of its own: 'optimized distributed.strategy=ddp' "
        "(default: configs/baseline.yaml)",
    )
    parser.add_argument(
        "--optimized", default="optimized", help="second config, likewise (default: configs/optimized.yaml)"
    )
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps per config (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per config first (default 3)")
    parser.add_argument(
        "--round-steps",
        type=int,
        default=2,
        help="steps per config per turn; the configs take turns until --steps (default 2)",
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="also every step between: baseline, then one group of performance keys at a time",
    )
    parser.add_argument(
        "--no-fit",
        dest="fit",
        action="store_false",
        help="skip the search for the largest micro-batch under --memory-cap-gib",
    )
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        default=8.0,
        help="memory cap of the largest-micro-batch search: CUDA allocation, or CPU RSS (default 8)",
    )
    parser.add_argument("--max-micro-batch", type=int, default=512, help="largest micro-batch tried (default 512)")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run each config as this many ranks on this machine (gloo on CPU, one GPU each on "
        "CUDA) and report memory per process: DDP vs FSDP2 (default 1; implies --no-fit)",
    )
    parser.add_argument(
        "--out", default="runs/bench", help="directory for bench.json and bench.md (default runs/bench)"
    )


def run(args: argparse.Namespace) -> int:
    from mmldlm.errors import OptionError, require_positive
    from mmldlm.tools.bench import BenchOptions, run_bench

    require_positive(
        {
            "--steps": args.steps,
            "--round-steps": args.round_steps,
            "--max-micro-batch": args.max_micro_batch,
            "--processes": args.processes,
        }
    )
    if args.warmup < 0:
        raise OptionError("--warmup", args.warmup, "an integer >= 0")
    if args.memory_cap_gib <= 0:
        raise OptionError("--memory-cap-gib", args.memory_cap_gib, "a number of GiB > 0")
    opts = BenchOptions(
        baseline=args.baseline,
        optimized=args.optimized,
        overrides=args.overrides,
        steps=args.steps,
        warmup=args.warmup,
        round_steps=args.round_steps,
        ladder=args.ladder,
        fit=args.fit and args.processes == 1,
        memory_cap_gib=args.memory_cap_gib,
        max_micro_batch=args.max_micro_batch,
        processes=args.processes,
        out=args.out,
    )
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = " ".join(
        [
            "mmldlm bench",
            *map(shlex.quote, args.overrides),
            f"--baseline {shlex.quote(args.baseline)}",
            f"--optimized {shlex.quote(args.optimized)}",
            *([f"--processes {args.processes}"] if args.processes > 1 else []),
            f"--steps {args.steps}",
            f"--warmup {args.warmup}",
            f"--round-steps {args.round_steps}",
            *(["--ladder"] if args.ladder else []),
            *(
                [f"--memory-cap-gib {args.memory_cap_gib:g}", f"--max-micro-batch {args.max_micro_batch}"]
                if opts.fit
                else ["--no-fit"]
            ),
            f"--out {shlex.quote(args.out)}",
        ]
    )
    report = run_bench(opts, command=command)
    from mmldlm.tools.bench import markdown

    print(markdown(report))
    print(f"wrote {args.out}/bench.json and {args.out}/bench.md")
    return 0
