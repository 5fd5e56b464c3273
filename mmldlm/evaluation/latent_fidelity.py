"""Fidelity of generated latents: do they cover the real latent distribution, or collapse towards its mean?

A sampler can score well on retrieval and on the cosine to its target while its samples are close to
the posterior mean (a regressor), far narrower than the data. Three figures, each on (N, D) latents in
the standardised space (every dimension of unit variance over the training set, so all count alike):

- Fréchet distance between Gaussians fitted to the two sets (Heusel et al. 2017, the FID formula):
  ||mu_g - mu_r||^2 + tr(S_g + S_r - 2 (S_g S_r)^(1/2)). With N samples in D dimensions it is biased
  upwards by the estimation noise of both covariances, so it is read only beside its reference: two
  disjoint sets of N real latents (real vs real at the same N).
- Precision and recall in k-NN manifolds (Kynkäänniemi et al. 2019, "Improved Precision and Recall
  Metric for Assessing Generative Models", sec. 3): each sample's ball reaches its k-th nearest
  neighbour within its own set; precision is the share of generated latents inside some real ball,
  recall the share of real latents inside some generated ball. A collapsed sampler keeps precision
  and loses recall.
- The per-dimension standard deviation ratio, generated / real: its median and range over dimensions
  (1 = the data's spread; a regressor's samples have ratios well below 1).

`exact_gaussian_samples` runs the latent sampler with the exact denoiser of Gaussian data, so that the
collapse of a step count, shift or sampler can be seen without a trained model (docs/quality.md).
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg
import torch

from mmldlm.diffusion import GaussianDiffusion, rng


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Fréchet distance between Gaussians fitted to the rows of a (N, D) and b (M, D)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    with warnings.catch_warnings():  # singular whenever N <= D: expected, and the reference shares it
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        root = scipy.linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(root).all():  # a singular product (N <= D): nudge both as pytorch-fid does
        nudge = 1e-6 * np.eye(a.shape[1])
        root = scipy.linalg.sqrtm((cov_a + nudge) @ (cov_b + nudge))
    mean_gap = a.mean(axis=0) - b.mean(axis=0)
    return float(mean_gap @ mean_gap + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(root.real))


def _radii(x: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) the distance of each row of x (N, D) to its k-th nearest other row."""
    distances = torch.cdist(x, x)  # (N, N), 0 on the diagonal
    return distances.kthvalue(k + 1, dim=1).values  # the +1 skips the row itself


def precision_recall(real: np.ndarray, generated: np.ndarray, k: int = 3) -> tuple[float, float]:
    """(precision, recall) of generated (M, D) against real (N, D) in k-NN manifolds (module docstring)."""
    real_t = torch.as_tensor(np.asarray(real), dtype=torch.float64)
    gen_t = torch.as_tensor(np.asarray(generated), dtype=torch.float64)
    between = torch.cdist(gen_t, real_t)  # (M, N)
    precision = (between <= _radii(real_t, k)[None, :]).any(dim=1).double().mean()
    recall = (between <= _radii(gen_t, k)[:, None]).any(dim=0).double().mean()
    return float(precision), float(recall)


def std_ratio(generated: np.ndarray, real: np.ndarray) -> np.ndarray:
    """The standard deviation of each dimension of generated (M, D) over that of real (N, D), over the
    dimensions where real varies."""
    real_std = np.asarray(real, dtype=np.float64).std(axis=0)
    varies = real_std > 0
    return np.asarray(generated, dtype=np.float64).std(axis=0)[varies] / real_std[varies]


def spread(x: np.ndarray) -> float:
    """The root mean squared distance of the rows of x (N, D) to their mean."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(((x - x.mean(axis=0)) ** 2).sum(axis=1).mean()))


def fidelity(generated: np.ndarray, real: np.ndarray, reference: np.ndarray, k: int = 3, paired: bool = False) -> dict:
    """The module's figures of generated (N, D) against real (N, D), each beside the same figure of
    `reference` (N, D), real latents disjoint from `real`: what another real set scores at the same N
    (the std ratio's median, min and max included: at N = 128 over 384 dims two real sets already
    spread from about 0.77 to 1.31). N >= 2; k is cut to N - 1 for smaller sets.

    `paired`: row i of `generated` was made from the text whose latent is row i of `real` (t2l). A
    perfect encoder then returns `real` itself (Fréchet distance 0, precision and recall 1), and the
    other real set is what an encoder that ignores its text but samples the right distribution scores;
    the constant latent at the mean of standardised space (the training-set mean latent,
    `mean_latent_*`) is what one that ignores its text and its spread scores."""
    k = min(k, len(generated) - 1)
    ratio, real_ratio = std_ratio(generated, real), std_ratio(reference, real)
    precision, recall = precision_recall(real, generated, k)
    real_precision, real_recall = precision_recall(real, reference, k)
    out = {
        "num_samples": len(generated),
        "dims": int(np.asarray(generated).shape[1]),
        "paired": paired,
        "frechet_distance": frechet_distance(generated, real),
        "frechet_distance_real_vs_real": frechet_distance(reference, real),
        "precision": precision,
        "recall": recall,
        "precision_real_vs_real": real_precision,
        "recall_real_vs_real": real_recall,
        "k": k,
        "std_ratio_median": float(np.median(ratio)),
        "std_ratio_min": float(ratio.min()),
        "std_ratio_max": float(ratio.max()),
        "std_ratio_real_vs_real_median": float(np.median(real_ratio)),
        "std_ratio_real_vs_real_min": float(real_ratio.min()),
        "std_ratio_real_vs_real_max": float(real_ratio.max()),
        "spread": spread(generated),
        "spread_real": spread(real),
    }
    if paired:
        constant = np.zeros_like(np.asarray(real, dtype=np.float64))  # the training mean, standardised
        out["frechet_distance_mean_latent"] = frechet_distance(constant, real)
        out["precision_mean_latent"], out["recall_mean_latent"] = precision_recall(real, constant, k)
    return out


@torch.no_grad()
def exact_gaussian_samples(
    diffusion: GaussianDiffusion,
    data_std: torch.Tensor,
    num_steps: int,
    num_samples: int,
    sampler: str | None = None,
    generator: torch.Generator | None = None,
    sampling_shift: float | None = None,
) -> torch.Tensor:
    """(num_samples, D) float64 samples of the latent sampler (`GaussianDiffusion.step` on its time
    grid, `GaussianDiffusion.time_grid` with `sampling_shift`) for data N(0, diag(data_std^2)), with the exact denoiser
    E[x0 | x_t] = alpha s^2 / (alpha^2 s^2 + sigma^2) x_t handed to it as the configured prediction."""
    data_std = torch.as_tensor(data_std, dtype=torch.float64)
    x = rng.normal((num_samples, 1, data_std.numel()), "cpu", generator, dtype=torch.float64)  # (N, 1, D) at t = 1
    for t, s in diffusion.time_grid(num_steps, sampling_shift):
        alpha, sigma = diffusion.alpha_sigma(t, x)
        x0 = alpha * data_std**2 / (alpha**2 * data_std**2 + sigma**2) * x
        eps = (x - alpha * x0) / sigma
        x = diffusion.step(diffusion.from_x0_eps(x0, eps, t), x, t, s, sampler, generator)
    return x[:, 0]
