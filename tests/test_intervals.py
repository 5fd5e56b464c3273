import numpy as np
import pytest

from mmldlm.sampling.intervals import Corpus, Mean, bootstrap, bootstrap_statistic, paired_difference


def test_the_bootstrap_interval_covers_a_known_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    trials, covered = 200, 0
    for trial in range(trials):
        est = bootstrap(rng.exponential(1.0, size=100), num_resamples=400, seed=trial)
        covered += est.low <= 1.0 <= est.high
    # Binomial(200, 0.95) is within [181, 197] with probability ~0.99; the percentile bootstrap of a
    # skewed mean at n = 100 under-covers slightly, so the lower bound is a little lower.
    assert 178 <= covered <= 197, covered


def test_a_ratio_of_sums_weights_each_text_by_its_tokens():
    est = bootstrap([1.0, 3.0], weights=[3, 1], num_resamples=50)
    assert est.value == pytest.approx((1 * 3 + 3 * 1) / 4)
    assert est.n == 2


def test_draws_per_text_widen_the_interval_beside_one_draw():
    rng = np.random.default_rng(1)
    text_effect = rng.normal(size=(200, 1))
    draws = text_effect + rng.normal(scale=3.0, size=(200, 4))
    two_level = bootstrap(draws, num_resamples=400)
    text_only = bootstrap(draws.mean(axis=1), num_resamples=400)
    assert two_level.value == pytest.approx(text_only.value)
    assert (two_level.high - two_level.low) >= 0.9 * (text_only.high - text_only.low)


def test_a_corpus_statistic_is_resampled_as_a_whole():
    values = np.arange(10, dtype=float)
    est = bootstrap_statistic(lambda idx: float(values[idx].max()), n=10, num_resamples=200)
    assert est.value == 9.0 and est.high == 9.0 and est.low < 9.0


def test_a_run_compared_with_itself_is_not_significant_and_a_shift_is():
    rng = np.random.default_rng(2)
    a = rng.normal(size=128)
    same = paired_difference(a, a)
    assert same.difference == 0.0 and not same.significant
    shifted = paired_difference(a + 0.3 + rng.normal(scale=0.1, size=128), a)
    assert shifted.significant and shifted.low > 0


def _seeded_arm(rng, texts, runs, shift=0.0, seed_sd=0.1):
    """Per-text values of `runs` runs of one recipe: the texts' own difficulty, each seed's offset (a
    model trained with another seed is another model), and each run's per-text noise."""
    return [
        {"v": texts + shift + rng.normal(scale=seed_sd) + rng.normal(scale=0.3, size=texts.size)} for _ in range(runs)
    ]


def test_two_seeds_per_arm_flag_about_5_percent_of_same_recipe_comparisons_where_one_seed_flags_most():
    # Two arms of the same recipe: every difference between them is the seeds'. The paired bootstrap of
    # one run per arm sees only the texts and calls most such pairs different; the arms' interval,
    # which adds the seeds' variance, flags about the 5% it promises (t with ~2 df is conservative).
    rng = np.random.default_rng(4)
    trials, flagged_arms, flagged_single = 100, 0, 0
    for trial in range(trials):
        texts = rng.normal(size=128)
        a, b = _seeded_arm(rng, texts, 2), _seeded_arm(rng, texts, 2)
        flagged_arms += Mean("v").arms_difference(a, b, num_resamples=200, seed=trial).significant
        flagged_single += Mean("v").difference(a[0], b[0], num_resamples=200, seed=trial).significant
    assert flagged_arms <= 10, flagged_arms  # Binomial(100, 0.05) exceeds 10 with probability ~0.01
    assert flagged_single >= 50, flagged_single


