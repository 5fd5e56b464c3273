"""MM-LDLM: multimodal latent diffusion language models (masked text diffusion + Gaussian latent diffusion)."""

__version__ = "0.1.0"
