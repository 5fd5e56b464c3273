"""The writing figures on hand-made texts whose answers are known, and the n-gram reference's rules."""

import math

import pytest

from mmldlm.sampling import text_metrics as tm


def test_an_exact_copy_scores_full_bleu_f1_and_copy_rate():
    sources = ["a small dog that barks at strangers", "an instrument for measuring temperature"]
    assert tm.corpus_bleu(sources, sources) == pytest.approx(100.0)
    assert tm.word_f1(tm.words(sources[0]), tm.words(sources[0])) == 1.0
    assert tm.copy_rate(sources, {tm.normalized(s) for s in sources}) == 1.0
    assert tm.copy_rate(["a small  dog that barks at strangers "], {tm.normalized(sources[0])}) == 1.0
    assert tm.copy_rate(["a small dog"], {tm.normalized(s) for s in sources}) == 0.0
    # Word salad of the source's words keeps F1 1 but loses BLEU: the reason both are reported.
    salad = ["strangers at barks that dog small a", "temperature measuring for instrument an"]
    assert tm.word_f1(tm.words(salad[0]), tm.words(sources[0])) == 1.0
    assert tm.corpus_bleu(salad, sources) < 10


def test_repetition_is_rep_n_by_hand():
    # "the bark of the bark": bigrams the-bark, bark-of, of-the, the-bark -> 3 distinct of 4.
    assert tm.repetition(["the bark of the bark"], 2) == pytest.approx(0.25)
    assert tm.repetition(["the bark of the bark"], 1) == pytest.approx(1 - 3 / 5)
    assert tm.repetition(["a small dog"], 2) == 0.0
    # Texts without a bigram do not count; the mean is over the others.
    assert tm.repetition(["dog", "bark bark bark"], 2) == pytest.approx(0.5)
    assert tm.distinct(["a dog", "a dog", "a cat"], 2) == pytest.approx(2 / 3)
    assert tm.distinct(["a dog", "a cat"], 1) == pytest.approx(3 / 4)


TRAIN = ["a small dog that barks", "a small cat that sleeps", "the dog barks at a cat", "a dog runs"]


def test_the_ngram_model_is_a_distribution_over_every_word_and_the_unknown_one():
    lm = tm.NgramLM(TRAIN)
    for context in [(tm.BOS, tm.BOS), ("a", "small"), ("never", "seen"), ("dog", "barks")]:
        total = sum(lm.trigram(*context, w) for w in lm.vocabulary()) + lm.trigram(*context, "unicorn")
        assert total == pytest.approx(1.0)
    assert math.isfinite(lm.perplexity(["a purple unicorn"]))


def test_real_text_is_more_fluent_than_its_words_shuffled_and_than_unseen_text():
    lm = tm.NgramLM(TRAIN)
    assert lm.perplexity(["a small dog that barks"]) < lm.perplexity(["barks that dog small a"])
    # A sentence planted only in validation is scored as unseen text: fitted on the training texts alone.
    planted = "the cat sleeps at a dog"
    assert lm.perplexity([planted]) > lm.perplexity(["the dog barks at a cat"])
    assert tm.NgramLM([*TRAIN, planted]).perplexity([planted]) < lm.perplexity([planted])
