"""Figures of generated writing, each read beside the same figure of real text (docs/quality.md).
Every function takes plain strings, so any texts can be scored:

    from mmldlm.evaluation.text_metrics import NgramReference, bleu, distinct, repetition
    reference = NgramReference.fit(training_texts)          # word 3-gram Kneser-Ney, training text only
    reference.perplexity(generated), reference.perplexity(real_texts)
    repetition(generated, 2), distinct(generated, 2), bleu(generated, sources)

Words are the lowercase letter runs of a text (`words`): digits and punctuation are not words.
- exact_match: the share of texts equal to their source (as strings).
- word_f1: F1 of the two texts' word multisets.
- bleu: corpus BLEU (Papineni et al. 2002) of sacrebleu with its defaults (13a tokenisation, case kept,
  no smoothing), 0-100, one reference per text.
- repetition(texts, n): seq-rep-n of Welleck et al. 2019 ("Neural text generation with unlikelihood
  training"): 1 - |distinct n-grams| / |n-grams| of one text's words, the share of its word n-grams that
  repeat an earlier one, averaged over the texts that have an n-gram. n = 1: the share of repeated words.
- distinct(texts, n): distinct-n of Li et al. 2016: |distinct n-grams| / |n-grams| over all texts
  together, how varied a set of samples is.
- copy_rate: the share of texts that equal some training text (whole texts, whitespace collapsed).
- NgramReference: perplexity under a word n-gram language model fitted on training texts only
  (interpolated Kneser-Ney of nltk; see its docstring for OOV words).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import sacrebleu
from sacrebleu.metrics import BLEU


def words(text: str) -> list[str]:
    """The lowercase letter runs of `text`, in order."""
    return re.findall(r"[a-z]+", text.lower())


def exact_match(generated: list[str], sources: list[str]) -> float:
    """The share of generated texts equal to their source."""
    return sum(g == s for g, s in zip(generated, sources, strict=True)) / max(1, len(sources))


def word_f1(generated: list[str], source: list[str]) -> float:
    """F1 of the word multisets (0 when either is empty)."""
    common = sum((Counter(generated) & Counter(source)).values())
    if not common:
        return 0.0
    precision, recall = common / len(generated), common / len(source)
    return 2 * precision * recall / (precision + recall)


def bleu(generated: list[str], references: list[str]) -> float:
    """Corpus BLEU (0-100) of `generated` against one reference text each (module docstring)."""
    return float(sacrebleu.corpus_bleu(generated, [references]).score)


def bleu_statistics(generated: list[str], references: list[str]) -> np.ndarray:
    """(n, 10) per-text BLEU counts (hypothesis and reference lengths, matched and total 1- to 4-grams):
    corpus BLEU is a function of their sum (`bleu_of_statistics`), so a resample of texts is a sum."""
    return np.array(BLEU()._extract_corpus_statistics(generated, [references]), dtype=np.float64).reshape(-1, 10)


def bleu_of_statistics(statistics: np.ndarray) -> float:
    """Corpus BLEU (as `bleu`) of the texts whose `bleu_statistics` rows are given."""
    return float(BLEU()._compute_score_from_stats(np.asarray(statistics).sum(axis=0).tolist()).score)


def word_ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The word n-grams of `text`, in order."""
    tokens = words(text)
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repetition_per_text(texts: Iterable[str], n: int) -> list[float | None]:
    """seq-rep-n (module docstring) of each text; None for a text without a word n-gram."""
    return [1.0 - len(set(grams)) / len(grams) if grams else None for grams in (word_ngrams(t, n) for t in texts)]


def repetition(texts: Iterable[str], n: int) -> float | None:
    """seq-rep-n (module docstring) averaged over the texts with at least one word n-gram; None when
    no text has one."""
    shares = [share for share in repetition_per_text(texts, n) if share is not None]
    return sum(shares) / len(shares) if shares else None


def distinct(texts: Iterable[str], n: int) -> float | None:
    """distinct-n over all `texts` together (module docstring); None without any word n-gram."""
    return distinct_of([word_ngrams(text, n) for text in texts])


