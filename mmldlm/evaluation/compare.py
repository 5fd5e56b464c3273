"""Two evaluation reports of the same texts, figure by figure: A, B, A - B and the 95% interval of the
difference from a paired bootstrap (the same resampled texts for both; Dror et al. 2018), and whether
that interval excludes 0. `mmldlm compare` prints `markdown(compare_reports(a, b))`.

One run per side compares two models: the interval covers other texts, not other training seeds, and
two seeds of one recipe differ on many figures (docs/quality.md). To
compare two recipes, `compare_arms` takes several runs per arm (each recipe trained with other seeds) and
adds the variance between seeds to the interval (intervals.arms_difference).

The reports must have scored the same validation texts (`texts_sha256`) with the same seed, so that the
i-th per-text value of A and of B belong to the same text (and, for sampled figures, to the same draws
of the generators where the two models agree). Each figure's recipe is the one `mmldlm eval` made it
with (figures.py `sections`).

Each report records its decoder (`sampling`): a figure of a section whose decoders differ (figures.py
`decoder_of`: best-of-16 against best-of-1, other steps or temperatures) measures models and decoders
together, and its row and the header say so; a figure the decoder selected its texts by (the re-encoded
cosine of a best-of-N decoder, `selected_on`) is marked as selected. Several runs per arm must be seeds
of one recipe: the same config apart from train.seed and train.run_dir (and where the run writes:
logging, checkpoint), evaluated at the same step with the same decoder (`check_one_recipe`).
"""

from __future__ import annotations

import json

import numpy as np

from mmldlm.config import RunConfig, flat_keys, to_dict
from mmldlm.errors import UserError
from mmldlm.evaluation.figures import Figure, decoder_of, sections
from mmldlm.evaluation.intervals import LEVEL, NUM_RESAMPLES, POWER

# Sections that score the validation data and the training texts, not the model: the same in both.
DATA_ONLY = ("references", "nearest_training_text", "joint reference")
# Figures scored by a reference model of the run's own training texts (the word 3-gram model): two
# reports compare on them only where both were scored by the same one (`fluency_reference`).
REFERENCE_SCORED = ("ngram_perplexity",)


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
            "--num-samples and --retrieval-pool, on runs of the same prepared dataset; runs trained on different "
            "data compare each on its own validation texts with --unpaired"
        )
    if a.get("seed") != b.get("seed"):
        raise UserError(
            f"{names[0]} has seed {a.get('seed')!r} and {names[1]} {b.get('seed')!r}; expected the same seed"
        )


# Config keys in which seeds of one recipe may differ: the seed, and where the run writes (its directory, its
# logs and checkpoints), none of which changes what it trains.
NOT_THE_RECIPE = ("train.seed", "train.run_dir", "logging.", "checkpoint.")


def recipe_of(report: dict, name: str) -> dict:
    """{key: value} that seeds of one recipe share: the run's config but `NOT_THE_RECIPE` (keys it does not
    record at their defaults), the step evaluated and the decoder (sampling.*); UserError for a report that
    records no config."""
    if not isinstance(report.get("config"), dict):
        raise UserError(
            f"{name}: the report records no run config (written by an older `mmldlm eval`); expected one that "
            "does, to check that the runs of an arm are seeds of one recipe: evaluate the run again"
        )
    # A key the report lacks was added to the config after it was written: the run trained as its default says.
    recorded = {**flat_keys(to_dict(RunConfig())), **flat_keys(report["config"])}
    config = {key: value for key, value in recorded.items() if not key.startswith(NOT_THE_RECIPE)}
    sampling = {f"sampling.{key}": value for key, value in (report.get("sampling") or {}).items()}
    return {**config, "step": report.get("step"), **sampling}


def check_one_recipe(reports: list[dict], names: list[str], arm: str) -> None:
    """UserError, in one line naming the keys that differ, unless the runs of `arm` ("--a" or "--b") are seeds
    of one recipe (`recipe_of`)."""
    if len(reports) < 2:
        return
    first = recipe_of(reports[0], names[0])
    for report, name in zip(reports[1:], names[1:]):
        other = recipe_of(report, name)
        differ = [key for key in dict.fromkeys([*first, *other]) if first.get(key) != other.get(key)]
        if differ:
            shown = ", ".join(
                f"{key} ({shown_value(first.get(key))} vs {shown_value(other.get(key))})" for key in differ[:6]
            )
            more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
            raise UserError(
                f"{arm}: {names[0]} and {name} are not seeds of one recipe: they differ in {shown}{more}; expected "
                "the same config apart from train.seed and train.run_dir, evaluated at the same step with the "
                "same decoder"
            )


