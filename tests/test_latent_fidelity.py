"""Fidelity of generated latents: the figures tell real samples from samples collapsed towards the mean,
and the latent sampler's own collapse shows with an exact denoiser."""

import numpy as np
import pytest
import torch

from mmldlm.config import LatentDiffusionConfig
from mmldlm.diffusion import GaussianDiffusion
from mmldlm.evaluation.latent_fidelity import exact_gaussian_samples, fidelity, frechet_distance

N, D = 300, 16


@pytest.fixture(scope="module")
def sets():
    """Three disjoint sets of N draws of one correlated, non-isotropic Gaussian in D dimensions."""
    rng = np.random.default_rng(0)
    mixing = rng.normal(size=(D, D)) / np.sqrt(D) * np.linspace(0.3, 1.5, D)
    mean = rng.normal(size=D)
    return [mean + rng.normal(size=(N, D)) @ mixing for _ in range(3)]


def test_real_samples_score_like_the_real_reference(sets):
    real, reference, generated = sets
    out = fidelity(generated, real, reference)
    assert out["num_samples"] == N and out["dims"] == D
    assert out["frechet_distance"] < 2 * out["frechet_distance_real_vs_real"]
    assert 0.85 < out["std_ratio_median"] < 1.15
    assert out["precision"] > 0.7 and out["recall"] > 0.7
    assert out["recall_real_vs_real"] > 0.7


def test_samples_shrunk_towards_the_mean_are_caught_by_every_figure(sets):
    real, reference, generated = sets
    collapsed = generated.mean(axis=0) + 0.3 * (generated - generated.mean(axis=0))
    out = fidelity(collapsed, real, reference)
    assert out["frechet_distance"] > 5 * out["frechet_distance_real_vs_real"]
    assert out["std_ratio_median"] == pytest.approx(0.3, rel=0.15) and out["std_ratio_max"] < 0.5
    assert out["recall"] < 0.2 < 0.7 < out["recall_real_vs_real"]
    assert out["spread"] < 0.5 * out["spread_real"]


def test_frechet_distance_of_two_large_gaussian_samples_is_the_closed_form():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(20000, 3)) * [1.0, 2.0, 0.5]
    b = rng.normal(size=(20000, 3)) * [1.0, 1.0, 0.5] + [1.0, 0.0, 0.0]
    # ||mu_a - mu_b||^2 + sum (s_a - s_b)^2 for diagonal covariances: 1 + 1 = 2
    assert frechet_distance(a, b) == pytest.approx(2.0, abs=0.05)


def test_exact_denoiser_shows_the_few_step_latent_sampler_collapse():
    data_std = torch.tensor([0.5, 1.0])
    shifted = GaussianDiffusion(LatentDiffusionConfig(prediction="x0", shift=8.0))
    g = torch.Generator().manual_seed(0)
    two_steps = exact_gaussian_samples(shifted, data_std, 2, 4000, "ddim", g).std(dim=0) / data_std
    many_steps = exact_gaussian_samples(shifted, data_std, 256, 4000, "ddim", g).std(dim=0) / data_std
    assert (two_steps < 0.15).all()  # close to the mean: 0.06 and 0.12 of the data's spread
    assert (many_steps > 0.9).all() and (many_steps < 1.05).all()


def test_a_sampling_shift_grid_gives_a_shifted_model_the_plain_schedules_few_step_spread():
    data_std = torch.tensor([0.5, 1.0], dtype=torch.float64)
    shifted = GaussianDiffusion(LatentDiffusionConfig(prediction="x0", shift=8.0))
    plain = GaussianDiffusion(LatentDiffusionConfig(prediction="x0", shift=1.0))
    assert shifted.time_grid(8) == shifted.time_grid(8, 8.0) == plain.time_grid(8)  # equal steps of t
    grid = shifted.time_grid(8, 1.0)
    assert grid[0][0] == 1.0 and grid[-1][1] == 0.0 and all(t > s for t, s in grid)
    like = torch.zeros(1, 1)
    for (t, _), (u, _) in zip(grid[1:], plain.time_grid(8)[1:]):  # the plain schedule's SNRs, equal steps
        assert shifted.snr(t, like).item() == pytest.approx(plain.snr(u, like).item(), rel=1e-9)
    samples = {}
    for name, diffusion, grid_shift in (("equal", shifted, None), ("grid", shifted, 1.0), ("plain", plain, None)):
        g = torch.Generator().manual_seed(0)
        x = exact_gaussian_samples(diffusion, data_std, 8, 4000, "ddim", g, sampling_shift=grid_shift)
        samples[name] = x.std(dim=0) / data_std
    # DDIM sees only the grid's SNRs (t = 1 differs: alpha_1 is min_alpha / 8 under shift 8)
    assert torch.allclose(samples["grid"], samples["plain"], atol=1e-3)
    assert (samples["grid"] > 0.8).all() and (samples["equal"][0] < 0.35)  # 0.83 / 0.86 against 0.30 / 0.51


def test_sets_smaller_than_k_plus_one_use_every_other_sample_as_the_neighbourhood(sets):
    real, reference, generated = (x[:3] for x in sets)
    out = fidelity(generated, real, reference, k=5)
    assert out["k"] == 2 and 0 <= out["precision"] <= 1 and 0 <= out["recall"] <= 1


def test_paired_latents_read_against_a_perfect_encoder_another_real_set_and_the_mean(sets):
    real, reference, _ = sets
    centred = real - real.mean(axis=0)  # standardised space: the training mean at the origin
    perfect = fidelity(centred, centred, reference - real.mean(axis=0), paired=True)
    assert perfect["frechet_distance"] == pytest.approx(0.0, abs=1e-6) and perfect["recall"] == 1.0
    assert 0 < perfect["frechet_distance_real_vs_real"] < perfect["frechet_distance_mean_latent"]
    assert perfect["recall_mean_latent"] == 0.0  # one point covers no real latent's neighbourhood
    # two real sets of the same n already spread about 1: the std ratio's [min, max] is read beside theirs
    assert perfect["std_ratio_real_vs_real_min"] < 0.95 < 1.05 < perfect["std_ratio_real_vs_real_max"]
    assert "frechet_distance_mean_latent" not in fidelity(reference, real, reference)
