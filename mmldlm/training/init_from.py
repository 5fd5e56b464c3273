"""Starting a new run from another run's weights (train.init_from, `mmldlm train --init-from SOURCE`):
fine-tuning a trained model on new data.

The source is a run directory (its newest checkpoint that verifies), one of its checkpoints, or an
exported model folder (`mmldlm export`); it is read whole in every process, as sampling reads it
(mmldlm/runs/trained.py `load_trained`), before anything of the new run is trained. Only the weights
come over (the EMA where the source kept one, unless train.init_weights is "raw"): the optimizer's
moments, the LR schedule, the data position and the step counter start afresh, and the new run writes
its own run directory. Two things must agree, else the start is refused naming what differs:
- the model: every tensor of the source's weights by name and shape (the new run's `model` config
  must build the source's network);
- the data: the new dataset reads as the source's did (the same tokenizer and sentence encoder),
  which `mmldlm prepare --like SOURCE` guarantees.

Loading into the wrapped model (DDP, FSDP2, HSDP) goes through torch's `set_model_state_dict` with the
full state on every rank: each rank keeps the slices of its own shards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from mmldlm.config import ConfigError
from mmldlm.data.errors import DataError
from mmldlm.export.pretrained import is_exported, load_trained, read_config
from mmldlm.runs.trained import TrainedRun, check_compatible, weight_mismatches

KEY = "train.init_from"
FULL_STATE = StateDictOptions(full_state_dict=True)


def read_source(source: str, weights: str) -> TrainedRun:
    """The model of `source` on the CPU with the weights asked for ("ema": its EMA where it has one;
    "raw": the trained weights); DataError when it cannot be read."""
    path = Path(source)
    if not path.is_dir():
        raise DataError(
            "no such directory; expected a training run directory, one of its checkpoints "
            "(RUN/checkpoints/step-NNNNNNN) or an exported model folder (mmldlm export)"
        )
    if is_exported(path):
        if weights == "raw" and read_config(path)["weights"] == "ema":
            raise DataError(
                "an exported model holds only the EMA of its weights; train.init_weights=raw needs "
                "the run directory it was exported from"
            )
        return load_trained(path, device="cpu")
    use_ema = None if weights == "ema" else False  # "ema" takes the raw weights of a source that kept no EMA
    if (path / "meta.json").is_file():  # a checkpoint: RUN/checkpoints/step-NNNNNNN
        return load_trained(path.parent.parent, checkpoint=path, device="cpu", use_ema=use_ema)
    return load_trained(path, device="cpu", use_ema=use_ema)


def check_architecture(source: TrainedRun, model, model_cfg) -> None:
    """ConfigError naming the tensors whose name or shape differ between the source's weights and
    `model` (the new run's network, wrapped or not), and the model config keys that differ."""
    problems = weight_mismatches(model, source.model.state_dict())
    if problems is None:
        return
    differing = [
        f"model.{f.name}: {getattr(source.cfg.model, f.name)!r} in the source, {getattr(model_cfg, f.name)!r} here"
        for f in dataclasses.fields(model_cfg)
        if f.name != "vocab_size" and getattr(source.cfg.model, f.name) != getattr(model_cfg, f.name)
    ]
    raise ConfigError(
        f"config key '{KEY}': got {str(source.checkpoint)!r}; its weights do not fit this run's model: "
        f"{problems}{' (' + '; '.join(differing) + ')' if differing else ''}; give this run the source's "
        f"model config (the model section of its config.yaml, or of an export's config.json)"
    )


def init_weights(trainer, source: str, weights: str) -> TrainedRun:
    """Load the weights of `source` into the trainer's model (and its EMA, which then starts from them)
    on every rank; returns the source, whose `checkpoint`, `step` and `weights` say what was loaded."""
    try:
        run = read_source(source, weights)
        check_compatible(run, Path(trainer.loader.dataset.path))
    except DataError as err:
        raise DataError(f"{KEY} {source}: {err}") from None
    check_architecture(run, trainer.raw_model, trainer.cfg.model)
    state = run.model.state_dict()
    set_model_state_dict(trainer.model, state, options=FULL_STATE)
    if trainer.ema is not None:
        set_model_state_dict(trainer.ema.module, state, options=FULL_STATE)
    return run
