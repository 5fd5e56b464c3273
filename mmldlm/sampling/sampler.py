"""Samplers: text from latents (l2t), latents from text (t2l), and both together (joint).

Every sampler walks a uniform time grid 1 = t_0 > t_1 > ... > t_N = 0 and calls the diffusions' own
`step` for each transition t_i -> t_{i+1} (N = num_steps for l2t and joint, latent_steps for t2l):
- text: starts fully masked at t = 1 (padding stays padding: the text length is given, see below)
  and ends with every position unmasked at t = 0 (`MaskedDiffusion.step`, float64 Gumbel, ancestral
  or in an order; `MaskedDiffusion.remasking_step` with ReMDM's remasking);
- latent: starts from N(0, I) at t = 1 in the standardised space and ends at the x0 estimate at
  t = 0 (`GaussianDiffusion.step`, DDIM or DDPM); results are returned de-standardised, in the
  sentence encoder's space.
In `joint` both streams move on the same grid (t_text = t_latent = t_i), which is inside the training
distribution since `joint` trains on independent times.

Length. The text has no end-of-text token and padding is never predicted (it is excluded from the
loss), so the caller fixes each text's length with `pad_mask` (True = a real position); the CLI takes
it from a source text or draws it from the validation split's lengths.

What the text sampler preserves, at temperature 1: were the model's conditionals exact, the
"ancestral", "margin" and "left_to_right" orders and posterior remasking would draw texts from the
model's distribution (exactly where each step reveals one token: positions revealed in one step are
drawn independently); the "confidence" order and the confidence remasking rounds are mode-seeking, as
they keep or remask tokens by the values drawn. tests/test_sampler_distribution.py measures both with
an exact denoiser on a toy distribution (docs/quality.md).

Classifier-free guidance (Ho & Salimans 2022) with scale w:
    guided = cond + w * (cond - uncond) = uncond + (1 + w) * (cond - uncond)
on the text logits (l2t) or the latent prediction (t2l). w = 0 is the unguided sampler exactly: the
unconditional pass is not even run. The unconditional input is what training substitutes when it
drops the condition (objective.cond_drop_prob): the learned null latent for l2t, fully masked text at
t_text = 1 for t2l. The joint sampler is unconditional and takes no guidance. (Some papers write the
same rule as uncond + s * (cond - uncond); their s = 1 + w.)

Self-conditioning (model.self_condition; Chen et al. 2022): in t2l and joint each step hands the
model the x0 estimate of the step before (none at the first step), as training did.

Reusing the model output (MDLM sec. 3.3.1, "caching"): in l2t the latent is fixed, so when a step
unmasks nothing the model's input tokens are unchanged and the next step reuses the previous logits.
MDLM's denoiser takes no time input, which makes this exact; ours sees t_text, but the optimal
denoiser of absorbing diffusion does not depend on t given the tokens (Ou et al. 2024,
arXiv:2406.03736), so the reuse only drops a dependence the model should not have. With many steps
per token most steps change nothing and are skipped; `reuse_output=False` turns it off.

The options are `SamplingOptions` (mmldlm/config.py), the one statement of each option's default, help
and range, from which the run config's sampler defaults and the options of `mmldlm sample` are made.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mmldlm import progress
from mmldlm.config import SamplingOptions
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion, rng
from mmldlm.errors import OptionError
from mmldlm.sampling import decoding
from mmldlm.sampling.decoding import Draft


def time_grid(num_steps: int, start: float = 1.0) -> list[tuple[float, float]]:
    """The (t, s) pairs of the reverse steps: start -> ... -> 0 in equal steps (float64 values)."""
    times = torch.linspace(start, 0.0, num_steps + 1, dtype=torch.float64).tolist()
    times[-1] = 0.0
    return list(zip(times[:-1], times[1:]))


def pad_mask_from_lengths(lengths, max_len: int | None = None) -> torch.Tensor:
    """(B,) lengths -> (B, L) bool, True on the first lengths[b] positions; L = max_len or max(lengths)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    L = int(max_len if max_len is not None else lengths.max())
    return torch.arange(L)[None, :] < lengths[:, None]


