"""The figures of an evaluation report, one entry each: where it sits in the report, the recipe that makes it
from the per-text values (intervals.py; `mmldlm eval` summarises by it, `mmldlm compare` compares by it), and
for a figure shown in eval's headline list or the model card's table, its label, format and reference.
Adding a figure is one entry of `FIGURES`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmldlm.evaluation import text_metrics
from mmldlm.evaluation.intervals import CorpusStatistic, Mean, Rate


def _bleu(key: str) -> CorpusStatistic:
    def statistic(per_text: dict):
        rows = np.asarray(per_text[key], dtype=np.float64)
        return lambda idx: text_metrics.bleu_of_statistics(rows[idx])

    return CorpusStatistic((key,), statistic)


def _perplexity(prefix: str) -> CorpusStatistic:
    """The perplexity of per-text values `prefix`_bits over `prefix`_words."""
    bits, counts = f"{prefix}_bits", f"{prefix}_words"

    def statistic(per_text: dict):
        b, c = np.asarray(per_text[bits], dtype=np.float64), np.asarray(per_text[counts], dtype=np.float64)
        return lambda idx: text_metrics.perplexity_of(b[idx], c[idx])

    return CorpusStatistic((bits, counts), statistic)


def _distinct(n: int, key: str = "texts") -> CorpusStatistic:
    def statistic(per_text: dict):
        grams = [text_metrics.word_ngrams(text, n) for text in per_text[key]]
        return lambda idx: text_metrics.distinct_of([grams[i] for i in idx]) or 0.0

    return CorpusStatistic((key,), statistic, resampled=False)


@dataclass(frozen=True)
class Figure:
    """Figure `key` of the report sections of kind `section` (`MEASURED_AGAIN`), made by `recipe`; where eval's
    headline list (`HEADLINE`) or the model card shows it, its `label` (formatted with the section's fields),
    format `number_format`, and `reference`: the figure of the "references" section it is read against.
    `setting`: a field of the section that the figure depends on beyond the texts (retrieval@1 among
    `pool_size` latents, whose chance is 1 / pool_size); reports compare on it only where that field agrees."""

    section: str
    key: str
    recipe: Mean | CorpusStatistic
    label: str = ""
    number_format: str = ".3f"
    reference: str = ""
    setting: str = ""


NGRAM = _perplexity("ngram")  # the word 3-gram perplexity of l2t's and joint's texts
FIGURES = (
    Figure("elbo", "text_nats_per_token", Mean("text_nats", "num_tokens")),
    Figure("elbo", "nats_per_token_with_length", Mean("nats_with_length", "num_tokens")),
    Figure("elbo", "nats_per_token_with_end", Mean("nats_with_end", "num_tokens_with_end")),
    Figure("elbo", "nats_per_text", Mean("nats_per_text")),
    Figure("elbo", "length_nats_per_text", Mean("length_nats")),
    Figure("elbo", "latent_loss", Mean("latent_loss")),
    Figure("l2t", "exact_match", Rate("exact")),
    Figure("l2t", "word_f1", Mean("word_f1"), "l2t word F1 against the source", ".3f", "other_sentence_word_f1"),
    Figure("l2t", "bleu", _bleu("bleu_statistics"), "l2t BLEU", ".1f", "other_sentence_bleu"),
    Figure("l2t", "repetition", Mean("repetition", "has_bigram"), "l2t repetition (rep-2)", ".3f", "real_repetition"),
    Figure("l2t", "real_word_rate", Mean("real_word_share", "num_words")),
    Figure("l2t", "ngram_perplexity", NGRAM),
    Figure("l2t", "cosine_mean", Mean("cosine"), "l2t re-encoded cosine", ".3f", "other_sentence_cosine"),
    Figure("t2l", "cosine_mean", Mean("cosine"), "t2l cosine to the true latent", ".3f", "mean_latent_cosine"),
    Figure(
        "t2l",
        "retrieval_at_1",
        Rate("hit"),
        "t2l retrieval@1 among {pool_size}",
        ".1%",
        "chance_retrieval_at_1",
        "pool_size",
    ),
    Figure("length", "accuracy", Rate("correct")),
    Figure("length", "mean_abs_error", Mean("abs_error")),
    Figure("joint", "consistency", Mean("consistency"), "joint: text-latent consistency"),
    Figure("joint", "repetition", Mean("repetition", "has_bigram")),
    Figure("joint", "distinct_1", _distinct(1)),
    Figure("joint", "distinct_2", _distinct(2)),
    Figure("joint", "copy_rate", Rate("copied")),
    Figure("joint", "ngram_perplexity", NGRAM, "joint: word 3-gram perplexity", ".0f", "real_ngram_perplexity"),
    Figure("nearest_training_text", "word_f1", Mean("word_f1")),
    Figure("nearest_training_text", "bleu", _bleu("bleu_statistics")),
    Figure("nearest_training_text", "exact_match", Rate("exact")),
    Figure("nearest_training_text", "cosine_mean", Mean("cosine")),
    Figure("references", "mean_latent_cosine", Mean("mean_latent_cosine")),
    Figure("references", "real_repetition", Mean("real_repetition", "real_has_bigram")),
    # distinct-n grows as n falls: joint's at the same n
    Figure("references", "real_distinct_1", _distinct(1, "real_texts")),
    Figure("references", "real_distinct_2", _distinct(2, "real_texts")),
    Figure("references", "other_sentence_cosine", Mean("other_sentence_cosine")),
    Figure("references", "other_sentence_word_f1", Mean("other_sentence_word_f1")),
    Figure("references", "other_sentence_bleu", _bleu("other_sentence_bleu_statistics")),
    Figure("references", "real_ngram_perplexity", _perplexity("real_ngram")),
    Figure("references", "shuffled_ngram_perplexity", _perplexity("shuffled_ngram")),
    Figure("joint reference", "real_pairs", Mean("real_pairs")),
    Figure("joint reference", "shuffled_pairs", Mean("shuffled_pairs")),
)
# What a figure's reference is, in the model card's table and in eval's headline list.
REFERENCE_LABELS = {
    "chance_retrieval_at_1": ("chance", "chance"),
    "mean_latent_cosine": ("training-mean latent", "the constant training-mean latent"),
    "other_sentence_word_f1": ("another sentence", "an unrelated sentence"),
    "other_sentence_bleu": ("another sentence", "an unrelated sentence"),
    "other_sentence_cosine": ("another sentence", "an unrelated sentence"),
    "real_repetition": ("real text", "real text"),
    "real_ngram_perplexity": ("real text", "real text"),
}
# The sections that measure the figures of another again: without selection, or at the length head's lengths.
MEASURED_AGAIN = {"l2t": ("l2t_without_selection", "l2t_predicted_length"), "joint": ("joint_without_selection",)}


def figures_of(section: str) -> dict[str, Figure]:
    """{figure key: Figure} of the sections of kind `section`, in the report's order."""
    return {f.key: f for f in FIGURES if f.section == section}


def recipes(section: str) -> dict:
    """{figure key: recipe} of the sections of kind `section`, in the report's order."""
    return {key: f.recipe for key, f in figures_of(section).items()}


FIGURE = {(f.section, f.key): f for f in FIGURES}  # each entry by (section kind, figure key)
# The figures a reader looks for first, each beside its reference.
HEADLINE = tuple(
    FIGURE[where] for where in (("t2l", "retrieval_at_1"), ("t2l", "cosine_mean"), ("l2t", "word_f1"), ("l2t", "bleu"))
)


# The sampling options (config.SamplingOptions) that no figure of a section of that kind depends on. l2t decodes a
# given latent: the latent sampler's options do not enter. joint's text takes no length candidates (its lengths
# are drawn) and its latent walks num_steps. reuse_output skips a model call whose output is known: the same
# texts either way.
NOT_READ = {
    "l2t": ("latent_sampler", "latent_steps", "latent_shift", "joint_order", "reuse_output", "length_candidates"),
    "l2t_predicted_length": ("latent_sampler", "latent_steps", "latent_shift", "joint_order", "reuse_output"),
    "joint": ("latent_steps", "length_candidates", "reuse_output"),
}
# Sections measured again with the sampler's one text: the decoder without its selection.
WITHOUT_SELECTION = {"l2t_without_selection": "l2t", "joint_without_selection": "joint"}


def decoder_of(section: str, sampling: dict | None) -> dict | None:
    """The options of a report's decoder (its `sampling`) that the figures of report section `section` depend on:
    {} for a section that samples nothing (the ELBO, the length head); None where the report recorded no
    options. t2l's figures read the posterior mean, one model call from t = 1, which only guidance changes."""
    kind = WITHOUT_SELECTION.get(section, section)
    if kind not in (*NOT_READ, "t2l"):
        return {}
    if sampling is None:
        return None
    if kind == "t2l":
        return {"guidance_scale": sampling.get("guidance_scale")}
    options = {key: value for key, value in sampling.items() if key not in NOT_READ[kind]}
    if section in WITHOUT_SELECTION:
        options.update(best_of=1, correction_rounds=0)
    if not options.get("correction_rounds"):
        options.pop("correction_proposals", None)  # variants per correction round: none without rounds
    return options


def sections(report: dict) -> list[tuple[str, dict, dict[str, Figure]]]:
    """(name, section, {key: Figure}) of every section of `report` that keeps per-text values, in the order of
    `FIGURES`: the elbo section's modes as "elbo MODE", the joint section's "reference" as "joint reference"."""
    out = []
    for kind in dict.fromkeys(f.section for f in FIGURES):
        if kind == "elbo":
            found = [(f"elbo {mode}", entry) for mode, entry in report.get("elbo", {}).items()]
        elif kind == "joint reference":
            found = [(kind, report.get("joint", {}).get("reference", {}))]
        else:
            found = [(key, report.get(key, {})) for key in (kind, *MEASURED_AGAIN.get(kind, ()))]
        out += [(name, section, figures_of(kind)) for name, section in found if "per_text" in section]
    return out
