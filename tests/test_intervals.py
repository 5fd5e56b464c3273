import numpy as np
import pytest

from mmldlm.evaluation.intervals import (
    CorpusStatistic,
    Mean,
    Rate,
    bootstrap,
    bootstrap_statistic,
    paired_difference,
    seed_t_interval,
)

# Coverage: the share of simulated samples whose 95% interval holds the true figure. With 1000 trials a
# 95% interval covers 93.5-95% here and a 90% one 88-91% (each figure measured at both levels); the
# band [92.5%, 97%] passes the first and fails the second, and fails an interval 20% too wide (about 98%).
COVERAGE_BAND = (0.925, 0.97)


def _coverage(interval, truth: float, trials: int = 1000) -> float:
    rng = np.random.default_rng(0)
    covered = 0
    for trial in range(trials):
        low, high = interval(rng, trial)
        covered += low <= truth <= high
    return covered / trials


def _in_band(coverage: float) -> bool:
    return COVERAGE_BAND[0] <= coverage <= COVERAGE_BAND[1]


def test_the_interval_of_a_mean_covers_the_true_mean_95_percent_of_the_time():
    def interval(rng, trial):  # gamma(4): skewed like a per-text score, mean 4
        est = bootstrap(rng.gamma(4.0, size=100), seed=trial)
        return est.low, est.high

    coverage = _coverage(interval, 4.0)
    assert _in_band(coverage), coverage


def test_the_interval_of_a_ratio_covers_the_true_per_token_figure_95_percent_of_the_time():
    def interval(rng, trial):  # nats per token: short texts cost more per token, and vary more
        tokens = rng.integers(3, 30, size=100).astype(float)
        nats = 4.0 + 10.0 / tokens + rng.normal(size=100) / np.sqrt(tokens)
        est = bootstrap(nats, weights=tokens, seed=trial)
        return est.low, est.high

    coverage = _coverage(interval, 4.0 + 10.0 / 16.0)  # E[nats * tokens] / E[tokens], E[tokens] = 16
    assert _in_band(coverage), coverage


def test_the_interval_of_texts_times_draws_covers_95_percent_where_the_draws_dominate():
    # two draws per text, each three times as noisy as the texts differ: resampling draws within texts
    # as well counted their variance twice (an interval 21% too wide, covering about 98%)
    def interval(rng, trial):
        est = bootstrap(rng.normal(size=(100, 1)) + rng.normal(scale=3.0, size=(100, 2)), seed=trial)
        return est.low, est.high

    coverage = _coverage(interval, 0.0)
    assert _in_band(coverage), coverage


def test_the_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    def interval(rng, trial):
        texts = rng.normal(size=100)
        a, b = texts + 0.2 + rng.normal(scale=0.5, size=100), texts + rng.normal(scale=0.5, size=100)
        diff = paired_difference(a, b, seed=trial)
        return diff.low, diff.high

    coverage = _coverage(interval, 0.2)
    assert _in_band(coverage), coverage


def _bleu_rows(rng, n: int) -> np.ndarray:
    """(n, 10) per-text BLEU counts like `bleu_statistics`: lengths, matched and total 1- to 4-grams;
    references longer than the texts, so the brevity penalty is smooth where the figure sits."""
    hyp = rng.integers(5, 25, size=n)
    ref = hyp + rng.integers(1, 6, size=n)
    totals = np.maximum(hyp[:, None] - np.arange(4)[None, :], 0)
    matched = rng.binomial(totals, [0.5, 0.2, 0.08, 0.03])
    return np.column_stack([hyp, ref, matched, totals]).astype(float)


def test_the_interval_of_corpus_bleu_covers_the_corpus_figure_95_percent_of_the_time():
    from mmldlm.evaluation.text_metrics import bleu_of_statistics

    truth = bleu_of_statistics(_bleu_rows(np.random.default_rng(1), 2_000_000))  # the population's BLEU

    def interval(rng, trial):
        rows = _bleu_rows(rng, 100)
        est = bootstrap_statistic(lambda idx: bleu_of_statistics(rows[idx]), 100, num_resamples=300, seed=trial)
        return est.low, est.high

    # 600 trials of 300 resamples (sacrebleu's score is not vectorised): 93.3% at 95%, 89.3% at 90%
    coverage = _coverage(interval, truth, trials=600)
    assert 0.92 <= coverage <= COVERAGE_BAND[1], coverage


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


