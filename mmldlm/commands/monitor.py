"""`mmldlm monitor RUN_DIR|metrics.jsonl`: follow a run's metrics, show its status, raise alerts,
write a health report and a plot. Exit status 0 healthy, 1 warnings (with --strict), 2 critical,
so it can gate a job."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="RUN_DIR|metrics.jsonl", help="a run directory or its metrics.jsonl")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between polls (default 2)")
    parser.add_argument(
        "--once",
        action="store_true",
        help="read the file as it is now and exit (default: follow until the run completes, "
        "is stopped by a signal, or stalls)",
    )
    parser.add_argument("--report", metavar="PATH", help="write the health report (JSON) here")
    parser.add_argument("--plot", metavar="PATH", help="plot the curves against step into this PNG")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=600.0,
        metavar="S",
        help="no new record for this long: the run has stalled (critical; default 600)",
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from mmldlm.errors import OptionError
    from mmldlm.tools.monitor import Monitor, exit_code, follow, plot, write_report

    for key, value in (("--interval", args.interval), ("--stall-seconds", args.stall_seconds)):
        if not value > 0:
            raise OptionError(key, value, "a number of seconds > 0")
    monitor = Monitor(args.target, stall_seconds=args.stall_seconds)
    try:
        status = follow(monitor, interval=args.interval, once=args.once)
    except FileNotFoundError as err:
        print(f"mmldlm monitor: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while following: still write what was asked for
        status = monitor.report()["status"]
    if args.report:
        write_report(monitor.report(), args.report)
        print(f"health report: {args.report}")
    if args.plot:
        alerts = sorted(monitor.alerts + monitor.history.notes, key=lambda a: a.step)
        plot(monitor.history.records, args.plot, alerts, monitor.history.tracker.slowdowns)
        print(f"plot: {args.plot}")
    return exit_code(status, args.strict)
