"""The baseline recipe: what `mmldlm bench` measures the optimized presets against
(configs/baseline.yaml). None of it is for real runs; it is kept so the speed-ups stay measurable.

Its switches, and where the core consults each (every such line says "baseline recipe"):

    model.attention=explicit           `explicit_attention`: the (Sq, S) score matrix materialised per head;
                                       model/mmdit.py `attend`
    perf.refreeze_every_step           `refreeze`: requires_grad set on every parameter at every step;
                                       training/trainer.py `train_step`
    latent_diffusion.loss=normalized_mse
                                       `normalized_mse`: MSE of L2-normalised vectors, ~1/D in scale;
                                       diffusion/gaussian.py `loss`
    optim.fused=false, optim.foreach=false
                                       torch AdamW's own per-parameter loop (no code here); training/optim.py
    distributed.find_unused_parameters=true
                                       DDP's autograd-graph walk every step (no code here); training/parallelize.py
    perf.fused_text_loss=false         the text head's (N, V) logits, then the loss: the path sampling reads
                                       too (no code here); objective.py
    train.precision=fp32, the loader   ordinary config values (no code here)

The optimized path of each lives where it is consulted; only the baseline recipe's own code is here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float) -> Tensor:
    """softmax(q k^T / sqrt(hd)) v with the score matrix materialised; q (B, nh, Sq, hd), k and v
    (B, nh, S, hd), attn_mask broadcastable to (B, nh, Sq, S), True = attend."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, nh, Sq, S)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout_p)
    return weights @ v


def refreeze(parameters: Iterable[torch.nn.Parameter], idle: list[torch.nn.Parameter]) -> None:
    """A pass over every parameter setting requires_grad: the idle head frozen, the rest trainable
    (the optimized path freezes once per mode: training/parallelize.py)."""
    idle_ids = {id(p) for p in idle}
    for p in parameters:
        p.requires_grad_(id(p) not in idle_ids)


def normalized_mse(x0_hat: Tensor, x0: Tensor) -> Tensor:
    """MSE between L2-normalised x0_hat and x0 along the last dim: 2 (1 - cos) / D per vector, ~1/D in
    scale and blind to magnitude."""
    return F.mse_loss(F.normalize(x0_hat, dim=-1), F.normalize(x0, dim=-1))