def compare_reports(a: dict, b: dict, names: tuple[str, str] = ("A", "B"), unpaired: bool = False) -> dict:
    """{"a", "b", "runs_a", "runs_b", "level", "num_resamples", "rows": [{section, figure, a, b,
    difference, low, high, n, significant}], "other_reference": [n-gram perplexities scored by different
    references, REFERENCE_SCORED], "not_compared": [sections in one report only],
    "without_interval": [figures no resampling can bound, intervals.CorpusStatistic.resampled]}; the figures of
    the model, not of the data (`DATA_ONLY`). `unpaired`: each report scored its own texts (runs on
    different data, each on its own validation split), resampled independently."""
    return compare_arms([a], [b], [names[0]], [names[1]], unpaired=unpaired)


def null_flags(a: dict, b: dict, num: int, seed: int = 0) -> list[int]:
    """How many figures each of `num` comparisons of A and B with no difference flags: each text's values
    of A and B exchanged with probability 1/2, section by section (under no difference the two are
    exchangeable text by text). The counts carry the figures' dependence (three l2t sections score the
    same texts, the likelihood appears in four forms), which a binomial count of 5% does not."""
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(num):
        swapped_a, swapped_b = _swapped(a, b, rng)
        rows = compare_arms([swapped_a], [swapped_b], ["A"], ["B"])["rows"]
        counts.append(sum(row["significant"] for row in rows))
    return counts


def _swapped(a: dict, b: dict, rng: np.random.Generator) -> tuple[dict, dict]:
    """Copies of reports (or sections) a and b whose `per_text` rows are exchanged at random."""
    out_a, out_b = dict(a), dict(b)
    for key, node in a.items():
        other = b.get(key)
        if not (isinstance(node, dict) and isinstance(other, dict)):
            continue
        if key == "per_text":
            out_a[key], out_b[key] = _swap_rows(node, other, rng)
        else:
            out_a[key], out_b[key] = _swapped(node, other, rng)
    return out_a, out_b


def _swap_rows(per_text_a: dict, per_text_b: dict, rng: np.random.Generator) -> tuple[dict, dict]:
    arrays = {
        key: (np.asarray(per_text_a[key]), np.asarray(per_text_b[key])) for key in per_text_a.keys() & per_text_b.keys()
    }
    sizes = {a.shape[0] for a, b in arrays.values() if a.shape == b.shape and a.ndim}
    if len(sizes) != 1:  # other texts or draws in A and B: nothing to exchange row by row
        return per_text_a, per_text_b
    swap = rng.random(sizes.pop()) < 0.5
    out_a, out_b = dict(per_text_a), dict(per_text_b)
    for key, (a, b) in arrays.items():
        if a.shape == b.shape and a.ndim:
            rows = swap.reshape(-1, *[1] * (a.ndim - 1))
            out_a[key], out_b[key] = np.where(rows, b, a), np.where(rows, a, b)
    return out_a, out_b


def compare_arms(
    arm_a: list[dict], arm_b: list[dict], names_a: list[str], names_b: list[str], unpaired: bool = False
) -> dict:
    """`compare_reports` for several runs per arm, all on the same texts with the same seed: A and B are
    the arms' mean figures; with one run per arm the interval is the paired bootstrap over texts, with
    more it adds the seeds' variance (rows then carry runs_a, runs_b, seed_sd, text_se and df)."""
    reports, names = [*arm_a, *arm_b], [*names_a, *names_b]
    if unpaired and len(reports) > 2:
        raise UserError(f"--unpaired takes one run per side, got {len(arm_a)} and {len(arm_b)}; expected A and B")
    for report, name in zip(reports[1:], names[1:]):
        if not unpaired:
            check_comparable(reports[0], report, (names[0], name))
    check_one_recipe(arm_a, names_a, "--a")
    check_one_recipe(arm_b, names_b, "--b")
    of_each = [
        {name: (section, figures) for name, section, figures in sections(r) if name not in DATA_ONLY} for r in reports
    ]
    common = [name for name in of_each[0] if all(name in of for of in of_each[1:])]
    one_reference = len({(r.get("fluency_reference") or {}).get("sha256") for r in reports}) == 1
    decoders = (arm_a[0].get("sampling"), arm_b[0].get("sampling"))
    found = {"rows": [], "other_reference": [], "other_setting": [], "without_interval": []}
    for name in common:
        for figure in of_each[0][name][1].values():
            outcome = _compare_figure(
                figure, name, [of[name][0] for of in of_each], len(arm_a), names, unpaired, one_reference, decoders
            )
            if outcome is not None:
                found[outcome[0]].append(outcome[1])
    not_compared = sorted({name for of in of_each for name in of} - set(common))
    return {
        "a": " + ".join(names_a),
        "b": " + ".join(names_b),
        "runs_a": list(names_a),
        "runs_b": list(names_b),
        "sampling_a": arm_a[0].get("sampling"),  # each arm's decoder (its runs share it)
        "sampling_b": arm_b[0].get("sampling"),
        "paired": not unpaired,
        "level": LEVEL,
        "num_resamples": NUM_RESAMPLES,
        **found,
        "not_compared": not_compared,
    }


