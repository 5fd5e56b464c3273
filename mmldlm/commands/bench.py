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
    add_row_arguments(parser)
    add_synthetic_arguments(parser)
    add_measurement_arguments(parser)
    parser.add_argument(
        "--out", default="runs/bench", help="directory for bench.json and bench.md (default runs/bench)"
    )


def add_row_arguments(parser: argparse.ArgumentParser) -> None:
    """What is compared: the two configs, the ladder between them and further variants."""
    parser.add_argument(
        "--baseline",
        default="baseline",
        help="first config, optionally with overrides of its own: 'optimized distributed.strategy=ddp' "
        "(default: configs/baseline.yaml)",
    )
    parser.add_argument(
        "--optimized", default="optimized", help="second config, likewise (default: configs/optimized.yaml)"
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="also every step between: baseline, then one group of performance keys at a time",
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="'NAME [section.key=value ...]'",
        help="a further row, set against the baseline like the optimized one; repeatable, e.g. "
        "--variant 'optimized perf.activation_checkpointing=full'",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="a last row: a plain transformer of the optimized config's text-stream dimensions (no latent "
        "stream, no padding: full rows of the data's longest text), with its precision, optimizer and "
        "compile; every row's tokens/s and MFU are also given over the reference's",
    )


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    synthetic = parser.add_argument_group(
        "synthetic data",
        "any of these replaces data.path by random tokens and latents of the given shape, written to "
        "OUT/synthetic-data (no corpus, tokenizer or encoder needed; the report states the distribution); "
        "an option left out takes the older codebase's shape (mmldlm/data/synthetic.py)",
    )
    synthetic.add_argument("--synthetic-vocab", type=int, help="vocabulary entries, [PAD] and [MASK] included")
    synthetic.add_argument(
        "--synthetic-lengths", metavar="MIN:MAX", help="tokens per text, drawn uniformly from MIN..MAX"
    )
    synthetic.add_argument("--synthetic-latent-dim", type=int, help="latent width D (one latent per text)")
    synthetic.add_argument("--synthetic-samples", type=int, help="train texts")


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """How each row is measured: steps and turns, the largest-micro-batch search, processes."""
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps per config (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per config first (default 3)")
    parser.add_argument(
        "--round-steps",
        type=int,
        default=2,
        help="steps per config per turn; the configs take turns until --steps (default 2)",
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
        "--rows",
        choices=("auto", "in-turns", "one-at-a-time"),
        default="auto",
        help="in-turns: the configs take turns, a few steps each, round after round (a shared machine's "
        "slow phases hit each alike); one-at-a-time: each config alone, one after another (a waiting "
        "config holds none of the GPU's memory); auto: in turns on a CPU, one at a time on a GPU "
        "(default auto)",
    )


def _synthetic_spec(args: argparse.Namespace):
    """The SyntheticShape of the --synthetic-* options, None where none is given."""
    from mmldlm.data.synthetic import SyntheticShape, parse_lengths  # here: the CLI imports no library at start-up

    given = {
        "vocab_size": args.synthetic_vocab,
        "latent_dim": args.synthetic_latent_dim,
        "num_samples": args.synthetic_samples,
    }
    if args.synthetic_lengths is not None:
        given["min_length"], given["max_length"] = parse_lengths(args.synthetic_lengths)
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return None
    shape = SyntheticShape(**given)
    shape.check()
    return shape


def _command_line(args: argparse.Namespace, fit: bool) -> str:
    """The bench command as run, every option spelled out."""
    synthetic = {
        "--synthetic-vocab": args.synthetic_vocab,
        "--synthetic-lengths": args.synthetic_lengths,
        "--synthetic-latent-dim": args.synthetic_latent_dim,
        "--synthetic-samples": args.synthetic_samples,
    }
    return " ".join(
        [
            "mmldlm bench",
            *map(shlex.quote, args.overrides),
            *(f"{key} {shlex.quote(str(value))}" for key, value in synthetic.items() if value is not None),
            f"--baseline {shlex.quote(args.baseline)}",
            f"--optimized {shlex.quote(args.optimized)}",
            *(f"--variant {shlex.quote(variant)}" for variant in args.variants),
            *(["--reference"] if args.reference else []),
            *([f"--processes {args.processes}"] if args.processes > 1 else []),
            *([f"--rows {args.rows}"] if args.rows != "auto" else []),
            f"--steps {args.steps}",
            f"--warmup {args.warmup}",
            f"--round-steps {args.round_steps}",
            *(["--ladder"] if args.ladder else []),
            *(
                [f"--memory-cap-gib {args.memory_cap_gib:g}", f"--max-micro-batch {args.max_micro_batch}"]
                if fit
                else ["--no-fit"]
            ),
            f"--out {shlex.quote(args.out)}",
        ]
    )


def run(args: argparse.Namespace) -> int:
    from mmldlm.errors import OptionError, require_positive
    from mmldlm.tools.bench import BenchOptions, markdown, run_bench

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
        variants=args.variants,
        reference=args.reference,
        synthetic=_synthetic_spec(args),
        fit=args.fit and args.processes == 1,
        memory_cap_gib=args.memory_cap_gib,
        max_micro_batch=args.max_micro_batch,
        processes=args.processes,
        rows=args.rows,
        out=args.out,
    )
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run_bench(opts, command=_command_line(args, opts.fit))
    print(markdown(report))
    print(f"wrote {args.out}/bench.json and {args.out}/bench.md")
    return 0
