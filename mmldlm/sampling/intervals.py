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

A report keeps each figure's per-text values, and a recipe (`Mean`, `Corpus`) says how the figure is made
from them, so one recipe gives both the figure's interval (`estimate`) and the paired difference of two
reports on the same texts (`difference`, what `mmldlm compare` prints).

One run per arm measures two models: the interval covers other texts for these two models, not other
training seeds. With several runs per arm (the same recipe trained with other seeds, all scored on the
same texts), `arms_difference` adds the variance between seeds (pooled over both arms, Student) to the
texts' bootstrap variance of the difference of the arm means, and takes a t interval with the
Welch-Satterthwaite degrees of freedom: with two seeds per arm, about 2 (t = 4.3), as wide as two seeds
can tell.

Two-level data: a `(n_texts, n_draws)` array resamples texts, then draws within each resampled text,
so the interval covers both the choice of texts and the sampler's randomness. Resamples come from a
generator of their own (`seed`): the same inputs give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NUM_RESAMPLES = 1000
LEVEL = 0.95


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
    error of the difference, and the degrees of freedom of the interval."""

    runs_a: int = 1
    runs_b: int = 1
    seed_sd: float = math.nan
    text_se: float = math.nan
    df: float = math.inf

    def to_dict(self) -> dict:
        extra = {"runs_a": self.runs_a, "runs_b": self.runs_b, "seed_sd": self.seed_sd, "text_se": self.text_se}
        return {**super().to_dict(), **extra, "df": self.df if math.isfinite(self.df) else None}


def _bounds(resampled: np.ndarray, level: float) -> tuple[float, float]:
    resampled = resampled[np.isfinite(resampled)]
    if resampled.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(resampled, [tail, 100.0 - tail])
    return float(low), float(high)


def _mean_of(values: np.ndarray, weights: np.ndarray | None) -> Callable[[np.ndarray, np.ndarray | None], float]:
    """The statistic of rows `idx` (and, for 2-D values, draws `cols` per row): a mean or a ratio."""

    def statistic(idx: np.ndarray, cols: np.ndarray | None = None) -> float:
        v = values[idx] if cols is None else np.take_along_axis(values[idx], cols, axis=1)
        if weights is None:
            return float(v.mean())
        w = weights[idx] if cols is None else np.take_along_axis(weights[idx], cols, axis=1)
        return float((v * w).sum() / max(w.sum(), 1e-12))

    return statistic


def _as_arrays(values, weights) -> tuple[np.ndarray, np.ndarray | None]:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim not in (1, 2) or v.shape[0] == 0:
        raise ValueError(f"bootstrap: expected a non-empty (n,) or (n, draws) array, got shape {v.shape}")
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    if w is not None:  # one weight per text (n,) stands for each of its draws (n, draws)
        w = np.broadcast_to(w[:, None] if w.ndim == 1 and v.ndim == 2 else w, v.shape)
    return v, w


def _draw_indices(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    n = shape[0]
    idx = rng.integers(0, n, size=n)
    cols = rng.integers(0, shape[1], size=(n, shape[1])) if len(shape) == 2 else None
    return idx, cols


def bootstrap(
    values,
    *,
    weights=None,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Estimate:
    """The mean of `values` ((n,) per text, or (n, draws)), or the ratio sum(v w) / sum(w) with
    `weights`, with its percentile bootstrap interval over texts (and draws)."""
    v, w = _as_arrays(values, weights)
    statistic = _mean_of(v, w)
    rng = np.random.default_rng(seed)
    resampled = np.array([statistic(*_draw_indices(rng, v.shape)) for _ in range(num_resamples)])
    return Estimate(statistic(np.arange(v.shape[0])), *_bounds(resampled, level), n=v.shape[0], level=level)


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
    rng = np.random.default_rng(seed)
    resampled = np.array([statistic(rng.integers(0, n, size=n)) for _ in range(num_resamples)])
    return Estimate(float(statistic(np.arange(n))), *_bounds(resampled, level), n=n, level=level)


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
    with the same indices (a paired bootstrap), so what the texts share cancels; (n, draws) values of the
    same shape are paired by draw as well (the same seeds drew them)."""
    a, wa = _as_arrays(values_a, weights_a)
    b, wb = _as_arrays(values_b, weights_b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"paired_difference: the two runs have {a.shape[0]} and {b.shape[0]} texts; expected the same")
    stat_a, stat_b = _mean_of(a, wa), _mean_of(b, wb)
    rng = np.random.default_rng(seed)
    resampled = []
    for _ in range(num_resamples):
        idx = rng.integers(0, a.shape[0], size=a.shape[0])
        cols_a = rng.integers(0, a.shape[1], size=(a.shape[0], a.shape[1])) if a.ndim == 2 else None
        # Draws with the same generators in A and B are paired too: the same draws of each text.
        same_draws = b.shape == a.shape
        cols_b = cols_a if same_draws else rng.integers(0, b.shape[1], size=b.shape) if b.ndim == 2 else None
        resampled.append(stat_a(idx, cols_a) - stat_b(idx, cols_b))
    full = np.arange(a.shape[0])
    va, vb = stat_a(full), stat_b(full)
    return Difference(va, vb, va - vb, *_bounds(np.array(resampled), level), n=a.shape[0], level=level)


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
    rng = np.random.default_rng(seed)
    resampled = []
    for _ in range(num_resamples):
        idx = rng.integers(0, n, size=n)
        resampled.append(statistic_a(idx) - statistic_b(idx))
    full = np.arange(n)
    va, vb = float(statistic_a(full)), float(statistic_b(full))
    return Difference(va, vb, va - vb, *_bounds(np.array(resampled), level), n=n, level=level)


