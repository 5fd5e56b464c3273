"""Turning a trained run into text, latents and numbers.

    sampler.py   the l2t / t2l / joint samplers (MDLM and DDIM/DDPM steps, guidance, output reuse)
    run.py       a run's config + checkpoint -> model, diffusions, tokenizer, validation split, encoder
    evaluate.py  validation ELBO per mode, l2t reconstruction, t2l cosine and retrieval, the report
"""

from mmldlm.sampling.run import TrainedRun, load_run
from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths, time_grid

__all__ = ["Sampler", "SamplingOptions", "TrainedRun", "load_run", "pad_mask_from_lengths", "time_grid"]
