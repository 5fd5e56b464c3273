"""Turning a trained run into text, latents and numbers.

sampler.py     the l2t / t2l / joint samplers (MDLM and DDIM/DDPM steps, guidance, output reuse)
run.py         a run's config + checkpoint -> model, diffusions, tokenizer, validation split, encoder
pretrained.py  an exported model folder (write, read) and the MMLDLM Python API
card.py        the exported folder's model card, from the run directory
evaluate.py    validation ELBO per mode, l2t reconstruction, t2l cosine and retrieval, the report
intervals.py   bootstrap intervals of the report's figures and paired differences of two reports
compare.py     two reports of the same texts, figure by figure (`mmldlm compare`)
"""

from mmldlm.sampling.pretrained import MMLDLM, load_trained
from mmldlm.sampling.run import TrainedRun, load_run
from mmldlm.sampling.sampler import Sampler, SamplingOptions, pad_mask_from_lengths, time_grid

__all__ = [
    "MMLDLM",
    "Sampler",
    "SamplingOptions",
    "TrainedRun",
    "load_run",
    "load_trained",
    "pad_mask_from_lengths",
    "time_grid",
]
