"""The setup step that turns a plain `MultimodalMMDiT` into what the loop trains. The model file
knows nothing of this. The order is fixed (as in torchtitan): activation checkpointing of blocks,
then per-block `torch.compile`, then the data-parallel wrap (DDP or FSDP2), because each step must
see the modules the previous one produced.

The idle output head. In l2t the latent head is not computed, in t2l the text head is not (and
neither is the last block's tail that only feeds it: `model.latent_head_parameters()` /
`model.text_head_parameters()`). Under DDP with find_unused_parameters=False every parameter must
receive a gradient in every backward, or the reducer waits for it forever and errors on the next
step. Instead of paying for find_unused_parameters=True (an autograd-graph walk every step), the
loop *anchors* the idle parameters into the loss: `loss + 0 * sum(p.sum())` gives each of them an
exact zero gradient, so every bucket fills and the all-reduce proceeds. Because AdamW would still
move a parameter with a zero gradient (momentum and weight decay), the loop then sets the idle
parameters' `.grad` to None before the optimizer step: AdamW skips them, exactly as in a single
process where they simply got no gradient. Since every parameter now receives a gradient on every
step whatever the mode, the set of used parameters never changes and DDP's static_graph is valid.

FSDP2 needs no anchor: a parameter that took no part in the step keeps a None gradient after the
reduce-scatter (every rank runs the same mode at a given step), so the idle head is skipped the same way.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmldlm.config import DistributedConfig
from mmldlm.training.distributed import DistInfo


def parallelize(model: nn.Module, cfg: DistributedConfig, info: DistInfo) -> nn.Module:
    """Wrap `model` (already on its device) for data-parallel training; a single process trains it as is."""
    if not info.distributed:
        return model
    if cfg.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # Per block first, then the root (embeddings, heads, timestep MLPs): each block's parameters
        # are gathered just before it runs and freed after, overlapping with the neighbours' compute.
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    return DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        find_unused_parameters=False,  # the idle head is anchored instead (see the module doc)
        gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy, less memory
        # broadcast_buffers=False under its current name: no buffer broadcast before every forward
        # (the model has no buffers that training changes).
        forward_sync_buffers=False,
        static_graph=cfg.static_graph if cfg.static_graph != "auto" else True,
    )


def uses_anchor(cfg: DistributedConfig, info: DistInfo) -> bool:
    """Whether the loop must anchor idle-head parameters into the loss (DDP only)."""
    return info.distributed and cfg.strategy == "ddp"


def anchor(loss: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    """`loss` plus an exact zero that depends on every parameter in `params` (see the module doc)."""
    if not params:
        return loss
    return loss + 0.0 * sum(p.sum() for p in params)


def no_grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-step: on non-final micro-steps the gradient all-reduce / reduce-scatter
    is skipped and gradients accumulate locally; the final micro-step synchronises them all."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
