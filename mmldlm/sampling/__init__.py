"""The samplers: a model and its two diffusions -> text, latents or both.

sampler.py     the l2t / t2l / joint samplers (MDLM and DDIM/DDPM steps, guidance, output reuse)
decoding.py    the decoding strategies the sampler applies: confidence remasking, best-of-N, correction rounds

Public names: Sampler, SamplingOptions, pad_mask_from_lengths, time_grid. A trained run to sample from is
mmldlm/runs/trained.py (`load_run`); the MMLDLM Python API is mmldlm/export/pretrained.py.
"""

from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths, time_grid

__all__ = ["Sampler", "SamplingOptions", "pad_mask_from_lengths", "time_grid"]
