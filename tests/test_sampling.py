"""The samplers on a tiny model overfitted (in this module, a few seconds) on six short token
sequences with fixed random latents: l2t gives each sequence back from its latent, t2l finds each
latent from its sequence; sampling is deterministic for a seed, finite at t = 1 and t = 0, and
guidance scale 0 is the unguided sampler exactly."""

import dataclasses

import pytest
import torch

from mmldlm.config import LatentDiffusionConfig, ModelConfig, ObjectiveConfig, TextDiffusionConfig
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.model import MultimodalMMDiT
from mmldlm.objective import Objective
from mmldlm.sampling import Sampler, SamplingOptions, decoding, pad_mask_from_lengths, time_grid

PAD, MASK, VOCAB, D = 0, 1, 24, 8
LENGTHS = [5, 7, 6, 4, 7, 5]


def sentences() -> dict:
    """Six sequences of words 2..23 of ragged lengths and six random raw latents (mean 1, std 3)."""
    g = torch.Generator().manual_seed(0)
    pad_mask = pad_mask_from_lengths(LENGTHS)  # (6, 7)
    tokens = torch.randint(2, VOCAB, pad_mask.shape, generator=g).masked_fill(~pad_mask, PAD)
    latents = 1.0 + 3.0 * torch.randn(len(LENGTHS), 1, D, generator=g)
    return {"tokens": tokens, "pad_mask": pad_mask, "latents": latents}


def diffusions(data: dict, prediction: str = "v") -> tuple[MaskedDiffusion, GaussianDiffusion]:
    flat = data["latents"].reshape(-1, D)
    return (
        MaskedDiffusion(TextDiffusionConfig(), mask_token_id=MASK, pad_token_id=PAD),
        GaussianDiffusion(LatentDiffusionConfig(prediction=prediction), mean=flat.mean(0), std=flat.std(0)),
    )


def small_model(seed: int = 0) -> MultimodalMMDiT:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=64, num_blocks=2, num_heads=2, max_seq_len=8, latent_dim=D, num_latents=1, timestep_embed_dim=32
    )
    return MultimodalMMDiT(cfg, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def overfit():
    """(model, text, latent, data): the model trained on `sentences()` in an l2t / t2l mixture. No
    condition dropping: with six samples it slows the memorising several-fold, and nothing here needs a
    trained null latent (the guidance test checks the rule, not its effect)."""
    data = sentences()
    text, latent = diffusions(data)
    objective = Objective(
        ObjectiveConfig(mode="random", mode_weights={"l2t": 1.0, "t2l": 1.0}, cond_drop_prob=0.0), text, latent
    )
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batch = {k: v.repeat(4, *[1] * (v.dim() - 1)) for k, v in data.items()}  # 24 rows: 4 draws of t each
    g = torch.Generator().manual_seed(0)
    for step in range(800):
        loss, _ = objective(model, batch, step, generator=g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model, text, latent, data


def test_l2t_reproduces_every_training_sentence_from_its_latent(overfit):
    model, text, latent, data = overfit
    for strategy in ("ancestral", "confidence"):
        sampler = Sampler(model, text, latent, SamplingOptions(num_steps=16, strategy=strategy))
        tokens = sampler.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(1))
        assert torch.equal(tokens, data["tokens"]), strategy


def test_t2l_retrieves_every_latent_from_its_sentence(overfit):
    model, text, latent, data = overfit
    for sampler_name in ("ddim", "ddpm"):
        sampler = Sampler(model, text, latent, SamplingOptions(num_steps=16, latent_sampler=sampler_name))
        z = sampler.t2l(data["tokens"], data["pad_mask"], torch.Generator().manual_seed(1))  # encoder space
        similarity = (
            torch.nn.functional.normalize(z.flatten(1), dim=-1)
            @ torch.nn.functional.normalize(data["latents"].flatten(1), dim=-1).T
        )  # (6, 6)
        assert torch.equal(similarity.argmax(dim=1), torch.arange(6)), sampler_name
        assert torch.nn.functional.cosine_similarity(z.flatten(1), data["latents"].flatten(1)).min() > 0.9


def test_posterior_mean_latent_is_one_model_call_that_finds_every_latent_and_joint_refuses_it(overfit):
    model, text, latent, data = overfit
    sampler = Sampler(model, text, latent, SamplingOptions(latent_steps=16, latent_sampler="mean"))
    z = sampler.t2l(data["tokens"], data["pad_mask"], torch.Generator().manual_seed(1))
    assert sampler.num_forward == 1
    assert torch.nn.functional.cosine_similarity(z.flatten(1), data["latents"].flatten(1)).min() > 0.9
    with pytest.raises(ValueError, match="latent_sampler.: got 'mean'; expected 'ddim' or 'ddpm' for joint"):
        sampler.joint(data["pad_mask"], torch.Generator().manual_seed(1))


def test_reusing_the_output_skips_model_calls_and_still_reproduces(overfit):
    model, text, latent, data = overfit
    calls = {}
    for reuse in (True, False):
        sampler = Sampler(model, text, latent, SamplingOptions(num_steps=64, reuse_output=reuse))
        tokens = sampler.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(2))
        assert torch.equal(tokens, data["tokens"])
        calls[reuse] = sampler.num_forward
    assert calls[False] == 64 and calls[True] < 64


