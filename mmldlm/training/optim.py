"""AdamW with decoupled weight decay on weight matrices only.

Weight decay pulls parameters towards zero. That is a useful prior for the weight matrices of linear
layers, and harmful for everything else: norm gains (decay towards 0 instead of 1), biases, token
and position embeddings (rare tokens would shrink to nothing), and the learned null latent (the CFG
"no condition" vector must keep its scale). So the rule is by module type, not by name matching:
the `weight` of an `nn.Linear` decays, every other parameter does not.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mmldlm.config import OptimConfig
from mmldlm.library_noise import quiet_library_noise

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: Linear weights with `weight_decay`, all other parameters without."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() dedups shared (tied) tensors
        if param.requires_grad:
            (decay if id(param) in decay_ids else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`: the fused kernel when asked for or (auto) when the device has one,
    else the foreach kernel (one launch over all tensors), or with optim.foreach=false the
    per-parameter loop (baseline recipe: mmldlm/baseline.py). The choice and any fallback reason
    are logged."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.state_dtype != "fp32":
        return low_bit_adamw(groups, cfg.state_dtype, kwargs)
    unfused = "foreach" if cfg.foreach else "per-parameter loop"
    if cfg.fused is False:
        log.info("optimizer: AdamW (%s), optim.fused=false", unfused)
        return torch.optim.AdamW(groups, foreach=cfg.foreach, fused=False, **kwargs)
    try:
        optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:
        if cfg.fused is True:
            raise RuntimeError(
                f"optim.fused=true but fused AdamW is unavailable here: {err}; "
                "set optim.fused=auto to fall back to the foreach kernel"
            ) from err
        log.info("optimizer: AdamW (%s); the fused kernel is unavailable: %s", unfused, err)
        return torch.optim.AdamW(groups, foreach=cfg.foreach, fused=False, **kwargs)
    log.info("optimizer: AdamW (fused)")
    return optimizer


# Bytes per parameter of AdamW's two moments, by optim.state_dtype (int8/int4: the codes plus one
# fp32 scale per block of 256/128 values).
STATE_BYTES = {"fp32": 8.0, "int8": 2 * (1 + 4 / 256), "int4": 2 * (0.5 + 4 / 128)}


def low_bit_adamw(groups: list[dict], state_dtype: str, kwargs: dict) -> torch.optim.Optimizer:
    """torchao's AdamW with block-quantized moments (fp32 weights, decoupled weight decay)."""
    quiet_library_noise()
    from torchao.optim import AdamW4bit, AdamW8bit  # here: only optim.state_dtype int8/int4 needs it

    optimizer_class = {"int8": AdamW8bit, "int4": AdamW4bit}[state_dtype]
    log.info("optimizer: %s (torchao; moments %s, weights fp32)", optimizer_class.__name__, state_dtype)
    return optimizer_class(groups, **kwargs)


def gradient_norm(grads: list[torch.Tensor], plain: bool | None = None) -> torch.Tensor:
    """The 2-norm of `grads` taken together, `torch.nn.utils.get_total_norm`'s result to the bit: on
    plain tensors of one device and dtype, one `_foreach_norm`, a stack and a norm. get_total_norm also
    moves every per-tensor norm to the first tensor's device, one host operation per tensor even where
    nothing moves (314 of a compiled step's 1,843 host calls at 24 blocks, docs/benchmarks.md); it remains the
    way for FSDP2's DTensor shards, mixed devices or dtypes. `plain`: whether the gradients are plain
    tensors of one device and dtype, where the caller knows (None: checked here, tensor by tensor)."""
    if not grads:
        return torch.nn.utils.get_total_norm(grads)
    first = grads[0]
    if plain is None:
        plain = all(type(g) is torch.Tensor and g.device == first.device and g.dtype == first.dtype for g in grads)
    if plain and first.device.type in ("cpu", "cuda"):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    return torch.nn.utils.get_total_norm(grads)
