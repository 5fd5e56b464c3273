"""Writing and reading against training compute, one command on any device: a ladder of training budgets,
each trained and evaluated with the same figures, as one markdown table and one plot against training FLOPs.

    python scripts/writing_ladder.py --minutes 40 --out runs/ladder                   # a GPU: 40 minutes
    python scripts/writing_ladder.py --minutes 6 --out /tmp/ladder data.path=DIR      # a CPU smoke ladder

1. Speed: each rung's preset trains a few steps (`--timing-steps`) on this device and is evaluated once;
   the mean step time (after the first steps), the start-up and the evaluation seconds are measured,
   not assumed.
2. Budgets: a rung `PRESET:M` trains M units of samples (tiny:1, tiny:4, tiny:16 and small:16 by
   default); one unit is sized so that all rungs together, with their start-ups and evaluations (as
   measured in 1.), fit what is left of `--minutes` with a 10% margin.
3. Each rung: `mmldlm train --config CONFIG model=PRESET train.steps=N` (its warmup scaled to the run,
   no evaluation during training), then `mmldlm eval` (`--eval-args`, by default 128 validation texts
   with one text per latent, so no figure is the one a decoder selected on).
4. Out: OUT/ladder.md (one row per rung: samples, training FLOPs, minutes, and the figures with their
   95% intervals where the report has them), OUT/ladder.json, OUT/ladder.png (each figure against
   training FLOPs, log x, with the intervals as error bars).
Extra arguments `section.key=value` go to every rung's training (for example `data.path=DIR`).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mmldlm.device import describe_device
from mmldlm.evaluation.report import eval_metrics

# (label, eval_* key of mmldlm.evaluation.report.eval_metrics, format, scale)
FIGURES = (
    ("t2l retrieval@1", "eval_t2l_retrieval_at_1", "{:.1f}%", 100.0),
    ("t2l cosine", "eval_t2l_cosine_mean", "{:.3f}", 1.0),
    ("l2t word F1", "eval_l2t_word_f1", "{:.3f}", 1.0),
    ("l2t BLEU", "eval_l2t_bleu", "{:.1f}", 1.0),
    ("l2t exact", "eval_l2t_exact_match", "{:.1f}%", 100.0),
    ("l2t nats/token", "eval_elbo_l2t_text_nats_per_token", "{:.3f}", 1.0),
)


def parse_rungs(text: str) -> list[tuple[str, float]]:
    rungs = []
    for part in text.split(","):
        preset, _, units = part.partition(":")
        try:
            rungs.append((preset.strip(), float(units or 1)))
        except ValueError:
            raise SystemExit(f"writing_ladder.py: --rungs: got {part!r}; expected PRESET:UNITS, e.g. tiny:4") from None
        if rungs[-1][1] <= 0:
            raise SystemExit(f"writing_ladder.py: --rungs: got {part!r}; expected UNITS > 0")
    return rungs


def mmldlm(args: list[str], log: Path) -> float:
    """Run `python -m mmldlm.cli ARGS`, its output appended to `log`; the wall seconds it took."""
    start = time.perf_counter()
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ mmldlm {shlex.join(args)}\n")
        out.flush()
        done = subprocess.run([sys.executable, "-m", "mmldlm.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"writing_ladder.py: `mmldlm {shlex.join(args)}` exited {done.returncode}; see {log}")
    return time.perf_counter() - start


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if "step_time_s" in r]


def train_args(config: str, preset: str, steps: int, run_dir: Path, extra: list[str]) -> list[str]:
    return [
        "train",
        "--config",
        config,
        f"model={preset}",
        f"train.steps={steps}",
        f"train.run_dir={run_dir}",
        f"schedule.warmup_steps={max(1, steps // 20)}",
        f"checkpoint.every={steps}",
        "eval.every=0",
        *extra,
    ]


def measure_speed(preset: str, args, out: Path) -> dict:
    """Seconds per training step (the mean after the first quarter: bucketed batches vary in length, and
    the total is what matters), the run's fixed start-up seconds and the seconds of one evaluation
    (`--eval-args`), measured on a short run of `preset`."""
    run_dir = out / f"timing-{preset}"
    steps = args.timing_steps
    wall = mmldlm(
        [*train_args(args.config, preset, steps, run_dir, args.overrides), "train.log_every=1"], out / "log.txt"
    )
    times = [r["step_time_s"] for r in records(run_dir)]
    eval_s = mmldlm(evaluate_args(run_dir, args.eval_args), out / "log.txt")
    return {
        "step_s": statistics.mean(times[len(times) // 4 :]),
        "startup_s": max(0.0, wall - sum(times)),
        "eval_s": eval_s,
        "global_batch_size": records(run_dir)[-1]["global_batch_size"],
    }


def evaluate_args(run_dir: Path, eval_args: str) -> list[str]:
    return ["eval", "--run", str(run_dir), "--out", str(run_dir / "eval.json"), *shlex.split(eval_args)]


def plan(rungs, speeds: dict, seconds_left: float, safety: float = 0.9) -> list[dict]:
    """Steps per rung: one unit of samples sized so that the rungs, with their start-ups and evaluations,
    fit `seconds_left` (less a margin for the noise of the timings)."""
    fixed = sum(speeds[p]["startup_s"] + speeds[p]["eval_s"] for p, _ in rungs)
    train_s = max(seconds_left * safety - fixed, 0.0)
    seconds_per_unit_sample = sum(units * speeds[p]["step_s"] / speeds[p]["global_batch_size"] for p, units in rungs)
    unit = train_s / seconds_per_unit_sample
    if train_s < fixed:
        print(
            f"writing_ladder.py: {seconds_left:.0f} s are left for {len(rungs)} rungs whose start-ups and evaluations "
            f"take {fixed:.0f} s: the rungs train {train_s:.0f} s in all; give more --minutes to decide anything",
            flush=True,
        )
    out = []
    for preset, units in rungs:
        batch = speeds[preset]["global_batch_size"]
        steps = max(1, round(units * unit / batch))
        out.append({"preset": preset, "units": units, "steps": steps, "samples": steps * batch})
    return out


def estimate(metrics: dict, key: str) -> tuple[float, float | None, float | None] | None:
    """(value, low, high) of an eval_* figure; low/high from its interval keys where the report has them."""
    if key not in metrics or not isinstance(metrics[key], int | float):
        return None
    low, high = metrics.get(f"{key}_low"), metrics.get(f"{key}_high")
    return float(metrics[key]), low, high


def cell(est, fmt: str, scale: float) -> str:
    if est is None:
        return "-"
    value, low, high = est
    text = fmt.format(value * scale)
    if low is not None and high is not None:
        text += f" [{fmt.format(low * scale).rstrip('%')}, {fmt.format(high * scale)}]"
    return text


def markdown(rows: list[dict], header: str) -> str:
    names = " | ".join(label for label, *_ in FIGURES)
    lines = [header, "", f"| rung | steps | samples | training FLOPs | minutes | {names} |"]
    lines.append("|" + "---|" * (5 + len(FIGURES)))
    for r in rows:
        cells = " | ".join(cell(r["figures"].get(key), fmt, scale) for _, key, fmt, scale in FIGURES)
        lines.append(
            f"| {r['preset']}:{r['units']:g} | {r['steps']} | {r['samples']:,} | {r['train_flops']:.2e} | "
            f"{r['minutes']:.1f} | {cells} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for (label, key, _, scale), ax in zip(FIGURES, axes.flat):
        points = [(r["train_flops"], r["figures"][key]) for r in rows if r["figures"].get(key)]
        for flops, (value, low, high) in points:
            err = None if low is None else [[(value - low) * scale], [(high - value) * scale]]
            ax.errorbar([flops], [value * scale], yerr=err, marker="o", capsize=3, color="C0")
        ax.set_title(label)
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="the whole ladder's time on this device")
    parser.add_argument("--out", type=Path, required=True, help="the ladder's directory (runs, table, plot)")
    parser.add_argument("--config", default="default", help="the run config every rung starts from (default: default)")
    parser.add_argument(
        "--rungs", default="tiny:1,tiny:4,tiny:16,small:16", help="PRESET:UNITS,... (default: %(default)s)"
    )
    parser.add_argument("--eval-args", default="--num-samples 128 --best-of 1", help="options of each `mmldlm eval`")
    parser.add_argument("--timing-steps", type=int, default=32, help="steps of each preset's speed measurement")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides of every rung's training")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.timing_steps < 4:
        parser.error("expected --minutes > 0 and --timing-steps >= 4")
    rungs = parse_rungs(args.rungs)
    # Each run directory is named by its preset and rung: `mmldlm train` would refuse an earlier
    # ladder's, a rung's after minutes of the runs before it, so say so before any starts.
    earlier = sorted(p.name for pattern in ("timing-*", "rung-*") for p in args.out.glob(pattern) if p.is_dir())
    if earlier:
        parser.error(
            f"--out {args.out} already holds an earlier ladder's runs ({', '.join(earlier)});"
            " expected a new or empty directory: choose another --out, or move those runs away"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    speeds = {preset: measure_speed(preset, args, args.out) for preset in dict.fromkeys(p for p, _ in rungs)}
    rows = []
    for i, rung in enumerate(plan(rungs, speeds, args.minutes * 60.0 - (time.perf_counter() - started))):
        run_dir = args.out / f"rung-{i}-{rung['preset']}-{rung['units']:g}"
        wall = mmldlm(
            train_args(args.config, rung["preset"], rung["steps"], run_dir, args.overrides), args.out / "log.txt"
        )
        report = run_dir / "eval.json"
        wall += mmldlm(
            ["eval", "--run", str(run_dir), "--out", str(report), *shlex.split(args.eval_args)], args.out / "log.txt"
        )
        flops = [r["train_flops"] for r in records(run_dir)]
        figures = eval_metrics(json.loads((run_dir / "eval.json").read_text(encoding="utf-8")))
        rows.append(
            {
                **rung,
                "run_dir": str(run_dir),
                "train_flops": statistics.mean(flops) * rung["steps"] if flops else math.nan,
                "minutes": wall / 60.0,
                "figures": {key: estimate(figures, key) for _, key, _, _ in FIGURES},
            }
        )
        print(f"writing_ladder.py: {rung['preset']}:{rung['units']:g} done ({wall / 60:.1f} min)", flush=True)

    elapsed = (time.perf_counter() - started) / 60.0
    device = describe_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    command = shlex.join(["python", "scripts/writing_ladder.py", *(argv or sys.argv[1:])])
    header = (
        f"Writing and reading against training compute ({elapsed:.1f} of {args.minutes:g} min, {device}; `{command}`)"
    )
    (args.out / "ladder.md").write_text(markdown(rows, header), encoding="utf-8")
    (args.out / "ladder.json").write_text(json.dumps({"speeds": speeds, "rungs": rows}, indent=1) + "\n")
    plot(rows, args.out / "ladder.png")
    print(markdown(rows, header), end="")
    print(f"writing_ladder.py: wrote {args.out / 'ladder.md'}, ladder.json and ladder.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