def _compare_figure(
    figure: Figure,
    name: str,
    found: list[dict],
    num_a: int,
    names: list[str],
    unpaired: bool,
    one_reference: bool,
    decoders: tuple[dict | None, dict | None],
) -> tuple[str, dict | str] | None:
    """Figure `figure` of the sections `found` (named `name`, one per report, A's num_a first):
    ("rows", its row, labelled with its `decoders`, A's and B's `sampling`), or the list of compare_arms'
    result that names it instead, with its label: scored by other n-gram references, in other settings
    (figures.Figure.setting), or without an interval; None where a report lacks its per-text values."""
    label, recipe, per_text = f"{name} {figure.key}", figure.recipe, [f["per_text"] for f in found]
    if not all(key in p for p in per_text for key in recipe.keys):
        return None
    if figure.key in REFERENCE_SCORED and not one_reference:
        return "other_reference", label
    settings = [f.get(figure.setting) for f in found] if figure.setting else []
    if len(set(settings)) > 1:
        return "other_setting", f"{label} ({figure.setting} {' vs '.join(map(str, settings))})"
    if unpaired:
        difference = recipe.unpaired_difference(per_text[0], per_text[1])
    else:
        difference = _difference(recipe, per_text[:num_a], per_text[num_a:], label, names)
    if difference is None:  # no interval for this figure (intervals.CorpusStatistic.resampled)
        return "without_interval", label
    row = {"section": name, "figure": figure.key, **difference.to_dict()}
    if unpaired:  # each run's own number of texts
        row.update(n_a=len(per_text[0][recipe.keys[0]]), n_b=len(per_text[1][recipe.keys[0]]))
    row.update(_decoding(figure, name, found[0], found[num_a], decoders))
    return "rows", row


def _decoding(figure: Figure, name: str, a: dict, b: dict, decoders: tuple[dict | None, dict | None]) -> dict:
    """What a row says of its decoders: "decoders" (how A's and B's differ for section `name`, where they
    do) and "selected" (which side's decoder selected its texts by this figure, and how)."""
    out = {}
    ours = [decoder_of(name, sampling) for sampling in decoders]
    if ours[0] != ours[1]:
        out["decoders"] = decoder_difference(*ours)
    selected = [(side, s.get("selected_on", {}).get(figure.key)) for side, s in (("A", a), ("B", b))]
    if any(how for _, how in selected):
        out["selected"] = "; ".join(f"{side} {how}" for side, how in selected if how)
    return out


def decoder_difference(a: dict | None, b: dict | None) -> str:
    """'best_of 1 vs 16, temperature 1.0 vs 0.7': the options in which decoders `a` and `b` differ (None: a report
    that recorded none)."""
    if a is None or b is None:
        return f"{'A' if a is None else 'B'} recorded no decoder"
    differ = [key for key in dict.fromkeys([*a, *b]) if a.get(key) != b.get(key)]
    return ", ".join(f"{key} {shown_value(a.get(key))} vs {shown_value(b.get(key))}" for key in differ)


def shown_value(value) -> str:
    """A config or sampling value as its YAML and JSON files write it: null, true, 0.0005, [[0, 2]]."""
    return value if isinstance(value, str) else json.dumps(value)


def _difference(recipe, per_a: list[dict], per_b: list[dict], figure: str, names: list[str]):
    sizes = [len(p[recipe.keys[0]]) for p in (*per_a, *per_b)]
    if len(set(sizes)) > 1:
        counts = ", ".join(f"{name}: {size}" for name, size in zip(names, sizes))
        raise UserError(
            f"{figure}: the runs scored different numbers of texts ({counts}); "
            "expected the same texts (the same --num-samples)"
        )
    if len(per_a) == len(per_b) == 1:
        return recipe.difference(per_a[0], per_b[0])
    try:
        return recipe.arms_difference(per_a, per_b)
    except ValueError as err:
        raise UserError(f"{figure}: {err}") from None


def flags_line(result: dict) -> str:
    """How many figures differ, beside how many a comparison with no difference at all would flag."""
    flagged, total = sum(r["significant"] for r in result["rows"]), len(result["rows"])
    chance = (1.0 - result["level"]) * total
    line = (
        f"{flagged} of {total} figures differ at {result['level']:.0%}. Where A and B do not differ at all, "
        f"each figure is flagged with probability {1.0 - result['level']:.0%}, about {chance:.1f} of {total} on "
        "average (fewer with --a/--b, whose interval is conservative; docs/quality.md, 'Comparing two runs'); "
        "the figures are dependent (several sections score the same texts, the likelihood appears "
        "in four forms), so the count varies more than a binomial one"
    )
    counts = result.get("null_flags")
    if counts:
        line += (
            f". Measured on these texts: {len(counts)} comparisons with each text's A and B values exchanged at "
            f"random (no difference by construction) flagged {min(counts)} to {max(counts)} of {total} "
            f"(median {float(np.median(counts)):g})"
        )
    return line