def _recipe_trials(rng, trials: int, runs: int, shift: float = 0.0, n: int = 128) -> dict:
    """`seed_t_interval` of `trials` simulated comparisons of two arms of `runs` runs each (`_seeded_arm`:
    seed sd 0.1, per-text noise 0.3, n texts), the texts' variance being what the paired bootstrap
    estimates: the variance of the per-text difference of the arm means over n."""
    texts = rng.normal(size=(trials, 1, n))

    def arm(offset: float) -> np.ndarray:  # (trials, runs, n)
        seeds = rng.normal(scale=0.1, size=(trials, runs, 1))
        return texts + offset + seeds + rng.normal(scale=0.3, size=(trials, runs, n))

    a, b = arm(shift), arm(0.0)
    var_text = (a.mean(axis=1) - b.mean(axis=1)).var(axis=1) / n
    return seed_t_interval(a.mean(axis=2), b.mean(axis=2), var_text)


@pytest.mark.parametrize("runs", [2, 3])
def test_two_or_three_seeds_per_arm_flag_at_most_5_5_percent_of_same_recipe_comparisons(runs):
    # Two arms of the same recipe: every difference between them is the seeds'. Welch-Satterthwaite
    # degrees of freedom from the seeds' estimated variance flagged 7.1% at 2 + 2 seeds.
    t = _recipe_trials(np.random.default_rng(4), 3000, runs)
    flagged = ((t["low"] > 0) | (t["high"] < 0)).mean()
    assert flagged <= 0.055, flagged
    assert t["df"] == 2 * runs - 2


def test_a_true_difference_of_the_stated_detectable_size_is_flagged_about_80_percent_of_the_time():
    # at the true standard error, the root mean square of the estimated ones: a single comparison's
    # estimate rests on 2 degrees of freedom and is itself off by up to 2x either way
    rng = np.random.default_rng(7)
    detectable = float(np.sqrt(np.mean(_recipe_trials(rng, 3000, 2)["detectable"] ** 2)))
    t = _recipe_trials(rng, 3000, 2, shift=detectable)
    found = (t["low"] > 0).mean()
    assert 0.75 <= found <= 0.9, (detectable, found)
    # two seed sds, a difference a reader would call large, is found far less often
    assert (_recipe_trials(rng, 3000, 2, shift=0.2)["low"] > 0).mean() < 0.4


def test_the_recipe_interval_takes_the_texts_variance_from_the_paired_bootstrap():
    rng = np.random.default_rng(8)
    texts = rng.normal(size=128)
    a, b = _seeded_arm(rng, texts, 2), _seeded_arm(rng, texts, 2)
    diff = Mean("v").arms_difference(a, b)
    per_text = np.mean([r["v"] for r in a], axis=0) - np.mean([r["v"] for r in b], axis=0)
    assert diff.text_se**2 == pytest.approx(per_text.var() / 128, rel=0.15)
    expected = seed_t_interval([r["v"].mean() for r in a], [r["v"].mean() for r in b], diff.text_se**2)
    assert (diff.low, diff.high, diff.df) == pytest.approx((expected["low"], expected["high"], 2))
    assert diff.detectable == pytest.approx(float(expected["detectable"]))


def test_a_recipe_better_by_far_more_than_its_seeds_differ_is_found_with_two_seeds_per_arm():
    rng = np.random.default_rng(5)
    texts = rng.normal(size=128)
    a, b = _seeded_arm(rng, texts, 2, shift=1.0, seed_sd=0.05), _seeded_arm(rng, texts, 2, seed_sd=0.05)
    diff = Mean("v").arms_difference(a, b)
    assert diff.significant and diff.low > 0.5 and diff.runs_a == diff.runs_b == 2
    assert diff.a == pytest.approx(np.mean([r["v"].mean() for r in a]))
    assert diff.seed_sd > 0 and diff.df == 2  # few seeds: few degrees of freedom, a wide t
    # An arm of one run borrows the other arm's spread between seeds (pooled, 1 degree of freedom).
    one = Mean("v").arms_difference(a[:1], b)
    assert one.runs_a == 1 and one.high - one.low > diff.high - diff.low
    corpus = CorpusStatistic(("v",), lambda p: lambda idx: float(np.median(np.asarray(p["v"])[idx])))
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
    corpus = CorpusStatistic(("v",), lambda p: lambda idx: float(np.mean(np.asarray(p["v"])[idx])))
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
    corpus = CorpusStatistic(("nats",), lambda p: lambda idx: float(np.asarray(p["nats"])[idx].max()))
    assert corpus.difference(per_text, per_text).high == 0.0


