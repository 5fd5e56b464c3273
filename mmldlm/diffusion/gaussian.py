"""Continuous-time Gaussian diffusion over standardised latents.

Variance preserving: x_t = alpha_t x0 + sigma_t eps with alpha_t^2 + sigma_t^2 = 1 and time t in
[0, 1] (0 = clean). Cosine schedule (Nichol & Dhariwal 2021, continuous form): alpha_t = cos(phi t),
sigma_t = sin(phi t). With phi = pi/2 alpha_1 would be 0 and x0 = (x_t - sigma eps) / alpha
undefined at t = 1, so phi = arccos(min_alpha): alpha_1 = min_alpha exactly and the schedule stays
smooth (no kink from clipping).

Shifted schedule (`shift` s; Hoogeboom et al. 2023 "simple diffusion", sec. 3.1; the same SNR / s^2
as SD3's timestep shift): tan(angle_t) = s tan(phi t), so SNR_t = alpha_t^2 / sigma_t^2 is divided
by s^2 at every t. A sentence latent is one point in 384 dimensions on a low-dimensional manifold:
at the plain schedule's middle times the noised latent alone still identifies its sentence, the
condition is not needed there, and the t2l direction learns from only the last stretch of t.

Loss weighting over t (Hang et al. 2023, "min-SNR", eq. 6-8): written as a weight lambda_t on the
x0 error, ||x0_hat - x0||^2 = ||eps_hat - eps||^2 / SNR = ||v_hat - v||^2 / (SNR + 1), so the
parameterisation's own MSE gets lambda_t / (1, SNR, SNR + 1) for x0, eps, v. "none" leaves the
plain MSE of the parameterisation; "min_snr" is lambda_t = min(SNR_t, gamma).

Parameterisations (Salimans & Ho 2022, "Progressive Distillation", sec. 4 and app. D):
    eps, x0, or v = alpha_t eps - sigma_t x0,
    x0 = alpha_t x_t - sigma_t v,   eps = sigma_t x_t + alpha_t v.
Schedule coefficients are computed in float64 and cast to the data's dtype.

Sampling (`step`) from t to s < t uses the network's (x0, eps) estimate:
    x_s = alpha_s x0 + sqrt(sigma_s^2 - c^2) eps + c z,
    c^2 = eta^2 sigma_s^2 (1 - (alpha_t sigma_s / (alpha_s sigma_t))^2)
(DDIM, Song et al. 2021 eq. 12 and 16): eta = 0 is DDIM, eta = 1 the DDPM ancestral step, whose mean
and variance are those of the posterior q(x_s | x_t, x0) (Kingma et al. 2021, VDM eq. 26).

The sampler's time grid (`time_grid`): N equal steps of t, or, with a `sampling_shift` s', the times of
the trained schedule whose SNRs are those of N equal steps under shift s' (s' = 1: the plain cosine
schedule's SNRs). DDIM's update depends on the grid's SNRs only, so with the exact denoiser a shift-8
model sampled on the s' = 1 grid is the shift-1 sampler: its last step starts from a far higher SNR,
whose posterior mean is shrunk far less (docs/quality.md).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from mmldlm import baseline
from mmldlm.config import LatentDiffusionConfig
from mmldlm.diffusion import rng

PREDICTIONS = ("eps", "x0", "v")


def _stat(value, name: str) -> torch.Tensor | None:
    if value is None:
        return None
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    if tensor.dim() != 1:
        raise ValueError(
            f"GaussianDiffusion: latent {name} must be a vector of D values; got shape {tuple(tensor.shape)}"
        )
    if not torch.isfinite(tensor).all():
        raise ValueError(f"GaussianDiffusion: latent {name} has non-finite values; recompute the dataset statistics")
    return tensor


class GaussianDiffusion:
    """Cosine-schedule Gaussian diffusion: standardisation, forward process, loss and sampling step."""

    def __init__(self, cfg: LatentDiffusionConfig, mean=None, std=None):
        self.cfg = cfg
        self.max_angle = math.acos(cfg.min_alpha)
        self.mean = _stat(mean, "mean")  # (D,) or None
        self.std = _stat(std, "std")
        if self.std is not None and (self.std <= 0).any():
            bad = int((self.std <= 0).nonzero()[0, 0])
            raise ValueError(
                f"GaussianDiffusion: latent std must be > 0 in every dimension; dimension {bad} "
                f"has {self.std[bad].item()} (a constant dimension); recompute the dataset statistics"
            )
        if self.mean is not None and self.std is not None and self.mean.shape != self.std.shape:
            raise ValueError(
                f"GaussianDiffusion: latent mean has {self.mean.numel()} values but std has {self.std.numel()}"
            )
        self._stats_cache: dict = {}

    # --- standardisation -------------------------------------------------------------------------

    def _stats_like(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        key = (x.device, x.dtype)
        if key not in self._stats_cache:
            for stat in (self.mean, self.std):
                if stat is not None and stat.numel() != x.shape[-1]:
                    raise ValueError(
                        f"GaussianDiffusion: latents have dim {x.shape[-1]} but the statistics have "
                        f"{stat.numel()}; the dataset's encoder and model.latent_dim must agree"
                    )
            move = lambda s: None if s is None else rng.to_device(s.to(x.dtype), x.device)  # noqa: E731
            self._stats_cache[key] = (move(self.mean), move(self.std))
        return self._stats_cache[key]

    def standardize(self, x: torch.Tensor) -> torch.Tensor:
        """Raw encoder space -> per-dimension zero mean, unit variance (over the training set). x (..., D)."""
        mean, std = self._stats_like(x)
        if mean is not None:
            x = x - mean
        return x / std if std is not None else x

    def destandardize(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `standardize`."""
        mean, std = self._stats_like(x)
        if std is not None:
            x = x * std
        return x + mean if mean is not None else x

    # --- schedule --------------------------------------------------------------------------------

    def alpha_sigma(self, t, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha_t, sigma_t) shaped (B, 1, ..., 1) to broadcast against `like` (B, ...), in its dtype.
        t: a number, a 0-d or a (B,) tensor in [0, 1]."""
        angle = self._angle(t, like)
        return torch.cos(angle).to(like.dtype), torch.sin(angle).to(like.dtype)

    def _angle(self, t, like: torch.Tensor) -> torch.Tensor:
        """The schedule's angle (alpha = cos, sigma = sin) at t, float64, shaped (B, 1, ..., 1)."""
        t = torch.as_tensor(t, dtype=torch.float64, device=like.device)
        if t.dim() == 0:
            t = t.expand(like.shape[0])
        angle = self.max_angle * t.reshape(-1, *([1] * (like.dim() - 1)))  # (B, 1, ..., 1)
        if self.cfg.shift != 1.0:
            angle = torch.atan(self.cfg.shift * torch.tan(angle))
        return angle

    def time_grid(self, num_steps: int, sampling_shift: float | None = None) -> list[tuple[float, float]]:
        """The (t, s) pairs of `num_steps` reverse steps from t = 1 to 0: equal steps of t, or with
        `sampling_shift` s' the trained schedule's t of the SNRs of equal steps under shift s'
        (tan(phi t) = (s' / shift) tan(phi u), u in equal steps); float64 values, 1.0 and 0.0 exact."""
        u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        if sampling_shift is not None and sampling_shift != self.cfg.shift:
            ratio = sampling_shift / self.cfg.shift
            u = torch.atan(ratio * torch.tan(self.max_angle * u)) / self.max_angle
        times = u.tolist()
        times[0], times[-1] = 1.0, 0.0
        return list(zip(times[:-1], times[1:]))

    def snr(self, t, like: torch.Tensor) -> torch.Tensor:
        """alpha_t^2 / sigma_t^2 (inf at t = 0), float64, shaped (B, 1, ..., 1) like alpha_sigma."""
        angle = self._angle(t, like)
        return torch.cos(angle) ** 2 / torch.sin(angle) ** 2

    def loss_weight(self, t, like: torch.Tensor) -> torch.Tensor | None:
        """The weight of the parameterisation's MSE at t (module docstring), (B, 1, ..., 1); None = 1."""
        if self.cfg.loss_weighting == "none":
            return None
        snr = self.snr(t, like)
        x0_weight = snr.clamp(max=self.cfg.min_snr_gamma)
        if self.cfg.prediction == "eps":
            weight = torch.where(torch.isinf(snr), torch.zeros_like(snr), x0_weight / snr)
        elif self.cfg.prediction == "v":
            weight = torch.where(torch.isinf(snr), torch.zeros_like(snr), x0_weight / (snr + 1.0))
        else:
            weight = x0_weight
        return weight.to(like.dtype)

    # --- forward process -------------------------------------------------------------------------

    def add_noise(self, x0: torch.Tensor, t, noise: torch.Tensor) -> torch.Tensor:
        """x_t = alpha_t x0 + sigma_t noise. x0, noise (B, K, D); t (B,)."""
        alpha, sigma = self.alpha_sigma(t, x0)
        return alpha * x0 + sigma * noise

    def sample_noise(self, like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return rng.normal(like.shape, like.device, generator, dtype=like.dtype)

    # --- parameterisations -----------------------------------------------------------------------

    def predict_x0_eps(
        self, pred: torch.Tensor, x_t: torch.Tensor, t, prediction: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x0, eps) implied by a network output `pred` of type `prediction` (default: the configured one).

        With x0-prediction at t = 0 (sigma = 0) eps is not identifiable and is returned as 0; no other
        case divides by a value that can be 0 (alpha_t >= min_alpha).
        """
        prediction = prediction or self.cfg.prediction
        alpha, sigma = self.alpha_sigma(t, x_t)
        if prediction == "eps":
            return (x_t - sigma * pred) / alpha, pred
        if prediction == "x0":
            inv_sigma = torch.where(sigma > 0, 1.0 / sigma, torch.zeros_like(sigma))
            return pred, (x_t - alpha * pred) * inv_sigma
        if prediction == "v":
            return alpha * x_t - sigma * pred, sigma * x_t + alpha * pred
        raise ValueError(f"GaussianDiffusion: prediction {prediction!r}; expected one of {PREDICTIONS}")

    def from_x0_eps(self, x0: torch.Tensor, eps: torch.Tensor, t, prediction: str | None = None) -> torch.Tensor:
        """The network output of type `prediction` (default: the configured one) for a given (x0, eps)."""
        prediction = prediction or self.cfg.prediction
        if prediction == "eps":
            return eps
        if prediction == "x0":
            return x0
        if prediction == "v":
            alpha, sigma = self.alpha_sigma(t, x0)
            return alpha * eps - sigma * x0
        raise ValueError(f"GaussianDiffusion: prediction {prediction!r}; expected one of {PREDICTIONS}")

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t) -> torch.Tensor:
        """What the network is trained to output for x_t = add_noise(x0, t, noise)."""
        return self.from_x0_eps(x0, noise, t)

    # --- loss ------------------------------------------------------------------------------------

    def loss(self, pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t) -> torch.Tensor:
        """Scalar latent loss for the network output `pred` on x_t = add_noise(x0, t, noise). x0 standardised.

        mse: mean squared error to `target` (the configured prediction), over all elements, weighted
            over t by `loss_weighting` (module docstring).
        cosine: mean over vectors of 1 - cos(x0_hat, x0) along the last dim (in [0, 2], no clamp).
        normalized_mse: the baseline recipe's (mmldlm/baseline.py).
        """
        pred, x0, noise = pred.float(), x0.float(), noise.float()
        if self.cfg.loss == "mse":
            weight = self.loss_weight(t, x0)
            if weight is None:
                return F.mse_loss(pred, self.target(x0, noise, t))
            return (weight * (pred - self.target(x0, noise, t)) ** 2).mean()
        x0_hat, _ = self.predict_x0_eps(pred, self.add_noise(x0, t, noise), t)
        if self.cfg.loss == "cosine":
            return (1.0 - F.cosine_similarity(x0_hat, x0, dim=-1)).mean()
        return baseline.normalized_mse(x0_hat, x0)  # baseline recipe

    # --- reverse process -------------------------------------------------------------------------

    def step(
        self,
        pred: torch.Tensor,
        x_t: torch.Tensor,
        t,
        s,
        sampler: Literal["ddim", "ddpm"] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One reverse step from time t to s < t (module docstring); returns x_s shaped like x_t.

        pred: the network output on x_t at time t; t, s numbers or (B,) tensors, 0 <= s < t <= 1;
        sampler: "ddim" (deterministic) or "ddpm" (ancestral), default cfg.sampler. At s = 0 both
        return the x0 estimate.
        """
        sampler = sampler or self.cfg.sampler
        if sampler not in ("ddim", "ddpm"):
            raise ValueError(f"GaussianDiffusion.step: sampler {sampler!r}; expected 'ddim' or 'ddpm'")
        x0, eps = self.predict_x0_eps(pred, x_t, t)
        alpha_s, sigma_s = self.alpha_sigma(s, x_t)
        if sampler == "ddim":
            return alpha_s * x0 + sigma_s * eps
        alpha_t, sigma_t = self.alpha_sigma(t, x_t)
        # c^2 = posterior variance of q(x_s | x_t, x0); sigma_s / sigma_t <= 1 and is 0 when t = s = 0.
        ratio = torch.where(sigma_t > 0, sigma_s / sigma_t, torch.zeros_like(sigma_t))
        c2 = (sigma_s**2 * (1.0 - (alpha_t / alpha_s * ratio) ** 2)).clamp_min(0.0)  # rounding below 0
        z = rng.normal(x_t.shape, x_t.device, generator, dtype=x_t.dtype)
        return alpha_s * x0 + (sigma_s**2 - c2).clamp_min(0.0).sqrt() * eps + c2.sqrt() * z
