"""Objective: the modes wire the streams as the table in mmldlm/objective.py says, the tiny model
learns each direction on a fixed batch, gradients reach the conditioning encoder and never the idle
head, the mode draw is deterministic, and bad configs fail with a message that names the key."""

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from mmldlm.config import (
    ConfigError,
    LatentDiffusionConfig,
    ObjectiveConfig,
    TextDiffusionConfig,
    load_config,
    load_model_preset,
)
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.model import ModelOutput, MultimodalMMDiT
from mmldlm.objective import Objective

PAD, MASK, VOCAB = 0, 1, 64
B, L, D = 8, 16, 16


def make_batch(seed: int = 0) -> dict:
    """8 texts of random words (ids 2..63) with ragged lengths and random raw latents (mean 3, std 2)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, VOCAB, (B, L), generator=g)
    lengths = torch.tensor([16, 16, 14, 12, 16, 9, 16, 11])
    pad_mask = torch.arange(L)[None, :] < lengths[:, None]  # (B, L)
    tokens[~pad_mask] = PAD
    latents = 3.0 + 2.0 * torch.randn(B, 1, D, generator=g)
    return {"tokens": tokens, "pad_mask": pad_mask, "latents": latents, "index": torch.arange(B)}


def make_objective(
    batch: dict | None = None,
    *,
    self_condition: bool = False,
    length_head: bool = False,
    latent_cfg: LatentDiffusionConfig | None = None,
    **objective_kw,
) -> Objective:
    """The objective for `batch`'s latent statistics; self_condition and length_head say what the
    model has (tiny_model: a length head, no self-conditioning)."""
    text = MaskedDiffusion(TextDiffusionConfig(), mask_token_id=MASK, pad_token_id=PAD)
    stats = {}
    if batch is not None:
        flat = batch["latents"].reshape(-1, D)
        stats = {"mean": flat.mean(0), "std": flat.std(0)}
    latent = GaussianDiffusion(latent_cfg or LatentDiffusionConfig(), **stats)
    return Objective(
        ObjectiveConfig(**objective_kw), text, latent, self_condition=self_condition, length_head=length_head
    )


def tiny_model(seed: int = 0) -> MultimodalMMDiT:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(load_model_preset("tiny"), latent_dim=D, num_latents=1, max_seq_len=L)
    return MultimodalMMDiT(cfg, vocab_size=VOCAB)


# --------------------------------------------------------------------------------------------------
# Wiring, with a stand-in model that records what it is given.


class RecordingModel:
    def __init__(self):
        self.calls = []

    def __call__(
        self,
        tokens,
        latents,
        t_text,
        t_latent,
        text_pad_mask=None,
        latent_null=None,
        *,
        text_head=True,
        latent_head=True,
        text_rows=None,
        text_lengths=None,
    ):
        self.calls.append(
            dict(
                tokens=tokens,
                latents=latents,
                t_text=t_text,
                t_latent=t_latent,
                text_pad_mask=text_pad_mask,
                latent_null=latent_null,
                text_head=text_head,
                latent_head=latent_head,
                text_rows=text_rows,
            )
        )
        logits = torch.zeros(*tokens.shape, VOCAB, requires_grad=True) if text_head else None
        if text_rows is not None:
            logits = logits.flatten(0, 1)[text_rows]
        latent = torch.zeros(latents.shape, requires_grad=True) if latent_head else None
        return ModelOutput(logits, latent, None)


def run_recorded(mode: str, cond_drop_prob: float = 0.0, batch_size: int = 64):
    g = torch.Generator().manual_seed(1)
    batch = make_batch()
    batch = {k: v.repeat(batch_size // B, *[1] * (v.dim() - 1)) for k, v in batch.items()}
    objective = make_objective(make_batch(), mode=mode, cond_drop_prob=cond_drop_prob)
    model = RecordingModel()
    loss, metrics = objective(model, batch, step=0, generator=g)
    return batch, objective, model.calls[0], loss, metrics


def test_l2t_masks_text_and_keeps_the_latent_clean():
    batch, objective, call, loss, metrics = run_recorded("l2t", cond_drop_prob=0.5)
    assert call["text_head"] and not call["latent_head"]
    assert torch.equal(call["t_latent"], torch.zeros(64))
    assert torch.allclose(call["latents"], objective.latent.standardize(batch["latents"]))
    masked = call["tokens"] == MASK
    assert masked.any() and not (masked & ~batch["pad_mask"]).any()
    assert ((call["tokens"] == batch["tokens"]) | masked).all()
    assert 0 < call["latent_null"].sum() < 64  # about half the latents replaced by the null latent
    assert torch.equal(call["text_pad_mask"], batch["pad_mask"])
    assert set(metrics) == {"mode", "loss", "text_loss", "accuracy", "num_masked", "num_tokens"}
    assert metrics["mode"] == "l2t" and not metrics["loss"].requires_grad
    assert loss.item() == pytest.approx(metrics["text_loss"].item())


def test_t2l_noises_the_latent_and_drops_text_as_fully_masked():
    batch, objective, call, loss, metrics = run_recorded("t2l", cond_drop_prob=0.5)
    assert call["latent_head"] and not call["text_head"]
    assert call["latent_null"] is None
    dropped = call["t_text"] == 1.0
    assert 0 < dropped.sum() < 64 and ((call["t_text"] == 0.0) | dropped).all()
    pad = batch["pad_mask"]
    assert torch.equal(call["tokens"][~dropped], batch["tokens"][~dropped])  # clean text
    assert (call["tokens"][dropped][pad[dropped]] == MASK).all()  # every real token masked
    assert (call["tokens"][dropped][~pad[dropped]] == PAD).all()  # padding stays padding
    clean = objective.latent.standardize(batch["latents"])
    assert not torch.allclose(call["latents"], clean) and (call["t_latent"] > 0).all()
    assert set(metrics) == {"mode", "loss", "latent_loss"}
    # the stand-in predicts v = 0, so the loss is E[v^2] = 1 for standard normal latents and noise
    assert metrics["latent_loss"].item() == pytest.approx(1.0, abs=0.15)


def test_joint_noises_both_streams_at_independent_times():
    batch, objective, call, loss, metrics = run_recorded("joint", cond_drop_prob=0.5)
    assert call["text_head"] and call["latent_head"] and call["latent_null"] is None
    assert (call["tokens"] == MASK).any()
    assert not torch.equal(call["t_text"], call["t_latent"])
    correlation = np.corrcoef(call["t_text"].numpy(), call["t_latent"].numpy())[0, 1]
    assert abs(correlation) < 0.4  # stratified strata are shuffled per draw, not shared by row
    assert set(metrics) >= {"text_loss", "latent_loss", "accuracy"}
    expected = metrics["text_loss"] + metrics["latent_loss"]  # both loss weights are 1
    assert loss.item() == pytest.approx(expected.item())


@pytest.mark.parametrize("kind", ["uniform", "antithetic", "stratified"])
def test_time_sampling(kind):
    objective = make_objective(t_sampling=kind)
    t = objective.sample_t(64, "cpu", torch.Generator().manual_seed(2))
    assert t.shape == (64,) and (t >= 0).all() and (t < 1).all()
    if kind == "antithetic":
        assert torch.allclose(t[:32] + t[32:], torch.ones(32))
    if kind == "stratified":
        assert torch.equal(torch.sort((t * 64).floor()).values, torch.arange(64.0))


# --------------------------------------------------------------------------------------------------
# Learning on the tiny model.


class FixedTimes(Objective):
    """The objective at fixed times (the midpoints of 8 strata, the same every step); masks and noise
    stay fresh every step, so neither a fixed mask pattern nor a fixed noise vector can stand in for
    the condition."""

    def sample_t(self, batch_size, device, generator=None):
        return (torch.arange(batch_size, device=device) % B + 0.5) / B


def overfit(mode: str, steps: int, target_ratio: float) -> dict:
    """Train on one fixed batch of 8 samples, each repeated 4 times per step (independent masks and
    noise: a lower-variance gradient), and measure the loss on one held draw (seed 4, never trained
    on) every 25 steps; stop once it is below target_ratio of its start."""
    batch = make_batch()
    objective = make_objective(batch, mode=mode, cond_drop_prob=0.0)
    objective = FixedTimes(objective.cfg, objective.text, objective.latent)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    repeated = {k: v.repeat(4, *[1] * (v.dim() - 1)) for k, v in batch.items()}
    train_draws = torch.Generator().manual_seed(3)

    def held_loss(b: dict) -> float:
        with torch.no_grad():
            return objective(model, b, 0, generator=torch.Generator().manual_seed(4))[0].item()

    start = final = held_loss(batch)
    for step in range(1, steps + 1):
        loss, _ = objective(model, repeated, step, generator=train_draws)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 25 == 0:
            final = held_loss(batch)
            if final < target_ratio * start:
                break
    # the same held draw with each row given another row's condition
    shuffled = dict(batch)
    other = torch.roll(torch.arange(B), 1)
    if mode == "l2t":
        shuffled["latents"] = batch["latents"][other]
    else:
        shuffled["tokens"], shuffled["pad_mask"] = batch["tokens"][other], batch["pad_mask"][other]
    return {"start": start, "final": final, "shuffled": held_loss(shuffled), "steps": step}


@pytest.mark.parametrize("mode,target_ratio", [("l2t", 0.1), ("t2l", 0.1), ("joint", 0.5)])
def test_tiny_model_overfits_one_batch(mode, target_ratio):
    result = overfit(mode, steps=300, target_ratio=target_ratio)
    assert result["final"] < target_ratio * result["start"], (mode, result)
    if mode != "joint":
        # the condition determines the target: with another row's condition most of the loss returns
        assert result["shuffled"] > 0.5 * result["start"], (mode, result)


@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint"])
def test_gradients_reach_the_condition_and_never_the_idle_head(mode):
    batch = make_batch()
    objective = make_objective(batch, mode=mode, cond_drop_prob=0.0, length_head=True)
    model = tiny_model()
    # adaLN-Zero starts every head and gate at 0, which blocks the gradient below them: step 1
    # moves the heads, step 2 the gates, and from step 3 on gradients reach the inputs
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        objective(model, batch, step, generator=torch.Generator().manual_seed(step))[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    objective(model, batch, 3, generator=torch.Generator().manual_seed(3))[0].backward()
    idle = {"l2t": model.latent_head_parameters(), "t2l": model.text_head_parameters(), "joint": []}[mode]
    idle_ids = {id(p) for p in idle}
    assert all(p.grad is None for p in idle)
    assert all(p.grad is not None for p in model.parameters() if id(p) not in idle_ids)
    if mode == "l2t":  # the condition's input encoder learns (it is not frozen)
        assert model.latent_proj.weight.grad.abs().sum() > 0
    if mode == "t2l":
        assert model.text_embed.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# Mode selection.


def test_random_mode_is_deterministic_follows_weights_and_leaves_global_rng_alone():
    weights = {"l2t": 3.0, "t2l": 1.0, "joint": 0.0}
    objective = make_objective(mode="random", mode_weights=weights, seed=7)
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state, numpy_state = torch.random.get_rng_state(), np.random.get_state()[1].copy()
    modes = [objective.mode_at(step) for step in range(4000)]
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state)

    torch.manual_seed(123)  # another "rank" with another global seed draws the same modes
    again = make_objective(mode="random", mode_weights=weights, seed=7)
    assert [again.mode_at(step) for step in range(4000)] == modes
    assert modes != [make_objective(mode="random", mode_weights=weights, seed=8).mode_at(s) for s in range(4000)]

    counts = Counter(modes)
    assert counts["joint"] == 0
    assert counts["l2t"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_sequential_and_fixed_modes():
    schedule = [[0, "t2l"], [10, "l2t"], [25, "joint"]]
    objective = make_objective(mode="sequential", mode_schedule=schedule)
    assert [objective.mode_at(s) for s in (0, 9, 10, 24, 25, 10_000)] == ["t2l", "t2l", "l2t", "l2t", "joint", "joint"]
    assert {make_objective(mode="joint").mode_at(s) for s in range(50)} == {"joint"}


# --------------------------------------------------------------------------------------------------
# Config errors name the key, the value and what is allowed.


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["model.hidden_size=130", "model.num_heads=4"],
            "config key 'model.hidden_size': got 130; expected a multiple of model.num_heads=4",
        ),
        (
            ["objective.mode_weights.joint=-1"],
            "config key 'objective.mode_weights.joint': got -1.0; expected a number >= 0",
        ),
        (
            ["objective.mode_weights.both=1"],
            "config key 'objective.mode_weights.both': got 1.0; expected weights for the modes l2t, t2l, joint",
        ),
        (
            ["objective.mode_weight=1"],
            "config key 'objective.mode_weight': unknown key; allowed keys here are: mode, mode_weights,",
        ),
        (
            ["objective.text_loss_weight=heavy"],
            "config key 'objective.text_loss_weight': got 'heavy'; expected a number",
        ),
        (
            ["objective.mode=both"],
            "config key 'objective.mode': got 'both'; expected one of 'l2t', 't2l', 'joint', 'random', 'sequential'",
        ),
        (
            ["objective.mode=sequential", "objective.mode_schedule=[[5, l2t]]"],
            "config key 'objective.mode_schedule': got [[5, 'l2t']]; "
            "expected a list whose first entry starts at step 0",
        ),
        (["objective.seed=-1"], "config key 'objective.seed': got -1; expected an integer >= 0"),
        (
            ["text_diffusion.schedule=cosine"],
            "config key 'text_diffusion.schedule': got 'cosine'; expected one of 'loglinear', 'linear'",
        ),
        (
            ["latent_diffusion.prediction=score"],
            "config key 'latent_diffusion.prediction': got 'score'; expected one of 'eps', 'x0', 'v'",
        ),
    ],
)
def test_bad_config_names_key_value_and_allowed(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(expected)


# --------------------------------------------------------------------------------------------------
# Self-conditioning and the length head.


class SelfConditionedRecorder(RecordingModel):
    """A stand-in that also takes the self-conditioning input and records the grad mode of each call;
    its latent prediction is a fixed function of the noised latent (not zero), so the x0 estimate
    fed back is something to check."""

    def __call__(
        self,
        tokens,
        latents,
        t_text,
        t_latent,
        text_pad_mask=None,
        latent_null=None,
        *,
        text_head=True,
        latent_head=True,
        text_rows=None,
        latent_self_cond=None,
        length_from=None,
        text_lengths=None,
    ):
        out = super().__call__(
            tokens,
            latents,
            t_text,
            t_latent,
            text_pad_mask,
            latent_null,
            text_head=text_head,
            latent_head=latent_head,
            text_rows=text_rows,
        )
        self.calls[-1].update(latent_self_cond=latent_self_cond, grad_enabled=torch.is_grad_enabled())
        latent = 0.5 * latents if latent_head else None
        if latent is not None and torch.is_grad_enabled():
            latent = latent.requires_grad_()
        return ModelOutput(out.text_logits, latent, None)


def test_without_self_conditioning_the_model_is_called_once_and_gets_no_estimate():
    _, _, call, _, _ = run_recorded("t2l")
    assert "latent_self_cond" not in call  # RecordingModel would have failed on the keyword
    names = [n for n, _ in tiny_model().named_parameters()]
    assert not any("self_cond" in n for n in names)
    # A self-conditioned model starts equal to the plain one (its input projection is zero).
    cfg = dataclasses.replace(load_model_preset("tiny"), latent_dim=D, num_latents=1, max_seq_len=L)
    torch.manual_seed(0)
    plain = MultimodalMMDiT(cfg, vocab_size=VOCAB)
    torch.manual_seed(0)
    conditioned = MultimodalMMDiT(dataclasses.replace(cfg, self_condition=True), vocab_size=VOCAB)
    conditioned.load_state_dict(plain.state_dict(), strict=False)
    batch = make_batch()
    a = make_objective(batch, mode="t2l")(plain, batch, 0, generator=torch.Generator().manual_seed(1))[0]
    b = make_objective(batch, mode="t2l", self_condition=True, self_condition_prob=1.0)(
        conditioned, batch, 0, generator=torch.Generator().manual_seed(1)
    )[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-5)


@pytest.mark.parametrize("mode", ["t2l", "joint"])
def test_self_conditioning_feeds_a_gradient_free_x0_estimate(mode):
    batch = make_batch()
    objective = make_objective(
        batch, mode=mode, self_condition=True, self_condition_prob=1.0, latent_cfg=LatentDiffusionConfig(prediction="v")
    )
    model = SelfConditionedRecorder()
    objective(model, batch, step=0, generator=torch.Generator().manual_seed(1))
    first, second = model.calls
    assert not first["grad_enabled"] and second["grad_enabled"]
    assert first["latent_head"] and not first["text_head"]  # the first pass only estimates x0
    estimate = second["latent_self_cond"]
    assert not estimate.requires_grad
    expected, _ = objective.latent.predict_x0_eps(0.5 * first["latents"], first["latents"], first["t_latent"])
    torch.testing.assert_close(estimate, expected)
    # l2t keeps its latent clean: nothing to estimate, one call.
    model = SelfConditionedRecorder()
    make_objective(batch, mode="l2t", self_condition=True, self_condition_prob=1.0)(
        model, batch, step=0, generator=torch.Generator().manual_seed(1)
    )
    assert len(model.calls) == 1 and model.calls[0]["latent_self_cond"] is None
    # With probability 0 the trained pass sees no estimate (zeros inside the model).
    model = SelfConditionedRecorder()
    make_objective(batch, mode=mode, self_condition=True, self_condition_prob=0.0)(
        model, batch, step=0, generator=torch.Generator().manual_seed(1)
    )
    assert len(model.calls) == 1 and model.calls[0]["latent_self_cond"] is None


def test_length_head_learns_the_lengths_of_an_overfit_set():
    batch = make_batch()  # 8 texts of lengths 16, 16, 14, 12, 16, 9, 16, 11, each with its own latent
    objective = make_objective(batch, mode="t2l", length_head=True)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for step in range(60):
        loss, metrics = objective(model, batch, step, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    assert metrics["length_accuracy"].item() == 1.0, metrics["length_loss"]
    with torch.no_grad():
        predicted = model.length_logits(objective.latent.standardize(batch["latents"])).argmax(dim=1) + 1
    assert predicted.tolist() == batch["pad_mask"].sum(dim=1).tolist()


def test_per_sample_losses_add_up_to_the_batch_losses():
    batch = make_batch()
    model = tiny_model()
    objective = make_objective(batch, mode="joint", cond_drop_prob=0.0)
    objective.per_sample = True
    _, metrics = objective(model, batch, step=0, generator=torch.Generator().manual_seed(0))
    nats, tokens = metrics["nats_per_sample"], metrics["num_tokens_per_sample"]
    assert torch.equal(tokens, batch["pad_mask"].sum(dim=1))
    assert (nats.sum() / tokens.sum()).item() == pytest.approx(metrics["text_loss"].item(), rel=1e-5)
    assert metrics["latent_loss_per_sample"].shape == (B,)
    assert metrics["latent_loss_per_sample"].mean().item() == pytest.approx(metrics["latent_loss"].item(), rel=1e-5)