def n_of(row: dict) -> str:
    """A row's number of texts: one for both runs, or each run's own (--unpaired)."""
    return f"{row['n_a']} / {row['n_b']}" if "n_a" in row else str(row["n"])


def figure_label(row: dict) -> str:
    """'l2t cosine_mean (decoders differ) (selected: B max over 16 candidates)': a row's figure, and what its
    decoders make of it."""
    label = f"{row['section']} {row['figure']}"
    if "decoders" in row:
        label += " (decoders differ)"
    if "selected" in row:
        label += f" (selected: {row['selected']})"
    return label


def _decoders_line(result: dict) -> str:
    """The header's sentence on decoders where some rows compare different ones; '' where none does."""
    rows = [r for r in result["rows"] if "decoders" in r]
    if not rows:
        return ""
    return (
        f"A and B decoded with different options ({decoder_difference(result['sampling_a'], result['sampling_b'])}): "
        f"the {len(rows)} rows marked 'decoders differ' measure each model with its decoder, not the models alone"
    )


def markdown(result: dict) -> str:
    """The comparison as a markdown table, one row per figure."""
    several = len(result.get("runs_a", [1])) + len(result.get("runs_b", [1])) > 2
    if several:
        intro = (
            f"A = mean of {len(result['runs_a'])} runs ({', '.join(result['runs_a'])}), B = mean of "
            f"{len(result['runs_b'])} runs ({', '.join(result['runs_b'])}); interval: {result['level']:.0%} t interval "
            "from the variance between seeds (pooled over both arms) plus the texts' paired bootstrap variance "
            f"({result['num_resamples']} resamples), with the seeds' k_A + k_B - 2 degrees of freedom; significant: "
            f"the interval excludes 0; detectable: the true difference this interval finds {POWER:.0%} of the time "
            "(from the estimated spread, itself uncertain with few seeds: a difference below it is not evidence of "
            "no difference)"
        )
    elif not result.get("paired", True):
        intro = (
            f"A = {result['a']}, B = {result['b']}, each on its own texts; interval: {result['level']:.0%} "
            f"bootstrap of each run's texts resampled independently ({result['num_resamples']} resamples; "
            "unpaired, so wider than a paired comparison on shared texts); significant: the interval excludes 0. "
            "One run per side: the interval covers other texts for these two models, not other training seeds"
        )
    else:
        intro = (
            f"A = {result['a']}, B = {result['b']}; interval: {result['level']:.0%} paired bootstrap over the texts "
            f"({result['num_resamples']} resamples); significant: the interval excludes 0. One run per side: the "
            "interval covers other texts for these two models, not other training seeds (give each side several "
            "seeds with --a/--b to compare recipes)"
        )
    decoded = _decoders_line(result)
    if decoded:
        intro = intro.replace("these two models", "these two models and their decoders") + ". " + decoded
    seeds = f" sd between seeds | detectable at {POWER:.0%} |" if several else ""
    n = "n" if result.get("paired", True) else "n (A / B)"
    lines = [
        intro,
        "",
        f"| figure | {n} | A | B | A - B | interval |{seeds} significant |",
        "|---" * (9 if several else 7) + "|",
    ]
    for r in result["rows"]:
        seed_sd = f" {r['seed_sd']:.3g} | {r['detectable']:.3g} |" if several else ""
        lines.append(
            f"| {figure_label(r)} | {n_of(r)} | {r['a']:.4g} | {r['b']:.4g} | {r['difference']:+.4g} | "
            f"[{r['low']:+.4g}, {r['high']:+.4g}] |{seed_sd} {'yes' if r['significant'] else 'no'} |"
        )
    lines += ["", flags_line(result)]
    if result["not_compared"]:
        lines += ["", f"Not in every report, not compared: {', '.join(result['not_compared'])}"]
    if result.get("other_reference"):
        lines += [
            "",
            "Scored by different n-gram references (each run's model of its own training texts), not compared: "
            + ", ".join(result["other_reference"]),
        ]
    if result.get("other_setting"):
        settings = ", ".join(result["other_setting"])
        lines += ["", f"Scored in other settings (retrieval@1's chance is 1 / pool_size), not compared: {settings}"]
    if result.get("without_interval"):
        no_interval = ", ".join(result["without_interval"])
        lines += ["", f"No interval (resampling texts biases them), not compared: {no_interval}"]
    return "\n".join(lines) + "\n"
