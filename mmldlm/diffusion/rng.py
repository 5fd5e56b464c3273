"""Random draws that follow an optional `torch.Generator` wherever it lives.

Torch requires a generator on the device it draws on; drawing on the generator's device and moving
the result lets the trainer keep one checkpointable generator whatever the model's device. The
trainer's is on the CPU: its draws, and what the training step decides from them (which tokens are
masked, where the text head runs), are known on the host and reach the device by `to_device`, which
never makes the host wait for the device. Without a generator the global RNG of `device` is used.
"""

from __future__ import annotations

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