def test_sampling_is_deterministic_for_a_seed(overfit):
    model, text, latent, data = overfit
    sampler = Sampler(model, text, latent, SamplingOptions(num_steps=8, temperature=3.0, latent_sampler="ddpm"))
    pad_mask = pad_mask_from_lengths([7, 5, 6])
    runs = [sampler.joint(pad_mask, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][1], runs[2][1])  # another seed, other noise
    hot = [sampler.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(seed)) for seed in (3, 3)]
    assert torch.equal(*hot)


def test_guidance_scale_zero_is_the_unguided_sampler_exactly(overfit):
    model, text, latent, data = overfit
    pad_mask, latents = data["pad_mask"], data["latents"]
    t_zero = torch.zeros(6)

    def reference_l2t(g):
        """MDLM ancestral sampling written out: one conditional model call per step, nothing else."""
        tokens, z = torch.where(pad_mask, MASK, PAD), latent.standardize(latents)
        for t, s in time_grid(8):
            logits, _, _ = model(tokens, z, torch.full((6,), t), t_zero, pad_mask, latent_head=False)
            logits = logits / 2.0
            logits[..., PAD] = float("-inf")
            tokens = text.step(logits, tokens, t, s, g)
        return tokens

    def reference_t2l(g):
        x = torch.randn(6, 1, D, generator=g)
        for t, s in time_grid(8):
            _, pred, _ = model(data["tokens"], x, t_zero, torch.full((6,), t), pad_mask, text_head=False)
            x = latent.step(pred, x, t, s, "ddpm", g)
        return latent.destandardize(x)

    options = SamplingOptions(
        num_steps=8,
        temperature=2.0,
        guidance_scale=0.0,
        reuse_output=False,
        latent_sampler="ddpm",
        strategy="ancestral",
    )
    sampler = Sampler(model, text, latent, options)
    with torch.no_grad():
        assert torch.equal(
            sampler.l2t(latents, pad_mask, torch.Generator().manual_seed(4)),
            reference_l2t(torch.Generator().manual_seed(4)),
        )
        assert torch.equal(
            sampler.t2l(data["tokens"], pad_mask, torch.Generator().manual_seed(4)),
            reference_t2l(torch.Generator().manual_seed(4)),
        )
    assert sampler.num_forward == 16  # no unconditional pass at scale 0
    # The guided rule itself: scale w moves the logits by w (cond - uncond).
    guided = Sampler(model, text, latent, SamplingOptions(guidance_scale=2.0))
    plain = Sampler(model, text, latent, SamplingOptions())
    tokens = torch.where(data["pad_mask"], MASK, PAD)
    z = latent.standardize(data["latents"])
    cond = plain._l2t_logits(tokens, z, 0.5, data["pad_mask"])
    null = torch.ones(6, dtype=torch.bool)
    uncond, _, _ = model(
        tokens, z, torch.full((6,), 0.5), torch.zeros(6), data["pad_mask"], latent_null=null, latent_head=False
    )
    expected = plain._text_scores(cond + 2.0 * (cond - uncond))
    assert torch.allclose(guided._l2t_logits(tokens, z, 0.5, data["pad_mask"]), expected, atol=1e-4)


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
def test_no_nan_at_t1_or_t0_for_every_parameterisation(prediction):
    data = sentences()
    text, latent = diffusions(data, prediction)
    model = small_model(seed=1)
    with torch.no_grad():  # non-zero heads, so the predictions are not trivially 0
        for p in [*model.latent_final.parameters(), *model.text_final.parameters()]:
            p.normal_(std=0.5)
    assert time_grid(1) == [(1.0, 0.0)]  # one step goes from t = 1 straight to t = 0
    for num_steps in (1, 3):
        for sampler_name in ("ddim", "ddpm"):
            sampler = Sampler(
                model.eval(),
                text,
                latent,
                SamplingOptions(num_steps=num_steps, guidance_scale=1.5, latent_sampler=sampler_name),
            )
            g = torch.Generator().manual_seed(0)
            z = sampler.t2l(data["tokens"], data["pad_mask"], g)
            tokens, z_joint = sampler.joint(data["pad_mask"], g)
            out = sampler.l2t(data["latents"], data["pad_mask"], g)
            assert torch.isfinite(z).all() and torch.isfinite(z_joint).all()
            for t in (tokens, out):  # everything unmasked at t = 0, padding kept, no pad predicted
                assert not (t == MASK).any()
                assert torch.equal(t == PAD, ~data["pad_mask"])