def test_a_recipe_better_by_far_more_than_its_seeds_differ_is_found_with_two_seeds_per_arm():
    rng = np.random.default_rng(5)
    texts = rng.normal(size=128)
    a, b = _seeded_arm(rng, texts, 2, shift=1.0, seed_sd=0.05), _seeded_arm(rng, texts, 2, seed_sd=0.05)
    diff = Mean("v").arms_difference(a, b)
    assert diff.significant and diff.low > 0.5 and diff.runs_a == diff.runs_b == 2
    assert diff.a == pytest.approx(np.mean([r["v"].mean() for r in a]))
    assert diff.seed_sd > 0 and 0 < diff.df < 100  # few seeds: few degrees of freedom, a wide t
    # An arm of one run borrows the other arm's spread between seeds (pooled, 1 degree of freedom).
    one = Mean("v").arms_difference(a[:1], b)
    assert one.runs_a == 1 and one.high - one.low > diff.high - diff.low
    corpus = Corpus(("v",), lambda p: lambda idx: float(np.median(np.asarray(p["v"])[idx])))
    assert corpus.arms_difference(a, b).significant
    with pytest.raises(ValueError, match="two or more"):
        Mean("v").arms_difference(a[:1], b[:1])


def test_runs_on_their_own_texts_compare_unpaired_with_a_wider_interval_than_shared_texts_give():
    rng = np.random.default_rng(6)
    texts = rng.normal(size=200)  # the texts' own difficulty dominates each text's value
    a, b = {"v": texts + 0.2 + rng.normal(scale=0.1, size=200)}, {"v": texts + rng.normal(scale=0.1, size=200)}
    paired = Mean("v").difference(a, b)
    other_texts = {"v": rng.normal(size=150) + rng.normal(scale=0.1, size=150)}  # B on texts of its own
    unpaired = Mean("v").unpaired_difference(a, other_texts)
    assert paired.significant and paired.low > 0.15
    assert unpaired.high - unpaired.low > 5 * (paired.high - paired.low) and unpaired.n == 150
    assert unpaired.low < unpaired.difference < unpaired.high
    corpus = Corpus(("v",), lambda p: lambda idx: float(np.mean(np.asarray(p["v"])[idx])))
    assert corpus.unpaired_difference(a, other_texts).difference == pytest.approx(unpaired.difference)


def test_unequal_numbers_of_texts_are_refused():
    with pytest.raises(ValueError, match="same"):
        paired_difference([1.0, 2.0], [1.0])


def test_recipes_pair_the_draws_of_two_reports_and_weigh_each_text_by_its_tokens():
    rng = np.random.default_rng(3)
    per_text = {"nats": rng.normal(5.0, 1.0, size=(64, 2)), "tokens": rng.integers(3, 30, size=64)}
    recipe = Mean("nats", "tokens")
    est = recipe.estimate(per_text)
    expected = (per_text["nats"] * per_text["tokens"][:, None]).sum() / (2 * per_text["tokens"].sum())
    assert est.value == pytest.approx(expected) and est.low < est.value < est.high and est.n == 64
    same = recipe.difference(per_text, per_text)
    assert same.difference == same.low == same.high == 0.0  # the same texts and the same draws of each
    corpus = Corpus(("nats",), lambda p: lambda idx: float(np.asarray(p["nats"])[idx].max()))
    assert corpus.difference(per_text, per_text).high == 0.0


def test_a_figure_that_resampling_biases_gets_no_interval_and_no_paired_difference():
    # distinct-n of texts drawn with replacement: every duplicate reads as repetition, so each
    # resample falls below the figure; such a figure is reported alone.
    from mmldlm.sampling.evaluate import _distinct

    texts = [f"text {'ab' * (i + 1)} says something new" for i in range(20)]
    recipe = _distinct(1)
    est = recipe.estimate({"texts": texts})
    assert est.value == pytest.approx((20 + 4) / (20 * 5))
    assert np.isnan(est.low) and np.isnan(est.high)
    assert recipe.difference({"texts": texts}, {"texts": texts}) is None


