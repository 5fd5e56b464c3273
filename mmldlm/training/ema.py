"""An exponential moving average (EMA) of the weights, the copy that sampling and evaluation use.

After every optimizer step that updated the weights theta:

    ema <- d_n * ema + (1 - d_n) * theta,    d_n = min(decay, (1 + n) / (10 + n))

with n the number of updates averaged so far. The warm-up d_n keeps the first average from being
dominated by the random initial weights: with decay 0.999 the average would otherwise need
thousands of steps to forget them, longer than a short run. The first update copies theta.

torch's own helpers do the work: `torch.optim.swa_utils.AveragedModel` holds the copy and counts n
(its `n_averaged` buffer, saved with the checkpoint), and `get_ema_multi_avg_fn` applies the update
with one foreach kernel over all tensors. The copy is made from the plain model before the trainer
wraps it; under FSDP2 the copy is sharded like the model (each rank averages its own shards), under
DDP every rank keeps a whole copy (the ranks' weights are equal, so their averages are too).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def warmup_decay(decay: float, num_averaged: int) -> float:
    """d_n of the module docstring."""
    return min(decay, (1.0 + num_averaged) / (10.0 + num_averaged))


class WeightEMA:
    """The EMA of `model`'s parameters; `module` is a model of the same class holding the average."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"WeightEMA: decay {decay}; expected a number in (0, 1)")
        self.decay = decay
        self.averaged = AveragedModel(model, multi_avg_fn=self._average, use_buffers=False)
        self.averaged.requires_grad_(False)
        # (model, the average's tensors, the model's), listed at the first update: parameters() walks
        # every module and each detach is a host operation, 1.7-1.9 ms a step at 24 blocks. The
        # tensors share the parameters' memory, which the optimizer and checkpoint loads write in place.
        self._listed: tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    @property
    def num_averaged(self) -> int:
        return int(self.averaged.n_averaged.item())

    def _average(self, ema_params: list, params: list, num_averaged: torch.Tensor) -> None:
        get_ema_multi_avg_fn(warmup_decay(self.decay, int(num_averaged.item())))(ema_params, params, num_averaged)

    @torch.no_grad()
    def update(self, model: nn.Module, skip: torch.Tensor | None = None) -> None:
        """Fold `model`'s current parameters (the plain model, not a DDP wrapper) into the average.
        skip: () bool on the device, True = this step's update was skipped, leave the average (and n)
        as they are; decided on the device, so the host never waits for the step."""
        if skip is None:
            self.averaged.update_parameters(model)
            return
        n = self.averaged.n_averaged  # () on the device
        # d_n as in the module docstring; the first update (n = 0) copies theta: weight 1.
        decay = torch.clamp((1.0 + n) / (10.0 + n), max=self.decay).to(torch.float32)
        weight = torch.where(n == 0, 1.0, 1.0 - decay) * (~skip).to(torch.float32)
        if self._listed is None or self._listed[0] is not model:
            ema = [p.detach() for p in self.averaged.module.parameters()]
            self._listed = (model, ema, [p.detach() for p in model.parameters()])
        _, ema_params, params = self._listed
        torch._foreach_lerp_(ema_params, params, weight)  # ema += weight * (theta - ema)
        n += (~skip).to(n.dtype)
