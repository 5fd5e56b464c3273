"""What the older trainer did with a composed run config on a cluster: read from what its code does, not
from what its config keys are named. A key it never reads is a finding, not a setting.

- It trains `training.num_epochs` full passes over its loader. `training.num_train_steps` sets only the
  length of the cosine LR schedule (linear warmup, then a cosine from the peak to 0 at that step), not
  when training stops. Per epoch each of the W processes draws ceil(N / W) samples (DistributedSampler)
  in batches of `training.train_batch_size`.
- It never applies gradient accumulation: `training.gradient_accumulation_steps` is read by the launcher
  only, and the optimizer steps after every micro-batch. Global batch = micro-batch x GPUs.
- Adam's betas are the optimizer group's `optimizer.betas` list; `optimizer.beta1` / `optimizer.beta2`
  are never read.
- Its block is built without a head count: 8 heads, whatever `model.n_heads` says.
- Its loader walks the token folder in the folder's own order (os.scandir), keeps each .npz whose latent
  .npy exists and stops at `data.max_samples` pairs, or where that is null at `data.initial_scan_limit`
  (10,000 when the key is absent); its validation split overlaps training, so it trains on every pair
  it read.
- It evaluates every `logging.eval_freq` steps: never, where that is longer than the run.
- Modes `unconditional` and `multimodal_mdlm` train both streams together (our `joint`).
- Checkpoints overwrite one `latest` folder and at most 4 are kept; its collective timeout is hard-coded
  to 30 minutes (NCCL_TIMEOUT is read by neither torch nor NCCL); DDP runs with
  find_unused_parameters on; bf16 means weights cast to bf16, with no fp32 master copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mmldlm.tools.migrate.cluster import Cluster

HEADS = 8
SCAN_LIMIT = 10_000  # files read with data.max_samples null, where data.initial_scan_limit is absent
CHECKPOINTS_KEPT = 4
COLLECTIVE_TIMEOUT_MINUTES = 30
MODES = {"l2t": "l2t", "t2l": "t2l", "joint": "joint", "unconditional": "joint", "multimodal_mdlm": "joint"}
PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}
NEVER_READ = {
    "training.gradient_accumulation_steps": "no step of the trainer applies it: the optimizer steps every micro-batch",
    "optimizer.beta1": "Adam's betas come from optimizer.betas",
    "optimizer.beta2": "Adam's betas come from optimizer.betas",
    "model.n_heads": f"the block is built without a head count: {HEADS} heads",
}


@dataclass
class OlderRun:
    """The older trainer's run of a config on a cluster; None where the config leaves it unknown."""

    values: dict[str, Any]  # the composed config, flat
    world_size: int
    micro_batch: int | None
    epochs: int | None
    samples_read: int | None
    samples_why: str
    steps_per_epoch: int | None
    schedule_steps: int | None  # training.num_train_steps: the cosine's length only
    lr: float | None  # None: not a number (an empty optimizer.lr): the trainer fails at its first step
    betas: list[float] | None
    mode: str | None  # ours
    precision: str | None  # ours
    notes: list[str] = field(default_factory=list)  # what the model assumed for a key the config lacks

    @property
    def global_batch(self) -> int | None:
        return None if self.micro_batch is None else self.micro_batch * self.world_size

    @property
    def steps(self) -> int | None:
        """Optimizer steps the run trains: epochs x steps per epoch."""
        if self.epochs is None or self.steps_per_epoch is None:
            return None
        return self.epochs * self.steps_per_epoch

    @property
    def warmup(self) -> int:
        return _int(self.values.get("training.warmup_steps")) or 0

    @property
    def lr_at_end(self) -> float | None:
        """The cosine's factor at the run's last step, where the schedule is longer than the run."""
        if self.steps is None or not self.schedule_steps:
            return None
        if self.steps <= self.warmup:
            return self.steps / max(1, self.warmup)
        progress = min(1.0, (self.steps - self.warmup) / max(1, self.schedule_steps - self.warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def evaluates(self) -> bool:
        """Whether logging.eval_freq comes round within the run (where both are known)."""
        every = _int(self.values.get("logging.eval_freq"))
        return every is None or self.steps is None or 0 < every <= self.steps


def older_run(values: dict[str, Any], cluster: Cluster) -> OlderRun:
    run = OlderRun(
        values=values,
        world_size=cluster.world_size,
        micro_batch=_int(values.get("training.train_batch_size")),
        epochs=_int(values.get("training.num_epochs")),
        samples_read=None,
        samples_why="",
        steps_per_epoch=None,
        schedule_steps=_int(values.get("training.num_train_steps")),
        lr=_number(values.get("optimizer.lr")),
        betas=_betas(values.get("optimizer.betas")),
        mode=MODES.get(values.get("loss.loss_type")),
        precision=PRECISIONS.get(values.get("training.dtype")),
    )
    if run.epochs is None:
        run.notes.append("training.num_epochs is not in the config: the older trainer's default is not known here")
    run.samples_read, run.samples_why = _samples_read(values)
    if run.samples_read is not None and run.micro_batch:
        per_process = math.ceil(run.samples_read / run.world_size)
        run.steps_per_epoch = math.ceil(per_process / run.micro_batch)
    if run.betas is None:
        run.notes.append("optimizer.betas is not in the config: torch's AdamW default [0.9, 0.999] is taken")
        run.betas = [0.9, 0.999]
    return run


def _samples_read(values: dict[str, Any]) -> tuple[int | None, str]:
    limit = values.get("data.max_samples")
    if limit is not None:
        return _int(limit), "data.max_samples"
    if "data.initial_scan_limit" in values:
        return _int(values["data.initial_scan_limit"]), "data.max_samples null: data.initial_scan_limit"
    return SCAN_LIMIT, f"data.max_samples null: the loader's scan limit, {SCAN_LIMIT:,}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _betas(value: Any) -> list[float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_number(v) is not None for v in value):
        return [float(v) for v in value]
    return None


def heads_for(width: int) -> int:
    """The older block's 8 heads where 8 divides the width into even head dims (RoPE), else the nearest
    head count that does (ties to fewer, wider heads)."""
    candidates = [h for h in range(1, width + 1) if width % h == 0 and (width // h) % 2 == 0]
    return min(candidates, key=lambda h: (abs(h - HEADS), h))
