"""How far a figure moves between training seeds of one recipe: the yardstick for a comparison run once per
arm. For k runs (the same config, other `train.seed`) it prints each figure's value per run, the mean,
the standard deviation between seeds, and the half-width of a 95% interval of the difference between
two single runs of one recipe, t(0.975, k - 1) * sqrt(2) * sd: a difference between two configurations
trained once each decides only where it exceeds that.

    python scripts/seed_spread.py runs/default runs/default-seed1 runs/default-seed2 runs/default-seed3
    python scripts/seed_spread.py runs/default*/eval/step-0004000.json       # full eval reports
    python scripts/seed_spread.py runs/default runs/default-seed1 --step 2000 --figures eval_l2t_bleu

Run directories are read from their metrics.jsonl (the evaluation during training, at `--step`, default
the last step all runs evaluated); JSON files are reports of `mmldlm eval` (mmldlm/evaluation/evaluate.py
`eval_metrics`). Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

# The figures docs/quality.md decides by, as metrics.jsonl names them.
FIGURES = (
    "eval_elbo_l2t_text_nats_per_token",
    "eval_elbo_t2l_latent_loss",
    "eval_t2l_cosine_mean",
    "eval_t2l_retrieval_at_1",
    "eval_l2t_word_f1",
    "eval_l2t_bleu",
    "eval_l2t_cosine_mean",
    "eval_l2t_real_word_rate",
    "eval_l2t_repetition",
    "eval_l2t_without_selection_word_f1",
    "eval_l2t_without_selection_bleu",
    "eval_l2t_without_selection_cosine_mean",
    "eval_joint_consistency_mean",
    "eval_joint_without_selection_consistency_mean",
    "eval_joint_latent_fidelity_std_ratio_median",
)


def figures_of(path: Path, step: int | None) -> tuple[dict, int | None]:
    """The eval_* figures of a run's evaluation during training at `step` (None: its last), or of a
    JSON report of `mmldlm eval`; and the step they come from (None for a report)."""
    if path.is_file():
        from mmldlm.evaluation.report import eval_metrics

        return eval_metrics(json.loads(path.read_text(encoding="utf-8"))), None
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    evals = {r["step"]: r for r in records if "eval_t2l_cosine_mean" in r or "eval_l2t_word_f1" in r}
    if not evals:
        raise SystemExit(
            f"seed_spread: {path / 'metrics.jsonl'}: no evaluation records; expected a run with eval.every > 0"
        )
    chosen = max(evals) if step is None else step
    if chosen not in evals:
        raise SystemExit(f"seed_spread: {path}: no evaluation at step {chosen}; it has {sorted(evals)}")
    return evals[chosen], chosen


def spread(values: list[float]) -> tuple[float, float, float]:
    """(mean, sd between runs, half-width of the 95% interval of a difference between two single runs)."""
    k = len(values)
    sd = float(np.std(values, ddof=1))
    return float(np.mean(values)), sd, float(stats.t.ppf(0.975, k - 1)) * math.sqrt(2.0) * sd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or JSON reports of `mmldlm eval`")
    parser.add_argument("--step", type=int, default=None, help="the evaluation step of run directories")
    parser.add_argument("--figures", nargs="+", default=list(FIGURES), help="eval_* names (default: the main ones)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("expected two or more runs of one recipe")
    if args.step is None and all(p.is_dir() for p in args.runs):
        steps = [set(_eval_steps(p)) for p in args.runs]
        common = set.intersection(*steps)
        args.step = max(common) if common else None
    rows = [figures_of(p, args.step) for p in args.runs]
    n = rows[0][0].get("eval_l2t_num_samples") or rows[0][0].get("eval_t2l_num_samples")
    where = f"step {args.step}" if args.step is not None else "eval reports"
    print(f"{len(args.runs)} runs ({', '.join(map(str, args.runs))}), {where}, n = {n} texts\n")
    print(
        "| figure | " + " | ".join(f"run {i}" for i in range(len(rows))) + " | mean | sd between seeds | "
        "95% half-width of a one-run difference |"
    )
    print("|---|" + "---|" * (len(rows) + 3))
    for name in args.figures:
        values = [r.get(name) for r, _ in rows]
        if any(v is None for v in values):
            continue
        mean, sd, half = spread(values)
        cells = " | ".join(f"{v:.4g}" for v in values)
        print(f"| {name.removeprefix('eval_')} | {cells} | {mean:.4g} | {sd:.3g} | {half:.3g} |")
    return 0


def _eval_steps(path: Path) -> list[int]:
    lines = (path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["step"] for r in map(json.loads, lines) if "eval_t2l_cosine_mean" in r or "eval_l2t_word_f1" in r]


if __name__ == "__main__":
    sys.exit(main())
