"""Quality against training samples seen, from the evaluation records (`eval.every`) of one or more
runs: a markdown table on stdout (each figure with its 95% interval where the record has one) and, with
--plot, a PNG of t2l retrieval@1 and cosine and l2t cosine and word F1 (their intervals shaded) beside
the references the evaluation measured (chance retrieval, the training-set mean latent, an unrelated
real sentence).

    python scripts/quality_curve.py runs/quality --plot docs/quality_curve.png
    python scripts/quality_curve.py runs/a runs/b --label a --label b --plot curves.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = (
    ("t2l retrieval@1", "eval_t2l_retrieval_at_1", "{:.1%}"),
    ("t2l cosine", "eval_t2l_cosine_mean", "{:.3f}"),
    ("l2t cosine", "eval_l2t_cosine_mean", "{:.3f}"),
    ("l2t word F1", "eval_l2t_word_f1", "{:.3f}"),
    ("l2t real words", "eval_l2t_real_word_rate", "{:.1%}"),
    ("l2t exact match", "eval_l2t_exact_match", "{:.1%}"),
    ("l2t nats/token", "eval_elbo_l2t_text_nats_per_token", "{:.3f}"),
    ("length exact", "eval_length_accuracy", "{:.1%}"),
)
REFERENCES = (
    ("chance retrieval@1", "eval_references_chance_retrieval_at_1", 0),
    ("mean-latent cosine", "eval_references_mean_latent_cosine", 1),
    ("unrelated-sentence cosine", "eval_references_other_sentence_cosine", 2),
    ("unrelated-sentence word F1", "eval_references_other_sentence_word_f1", 3),
)


def evaluations(run: Path) -> list[dict]:
    """The run's evaluation records, each with `samples`: the training samples seen by its step."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    batch, seen, last_step, out = None, 0, 0, []
    for record in records:  # samples seen = the sum of the global batch over the steps before
        if "global_batch_size" in record:
            batch = record["global_batch_size"]
            seen += batch * (record["step"] - last_step)
            last_step = record["step"]
        elif any(key.startswith("eval_") for key in record):
            out.append({**record, "samples": seen + (batch or 0) * (record["step"] - last_step)})
    return out


def cell(record: dict, key: str, fmt: str) -> str:
    """The figure with its 95% interval where the record has one (eval_*_low, eval_*_high)."""
    if key not in record:
        return "-"
    text = fmt.format(record[key])
    if f"{key}_low" in record:
        text += f" [{fmt.format(record[f'{key}_low'])}, {fmt.format(record[f'{key}_high'])}]"
    return text


def table(label: str, evals: list[dict]) -> str:
    head = "| run | step | samples seen | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for r in evals:
        cells = [cell(r, key, fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {label} | {r['step']} | {r['samples']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = COLUMNS[:4]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for (title, key, _), ax in zip(panels, axes.flat):
        for i, (label, evals) in enumerate(runs):
            points = [(r["samples"], r[key]) for r in evals if key in r and math.isfinite(r[key])]
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i}", label=label)
            band = [(r["samples"], r[f"{key}_low"], r[f"{key}_high"]) for r in evals if f"{key}_low" in r]
            if band:  # the 95% interval of each evaluation
                ax.fill_between(*zip(*band), color=f"C{i}", alpha=0.15, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("training samples seen")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    last = runs[0][1][-1] if runs[0][1] else {}
    for name, key, panel in REFERENCES:
        if key in last:
            axes.flat[panel].axhline(last[key], color="grey", linestyle="--", label=name)
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (RUN/metrics.jsonl)")
    parser.add_argument("--label", action="append", help="a name per run (default: the directory name)")
    parser.add_argument("--plot", metavar="PNG", help="write the curves here")
    args = parser.parse_args()
    labels = args.label or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(labels)} --label for {len(args.runs)} runs")
    runs = [(label, evaluations(run)) for label, run in zip(labels, args.runs)]
    for label, evals in runs:
        if not evals:
            parser.error(f"{label}: no evaluation records in metrics.jsonl (train with eval.every > 0)")
        print(table(label, evals), end="\n\n")
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
