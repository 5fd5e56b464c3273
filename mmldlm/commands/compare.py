"""`mmldlm compare A B [--data DIR] [--num-samples N] [--seed S] [--out FILE.json]`: two runs (or two
checkpoints, exported models, decoders) on the same validation texts with the same sampling seeds, and a
paired bootstrap per figure (mmldlm/evaluation/compare.py): a table of A, B, A - B, its 95% interval and
whether it excludes 0, printed, and the same as JSON with --out.

A and B are training run directories or exported model folders, evaluated here with the same options
(those of `mmldlm eval`), or JSON reports `mmldlm eval` wrote, read as they are; reports of different
texts or seeds are refused. `mmldlm compare --a A1 A2 ... --b B1 B2 ...` compares two recipes, each
trained with several seeds: the arms' mean figures, with the variance between seeds in the interval."""

from __future__ import annotations

import argparse

from mmldlm.commands.evaluate import add_evaluation_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="A and B: two training run directories, exported model folders or JSON reports of `mmldlm eval`",
    )
    for arm in ("a", "b"):
        parser.add_argument(
            f"--{arm}",
            nargs="+",
            dest=f"arm_{arm}",
            metavar="RUN",
            help=f"instead of A and B: arm {arm.upper()} as several runs of one recipe (other training seeds), "
            "each a run, an export or a report; the interval then adds the variance between seeds",
        )
    parser.add_argument(
        "--no-ema",
        action="store_true",
        help="the raw trained weights of both runs instead of their EMA (where a run kept one)",
    )
    parser.add_argument(
        "--unpaired",
        action="store_true",
        help="A and B each scored on its own validation texts (runs trained on different data of one corpus): "
        "each run's texts resampled on their own; without it both must have scored the same texts",
    )
    parser.add_argument(
        "--null-comparisons",
        type=int,
        default=20,
        metavar="N",
        help="A against B with each text's values exchanged at random, N times: how many figures a comparison "
        "with no difference flags on these texts (one run per side, paired; 0: skip)",
    )
    add_evaluation_arguments(parser)
    parser.add_argument("--out", metavar="FILE.json", help="write the comparison here as JSON too")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from mmldlm.commands.evaluate import check_options, evaluation
    from mmldlm.errors import OptionError, UserError
    from mmldlm.evaluation.compare import compare_arms, markdown, null_flags
    from mmldlm.outputs import write_atomically

    check_options(args)
    if args.null_comparisons < 0:
        raise OptionError("--null-comparisons", args.null_comparisons, "0 (skip) or a positive integer")
    arm_a, arm_b = arms(args)
    for path in (*arm_a, *arm_b):  # every path refused before any is evaluated
        if not Path(path).exists():
            raise UserError(f"{path}: no such file or directory; expected a run, an exported model or an eval report")
    reports = {path: read_report(Path(path)) for path in (*arm_a, *arm_b) if Path(path).is_file()}
    for path in (*arm_a, *arm_b):
        if path not in reports:
            reports[path] = evaluation(args, path)[1]
    result = compare_arms(
        [reports[p] for p in arm_a], [reports[p] for p in arm_b], arm_a, arm_b, unpaired=args.unpaired
    )
    if len(arm_a) == len(arm_b) == 1 and not args.unpaired and args.null_comparisons > 0:
        result["null_flags"] = null_flags(reports[arm_a[0]], reports[arm_b[0]], args.null_comparisons)
    print(markdown(result), end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(out, json.dumps(result, indent=1) + "\n")
        print(f"mmldlm compare: wrote {out}")
    return 0


def arms(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The runs of arm A and of arm B: `A B`, or `--a ... --b ...`; UserError for anything else."""
    from mmldlm.errors import UserError

    if args.arm_a or args.arm_b:
        if args.runs or not (args.arm_a and args.arm_b):
            raise UserError(
                f"got {len(args.runs)} positional runs, --a {args.arm_a or []} and --b {args.arm_b or []}; "
                "expected either two runs A B, or --a RUN [RUN ...] and --b RUN [RUN ...]"
            )
        return list(args.arm_a), list(args.arm_b)
    if len(args.runs) != 2:
        raise UserError(
            f"got {len(args.runs)} run{'' if len(args.runs) == 1 else 's'} ({' '.join(args.runs) or 'none'}); "
            "expected two, A and B, or --a RUN [RUN ...] and --b RUN [RUN ...]"
        )
    return [args.runs[0]], [args.runs[1]]


def read_report(path) -> dict:
    """The JSON report of `mmldlm eval` at `path`; UserError naming the file when it is none."""
    import json

    from mmldlm.errors import UserError

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a JSON report of `mmldlm eval` ({err})") from None
    if not isinstance(report, dict):
        raise UserError(f"{path}: got a JSON {type(report).__name__}; expected a report of `mmldlm eval`")
    return report
