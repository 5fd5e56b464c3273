"""An evaluation report (evaluate.py) for readers: the markdown `mmldlm eval` prints and writes, the
eval_* metric keys of metrics.jsonl (`eval_metrics`), and the helpers the model card and other reports format
figures with (`figure_text`, `table_cell`, `selected_label`)."""

from __future__ import annotations

import math

from mmldlm.evaluation.figures import HEADLINE, REFERENCE_LABELS
from mmldlm.evaluation.intervals import MIN_TEXTS


def eval_metrics(report: dict) -> dict:
    """The report's numbers as eval_* keys (for metrics.jsonl): eval_elbo_l2t_text_nats_per_token, and
    each interval as _low and _high: eval_elbo_l2t_text_nats_per_token_low, ... (no per-text values)."""
    out = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if key in ("per_text", "examples"):
                continue
            if isinstance(value, dict):
                walk(f"{prefix}_{key}", value)
            elif key.endswith("_interval") and isinstance(value, list):
                name = f"{prefix}_{key.removesuffix('_interval')}"
                out[f"{name}_low"], out[f"{name}_high"] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}_{key}"] = value

    parts = (
        "elbo",
        "l2t",
        "t2l",
        "length",
        "references",
        "l2t_predicted_length",
        "l2t_without_selection",
        "joint",
        "joint_without_selection",
        "nearest_training_text",
    )
    walk("eval", {k: report[k] for k in parts if k in report})
    return out


def figure_text(section: dict, key: str, number_format: str = ".3f") -> str:
    """`section[key]` with its 95% interval, '0.589 [0.561, 0.617]' ('.1%': '41.0% [35.2%, 46.9%]')."""
    value, interval = section[key], section.get(f"{key}_interval")
    if interval is None or not all(math.isfinite(x) for x in interval):
        return format(value, number_format)
    return f"{value:{number_format}} [{interval[0]:{number_format}}, {interval[1]:{number_format}}]"


def table_cell(text: str) -> str:
    """`text` as one markdown table cell: no line breaks, no bare column separator."""
    return " ".join(text.split()).replace("|", "\\|")


def selected_label(section: dict, key: str) -> str:
    """' (selected on: max over 4 candidates)' where the decoder chose its texts by figure `key`, else ''."""
    how = section.get("selected_on", {}).get(key)
    return f" (selected on: {how})" if how else ""


def _figures(r: dict) -> str:
    """BLEU, repetition and n-gram perplexity of one l2t entry, as a clause."""
    text = f"BLEU {figure_text(r, 'bleu', '.1f')}, repetition {figure_text(r, 'repetition')}" if "bleu" in r else ""
    if "ngram_perplexity" in r:
        text += f", n-gram perplexity {figure_text(r, 'ngram_perplexity', '.1f')}"
    return text


def _cosine_clause(report: dict, key: str) -> str:
    """The re-encoded cosine of l2t entry `key`, labelled when the decoder selected on it, beside the
    same decoder's cosine without selection."""
    r = report[key]
    if "cosine_mean" not in r:
        return "re-encoded cosine not measured"
    text = f"re-encoded cosine {figure_text(r, 'cosine_mean', '.4f')}{selected_label(r, 'cosine_mean')}"
    plain = report.get("l2t_without_selection", {}) if key == "l2t" else {}  # measured at the source lengths
    if "selected_on" in r and "cosine_mean" in plain:
        text += f"; without selection (best of 1) {figure_text(plain, 'cosine_mean', '.4f')}"
    return text


