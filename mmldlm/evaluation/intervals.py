"""Uncertainty of evaluation figures: percentile bootstrap intervals (Efron & Tibshirani 1993, ch. 13).

Every figure of `mmldlm eval` is a statistic of a sample of validation texts (and, where the figure is
sampled, of sampling draws per text). The interval says how far the same figure could move on another
sample of texts of the same size, the way lm-evaluation-harness and HELM report a standard error beside
each metric:

    est = bootstrap(per_text_values)                       # the mean, its 95% interval, n
    est = bootstrap(per_text_nats, weights=num_tokens)     # a ratio: sum(x w) / sum(w), per token
    est = bootstrap_statistic(lambda idx: bleu(gen[idx], src[idx]), n=len(gen))  # corpus-level figures
    diff = paired_difference(values_a, values_b)           # run A - run B on the same texts (Dror et al. 2018)
    diff = recipe.arms_difference(runs_a, runs_b)          # several training seeds per arm: seeds and texts
    diff = recipe.unpaired_difference(per_text_a, per_text_b)  # each run on its own texts (other data)

A report keeps each figure's per-text values, and a recipe (`Mean`, `Rate`, `CorpusStatistic`) says how the
figure is made from them, so one recipe gives both the figure's interval (`estimate`) and the paired
difference of two reports on the same texts (`difference`, what `mmldlm compare` prints). A `Rate` that
no text (or every text) reaches gets the exact Clopper-Pearson interval, not the bootstrap's [0, 0].

One run per arm measures two models: the interval covers other texts for these two models, not other
training seeds. With several runs per arm (the same recipe trained with other seeds, all scored on the
same texts), `arms_difference` adds the variance between seeds (pooled over both arms, Student) to the
texts' bootstrap variance of the difference of the arm means, and takes Student's t with the seeds'
k_A + k_B - 2 degrees of freedom (`seed_t_interval`): with two seeds per arm t(0.975, 2) = 4.3, as wide
as two seeds can tell, and the smallest difference it finds 80% of the time is 5.7 standard errors.

Two-level data: a `(n_texts, n_draws)` array resamples texts, each with all its draws: a text's mean
over its draws carries the sampler's randomness, so the interval covers both the choice of texts and
the draws (resampling draws within texts as well counts the draws' variance twice: 21% too wide at two
draws that vary three times as much as the texts, an outside review found). Resamples come from a
generator of their own (`seed`): the same inputs give the same interval.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

NUM_RESAMPLES = 1000
LEVEL = 0.95
POWER = 0.8  # the power at which `seed_t_interval` states the smallest difference it detects
# Below this many texts a 95% percentile interval covers too little: of 1000 samples of gamma(4) values,
# 81.9% at n = 5, 89.2% at n = 10, 94.0% at n = 30 (eval's report says so beside such figures).
MIN_TEXTS = 30


@dataclass(frozen=True)
class Estimate:
    """A figure, its interval [low, high] at `level`, and the number of texts `n` it rests on."""

    value: float
    low: float
    high: float
    n: int
    level: float = LEVEL


@dataclass(frozen=True)
class Difference:
    """A - B on the same texts: the difference, its interval, and whether the interval excludes 0."""

    a: float
    b: float
    difference: float
    low: float
    high: float
    n: int
    level: float = LEVEL

    @property
    def significant(self) -> bool:
        return self.low > 0.0 or self.high < 0.0

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "difference": self.difference,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "significant": self.significant,
        }


@dataclass(frozen=True)
class ArmsDifference(Difference):
    """The difference of two arms' mean figures over several training runs each (`runs_a`, `runs_b`),
    its t interval, the standard deviation between seeds (pooled over both arms) and the texts' standard
    error of the difference, the degrees of freedom of the interval, and the smallest true difference
    it excludes 0 for at `POWER` (`detectable`)."""

    runs_a: int = 1
    runs_b: int = 1
    seed_sd: float = math.nan
    text_se: float = math.nan
    df: float = math.inf
    detectable: float = math.nan

    def to_dict(self) -> dict:
        extra = {"runs_a": self.runs_a, "runs_b": self.runs_b, "seed_sd": self.seed_sd, "text_se": self.text_se}
        return {**super().to_dict(), **extra, "df": self.df, "detectable": self.detectable}


def _bounds(resampled: np.ndarray, level: float) -> tuple[float, float]:
    resampled = resampled[np.isfinite(resampled)]
    if resampled.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(resampled, [tail, 100.0 - tail])
    return float(low), float(high)


# A statistic maps texts `idx` to a figure: idx (n,) gives one figure, idx (R, n) one per row (R resamples
# at once). Each text keeps all its draws: resampling texts alone, not draws within them, estimates the
# variance of a two-level mean without counting the draws' share twice (Davison & Hinkley 1997, sec. 3.8).
Statistic = Callable[[np.ndarray], np.ndarray]


def _mean_of(values: np.ndarray, weights: np.ndarray | None) -> Statistic:
    """The mean of `values` (n,) or (n, draws) over texts idx, or the ratio sum(v w) / sum(w)."""

    def statistic(idx: np.ndarray) -> np.ndarray:
        v = values[idx]  # (..., n) or (..., n, draws)
        axes = tuple(range(idx.ndim - 1, v.ndim))
        if weights is None:
            return v.mean(axis=axes)
        w = weights[idx]
        return (v * w).sum(axis=axes) / np.maximum(w.sum(axis=axes), 1e-12)

    return statistic


def _rowwise(statistic: Callable[[np.ndarray], float]) -> Statistic:
    """A statistic of one set of texts (corpus BLEU, a perplexity), applied to each resample's row."""
    return lambda idx: np.array([statistic(row) for row in idx]) if idx.ndim == 2 else np.float64(statistic(idx))