def length_masks(lengths: list[list[int]]) -> torch.Tensor:
    """Pad masks of candidate lengths: (B, L) for one length per text, (B, C, L) for C per text."""
    masks = pad_mask_from_lengths([n for row in lengths for n in row])  # (B * C, L)
    num = len(lengths[0])
    return masks if num == 1 else masks.view(len(lengths), num, -1)


class Sampler:
    """The three samplers for one model and its diffusions. `num_forward` counts model calls (one
    call may carry a conditional and an unconditional half), `num_encoded` the texts re-encoded.
    `reencode(tokens, pad_mask) -> latents (B, K, D)` in the encoder's space: the sentence encoder that
    made the training latents, needed by the decoding options that use it (decoding.py)."""

    def __init__(
        self,
        model,
        text: MaskedDiffusion,
        latent: GaussianDiffusion,
        options: SamplingOptions,
        reencode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        options.check()
        self.model, self.text, self.latent, self.options = model, text, latent, options
        self.reencode = reencode
        self.num_forward = self.num_encoded = 0
        if options.uses_encoder and reencode is None:
            raise OptionError(
                "sampling options 'best_of', 'correction_rounds', 'length_candidates'",
                (options.best_of, options.correction_rounds, options.length_candidates),
                "1, 0, 1: re-ranking and correction need the sentence encoder, and this sampler was given none",
            )
        if options.guidance_scale != 0 and getattr(model, "null_latent", None) is None:
            raise OptionError(
                "sampling option 'guidance_scale'",
                options.guidance_scale,
                "0: guidance needs the learned null latent, and this model was built with model.null_latent=false",
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- model calls -----------------------------------------------------------------------------

    def _model(
        self,
        tokens,
        latents,
        t_text,
        t_latent,
        pad_mask,
        latent_null=None,
        *,
        text_head: bool,
        latent_head: bool,
        self_cond: torch.Tensor | None = None,
    ):
        """The model on a batch; t_text and t_latent are numbers (the same for every row) or (B,) tensors;
        self_cond: the previous step's x0 estimate of the latent (None: none yet, or no self-conditioning)."""
        B = tokens.shape[0]
        self.num_forward += 1
        rows = lambda t: torch.as_tensor(t, dtype=torch.float32, device=tokens.device).expand(B)  # noqa: E731
        extra = {"latent_self_cond": self_cond} if self_cond is not None else {}
        return self.model(
            tokens,
            latents,
            rows(t_text),
            rows(t_latent),
            text_pad_mask=pad_mask,
            latent_null=latent_null,
            text_head=text_head,
            latent_head=latent_head,
            **extra,
        )

    def _self_cond(self, pred: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor | None:
        """The x0 estimate a self-conditioned model reads at the next step (None for other models)."""
        if not getattr(self.model.cfg, "self_condition", False):
            return None
        return self.latent.predict_x0_eps(pred, x, t)[0]

    def _guide(self, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        return cond + self.options.guidance_scale * (cond - uncond)

    def _text_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits -> what the text step samples from: tempered, and never padding (padding is not a
        training target at a real position, so its logit carries no information)."""
        logits = logits.float()
        if self.options.temperature != 1.0:
            logits = logits / self.options.temperature
        logits[..., self.text.pad_token_id] = float("-inf")
        return logits

    def _penalize_repeats(self, scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """scores (B, L, V) lowered by options.repetition_penalty for every token already revealed in
        the row (not the mask or padding)."""
        if self.options.repetition_penalty == 0:
            return scores
        present = torch.zeros(scores.shape[0], scores.shape[-1], dtype=torch.bool, device=scores.device)
        present.scatter_(1, tokens, True)  # (B, V)
        present[:, [self.text.mask_token_id, self.text.pad_token_id]] = False
        return scores - self.options.repetition_penalty * present[:, None, :].to(scores.dtype)

    def _l2t_logits(self, tokens, latents, t: float, pad_mask) -> torch.Tensor:
        """Text logits given the clean latent at text time t, guided when the scale is not 0."""
        if self.options.guidance_scale == 0:
            logits = self._model(tokens, latents, t, 0.0, pad_mask, text_head=True, latent_head=False).text_logits
            return self._text_scores(logits)
        B = tokens.shape[0]
        null = torch.arange(2 * B, device=tokens.device) >= B  # second half: the null latent
        logits = self._model(
            tokens.repeat(2, 1),
            latents.repeat(2, 1, 1),
            t,
            0.0,
            pad_mask.repeat(2, 1),
            latent_null=null,
            text_head=True,
            latent_head=False,
        ).text_logits
        cond, uncond = logits.float().chunk(2)
        return self._text_scores(self._guide(cond, uncond))

    def _t2l_prediction(self, tokens, x, t: float, pad_mask, self_cond=None) -> torch.Tensor:
        """Latent prediction given the clean text at latent time t, guided when the scale is not 0."""
        if self.options.guidance_scale == 0:
            pred = self._model(
                tokens, x, 0.0, t, pad_mask, text_head=False, latent_head=True, self_cond=self_cond
            ).latent
            return pred.float()
        B = tokens.shape[0]
        hidden = tokens.masked_fill(pad_mask, self.text.mask_token_id)  # "no text": every real token masked
        t_text = (torch.arange(2 * B, device=tokens.device) >= B).float()  # the masked half is at t = 1
        pred = self._model(
            torch.cat([tokens, hidden]),
            x.repeat(2, 1, 1),
            t_text,
            t,
            pad_mask.repeat(2, 1),
            text_head=False,
            latent_head=True,
            self_cond=None if self_cond is None else self_cond.repeat(2, 1, 1),
        ).latent
        cond, uncond = pred.float().chunk(2)
        return self._guide(cond, uncond)

    # --- samplers --------------------------------------------------------------------------------

    def _start_text(self, pad_mask: torch.Tensor) -> torch.Tensor:
        """Fully masked text (t = 1) with padding where pad_mask is False."""
        return torch.where(pad_mask, self.text.mask_token_id, self.text.pad_token_id).long()

    def _start_confidence(self, pad_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) float64: -inf at the masked real positions (nothing drawn yet), +inf at padding."""
        inf = torch.full(pad_mask.shape, float("inf"), dtype=torch.float64, device=pad_mask.device)
        return torch.where(pad_mask, -inf, inf)

    def _start_latent(self, batch_size: int, generator) -> torch.Tensor:
        K, D = self.model.cfg.num_latents, self.model.cfg.latent_dim
        return rng.normal((batch_size, K, D), self.device, generator)

    def _reveal(self, draft: Draft, latents, pad_mask, grid, generator) -> Draft:
        """Unmask every masked position of the draft along `grid` given clean standardised latents
        (B, K, D); each revealed token's log-probability when drawn becomes its confidence."""
        tokens, confidence = draft.tokens, draft.confidence.clone()
        logits = None
        for t, s in grid:
            if logits is None or not self.options.reuse_output:
                logits = self._l2t_logits(tokens, latents, t, pad_mask)
            scores = self._penalize_repeats(logits, tokens)
            new = self._text_step(scores, tokens, t, s, generator)
            if self._record_confidence(confidence, scores, tokens, new):
                logits = None  # the input changed: the next step needs a fresh model output
            tokens = new
            progress.step()
        return Draft(tokens, confidence)

    def _text_step(self, scores, tokens, t: float, s: float, generator) -> torch.Tensor:
        """One reverse step of the text from t to s: the strategy's, or ReMDM's remasking posterior."""
        if self.options.remask == "posterior":
            return self.text.remasking_step(scores, tokens, t, s, self.options.remask_cap, generator)
        return self.text.step(scores, tokens, t, s, generator, self.options.strategy)

    def _record_confidence(self, confidence, scores, tokens, new) -> bool:
        """Write the log-probability of each token revealed between `tokens` and `new` (B, L) into
        `confidence` (B, L) (-inf where the posterior masked a token again); whether any changed."""
        revealed = new != tokens
        if not revealed.any():
            return False
        confidence[revealed] = self.text.log_x0(scores[revealed]).gather(-1, new[revealed][:, None])[:, 0]
        return True

    def planned_steps(self, pad_mask: torch.Tensor, mode: str) -> int:
        """Reverse steps one call of `mode` walks for texts of pad_mask (B, L) or (B, C, L), what a progress
        bar counts (mmldlm/progress.py): the trajectory, then one step per re-sampled position in each
        remasking (l2t) and correction round, of the longest text."""
        options = self.options
        if mode == "t2l":
            return 1 if options.latent_sampler == "mean" else options.latent_steps or options.num_steps
        longest = int(pad_mask.sum(dim=-1).max()) if pad_mask.numel() else 0
        per_round = max(1, math.ceil(longest * options.remask_fraction))
        rounds = options.correction_rounds + (options.remask_rounds if mode == "l2t" else 0)
        return options.num_steps + rounds * per_round

    def write(self, latents: torch.Tensor, pad_mask: torch.Tensor, generator=None) -> Draft:
        """Text for clean standardised latents (B, K, D) from fully masked: the reverse trajectory, then
        the remasking rounds (decoding.py)."""
        start = Draft(self._start_text(pad_mask), self._start_confidence(pad_mask))
        draft = self._reveal(start, latents, pad_mask, time_grid(self.options.num_steps), generator)
        return decoding.remask_rounds(self, draft, latents, pad_mask, generator)

    def fill(self, draft: Draft, masked: torch.Tensor, latents, pad_mask, generator=None) -> Draft:
        """The draft with the positions of `masked` (B, L) re-sampled given the rest: one step per
        masked position from the time at which that share of the text is masked."""
        num = int(masked.sum(dim=1).max())
        if num == 0:
            return draft
        share = float((masked.sum(dim=1) / pad_mask.sum(dim=1).clamp_min(1)).max())  # t of that much masking
        start = Draft(draft.tokens.masked_fill(masked, self.text.mask_token_id), draft.confidence)
        return self._reveal(start, latents, pad_mask, time_grid(num, start=share), generator)

    @torch.no_grad()
    def l2t(
        self, latents: torch.Tensor, pad_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Text tokens (B, L) for latents (B, K, D) in encoder space; pad_mask (B, L) fixes the lengths,
        or (B, C, L) offers C lengths per latent, of which the sentence encoder picks one (the returned
        text is padding beyond it). Best-of-N and the correction rounds are no-ops unless asked for
        (decoding.py)."""
        if pad_mask.dim() == 3 and self.reencode is None:
            raise ValueError("Sampler.l2t: several candidate lengths per latent need the sentence encoder")
        pad_mask = pad_mask.to(self.device)
        target = latents.to(self.device, torch.float32)
        with progress.share(target.shape[0], self.planned_steps(pad_mask, "l2t")):
            draft = decoding.best_of(self, target, pad_mask, generator)
            return decoding.correction_rounds(self, draft, target, generator).tokens

    @torch.no_grad()
    def t2l(
        self, tokens: torch.Tensor, pad_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Latents (B, K, D) in encoder space for text tokens (B, L) (padding where pad_mask is False);
        with latent_sampler "mean" the posterior mean (one step from t = 1, whose x0 estimate it is)."""
        tokens, pad_mask = tokens.to(self.device), pad_mask.to(self.device)
        x = self._start_latent(tokens.shape[0], generator)  # (B, K, D) at t = 1
        x0 = None
        posterior_mean = self.options.latent_sampler == "mean"
        steps = 1 if posterior_mean else self.options.latent_steps or self.options.num_steps
        with progress.share(tokens.shape[0], self.planned_steps(pad_mask, "t2l")):
            for t, s in self.latent.time_grid(steps, self.options.latent_shift):
                pred = self._t2l_prediction(tokens, x, t, pad_mask, x0)
                x0 = self._self_cond(pred, x, t)
                x = self.latent.step(
                    pred, x, t, s, "ddim" if posterior_mean else self.options.latent_sampler, generator
                )
                progress.step()
        return self.latent.destandardize(x)

    def _sampled_latent_sampler(self) -> str:
        """The latent sampler of joint generation: "ddim" or "ddpm"; OptionError for "mean", which has no
        text to take the mean given."""
        if self.options.latent_sampler == "mean":
            raise OptionError(
                "sampling option 'latent_sampler'",
                "mean",
                "'ddim' or 'ddpm' for joint generation ('mean' is t2l's posterior mean given a text)",
            )
        return self.options.latent_sampler

    @torch.no_grad()
    def latent_prior(self, pad_mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Latents (B, K, D) in encoder space sampled with no text but its length: the latent stream
        reads fully masked text of the lengths of pad_mask (B, L) at t_text = 1 (what training shows it
        in joint at t_text = 1 and when it drops the text of t2l), num_steps reverse steps from noise."""
        pad_mask = pad_mask.to(self.device)
        sampler = self._sampled_latent_sampler()
        hidden = self._start_text(pad_mask)
        x = self._start_latent(pad_mask.shape[0], generator)
        x0 = None
        for t, s in self.latent.time_grid(self.options.num_steps, self.options.latent_shift):
            pred = self._model(hidden, x, 1.0, t, pad_mask, text_head=False, latent_head=True, self_cond=x0).latent
            x0 = self._self_cond(pred.float(), x, t)
            x = self.latent.step(pred.float(), x, t, s, sampler, generator)
        return self.latent.destandardize(x)

    def write_joint(self, pad_mask: torch.Tensor, generator=None) -> tuple[Draft, torch.Tensor]:
        """One joint trajectory: (the text's Draft, latents (B, K, D) in encoder space)."""
        sampler = self._sampled_latent_sampler()
        tokens = self._start_text(pad_mask)
        confidence = self._start_confidence(pad_mask)
        x = self._start_latent(tokens.shape[0], generator)
        x0 = None
        # The text and the latent take the same number of steps, each on its own grid (training noises
        # them at independent times in joint mode).
        latent_grid = self.latent.time_grid(self.options.num_steps, self.options.latent_shift)
        for (t, s), (t_lat, s_lat) in zip(time_grid(self.options.num_steps), latent_grid):
            logits, pred, _ = self._model(tokens, x, t, t_lat, pad_mask, text_head=True, latent_head=True, self_cond=x0)
            scores = self._penalize_repeats(self._text_scores(logits), tokens)
            new = self._text_step(scores, tokens, t, s, generator)
            self._record_confidence(confidence, scores, tokens, new)
            tokens = new
            x0 = self._self_cond(pred.float(), x, t_lat)
            x = self.latent.step(pred.float(), x, t_lat, s_lat, sampler, generator)
            progress.step()
        return Draft(tokens, confidence), self.latent.destandardize(x)

    @torch.no_grad()
    def joint(
        self, pad_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unconditional (text tokens (B, L), latents (B, K, D) in encoder space) with the given lengths.
        Best-of-N keeps the pair whose text re-encodes closest to its own latent, and the correction
        rounds move the text towards that latent (decoding.py); no-ops unless asked for."""
        pad_mask = pad_mask.to(self.device)
        with progress.share(pad_mask.shape[0], self.planned_steps(pad_mask, "joint")):
            draft, latents = decoding.best_joint(self, pad_mask, generator)
            return decoding.correction_rounds(self, draft, latents, generator).tokens, latents
