"""The loop in one process with test doubles for the objective and the loader: accumulation,
progressive batch size, the idle head, signals; and on real tiny runs train.threads and the first step
of each mode."""

import errno
import json
import math
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from data_support import prepared
from loader_support import SyntheticLoader

from mmldlm.config import ModelConfig, load_config
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.runs.checkpoints import read_weights
from mmldlm.training.checkpoint import CheckpointManager
from mmldlm.training.distributed import DistInfo
from mmldlm.training.run import train
from mmldlm.training.storage import WriteError
from mmldlm.training.trainer import Trainer, TrainingStopped

VOCAB, LEN, DIM = 40, 8, 16


class FixedNoiseObjective:
    """Per-sample losses with no randomness: a batch's loss is the mean of its samples' losses, so
    any split into micro-batches must give the same gradient."""

    def __init__(self, mode="joint"):
        self.mode = mode

    def mode_at(self, step):
        return self.mode

    def __call__(self, model, batch, step, generator=None):
        tokens, latents = batch["tokens"], batch["latents"]
        t = torch.full((tokens.shape[0],), 0.5)
        logits, out, _ = model(tokens, latents, t, t, text_head=self.mode != "t2l", latent_head=self.mode != "l2t")
        per_sample = torch.zeros(tokens.shape[0])
        if logits is not None:
            per_sample = per_sample + F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none").mean(1)
        if out is not None:
            per_sample = per_sample + (out - latents).pow(2).mean((1, 2))
        loss = per_sample.mean()
        return loss, {"loss": loss.detach(), "mode": self.mode}


def SequentialLoader(micro):
    return SyntheticLoader(micro, VOCAB, LEN, DIM)