def test_seed_spread_reads_each_runs_evaluation_and_gives_the_one_run_yardstick(tmp_path, capsys, monkeypatch):
    import json
    import math
    from pathlib import Path

    from scipy import stats

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    from seed_spread import main as seed_spread

    values = [0.30, 0.34, 0.32]
    for i, value in enumerate(values):
        run = tmp_path / f"seed{i}"
        run.mkdir()
        records = [{"step": 5, "loss": 1.0}, {"step": 10, "eval_l2t_word_f1": 0.1, "eval_l2t_num_samples": 32}]
        records.append({"step": 20, "eval_l2t_word_f1": value, "eval_l2t_num_samples": 32})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert seed_spread([str(tmp_path / f"seed{i}") for i in range(3)]) == 0
    out = capsys.readouterr().out
    sd = float(np.std(values, ddof=1))
    half = stats.t.ppf(0.975, 2) * math.sqrt(2) * sd
    assert "step 20, n = 32 texts" in out  # the last step every run evaluated
    assert f"| l2t_word_f1 | 0.3 | 0.34 | 0.32 | 0.32 | {sd:.3g} | {half:.3g} |" in out


def test_decoding_table_rows_after_the_first_carry_their_paired_difference_from_it(monkeypatch):
    from pathlib import Path

    from mmldlm.sampling.evaluate import L2T, figure_text, summarise

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    from decoding_table import cell

    rng = np.random.default_rng(0)
    shared = rng.uniform(0.0, 1.0, 400)  # what the texts share: cancels in the paired difference
    first = summarise(L2T, {"word_f1": shared})
    better = summarise(L2T, {"word_f1": shared + 0.02 + rng.normal(0.0, 0.01, 400)})
    # the first row has nothing to differ from: its figure and interval alone
    assert cell(first, None, L2T, "word_f1", "{:.3f}") == figure_text(first, "word_f1", ".3f")
    same = cell(first, first, L2T, "word_f1", "{:.3f}")
    assert same.endswith("; +0.000 [+0.000, +0.000]")  # a row against itself: exactly 0
    text = cell(better, first, L2T, "word_f1", "{:.3f}")
    difference, bounds = text.split("; ")[1].split(" ", 1)
    low, high = (float(b) for b in bounds.strip("[]").split(", "))
    assert abs(float(difference) - 0.02) < 0.003 and 0.0 < low < 0.02 < high
    # unpaired, the texts' own spread (sd 0.29 over 400) would give a half-width near 0.04, spanning 0
    assert high - low < 0.01
    assert cell(better, first, L2T, "model_calls_per_batch", "{:.0f}") == "-"


def test_compare_leaves_out_perplexities_scored_by_different_n_gram_references():
    from mmldlm.sampling.compare import compare_reports, markdown
    from mmldlm.sampling.evaluate import L2T, summarise
    from mmldlm.sampling.text_metrics import NgramReference

    rng = np.random.default_rng(0)
    corpus = ["the cat sat on the mat", "a dog ran in the park", "the dog sat on a mat"]
    same, other = NgramReference.fit(corpus), NgramReference.fit(corpus[:2])
    assert same.sha256 == NgramReference.fit(list(corpus)).sha256 != other.sha256

    def report(reference: NgramReference, texts: list[str]) -> dict:
        bits, counts = reference.bits_per_text(texts)
        per_text = {"word_f1": rng.uniform(0, 1, len(texts)), "ngram_bits": bits, "ngram_words": counts}
        section = summarise(L2T, per_text, num_samples=len(texts))
        return {"texts_sha256": "t", "seed": 0, "l2t": section, "fluency_reference": {"sha256": reference.sha256}}

    texts = ["the cat ran on the mat", "a dog sat in the park"] * 4
    one = compare_reports(report(same, texts), report(same, texts))
    assert {r["figure"] for r in one["rows"]} == {"word_f1", "ngram_perplexity"} and not one["other_reference"]
    two = compare_reports(report(same, texts), report(other, texts), unpaired=True)
    assert [r["figure"] for r in two["rows"]] == ["word_f1"] and two["other_reference"] == ["l2t ngram_perplexity"]
    assert "Scored by different n-gram references" in markdown(two)
