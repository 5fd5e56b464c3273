"""Write the GPU suite's report (scripts/gpu_suite.sh): the device, the CUDA tests' summary and each
bench's table, as markdown. Where OUT already holds the markers START and END, only the text between
them is replaced (the hand-written analysis around it stays); otherwise OUT is written whole.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="+", metavar="BENCH_DIR", help="directories holding bench.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tests", help="the log of `pytest -m cuda`")
    parser.add_argument("--seconds", type=int, help="the suite's wall time")
    args = parser.parse_args(argv)

    from mmldlm.tools.bench import markdown

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
    for directory in args.benches:
        path = Path(directory) / "bench.json"
        if not path.exists():
            lines += [f"### {directory}", "", "(no bench.json: that bench failed; see its output)", ""]
            continue
        report = json.loads(path.read_text())
        lines += [markdown(report).replace("# mmldlm bench", "### mmldlm bench", 1).strip(), ""]
    body = "\n".join(lines)
    out = Path(args.out)
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        text = text[: text.index(START) + len(START)] + "\n" + body + text[text.index(END) :]
    else:
        text = f"# GPU benchmarks\n\n{START}\n{body}{END}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
