"""The EMA of the weights: the warm-up recursion, checkpoints that carry it, and sampling from it."""

import pytest
import torch
from loader_support import SyntheticLoader
from torch import nn

from mmldlm.config import ModelConfig, load_config
from mmldlm.diffusion import GaussianDiffusion, MaskedDiffusion
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.objective import Objective
from mmldlm.runs.checkpoints import has_ema
from mmldlm.training.distributed import DistInfo
from mmldlm.training.ema import WeightEMA, warmup_decay
from mmldlm.training.trainer import Trainer

VOCAB, LEN, DIM = 40, 8, 16


def test_ema_after_n_updates_equals_the_warmup_recursion_written_out():
    """Weights theta_k = k * w0 at update k: the average is sum_k c_k theta_k with the weights that
    the recursion ema <- d_n ema + (1 - d_n) theta gives, written out here in float64."""
    model = nn.Linear(3, 2)
    w0 = [p.detach().clone().double() for p in model.parameters()]
    ema = WeightEMA(model, decay=0.9)
    expected = None
    for k in range(1, 41):
        with torch.no_grad():
            for p, base in zip(model.parameters(), w0):
                p.copy_(k * base)
        n = ema.num_averaged
        ema.update(model)
        theta = [k * base for base in w0]
        if expected is None:  # the first update copies the weights
            expected = theta
        else:
            d = min(0.9, (1 + n) / (10 + n))
            expected = [d * e + (1 - d) * t for e, t in zip(expected, theta)]
    assert ema.num_averaged == 40
    for p, e in zip(ema.module.parameters(), expected):
        torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6)
    # The warm-up: small n averages fast, large n reaches the configured decay.
    assert warmup_decay(0.999, 0) == pytest.approx(0.1) and warmup_decay(0.999, 10**6) == 0.999
    for p in ema.module.parameters():
        assert not p.requires_grad


def make_trainer(tmp_path, steps, ema_decay=0.9, resume=None):
    cfg = load_config(
        None,
        [
            "train.log_every=1",
            "logging.progress_bar=false",
            "schedule.warmup_steps=0",
            "schedule.kind=constant",
            "optim.lr=0.01",
            f"train.run_dir={tmp_path}",
            f"train.steps={steps}",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.precision=fp32",
            "train.deterministic=true",
            f"train.ema_decay={ema_decay}",
            "checkpoint.every=3",
            "objective.mode=random",
        ],
    )
    torch.manual_seed(0)
    model = MultimodalMMDiT(
        ModelConfig(
            hidden_size=32,
            num_blocks=2,
            num_heads=2,
            max_seq_len=LEN,
            latent_dim=DIM,
            num_latents=1,
            timestep_embed_dim=16,
        ),
        vocab_size=VOCAB,
    )
    objective = Objective(
        cfg.objective,
        MaskedDiffusion(cfg.text_diffusion, mask_token_id=1, pad_token_id=0),
        GaussianDiffusion(cfg.latent_diffusion),
        length_head=True,
    )
    trainer = Trainer(cfg, model, objective, SyntheticLoader(4, VOCAB, LEN, DIM, pad_id=0, first_token=2), DistInfo())
    trainer.resume(resume)
    return trainer


def test_resumed_ema_equals_the_uninterrupted_ema_bit_for_bit(tmp_path):
    straight = make_trainer(tmp_path / "a", steps=8)
    assert straight.fit() == 0
    first = make_trainer(tmp_path / "b", steps=5)  # checkpoints at 3 and (last step) 5
    assert first.fit() == 0
    resumed = make_trainer(tmp_path / "b", steps=8, resume="auto")
    assert resumed.step == 5 and resumed.ema.num_averaged == 5
    assert resumed.fit() == 0
    for (name, a), b in zip(straight.ema.module.named_parameters(), resumed.ema.module.parameters()):
        assert torch.equal(a, b), name
    # The average lags the weights: it is not a copy of them.
    assert any(not torch.equal(a, b) for a, b in zip(straight.ema.module.parameters(), straight.raw_model.parameters()))
    assert has_ema(tmp_path / "b" / "checkpoints" / "step-0000008")


def test_resuming_a_run_without_ema_starts_the_average_from_the_weights(tmp_path):
    plain = make_trainer(tmp_path, steps=3, ema_decay=0.0)
    assert plain.fit() == 0 and plain.ema is None
    resumed = make_trainer(tmp_path, steps=4, resume="auto")
    assert resumed.ema.num_averaged == 0
    assert resumed.fit() == 0
    for a, b in zip(resumed.ema.module.parameters(), resumed.raw_model.parameters()):
        assert torch.equal(a, b)  # the first update copied the weights of step 4
