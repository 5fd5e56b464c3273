"""What each text sampler preserves, checked with an exact denoiser: a known distribution over short
texts, a model that returns each masked position's exact conditional given the unmasked tokens, and the
total variation (TV) between N sampled texts and the distribution, against the TV of N i.i.d. draws.
A sampler of the model's distribution lands near the i.i.d. figure; a mode-seeking one far above."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmldlm.config import LatentDiffusionConfig, TextDiffusionConfig
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.sampling import Sampler, SamplingOptions, time_grid

WORDS, PAD, MASK, LENGTH = 3, 3, 4, 4  # words 0-2, then padding and the mask: 5 token ids
NUM_TEXTS = 20_000


class ExactDenoiser(nn.Module):
    """Text logits log p(x_i = w | the unmasked tokens) at every position, from the joint distribution
    `probs` (S,) over the texts `texts` (S, L); the latent is ignored. Each of the 4^L partial texts
    (a word or the mask at each position) is worked out once, and a call looks its rows up."""

    def __init__(self, texts: torch.Tensor, probs: torch.Tensor):
        super().__init__()
        partial = torch.cartesian_prod(*[torch.tensor([0, 1, 2, MASK])] * LENGTH)  # (4^L, L)
        agrees = (partial[:, None, :] == MASK) | (partial[:, None, :] == texts[None])  # (4^L, S, L)
        weight = agrees.all(dim=-1).double() * probs  # (4^L, S): the texts each partial text allows
        marginal = torch.einsum("ps,slv->plv", weight, F.one_hot(texts, WORDS + 2).double())  # (4^L, L, V)
        self.table = marginal.log()
        self.anchor = nn.Parameter(torch.zeros(()))  # the sampler reads the device from a parameter
        self.cfg = SimpleNamespace(self_condition=False)

    def forward(self, tokens, latents, t_text, t_latent, **kwargs):
        digits = torch.where(tokens == MASK, WORDS, tokens)  # (B, L) the mask as digit 3
        row = (digits * (WORDS + 1) ** torch.arange(LENGTH - 1, -1, -1)).sum(dim=1)  # cartesian_prod's order
        return SimpleNamespace(text_logits=self.table[row])


@pytest.fixture(scope="module")
def toy():
    return toy_distribution()


def toy_distribution() -> tuple[ExactDenoiser, torch.Tensor]:
    """(denoiser, probs): 81 texts of 4 words with correlated, uneven probabilities."""
    texts = torch.cartesian_prod(*[torch.arange(WORDS)] * LENGTH)  # (81, 4)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(1.5 * torch.randn(len(texts), generator=g, dtype=torch.float64), 0)
    return ExactDenoiser(texts, probs), probs


def total_variations(index: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """(D,) the TV to `probs` of each row of text indices (D, N) (a text's index in cartesian_prod's order)."""
    D, N = index.shape
    offset = len(probs) * torch.arange(D)[:, None]  # each row counts in a block of its own
    counts = torch.bincount((index + offset).flatten(), minlength=D * len(probs)).view(D, -1).double()
    return 0.5 * (counts / N - probs).abs().sum(dim=1)


def iid_total_variations(probs: torch.Tensor, num_draws: int = 20) -> torch.Tensor:
    """(num_draws,) TVs of NUM_TEXTS i.i.d. texts each: where any sampler of the distribution sits."""
    g = torch.Generator().manual_seed(1)
    draws = torch.multinomial(probs, NUM_TEXTS * num_draws, replacement=True, generator=g)
    return total_variations(draws.view(num_draws, NUM_TEXTS), probs)


def sampled_total_variation(toy, seed: int = 2, **options) -> float:
    denoiser, probs = toy
    text = MaskedDiffusion(TextDiffusionConfig(), mask_token_id=MASK, pad_token_id=PAD)
    sampler = Sampler(denoiser, text, GaussianDiffusion(LatentDiffusionConfig()), SamplingOptions(**options))
    pad_mask = torch.ones(NUM_TEXTS, LENGTH, dtype=torch.bool)
    draft = sampler.write(torch.zeros(NUM_TEXTS, 1, 1), pad_mask, torch.Generator().manual_seed(seed))
    assert not (draft.tokens >= WORDS).any()  # every text complete, no padding drawn
    index = (draft.tokens * WORDS ** torch.arange(LENGTH - 1, -1, -1)).sum(dim=1)
    return total_variations(index[None], probs).item()


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "ancestral", "num_steps": 64},
        {"strategy": "margin", "num_steps": 8},
        {"strategy": "left_to_right", "num_steps": 8},
        {"strategy": "ancestral", "num_steps": 128, "remask": "posterior", "remask_cap": 0.02},
    ],
    ids=["ancestral", "margin", "left_to_right", "posterior_remasking"],
)
def test_samplers_that_claim_the_models_distribution_sample_it_as_well_as_iid_draws(toy, options):
    assert sampled_total_variation(toy, **options) < 1.5 * iid_total_variations(toy[1]).mean()


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "confidence", "num_steps": 8},
        {"strategy": "ancestral", "num_steps": 64, "remask_rounds": 4, "remask_fraction": 0.5},
    ],
    ids=["confidence", "confidence_remasking"],
)
def test_mode_seeking_samplers_are_far_from_the_models_distribution(toy, options):
    assert sampled_total_variation(toy, **options) > 3 * iid_total_variations(toy[1]).mean()


def test_revealed_count_follows_the_schedule_for_more_steps_than_tokens():
    """12 tokens in 50 steps: a per-step share rounds to 0 until t = 0.46 and the model reads 12 masks
    at t = 0.5; the cumulative target reveals round(12 (1 - s)) by each time s."""
    text = MaskedDiffusion(TextDiffusionConfig(), mask_token_id=MASK, pad_token_id=PAD)
    tokens = torch.full((1, 12), MASK)
    logits = torch.zeros(1, 12, WORDS + 2)
    revealed = []
    for t, s in time_grid(50):
        if t == pytest.approx(0.5):
            assert (tokens == MASK).sum() == 6  # the masked share the model saw in training at t = 0.5
        tokens = text.step(logits, tokens, t, s, torch.Generator().manual_seed(0), "confidence")
        revealed.append(int((tokens != MASK).sum()))
    targets = [round(12 * (1 - s)) for _, s in time_grid(50)]
    assert revealed == targets and revealed[-1] == 12
    assert revealed[2] == 1  # the first token at the third step


# The figures of docs/quality.md: PYTHONPATH=. python tests/test_sampler_distribution.py
MEASURED = {
    "confidence, 8 steps": {"strategy": "confidence", "num_steps": 8},
    "confidence, 50 steps": {"strategy": "confidence", "num_steps": 50},
    "margin, 8 steps": {"strategy": "margin", "num_steps": 8},
    "left_to_right, 8 steps": {"strategy": "left_to_right", "num_steps": 8},
    "ancestral, 64 steps": {"strategy": "ancestral", "num_steps": 64},
    "ancestral, 64 steps + 4 confidence remasking rounds of 0.25": {
        "strategy": "ancestral",
        "num_steps": 64,
        "remask_rounds": 4,
    },
    "ancestral, 64 steps + 4 confidence remasking rounds of 0.5": {
        "strategy": "ancestral",
        "num_steps": 64,
        "remask_rounds": 4,
        "remask_fraction": 0.5,
    },
    "ancestral, 128 steps, posterior remasking, cap 0.02": {
        "strategy": "ancestral",
        "num_steps": 128,
        "remask": "posterior",
    },
    "ancestral, 128 steps, posterior remasking, cap 0.05": {
        "strategy": "ancestral",
        "num_steps": 128,
        "remask": "posterior",
        "remask_cap": 0.05,
    },
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    toy = toy_distribution()
    iid = iid_total_variations(toy[1])
    print(f"TV to the distribution, {NUM_TEXTS} texts per sample; 5 seeds: mean [min, max]")
    print(f"i.i.d. draws (20 samples): {iid.mean():.4f} [{iid.min():.4f}, {iid.max():.4f}]")
    for name, options in MEASURED.items():
        tvs = torch.tensor([sampled_total_variation(toy, seed, **options) for seed in range(5)])
        print(f"{name}: {tvs.mean():.4f} [{tvs.min():.4f}, {tvs.max():.4f}]")