def _as_arrays(values, weights) -> tuple[np.ndarray, np.ndarray | None]:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim not in (1, 2) or v.shape[0] == 0:
        raise ValueError(f"bootstrap: expected a non-empty (n,) or (n, draws) array, got shape {v.shape}")
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    if w is not None:  # one weight per text (n,) stands for each of its draws (n, draws)
        w = np.broadcast_to(w[:, None] if w.ndim == 1 and v.ndim == 2 else w, v.shape)
    return v, w


def _resamples(rng: np.random.Generator, n: int, num_resamples: int, chunk: int = 100):
    """Index arrays (≤ chunk, n) of `num_resamples` resamples of n texts with replacement."""
    for start in range(0, num_resamples, chunk):
        yield rng.integers(0, n, size=(min(chunk, num_resamples - start), n))


def _resampled(statistics: list[Statistic], signs: list[float], n: int, num_resamples: int, seed: int) -> np.ndarray:
    """(num_resamples,) the sum of sign * statistic over resamples of the n texts, every statistic on
    the same resampled texts (paired)."""
    rng = np.random.default_rng(seed)
    blocks = _resamples(rng, n, num_resamples)
    return np.concatenate([sum(sign * statistic(idx) for statistic, sign in zip(statistics, signs)) for idx in blocks])


