"""The MultimodalMMDiT network and its size accounting."""

from mmldlm.model.info import parameter_counts, training_flops_per_sample
from mmldlm.model.mmdit import MultimodalMMDiT

__all__ = ["MultimodalMMDiT", "parameter_counts", "training_flops_per_sample"]
