"""Write the GPU suite's report (scripts/gpu_suite.sh): the device, the CUDA tests' summary and each
bench's table, as markdown. Where OUT already holds the markers START and END, only the text between
them is replaced (the hand-written analysis around it stays); otherwise the report is appended to
OUT between them. scripts/gpu_session_report.py writes scripts/gpu_session.sh's report with the
same pieces.

    python scripts/gpu_report.py --out docs/benchmarks-gpu.md --tests TESTS_LOG BENCH_DIR [BENCH_DIR ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

START, END = "<!-- gpu_suite report: start -->", "<!-- gpu_suite report: end -->"


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device; torch {torch.__version__}"
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
        f"driver {driver}; torch {torch.__version__} (CUDA {torch.version.cuda})"
    )


def bench_section(directory: str | Path) -> str:
    """The markdown of one bench's report (its title one level down), or a line saying it has none."""
    from mmldlm.tools.bench import markdown

    path = Path(directory) / "bench.json"
    if not path.exists():
        return f"### {directory}\n\n(no bench.json: that bench failed; see its output)\n"
    report = json.loads(path.read_text())
    return markdown(report).replace("# mmldlm bench", "### mmldlm bench", 1).strip() + "\n"


def splice(out: Path, start: str, end: str, body: str) -> None:
    """Write `body` into `out` between the markers `start` and `end`, keeping the text around them; a
    file without them gets them appended (a new file: under a "# GPU benchmarks" title)."""
    text = out.read_text() if out.exists() else "# GPU benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start) + len(start)] + "\n" + body + text[text.index(end) :]
    else:
        text = f"{text.rstrip()}\n\n{start}\n{body}{end}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="+", metavar="BENCH_DIR", help="directories holding bench.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tests", help="the log of `pytest -m cuda`")
    parser.add_argument("--seconds", type=int, help="the suite's wall time")
    args = parser.parse_args(argv)

    lines = [
        f"## Report of `scripts/gpu_suite.sh` ({datetime.date.today().isoformat()})",
        "",
        "Written by `bash scripts/gpu_suite.sh`"
        + (f" in {args.seconds // 60} min {args.seconds % 60} s" if args.seconds else "")
        + ".",
        "",
        f"Device: {device_line()}.",
        "",
    ]
    if args.tests:
        log = Path(args.tests).read_text().strip().splitlines()
        lines += ["### CUDA tests (`pytest -m cuda`)", "", "```", log[-1] if log else "(no output)", "```", ""]
    lines += [bench_section(directory) for directory in args.benches]
    splice(Path(args.out), START, END, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