def test_a_figure_that_resampling_biases_gets_no_interval_and_no_paired_difference():
    # distinct-n of texts drawn with replacement: every duplicate reads as repetition, so each
    # resample falls below the figure; such a figure is reported alone.
    from mmldlm.evaluation.figures import _distinct

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

    from mmldlm.evaluation.evaluate import summarise
    from mmldlm.evaluation.figures import recipes
    from mmldlm.evaluation.report import figure_text

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    from decoding_table import cell

    rng = np.random.default_rng(0)
    shared = rng.uniform(0.0, 1.0, 400)  # what the texts share: cancels in the paired difference
    first = summarise(recipes("l2t"), {"word_f1": shared})
    better = summarise(recipes("l2t"), {"word_f1": shared + 0.02 + rng.normal(0.0, 0.01, 400)})
    # the first row has nothing to differ from: its figure and interval alone
    assert cell(first, None, recipes("l2t"), "word_f1", "{:.3f}") == figure_text(first, "word_f1", ".3f")
    same = cell(first, first, recipes("l2t"), "word_f1", "{:.3f}")
    assert same.endswith("; +0.000 [+0.000, +0.000]")  # a row against itself: exactly 0
    text = cell(better, first, recipes("l2t"), "word_f1", "{:.3f}")
    difference, bounds = text.split("; ")[1].split(" ", 1)
    low, high = (float(b) for b in bounds.strip("[]").split(", "))
    assert abs(float(difference) - 0.02) < 0.003 and 0.0 < low < 0.02 < high
    # unpaired, the texts' own spread (sd 0.29 over 400) would give a half-width near 0.04, spanning 0
    assert high - low < 0.01
    assert cell(better, first, recipes("l2t"), "model_calls_per_batch", "{:.0f}") == "-"


def test_compare_leaves_out_perplexities_scored_by_different_n_gram_references():
    from mmldlm.evaluation.compare import compare_reports, markdown
    from mmldlm.evaluation.evaluate import summarise
    from mmldlm.evaluation.figures import recipes
    from mmldlm.evaluation.text_metrics import NgramReference

    rng = np.random.default_rng(0)
    corpus = ["the cat sat on the mat", "a dog ran in the park", "the dog sat on a mat"]
    same, other = NgramReference.fit(corpus), NgramReference.fit(corpus[:2])
    assert same.sha256 == NgramReference.fit(list(corpus)).sha256 != other.sha256

    def report(reference: NgramReference, texts: list[str]) -> dict:
        bits, counts = reference.bits_per_text(texts)
        per_text = {"word_f1": rng.uniform(0, 1, len(texts)), "ngram_bits": bits, "ngram_words": counts}
        section = summarise(recipes("l2t"), per_text, num_samples=len(texts))
        return {"texts_sha256": "t", "seed": 0, "l2t": section, "fluency_reference": {"sha256": reference.sha256}}

    texts = ["the cat ran on the mat", "a dog sat in the park"] * 4
    one = compare_reports(report(same, texts), report(same, texts))
    assert {r["figure"] for r in one["rows"]} == {"word_f1", "ngram_perplexity"} and not one["other_reference"]
    two = compare_reports(report(same, texts), report(other, texts), unpaired=True)
    assert [r["figure"] for r in two["rows"]] == ["word_f1"] and two["other_reference"] == ["l2t ngram_perplexity"]
    assert "Scored by different n-gram references" in markdown(two)


def test_unpaired_compare_leaves_out_retrieval_among_other_pools_and_shows_each_sides_n():
    from mmldlm.evaluation.compare import compare_reports, markdown
    from mmldlm.evaluation.evaluate import summarise
    from mmldlm.evaluation.figures import recipes

    rng = np.random.default_rng(0)

    def report(n: int, pool_size: int) -> dict:
        per_text = {"cosine": rng.uniform(0.5, 1, n), "hit": rng.uniform(0, 1, n) < 0.5}
        return {"texts_sha256": str(n), "seed": 0, "t2l": summarise(recipes("t2l"), per_text, pool_size=pool_size)}

    # A ranks each latent among 1000 texts (chance 0.1%), B among its 4 (chance 25%): not one figure.
    result = compare_reports(report(16, 1000), report(4, 4), unpaired=True)
    assert [(r["figure"], r["n_a"], r["n_b"]) for r in result["rows"]] == [("cosine_mean", 16, 4)]
    assert result["other_setting"] == ["t2l retrieval_at_1 (pool_size 1000 vs 4)"]
    table = markdown(result)
    assert "| figure | n (A / B) |" in table and "| t2l cosine_mean | 16 / 4 |" in table
    assert "not compared: t2l retrieval_at_1 (pool_size 1000 vs 4)" in table
    same_pool = compare_reports(report(16, 1000), report(4, 1000), unpaired=True)
    assert {r["figure"] for r in same_pool["rows"]} == {"cosine_mean", "retrieval_at_1"}


