"""The two diffusion processes, one module each, kept apart from the network and the sampler:
`MaskedDiffusion` (MDLM over tokens) and `GaussianDiffusion` (continuous-time cosine over latents).
Each offers `add_noise`, `loss` and `step`."""

from mmldlm.diffusion.gaussian import GaussianDiffusion
from mmldlm.diffusion.masked import MaskedDiffusion

__all__ = ["GaussianDiffusion", "MaskedDiffusion"]
