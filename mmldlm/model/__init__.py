"""The MultimodalMMDiT network and its size accounting."""

from mmldlm.model.info import parameter_counts, training_flops_per_sample
from mmldlm.model.mmdit import ModelOutput, MultimodalMMDiT

__all__ = ["ModelOutput", "MultimodalMMDiT", "parameter_counts", "training_flops_per_sample"]
