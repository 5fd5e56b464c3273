"""Learning rate by optimizer step, with reduce-on-plateau on top.

Every kind starts with a linear warmup over `warmup_steps` (step s uses (s + 1) / W of the peak, so
the first update is not wasted at LR 0). After warmup:
- constant:        the peak LR.
- warmup_cosine:   half a cosine from the peak down to `min_lr_ratio * peak`, reached at the last step.
- cosine_restarts: cosine cycles of `restart_period` steps (SGDR, Loshchilov & Hutter 2017) from
                   the peak down to the floor, restarting at the peak.
- wsd:             warmup-stable-decay: the peak until the last `decay_fraction` of the post-warmup
                   steps, then linear down to the floor at the last step.
The last step is the schedule's own (`num_steps`) where it is set, else the run's. Past it (a resumed run
given more steps than planned, or evaluation) the LR stays at its last-step value: it never rises
again, in particular a cosine restart never starts there.
"""

from __future__ import annotations

import math

import torch

from mmldlm.config import ScheduleConfig


class LRSchedule:
    """`lr(step)` for optimizer steps 0 .. total_steps - 1 (cfg.num_steps, else the run's `total_steps`);
    `observe(loss)` feeds reduce-on-plateau."""

    def __init__(self, cfg: ScheduleConfig, peak_lr: float, total_steps: int):
        self.cfg = cfg
        self.peak_lr = peak_lr
        self.total_steps = cfg.num_steps or total_steps
        # Reduce-on-plateau state: a multiplier on the schedule that only ever shrinks.
        self.plateau_scale = 1.0
        self.best_loss = math.inf
        self.num_bad_windows = 0
        self.window_sum = 0.0
        self.window_count = 0

    def base_factor(self, step: int) -> float:
        """The schedule's multiplier of the peak LR at `step`, without the plateau scale."""
        cfg = self.cfg
        step = min(step, self.total_steps - 1)  # never rises past the last step
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        floor = cfg.min_lr_ratio
        after = step - cfg.warmup_steps
        span = max(1, self.total_steps - 1 - cfg.warmup_steps)  # the last step reaches the floor
        if cfg.kind == "constant":
            return 1.0
        if cfg.kind == "warmup_cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, after / span)))
        if cfg.kind == "cosine_restarts":
            phase = (after % cfg.restart_period) / cfg.restart_period
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * phase))
        # wsd
        num_decay = max(1, math.ceil(cfg.decay_fraction * span))
        decay_start = span - num_decay
        if after <= decay_start:
            return 1.0
        return 1.0 - (1 - floor) * (after - decay_start) / num_decay

    def lr(self, step: int) -> float:
        scheduled = self.peak_lr * self.base_factor(step)
        if self.plateau_scale == 1.0:
            return scheduled
        # The plateau floor never lifts the LR above the schedule (e.g. during warmup).
        return max(scheduled * self.plateau_scale, min(self.cfg.plateau.min_lr, scheduled))

    def observe(self, loss: float) -> bool:
        """Record one step's training loss; returns True when the plateau rule just reduced the LR."""
        plateau = self.cfg.plateau
        if not plateau.enabled:
            return False
        self.window_sum += loss
        self.window_count += 1
        if self.window_count < plateau.every:
            return False
        mean = self.window_sum / self.window_count
        self.window_sum, self.window_count = 0.0, 0
        if mean < self.best_loss * (1 - plateau.threshold):
            self.best_loss, self.num_bad_windows = mean, 0
            return False
        self.num_bad_windows += 1
        if self.num_bad_windows <= plateau.patience:
            return False
        self.num_bad_windows = 0
        self.plateau_scale *= plateau.factor
        return True

    def apply(self, optimizer, step: int) -> float:
        """Set every param group's LR for `step`; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW keeps it as a tensor, changed in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {
            "plateau_scale": self.plateau_scale,
            "best_loss": self.best_loss,
            "num_bad_windows": self.num_bad_windows,
            "window_sum": self.window_sum,
            "window_count": self.window_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.plateau_scale = state["plateau_scale"]
        self.best_loss = state["best_loss"]
        self.num_bad_windows = state["num_bad_windows"]
        self.window_sum = state["window_sum"]
        self.window_count = state["window_count"]
