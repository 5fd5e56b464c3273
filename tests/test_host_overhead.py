"""What the host does in a training step, counted on a CPU before it costs a GPU anything: a step that
does not log never reads the device (no `nonzero`, boolean selection, `.item()` or blocking copy), so
the host can run ahead of the GPU."""

import pytest
import torch
from data_support import prepared
from loader_support import SyntheticLoader
from test_perf import DIM, LEN, PAD_ID, VOCAB, objective_for, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from mmldlm.config import load_config
from mmldlm.training import trainer as trainer_module
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import build_trainer
from mmldlm.training.trainer import Trainer

aten = torch.ops.aten


class LoopAsFused(torch.optim.AdamW):
    """torch's fused AdamW does not run on meta tensors: its per-parameter loop stands in, and the
    trainer takes the fused path (the skip flag and clipping factor handed over as device tensors)."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr, foreach=False, fused=False)
        self.defaults["fused"] = True
        self.handed_over = []

    def step(self):
        given = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        self.handed_over.append({k: v.device.type for k, v in given.items()})
        try:
            super().step()
        finally:
            self.__dict__.update(given)


class BlockingCopies(TorchDispatchMode):
    """Copies from the host to another device that the host waits for (non_blocking=False)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if args[0].device.type == "cpu" and target is not None and target.type != "cpu":
                if not kwargs.get("non_blocking", False):
                    self.found.append(str(func))
        elif func is aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                self.found.append(str(func))
        return func(*args, **kwargs)


def meta_trainer(tmp_path, monkeypatch, mode, overrides=(), model_options=None):
    """The trainer with its model and batches on the meta device: any read of a device value (a sync on
    a GPU) raises there, as meta tensors hold no values."""
    monkeypatch.setattr(trainer_module, "build_optimizer", lambda model, cfg: LoopAsFused(model.parameters(), cfg.lr))
    cfg = load_config(
        None,
        [
            "logging.progress_bar=false",
            f"train.run_dir={tmp_path}",
            "train.steps=4",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "train.precision=fp32",  # autocast has no meta device; its casts read nothing
            f"objective.mode={mode}",
            *overrides,
        ],
    )
    model = tiny_model()
    for key, value in (model_options or {}).items():
        setattr(model.cfg, key, value)

    def loader(micro):
        return SyntheticLoader(micro, VOCAB, LEN, DIM, pad_id=PAD_ID, first_token=2)

    return Trainer(cfg, model, objective_for(cfg), loader, DistInfo(device=torch.device("meta")))


@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint", "random"])
def test_a_step_that_does_not_log_never_waits_for_the_device(tmp_path, monkeypatch, mode):
    """Every mode, clipping on and classifier-free dropping on: two steps run to the end on the meta
    device (whose tensors hold no values, so a `nonzero`, a boolean selection or an `.item()` of a
    device tensor raises), with no blocking copy to the device; the fused optimizer is handed the skip
    flag and the clipping factor on the device."""
    trainer = meta_trainer(tmp_path, monkeypatch, mode, ["optim.grad_clip=1.0", "objective.cond_drop_prob=0.5"])
    with BlockingCopies() as copies:
        pending = [trainer.run_step(), trainer.run_step()]
    assert copies.found == []
    assert [p.step for p in pending] == [1, 2]
    assert trainer.optimizer.handed_over == [{"grad_scale": "meta", "found_inf": "meta"}] * 2
    assert next(trainer.raw_model.parameters()).device.type == "meta"


@pytest.mark.parametrize("config", ["default", "optimized"])
def test_the_presets_steps_on_real_batches_queue_without_reading_the_device(
    tmp_path, tmp_path_factory, monkeypatch, config
):
    """The real loader, objective and model of a preset (the random mixture of modes, accumulation of
    two micro-batches, checkpointed blocks), built on the meta device: three steps queue, and the
    record is where the host reads (a meta tensor has no value to read). Activation checkpointing is
    named: `auto` probes memory at start-up, which needs a real device."""
    monkeypatch.setattr(trainer_module, "build_optimizer", lambda model, cfg: LoopAsFused(model.parameters(), cfg.lr))
    overrides = [
        f"data.path={prepared(tmp_path_factory)}",
        "model=tiny",
        "data.num_workers=0",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "perf.activation_checkpointing=selective",
        f"train.run_dir={tmp_path}",
    ]
    cfg = load_config(config, overrides)
    trainer = build_trainer(cfg, DistInfo(device=torch.device("meta")))
    with BlockingCopies() as copies:
        pending = [trainer.run_step() for _ in range(3)]
    assert copies.found == [] and [p.num_accum for p in pending] == [2, 2, 2]
    assert {p.mode for p in pending} <= {"l2t", "t2l", "joint"}
    with pytest.raises(NotImplementedError, match="meta"):
        trainer.read_record(pending[-1])