def test_a_rate_no_text_reaches_gets_the_exact_upper_bound_not_zero_width():
    none = {"exact": np.zeros(128)}
    est = Rate("exact").estimate(none)
    assert est.value == 0.0 and est.low == 0.0
    assert est.high == pytest.approx(1.0 - 0.025 ** (1 / 128))  # Clopper-Pearson: 2.8% at 0 of 128
    assert Rate("exact").estimate({"exact": np.ones(10)}).low == pytest.approx(0.025 ** (1 / 10))
    some = {"exact": (np.arange(128) % 8 == 0).astype(float)}  # 16 of 128: the bootstrap's interval
    assert Rate("exact").estimate(some) == Mean("exact").estimate(some)
    same = Rate("exact").difference(none, none)
    assert same.difference == 0.0 and same.low == -same.high == pytest.approx(-est.high) and not same.significant
    assert Rate("exact").unpaired_difference(none, {"exact": np.zeros(64)}).high == pytest.approx(est.high)


def test_exchanging_each_texts_values_gives_comparisons_with_no_difference_that_flag_few_figures():
    from mmldlm.evaluation.compare import compare_reports, markdown, null_flags
    from mmldlm.evaluation.evaluate import summarise
    from mmldlm.evaluation.figures import recipes

    rng = np.random.default_rng(11)
    texts = rng.uniform(0.0, 1.0, 200)

    def report(shift: float) -> dict:
        noisy = lambda: np.clip(texts + shift + rng.normal(0.0, 0.05, 200), 0, 1)  # noqa: E731
        return {
            "texts_sha256": "t",
            "seed": 0,
            "l2t": summarise(recipes("l2t"), {"word_f1": noisy(), "cosine": noisy()}, num_samples=200),
            "t2l": summarise(recipes("t2l"), {"cosine": noisy()}, num_samples=200),
        }

    a, b = report(0.05), report(0.0)
    result = compare_reports(a, b)
    assert sum(r["significant"] for r in result["rows"]) == 3  # a true difference on every figure
    counts = null_flags(a, b, 20)
    assert len(counts) == 20 and max(counts) <= 1 and null_flags(a, b, 20) == counts  # the same seed, the same
    result["null_flags"] = counts
    text = markdown(result)
    assert "20 comparisons with each text's A and B values exchanged at random (no difference by construction)" in text
    assert f"flagged {min(counts)} to {max(counts)} of 3" in text


def _decoded_report(rng, sampling: dict, selected: str | None = None, **config) -> dict:
    """A report of 64 texts by a decoder with `sampling` (the options `mmldlm eval` records), of a run whose config
    has `config` ({"train.steps": 4000, ...}) changed."""
    from mmldlm.config import RunConfig, to_dict
    from mmldlm.evaluation.evaluate import summarise
    from mmldlm.evaluation.figures import recipes

    run = to_dict(RunConfig())
    for key, value in config.items():
        section, name = key.split(".")
        run[section][name] = value
    l2t = summarise(recipes("l2t"), {"word_f1": rng.uniform(0, 1, 64), "cosine": rng.uniform(0, 1, 64)})
    if selected:
        l2t["selected_on"] = {"cosine_mean": selected}
    t2l = summarise(recipes("t2l"), {"cosine": rng.uniform(0, 1, 64)}, pool_size=1000)
    return {"texts_sha256": "t", "seed": 0, "step": 4000, "config": run, "sampling": sampling, "l2t": l2t, "t2l": t2l}