def make_trainer(tmp_path, overrides, mode="joint", objective=None):
    cfg = load_config(
        None,
        [
            "train.log_every=1",
            "logging.progress_bar=false",
            "schedule.warmup_steps=0",
            "schedule.kind=constant",
            "optim.lr=0.01",
            f"train.run_dir={tmp_path}",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    model_cfg = ModelConfig(
        hidden_size=32, num_blocks=2, num_heads=2, max_seq_len=LEN, latent_dim=DIM, num_latents=1, timestep_embed_dim=16
    )
    model = MultimodalMMDiT(model_cfg, vocab_size=VOCAB)
    objective = objective or FixedNoiseObjective(mode)
    return Trainer(cfg, model, objective, SequentialLoader(cfg.train.micro_batch_size), DistInfo())


def records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_micro_batch_2_times_4_accumulation_equals_batch_8(tmp_path):
    fp32 = ["train.steps=2", "train.global_batch_size=8", "train.precision=fp32"]  # bf16 rounds per batch split
    accumulated = make_trainer(tmp_path / "a", [*fp32, "train.micro_batch_size=2"])
    single = make_trainer(tmp_path / "b", [*fp32, "train.micro_batch_size=8"])
    assert accumulated.fit() == 0 and single.fit() == 0
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["accumulation_steps"] for r in ra] == [4, 4] and [r["accumulation_steps"] for r in rb] == [1, 1]
    for a, b in zip(ra, rb):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
    for (name, p), q in zip(accumulated.raw_model.named_parameters(), single.raw_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


def test_progressive_batch_size_changes_accumulation_at_the_given_steps(tmp_path):
    trainer = make_trainer(
        tmp_path, ["train.steps=5", "train.micro_batch_size=2", "train.batch_schedule=[[0, 2], [2, 6], [4, 4]]"]
    )
    assert trainer.fit() == 0
    recs = records(tmp_path)
    assert [r["global_batch_size"] for r in recs] == [2, 2, 6, 6, 4]
    assert [r["accumulation_steps"] for r in recs] == [1, 1, 3, 3, 2]
    assert trainer.loader.pos == 1 + 1 + 3 + 3 + 2
    # The work the monitor judges each step's time by, and the one input shape (micro-batch 2 x LEN) met.
    assert [r["train_flops"] / recs[0]["train_flops"] for r in recs] == pytest.approx([1, 1, 3, 3, 2])
    assert [r["num_shapes"] for r in recs] == [1] * 5


def test_idle_head_is_not_moved_by_adamw(tmp_path):
    trainer = make_trainer(
        tmp_path,
        ["train.steps=3", "train.micro_batch_size=2", "train.global_batch_size=2", "optim.weight_decay=0.5"],
        mode="l2t",
    )
    with torch.no_grad():  # non-zero head weights, so weight decay would visibly shrink them
        for p in trainer.raw_model.latent_head_parameters():
            p.normal_()
    idle = [p.detach().clone() for p in trainer.raw_model.latent_head_parameters()]
    text_before = trainer.raw_model.text_final.head.weight.detach().clone()
    assert trainer.fit() == 0
    for before, p in zip(idle, trainer.raw_model.latent_head_parameters()):
        assert torch.equal(before, p)
    assert not torch.equal(text_before, trainer.raw_model.text_final.head.weight)


def test_sigterm_checkpoints_at_the_end_of_the_step_and_exits_with_128_plus_its_number(tmp_path):
    trainer = make_trainer(tmp_path, ["train.steps=50", "train.micro_batch_size=2", "train.global_batch_size=2"])
    real_step = trainer.run_step

    def signal_during_step_4(stop=None):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(stop)

    trainer.run_step = signal_during_step_4
    assert trainer.fit() == 128 + signal.SIGTERM
    assert trainer.step == 4 and trainer.stopped_by == "SIGTERM"  # the step it arrived in is the last
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000004"
    assert records(tmp_path)[-1]["stop_requested"] is True and records(tmp_path)[-1]["step"] == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_failed_background_save_is_reported_at_the_next_step(tmp_path, monkeypatch):
    import mmldlm.training.checkpoint as ckpt

    trainer = make_trainer(
        tmp_path,
        [
            "train.steps=20",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "checkpoint.every=2",
            "checkpoint.async_save=true",
        ],
    )
    real_save, real_step = ckpt.torch.save, trainer.run_step

    def full_disk_from_step_4(obj, path):
        if ".tmp-step-0000004" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, path)

    def step_after_the_write(stop=None):
        if trainer.checkpoints._thread is not None:  # the write has ended before the step does
            trainer.checkpoints._thread.join()
        return real_step(stop)

    monkeypatch.setattr(ckpt.torch, "save", full_disk_from_step_4)
    trainer.run_step = step_after_the_write
    with pytest.raises(
        WriteError,
        match="no space left on device .*rank-00000.pt; the partial checkpoint was "
        "removed, the last good checkpoint is .*step-0000002",
    ):
        trainer.fit()
    assert trainer.step == 5  # the step after the failed save, not the next save at step 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-0000002"]


def test_asynchronous_checkpoints_hold_the_step_they_save(tmp_path, monkeypatch):
    """The state is copied during the next step, which waits for the copy before its update. Here the
    copy starts only once the trainer is about to change the state (it waits for the copy, or has
    stepped the optimizer): the asynchronous checkpoints still equal blocking ones."""
    from torch.distributed.checkpoint.staging import StateDictStager

    changing = threading.Event()  # set once the trainer is about to change what a save copies
    real_stage, real_save = StateDictStager.stage, CheckpointManager.save
    real_wait_for_snapshot = CheckpointManager.wait_for_snapshot

    def save(self, *args, **kwargs):
        changing.clear()
        real_save(self, *args, **kwargs)

    def wait_for_snapshot(self):
        changing.set()
        real_wait_for_snapshot(self)

    def stage_once_the_state_changes(self, state_dict, **kwargs):
        assert changing.wait(60), "the step after the save never came to its update"
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", save)
    monkeypatch.setattr(CheckpointManager, "wait_for_snapshot", wait_for_snapshot)
    monkeypatch.setattr(StateDictStager, "stage", stage_once_the_state_changes)
    # Asynchronous saves at steps 2 and 4, each with a step after it; the last save (5) blocks.
    common = ["train.steps=5", "checkpoint.every=2", "train.precision=fp32", "train.micro_batch_size=2"]
    runs = {}
    for name in ("async", "blocking"):
        overrides = [*common, f"checkpoint.async_save={name == 'async'}", "train.ema_decay=0.9"]
        trainer = make_trainer(tmp_path / name, overrides)
        trainer.optimizer.register_step_post_hook(lambda *args: changing.set())
        assert trainer.fit() == 0
        runs[name] = tmp_path / name / "checkpoints"
    for step in ("step-0000002", "step-0000004"):
        for which in ("model", "ema"):
            saved, reference = read_weights(runs["async"] / step, which), read_weights(runs["blocking"] / step, which)
            assert saved.keys() == reference.keys()
            assert all(torch.equal(saved[k], reference[k]) for k in saved), (step, which)


class NonFiniteObjective(FixedNoiseObjective):
    """FixedNoiseObjective whose loss is NaN at the given (0-based) steps."""

    def __init__(self, steps):
        super().__init__()
        self.steps = set(steps)

    def __call__(self, model, batch, step, generator=None):
        loss, metrics = super().__call__(model, batch, step, generator)
        return (loss * float("nan"), metrics) if step in self.steps else (loss, metrics)


def test_consecutive_nonfinite_updates_are_skipped_then_stop_the_run_with_checkpoints_untouched(tmp_path):
    overrides = ["train.steps=10", "train.micro_batch_size=2", "train.global_batch_size=2", "checkpoint.every=4"]
    trainer = make_trainer(
        tmp_path, [*overrides, "train.max_consecutive_skips=3"], objective=NonFiniteObjective({4, 5, 6})
    )
    with pytest.raises(
        TrainingStopped, match="^3 consecutive updates were skipped .* stopping at step 7. The checkpoints"
    ):
        trainer.fit()
    recs = records(tmp_path)
    assert [r["skipped"] for r in recs] == [False] * 4 + [True] * 3 and recs[-1]["num_skipped"] == 3
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-0000004"]  # nothing written at 7
    saved = read_weights(checkpoints / "step-0000004")
    assert all(torch.equal(p.detach(), saved[name]) for name, p in trainer.raw_model.named_parameters())


def test_auto_precision_is_bf16_only_where_bf16_matmuls_are_native(monkeypatch):
    from mmldlm.config import ConfigError
    from mmldlm.training import trainer as trainer_module

    cpu = torch.device("cpu")
    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: True)
    assert trainer_module.resolve_precision("auto", cpu) == "bf16"
    # meta has no autocast: the meta-device tests of the step ran into torch's refusal on bf16 CPUs
    assert trainer_module.resolve_precision("auto", torch.device("meta")) == "fp32"
    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: False)
    assert trainer_module.resolve_precision("auto", cpu) == "fp32"
    assert trainer_module.resolve_precision("bf16", cpu) == "bf16"  # asked for: given, `mmldlm check` warns
    try:
        trainer_module.resolve_precision("fp16", cpu)
        raise AssertionError("fp16 on CPU must be refused")
    except ConfigError as err:
        assert "train.precision" in str(err) and "fp16" in str(err)


