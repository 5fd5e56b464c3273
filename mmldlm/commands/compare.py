"""`mmldlm compare A B [--data DIR] [--num-samples N] [--seed S] [--out FILE.json]`: two runs (or two
checkpoints, exported models, decoders) on the same validation texts with the same sampling seeds, and a
paired bootstrap per figure (mmldlm/sampling/compare.py): a table of A, B, A - B, its 95% interval and
whether it excludes 0, printed, and the same as JSON with --out.

A and B are training run directories or exported model folders, evaluated here with the same options
(those of `mmldlm eval`), or JSON reports `mmldlm eval` wrote, read as they are; reports of different
texts or seeds are refused."""

from __future__ import annotations

import argparse

from mmldlm.commands.evaluate import add_evaluation_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name in ("a", "b"):
        parser.add_argument(
            name,
            metavar=f"RUN_{name.upper()}",
            help="a training run directory, an exported model folder, or a JSON report of `mmldlm eval`",
        )
    parser.add_argument(
        "--no-ema",
        action="store_true",
        help="the raw trained weights of both runs instead of their EMA (where a run kept one)",
    )
    add_evaluation_arguments(parser)
    parser.add_argument("--out", metavar="FILE.json", help="write the comparison here as JSON too")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from mmldlm.commands.evaluate import check_options, evaluation
    from mmldlm.errors import UserError
    from mmldlm.sampling.compare import compare_reports, markdown

    check_options(args)
    for path in (args.a, args.b):  # both refused before either is evaluated
        if not Path(path).exists():
            raise UserError(f"{path}: no such file or directory; expected a run, an exported model or an eval report")
    reports = {path: read_report(Path(path)) for path in (args.a, args.b) if Path(path).is_file()}
    for path in (args.a, args.b):
        if path not in reports:
            reports[path] = evaluation(args, path)[1]
    result = compare_reports(reports[args.a], reports[args.b], names=(args.a, args.b))
    print(markdown(result), end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"mmldlm compare: wrote {out}")
    return 0


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
