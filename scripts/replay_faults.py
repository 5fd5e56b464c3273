"""Replay faults into a real run's metrics and report what `mmldlm monitor` says about each.

    python scripts/replay_faults.py runs/default/metrics.jsonl [--points 7] [--last-step N]

First the alerts on the file as it is (a healthy run should have none), then for each fault of
mmldlm/tools/faults.py injected at `--points` places spread over the run (from 20% of its records,
leaving 35 after the last): how often the right alert came, how many records after the fault
began, and any other alert the fault caused. One markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics

from mmldlm.tools import faults

AFTER = 35  # records after the last injection point: a memory_creep needs 30 records of history

FAULTS = {  # name: (expected alert, inject(records, first_step))
    "busy process from here on (-40% samples/s)": (
        "throughput_drop",
        lambda r, s: faults.slowdown(r, s, 10**9, drop=0.4),
    ),
    "busy process for 50 steps (-40%)": ("throughput_drop", lambda r, s: faults.slowdown(r, s, 50, drop=0.4)),
    "loader stall (+0.2 s wait per step, 100 steps)": (
        "data_wait",
        lambda r, s: faults.loader_stall(r, s, 100, seconds=0.2),
    ),
    "leak of 3 MiB per step": ("memory_creep", lambda r, s: faults.leak(r, s, mib_per_step=3.0)),
    "leak of 1 MiB per step": ("memory_creep", lambda r, s: faults.leak(r, s, mib_per_step=1.0)),
    "NaN loss": ("nonfinite", faults.nonfinite),
}


def replay(records: list[dict], expected: str, inject, first_step: int) -> tuple[int | None, list[str]]:
    """(records from the fault's first to the expected alert, counted from 1; None if it never
    came) and the other alerts the faulty records raised."""
    steps = [r["step"] for r in records if "loss" in r]
    alerts = faults.alerts_of(inject(records, first_step))
    hits = [a for a in alerts if a.kind == expected and a.step >= first_step]
    latency = len([s for s in steps if first_step <= s <= hits[0].step]) if hits else None
    return latency, [f"{a.kind}@{a.step}" for a in alerts if a is not (hits[0] if hits else None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--points", type=int, default=7, help="injection points spread over the run")
    parser.add_argument("--last-step", type=int, help="only the records up to this step (a healthy stretch)")
    args = parser.parse_args()
    with open(args.metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if args.last_step is None or r["step"] <= args.last_step]
    steps = [r["step"] for r in records if "loss" in r]
    healthy = faults.alerts_of(records)
    print(f"{args.metrics}: {len(steps)} records, steps {steps[0]}-{steps[-1]}")
    print(f"as recorded: {len(healthy)} alert(s) {[f'{a.kind}@{a.step}' for a in healthy]}\n")
    # From 20% of the run to the last place that leaves a memory window and a few records after it.
    low, high = len(steps) // 5, max(len(steps) // 5, len(steps) - AFTER)
    firsts = [steps[low + (high - low) * i // max(args.points - 1, 1)] for i in range(args.points)]
    print(f"injected at steps {firsts}\n")
    print("| fault | expected alert | detected | records to detection (median, max) | other alerts |")
    print("|---|---|---|---|---|")
    for name, (expected, inject) in FAULTS.items():
        results = [replay(records, expected, inject, first) for first in firsts]
        latencies = [lat for lat, _ in results if lat is not None]
        others = sorted({o for _, other in results for o in other} - {f"{a.kind}@{a.step}" for a in healthy})
        spread = f"{statistics.median(latencies):g}, {max(latencies)}" if latencies else "-"
        print(f"| {name} | {expected} | {len(latencies)}/{len(firsts)} | {spread} | {', '.join(others) or 'none'} |")


if __name__ == "__main__":
    main()
