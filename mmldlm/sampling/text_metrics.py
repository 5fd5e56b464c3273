"""Figures of generated text that a keyword salad cannot game, each with a definition a reader can check.

- `word_f1`: F1 of the word multisets of a text and its source (order-free).
- `corpus_bleu`: sacrebleu's corpus BLEU (Papineni et al. 2002; its default 13a tokenizer), 0-100.
- `repetition`: rep-n of Welleck et al. 2019 ("Neural text generation with unlikelihood training"),
  per text: 1 - distinct word n-grams / word n-grams; averaged over the texts that have an n-gram.
  A text that says the same bigram twice scores above 0; real text has some (rep-1 counts "the").
- `distinct`: distinct-n of Li et al. 2016 across a set of texts: distinct word n-grams / word n-grams.
- `copy_rate`: the share of texts found verbatim (after whitespace normalisation) among known texts.
- `NgramLM`: an independent fluency reference, a word trigram model with interpolated Kneser-Ney
  smoothing (Chen & Goodman 1998, "An empirical study of smoothing techniques", eq. 26 with one
  discount), fitted on training texts only. Its lowest order is interpolated with a uniform
  distribution over the vocabulary plus one unknown word, so a word never seen in training gets a
  small, finite probability (it raises the perplexity rather than making it infinite).
  nltk's KneserNeyInterpolated is the same estimator but scans every n-gram of the model for each
  query (minutes for 128 short texts) and gives unseen words probability zero, so it is not used here.

Words are the lowercase letter runs of a text (`words`).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import sacrebleu

BOS, EOS = "<s>", "</s>"


def words(text: str) -> list[str]:
    """The lowercase letter runs of `text`, in order."""
    return re.findall(r"[a-z]+", text.lower())


def word_f1(generated: list[str], source: list[str]) -> float:
    """F1 of the word multisets (0 when either is empty)."""
    common = sum((Counter(generated) & Counter(source)).values())
    if not common:
        return 0.0
    precision, recall = common / len(generated), common / len(source)
    return 2 * precision * recall / (precision + recall)


def corpus_bleu(generated: list[str], sources: list[str]) -> float:
    """Corpus BLEU (0-100) of the generated texts against one source each."""
    return sacrebleu.corpus_bleu(generated, [sources]).score


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repetition(texts: list[str], n: int = 2) -> float:
    """Mean rep-n over the texts with at least one word n-gram (0 when none has)."""
    scores = []
    for text in texts:
        grams = _ngrams(words(text), n)
        if grams:
            scores.append(1.0 - len(set(grams)) / len(grams))
    return sum(scores) / len(scores) if scores else 0.0


def distinct(texts: list[str], n: int = 2) -> float:
    """distinct-n across the texts (0 when they hold no n-gram)."""
    grams = [gram for text in texts for gram in _ngrams(words(text), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def normalized(text: str) -> str:
    return " ".join(text.split())


def copy_rate(texts: list[str], known: set[str] | frozenset[str]) -> float:
    """The share of texts that are, whitespace-normalised, in `known` (normalised the same way)."""
    return sum(normalized(text) in known for text in texts) / len(texts) if texts else 0.0


class NgramLM:
    """Interpolated Kneser-Ney trigram model over words (module docstring). `perplexity(texts)` is
    exp of the mean negative log-probability per word, the end of each text counted as a word."""

    def __init__(self, texts: list[str], discount: float = 0.75):
        self.discount = discount
        trigrams, bigrams = Counter(), Counter()
        for text in texts:
            padded = [BOS, BOS, *words(text), EOS]
            trigrams.update(_ngrams(padded, 3))
            bigrams.update(_ngrams(padded[1:], 2))
        # Order 3 reads raw counts; orders 2 and 1 read continuation counts (distinct left contexts).
        self.tri, self.tri_context = trigrams, Counter()
        self.tri_types = Counter()  # (u, v) -> distinct w after it
        for (u, v, _), count in trigrams.items():
            self.tri_context[(u, v)] += count
            self.tri_types[(u, v)] += 1
        self.bi_cont = Counter((v, w) for (_, v, w) in trigrams)  # N1+(. v w)
        self.bi_cont_context, self.bi_types = Counter(), Counter()  # N1+(. v .), distinct w after v
        for (v, _), count in self.bi_cont.items():
            self.bi_cont_context[v] += count
            self.bi_types[v] += 1
        self.uni_cont = Counter(w for (_, w) in bigrams)  # N1+(. w)
        self.uni_total = sum(self.uni_cont.values())
        self.vocab_size = len(self.uni_cont) + 1  # the words that can follow something, and one unknown

    def unigram(self, w: str) -> float:
        d = self.discount
        seen = max(self.uni_cont[w] - d, 0.0) / self.uni_total
        return seen + d * len(self.uni_cont) / self.uni_total / self.vocab_size

    def bigram(self, v: str, w: str) -> float:
        total = self.bi_cont_context[v]
        if not total:
            return self.unigram(w)
        d = self.discount
        return max(self.bi_cont[(v, w)] - d, 0.0) / total + d * self.bi_types[v] / total * self.unigram(w)

    def trigram(self, u: str, v: str, w: str) -> float:
        """P(w | u v)."""
        total = self.tri_context[(u, v)]
        if not total:
            return self.bigram(v, w)
        d = self.discount
        return max(self.tri[(u, v, w)] - d, 0.0) / total + d * self.tri_types[(u, v)] / total * self.bigram(v, w)

    def perplexity(self, texts: list[str]) -> float:
        nll, count = 0.0, 0
        for text in texts:
            padded = [BOS, BOS, *words(text), EOS]
            for u, v, w in _ngrams(padded, 3):
                nll -= math.log(self.trigram(u, v, w))
                count += 1
        return math.exp(nll / count) if count else float("nan")

    def vocabulary(self) -> list[str]:
        """Every word the model can predict with a seen count (and the end of a text)."""
        return list(self.uni_cont)
