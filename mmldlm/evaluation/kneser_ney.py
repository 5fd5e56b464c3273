"""nltk's interpolated Kneser-Ney word language model, with its continuation counts indexed once.

nltk's `KneserNey` smoothing finds the continuation counts N1+(. context w) of a lower order by scanning
every higher-order context on each call: about 70 ms a word with 49k training texts, so scoring a few
hundred texts took minutes. `IndexedKneserNey` gives the same numbers (tests/test_text_metrics.py
compares them) from a table built in one pass over the counts (0.5 s), the first time a word is scored.
This module imports nltk, which takes a second (nltk loads scipy.stats): text_metrics.py imports it only
when a reference is fitted.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict

from nltk.lm import Vocabulary
from nltk.lm.models import InterpolatedLanguageModel
from nltk.lm.preprocessing import pad_both_ends, padded_everygram_pipeline
from nltk.lm.smoothing import KneserNey
from nltk.util import ngrams


class IndexedKneserNey(KneserNey):
    """nltk's Kneser-Ney smoothing; continuation counts read from `continuations` (module docstring)."""

    @functools.cached_property
    def continuations(self) -> tuple[dict[tuple, Counter], Counter]:
        """({context: {word: N1+(. context word)}}, {context: N1+(. context .)}) of every order below the
        model's, from the fitted counts (so built after `fit`)."""
        counts, totals = defaultdict(Counter), Counter()
        for order in range(2, self._order + 1):
            for prefix, followers in self.counts[order].items():
                context = prefix[1:]  # the prefix's first word is the "." that is counted once per type
                seen = [word for word, count in followers.items() if count > 0]
                counts[context].update(seen)
                totals[context] += len(seen)
        return dict(counts), totals

    def _continuation_counts(self, word, context=()):
        counts, totals = self.continuations
        return counts.get(context, {}).get(word, 0), totals[context]


def fit_kneser_ney(
    sentences: list[list[str]], order: int, unk_cutoff: int, discount: float
) -> InterpolatedLanguageModel:
    """An interpolated Kneser-Ney model of `order` fitted on word lists; words seen fewer than
    `unk_cutoff` times become nltk's <UNK>; each sentence is padded with order - 1 <s> and </s>."""
    grams, padded_words = padded_everygram_pipeline(order, sentences)
    vocabulary = Vocabulary(padded_words, unk_cutoff=unk_cutoff)  # the words, <s> and </s>
    model = InterpolatedLanguageModel(
        IndexedKneserNey, order, vocabulary=vocabulary, params={"discount": discount, "order": order}
    )
    model.fit(grams)
    return model


def num_unknown_types(model: InterpolatedLanguageModel) -> int:
    """How many word types of the fitted text <UNK> stands for (those seen fewer than the cutoff times)."""
    return max(1, sum(count < model.vocab.cutoff for count in model.vocab.counts.values()))


def log2_probabilities(model: InterpolatedLanguageModel, sentence: list[str], unknown_types: int) -> list[float]:
    """log2 p of each word of `sentence` given the words before it, and of its end (the first </s>). A
    word outside the vocabulary gets one type's share of <UNK>, p(<UNK> | context) / `unknown_types`."""
    padded = pad_both_ends(sentence, n=model.order)
    grams = list(ngrams(padded, model.order))[: len(sentence) + 1]
    unknown = math.log2(unknown_types)
    return [model.logscore(g[-1], g[:-1]) - (unknown if g[-1] not in model.vocab else 0.0) for g in grams]
