"""The training objective: which direction a step trains, how its times are drawn, and the loss.

| mode  | text stream              | latent stream                       | heads  |
|-------|--------------------------|-------------------------------------|--------|
| l2t   | masked at t_text ~ p(t)  | clean, t_latent = 0                 | text   |
| t2l   | clean, t_text = 0        | noised at t_latent ~ p(t)           | latent |
| joint | masked at t_text ~ p(t)  | noised at an independent t_latent   | both   |

p(t) is cfg.t_sampling over [0, 1]; the same t is what the model is told (t_text, t_latent). Text
times below text_diffusion.eps are moved to eps (`MaskedDiffusion.bound_time`: those rows pay the
bound's reconstruction term).

Only the output head of the stream that is not generated is idle (it is not computed, so its
parameters get no gradient); both input encoders always train, so the condition is learned.

Classifier-free guidance: with prob cond_drop_prob a row's condition is replaced by "no condition":
in l2t the latent by the model's learned null latent (latent_null=True), in t2l the text by fully
masked text at t_text = 1 (the text stream's own "nothing known" state: no extra parameters). A
sampler asks for the unconditional prediction the same way.

Self-conditioning (Chen et al. 2022, "Analog Bits", sec. 3.2; with model.self_condition): in the
modes that noise the latent, on a share self_condition_prob of the steps a first pass without
gradient estimates x0, and the trained pass reads that estimate beside x_t; on the other steps it
reads zeros, which is what a sampler's first step sees. A sampler feeds each step the x0 estimate
of the step before.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from mmldlm.config import MODES, ObjectiveConfig
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion, rng
from mmldlm.diffusion.masked import pad_rows
from mmldlm.model.mmdit import ModelOutput, Packing

HOST = torch.device("cpu")  # where the step's random draws and the decisions that follow them are made


class NoisedInputs(NamedTuple):
    """What the model reads in one training step (`Objective._noised_inputs`)."""

    text: torch.Tensor  # (B, L) tokens, masked where the text is generated or its condition dropped
    latent: torch.Tensor  # (B, K, D) standardised latents, noised where the latent is generated
    t_text: torch.Tensor  # (B,)
    t_latent: torch.Tensor  # (B,)
    latent_null: torch.Tensor | None  # (B,) bool: rows whose latent condition is dropped (l2t)
    noise: torch.Tensor | None  # (B, K, D): the Gaussian noise of the latent, where it is generated
    rows: torch.Tensor | None  # (N,) int64: the masked real positions (flat B * L), where the text is generated
    # With text_row_buckets: rows filled up to a fixed count, True at the masked positions (`pad_rows`),
    # and how many those are (a host int); None otherwise.
    valid: torch.Tensor | None = None
    num_masked: int | None = None


class Objective:
    """Loss of one micro-batch in the mode of its step; see the module docstring."""

    def __init__(
        self,
        cfg: ObjectiveConfig,
        text: MaskedDiffusion,
        latent: GaussianDiffusion,
        self_condition: bool = False,
        length_head: bool = False,
        per_sample: bool = False,
        fused_text_loss: bool = False,
        text_row_buckets: int | None = None,
    ):
        self.cfg = cfg
        # perf.fused_text_loss: the model's text head fused with its loss (no (N, V) logits in training)
        self.fused_text_loss = fused_text_loss
        # perf.text_row_buckets: the text head's rows filled up to a multiple of the batch's text
        # positions / text_row_buckets, so that they take a few counts (None: exactly the masked ones)
        self.text_row_buckets = text_row_buckets
        # Evaluation: the text ELBO and latent loss of each sample as metrics too (mmldlm/evaluation/evaluate.py).
        self.per_sample = per_sample
        self.text = text
        self.latent = latent
        # What the model has (model.self_condition, model.length_head): whether to feed and train them.
        self.self_condition = self_condition
        self.length_head = length_head
        # random mode: only modes with a positive weight can be drawn
        drawable = [(m, float(cfg.mode_weights.get(m, 0.0))) for m in MODES]
        self._random_modes = [m for m, w in drawable if w > 0]
        self._random_cum = np.cumsum([w for _, w in drawable if w > 0])

    # --- which direction -------------------------------------------------------------------------

    def mode_at(self, step: int) -> str:
        """The mode of training step `step`: a pure function of (cfg, step), the same on every rank
        and untouched by (and not touching) any global RNG."""
        mode = self.cfg.mode
        if mode in MODES:
            return mode
        if mode == "sequential":
            current = self.cfg.mode_schedule[0][1]
            for first_step, name in self.cfg.mode_schedule:
                if step >= first_step:
                    current = name
            return current
        # random: a draw from its own stream seeded by (seed, step)
        u = np.random.default_rng([self.cfg.seed, step]).random() * self._random_cum[-1]
        return self._random_modes[int(np.searchsorted(self._random_cum, u, side="right"))]

    # --- times -----------------------------------------------------------------------------------

    def sample_t(self, batch_size: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B,) diffusion times in [0, 1] drawn by cfg.t_sampling:
        uniform: i.i.d. U(0, 1); antithetic: u and 1 - u in pairs; stratified: (i + u_i) / B for a
        random assignment of strata i to rows (one time per stratum: lower-variance batch loss)."""
        B = batch_size
        if self.cfg.t_sampling == "uniform":
            return rng.uniform(B, device, generator)
        if self.cfg.t_sampling == "antithetic":
            u = rng.uniform((B + 1) // 2, device, generator)
            return torch.cat([u, 1.0 - u])[:B]
        strata = rng.permutation(B, device, generator).float()
        return (strata + rng.uniform(B, device, generator)) / B

    # --- loss ------------------------------------------------------------------------------------

    def __call__(
        self,
        model,
        batch: dict,
        step: int,
        generator: torch.Generator | None = None,
        t_text: torch.Tensor | None = None,
    ):
        """(loss, metrics) for one micro-batch at training step `step`; `t_text` (B,) the text's times in
        [0, 1] instead of drawing them by cfg.t_sampling (evaluation's importance-sampled times).

        batch: tokens (B, L) int64, pad_mask (B, L) bool (True = real, a prefix of each row), latents
        (B, K, D) raw encoder space; with data.packing also the packed layout the model's blocks run on
        (mmldlm/model/mmdit.py `Packing`): noise, losses and metrics are those of the padded batch
        either way; text_lengths, each row's real tokens as host ints (the trainer adds them: without
        them they are read from the device). Every random draw, and what follows from it (which tokens
        are masked, where the text head runs), is made on the host with `generator` (a CPU generator;
        None: the CPU's global RNG), so that the step never waits for the device.
        metrics (detached tensors, and `mode` a str): loss, and for the active heads only
        text: text_loss (NELBO nats/token or masked CE, per text cfg), accuracy, num_masked (an int),
        num_tokens; latent: latent_loss; with `per_sample` also nats_per_sample, num_tokens_per_sample and
        latent_loss_per_sample (B,); length head (every mode): length_loss, length_accuracy. Keys of an idle
        head are absent.
        """
        mode = self.mode_at(step)
        tokens, pad_mask, packing = batch["tokens"], batch.get("pad_mask"), Packing.from_batch(batch)
        latents = self.latent.standardize(batch["latents"])  # (B, K, D)
        text_on, latent_on = mode in ("l2t", "joint"), mode in ("t2l", "joint")
        real = host_pad_mask(batch)  # (B, L)
        x = self._noised_inputs(mode, text_on, latent_on, tokens, pad_mask, real, latents, generator, t_text)

        # A padded batch's call is the plain one; the host's text lengths let the attention skip padding.
        layout = {"packing": packing} if packing is not None else {}
        if pad_mask is not None:
            layout["text_lengths"] = tuple(real.sum(dim=1).tolist())
        self_cond = None
        if self.self_condition and latent_on and rng.uniform(1, HOST, generator).item() < self.cfg.self_condition_prob:
            self_cond = self._self_condition_estimate(model, x, pad_mask, layout)

        extra = {"latent_self_cond": self_cond} if self.self_condition else {}
        if self.length_head:
            extra["length_from"] = latents  # every step, from the clean latents
        if self.fused_text_loss and text_on and x.rows is not None:
            extra["text_targets"] = self.text.loss_targets(tokens, x.t_text, x.rows, x.valid)
        out = model(
            x.text,
            x.latent,
            x.t_text,
            x.t_latent,
            text_pad_mask=pad_mask,
            latent_null=x.latent_null,
            text_head=text_on,
            latent_head=latent_on,
            text_rows=x.rows,  # the text head runs only where the loss reads it: the masked real positions
            **layout,
            **extra,
        )
        return self._loss_and_metrics(mode, text_on, latent_on, out, tokens, pad_mask, latents, x)

    def _noised_inputs(
        self,
        mode: str,
        text_on: bool,
        latent_on: bool,
        tokens: torch.Tensor,
        pad_mask: torch.Tensor | None,
        real: torch.Tensor,
        latents: torch.Tensor,
        generator: torch.Generator | None,
        given_t_text: torch.Tensor | None = None,
    ) -> NoisedInputs:
        """The model's inputs in `mode`: each generated stream noised at times drawn by cfg.t_sampling
        (the text's at `given_t_text` where given), the other clean at time 0, and the condition dropped
        as cond_drop_prob says. Drawn on the host, `real` (B, L) the host's pad mask; then moved."""
        (B, L), device = tokens.shape, tokens.device
        t_text, t_latent = torch.zeros(B), torch.zeros(B)
        masked = noise = rows = valid = num_masked = None
        if text_on:
            drawn = self.sample_t(B, HOST, generator) if given_t_text is None else given_t_text.to(HOST)
            t_text = self.text.bound_time(drawn)
            masked = self.text.draw_masked(t_text, (B, L), HOST, generator) & real
            rows = masked.flatten().nonzero().squeeze(1)  # (N,) on the host: no read-back
            if self.text_row_buckets:
                num_masked = rows.shape[0]
                rows, valid = pad_rows(rows, -(-B * L // self.text_row_buckets))
        if latent_on:
            t_latent = self.sample_t(B, HOST, generator)
            noise = rng.normal(latents.shape, HOST, generator, dtype=latents.dtype)  # (B, K, D)
        drop = self._draw_condition_drop(mode, B, generator)  # (B,) bool or None
        if mode == "t2l" and drop is not None:
            t_text = drop.float()  # all masked = time 1

        hide = None
        if mode == "t2l" and drop is not None:
            hide = drop[:, None] & real  # (B, L): every real token of a dropped row
        # Every draw to the device in one copy: the host never waits for it (rng.to_device_together).
        masked, rows, valid, noise, t_text, t_latent, drop, hide = rng.to_device_together(
            [masked, rows, valid, noise, t_text, t_latent, drop, hide], device
        )
        text_in, latent_in, latent_null = tokens, latents, None
        if text_on:
            text_in = tokens.masked_fill(masked, self.text.mask_token_id)  # (B, L)
        if latent_on:
            latent_in = self.latent.add_noise(latents, t_latent, noise)
        if mode == "l2t" and drop is not None:
            latent_null = drop
        if hide is not None:
            text_in = tokens.masked_fill(hide, self.text.mask_token_id)
        return NoisedInputs(text_in, latent_in, t_text, t_latent, latent_null, noise, rows, valid, num_masked)

    def _draw_condition_drop(self, mode: str, batch_size: int, generator: torch.Generator | None):
        """Classifier-free guidance: (B,) bool on the host, the rows whose condition is replaced by "no
        condition" (prob cond_drop_prob; l2t: the null latent; t2l: all text masked at time 1); None
        where nothing is dropped in this mode."""
        if mode not in ("l2t", "t2l") or self.cfg.cond_drop_prob <= 0:
            return None
        return rng.uniform(batch_size, HOST, generator) < self.cfg.cond_drop_prob

    def _self_condition_estimate(
        self, model, x: NoisedInputs, pad_mask: torch.Tensor | None, layout: dict
    ) -> torch.Tensor:
        """(B, K, D) the x0 estimate of a first pass without gradient, which the trained pass reads beside x_t."""
        with torch.no_grad():
            first = model(
                x.text,
                x.latent,
                x.t_text,
                x.t_latent,
                text_pad_mask=pad_mask,
                latent_null=x.latent_null,
                text_head=False,
                latent_head=True,
                **layout,
            ).latent
            self_cond, _ = self.latent.predict_x0_eps(first.float(), x.latent, x.t_latent)
        return self_cond

    def _loss_and_metrics(
        self,
        mode: str,
        text_on: bool,
        latent_on: bool,
        out: ModelOutput,
        tokens: torch.Tensor,
        pad_mask: torch.Tensor | None,
        latents: torch.Tensor,
        x: NoisedInputs,
    ) -> tuple[torch.Tensor, dict]:
        """The weighted sum of the active heads' losses, and the metrics `__call__` documents."""
        metrics: dict = {"mode": mode}
        loss = 0.0
        if text_on:
            text_loss, text_metrics = self.text.loss(
                out.text_logits,
                tokens,
                x.text,
                x.t_text,
                pad_mask,
                per_sample=self.per_sample,
                rows=x.rows,
                valid=x.valid,
                num_masked=x.num_masked,
            )
            loss = loss + self.cfg.text_loss_weight * text_loss
            metrics["text_loss"] = text_loss.detach()
            metrics.update(text_metrics)
        if latent_on:
            latent_loss = self.latent.loss(out.latent, latents, x.noise, x.t_latent)
            loss = loss + self.cfg.latent_loss_weight * latent_loss
            metrics["latent_loss"] = latent_loss.detach()
            if self.per_sample:
                metrics["latent_loss_per_sample"] = self._latent_loss_per_sample(out.latent, latents, x)
        if self.length_head:
            length_loss, length_accuracy = length_loss_and_accuracy(out.length_logits, tokens, pad_mask)
            loss = loss + self.cfg.length_loss_weight * length_loss
            metrics.update(length_loss=length_loss.detach(), length_accuracy=length_accuracy)
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _latent_loss_per_sample(self, prediction: torch.Tensor, latents: torch.Tensor, x: NoisedInputs) -> torch.Tensor:
        """(B,) each sample's latent loss on its own: B small calls, no model forward."""
        return torch.stack(
            [
                self.latent.loss(prediction[i : i + 1], latents[i : i + 1], x.noise[i : i + 1], x.t_latent[i : i + 1])
                for i in range(latents.shape[0])
            ]
        ).detach()


def host_pad_mask(batch: dict) -> torch.Tensor:
    """(B, L) bool on the host, True = real token: from the batch's `text_lengths` (host ints; the
    loader pads each text at its end) where given, else its pad_mask read from the device (a read-back);
    every position without either."""
    B, L = batch["tokens"].shape
    if batch.get("text_lengths") is not None:
        return torch.arange(L) < torch.tensor(batch["text_lengths"])[:, None]
    if batch.get("pad_mask") is not None:
        return batch["pad_mask"].cpu()
    return torch.ones(B, L, dtype=torch.bool)


def text_lengths(tokens: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
    """(B,) int64: the real tokens of each row."""
    if pad_mask is None:
        return torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
    return pad_mask.sum(dim=1)


def length_loss_and_accuracy(
    length_logits: torch.Tensor, tokens: torch.Tensor, pad_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the length head's (B, max_seq_len) logits over lengths 1..max_seq_len against the
    batch's text lengths, and the accuracy of its argmax (detached)."""
    target = text_lengths(tokens, pad_mask).clamp(1, length_logits.shape[1]) - 1  # (B,) class index
    logits = length_logits.float()
    loss = F.cross_entropy(logits, target)
    with torch.no_grad():
        accuracy = (logits.argmax(dim=1) == target).float().mean()
    return loss, accuracy
