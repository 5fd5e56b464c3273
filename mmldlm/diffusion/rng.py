"""Random draws that follow an optional `torch.Generator` wherever it lives.

Torch requires a generator on the device it draws on; drawing on the generator's device and moving
the result lets the trainer keep one checkpointable generator whatever the model's device. The
trainer's is on the CPU: its draws, and what the training step decides from them (which tokens are
masked, where the text head runs), are known on the host and reach the device by `to_device`, which
never makes the host wait for the device. Without a generator the global RNG of `device` is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _draw_device(device: torch.device, generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device(device)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """x on `device`; from the host to a CUDA device through pinned memory and a copy that does not
    wait (a pageable or blocking copy makes the host wait until the device has run what is queued)."""
    device = torch.device(device)
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=x.device.type == "cpu")


# Each tensor's bytes start at a multiple of this in `to_device_together`'s shared copy: every dtype's
# view of its part is then aligned, as inductor's GPU kernels also expect of their inputs.
ALIGNMENT = 16


def to_device_together(tensors: Sequence[torch.Tensor | None], device) -> list[torch.Tensor | None]:
    """`tensors` on `device`, where those that move go from the host in one copy: their bytes laid end
    to end in one pinned buffer, copied without waiting, each given back as a view of its part. A CUDA
    device then takes one copy a call where it took a pinning and a copy per tensor. None, and tensors
    already on `device`, pass through; tensors that need a gradient, or that come from another device
    than the host, move one by one (`to_device`)."""
    device = torch.device(device)
    moving = [i for i, x in enumerate(tensors) if x is not None and x.device != device]
    if len(moving) < 2 or any(tensors[i].device.type != "cpu" or tensors[i].requires_grad for i in moving):
        return [x if x is None else to_device(x, device) for x in tensors]
    buffer, places = laid_end_to_end([tensors[i] for i in moving], pin=device.type == "cuda")
    moved = list(tensors)
    for i, x in zip(moving, views_of(buffer.to(device, non_blocking=True), places)):
        moved[i] = x
    return moved


def laid_end_to_end(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[tuple]]:
    """The bytes of host `tensors` in one uint8 buffer (pinned where `pin`), each at a multiple of
    ALIGNMENT bytes, and where each lies: (offset, bytes, dtype, shape) for `views_of`."""
    places, total = [], 0
    for x in tensors:
        nbytes = x.numel() * x.element_size()
        places.append((total, nbytes, x.dtype, x.shape))
        total += -(-nbytes // ALIGNMENT) * ALIGNMENT
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for x, (offset, nbytes, _, _) in zip(tensors, places):
        buffer[offset : offset + nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
    return buffer, places


def views_of(buffer: torch.Tensor, places: Sequence[tuple]) -> list[torch.Tensor]:
    """The tensors `laid_end_to_end` placed in `buffer` (or in its copy on another device), as views."""
    return [buffer[offset : offset + nbytes].view(dtype).view(shape) for offset, nbytes, dtype, shape in places]


def uniform(shape, device, generator=None, dtype=torch.float32) -> torch.Tensor:
    """U[0, 1) of `shape` on `device`."""
    out = torch.rand(shape, generator=generator, device=_draw_device(device, generator), dtype=dtype)
    return to_device(out, device)


def normal(shape, device, generator=None, dtype=torch.float32) -> torch.Tensor:
    """N(0, 1) of `shape` on `device`."""
    out = torch.randn(shape, generator=generator, device=_draw_device(device, generator), dtype=dtype)
    return to_device(out, device)


def permutation(n: int, device, generator=None) -> torch.Tensor:
    """A random permutation of range(n) on `device`."""
    return to_device(torch.randperm(n, generator=generator, device=_draw_device(device, generator)), device)


def gumbel(shape, device, generator=None) -> torch.Tensor:
    """Standard Gumbel noise of `shape` on `device`, float64: float32 noise is truncated in its tail
    and lowers the effective temperature of Gumbel-max sampling (Zheng et al. 2024, arXiv:2409.02908)."""
    u = uniform(shape, device, generator, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))
