"""The text metrics of evaluation on hand-made texts whose answers are worked out by hand, and the n-gram
reference: the same numbers as nltk's own Kneser-Ney, a distribution, and judging real text better than
shuffled words."""

import pytest
from nltk.lm import KneserNeyInterpolated, Vocabulary
from nltk.lm.preprocessing import padded_everygram_pipeline

from mmldlm.evaluation.kneser_ney import fit_kneser_ney
from mmldlm.evaluation.text_metrics import (
    NgramReference,
    bleu,
    bleu_of_statistics,
    bleu_statistics,
    copy_rate,
    distinct,
    exact_match,
    perplexity_of,
    repetition,
    shuffled_words,
    word_f1,
    words,
)

TRAINING = [
    "the dog ran across the field",
    "a small dog sat on the mat",
    "the cat sat on the mat",
    "a dog and a cat ran across the road",
    "the field was wet after the rain",
    "a small cat ran after the dog",
]


def test_repetition_is_the_share_of_repeated_word_ngrams_of_each_text():
    # "the dog the dog the dog": bigrams the-dog, dog-the, the-dog, dog-the, the-dog: 2 distinct of 5.
    assert repetition(["the dog the dog the dog"], 2) == pytest.approx(1 - 2 / 5)
    assert repetition(["the dog the dog the dog"], 1) == pytest.approx(1 - 2 / 6)
    # Averaged over texts; a text with no bigram ("dog") has no share of repeated bigrams and is left out.
    assert repetition(["a a a", "a b c", "dog"], 2) == pytest.approx((0.5 + 0.0) / 2)
    assert repetition(["dog", ""], 2) is None
    assert repetition(TRAINING[:2], 2) == 0.0


def test_distinct_counts_ngrams_across_all_samples():
    assert distinct(["a b", "a b c"], 1) == pytest.approx(3 / 5)  # a b a b c
    assert distinct(["a b", "a b c"], 2) == pytest.approx(2 / 3)  # a-b a-b b-c
    assert distinct(["same text here"] * 4, 2) == pytest.approx(2 / 8)
    assert distinct(["one"], 2) is None


def test_an_exact_copy_has_bleu_100_and_copy_rate_1():
    assert bleu(TRAINING, TRAINING) == pytest.approx(100.0)
    assert bleu(TRAINING[1:] + TRAINING[:1], TRAINING) < 20
    assert exact_match(TRAINING, TRAINING) == 1.0 and exact_match(TRAINING[::-1], TRAINING) == 0.0
    assert copy_rate(TRAINING[:3], TRAINING) == 1.0
    assert copy_rate(["a  small dog sat on the mat ", "a dog no one wrote"], TRAINING) == 0.5  # whitespace aside


def test_words_and_word_f1():
    assert words("The café's 12 dogs!") == ["the", "caf", "s", "dogs"]
    assert word_f1(["a", "dog"], ["a", "dog"]) == 1.0 and word_f1([], ["a"]) == 0.0
    assert word_f1(["a", "dog", "ran"], ["a", "cat"]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))


def test_shuffled_words_keep_the_words_and_lose_the_order():
    texts = ["one two three four five six seven", "a b"]
    shuffled = shuffled_words(texts, seed=0)
    assert [sorted(words(s)) for s in shuffled] == [sorted(words(t)) for t in texts]
    assert shuffled[0] != texts[0] and shuffled == shuffled_words(texts, seed=0)


def test_the_indexed_kneser_ney_gives_nltks_numbers_and_a_distribution():
    sentences = [words(t) for t in TRAINING]
    ours = fit_kneser_ney(sentences, order=3, unk_cutoff=1, discount=0.75)
    grams, padded_words = padded_everygram_pipeline(3, sentences)
    stock = KneserNeyInterpolated(3, discount=0.75, vocabulary=Vocabulary(padded_words))
    stock.fit(grams)
    vocabulary = sorted(ours.vocab)
    assert {"</s>", "<s>", "<UNK>"} <= set(vocabulary)
    for context in [(), ("the",), ("<s>", "<s>"), ("the", "dog"), ("on", "the"), ("zebra", "the")]:
        scores = [ours.score(word, context) for word in vocabulary]
        assert scores == [stock.score(word, context) for word in vocabulary]
        if context != ("<s>", "<s>"):  # (nltk's counts of its own padding make that one sum to 1.09)
            assert sum(scores) == pytest.approx(1.0)


def test_shuffled_words_and_unseen_words_score_worse_than_real_text():
    reference = NgramReference.fit(TRAINING)
    assert reference.order == 3 and reference.num_texts == len(TRAINING)
    real = reference.perplexity(["the dog sat on the mat", "a small cat ran across the field"])
    shuffled = reference.perplexity(["mat the on sat dog the", "field across small the ran cat a"])
    assert 1 < real < shuffled
    # Outside the vocabulary (seen fewer than 2 times) a word costs one rare word's share of <UNK>, finite;
    # and a text of invented words is not cheap although <UNK> after <UNK> is likely.
    invented = reference.perplexity(["the dog sat on the zorblax"])
    assert real < invented < float("inf")
    assert reference.perplexity(["zorb lax quib frob nix", "blorf wug"]) > shuffled
    assert reference.perplexity([]) is None


def test_corpus_figures_of_any_subset_follow_from_per_text_counts():
    generated = ["the dog sat on the mat", "a cat ran", "the field was wet", "a small dog"]
    statistics = bleu_statistics(generated, TRAINING[:4])
    assert statistics.shape == (4, 10)
    for subset in ([0, 1, 2, 3], [1, 3], [2, 2, 0]):  # a bootstrap resample repeats texts
        picked = [generated[i] for i in subset]
        assert bleu_of_statistics(statistics[subset]) == pytest.approx(bleu(picked, [TRAINING[i] for i in subset]))
    reference = NgramReference.fit(TRAINING)
    bits, counts = reference.bits_per_text(generated)
    assert counts == [len(words(t)) + 1 for t in generated]  # every word and the text's end
    assert perplexity_of(bits[1:3], counts[1:3]) == pytest.approx(reference.perplexity(generated[1:3]))