def _joint_lines(report: dict) -> list[str]:
    j, pairs = report["joint"], report["joint"]["reference"]
    consistency = f"consistency {figure_text(j, 'consistency', '.4f')}{selected_label(j, 'consistency')}"
    if "selected_on" in j and "joint_without_selection" in report:
        consistency += f"; without selection {figure_text(report['joint_without_selection'], 'consistency', '.4f')}"
    return [
        "",
        f"joint ({j['num_samples']} samples): repetition {figure_text(j, 'repetition')}, distinct-1/2 "
        f"{figure_text(j, 'distinct_1')}/{figure_text(j, 'distinct_2')}{_real_distinct(report)}"
        + (f", copy rate {figure_text(j, 'copy_rate', '.1%')}" if "copy_rate" in j else "")
        + (f", n-gram perplexity {figure_text(j, 'ngram_perplexity', '.1f')}" if "ngram_perplexity" in j else "")
        + f"; {consistency} (real pairs {figure_text(pairs, 'real_pairs', '.4f')}, shuffled pairs "
        f"{figure_text(pairs, 'shuffled_pairs', '.4f')})",
        "",
        "| joint sample | consistency |",
        "|---|---|",
        *[f"| {table_cell(e['generated'])} | {e['consistency']:.3f} |" for e in j["examples"]],
    ]


def _real_distinct(report: dict) -> str:
    """Real validation text's distinct-1/2 at the joint samples' n, where the report has it."""
    ref = report.get("references", {})
    if "real_distinct_1" not in ref or ref.get("num_samples") != report["joint"]["num_samples"]:
        return ""
    return f" (real text {ref['real_distinct_1']:.3f}/{ref['real_distinct_2']:.3f})"


def writing_lines(report: dict) -> list[str]:
    """The writing figures beside their references, in a few lines of markdown."""
    ref, l2t = report.get("references", {}), report["l2t"]
    lines = ["", f"l2t writing at the source lengths: {_figures(l2t)}"]
    if "real_repetition" in ref:
        real = f"real {texts_label(report)} texts: repetition {figure_text(ref, 'real_repetition')}"
        if "real_ngram_perplexity" in ref:
            real += (
                f", n-gram perplexity {figure_text(ref, 'real_ngram_perplexity', '.1f')} "
                f"(their words shuffled: {figure_text(ref, 'shuffled_ngram_perplexity', '.1f')})"
            )
        if "other_sentence_bleu" in ref:
            real += f"; an unrelated sentence: BLEU {figure_text(ref, 'other_sentence_bleu', '.1f')}"
        lines += ["", real]
    if "l2t_predicted_length" in report:
        r = report["l2t_predicted_length"]
        lines += [
            "",
            "l2t at the length head's lengths (what `decode` gives): exact match "
            + f"{figure_text(r, 'exact_match', '.1%')}, word F1 {figure_text(r, 'word_f1')}, {_figures(r)}, "
            + _cosine_clause(report, "l2t_predicted_length"),
        ]
    if "nearest_training_text" in report:
        r = report["nearest_training_text"]
        lines += [
            "",
            f"reference, the training text with the nearest latent: word F1 {figure_text(r, 'word_f1')}, BLEU "
            f"{figure_text(r, 'bleu', '.1f')}, exact match {figure_text(r, 'exact_match', '.1%')}, cosine "
            f"{figure_text(r, 'cosine_mean', '.4f')}",
        ]
    if "joint" in report:
        lines += _joint_lines(report)
    return lines


ELBO_LABELS = {
    "l2t": "-log p(text | its latent), the length paid by the length head: comparable only with a decoder "
    "given the same sentence embedding",
    "t2l": "the latent loss of encoding each text (the text is given clean)",
    "joint": "the text term of the joint loss: the text given a noised copy of its own latent, averaged over the "
    "latent's time, the length paid by the validation lengths; it bounds no marginal -log p(text)",
}


