"""AdamW groups and LR schedules."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from mmldlm.config import OptimConfig, PlateauConfig, ScheduleConfig
from mmldlm.training.optim import build_optimizer, param_groups
from mmldlm.training.schedules import LRSchedule


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.null_latent = nn.Parameter(torch.zeros(1, 8))


def test_weight_decay_only_on_linear_weights():
    net = _Net()
    decay, no_decay = param_groups(net, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(net.proj.weight)]
    expected = {id(net.embed.weight), id(net.norm.weight), id(net.norm.bias), id(net.proj.bias), id(net.null_latent)}
    assert {id(p) for p in no_decay["params"]} == expected


def test_no_decay_params_do_not_shrink_without_gradient_signal():
    net = _Net()
    opt = build_optimizer(net, OptimConfig(lr=0.1, weight_decay=0.5, fused=False))
    before = net.embed.weight.detach().clone()
    w_before = net.proj.weight.detach().clone()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(net.embed.weight, before)  # zero grad, no decay: unchanged
    assert net.proj.weight.abs().sum() < w_before.abs().sum()  # decayed


def test_fused_auto_builds_an_optimizer():
    opt = build_optimizer(_Net(), OptimConfig(fused="auto"))
    assert isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("kind", ["constant", "warmup_cosine", "cosine_restarts", "wsd"])
def test_schedule_warmup_then_never_rises_after_last_step(kind):
    total = 100
    sched = LRSchedule(ScheduleConfig(kind=kind, warmup_steps=10, min_lr_ratio=0.1, restart_period=30), 1.0, total)
    lrs = [sched.lr(s) for s in range(total + 50)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    tail = lrs[total - 1 :]
    assert all(x == tail[0] for x in tail)  # frozen past the last step
    assert min(lrs[10:]) >= 0.1 - 1e-12


def test_cosine_reaches_floor_at_last_step_and_wsd_shape():
    cos = LRSchedule(ScheduleConfig(kind="warmup_cosine", warmup_steps=0, min_lr_ratio=0.2), 2.0, 50)
    assert cos.lr(0) == pytest.approx(2.0) and cos.lr(49) == pytest.approx(0.4)
    lrs = [cos.lr(s) for s in range(50)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    wsd = LRSchedule(ScheduleConfig(kind="wsd", warmup_steps=0, min_lr_ratio=0.0, decay_fraction=0.2), 1.0, 101)
    assert wsd.lr(79) == 1.0 and wsd.lr(100) == pytest.approx(0.0) and 0 < wsd.lr(90) < 1


def test_a_schedule_longer_than_the_run_ends_partway_down_its_cosine():
    # A run taken over from one whose cosine spanned a million steps while it trained 800.
    cfg = ScheduleConfig(kind="warmup_cosine", warmup_steps=100, min_lr_ratio=0.0, num_steps=1_000_000)
    sched = LRSchedule(cfg, 1.0, 800)
    assert sched.lr(99) == 1.0 and sched.lr(799) == pytest.approx(0.5 * (1 + math.cos(math.pi * 699 / 999_899)))
    assert sched.lr(799) > 0.9999 and LRSchedule(dataclasses.replace(cfg, num_steps=None), 1.0, 800).lr(799) == 0.0


def test_cosine_restarts_restart_at_peak():
    sched = LRSchedule(
        ScheduleConfig(kind="cosine_restarts", warmup_steps=0, min_lr_ratio=0.0, restart_period=10), 1.0, 100
    )
    assert sched.lr(0) == 1.0 and sched.lr(10) == 1.0 and sched.lr(9) < 0.05
    assert sched.lr(5) == pytest.approx(0.5)


def test_plateau_reduces_after_patience_and_state_round_trips():
    cfg = ScheduleConfig(
        kind="constant",
        warmup_steps=0,
        plateau=PlateauConfig(enabled=True, every=2, patience=1, factor=0.5, min_lr=0.3),
    )
    sched = LRSchedule(cfg, 1.0, 1000)
    reductions = [sched.observe(1.0) for _ in range(2)]  # first window sets the best
    reductions += [sched.observe(1.0) for _ in range(4)]  # two windows without improvement
    assert reductions.count(True) == 1 and sched.lr(5) == 0.5
    for _ in range(8):
        sched.observe(1.0)
    assert sched.lr(5) == 0.3  # floored at min_lr
    clone = LRSchedule(cfg, 1.0, 1000)
    clone.load_state_dict(sched.state_dict())
    assert clone.lr(7) == sched.lr(7) and clone.state_dict() == sched.state_dict()
    assert not math.isinf(clone.best_loss)