def test_bad_options_fail_with_a_message():
    data = sentences()
    text, latent = diffusions(data)
    model = small_model()
    with pytest.raises(ValueError, match="sampling option .num_steps.: got 0; expected an integer >= 1"):
        Sampler(model, text, latent, SamplingOptions(num_steps=0))
    no_null = MultimodalMMDiT(dataclasses.replace(model.cfg, null_latent=False), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="null latent"):
        Sampler(no_null, text, latent, SamplingOptions(guidance_scale=1.0))


def test_self_conditioned_sampler_feeds_each_step_the_previous_x0_estimate():
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32,
        num_blocks=1,
        num_heads=2,
        max_seq_len=8,
        latent_dim=D,
        num_latents=1,
        timestep_embed_dim=16,
        self_condition=True,
    )
    model = MultimodalMMDiT(cfg, vocab_size=VOCAB).eval()
    with torch.no_grad():  # a non-zero self-conditioning input path, so the estimate changes the output
        model.latent_self_cond_proj.weight.normal_(std=0.5)
        model.latent_final.head.weight.normal_(std=0.5)
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.cfg = inner, inner.cfg

        def forward(self, tokens, latents, t_text, t_latent, **kw):
            out = self.inner(tokens, latents, t_text, t_latent, **kw)
            seen.append((kw.get("latent_self_cond"), latents, t_latent[0].item(), out.latent))
            return out

    data = sentences()
    text, latent = diffusions(data)
    sampler = Sampler(Spy(model), text, latent, SamplingOptions(num_steps=3))
    sampler.t2l(data["tokens"], data["pad_mask"], torch.Generator().manual_seed(0))
    assert len(seen) == 3 and seen[0][0] is None
    for (_, x, t, pred), (estimate, *_) in zip(seen, seen[1:]):
        torch.testing.assert_close(estimate, latent.predict_x0_eps(pred.float(), x, t)[0])