def arms_difference(
    runs_a: list[Callable[..., float]],
    runs_b: list[Callable[..., float]],
    n: int,
    *,
    draws: int | None = None,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> ArmsDifference:
    """mean(A runs) - mean(B runs) for one figure, each run's figure `fn(idx, cols)` of texts `idx` (and
    draws `cols` per text where `draws`), all runs on the same n texts. Its variance: the seeds' (the
    runs' figures about their arm's mean on these texts, pooled over both arms: s^2 (1/k_A + 1/k_B)) plus
    the texts' (the paired bootstrap of the difference of the arm means); the interval is Student's t with
    the Welch-Satterthwaite degrees of freedom (the texts' part counts as known). Needs two runs in at
    least one arm."""
    from scipy import stats

    k_a, k_b = len(runs_a), len(runs_b)
    if k_a + k_b < 3:
        raise ValueError(f"arms_difference: got {k_a} and {k_b} runs; expected two or more in at least one arm")
    full = np.arange(n)
    figures_a = np.array([fn(full) for fn in runs_a])
    figures_b = np.array([fn(full) for fn in runs_b])
    mean_a, mean_b = float(figures_a.mean()), float(figures_b.mean())
    rng = np.random.default_rng(seed)
    resampled = np.empty(num_resamples)
    for r in range(num_resamples):
        idx = rng.integers(0, n, size=n)
        cols = rng.integers(0, draws, size=(n, draws)) if draws else None
        resampled[r] = np.mean([fn(idx, cols) for fn in runs_a]) - np.mean([fn(idx, cols) for fn in runs_b])
    resampled = resampled[np.isfinite(resampled)]
    var_text = float(resampled.var(ddof=1)) if resampled.size > 1 else 0.0
    df_seed = k_a + k_b - 2
    pooled = (((figures_a - mean_a) ** 2).sum() + ((figures_b - mean_b) ** 2).sum()) / df_seed
    var_seed = float(pooled) * (1.0 / k_a + 1.0 / k_b)
    variance = var_text + var_seed
    df = math.inf if var_seed == 0.0 else variance**2 / (var_seed**2 / df_seed)
    half = float(stats.t.ppf(0.5 + level / 2.0, df)) * math.sqrt(variance)
    difference = mean_a - mean_b
    return ArmsDifference(
        mean_a,
        mean_b,
        difference,
        difference - half,
        difference + half,
        n=n,
        level=level,
        runs_a=k_a,
        runs_b=k_b,
        seed_sd=math.sqrt(float(pooled)),
        text_se=math.sqrt(var_text),
        df=df,
    )


def unpaired_difference(
    statistic_a: Callable[..., float],
    shape_a: tuple[int, ...],
    statistic_b: Callable[..., float],
    shape_b: tuple[int, ...],
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Difference:
    """A - B for two runs each scored on its own texts (independent samples of one distribution, e.g.
    the validation splits of two datasets of one corpus): each run's texts (and draws, for (n, draws)
    shapes) resampled on their own, `statistic(idx, cols)` the figure of texts idx. Wider than the
    paired interval, which cancels what shared texts have in common."""
    rng = np.random.default_rng(seed)
    resampled = np.array(
        [
            statistic_a(*_draw_indices(rng, shape_a)) - statistic_b(*_draw_indices(rng, shape_b))
            for _ in range(num_resamples)
        ]
    )
    va, vb = float(statistic_a(np.arange(shape_a[0]))), float(statistic_b(np.arange(shape_b[0])))
    return Difference(va, vb, va - vb, *_bounds(resampled, level), n=min(shape_a[0], shape_b[0]), level=level)


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
        return np.asarray(per_text[self.values], dtype=np.float64), weights

    def estimate(self, per_text: dict, **kwargs) -> Estimate:
        values, weights = self._arrays(per_text)
        return bootstrap(values, weights=weights, **kwargs)

    def difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        (a, wa), (b, wb) = self._arrays(per_text_a), self._arrays(per_text_b)
        return paired_difference(a, b, weights_a=wa, weights_b=wb, **kwargs)

    def unpaired_difference(self, per_text_a: dict, per_text_b: dict, **kwargs) -> Difference:
        """A - B, each run on its own texts (`unpaired_difference`)."""
        (a, wa), (b, wb) = (_as_arrays(*self._arrays(p)) for p in (per_text_a, per_text_b))
        return unpaired_difference(_mean_of(a, wa), a.shape, _mean_of(b, wb), b.shape, **kwargs)

    def arms_difference(self, runs_a: list[dict], runs_b: list[dict], **kwargs) -> ArmsDifference:
        """Several runs per arm (their per-text values on the same texts, the same draws per text)."""
        arrays = [_as_arrays(*self._arrays(per_text)) for per_text in (*runs_a, *runs_b)]
        shapes = {v.shape for v, _ in arrays}
        if len(shapes) != 1:
            raise ValueError(
                f"arms_difference: {self.values} has shapes {sorted(shapes)}; expected the same texts and draws"
            )
        stats_ = [_mean_of(v, w) for v, w in arrays]
        (shape,) = shapes
        draws = shape[1] if len(shape) == 2 else None
        return arms_difference(stats_[: len(runs_a)], stats_[len(runs_a) :], shape[0], draws=draws, **kwargs)


@dataclass(frozen=True)
class Corpus:
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
        fn_a, fn_b = self.statistic(per_text_a), self.statistic(per_text_b)
        n_a, n_b = len(per_text_a[self.keys[0]]), len(per_text_b[self.keys[0]])
        return unpaired_difference(
            lambda idx, cols=None: fn_a(idx), (n_a,), lambda idx, cols=None: fn_b(idx), (n_b,), **kwargs
        )

    def arms_difference(self, runs_a: list[dict], runs_b: list[dict], **kwargs) -> ArmsDifference | None:
        """Several runs per arm on the same texts; None where the figure is not `resampled`."""
        if not self.resampled:
            return None
        sizes = {len(per_text[self.keys[0]]) for per_text in (*runs_a, *runs_b)}
        if len(sizes) != 1:
            raise ValueError(f"arms_difference: the runs have {sorted(sizes)} texts; expected the same")

        def of_texts(per_text: dict) -> Callable[..., float]:
            statistic = self.statistic(per_text)
            return lambda idx, cols=None: float(statistic(idx))

        fns = [of_texts(per_text) for per_text in (*runs_a, *runs_b)]
        return arms_difference(fns[: len(runs_a)], fns[len(runs_a) :], sizes.pop(), **kwargs)