def distinct_of(grams_per_text: list[list[tuple[str, ...]]]) -> float | None:
    """distinct-n of texts given as their word n-grams (`word_ngrams`); None without any."""
    grams = [gram for grams in grams_per_text for gram in grams]
    return len(set(grams)) / len(grams) if grams else None


def copied(texts: list[str], training_texts: Iterable[str]) -> list[bool]:
    """Whether each of `texts` is found verbatim (whitespace collapsed) among `training_texts`."""
    seen = {" ".join(t.split()) for t in training_texts}
    return [" ".join(t.split()) in seen for t in texts]


def copy_rate(texts: list[str], training_texts: Iterable[str]) -> float:
    """The share of `texts` found verbatim (whitespace collapsed) among `training_texts`."""
    return sum(copied(texts, training_texts)) / max(1, len(texts))


def shuffled_words(texts: list[str], seed: int = 0) -> list[str]:
    """Each text's words in a random order (the same order for the same seed): real words, no syntax."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        tokens = words(text)
        rng.shuffle(tokens)
        out.append(" ".join(tokens))
    return out


@dataclass
class NgramReference:
    """A word n-gram language model of real text, the judge of fluency that shares nothing with the model
    evaluated: interpolated Kneser-Ney (Kneser & Ney 1995; nltk.lm, discount 0.75) of order 3 by default.

    OOV words: a word seen fewer than `unk_cutoff` (2) times in the fitted texts is nltk's <UNK> when
    fitting, so <UNK> holds the probability of all rare words together. When scoring, a word outside the
    vocabulary (rare or never seen) gets one rare type's share of it, p(<UNK> | context) / the number of
    word types <UNK> stands for: an invented word costs what one rare word costs, finite but high. (Scoring
    <UNK> itself would make a text of invented words cheap: <UNK> after <UNK> is likely.) Perplexity is
    2 ** (mean -log2 p) over every word of every text and each text's end, token-weighted over the texts."""

    model: Any  # nltk InterpolatedLanguageModel (mmldlm/evaluation/kneser_ney.py)
    num_texts: int  # texts it was fitted on
    num_unknown_types: int  # word types of those texts that <UNK> stands for
    # SHA-256 of the fitted texts and the settings: perplexities of two reports compare only under one reference
    sha256: str = ""

    @classmethod
    def fit(cls, texts: list[str], order: int = 3, unk_cutoff: int = 2, discount: float = 0.75) -> NgramReference:
        """The reference fitted on `texts` (training texts only: text it scores later must not be among them)."""
        # here: kneser_ney.py imports nltk, which takes a second; only the fluency figure needs it
        from mmldlm.evaluation.kneser_ney import fit_kneser_ney, num_unknown_types

        model = fit_kneser_ney([words(t) for t in texts], order, unk_cutoff, discount)
        digest = hashlib.sha256(f"order {order}, unk_cutoff {unk_cutoff}, discount {discount}\n".encode())
        for text in texts:
            digest.update(text.encode("utf-8") + b"\n")
        return cls(model, len(texts), num_unknown_types(model), digest.hexdigest())

    @property
    def order(self) -> int:
        return self.model.order

    def bits_per_text(self, texts: list[str]) -> tuple[list[float], list[int]]:
        """(-log2 p summed over each text's words and its end, the number of those) per text: the
        perplexity of any set of the texts is 2 ** (sum of bits / sum of counts)."""
        from mmldlm.evaluation.kneser_ney import log2_probabilities  # here: see `fit`

        scores = [log2_probabilities(self.model, words(text), self.num_unknown_types) for text in texts]
        return [-sum(s) for s in scores], [len(s) for s in scores]

    def perplexity(self, texts: list[str]) -> float | None:
        """Perplexity of `texts` (class docstring); None for no texts."""
        bits, counts = self.bits_per_text(texts)
        return perplexity_of(bits, counts) if sum(counts) else None


def perplexity_of(bits, counts) -> float:
    """2 ** (sum(bits) / sum(counts)): the perplexity of texts from their `bits_per_text`; inf when a
    word has probability 0."""
    total = float(np.sum(bits))
    return 2.0 ** (total / max(1, int(np.sum(counts)))) if math.isfinite(total) else math.inf