def test_sampler_defaults_come_from_the_run_config_and_given_options_override_them():
    text = TextDiffusionConfig(num_sampling_steps=24, sampling_temperature=0.6)
    latent = LatentDiffusionConfig(num_sampling_steps=2, sampler="ddpm")
    options = SamplingOptions.defaults(text, latent)
    assert (options.num_steps, options.latent_steps, options.temperature, options.latent_sampler) == (
        24,
        2,
        0.6,
        "ddpm",
    )
    # A command-line option left unset (None) keeps the run's value; a given one wins; --steps sets both.
    options = SamplingOptions.defaults(text, latent, 8, temperature=None, latent_sampler="ddim", guidance_scale=1.5)
    assert (
        options.num_steps,
        options.latent_steps,
        options.temperature,
        options.latent_sampler,
        options.guidance_scale,
    ) == (8, 8, 0.6, "ddim", 1.5)
    assert SamplingOptions.defaults(text, latent, temperature=1.0).temperature == 1.0


def bag_encoder(data: dict):
    """A stand-in sentence encoder: a text's latent is its closest training sentence's latent, scaled
    by the share of positions the text has right, plus a fixed random vector per wrong (position,
    token): exact on the training sentences, further away with every wrong token.
    (tokens, pad_mask) -> latents (B, 1, D)."""
    table = 3.0 * torch.randn(8, VOCAB, D, generator=torch.Generator().manual_seed(7))
    sources, source_mask, latents = data["tokens"], data["pad_mask"], data["latents"].flatten(1)

    def reencode(tokens, pad_mask):
        L = tokens.shape[1]
        same = (tokens[:, None, :] == sources[None, :, :L]) & pad_mask[:, None, :] & source_mask[None, :, :L]
        share = same.sum(-1) / source_mask.sum(-1)[None, :]  # (B, 6)
        best = share.argmax(dim=1)
        right = same[torch.arange(len(best)), best]  # (B, L)
        wrong = table[torch.arange(L)[None, :], tokens] * (pad_mask & ~right)[..., None]  # (B, L, D)
        return (share.max(dim=1).values[:, None] * latents[best] + wrong.sum(dim=1))[:, None, :]

    return reencode


def test_best_of_one_without_correction_is_the_plain_sampler_exactly(overfit):
    model, text, latent, data = overfit
    hot = SamplingOptions(num_steps=8, temperature=3.0)
    plain = Sampler(model, text, latent, hot)
    same = Sampler(model, text, latent, dataclasses.replace(hot, best_of=1, correction_rounds=0), bag_encoder(data))
    for seed in (0, 1):
        assert torch.equal(
            plain.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(seed)),
            same.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(seed)),
        )
    assert same.num_encoded == 0


def test_encoder_in_the_loop_moves_texts_towards_their_targets_and_never_away(overfit):
    """A hot sampler writes wrong tokens; re-ranking and correction rounds, scored by the stand-in
    encoder against the encoding of the true texts, keep the closer texts: a correction round never
    returns a text further from its target than its input."""
    model, text, latent, data = overfit
    encoder = bag_encoder(data)
    target, pad_mask = data["latents"], data["pad_mask"]
    torch.testing.assert_close(encoder(data["tokens"], pad_mask), target)
    hot = SamplingOptions(num_steps=8, temperature=12.0, remask_fraction=0.3)

    def cosines(tokens):
        return torch.nn.functional.cosine_similarity(encoder(tokens, pad_mask).flatten(1), target.flatten(1))

    g = torch.Generator().manual_seed(0)
    plain = Sampler(model, text, latent, hot).l2t(target, pad_mask, g)
    # Best of 4: of 2, the six texts beat one plain draw in 6 of 8 seeds only (of 4: 8 of 8).
    sampler = Sampler(model, text, latent, dataclasses.replace(hot, best_of=4), encoder)
    draft = decoding.best_of(sampler, target, pad_mask, g)
    assert sampler.num_encoded == 4 * 6
    torch.testing.assert_close(draft.cosine, cosines(draft.tokens))  # the cosine is the re-encoding's
    assert draft.cosine.mean() > cosines(plain).mean()
    start = draft.cosine
    for rounds in range(3):
        corrected = decoding.correction_rounds(
            Sampler(model, text, latent, dataclasses.replace(hot, correction_rounds=1), encoder), draft, target, g
        )
        assert (cosines(corrected.tokens) >= draft.cosine - 1e-6).all(), rounds
        draft = corrected
    assert draft.cosine.mean() > start.mean()
    assert not (draft.tokens == MASK).any() and torch.equal(draft.tokens == PAD, ~pad_mask)