def bootstrap(
    values,
    *,
    weights=None,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Estimate:
    """The mean of `values` ((n,) per text, or (n, draws)), or the ratio sum(v w) / sum(w) with
    `weights`, with its percentile bootstrap interval over texts (each with its draws)."""
    v, w = _as_arrays(values, weights)
    statistic = _mean_of(v, w)
    resampled = _resampled([statistic], [1.0], v.shape[0], num_resamples, seed)
    return Estimate(float(statistic(np.arange(v.shape[0]))), *_bounds(resampled, level), n=v.shape[0], level=level)


def bootstrap_statistic(
    statistic: Callable[[np.ndarray], float],
    n: int,
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Estimate:
    """A figure computed from the texts at indices `idx` as a whole (corpus BLEU, distinct-n, a
    distance between two sets), with its interval over resampled texts."""
    if n <= 0:
        raise ValueError(f"bootstrap_statistic: expected n >= 1 texts, got {n}")
    resampled = _resampled([_rowwise(statistic)], [1.0], n, num_resamples, seed)
    return Estimate(float(statistic(np.arange(n))), *_bounds(resampled, level), n=n, level=level)


def _paired(stat_a: Statistic, stat_b: Statistic, n: int, num_resamples: int, level: float, seed: int) -> Difference:
    resampled = _resampled([stat_a, stat_b], [1.0, -1.0], n, num_resamples, seed)
    va, vb = float(stat_a(np.arange(n))), float(stat_b(np.arange(n)))
    return Difference(va, vb, va - vb, *_bounds(resampled, level), n=n, level=level)


def paired_difference(
    values_a,
    values_b,
    *,
    weights_a=None,
    weights_b=None,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Difference:
    """A - B for two sets of per-text values on the same texts, in the same order: both are resampled
    with the same indices (a paired bootstrap), so what the texts share cancels; each text keeps its
    draws in both, so draws that the same seeds drew stay paired as well."""
    a, wa = _as_arrays(values_a, weights_a)
    b, wb = _as_arrays(values_b, weights_b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"paired_difference: the two runs have {a.shape[0]} and {b.shape[0]} texts; expected the same")
    return _paired(_mean_of(a, wa), _mean_of(b, wb), a.shape[0], num_resamples, level, seed)


def paired_statistic_difference(
    statistic_a: Callable[[np.ndarray], float],
    statistic_b: Callable[[np.ndarray], float],
    n: int,
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Difference:
    """A - B for corpus-level figures of two runs on the same n texts, resampled with the same indices."""
    if n <= 0:
        raise ValueError(f"paired_statistic_difference: expected n >= 1 texts, got {n}")
    return _paired(_rowwise(statistic_a), _rowwise(statistic_b), n, num_resamples, level, seed)


@functools.lru_cache(maxsize=64)
def _power_multiplier(df: float, level: float, power: float) -> float:
    """The noncentrality delta at which a two-sided t test of level `level` with `df` degrees of freedom
    rejects with probability `power`: a true difference of delta standard errors is found that often."""
    critical = stats.t.ppf(0.5 + level / 2.0, df)

    def rejects(delta: float) -> float:  # the far tail, below -critical, adds under 1e-3 where power >= 0.5
        return stats.nct.sf(critical, df, delta) - power

    high = critical + 1.0
    while rejects(high) < 0.0:  # the rate of rejection rises with delta: bracket, then solve
        high *= 2.0
    return float(optimize.brentq(rejects, 0.0, high))


def seed_t_interval(figures_a, figures_b, var_text, level: float = LEVEL, power: float = POWER) -> dict:
    """The recipe interval of `arms_difference` from the runs' figures, figures_a (..., k_A) and
    figures_b (..., k_B), and the texts' variance of the difference of arm means var_text (...); leading
    axes are separate comparisons. Student's pooled t with k_A + k_B - 2 degrees of freedom on the
    seeds' variance s^2 (1/k_A + 1/k_B) plus var_text: counting only the seeds' degrees of freedom
    keeps the interval from narrowing where s^2 is small by chance (Welch-Satterthwaite degrees of
    freedom computed from s^2 did: 7.1% of same-recipe comparisons flagged at 2 + 2 seeds, against 5.0%
    here; tests/test_intervals.py). {difference, low, high, seed_sd, se, df, detectable}: detectable is
    the true difference the interval excludes 0 for with probability `power` at this se."""
    figures_a, figures_b = np.asarray(figures_a, dtype=np.float64), np.asarray(figures_b, dtype=np.float64)
    k_a, k_b = figures_a.shape[-1], figures_b.shape[-1]
    df = k_a + k_b - 2
    if df < 1:
        raise ValueError(f"arms_difference: got {k_a} and {k_b} runs; expected two or more in at least one arm")
    squares = ((figures_a - figures_a.mean(-1, keepdims=True)) ** 2).sum(-1)
    squares = squares + ((figures_b - figures_b.mean(-1, keepdims=True)) ** 2).sum(-1)
    pooled = squares / df
    se = np.sqrt(np.asarray(var_text) + pooled * (1.0 / k_a + 1.0 / k_b))
    difference = figures_a.mean(-1) - figures_b.mean(-1)
    half = stats.t.ppf(0.5 + level / 2.0, df) * se
    return {
        "difference": difference,
        "low": difference - half,
        "high": difference + half,
        "seed_sd": np.sqrt(pooled),
        "se": se,
        "df": df,
        "detectable": _power_multiplier(float(df), level, power) * se,
    }


def arms_difference(
    runs_a: list[Statistic],
    runs_b: list[Statistic],
    n: int,
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> ArmsDifference:
    """mean(A runs) - mean(B runs) for one figure, each run's figure `fn(idx)` of texts `idx`, all runs
    on the same n texts. Its variance: the seeds' (the runs' figures about their arm's mean on these
    texts, pooled over both arms: s^2 (1/k_A + 1/k_B)) plus the texts' (the paired bootstrap of the
    difference of the arm means); the interval: `seed_t_interval`. Needs two runs in at least one arm."""
    k_a, k_b = len(runs_a), len(runs_b)
    if k_a + k_b < 3:
        raise ValueError(f"arms_difference: got {k_a} and {k_b} runs; expected two or more in at least one arm")
    full = np.arange(n)
    figures_a = np.array([float(fn(full)) for fn in runs_a])
    figures_b = np.array([float(fn(full)) for fn in runs_b])
    signs = [1.0 / k_a] * k_a + [-1.0 / k_b] * k_b
    resampled = _resampled([*runs_a, *runs_b], signs, n, num_resamples, seed)
    resampled = resampled[np.isfinite(resampled)]
    var_text = float(resampled.var(ddof=1)) if resampled.size > 1 else 0.0
    t = seed_t_interval(figures_a, figures_b, var_text, level)
    return ArmsDifference(
        float(figures_a.mean()),
        float(figures_b.mean()),
        float(t["difference"]),
        float(t["low"]),
        float(t["high"]),
        n=n,
        level=level,
        runs_a=k_a,
        runs_b=k_b,
        seed_sd=float(t["seed_sd"]),
        text_se=math.sqrt(var_text),
        df=float(t["df"]),
        detectable=float(t["detectable"]),
    )


def unpaired_difference(
    statistic_a: Statistic,
    n_a: int,
    statistic_b: Statistic,
    n_b: int,
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Difference:
    """A - B for two runs each scored on its own texts (independent samples of one distribution, e.g.
    the validation splits of two datasets of one corpus): each run's n_a and n_b texts resampled on
    their own, `statistic(idx)` the figure of texts idx. Wider than the paired interval, which cancels
    what shared texts have in common."""
    rng = np.random.default_rng(seed)
    resampled = np.concatenate(
        [
            statistic_a(block) - statistic_b(rng.integers(0, n_b, size=(len(block), n_b)))
            for block in _resamples(rng, n_a, num_resamples)
        ]
    )
    va, vb = float(statistic_a(np.arange(n_a))), float(statistic_b(np.arange(n_b)))
    return Difference(va, vb, va - vb, *_bounds(resampled, level), n=min(n_a, n_b), level=level)


@dataclass(frozen=True)
class Mean:
    """A figure that is the mean of one per-text value, per_text[values] ((n,) or (n, draws)), or with
    `weights` the ratio sum(v w) / sum(w) (nats per token: values per token, weighted by tokens)."""

    values: str
    weights: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.values,) if self.weights is None else (self.values, self.weights)

    def _arrays(self, per_text: dict) -> tuple[np.ndarray, np.ndarray | None]:
        weights = None if self.weights is None else per_text[self.weights]
        return _as_arrays(per_text[self.values], weights)

    def estimate(self, per_text: dict, **kwargs) -> Estimate:
        values, weights = self._arrays(per_text)
        return bootstrap(values, weights=weights, **kwargs)

    def difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        (a, wa), (b, wb) = self._arrays(per_text_a), self._arrays(per_text_b)
        return paired_difference(a, b, weights_a=wa, weights_b=wb, **kwargs)

    def unpaired_difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        """A - B, each run on its own texts (`unpaired_difference`)."""
        (a, wa), (b, wb) = self._arrays(per_text_a), self._arrays(per_text_b)
        return unpaired_difference(_mean_of(a, wa), a.shape[0], _mean_of(b, wb), b.shape[0], **kwargs)

    def arms_difference(self, runs_a: list[dict], runs_b: list[dict], **kwargs) -> ArmsDifference:
        """Several runs per arm (their per-text values on the same texts, the same draws per text)."""
        arrays = [self._arrays(per_text) for per_text in (*runs_a, *runs_b)]
        shapes = {v.shape for v, _ in arrays}
        if len(shapes) != 1:
            raise ValueError(
                f"arms_difference: {self.values} has shapes {sorted(shapes)}; expected the same texts and draws"
            )
        stats_ = [_mean_of(v, w) for v, w in arrays]
        return arms_difference(stats_[: len(runs_a)], stats_[len(runs_a) :], shapes.pop()[0], **kwargs)


def clopper_pearson(events: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact binomial interval of a rate of `events` in n (Clopper & Pearson 1934): 0 of 128 gives
    [0, 2.8%] at 95%, where every resample of texts is 0 too."""
    tail = (1.0 - level) / 2.0
    low = 0.0 if events == 0 else float(stats.beta.ppf(tail, events, n - events + 1))
    high = 1.0 if events == n else float(stats.beta.ppf(1.0 - tail, events + 1, n - events))
    return low, high


@dataclass(frozen=True)
class Rate(Mean):
    """The share of texts where an event occurred, per_text[values] 0 or 1 each (exact match, copy rate,
    a retrieval hit). Where no text or every text has the event, resampling texts cannot move the figure
    and the bootstrap says [0, 0]: the interval is then the exact Clopper-Pearson one, and where both
    runs are such, their difference spans what both exact intervals allow (0 of 128 against 0 of 128:
    [-2.8%, +2.8%], even for a run against itself)."""

    def estimate(self, per_text: dict, **kwargs) -> Estimate:
        estimate = super().estimate(per_text, **kwargs)
        events, n = self._events(per_text)
        if events not in (0, n):
            return estimate
        return Estimate(estimate.value, *clopper_pearson(events, n, estimate.level), n=n, level=estimate.level)

    def _events(self, per_text: dict) -> tuple[int, int]:
        values = np.asarray(per_text[self.values], dtype=np.float64)
        return int(round(values.sum())), values.size

    def _widened(self, difference: Difference, per_text_a: dict, per_text_b: dict) -> Difference:
        counts = [self._events(p) for p in (per_text_a, per_text_b)]
        if any(events not in (0, n) for events, n in counts):
            return difference
        (low_a, high_a), (low_b, high_b) = (clopper_pearson(*count, difference.level) for count in counts)
        return dataclasses.replace(difference, low=low_a - high_b, high=high_a - low_b)

    def difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        return self._widened(super().difference(per_text_a, per_text_b, **kwargs), per_text_a, per_text_b)

    def unpaired_difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        return self._widened(super().unpaired_difference(per_text_a, per_text_b, **kwargs), per_text_a, per_text_b)


@dataclass(frozen=True)
class CorpusStatistic:
    """A figure of the texts as a whole (corpus BLEU, distinct-n, a perplexity over all words):
    `statistic(per_text)` returns the figure of the texts at indices `idx`, fn(idx) -> float, doing once
    whatever does not depend on idx. `resampled` False: a figure that resampling texts with replacement
    biases, so it gets no interval and no paired difference (distinct-n reads a text drawn twice as
    repetition: its resamples fall below the figure itself)."""

    keys: tuple[str, ...]
    statistic: Callable[[dict], Callable[[np.ndarray], float]]
    resampled: bool = True

    def estimate(self, per_text: dict, **kwargs) -> Estimate:
        n = len(per_text[self.keys[0]])
        if not self.resampled:
            return Estimate(float(self.statistic(per_text)(np.arange(n))), math.nan, math.nan, n)
        return bootstrap_statistic(self.statistic(per_text), n, **kwargs)

    def difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference | None:
        """A - B with its paired interval; None where the figure is not `resampled`."""
        if not self.resampled:
            return None
        n_a, n_b = len(per_text_a[self.keys[0]]), len(per_text_b[self.keys[0]])
        if n_a != n_b:
            raise ValueError(f"paired_statistic_difference: the two runs have {n_a} and {n_b} texts; expected the same")
        return paired_statistic_difference(self.statistic(per_text_a), self.statistic(per_text_b), n_a, **kwargs)

    def unpaired_difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference | None:
        """A - B, each run on its own texts (`unpaired_difference`); None where not `resampled`."""
        if not self.resampled:
            return None
        fn_a, fn_b = (_rowwise(self.statistic(p)) for p in (per_text_a, per_text_b))
        n_a, n_b = len(per_text_a[self.keys[0]]), len(per_text_b[self.keys[0]])
        return unpaired_difference(fn_a, n_a, fn_b, n_b, **kwargs)

    def arms_difference(self, runs_a: list[dict], runs_b: list[dict], **kwargs) -> ArmsDifference | None:
        """Several runs per arm on the same texts; None where the figure is not `resampled`."""
        if not self.resampled:
            return None
        sizes = {len(per_text[self.keys[0]]) for per_text in (*runs_a, *runs_b)}
        if len(sizes) != 1:
            raise ValueError(f"arms_difference: the runs have {sorted(sizes)} texts; expected the same")
        fns = [_rowwise(self.statistic(per_text)) for per_text in (*runs_a, *runs_b)]
        return arms_difference(fns[: len(runs_a)], fns[len(runs_a) :], sizes.pop(), **kwargs)
