"""Masked (absorbing-state) diffusion over tokens: MDLM, Sahoo et al. 2024, "Simple and Effective
Masked Diffusion Language Models" (arXiv:2406.07524). Equation numbers refer to that paper.

Time t runs from 0 (clean text) to 1 (all masked). Each real token of x is, independently, still
itself at time t with probability alpha_t and the mask token otherwise (eq. 2 with the absorbing
prior pi = m); padding is never masked.

Schedules (alpha_0 = 1 exactly, alpha_1 = eps: a sliver of signal remains at t = 1, as in MDLM):
- loglinear: alpha_t = 1 - (1 - eps) t, i.e. sigma_t = -log(1 - (1 - eps) t)    (MDLM LogLinearNoise)
- linear:    sigma_t = sigma_max t with sigma_max = -log(eps), i.e. alpha_t = eps^t  (MDLM LinearNoise)

SUBS parameterisation (sec. 3.2.3): the denoiser never predicts the mask token (its logit is -inf)
and copies unmasked inputs, so only masked positions carry loss. The continuous-time negative ELBO
(eq. 11) is

    NELBO = E_t E_q [ -alpha'_t / (1 - alpha_t) * sum_{masked i} -log p_theta(x_i | z_t) ],

which with loglinear is a 1/t weight on the masked cross-entropy. `loss` returns it in nats per real
(non-pad) token: the weighted cross-entropy summed over masked non-pad tokens of the batch, divided
by the number of non-pad tokens of the batch (MDLM's reported NLL per token; eval reuses it).

A true upper bound on -log p(x | L) (Sohl-Dickstein et al. 2015, eq. 14: prior + diffusion +
reconstruction) needs the two ends of the integral as well:
- t in (0, eps): the reverse process ends with one jump from z_eps to x, each masked token drawn from
  x_theta (what the sampler's last step does). Its cost, the reconstruction term
  E_q[sum_{masked at eps} -log x_theta(x_i | z_eps)], is estimated by the times drawn below eps:
  `bound_time` moves them to eps and `elbo_weight` gives them weight 1 / eps (their probability is
  eps), so E_t over U(0, 1) is the integral over (eps, 1) plus the reconstruction term, unbiased and
  with finite variance (the plain weight 1/t is unbiased too, but its variance diverges at t = 0).
- t = 1: alpha_1 = eps, so a token is still itself at t = 1 with prob eps and the diffusion term
  never pays for it. The prior p(z_1) that matches it keeps each position masked with prob 1 - eps
  and otherwise shows a token drawn uniformly from the V - 1 that are not the mask; its KL to
  q(z_1 | x) is eps * log(V - 1) per real token (`prior_nats_per_token`).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from mmldlm.config import TextDiffusionConfig
from mmldlm.device import autocast_off, compute_dtype
from mmldlm.diffusion import rng


def pad_rows(rows: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (N,) int64 filled up to the next multiple of `step` (one step at least) with position 0,
    and (N',) bool, True at the given rows: the text head and its loss then see a few row counts (each
    a fixed graph: compiled, CUDA graphs), the filling rows weighted 0 (`MaskedDiffusion.loss`' valid)."""
    count = max(1, -(-rows.shape[0] // step)) * step
    filled = torch.zeros(count, dtype=rows.dtype, device=rows.device)
    filled[: rows.shape[0]] = rows
    return filled, torch.arange(count, device=rows.device) < rows.shape[0]


def _per_row(t, batch_size: int, device, dtype=torch.float64) -> torch.Tensor:
    """A time given as a number, a 0-d or a (B,) tensor -> (B,) tensor."""
    t = torch.as_tensor(t, device=device, dtype=dtype)
    return t.expand(batch_size) if t.dim() == 0 else t.to(dtype)


def _gumbel_argmax(scores: torch.Tensor, generator) -> torch.Tensor:
    """argmax(scores + Gumbel noise) over the last dim, in float64 (rng.gumbel says why)."""
    return (scores.double() + rng.gumbel(scores.shape, scores.device, generator)).argmax(dim=-1)


class _SubsCrossEntropy(torch.autograd.Function):
    """`subs_cross_entropy`: forward keeps the float32 log-probabilities, backward writes the gradient
    softmax - one-hot from them in one new tensor (autograd's chain of the same, a float32 copy, a
    column fill, log_softmax and nll_loss, materialises (N, V) twice more each way)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, excluded: int):
        z = logits.float()
        z = z.clone() if z is logits else z  # its own copy: the column below is written
        z[:, excluded] = float("-inf")
        log_probs = torch.log_softmax(z, dim=-1)  # (N, V)
        del z
        ce = -log_probs.gather(1, targets[:, None]).squeeze(1)  # (N,)
        predicted = log_probs.argmax(dim=-1)
        ctx.mark_non_differentiable(predicted)
        ctx.save_for_backward(log_probs, targets)
        ctx.logits_dtype = logits.dtype
        return ce, predicted

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ce: torch.Tensor, _grad_predicted):
        log_probs, targets = ctx.saved_tensors
        grad = log_probs.exp()  # softmax; 0 at the excluded column
        grad.scatter_add_(1, targets[:, None], torch.full_like(targets[:, None], -1.0, dtype=grad.dtype))
        grad.mul_(grad_ce[:, None])
        return grad.to(ctx.logits_dtype), None, None


def subs_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, excluded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy in float32 of logits (N, V) (any float dtype) against targets (N,) with the column
    `excluded` never predicted (SUBS: the mask token's logit is -inf), and the argmax of each row, (N,)
    each: F.cross_entropy of `logits.float().index_fill(-1, excluded, -inf)` and its argmax, forward and
    backward, in two (N, V) float32 tensors where autograd's chain makes four (docs/benchmarks.md)."""
    return _SubsCrossEntropy.apply(logits, targets, excluded)


class TextTargets(NamedTuple):
    """What the text head fused with its loss needs besides its input (`subs_linear_cross_entropy`)."""

    tokens: torch.Tensor  # (N,) int64: the clean token at each row
    weights: torch.Tensor  # (N,) float32: each row's weight in the summed loss
    excluded: int  # the column never predicted (SUBS: the mask token)


class TextLoss(NamedTuple):
    """The text head fused with its loss (`subs_linear_cross_entropy`): no logits, only what the loss
    and its metrics read."""

    weighted: torch.Tensor  # () float32: sum of row_weights * ce, the one differentiable output
    ce: torch.Tensor  # (N,) float32, detached: each row's cross-entropy
    predicted: torch.Tensor  # (N,) int64: each row's argmax


# Rows per chunk of `subs_linear_cross_entropy`: as many as keep a chunk's float32 logits at 128 MiB
# (1,099 rows of a 30,522-token vocabulary, 4,096 of the bundled 8,192).
CHUNK_ELEMENTS = 1 << 25


class _SubsLinearCrossEntropy(torch.autograd.Function):
    """`subs_linear_cross_entropy`. Forward computes, chunk by chunk of rows, the logits, their
    cross-entropy and argmax and at once the gradient of the weighted sum with respect to x, the weight
    and the prior table; backward only scales those by the incoming gradient (a scalar). The (N, V)
    logits exist one chunk at a time, where the head followed by `subs_cross_entropy` keeps two (N, V)
    float32 tensors and one in the products' dtype alive together."""

    @staticmethod
    def forward(ctx, x, weight, prior, doc, targets, row_weights, excluded, dtype, chunk_rows):
        N = x.shape[0]
        need_x, need_w, need_prior = ctx.needs_input_grad[:3]  # all False under no_grad
        with autocast_off(x.device.type):
            xc, wc = x.to(dtype), weight.to(dtype)
            grad_prior = torch.zeros(prior.shape, device=x.device, dtype=torch.float32) if need_prior else None
            ce, predicted, grad_x, grad_w = [], [], [], None
            for start in range(0, max(N, 1), chunk_rows):
                x_rows = xc[start : start + chunk_rows]
                z = torch.mm(x_rows, wc.T).float()  # (n, V)
                if prior is not None:
                    z += prior.index_select(0, doc[start : start + chunk_rows])
                z[:, excluded] = float("-inf")
                lse = torch.logsumexp(z, dim=-1)  # (n,)
                target = targets[start : start + chunk_rows, None]
                ce.append(lse - z.gather(1, target).squeeze(1))
                predicted.append(z.argmax(dim=-1))
                if not (need_x or need_w or need_prior):
                    continue
                # d(sum w ce)/dz = w (softmax - one-hot), in place of the logits; 0 at the excluded column
                z.sub_(lse[:, None]).exp_()
                z.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=z.dtype))
                z.mul_(row_weights[start : start + chunk_rows, None])
                if need_prior:
                    grad_prior.index_add_(0, doc[start : start + chunk_rows], z)
                g = z.to(dtype)
                del z
                if need_x:
                    grad_x.append(torch.mm(g, wc))
                if need_w:
                    product = torch.mm(g.T, x_rows).float()
                    grad_w = product if grad_w is None else grad_w.add_(product)
            ce, predicted = (torch.cat(t) if len(t) > 1 else t[0] for t in (ce, predicted))
            grad_x = (torch.cat(grad_x) if len(grad_x) > 1 else grad_x[0]) if need_x else None
            weighted = (ce * row_weights).sum()
        ctx.save_for_backward(grad_x, grad_w, grad_prior)
        ctx.dtypes = x.dtype, weight.dtype
        ctx.mark_non_differentiable(ce, predicted)
        return weighted, ce, predicted

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_weighted, _grad_ce, _grad_predicted):
        grad_x, grad_w, grad_prior = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # a 0-d float32 factor keeps each gradient's dtype
        grad_x = (grad_x * grad_weighted).to(x_dtype) if grad_x is not None else None
        grad_w = (grad_w * grad_weighted).to(w_dtype) if grad_w is not None else None
        grad_prior = grad_prior * grad_weighted if grad_prior is not None else None
        return grad_x, grad_w, grad_prior, None, None, None, None, None, None


