"""Evaluation during training: every `eval.every` steps rank 0 runs mmldlm/evaluation/evaluate.py with
the small budget of the `eval` config section and returns a metrics record

    {"step": 200, "eval_elbo_l2t_text_nats_per_token": ..., "eval_elbo_l2t_text_nats_per_token_low": ...,
     "eval_elbo_l2t_text_nats_per_token_high": ..., "eval_l2t_num_samples": 32, ...}

(each figure with its 95% interval over the `eval.num_samples` texts) for the one metrics.jsonl writer.
The other ranks wait at a barrier, so no rank runs ahead into a collective while rank 0 is busy. Under
FSDP2 and HSDP no rank holds the whole model, so every rank first takes part in gathering the full
weights, and rank 0 evaluates a copy. Evaluation draws from its own generators and leaves the training
RNG, data position and train/eval mode as they were.
"""

from __future__ import annotations

import copy
import logging

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mmldlm.evaluation.evaluate import evaluate
from mmldlm.evaluation.report import eval_metrics
from mmldlm.model import MultimodalMMDiT
from mmldlm.runs.trained import TrainedRun
from mmldlm.training.distributed import barrier, collective_guard
from mmldlm.training.parallelize import eager_blocks

log = logging.getLogger(__name__)


def _full_model(trainer):
    """The unsharded model that evaluation samples from, on rank 0 (None elsewhere): the EMA of the
    weights when the run keeps one, else the raw model; a gathered copy where FSDP2 or HSDP shards it."""
    source = trainer.ema.module if trainer.ema is not None else trainer.raw_model
    if not (trainer.info.distributed and trainer.cfg.distributed.shards_model):
        return source if trainer.info.is_main else None
    with collective_guard(f"evaluation weight gather of step {trainer.step}", trainer.info):
        state = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not trainer.info.is_main:
        return None
    model = MultimodalMMDiT(copy.deepcopy(trainer.cfg.model), vocab_size=trainer.raw_model.vocab_size)
    model.load_state_dict(state)
    return model.to(trainer.device)


def evaluate_during_training(trainer) -> dict | None:
    """The eval record of the trainer's current step on rank 0, None on the other ranks."""
    model = _full_model(trainer)
    record = None
    if trainer.info.is_main:
        objective = trainer.objective
        run = TrainedRun.on_dataset(
            trainer.cfg,
            model,
            objective.text,
            objective.latent,
            trainer.loader.dataset.path,
            step=trainer.step,
            weights="ema" if trainer.ema is not None else "raw",
        )
        with eager_blocks(trainer.cfg.perf):  # its batch sizes and lengths are not training's
            report = evaluate(run, trainer.cfg.eval, seed=trainer.cfg.train.seed)
        record = {"step": trainer.step, **eval_metrics(report)}
        log.info(
            "eval at step %d: l2t exact match %.1f%%, t2l retrieval@1 %.1f%%",
            trainer.step,
            100 * report["l2t"]["exact_match"],
            100 * report["t2l"]["retrieval_at_1"],
        )
    barrier(trainer.info, f"evaluation of step {trainer.step}")
    return record
