"""Random draws that follow an optional `torch.Generator` wherever it lives.

Torch requires a generator on the device it draws on; drawing on the generator's device and moving
the result lets the trainer keep one checkpointable (CPU or CUDA) generator whatever the model's
device. Without a generator the global RNG of `device` is used.
"""

from __future__ import annotations

import torch


def _draw_device(device: torch.device, generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device(device)


def uniform(shape, device, generator=None, dtype=torch.float32) -> torch.Tensor:
    """U[0, 1) of `shape` on `device`."""
    out = torch.rand(shape, generator=generator, device=_draw_device(device, generator), dtype=dtype)
    return out.to(device)


def normal(shape, device, generator=None, dtype=torch.float32) -> torch.Tensor:
    """N(0, 1) of `shape` on `device`."""
    out = torch.randn(shape, generator=generator, device=_draw_device(device, generator), dtype=dtype)
    return out.to(device)


def permutation(n: int, device, generator=None) -> torch.Tensor:
    """A random permutation of range(n) on `device`."""
    return torch.randperm(n, generator=generator, device=_draw_device(device, generator)).to(device)


def gumbel(shape, device, generator=None) -> torch.Tensor:
    """Standard Gumbel noise of `shape` on `device`, float64: float32 noise is truncated in its tail
    and lowers the effective temperature of Gumbel-max sampling (Zheng et al. 2024, arXiv:2409.02908)."""
    u = uniform(shape, device, generator, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))
