"""The report of scripts/gpu_session.sh, written part by part: `start` begins it (date, mode, device,
driver, torch, data), each `part` appends one part's section (its command, exit status, seconds
against its limit, and what it measured) the moment the part ends, `end` closes it. After every call
the report so far stands in REPORT between the markers START and END (scripts/gpu_report.py's
splice), so a session cut off keeps every part that ended.

    python scripts/gpu_session_report.py --report REPORT --section OUT/session.md start --mode gpu --data DIR
    python scripts/gpu_session_report.py --report ... --section ... part --title T --status 0 --seconds 50 \\
        --budget 60 --log LOG --command 'CMD' [--tests | --bench DIR | --ladder DIR | --profile DIR]
    python scripts/gpu_session_report.py --report ... --section ... end
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from gpu_report import bench_section, device_line, splice

START, END = "<!-- gpu_session report: start -->", "<!-- gpu_session report: end -->"
ROW_LINE = re.compile(r"^bench: [^:]+: [0-9.]+ samples/s")
TIMED_OUT = (124, 137)  # timeout(1): stopped at the limit, or killed after its grace period
PROFILE_LINES = 40  # of profile.txt: the step's wall and device-busy lines and the top kernels by device time


def start_lines(mode: str, data: str) -> list[str]:
    meta_path = Path(data) / "meta.json"
    rehearsal = " (the CPU rehearsal: tiny shapes, figures meaningless)" if mode == "cpu" else ""
    return [
        f"## Report of `scripts/gpu_session.sh` ({datetime.datetime.now().isoformat(timespec='seconds')})",
        "",
        f"Written by `bash scripts/gpu_session.sh{' --cpu' if mode == 'cpu' else ''}`{rehearsal}, part by part.",
        "",
        f"Device: {device_line()}.",
        "",
        data_line(data, meta_path),
        "",
    ]


def data_line(data: str, meta_path: Path) -> str:
    if not meta_path.exists():
        return f"Data of parts 2 and 3: {data} (not prepared: those parts were off)."
    meta = json.loads(meta_path.read_text())
    return (
        f"Data of parts 2 and 3: {data} ({meta['splits']['train']:,} train + {meta['splits']['val']:,} val "
        f"texts, vocabulary {meta['vocab_size']:,}, latents {meta['num_latents']}x{meta['latent_dim']} from "
        f"{meta['encoder']})."
    )


def outcome(status: int, seconds: int, budget: int) -> str:
    if status == 0:
        return f"done in {seconds} s of its {budget} s"
    if status in TIMED_OUT:
        return f"**cut off** at its limit of {budget} s (what it finished is below)"
    return f"**failed** with exit status {status} after {seconds} s of its {budget} s"


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1] if lines else "(no output)"


def measured_rows(path: Path) -> list[str]:
    """The lines in which bench logs each row's figures the moment it is measured (tools/bench.py's
    `_row_line`): what a bench cut off before its report had already measured."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if ROW_LINE.match(line)]


def part_lines(args: argparse.Namespace) -> list[str]:
    lines = [
        f"### {args.title}",
        "",
        f"`{args.command}`",
        "",
        f"{outcome(args.status, args.seconds, args.budget)}; output in {args.log}.",
        "",
    ]
    if args.status != 0 or args.tests:
        lines += ["```", last_line(Path(args.log)), "```", ""]
    rows = measured_rows(Path(args.log)) if args.bench and args.status != 0 else []
    if rows:
        lines += ["Rows it measured before it ended (its log):", "", *(f"- {row}" for row in rows), ""]
    for directory in args.bench:
        lines.append(bench_section(directory).replace("### mmldlm bench", "#### mmldlm bench", 1))
    if args.ladder:
        table = Path(args.ladder) / "ladder.md"
        lines.append(table.read_text() if table.exists() else f"(no {table}: the rung did not finish)\n")
    if args.output:  # a script whose output is its table
        text = Path(args.log).read_text(errors="replace").splitlines() if Path(args.log).exists() else []
        lines += [line for line in text if line.startswith(("|", "#", "padded"))] + [""]
    if args.profile:
        profile = Path(args.profile) / "profile.txt"
        head = profile.read_text().splitlines()[:PROFILE_LINES] if profile.exists() else None
        lines += ["```", *head, "```", ""] if head else [f"(no {profile}: the profile did not finish)", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True, help="the markdown file to write the report into")
    parser.add_argument("--section", type=Path, required=True, help="the session's report so far (its own file)")
    sub = parser.add_subparsers(dest="action", required=True)
    begin = sub.add_parser("start")
    begin.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    begin.add_argument("--data", required=True, help="the prepared dataset of parts 2 and 3")
    part = sub.add_parser("part")
    part.add_argument("--title", required=True)
    part.add_argument("--command", required=True)
    part.add_argument("--status", type=int, required=True, help="the part's exit status")
    part.add_argument("--seconds", type=int, required=True)
    part.add_argument("--budget", type=int, required=True, help="the part's time limit in seconds")
    part.add_argument("--log", required=True)
    part.add_argument("--tests", action="store_true", help="the part ran pytest: show its summary line")
    part.add_argument("--bench", action="append", default=[], help="a bench's output directory")
    part.add_argument("--ladder", help="a writing_ladder.py output directory")
    part.add_argument("--output", action="store_true", help="show the lines of the log that are its table")
    part.add_argument("--profile", help="a profile_step.py output directory: the head of its profile.txt")
    sub.add_parser("end")
    args = parser.parse_args(argv)

    if args.action == "start":
        text = "\n".join(start_lines(args.mode, args.data)).rstrip() + "\n\n"
    elif args.action == "part":
        text = args.section.read_text() + "\n".join(part_lines(args)).rstrip() + "\n\n"
    else:
        text = args.section.read_text() + f"Session ended {datetime.datetime.now().isoformat(timespec='seconds')}.\n"
    args.section.parent.mkdir(parents=True, exist_ok=True)
    args.section.write_text(text)
    splice(args.report, START, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
