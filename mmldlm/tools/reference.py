"""The reference row of `mmldlm bench --reference`: a plain transformer of the config's text-stream
dimensions (mmldlm/model/reference.py) trained by our own `Trainer`, so that its precision, fused
AdamW, gradient clipping, compile, activation checkpointing and step timing are exactly a config's.
Its batches are full rows of the data's longest text (after data.max_length), with no padding and no
mask: the shape a GPU runs fastest, and the work our model does per real token of the same length."""

from __future__ import annotations

import dataclasses

import torch

from mmldlm.config import RunConfig
from mmldlm.data import model_for_dataset
from mmldlm.model.reference import PlainObjective, PlainTransformer
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import open_train_data
from mmldlm.training.trainer import Trainer, seed_everything


class FullRows:
    """An endless loader of (micro-batch, length) rows of random token ids (2..V-1: no [PAD], no
    [MASK]); what the ids say does not change a step's cost."""

    def __init__(self, micro_batch_size: int, length: int, vocab_size: int, seed: int):
        self.shape, self.vocab_size = (micro_batch_size, length), vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            yield {"tokens": torch.randint(2, self.vocab_size, self.shape, generator=self.generator)}


def build_reference_trainer(cfg: RunConfig, info: DistInfo) -> Trainer:
    """A Trainer of the plain transformer with `cfg`'s model dimensions and training switches. The
    micro-batch and activation checkpointing must be resolved (not "auto"): the memory probes run
    our objective's joint mode, which the plain model does not have."""
    for key, value in (
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("perf.activation_checkpointing", cfg.perf.activation_checkpointing),
    ):
        if value == "auto":
            raise ValueError(f"the reference row needs {key} resolved, got 'auto'")
    dataset, _, data_cfg = open_train_data(cfg, info)
    longest = int(dataset.lengths().max())
    length, vocab_size = min(longest, data_cfg.max_length or longest), cfg.model.vocab_size or dataset.vocab_size
    seed_everything(cfg.train.seed)
    model_cfg = dataclasses.replace(model_for_dataset(cfg.model, dataset), max_seq_len=length)
    model = PlainTransformer(model_cfg, vocab_size)
    seed = cfg.train.seed + info.rank

    def loader(micro_batch_size: int) -> FullRows:
        return FullRows(micro_batch_size, length, vocab_size, seed)

    return Trainer(cfg, model, PlainObjective(), loader, info, max_seq_len=length)