def test_remasking_rounds_keep_a_text_complete_and_reproduce_a_memorised_one(overfit):
    model, text, latent, data = overfit
    options = SamplingOptions(num_steps=16, remask_rounds=3, remask_fraction=0.5)
    sampler = Sampler(model, text, latent, options)
    tokens = sampler.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(1))
    assert torch.equal(tokens, data["tokens"])
    # Each round re-reveals half of each text one position per step: 16 steps, then 3 rounds of 4.
    assert sampler.num_forward > Sampler(model, text, latent, dataclasses.replace(options, remask_rounds=0)).num_forward


def test_posterior_remasking_masks_tokens_again_and_still_reproduces_a_memorised_text(overfit):
    model, text, latent, data = overfit
    options = SamplingOptions(num_steps=32, strategy="ancestral", remask="posterior", remask_cap=0.2)
    sampler = Sampler(model, text, latent, options)
    tokens = sampler.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(1))
    assert torch.equal(tokens, data["tokens"])
    # Tokens masked again are revealed again, and a trajectory that changes its input every step calls
    # the model at every step; without remasking some steps reveal nothing and reuse the output.
    plain = Sampler(model, text, latent, dataclasses.replace(options, remask="confidence"))
    plain.l2t(data["latents"], data["pad_mask"], torch.Generator().manual_seed(1))
    assert sampler.num_forward > plain.num_forward  # 30 of 32 steps against 22


def test_repetition_penalty_lowers_every_revealed_token_and_nothing_else(overfit):
    model, text, latent, data = overfit
    sampler = Sampler(model, text, latent, SamplingOptions(repetition_penalty=2.5))
    scores = torch.zeros(1, 3, VOCAB)
    tokens = torch.tensor([[5, MASK, 5]])
    lowered = sampler._penalize_repeats(scores, tokens)
    expected = torch.zeros(VOCAB)
    expected[5] = -2.5
    assert torch.equal(lowered[0, 1], expected)


def test_decoding_options_that_need_the_encoder_refuse_a_sampler_without_one(overfit):
    model, text, latent, _ = overfit
    with pytest.raises(ValueError, match=r"'length_candidates': got \(4, 0, 1\); expected 1, 0, 1: re-ranking"):
        Sampler(model, text, latent, SamplingOptions(best_of=4))
    with pytest.raises(ValueError, match="sampling option .remask_fraction.: got 0; expected a number in"):
        Sampler(model, text, latent, SamplingOptions(remask_fraction=0))


def test_joint_best_of_keeps_the_pairs_whose_text_matches_its_own_latent(overfit):
    model, text, latent, data = overfit
    encoder = bag_encoder(data)
    pad_mask = pad_mask_from_lengths([7, 5, 6, 4, 7, 5])
    hot = SamplingOptions(num_steps=8, temperature=3.0, latent_sampler="ddpm")

    def consistency(options):
        sampler = Sampler(model, text, latent, options, encoder)
        tokens, latents = sampler.joint(pad_mask, torch.Generator().manual_seed(3))
        assert not (tokens == MASK).any() and torch.equal(tokens == PAD, ~pad_mask)
        cosine = torch.nn.functional.cosine_similarity(encoder(tokens, pad_mask).flatten(1), latents.flatten(1))
        return cosine.mean(), sampler.num_encoded

    plain, none_encoded = consistency(hot)
    chosen, encoded = consistency(dataclasses.replace(hot, best_of=4, correction_rounds=2))
    assert none_encoded == 0 and encoded == 6 * 4 + 2 * 6 * 4  # candidates, then 4 variants per round
    assert chosen > plain