def subs_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    excluded: int,
    prior: torch.Tensor | None = None,
    doc: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    chunk_rows: int | None = None,
) -> TextLoss:
    """The head x (N, H) @ weight (V, H).T (+ prior.index_select(0, doc): prior (B, V) float32, doc (N,)
    the row of each), SUBS cross-entropy against targets (N,) with the column `excluded` never predicted,
    weighted by row_weights (N,) float32 and summed: `subs_cross_entropy` of the head's logits, without
    the (N, V) logits (`_SubsLinearCrossEntropy`). Products in `dtype` (autocast's, else x's) with
    float32 softmax; rows of weight 0 give no gradient (padding rows: any target but `excluded`)."""
    V = weight.shape[0]
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS // V)
    if dtype is None:
        dtype = compute_dtype(x)
    if prior is not None and doc is None:
        raise ValueError("subs_linear_cross_entropy: a prior table needs doc, the row of each of x's rows")
    weighted, ce, predicted = _SubsLinearCrossEntropy.apply(
        x, weight, prior, doc, targets, row_weights.float(), excluded, dtype, chunk_rows
    )
    return TextLoss(weighted, ce, predicted)


class MaskedDiffusion:
    """MDLM forward process, loss and ancestral sampling step."""

    def __init__(self, cfg: TextDiffusionConfig, mask_token_id: int, pad_token_id: int):
        if mask_token_id == pad_token_id:
            raise ValueError(
                f"MaskedDiffusion: mask_token_id and pad_token_id are both {mask_token_id}; "
                "the tokenizer must give them different ids"
            )
        self.cfg = cfg
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id

    # --- schedule --------------------------------------------------------------------------------

    def alpha(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha_t, 1 - alpha_t), the second computed without cancellation near t = 0."""
        eps = self.cfg.eps
        if self.cfg.schedule == "loglinear":
            one_minus = (1.0 - eps) * t
            return 1.0 - one_minus, one_minus
        sigma = -math.log(eps) * t
        return torch.exp(-sigma), -torch.expm1(-sigma)

    def elbo_weight(self, t: torch.Tensor) -> torch.Tensor:
        """-alpha'_t / (1 - alpha_t) (eq. 11) for t > eps; 1 / eps at t <= eps, where a row drawn
        below eps estimates the reconstruction term (module docstring)."""
        eps = self.cfg.eps
        clamped = t.clamp(min=eps)
        if self.cfg.schedule == "loglinear":
            return 1.0 / clamped  # (1 - eps) / ((1 - eps) t); 1 / eps at eps
        sigma_max = -math.log(eps)
        weight = sigma_max / torch.expm1(sigma_max * clamped)  # sigma' alpha / (1 - alpha)
        return torch.where(t <= eps, torch.full_like(weight, 1.0 / eps), weight)

    def bound_time(self, t: torch.Tensor) -> torch.Tensor:
        """Times below eps moved to eps: the text is noised (and the model told) at eps there, so the
        rows drawn below eps pay the reconstruction term (module docstring)."""
        return t.clamp(min=self.cfg.eps)

    def prior_nats_per_token(self, vocab_size: int) -> float:
        """KL(q(z_1 | x) || p(z_1)) per real token: eps * log(V - 1) (module docstring)."""
        alpha_1, _ = self.alpha(torch.tensor(1.0, dtype=torch.float64))
        return float(alpha_1) * math.log(vocab_size - 1)

    # --- forward process -------------------------------------------------------------------------

    def draw_masked(self, t, shape: tuple[int, int], device, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B, L) bool on `device`: each position masked with prob 1 - alpha_t of its row's time t (B,)
        (eq. 2); excluding padding is the caller's. Training draws it on the host, where the positions
        the text head runs at are then known without reading the device."""
        B, L = shape
        _, mask_prob = self.alpha(_per_row(t, B, device))  # (B,)
        u = rng.uniform((B, L), device, generator, dtype=torch.float64)
        return u < mask_prob[:, None]

    def add_noise(
        self, tokens: torch.Tensor, t, pad_mask: torch.Tensor | None = None, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """z_t ~ q(z_t | x) (eq. 2): each non-pad token becomes the mask with prob 1 - alpha_t.

        tokens (B, L) int64; t (B,) in [0, 1]; pad_mask (B, L) bool, True = real token.
        """
        masked = self.draw_masked(t, tokens.shape, tokens.device, generator)  # (B, L)
        if pad_mask is not None:
            masked &= pad_mask
        return tokens.masked_fill(masked, self.mask_token_id)

    # --- loss ------------------------------------------------------------------------------------

    def loss_positions(self, noised: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) bool: the masked non-pad positions of `noised`, the only ones the loss reads."""
        masked = noised == self.mask_token_id
        return masked & pad_mask if pad_mask is not None else masked

    def row_weights(
        self, t, batch_size: int, rows: torch.Tensor, L: int, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N,) float32: the weight of each row's cross-entropy in the summed loss (before its divisor):
        the ELBO weight of its text's time (cfg.loss "elbo") or 1 (masked_ce); 0 where `valid` (N,)
        bool is False (rows that only fill a fixed row count, `pad_rows`)."""
        if self.cfg.loss != "elbo":
            weight = torch.ones(rows.shape[0], device=rows.device)
        else:
            per_text = self.elbo_weight(_per_row(t, batch_size, rows.device, torch.float32))  # (B,)
            weight = per_text.index_select(0, torch.div(rows, L, rounding_mode="floor"))
        return weight if valid is None else weight * valid

    def loss_targets(
        self, tokens: torch.Tensor, t, rows: torch.Tensor, valid: torch.Tensor | None = None
    ) -> TextTargets:
        """What the model needs to fuse its text head with `loss` at rows (N,) of tokens (B, L), the
        masked real positions (`MultimodalMMDiT.text_loss`; `valid` as `loss` takes it): `loss` then
        takes the model's TextLoss for the logits, and equals the loss of the head's logits."""
        B, L = tokens.shape
        targets = tokens.reshape(-1).index_select(0, rows)
        return TextTargets(targets, self.row_weights(t, B, rows, L, valid), self.mask_token_id)

    def loss(
        self,
        logits: torch.Tensor | TextLoss,
        tokens: torch.Tensor,
        noised: torch.Tensor,
        t,
        pad_mask: torch.Tensor | None = None,
        per_sample: bool = False,
        rows: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        num_masked: int | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """The training loss over masked non-pad tokens and its metrics.

        logits (B, L, V) from the model on `noised`, or (N, V) only at `loss_positions(noised,
        pad_mask)` in row-major order (the model's text_rows), or the model's head fused with this loss
        there (a TextLoss, of `loss_targets`' targets); tokens (B, L) clean; t (B,) the times
        `noised` was drawn at. rows (N,) int64: those positions' flat (B * L) indices in row-major
        order where the caller knows them (training decides them on the host); without them they are
        found here, which reads the device. valid (N,) bool, with rows: False at rows that only fill a
        fixed row count (`pad_rows`), which then count for nothing; num_masked, with valid, the host's
        count of its True rows. cfg.loss "elbo": NELBO in nats per non-pad token (module docstring);
        "masked_ce": unweighted mean cross-entropy over masked non-pad tokens.
        Metrics (detached): accuracy of the argmax over masked non-pad tokens, num_masked (an int),
        num_tokens
        (non-pad tokens: the ELBO denominator, for token-weighted averages over batches). With
        `per_sample` (evaluation, cfg.loss "elbo") also nats_per_sample and num_tokens_per_sample (B,):
        the loss is their sums' ratio; each text's nats are its NELBO estimate given the length,
        without the prior term.
        """
        B, L = tokens.shape
        device = tokens.device
        if rows is None:
            rows = self.loss_positions(noised, pad_mask).flatten().nonzero().squeeze(1)  # (N,)
        if valid is None:
            num_masked = rows.shape[0]
        elif num_masked is None:
            raise ValueError("valid rows need num_masked, the host's count of them")
        num_real = pad_mask.sum() if pad_mask is not None else torch.full((), B * L, device=device)

        # SUBS: the mask is never the answer (its logit is -inf); unmasked positions copy their
        # input and contribute zero, so only masked rows are gathered (saves a (B, L, V) copy).
        targets = tokens.reshape(-1).index_select(0, rows)  # (N,)
        fused = isinstance(logits, TextLoss)  # the model's head fused with the loss (`loss_targets`)
        rows_given = logits.ce.shape[0] if fused else logits.shape[0] if logits.dim() == 2 else rows.shape[0]
        if rows_given != rows.shape[0]:
            raise ValueError(
                f"text logits of {rows_given} rows: expected (B, L, V) or one row per masked non-pad "
                f"position ({rows.shape[0]})"
            )
        if fused:
            ce, predicted = logits.ce, logits.predicted
        else:
            masked_logits = logits.reshape(B * L, -1).index_select(0, rows) if logits.dim() == 3 else logits  # (N, V)
            ce, predicted = subs_cross_entropy(masked_logits, targets, self.mask_token_id)  # (N,) each

        extra = {}
        if self.cfg.loss == "elbo":
            # (N,); the fused head summed them already (`loss_targets`' weights)
            weighted = None if fused and not per_sample else self.row_weights(t, B, rows, L, valid) * ce
            loss = (logits.weighted if fused else weighted.sum()) / num_real.clamp_min(1)
            if per_sample:
                text_of = torch.div(rows, L, rounding_mode="floor")  # (N,) the text of each row
                nats = torch.zeros(B, device=device).index_add_(0, text_of, weighted.detach())
                real = pad_mask.sum(dim=1) if pad_mask is not None else torch.full((B,), L, device=device)
                extra = {"nats_per_sample": nats, "num_tokens_per_sample": real}
        else:
            unweighted = ce.sum() if valid is None else (ce * valid).sum()
            loss = (logits.weighted if fused else unweighted) / max(num_masked, 1)

        with torch.no_grad():
            right = predicted == targets
            accuracy = (right if valid is None else right & valid).sum().float() / max(num_masked, 1)
        return loss, {"accuracy": accuracy, "num_masked": num_masked, "num_tokens": num_real, **extra}

    # --- reverse process -------------------------------------------------------------------------

    def log_x0(self, logits: torch.Tensor) -> torch.Tensor:
        """log x_theta of rows of logits (N, V), float64, the mask never predicted (SUBS)."""
        log_x0 = logits.double()
        log_x0[:, self.mask_token_id] = float("-inf")
        return torch.log_softmax(log_x0, dim=-1)

    def num_to_reveal(self, x_t: torch.Tensor, s) -> torch.Tensor:
        """(B,) how many masked positions of x_t (B, L) a step to time s reveals: the cumulative target
        round(n (alpha_s - alpha_1) / (1 - alpha_1)), the expected number of a text's n real tokens an
        ancestral trajectory from t = 1 has revealed by s, less the number already revealed (at least 0).
        Counts per step are differences of the targets, so however many steps there are, the share
        revealed follows the schedule and the model never reads more masks than training showed it
        at that time (a rounded per-step share, round(n_masked (alpha_s - alpha_t) / (1 - alpha_t)),
        is 0 whenever a step's share is under half a token: 12 tokens in 50 steps stayed all masked
        down to t = 0.46)."""
        B = x_t.shape[0]
        alpha_1, one_minus_1 = self.alpha(torch.ones(B, dtype=torch.float64, device=x_t.device))
        alpha_s, _ = self.alpha(_per_row(s, B, x_t.device))
        num_real = (x_t != self.pad_token_id).sum(dim=1)  # (B,)
        num_revealed = num_real - (x_t == self.mask_token_id).sum(dim=1)
        target = torch.round(num_real * ((alpha_s - alpha_1) / one_minus_1).clamp(0.0, 1.0))
        return (target - num_revealed).clamp_min(0)

    def step(
        self,
        logits: torch.Tensor,
        x_t: torch.Tensor,
        t,
        s,
        generator: torch.Generator | None = None,
        strategy: Literal["ancestral", "confidence", "margin", "left_to_right"] = "ancestral",
    ) -> torch.Tensor:
        """One reverse step from time t to time s < t: returns z_s (B, L).

        logits (B, L, V) from the model on x_t at time t; t, s numbers or (B,) tensors, 0 <= s < t <= 1.
        Unmasked tokens (and padding) are kept. A masked position
        - "ancestral": follows p_theta(z_s | z_t) (eq. 7 with SUBS): it stays masked with prob
          (1 - alpha_s) / (1 - alpha_t), else takes a token drawn from x_theta. At s = 0 nothing
          stays masked.
        - "confidence": a token is drawn from x_theta at every masked position, and the k most
          confident draws (highest log-probability) are kept, k = `num_to_reveal`: the revealed share
          follows the schedule for any number of steps. Mode-seeking: which draws are kept depends on
          the drawn values, favouring likely tokens, so even an exact x_theta does not give samples of
          the model's distribution (docs/quality.md: total variation 0.55 on a toy, i.i.d. draws 0.018).
        - "margin": as "confidence", ranked by the gap between the two most probable tokens of each
          position (Kim et al. 2025, "Train for the worst, plan for the best", sec. 4): a position whose
          best two words are near-equal waits until its neighbours decide between them.
        - "left_to_right": as "confidence", the k leftmost masked positions (semi-autoregressive order).
        "ancestral", "margin" and "left_to_right" sample the model's distribution: the positions revealed
        depend on the unmasked tokens alone, never on the values drawn, so each revealed token is a
        draw from its conditional (exact where a step reveals one token; positions revealed in the same
        step are drawn independently, which with few steps per token loses their correlation).
        Draws use float64 Gumbel-max.
        """
        masked = x_t == self.mask_token_id  # (B, L)
        where = masked.nonzero()  # (N, 2) (sequence, position) of each masked position

        if strategy == "ancestral":
            new = self._ancestral_reveals(logits, x_t, t, s, where, generator)
        elif strategy in ("confidence", "margin", "left_to_right"):
            new = self._ranked_reveals(logits, x_t, s, masked, where, strategy, generator)
        else:
            raise ValueError(
                f"MaskedDiffusion.step: strategy {strategy!r}; expected 'ancestral', 'confidence', 'margin' "
                "or 'left_to_right'"
            )

        out = x_t.clone()
        out[masked] = new.to(x_t.dtype)
        return out

    def _ancestral_reveals(
        self, logits: torch.Tensor, x_t: torch.Tensor, t, s, where: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        """(N,) the new value of each masked position `where` (N, 2) under the "ancestral" step: a token
        drawn from x_theta, or the mask token where the position stays masked."""
        B = logits.shape[0]
        row_of = where[:, 0]
        _, one_minus_t = self.alpha(_per_row(t, B, x_t.device))  # (B,)
        _, one_minus_s = self.alpha(_per_row(s, B, x_t.device))
        stay_prob = one_minus_s / one_minus_t  # (B,) P(still masked at s | masked at t)
        # eq. 7: (alpha_s - alpha_t)/(1 - alpha_t) * x_theta + (1 - alpha_s)/(1 - alpha_t) * m, drawn in
        # two stages with the same law: reveal with prob 1 - stay_prob, then a token from x_theta.
        # Only revealed positions pay for a draw over the vocabulary, so over a whole trajectory each
        # position is drawn about once rather than once per step.
        reveal = rng.uniform(row_of.shape, x_t.device, generator, dtype=torch.float64) >= stay_prob[row_of]
        new = torch.full_like(row_of, self.mask_token_id)
        chosen = where[reveal]
        new[reveal] = _gumbel_argmax(self.log_x0(logits[chosen[:, 0], chosen[:, 1]]), generator)
        return new

    def _ranked_reveals(
        self,
        logits: torch.Tensor,
        x_t: torch.Tensor,
        s,
        masked: torch.Tensor,
        where: torch.Tensor,
        strategy: str,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """(N,) the new value of each masked position under the "confidence", "margin" and
        "left_to_right" steps: a token drawn at every masked position, kept at the `num_to_reveal`
        best-ranked positions of each row, the mask token elsewhere."""
        B, L, _ = logits.shape
        log_x0 = self.log_x0(logits[masked])  # (N, V)
        draw = _gumbel_argmax(log_x0, generator)  # (N,)
        confidence = torch.full((B, L), float("-inf"), dtype=torch.float64, device=x_t.device)
        if strategy == "confidence":
            confidence[masked] = log_x0.gather(-1, draw[:, None])[:, 0].double()
        elif strategy == "margin":
            top2 = log_x0.topk(2, dim=-1).values.exp()  # (N, 2) the two highest probabilities
            confidence[masked] = (top2[:, 0] - top2[:, 1]).double()
        else:
            confidence[masked] = -where[:, 1].double()  # leftmost first
        num_unmask = self.num_to_reveal(x_t, s)  # (B,)
        rank = confidence.argsort(dim=1, descending=True).argsort(dim=1)  # (B, L) 0 = most confident
        keep = rank < num_unmask[:, None]
        return torch.where(keep[masked], draw, self.mask_token_id)

    def remasking_step(
        self, logits: torch.Tensor, x_t: torch.Tensor, t, s, max_sigma: float, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """One reverse step from time t to s < t of ReMDM's remasking posterior (Wang et al. 2025,
        "Remasking Discrete Diffusion Models with Inference-Time Scaling", arXiv:2503.00307) with
        the max-capped schedule sigma_t = min(max_sigma, (1 - alpha_s) / alpha_t): returns z_s (B, L).
        - an unmasked real token is masked again with probability sigma_t, whatever its value;
        - a masked position takes a token drawn from x_theta with probability
          (alpha_s - (1 - sigma_t) alpha_t) / (1 - alpha_t), else stays masked.
        Both keep the forward marginal q(z_s | x) of every position (sigma_t <= (1 - alpha_s) / alpha_t
        keeps the second a probability), so, as the ancestral step (sigma_t = 0), it samples the model's
        distribution; the remasked tokens are drawn again later given more of the text. At s = 0,
        sigma_t = 0 and every position is revealed. Padding is kept.
        """
        B = x_t.shape[0]
        alpha_t, one_minus_t = self.alpha(_per_row(t, B, x_t.device))  # (B,)
        alpha_s, one_minus_s = self.alpha(_per_row(s, B, x_t.device))
        sigma = (one_minus_s / alpha_t).clamp(max=max_sigma)  # (B,)
        reveal_prob = (alpha_s - (1.0 - sigma) * alpha_t) / one_minus_t  # (B,)

        masked = x_t == self.mask_token_id  # (B, L)
        u = rng.uniform(x_t.shape, x_t.device, generator, dtype=torch.float64)  # (B, L)
        remask = ~masked & (x_t != self.pad_token_id) & (u < sigma[:, None])
        reveal = masked & (u < reveal_prob[:, None])
        out = x_t.masked_fill(remask, self.mask_token_id)
        out[reveal] = _gumbel_argmax(self.log_x0(logits[reveal]), generator).to(x_t.dtype)
        return out
