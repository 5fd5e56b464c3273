"""Text decoding strategies beyond one reverse trajectory: each a function of its own that the Sampler
calls in a fixed order (sampler.py, `Sampler.l2t`), a no-op when its option is off.

1. Confidence remasking rounds: masked diffusion keeps every token once revealed, so an early error
   stays. After the text is complete, its least confident `remask_fraction` of tokens (by the
   log-probability each had when drawn) are masked again and re-sampled given the rest, every round.
   Mode-seeking: the tokens remasked are chosen by their values (the unlikely ones), so the rounds move
   the texts away from the model's distribution towards its likelier texts (docs/quality.md: total
   variation 0.13 with an exact denoiser, i.i.d. draws 0.018). ReMDM's remasking (Wang et al. 2025),
   which remasks whatever the value and keeps the distribution, is the sampler's `remask="posterior"`
   (MaskedDiffusion.remasking_step).
2. Best-of-N with the sentence encoder in the loop (vec2text, Morris et al. 2023, uses the encoder to
   score hypotheses): N texts per latent, re-encoded by the encoder that made the latents; the text
   whose re-encoding has the highest cosine to the target is kept.
3. Correction rounds: `correction_proposals` variants of the kept text, each with a share of its
   positions masked and re-sampled (the least confident share in the first variant, a random share
   weighted towards low confidence in the others); a variant replaces the text only where its
   re-encoding is closer to the target, so a round never moves a text away from its target.

A `Draft` carries the tokens and each position's confidence through these steps. The cosine rewards
the right words in any order (docs/quality.md), which is why 2. and 3. only choose among texts the
model wrote: the words and their order come from the model, the encoder only picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmldlm.diffusion import rng


@dataclass
class Draft:
    """Texts being decoded: tokens (B, L), and confidence (B, L) float64, the log-probability each
    real token had when it was drawn (+inf at padding: never remasked); cosine (B,) to the target
    latent where the encoder has scored it."""

    tokens: torch.Tensor
    confidence: torch.Tensor
    cosine: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> Draft:
        cosine = None if self.cosine is None else self.cosine[index]
        return Draft(self.tokens[index], self.confidence[index], cosine)


def least_confident(confidence: torch.Tensor, pad_mask: torch.Tensor, fraction: float, noise=None) -> torch.Tensor:
    """(B, L) bool: the ceil(fraction * length) real positions of each row with the lowest confidence
    (plus `noise`, a (B, L) perturbation that turns the choice into a weighted random one)."""
    count = torch.ceil(pad_mask.sum(dim=1) * fraction).clamp_min(1)  # (B,)
    score = confidence if noise is None else confidence + noise
    score = score.masked_fill(~pad_mask, float("inf"))
    rank = score.argsort(dim=1).argsort(dim=1)  # (B, L) 0 = least confident
    return (rank < count[:, None]) & pad_mask


def remask_rounds(sampler, draft: Draft, latents: torch.Tensor, pad_mask: torch.Tensor, generator) -> Draft:
    """1. (module docstring): `remask_rounds` rounds of re-sampling the least confident tokens given the
    rest; latents (B, K, D) standardised."""
    options = sampler.options
    for _ in range(options.remask_rounds):
        masked = least_confident(draft.confidence, pad_mask, options.remask_fraction)
        draft = sampler.fill(draft, masked, latents, pad_mask, generator)
    return draft


def similarity(sampler, tokens: torch.Tensor, pad_mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) cosine of each text's re-encoding to its target latent (B, K, D) in the encoder's space."""
    encoded = sampler.reencode(tokens, pad_mask).to(target.device, torch.float32)
    sampler.num_encoded += tokens.shape[0]
    return F.cosine_similarity(encoded.flatten(1), target.flatten(1), dim=-1)


def best_rows(cosine: torch.Tensor, num: int) -> torch.Tensor:
    """(B,) the row of highest cosine in each consecutive group of `num` rows of cosine (B * num,)."""
    best = cosine.view(-1, num).argmax(dim=1)
    return torch.arange(best.shape[0], device=best.device) * num + best


