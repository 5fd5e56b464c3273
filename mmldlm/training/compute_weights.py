"""Low-precision compute weights (perf.compute_weights): the model's linear layers and RMSNorms read bf16
copies of their weights in training, written from the float32 weights once per step, instead of
autocast casting every weight at every use and casting its gradient back.

Under bf16 autocast each matrix of a block costs two casts per micro-batch: the weight to bf16 before
its product (read 4 bytes, write 2) and the product's bf16 gradient to float32 after it (read 2, write
4), two kernels each, per weight, per block. With the copies the forward reads them as they are, the
gradients stay bf16 where autograd leaves them, and after each micro-batch's backward one `_foreach`
operation adds them all into float32 gradients: the casts become three operations a step whatever the
depth (refresh the copies, copy or add the gradients), as mixed-precision frameworks keep bf16 compute
weights beside float32 master weights (Megatron-LM, FSDP2's `MixedPrecisionPolicy`).

The values are autocast's: a copy is the float32 weight rounded to bf16, as autocast's cast is, the
products and their bf16 gradients are the same, and the float32 gradients are those gradients widened
and summed in float32 as before: one step gives the same weights to the bit (tests/test_compute_weights.py).
The float32 weights stay the model's parameters: the optimizer, clipping, the EMA, checkpoints, evaluation
and sampling see nothing else. The copies are swapped in only while a step's forwards and backwards run
(activation checkpointing's recomputation included) and refreshed at the start of every step, so a
resumed or otherwise changed weight is never read stale.

What it costs: the copies (2 bytes per parameter they cover) and the float32 gradient buffers of those
parameters are kept between steps (4 bytes; the gradients of the other parameters are freed after each
update as before), so a forward runs beside them: up to 6 bytes per covered parameter more at the peak.
One process only: DDP and FSDP2 reduce gradients in hooks on the parameters' own gradients, which the
copies bypass (FSDP2's own `MixedPrecisionPolicy` is the sharded way to the same casts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def covered_parameters(model: nn.Module, fused_text_loss: bool = False) -> list[tuple[nn.Module, str]]:
    """(module, name) of each trained parameter the copies cover: those of every linear layer and
    RMSNorm (the QK-norm gains), whose products run in bf16 under autocast and whose gradients
    therefore arrive in bf16. Not the text head's weight under `fused_text_loss`: the fused loss
    returns its gradient in float32, which a bf16 copy would round; nor embeddings, which autocast
    leaves in float32."""
    skipped = set()
    head = getattr(getattr(model, "text_final", None), "head", None)
    if fused_text_loss and head is not None:
        skipped.add(id(head.weight))
    covered = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.RMSNorm)):
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in skipped:
                    covered.append((module, name))
    return covered


class ComputeWeights:
    """The bf16 copies of `covered_parameters(model)` and their float32 gradients (the module docstring).

    Per step: `active()` around every micro-batch's forward and backward, `accumulate(first)` after each
    backward."""

    def __init__(self, model: nn.Module, fused_text_loss: bool = False, dtype: torch.dtype = torch.bfloat16):
        self.model = model
        self.slots = covered_parameters(model, fused_text_loss)
        self.masters = [module._parameters[name] for module, name in self.slots]
        with torch.no_grad():
            self.copies = [nn.Parameter(p.detach().to(dtype)) for p in self.masters]
        # The float32 gradients: one buffer each, kept (a fresh tensor per step would cost one operation
        # per parameter, which is what the copies are here to save).
        self.grads = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in self.masters]
        self.dtype = dtype

    def share(self) -> float:
        """The share of the model's parameters the copies cover (by count)."""
        total = sum(p.numel() for p in self.model.parameters())
        return sum(p.numel() for p in self.masters) / total

    def num_bytes(self) -> int:
        """Bytes the copies and the gradient buffers keep."""
        return sum(c.numel() * c.element_size() + g.numel() * g.element_size() for c, g in zip(self.copies, self.grads))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The copies in the covered modules' places, refreshed from the float32 weights (one operation)."""
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.masters)
        for (module, name), copy in zip(self.slots, self.copies):
            module._parameters[name] = copy
        try:
            yield
        finally:
            for (module, name), master in zip(self.slots, self.masters):
                module._parameters[name] = master

    def accumulate(self, first: bool) -> None:
        """The copies' gradients of the last backward into the float32 weights' `.grad`: copied on the
        first micro-batch of a step, added on the others (one operation either way); the copies' own
        gradients are then dropped. A weight whose copy got no gradient (an idle head) is left alone."""
        have = [i for i, c in enumerate(self.copies) if c.grad is not None]
        if not have:
            return
        grads = [self.copies[i].grad for i in have]
        buffers = [self.grads[i] for i in have]
        with torch.no_grad():
            if first:
                torch._foreach_copy_(buffers, grads)
            else:
                torch._foreach_add_(buffers, grads)
        for i, buffer in zip(have, buffers):
            self.masters[i].grad = buffer
            self.copies[i].grad = None


def compute_weights_off_reason(precision: str, distributed: bool, step_in_backward: bool) -> str | None:
    """Why perf.compute_weights cannot apply to this trainer, None when it can."""
    if precision != "bf16":
        return f"train.precision resolves to {precision} (the copies are bf16 autocast's)"
    if distributed:
        return "more than one process (DDP and FSDP2 reduce gradients in hooks the copies bypass)"
    if step_in_backward:
        return "optim.step_in_backward updates each weight as its own gradient arrives"
    return None
