"""The text likelihood bound with the length paid, checked against an exact denoiser and an exact length
model on a toy distribution whose entropy is known."""

import math

import pytest
import torch

from mmldlm.config import TextDiffusionConfig
from mmldlm.diffusion import MaskedDiffusion
from mmldlm.evaluation.evaluate import importance_times

# Toy texts over words 0..3 (4 = mask, 5 = pad: V = 6), of lengths 2 to 4, with their probabilities; the
# words within a text are correlated (texts share prefixes), so the denoiser's marginals matter.
TEXTS = [[0, 1], [0, 2], [1, 1, 3], [0, 1, 3], [2, 2, 2, 0], [0, 1, 3, 3], [3, 0, 1, 2]]
PROBS = torch.tensor([0.25, 0.10, 0.20, 0.10, 0.15, 0.12, 0.08], dtype=torch.float64)
MASK, PAD, V, L = 4, 5, 6, 4


def toy_batch(n: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n texts drawn from the toy distribution: tokens (n, L), pad_mask (n, L), their text index (n,)."""
    index = torch.multinomial(PROBS, n, replacement=True, generator=generator)
    table = torch.tensor([text + [PAD] * (L - len(text)) for text in TEXTS])
    tokens = table[index]
    return tokens, tokens != PAD, index


def exact_logits(noised: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, L, V) log of the exact posterior marginal of each position given the unmasked words and the
    length: the optimal denoiser of the toy distribution."""
    table = torch.tensor([text + [PAD] * (L - len(text)) for text in TEXTS])  # (S, L)
    lengths = (table != PAD).sum(dim=1)  # (S,)
    agrees = (noised[:, None, :] == MASK) | (noised[:, None, :] == table[None])  # (B, S, L)
    fits = agrees.all(dim=2) & (lengths[None] == pad_mask.sum(dim=1)[:, None])  # (B, S)
    posterior = PROBS[None] * fits  # (B, S)
    posterior = posterior / posterior.sum(dim=1, keepdim=True)
    marginal = torch.einsum("bs,slv->blv", posterior, torch.nn.functional.one_hot(table, V).double())
    return marginal.clamp_min(1e-300).log()


def length_nats(pad_mask: torch.Tensor) -> torch.Tensor:
    """(B,) -log p(L) under the toy distribution's exact length model."""
    lengths = torch.tensor([len(text) for text in TEXTS])
    p_length = torch.zeros(L + 1, dtype=torch.float64).index_add_(0, lengths, PROBS)
    return -p_length[pad_mask.sum(dim=1)].log()


def entropy() -> float:
    return float(-(PROBS * PROBS.log()).sum())


def bound_estimate(eps: float, schedule: str = "loglinear", n: int = 200_000) -> tuple[float, float, float]:
    """(nats per text with the length paid, its Monte Carlo standard error, nats per text given the
    length), with the exact denoiser, t drawn and noised as the objective does."""
    diffusion = MaskedDiffusion(TextDiffusionConfig(schedule=schedule, loss="elbo", eps=eps), MASK, PAD)
    g = torch.Generator().manual_seed(0)
    tokens, pad_mask, _ = toy_batch(n, g)
    t = diffusion.bound_time((torch.randperm(n, generator=g) + torch.rand(n, generator=g)) / n)  # stratified
    noised = diffusion.add_noise(tokens, t, pad_mask, generator=g)
    _, metrics = diffusion.loss(exact_logits(noised, pad_mask), tokens, noised, t, pad_mask, per_sample=True)
    given = metrics["nats_per_sample"].double() + diffusion.prior_nats_per_token(V) * pad_mask.sum(dim=1)
    paid = given + length_nats(pad_mask)
    return paid.mean().item(), paid.std().item() / math.sqrt(n), given.mean().item()


@pytest.mark.parametrize("schedule", ["loglinear", "linear"])
def test_length_paid_bound_of_the_exact_denoiser_equals_the_entropy_from_above(schedule):
    paid, error, given = bound_estimate(eps=1e-3, schedule=schedule)
    assert paid > given + 0.5  # the toy's length carries about 1.1 nats
    assert paid == pytest.approx(entropy(), rel=0.01)
    assert paid >= entropy() - 3 * error


def test_bound_stays_above_the_entropy_when_a_token_often_survives_to_t_1():
    # eps = 0.3: a token is unmasked at t = 1 with prob 0.3 and about 0.3 of the (0, eps) stretch is
    # clamped; the prior and reconstruction terms keep the figure a bound.
    paid, error, _ = bound_estimate(eps=0.3)
    assert paid >= entropy() - 3 * error


def test_prior_term_is_eps_log_of_the_tokens_a_position_can_show():
    diffusion = MaskedDiffusion(TextDiffusionConfig(eps=0.01), MASK, PAD)
    assert diffusion.prior_nats_per_token(V) == pytest.approx(0.01 * math.log(V - 1))


def test_importance_sampled_times_keep_the_bound_unbiased_and_tame_its_largest_draw():
    # A text of 16 tokens, each masked with prob t and costing 5 nats, weighted 1/t: f(t) has mean 80 at
    # every t, and a uniform t near 0 with one masked token gives one draw worth 5 / t nats.
    num_texts, num_draws, eps = 20000, 2, 1e-3
    g = torch.Generator().manual_seed(0)

    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.double().clamp_min(eps)
        return torch.binomial(torch.full_like(t, 16.0), t, generator=g) * 5.0 / t

    uniform = torch.stack([f(torch.rand(num_texts, generator=g)) for _ in range(num_draws)], dim=1)
    weighted = torch.stack(
        [f(t) * w for t, w in (importance_times(num_texts, d, num_draws, g) for d in range(num_draws))], dim=1
    )
    assert weighted.mean().item() == pytest.approx(80.0, rel=0.01)  # unbiased, as the uniform times are
    assert uniform.mean().item() == pytest.approx(80.0, rel=0.01)
    assert weighted.mean(dim=1).std() < 0.75 * uniform.mean(dim=1).std()  # each text's estimate: 28 against 42
    assert weighted.max() < 0.2 * uniform.max()  # the largest draw: 525 nats against 5000


def test_the_times_study_prints_both_schemes(capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    from elbo_times_study import main as study

    assert study(["--evaluations", "3", "--texts", "16"]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| uniform") or "stratified" in line
    ]
    assert len(rows) == 2 and all(row.count("|") == 5 for row in rows)
