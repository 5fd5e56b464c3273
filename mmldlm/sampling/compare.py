"""Two evaluation reports of the same texts, figure by figure: A, B, A - B and the 95% interval of the
difference from a paired bootstrap (the same resampled texts for both; Dror et al. 2018), and whether
that interval excludes 0. `mmldlm compare` prints `markdown(compare_reports(a, b))`.

The reports must have scored the same validation texts (`texts_sha256`) with the same seed, so that the
i-th per-text value of A and of B belong to the same text (and, for sampled figures, to the same draws
of the generators where the two models agree). Each figure's recipe is the one `mmldlm eval` made it
with (evaluate.py `sections`).
"""

from __future__ import annotations

from mmldlm.errors import UserError
from mmldlm.sampling.evaluate import sections
from mmldlm.sampling.intervals import LEVEL, NUM_RESAMPLES

# Sections that score the validation data and the training texts, not the model: the same in both.
DATA_ONLY = ("references", "nearest_training_text", "joint reference")


def check_comparable(a: dict, b: dict, names: tuple[str, str]) -> None:
    """UserError unless the reports `a` and `b` (named `names`) scored the same texts with the same seed."""
    for report, name in zip((a, b), names):
        if "texts_sha256" not in report:
            raise UserError(
                f"{name}: no per-text values (texts_sha256 missing); expected a report of `mmldlm eval` "
                "that keeps them: evaluate the run again"
            )
    if a["texts_sha256"] != b["texts_sha256"]:
        raise UserError(
            f"{names[0]} and {names[1]} scored different validation texts (texts_sha256 {a['texts_sha256'][:12]} "
            f"vs {b['texts_sha256'][:12]}); expected the same texts: evaluate both with the same --data, --split, "
            "--num-samples and --retrieval-pool, on runs of the same prepared dataset"
        )
    if a.get("seed") != b.get("seed"):
        raise UserError(
            f"{names[0]} has seed {a.get('seed')!r} and {names[1]} {b.get('seed')!r}; expected the same seed"
        )


def compare_reports(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> dict:
    """{"a", "b", "level", "num_resamples", "rows": [{section, figure, a, b, difference, low, high, n,
    significant}], "not_compared": [sections in one report only], "without_interval": [figures no
    resampling can bound, intervals.Corpus.resampled]}; the figures of the model, not of the data
    (`DATA_ONLY`)."""
    check_comparable(a, b, names)
    of_a = [(name, section, figures) for name, section, figures in sections(a) if name not in DATA_ONLY]
    of_b = {name: section for name, section, _ in sections(b) if name not in DATA_ONLY}
    rows, not_compared, without_interval = [], [], []
    for name, section_a, figures in of_a:
        if name not in of_b:
            not_compared.append(name)
            continue
        per_a, per_b = section_a["per_text"], of_b[name]["per_text"]
        for figure, recipe in figures.items():
            if not all(key in per_a and key in per_b for key in recipe.keys):
                continue
            if len(per_a[recipe.keys[0]]) != len(per_b[recipe.keys[0]]):
                raise UserError(
                    f"{name} {figure}: {names[0]} has {len(per_a[recipe.keys[0]])} texts and {names[1]} "
                    f"{len(per_b[recipe.keys[0]])}; expected the same texts (the same --num-samples)"
                )
            difference = recipe.difference(per_a, per_b)
            if difference is None:  # no interval for this figure (intervals.Corpus.resampled)
                without_interval.append(f"{name} {figure}")
                continue
            rows.append({"section": name, "figure": figure, **difference.to_dict()})
    not_compared += [name for name in of_b if name not in {n for n, *_ in of_a}]
    return {
        "a": names[0],
        "b": names[1],
        "level": LEVEL,
        "num_resamples": NUM_RESAMPLES,
        "rows": rows,
        "not_compared": not_compared,
        "without_interval": without_interval,
    }


def markdown(result: dict) -> str:
    """The comparison as a markdown table, one row per figure."""
    lines = [
        f"A = {result['a']}, B = {result['b']}; interval: {result['level']:.0%} paired bootstrap over the texts "
        f"({result['num_resamples']} resamples); significant: the interval excludes 0",
        "",
        "| figure | n | A | B | A - B | interval | significant |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['section']} {r['figure']} | {r['n']} | {r['a']:.4g} | {r['b']:.4g} | {r['difference']:+.4g} | "
            f"[{r['low']:+.4g}, {r['high']:+.4g}] | {'yes' if r['significant'] else 'no'} |"
        )
    if result["not_compared"]:
        lines += ["", f"In one report only, not compared: {', '.join(result['not_compared'])}"]
    if result.get("without_interval"):
        no_interval = ", ".join(result["without_interval"])
        lines += ["", f"No interval (resampling texts biases them), not compared: {no_interval}"]
    return "\n".join(lines) + "\n"