def keep_best(candidates: Draft, num: int) -> Draft:
    """The candidate of highest cosine in each consecutive group of `num` rows."""
    return candidates.rows(best_rows(candidates.cosine, num))


def best_of(sampler, target: torch.Tensor, pad_mask: torch.Tensor, generator) -> Draft:
    """2. (module docstring): `best_of` texts per target latent (B, K, D, encoder space) at each of the
    C candidate lengths of pad_mask (B, C, L), or at the one length of pad_mask (B, L); the closest
    kept. One length and best_of = 1: the sampler's text alone, not re-encoded."""
    num = sampler.options.best_of
    condition = sampler.latent.standardize(target)
    if pad_mask.dim() == 2 and num == 1:
        return sampler.write(condition, pad_mask, generator)
    masks = pad_mask if pad_mask.dim() == 3 else pad_mask[:, None]  # (B, C, L)
    per_target = masks.shape[1] * num
    rows_mask = masks.repeat_interleave(num, dim=1).flatten(0, 1)  # (B * C * num, L)
    candidates = sampler.write(condition.repeat_interleave(per_target, 0), rows_mask, generator)
    candidates.cosine = similarity(sampler, candidates.tokens, rows_mask, target.repeat_interleave(per_target, 0))
    return keep_best(candidates, per_target)


def best_joint(sampler, pad_mask: torch.Tensor, generator) -> tuple[Draft, torch.Tensor]:
    """2. for joint samples: `best_of` (text, latent) pairs per row, the pair whose text re-encodes
    closest to its own latent kept; (Draft, latents (B, K, D) in the encoder's space)."""
    num = sampler.options.best_of
    if num == 1:
        return sampler.write_joint(pad_mask, generator)
    rows_mask = pad_mask.repeat_interleave(num, 0)
    candidates, latents = sampler.write_joint(rows_mask, generator)
    candidates.cosine = similarity(sampler, candidates.tokens, rows_mask, latents)
    best = best_rows(candidates.cosine, num)
    return candidates.rows(best), latents[best]


def correction_rounds(sampler, draft: Draft, target: torch.Tensor, generator) -> Draft:
    """3. (module docstring): target (B, K, D) in the encoder's space."""
    options = sampler.options
    if options.correction_rounds == 0:
        return draft
    pad_mask = draft.tokens != sampler.text.pad_token_id  # each text's own length (best_of may choose it)
    if draft.cosine is None:
        draft.cosine = similarity(sampler, draft.tokens, pad_mask, target)
    num = options.correction_proposals
    B = draft.tokens.shape[0]
    condition = sampler.latent.standardize(target).repeat_interleave(num, 0)
    rows_mask, rows_target = pad_mask.repeat_interleave(num, 0), target.repeat_interleave(num, 0)
    first = torch.arange(B * num, device=pad_mask.device) % num == 0  # the least-confident variant
    for _ in range(options.correction_rounds):
        variants = draft.rows(torch.arange(B, device=pad_mask.device).repeat_interleave(num))
        # Gumbel top-k on -confidence: a position is chosen with weight exp(-confidence).
        gumbel = rng.gumbel(variants.confidence.shape, variants.confidence.device, generator)
        noise = torch.where(first[:, None], torch.zeros_like(gumbel), -gumbel)
        masked = least_confident(variants.confidence, rows_mask, options.remask_fraction, noise)
        variants = sampler.fill(variants, masked, condition, rows_mask, generator)
        variants.cosine = similarity(sampler, variants.tokens, rows_mask, rows_target)
        proposal = keep_best(variants, num)
        better = proposal.cosine > draft.cosine  # (B,)
        draft = Draft(
            torch.where(better[:, None], proposal.tokens, draft.tokens),
            torch.where(better[:, None], proposal.confidence, draft.confidence),
            torch.where(better, proposal.cosine, draft.cosine),
        )
    return draft