def test_bf16_autocast_on_cpu_keeps_fp32_masters_and_tracks_the_fp32_run(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = make_trainer(
            tmp_path / precision,
            ["train.steps=6", "train.micro_batch_size=4", "train.global_batch_size=4", f"train.precision={precision}"],
        )
        seen = []
        hook = trainer.raw_model.blocks[0].text.qkv.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(o.dtype)
        )
        assert trainer.fit() == 0
        hook.remove()
        assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert all(p.dtype == torch.float32 for p in trainer.raw_model.parameters())
        assert all(
            v.dtype == torch.float32
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.is_floating_point()
        )
        runs[precision] = [r["loss"] for r in records(tmp_path / precision)]
    assert runs["bf16"][-1] < runs["bf16"][0]  # it trains
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert abs(a - b) <= 0.02 * abs(a), (runs["fp32"], runs["bf16"])


def test_device_choice_is_one_rule_that_names_the_key_it_came_from():
    from mmldlm.device import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device: got 'tpu'; expected auto, cpu, cuda or cuda:N"):
        pick_device("tpu", key="--device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="config key 'train.device': got 'cuda:1'; expected auto or cpu: no CUDA"):
            pick_device("cuda:1")


def test_train_device_takes_cuda_n_among_the_visible_gpus_and_one_process_only(monkeypatch):
    from mmldlm.device import pick_device
    from mmldlm.training.distributed import init_distributed

    cfg = load_config(None, ["train.device=cuda:1"])
    assert cfg.train.device == "cuda:1"
    with pytest.raises(ValueError, match="config key 'train.device': got 'gpu'; expected auto, cpu, cuda or cuda:N"):
        load_config(None, ["train.device=gpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"got 'cuda:1'; expected cuda:N with N < 1, the CUDA devices visible here"):
        pick_device("cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="got 'cuda:0'; expected auto or cuda under torchrun"):
        init_distributed(cfg.distributed, "cuda:0")


def test_train_threads_sets_torchs_cpu_threads_for_the_run(tmp_path_factory, tmp_path):
    before = torch.get_num_threads()
    threads = 3 if before != 3 else 2
    cfg = load_config(
        None,
        [
            "model=tiny",
            "train.steps=1",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "data.num_workers=0",
            "logging.progress_bar=false",
            "train.device=cpu",
            f"train.threads={threads}",
            f"data.path={prepared(tmp_path_factory)}",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    try:
        assert train(cfg) == 0
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("config", ["default", "optimized"])
def test_a_record_read_after_queued_steps_gives_their_figures(tmp_path, tmp_path_factory, config):
    """Steps queue their work (no read of the device: tests/test_host_overhead.py); the record read after
    three of them holds the last step's loss and gradient norm and the throughput of all three."""
    from mmldlm.tools.bench import build_trainer

    data = prepared(tmp_path_factory)
    overrides = [f"data.path={data}", "model=tiny", "data.num_workers=0", "train.global_batch_size=8"]
    _, _, trainer, _ = build_trainer(config, [*overrides, "train.micro_batch_size=4"], str(tmp_path))
    trainer.train_step()  # the first step: start-up, and its record read
    pending = [trainer.run_step() for _ in range(3)]  # every mode of the random mixture, accumulation 2
    record = trainer.read_record(pending[-1])
    assert record["step"] == 4 and record["loss"] > 0 and record["grad_norm"] > 0
    assert record["record_steps"] == 3 and record["tokens_per_s"] > 0 and record["step_time_s"] > 0


def test_a_records_step_time_is_the_steps_own_not_what_ran_between_them(tmp_path, monkeypatch):
    """The record's step time counts each step from its start and the wait for the device at the read,
    not a checkpoint, a log line or (in bench) another config's turn between steps: those would show as
    a slow step. On a clock that moves a minute between steps, the steps take well under a second."""
    import mmldlm.training.tally as tally

    trainer = make_trainer(tmp_path, ["train.steps=4", "train.micro_batch_size=2"])
    trainer.train_step()
    clock = [tally.time.perf_counter()]

    def perf_counter():  # a microsecond a call
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(tally.time, "perf_counter", perf_counter)  # time.perf_counter, everywhere
    pending = []
    for _ in range(2):
        clock[0] += 60.0  # a minute between steps
        pending.append(trainer.run_step())
    clock[0] += 60.0
    record = trainer.read_record(pending[-1])
    assert record["record_steps"] == 2 and record["step_time_s"] < 1.0  # 60.0 or more counted between them


def test_each_record_says_how_much_cpu_time_the_process_got_and_how_loaded_the_machine_was(tmp_path, monkeypatch):
    # What `monitor` tells a busy machine from a slow run by: steps 3 and 4 wait a second each for
    # their batch without using a CPU (as a process does whose core another job holds), so their records'
    # CPU seconds per second fall far below those of the steps that computed all the time. The wait is
    # long beside the step's own work (tens of ms), which the same window also counts.
    trainer = make_trainer(tmp_path, ["train.steps=4", "train.micro_batch_size=2", "train.global_batch_size=2"])
    next_batch = trainer._next_batch

    def idle_then_next():
        if trainer.step >= 2:
            time.sleep(1.0)
        return next_batch()

    monkeypatch.setattr(trainer, "_next_batch", idle_then_next)
    assert trainer.fit() == 0
    recs = records(tmp_path)
    assert all(r["num_cpus"] == os.cpu_count() and 0 <= r["load_1m"] < 10 * os.cpu_count() for r in recs)
    busy, idle = [r["cpu_s_per_s"] for r in recs[:2]], [r["cpu_s_per_s"] for r in recs[2:]]
    assert min(busy) > 0.2 and max(idle) < 0.1, (busy, idle)


def test_fit_reads_records_only_at_the_steps_it_logs(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, ["train.steps=9", "train.log_every=4", "train.micro_batch_size=2"])
    read = []
    real = trainer.read_record
    monkeypatch.setattr(trainer, "read_record", lambda pending: read.append(pending.step) or real(pending))
    assert trainer.fit() == 0
    assert read == [1, 4, 8, 9]
    assert [r["step"] for r in records(tmp_path)] == [1, 4, 8, 9]


def test_flops_are_counted_on_real_tokens_not_on_padding(tmp_path):
    """MFU's FLOPs: each text at its own length (padding is no useful work), the text head at the
    masked positions it ran at; beside them the FLOPs as computed (padding included), which the
    monitor predicts step times from, and the positions computed, which give the real-token share."""
    from mmldlm.model.info import training_flops_per_sample
    from mmldlm.training.tally import StepTotals

    trainer = make_trainer(tmp_path, ["train.steps=1"])
    totals = StepTotals(trainer.device)
    batch = {"tokens": torch.zeros(2, 10, dtype=torch.long), "text_lengths": (4, 10)}
    trainer._count_work(totals, batch, "joint", 5)

    def text(n, head_rows=0.0):
        return training_flops_per_sample(trainer.raw_model, n, text_head_rows=head_rows)

    head_rows = 5 * (text(1, 1.0) - text(1))
    real, computed = totals.flops
    assert real == pytest.approx(text(4) + text(10) + head_rows, rel=1e-9)
    assert computed == pytest.approx(2 * text(10) + head_rows, rel=1e-9)  # what the padded batch ran
    assert (totals.positions, totals.real_positions) == (20, 14)


@pytest.mark.parametrize("mode", ["l2t", "t2l", "joint"])
def test_the_first_step_of_every_mode_on_the_default_config_has_a_moderate_gradient_norm(
    tmp_path_factory, tmp_path, mode
):
    # l2t drops the condition of a tenth of the rows to the null latent, zero to start: the vocabulary
    # prior's cosine there must not feed the step a gradient of 1/eps.
    overrides = [f"objective.mode={mode}", "train.steps=1", "train.log_every=1", "logging.progress_bar=false"]
    overrides += ["data.num_workers=0", "eval.every=0", f"data.path={prepared(tmp_path_factory)}"]
    cfg = load_config("configs/default.yaml", [*overrides, f"train.run_dir={tmp_path / 'run'}"])
    assert train(cfg) == 0
    step = next(r for r in records(tmp_path / "run") if r.get("step") == 1 and "grad_norm" in r)
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] < 1e3, step


def test_training_on_a_cpu_keeps_freed_memory_for_the_next_step(tmp_path_factory, tmp_path, monkeypatch):
    """The text head's (N, V) logits of long texts outgrow glibc's mmap threshold: a run on a CPU asks the
    C allocator to keep freed blocks (mmldlm.device.keep_freed_memory), so that each step reuses them
    instead of faulting fresh pages in."""
    import mmldlm.training.run as run

    calls = []
    monkeypatch.setattr(run, "keep_freed_memory", lambda: calls.append(True) or True)
    overrides = ["train.steps=1", "logging.progress_bar=false", "data.num_workers=0", "eval.every=0"]
    overrides += [f"data.path={prepared(tmp_path_factory)}", f"train.run_dir={tmp_path / 'run'}"]
    assert train(load_config("configs/default.yaml", overrides)) == 0
    assert calls == [True]