def _elbo_table(report: dict) -> list[str]:
    sampling = report.get("sampling", {})
    decoder = ", ".join(
        f"{key} {sampling[key]}"
        for key in ("num_steps", "temperature", "repetition_penalty", "best_of")
        if key in sampling
    )
    lines = [
        "Likelihood bounds: upper bounds of the continuous-time model at temperature 1, not of the decoder whose "
        f"texts fill the rest of this report ({decoder}). Per mode, what each bounds: "
        + "; ".join(f"{mode}: {label}" for mode, label in ELBO_LABELS.items() if mode in report["elbo"])
        + '. Per token divides by the T tokens of a text; "per T + 1" divides by T + 1, as an autoregressive model '
        "that pays for its end-of-text token does (the length term plays that token's role). Largest share: of the "
        "total, held by one text and draw of t (a bound weighted 1/t can rest on one draw at a small t).",
        "",
        f"| mode (n texts, {report.get('num_t_draws', 1)} draws of t each) | text nats/token given length "
        "| nats/token with length | nats per T + 1 with length | nats/text with length | length nats/text "
        "| perplexity bound with length (per T + 1) | largest share | latent loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["elbo"].items():
        cell = lambda k, f, r=r: figure_text(r, k, f) if k in r else "-"  # noqa: E731
        share = f"{r['largest_draw_share']:.1%}" if "largest_draw_share" in r else "-"
        lines.append(
            f"| {mode} ({r.get('num_samples', '?')}) | {cell('text_nats_per_token_given_length', '.4f')} | "
            f"{cell('nats_per_token_with_length', '.4f')} | {cell('nats_per_token_with_end', '.4f')} | "
            f"{cell('nats_per_text', '.2f')} | {cell('length_nats_per_text', '.2f')} | "
            f"{cell('ppl_bound_with_length', '.2f')} ({cell('ppl_bound_with_end', '.2f')}) | {share} | "
            f"{cell('latent_loss', '.4f')} |"
        )
    return lines


def _guidance_table(report: dict) -> list[str]:
    lines = [
        "",
        "| guidance scale | l2t word F1 | l2t real words | l2t exact match | l2t cosine | t2l cosine "
        "| t2l retrieval@1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in report["guidance"]:
        g2, g1 = entry["l2t"], entry["t2l"]
        cosine = figure_text(g2, "cosine_mean", ".4f") if "cosine_mean" in g2 else "-"
        lines.append(
            f"| {entry['guidance_scale']:g} | {figure_text(g2, 'word_f1')} | "
            + f"{figure_text(g2, 'real_word_rate', '.1%')} | {figure_text(g2, 'exact_match', '.1%')} | {cosine} | "
            + f"{figure_text(g1, 'cosine_mean', '.4f')} | {figure_text(g1, 'retrieval_at_1', '.1%')} |"
        )
    return lines


def length_line(length: dict, split: str = "validation") -> str:
    """The length head's figures on `split` latents, and how many texts were too long to score."""
    line = (
        f"length head ({length['num_samples']} {split} latents): exact "
        f"{figure_text(length, 'accuracy', '.1%')}, mean absolute error "
        f"{figure_text(length, 'mean_abs_error', '.2f')} tokens"
    )
    over = length.get("num_over_max_length", 0)
    if over:
        line += (
            f" over the {length['num_scored']} texts within max_length {length['max_length']}; {over} longer "
            f"texts not scored (the head names lengths up to {length['max_length']} only)"
        )
    return line


def fidelity_lines(report: dict) -> list[str]:
    """The "latent fidelity" section: t2l's and joint generation's latents against real ones."""
    rows = [(mode, report[mode]["latent_fidelity"]) for mode in ("t2l", "joint") if mode in report]
    rows = [(mode, f) for mode, f in rows if f is not None]
    if not rows:
        return []
    lines = [
        "",
        f"Latent fidelity (standardised space, {rows[0][1]['dims']} dims; each generated set against as many "
        f"real {texts_label(report)} latents, in brackets another disjoint real set of the same size against the "
        "same ones; "
        f"k-NN precision and recall at k = {rows[0][1]['k']}). t2l's latents are paired with their texts, "
        "compared with those texts' own latents: a perfect encoder scores Fréchet distance 0, precision and "
        "recall 1, std ratio 1 on every dimension; the other real set is an encoder that ignores its text but "
        "samples the right distribution, and the constant training-mean latent one that ignores both. Joint "
        "generation is unconditional: the other real set is what it should match.",
        "",
        "| latents | n | Fréchet distance (another real set; constant mean latent) | precision (...) | recall (...) "
        "| std ratio median [min, max] (another real set's) | spread (real) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in rows:
        constant = lambda key, number_format, f=f: f"; {f[key]:{number_format}}" if key in f else ""  # noqa: E731
        real_ratio = (
            f" ({f['std_ratio_real_vs_real_median']:.2f} [{f['std_ratio_real_vs_real_min']:.2f}, "
            f"{f['std_ratio_real_vs_real_max']:.2f}])"
            if "std_ratio_real_vs_real_min" in f
            else ""
        )
        lines.append(
            f"| {name}{' (paired)' if f.get('paired') else ''} | {f['num_samples']} | {f['frechet_distance']:.1f} "
            f"({f['frechet_distance_real_vs_real']:.1f}{constant('frechet_distance_mean_latent', '.1f')}) "
            f"| {f['precision']:.2f} ({f['precision_real_vs_real']:.2f}{constant('precision_mean_latent', '.2f')}) "
            f"| {f['recall']:.2f} ({f['recall_real_vs_real']:.2f}{constant('recall_mean_latent', '.2f')}) "
            f"| {f['std_ratio_median']:.2f} [{f['std_ratio_min']:.2f}, {f['std_ratio_max']:.2f}]{real_ratio} "
            f"| {f['spread']:.1f} ({f['spread_real']:.1f}) |"
        )
    if any(f["num_samples"] <= f["dims"] for _, f in rows):
        lines += [
            "",
            "With n at most the dimension the covariances are mostly estimation noise, and a narrower sample has "
            "less of it: read the std ratio and the spread before the Fréchet distance (docs/quality.md).",
        ]
    return lines


def texts_label(report: dict) -> str:
    """The split the figures come from, in words: "validation" (the run's own validation texts),
    "training", "training + validation", or with another dataset (--data) its folder's name first."""
    data = report.get("data", {})
    split = {"val": "validation", "train": "training", "all": "training + validation"}[data.get("split", "val")]
    return split if data.get("own_dataset", True) else f"{data['path'].rstrip('/').split('/')[-1]} {split}"


def training_texts_note(report: dict) -> list[str]:
    """A line where the texts evaluated (`eval --data`) include texts the run trained on."""
    data = report.get("data", {})
    if not data.get("in_training"):
        return []
    return [
        f"**Note:** {data['in_training']} of the {data['in_training_of']} {texts_label(report)} texts evaluated "
        "(the figures' and the retrieval pool's) are texts this run trained on: their figures measure recall, not "
        "generalisation; `python scripts/held_out_texts.py` writes texts no given run trained on."
    ]


def small_n_notes(report: dict) -> list[str]:
    """A line for each figure too few texts make meaningless: a retrieval pool of one, n below MIN_TEXTS."""
    notes = []
    pool = report["t2l"].get("pool_size", 2)
    if pool < 2:
        notes.append(f"t2l retrieval@1 among {pool} is 100% by construction: it measures nothing here")
    counts = {"ELBO": min((r.get("num_samples", MIN_TEXTS) for r in report.get("elbo", {}).values()), default=None)}
    counts.update({key: report[key].get("num_samples") for key in ("l2t", "t2l", "joint") if key in report})
    small = {key: n for key, n in counts.items() if n is not None and n < MIN_TEXTS}
    if small:
        listed = ", ".join(f"{key} {n}" for key, n in small.items())
        notes.append(
            f"Too few texts to mean much ({listed}; below {MIN_TEXTS}): a 95% bootstrap interval of 10 texts holds "
            "the true figure about 89% of the time and of 5 texts 82%; raise --num-samples, or prepare a larger "
            "validation split"
        )
    return [f"**Note:** {note}." for note in notes]


def headline_lines(report: dict) -> list[str]:
    """The few figures a reader looks for first, each beside its reference: t2l retrieval and cosine, l2t
    word F1 and BLEU (BLEU where the writing figures were measured)."""
    l2t, ref = report["l2t"], report.get("references", {})
    lines = []
    for f in HEADLINE:
        section, reference = report[f.section], REFERENCE_LABELS[f.reference][1]
        if f.key in section:
            lines.append(f"- {f.label.format(**section)}: {figure_text(section, f.key, f.number_format)}")
            if f.reference in ref:
                lines[-1] += f" ({reference} {figure_text(ref, f.reference, f.number_format)})"
    texts = f"{l2t['num_samples']} {texts_label(report)} text{'' if l2t['num_samples'] == 1 else 's'}"
    return [f"{texts}, each figure with its 95% interval (its reference in parentheses):", "", *lines]


def _title(report: dict) -> str:
    return f"# Evaluation of {report['checkpoint']} (step {report['step']}, {report['weights']} weights)"


def examples_lines(report: dict) -> list[str]:
    """The first validation texts beside what the model wrote from their latents, as a markdown table."""
    lines = ["| source | generated from its latent |", "|---|---|"]
    return lines + [f"| {table_cell(e['source'])} | {table_cell(e['generated'])} |" for e in report["l2t"]["examples"]]


def console_summary(report: dict) -> str:
    """What `mmldlm eval` prints: the headline figures beside their references, a note where too few texts
    make them meaningless, and the texts written from the first latents; the rest is in `markdown`'s file."""
    notes = training_texts_note(report) + small_n_notes(report)
    lines = [_title(report), "", *headline_lines(report), *(["", *notes] if notes else []), "", *examples_lines(report)]
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    """A short human summary of the report: the headline figures, then every figure with its 95% interval
    in brackets."""
    l2t, t2l, ref = report["l2t"], report["t2l"], report.get("references", {})
    reference = lambda key, text: f" ({text} {figure_text(ref, key, '.4f')})" if key in ref else ""  # noqa: E731
    chance = f" (chance {ref['chance_retrieval_at_1']:.1%})" if "chance_retrieval_at_1" in ref else ""
    split = texts_label(report)
    notes = training_texts_note(report) + small_n_notes(report)
    lines = [
        _title(report),
        "",
        *headline_lines(report),
        "",
        "## Every figure",
        "",
        "Sampling options: " + ", ".join(f"{key}={value}" for key, value in report["sampling"].items()),
        "",
        f"Texts: {split} (every figure below is of these texts). Each figure: its value [95% interval] "
        "(percentile bootstrap over the n texts, each with its draws of t for the ELBO; a rate no text reaches "
        "gets the exact Clopper-Pearson interval).",
        *(["", *notes] if notes else []),
        "",
        *_elbo_table(report),
        "",
        f"l2t reconstruction ({l2t['num_samples']} {split} latents): exact match "
        f"{figure_text(l2t, 'exact_match', '.1%')}, word F1 {figure_text(l2t, 'word_f1')}"
        f"{reference('other_sentence_word_f1', 'an unrelated real sentence:')}, "
        f"real words {figure_text(l2t, 'real_word_rate', '.1%')}, {_cosine_clause(report, 'l2t')}"
        f"{reference('other_sentence_cosine', 'an unrelated real sentence:')}, {l2t['samples_per_s']:.1f} samples/s",
        "",
        f"t2l ({t2l['num_samples']} {split} texts, the posterior mean): mean cosine to the true latent "
        f"{figure_text(t2l, 'cosine_mean', '.4f')}{reference('mean_latent_cosine', 'the training-set mean latent:')}, "
        f"retrieval@1 among {t2l['pool_size']} {figure_text(t2l, 'retrieval_at_1', '.1%')}{chance}, "
        f"{t2l['samples_per_s']:.1f} samples/s",
    ]
    lines += writing_lines(report)
    lines += fidelity_lines(report)
    if "length" in report:
        lines += ["", length_line(report["length"], split)]
    if "guidance" in report:
        lines += _guidance_table(report)
    lines += ["", *examples_lines(report)]
    return "\n".join(lines) + "\n"