def test_figures_of_different_decoders_are_labelled_in_their_rows_and_the_header_and_selected_ones_marked():
    from mmldlm.config import SamplingOptions
    from mmldlm.evaluation.compare import compare_reports, markdown

    rng = np.random.default_rng(12)
    plain = SamplingOptions(num_steps=4, temperature=1.0).to_dict()
    best = SamplingOptions(num_steps=8, temperature=0.7, best_of=16).to_dict()
    result = compare_reports(_decoded_report(rng, plain), _decoded_report(rng, best, "max over 16 candidates"))
    rows = {(r["section"], r["figure"]): r for r in result["rows"]}
    for figure in ("word_f1", "cosine_mean"):
        assert rows[("l2t", figure)]["decoders"] == "num_steps 4 vs 8, temperature 1.0 vs 0.7, best_of 1 vs 16"
    # t2l's figures read the posterior mean: one model call, which neither steps nor best-of change
    assert "decoders" not in rows[("t2l", "cosine_mean")]
    assert rows[("l2t", "cosine_mean")]["selected"] == "B max over 16 candidates"
    assert "selected" not in rows[("l2t", "word_f1")]
    assert result["sampling_a"] == plain and result["sampling_b"] == best
    table = markdown(result)
    assert "for these two models and their decoders" in table
    assert (
        "A and B decoded with different options (num_steps 4 vs 8, temperature 1.0 vs 0.7, best_of 1 vs 16): " in table
    )
    assert "| l2t word_f1 (decoders differ) | 64 |" in table
    assert "| l2t cosine_mean (decoders differ) (selected: B max over 16 candidates) | 64 |" in table
    assert "| t2l cosine_mean | 64 |" in table
    # the same decoder on both sides: nothing to label but the selection
    same = markdown(compare_reports(_decoded_report(rng, best, "max over 16 candidates"), _decoded_report(rng, best)))
    assert "decoders differ" not in same and "decoded with different options" not in same
    assert "| l2t cosine_mean (selected: A max over 16 candidates) | 64 |" in same


def test_runs_of_an_arm_must_be_seeds_of_one_recipe_and_are_refused_in_one_line_naming_what_differs():
    from mmldlm.config import SamplingOptions
    from mmldlm.errors import UserError
    from mmldlm.evaluation.compare import compare_arms

    rng = np.random.default_rng(13)
    sampling = SamplingOptions().to_dict()
    main = _decoded_report(rng, sampling, **{"train.steps": 4000})
    seed1 = _decoded_report(rng, sampling, **{"train.steps": 4000, "train.seed": 1, "train.run_dir": "runs/seed1"})
    other = _decoded_report(rng, sampling, **{"optim.lr": 5e-4})
    result = compare_arms([main, seed1], [other, other], ["main", "seed1"], ["lr", "lr"])
    assert {r["runs_a"] for r in result["rows"]} == {2}
    short = _decoded_report(rng, sampling, **{"train.steps": 300, "train.seed": 1})
    short["step"] = 300
    with pytest.raises(UserError) as refused:
        compare_arms([main, short], [other, other], ["runs/default", "runs/short"], ["lr", "lr"])
    assert str(refused.value) == (
        "--a: runs/default and runs/short are not seeds of one recipe: they differ in train.steps (4000 vs 300), "
        "step (4000 vs 300); expected the same config apart from train.seed and train.run_dir, evaluated at the same "
        "step with the same decoder"
    )
    decoded = _decoded_report(rng, {**sampling, "best_of": 16}, **{"optim.lr": 5e-4})
    with pytest.raises(
        UserError, match=r"^--b: lr and lr16 are not seeds of one recipe: they differ in sampling\.best"
    ):
        compare_arms([main, seed1], [other, decoded], ["main", "seed1"], ["lr", "lr16"])
    # A report written before a config key existed: the run trained as that key's default says.
    before_the_key = {**seed1, "config": {**seed1["config"], "model": dict(seed1["config"]["model"])}}
    del before_the_key["config"]["model"]["adaln"]
    assert {
        r["runs_a"] for r in compare_arms([main, before_the_key], [other, other], ["main", "s1"], ["lr", "lr"])["rows"]
    } == {2}
    changed = {**seed1, "config": {**seed1["config"], "model": {**seed1["config"]["model"], "adaln": "single"}}}
    with pytest.raises(UserError, match=r"they differ in model\.adaln \(per_block vs single\)"):
        compare_arms([before_the_key, changed], [other, other], ["s1", "single"], ["lr", "lr"])
    older = {key: value for key, value in seed1.items() if key != "config"}
    with pytest.raises(UserError, match=r"^old\.json: the report records no run config"):
        compare_arms([main, older], [other, other], ["main", "old.json"], ["lr", "lr"])
