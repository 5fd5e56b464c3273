"""`mmldlm check`: audit a run config, and the machine it would run on, for the problems that make a
run fail or waste its hardware (timeouts, loader, memory, batch splits, LR schedule, slow switches)
before any device hour is spent.

What each finding says is data (rules.py). When a rule fires is decided here, by small functions
`check_*(cfg, env, est) -> list[Finding]`, listed in CHECKS; the config's feasibility on the world size
is the trainer's own (`mmldlm.config.infeasible`). When the fix is a config change a finding also
carries it as {"section.key": value}, which `fix_config` applies (`--fix OUT`). Fixes outside the
config (environment variables, free disk) are described but cannot be applied to a file.

The memory and checkpoint-size numbers are estimates from the parameter count (estimates.py).
`detect_environment` and `RULES` are imported `as` themselves: commands/check.py and tests take them from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any

import yaml

from mmldlm.config import MODES, RunConfig, from_dict, infeasible, to_dict
from mmldlm.data import long_texts
from mmldlm.data.dataset import batch_shape_count, default_num_workers, open_dataset, padded_lengths
from mmldlm.device import auto_precision
from mmldlm.runs.checkpoints import find_latest, is_full_state
from mmldlm.runs.files import CheckpointError, current_run_config
from mmldlm.tools.check.estimates import (
    GIB,
    MEMORY_HEADROOM,
    Environment,
    Estimate,
    estimate,
    max_length_of,
    micro_per_process,
    prepared_data_path,
)
from mmldlm.tools.check.estimates import detect_environment as detect_environment
from mmldlm.tools.check.rules import RULES as RULES
from mmldlm.tools.check.rules import SEVERITY_ORDER, Finding, finding
from mmldlm.training.batch_size import global_batch_sizes
from mmldlm.training.compute_weights import compute_weights_off_reason
from mmldlm.training.schedules import LRSchedule
from mmldlm.wording import counted

# --------------------------------------------------------------------------------------------------
# When each rule fires.


def check_timeout(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    minutes = cfg.distributed.timeout_minutes
    if minutes > 24 * 60:
        return [finding("timeout_days", minutes=minutes, days=minutes / 1440)]
    if minutes > 120:
        return [finding("timeout_hours", minutes=minutes)]
    if minutes < 5:
        return [finding("timeout_short", minutes=minutes)]
    return []


def check_nccl_environment(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    findings, source = [], env.environ_source
    timeout_s = cfg.distributed.timeout_minutes * 60
    heartbeat = env.environ.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if heartbeat is not None:
        seconds = float(heartbeat) if heartbeat.replace(".", "", 1).isdigit() else None
        values = dict(value=heartbeat, timeout_s=timeout_s, heartbeat=timeout_s + 60, source=source)
        if env.environ.get("TORCH_NCCL_ENABLE_MONITORING") == "0":  # the monitor that reads it is off
            findings.append(finding("heartbeat_moot", **values))
        elif seconds is None or seconds > 86400:
            findings.append(finding("heartbeat_absurd", **values))
        elif seconds < timeout_s:
            findings.append(finding("heartbeat_short", **values))
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.environ.get(name) == "0":
            findings.append(finding("async_errors_off", name=name, source=source))
    if env.environ.get("TORCH_NCCL_ENABLE_MONITORING") == "0":
        findings.append(finding("monitoring_off", source=source))
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if env.environ.get(name) == "1":
            findings.append(finding("blocking_wait", name=name, source=source))
    return findings


def check_loader(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    d, findings = cfg.data, []
    per_rank = max(1, env.cpus // env.nproc_per_node)
    auto = default_num_workers(env.cpus, env.nproc_per_node)
    workers = auto if d.num_workers is None else d.num_workers
    if d.num_workers is not None and d.num_workers > per_rank:
        values = dict(workers=d.num_workers, cpus=env.cpus, nproc=env.nproc_per_node, per_rank=per_rank, auto=auto)
        findings.append(finding("too_many_workers", **values))
        workers = auto
    if workers > 0 and d.prefetch_factor is None:
        findings.append(finding("short_prefetch"))
    if workers > 0 and not d.persistent_workers:
        findings.append(finding("workers_restart"))
    if env.device == "cuda" and d.pin_memory is False:
        findings.append(finding("pageable_memory"))
    if env.device == "cuda" and workers == 0 and per_rank >= 2:
        findings.append(finding("no_workers", auto=auto))
    return findings


def check_busy_cpus(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """A CPU run whose processes have several torch threads each, more in all than the CPUs other work
    leaves free. A CPU counts as taken from a load of 0.5 (the load average is over a minute). With
    train.threads=auto the run itself follows the free CPUs (mmldlm/threads.py)."""
    if env.device != "cpu" or cfg.train.threads == "auto":
        return []
    free = max(0, env.cpus - math.floor(env.load + 0.5))
    per_process = cfg.train.threads or env.torch_threads
    threads = per_process * env.nproc_per_node
    # One thread has no other to wait for; with no other work, more threads than CPUs is the config's choice.
    if per_process == 1 or threads <= free or free == env.cpus:
        return []
    fit = max(1, free // env.nproc_per_node)
    values = dict(load=env.load, cpus=env.cpus, free=free, threads=threads, nproc=env.nproc_per_node)
    return [finding("busy_cpus", {"train.threads": fit}, fit=fit, per_process=per_process, **values)]


def _largest_micro_batch(cfg: RunConfig, env: Environment, est: Estimate, limit: float) -> int | None:
    """The largest micro-batch below the one that runs that fits `limit` GiB and still divides every
    global batch size over the world size (the global batch, hence the training, stays the same)."""
    sizes = global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)
    for micro in range(micro_per_process(cfg, env) - 1, 0, -1):
        if all(size % (micro * env.world_size) == 0 for size in sizes) and est.memory_gib(micro) <= limit:
            return micro
    return None


def check_memory(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    micro = micro_per_process(cfg, env)  # 1 under auto: the trainer picks the largest that fits, so only 1 must
    need, limit = est.memory_gib(micro), MEMORY_HEADROOM * env.device_memory_gib
    if need <= limit:
        return []
    values = dict(
        need=need,
        static=est.static_gib,
        params_m=est.num_params / 1e6,
        micro=micro,
        activations_mib=est.activations_gib_per_sample * 1024,
        checkpointing=est.checkpointing,
        headroom=MEMORY_HEADROOM,
        device_memory=env.device_memory_gib,
        device="GPU" if env.device == "cuda" else "RAM per process",
    )
    smaller = _largest_micro_batch(cfg, env, est, limit)
    if smaller is not None:
        return [finding("memory_smaller_micro", {"train.micro_batch_size": smaller}, smaller=smaller, **values)]
    if cfg.distributed.strategy == "ddp" and env.world_size > 1:
        sharded = dataclasses.replace(
            est, static_gib=est.static_gib - 16 * est.num_params / GIB * (1 - 1 / env.world_size)
        )
        fits = _largest_micro_batch(cfg, env, sharded, limit) or (micro if sharded.memory_gib(micro) <= limit else None)
        if fits is not None:
            changes = {"distributed.strategy": "fsdp2", "train.micro_batch_size": fits}
            return [finding("memory_shard", changes, world_size=env.world_size, fits=fits, **values)]
    return [finding("memory_no_fit", **values)]


def _covering_length(length: int, pad: int) -> int:
    """`length` rounded up to a multiple of 8 (64 past 64), and of data.pad_to_multiple."""
    multiple = math.lcm(8 if length <= 64 else 64, pad)
    return -(-length // multiple) * multiple


def _prepared_cut(path: Path) -> list[Finding]:
    """Texts that prepare cut or dropped (meta.json "lengths"; none recorded for imported data)."""
    lengths = json.loads((path / "meta.json").read_text()).get("lengths")
    if not lengths or lengths["long_texts"] == "split" or not (lengths["cut"] or lengths["dropped"]):
        return []
    max_tokens = lengths["max_tokens"]
    limit = f"the encoder's {lengths['encoder_max_wordpieces']} wordpieces"
    values = dict(
        num_long=lengths["cut"] + lengths["dropped"],
        num_texts=lengths["num_texts"],
        what="cut" if lengths["long_texts"] == "cut" else "dropped",
        path=path,
        long_texts=lengths["long_texts"],
        limits=limit + (f" or {max_tokens} tokens" if max_tokens else ""),
        max_tokens=f" --max-tokens {max_tokens}" if max_tokens else "",
    )
    return [finding("long_texts_prepared", {}, **values)]


def check_long_texts(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """Training texts longer than the model reads: the loader cuts them (only the offsets are read);
    and texts that prepare cut or dropped to fit (meta.json)."""
    path = prepared_data_path(cfg)
    if path is None:
        return []
    return _prepared_cut(path) + _loader_cut(cfg, env, est, path)


def _loader_cut(cfg: RunConfig, env: Environment, est: Estimate, path: Path) -> list[Finding]:
    lengths = open_dataset(path, "train").lengths()
    max_length = max_length_of(cfg)
    cut_off = long_texts.over(lengths, max_length)
    if not cut_off["texts"]:
        return []
    p99 = long_texts.distribution(lengths)["p99"]
    values = dict(
        num_over=cut_off["texts"],
        num_texts=len(lengths),
        text_share=cut_off["texts"] / len(lengths),
        token_share=cut_off["share"],
        max_length=max_length,
        path=path,
        p99=p99,
    )
    if not long_texts.cut_is_worth_a_warning(lengths, max_length):
        return [finding("long_texts_tail", {}, **values)]
    proposed = _covering_length(p99, cfg.data.pad_to_multiple)
    changes = {"model.max_seq_len": max(proposed, cfg.model.max_seq_len)}
    if cfg.data.max_length is not None:
        changes["data.max_length"] = proposed
    micro = micro_per_process(cfg, env)
    memory_then = estimate(apply_changes(cfg, changes), env).memory_gib(micro)
    values.update(proposed=proposed, memory_now=est.memory_gib(micro), memory_then=memory_then, micro=micro)
    data_max_length = f", data.max_length={proposed}" if cfg.data.max_length is not None else ""
    return [finding("long_texts", changes, data_max_length=data_max_length, **values)]


def _modes_in_mix(cfg: RunConfig) -> list[str]:
    o = cfg.objective
    if o.mode == "random":
        return [m for m in MODES if o.mode_weights.get(m, 0) > 0]
    if o.mode == "sequential":
        return sorted({mode for _, mode in o.mode_schedule}, key=MODES.index)
    return [o.mode]


def check_unused_parameters(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """Which output head is idle in the mode mix, and why DDP still needs no find_unused_parameters."""
    idle = {"l2t": "latent head", "t2l": "text head"}
    modes = _modes_in_mix(cfg)
    idle_heads = sorted({idle[m] for m in modes if m in idle})
    if not idle_heads or env.world_size == 1:
        return []
    name = "idle_heads_fsdp2" if cfg.distributed.shards_model else "idle_heads_ddp"
    return [finding(name, modes=", ".join(modes), heads=" and the ".join(idle_heads))]


def check_fused_optimizer(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    if cfg.optim.fused is True and not env.fused_adamw:
        return [finding("fused_unavailable", device=env.device)]
    if cfg.optim.fused is False and env.fused_adamw:
        return [finding("fused_off", device=env.device)]
    return []


def _num_saved(cfg: RunConfig) -> tuple[int, int]:
    """(checkpoints the run writes, milestones among them that are never pruned)."""
    steps, every, milestone = cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.milestone_every
    saved = steps // every + (1 if steps % every else 0)  # plus the final step
    if not milestone:
        return saved, 0
    milestones = steps // math.lcm(every, milestone) + (1 if steps % milestone == 0 and steps % every else 0)
    return saved, milestones


def check_checkpoint_retention(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    saved, milestones = _num_saved(cfg)
    kept = min(saved, cfg.checkpoint.keep_last + milestones)
    need = (kept + 1) * est.checkpoint_gib  # +1: the next one is written before the oldest is pruned
    if need <= 0.5 * env.free_disk_gib:
        return []
    severity = "error" if need > env.free_disk_gib else "warning"
    values = dict(
        need=need,
        kept=kept,
        each=est.checkpoint_gib,
        keep_last=cfg.checkpoint.keep_last,
        milestones=milestones,
        free=env.free_disk_gib,
        run_dir=cfg.train.run_dir,
    )
    budget = int(0.5 * env.free_disk_gib / est.checkpoint_gib) - 1
    if budget - milestones >= 1:
        keep = budget - milestones
        return [finding("disk_keep_fewer", {"checkpoint.keep_last": keep}, severity, keep=keep, **values)]
    if budget >= 1:
        changes = {"checkpoint.milestone_every": 0, "checkpoint.keep_last": budget}
        return [finding("disk_no_milestones", changes, severity, keep=budget, **values)]
    return [finding("disk_too_small", severity=severity, **values)]


def check_feasibility(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """What the trainer refuses on this world size (mmldlm.config.infeasible), judged at the micro-batch
    each process runs (1 under auto, the least the trainer tries); and a configured micro-batch that each
    process runs as its share of the global batch instead (a note)."""
    micro, findings = micro_per_process(cfg, env), []
    if cfg.train.micro_batch_size not in ("auto", micro):
        findings.append(_micro_batch_shared_out(cfg, env, micro))
    problems = infeasible(cfg, env.world_size, micro)
    # The finding names the global batch first, then the schedule (the trainer, the schedule first).
    unsplit = {p.key: p.value for p in problems if p.case == "batch_split" and p.key == "train.global_batch_size"}
    unsplit.update({p.key: p.value for p in problems if p.case == "batch_split"})
    if unsplit:
        findings.append(_batch_not_split(cfg, env, est, unsplit, micro))
    values = dict(world_size=env.world_size, micro=cfg.train.micro_batch_size, global_batch=cfg.train.global_batch_size)
    return findings + [finding(p.case, **values) for p in problems if p.case.startswith("step_in_backward")]


def _batch_not_split(cfg: RunConfig, env: Environment, est: Estimate, unsplit: dict[str, int], micro: int) -> Finding:
    per_step = micro * env.world_size
    sizes = ", ".join(f"{key}={size}" for key, size in unsplit.items())
    values = dict(sizes=sizes, micro=micro, world_size=env.world_size, per_step=per_step)
    # A smaller micro-batch keeps the global batch (the recipe the LR was tuned for); only when none
    # divides it is the global batch rounded up.
    auto = cfg.train.micro_batch_size == "auto"
    smaller = None if auto else _largest_micro_batch(cfg, env, est, limit=math.inf)
    if smaller is not None:
        return finding("batch_smaller_micro", {"train.micro_batch_size": smaller}, micro_fix=smaller, **values)
    changes = {"train.global_batch_size": math.ceil(cfg.train.global_batch_size / per_step) * per_step}
    if cfg.train.batch_schedule:
        changes["train.batch_schedule"] = [
            [step, math.ceil(size / per_step) * per_step] for step, size in cfg.train.batch_schedule
        ]
    rounded = ", ".join(f"{key}={value}" for key, value in changes.items())
    return finding("batch_share" if auto else "batch_round_up", changes, rounded=rounded, **values)


def _micro_batch_shared_out(cfg: RunConfig, env: Environment, micro: int) -> Finding:
    t = cfg.train
    values = dict(
        configured=t.micro_batch_size, world_size=env.world_size, micro=micro, global_batch=t.global_batch_size
    )
    smallest = min(global_batch_sizes(t.global_batch_size, t.batch_schedule))
    accumulation = t.global_batch_size // (micro * env.world_size)
    return finding("batch_micro_per_process", smallest=smallest, accumulation=accumulation, **values)


def check_lr_schedule(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    s, steps, findings = cfg.schedule, cfg.train.steps, []
    warmup_fix = {"schedule.warmup_steps": steps // 10}
    if s.warmup_steps >= steps:
        findings.append(finding("warmup_whole_run", warmup_fix, warmup=s.warmup_steps, steps=steps, tenth=steps // 10))
    elif s.warmup_steps > steps // 2:
        findings.append(finding("warmup_long", warmup_fix, warmup=s.warmup_steps, steps=steps, tenth=steps // 10))
    after = steps - min(s.warmup_steps, steps)
    if s.kind == "cosine_restarts" and after and (after - 1) % s.restart_period < s.restart_period // 2:
        cycles = max(1, round(after / s.restart_period))
        period = math.ceil(after / cycles)  # the last cycle ends at (or just before) the last step
        values = dict(period=s.restart_period, after=after, fitted=period)
        findings.append(finding("restart_late", {"schedule.restart_period": period}, **values))
    if s.plateau.enabled and s.plateau.min_lr >= cfg.optim.lr:
        floor = cfg.optim.lr / 100
        values = dict(min_lr=s.plateau.min_lr, lr=cfg.optim.lr, floor=floor)
        findings.append(finding("plateau_floor", {"schedule.plateau.min_lr": floor}, **values))
    late = [entry for entry in cfg.train.batch_schedule if entry[0] >= steps]
    if late:
        kept = [entry for entry in cfg.train.batch_schedule if entry[0] < steps]
        findings.append(finding("batch_growth_late", {"train.batch_schedule": kept}, late=late, steps=steps, kept=kept))
    findings += _resume_with_other_length(cfg)
    return findings


def _resume_with_other_length(cfg: RunConfig) -> list[Finding]:
    """A run directory that already holds a checkpoint of a run planned with other train.steps: the
    schedule is a function of train.steps, so resuming with a new length makes the LR jump. None where the
    checkpoint is at or past the new train.steps: that resume trains nothing (`mmldlm train` says so)."""
    run_dir = Path(cfg.train.run_dir)
    pointer = run_dir / "checkpoints" / "latest"
    try:
        before = yaml.safe_load(current_run_config(run_dir).read_text())["train"]["steps"]
        step = int(pointer.read_text().strip().split("-")[1])
    except (OSError, yaml.YAMLError, KeyError, TypeError, IndexError, ValueError):
        return []
    if before == cfg.train.steps or cfg.schedule.kind == "constant" or not isinstance(before, int):
        return []
    if step >= cfg.train.steps:  # a resume that trains nothing
        return []
    if cfg.schedule.num_steps is not None:  # the schedule's own length: train.steps does not move the LR
        return []
    old = LRSchedule(cfg.schedule, cfg.optim.lr, before).lr(step)
    new = LRSchedule(cfg.schedule, cfg.optim.lr, cfg.train.steps).lr(step)
    name = "resume_after_end" if step >= before - 1 else "resume_other_length"
    return [finding(name, run_dir=run_dir, step=step, before=before, steps=cfg.train.steps, old=old, new=new)]


def check_resume_topology(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """`--resume` naming a checkpoint written by another number of processes or another strategy: what
    the resume does then (one line); a checkpoint of the full-state format cannot be resumed."""
    if env.resume in (None, "none"):
        return []
    try:
        path = find_latest(Path(cfg.train.run_dir) / "checkpoints") if env.resume == "auto" else Path(env.resume)
        meta = json.loads((path / "meta.json").read_text()) if path is not None else None
    except (OSError, ValueError, CheckpointError):
        return []  # no checkpoint, or none that reads: `mmldlm train` says which and why
    if meta is None or not isinstance(meta.get("world_size"), int):
        return []
    values = {"resume": env.resume, "path": path}
    if is_full_state(path):
        return [finding("resume_full_state", **values)]
    strategy = cfg.distributed.strategy if env.world_size > 1 else "single"
    before_strategy = meta.get("strategy", "ddp" if meta["world_size"] > 1 else "single")
    if (meta["world_size"], before_strategy) == (env.world_size, strategy):
        return []
    values.update(before=meta["world_size"], before_strategy=before_strategy, now=env.world_size, strategy=strategy)
    return [finding("resume_other_topology", **values)]


def check_slow_switches(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """The baseline preset's performance choices (configs/baseline.yaml), each slower with no gain, and
    switches that undo each other's gain."""
    fires = {
        "find_unused_parameters": cfg.distributed.find_unused_parameters,
        "optimizer_loop": not cfg.optim.foreach and cfg.optim.fused is not True,
        "refreeze": cfg.perf.refreeze_every_step,
        "attention": cfg.model.attention == "explicit",
        "precision_fp32": cfg.train.precision == "fp32" and env.native_bf16,
        "precision_emulated": cfg.train.precision == "bf16" and not env.native_bf16,
        "compile_shapes": cfg.perf.compile
        and cfg.data.pad_to_multiple < 64
        and cfg.data.length_buckets is None
        and not cfg.perf.cuda_graphs,
        "packing_bucketed": cfg.data.packing and cfg.data.bucket_batches > 1,
        "async_save_cpu": cfg.checkpoint.async_save and env.device == "cpu",
    }
    values = dict(device=env.device, pad=cfg.data.pad_to_multiple, bucket_batches=cfg.data.bucket_batches)
    found = [finding(name, **values) for name, fired in fires.items() if fired]
    if cfg.perf.compute_weights:
        found += compute_weights_findings(cfg, env)
    found += packed_rows_mask_findings(cfg, env)
    if (cfg.perf.cuda_graphs or cfg.perf.cudnn_attention) and cfg.data.length_buckets is None:
        found += few_shapes_findings(cfg)
    return found


def check_compile_model_graphs(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    """perf.compile_model under static shapes (perf.cuda_graphs, or perf.compile_dynamic=false): how
    many whole-model graphs the batches can ask for, one per batch shape, mode and count of text
    rows (perf.text_row_buckets, for the modes that run the text head); a warning past 24, and on
    packed rows of any count (no data.pack_rows)."""
    perf = cfg.perf
    if not (perf.compile and perf.compile_model and (perf.cuda_graphs or perf.compile_dynamic is False)):
        return []
    shapes = batch_shape_count(cfg.data, max_length_of(cfg))
    if shapes is None:  # packed rows without data.pack_rows: as many row counts as the texts fill
        return [finding("compile_model_graphs_rows")]
    modes = _modes_in_mix(cfg)
    rows = perf.text_row_buckets  # the config asks for it under static shapes
    per_shape = sum(1 if mode == "t2l" else rows for mode in modes)
    graphs = shapes * per_shape
    values = dict(graphs=graphs, shapes=shapes, per_shape=per_shape, modes=", ".join(modes), rows=rows)
    return [finding("compile_model_graphs", severity="warning" if graphs > 24 else None, **values)]


def compute_weights_findings(cfg: RunConfig, env: Environment) -> list[Finding]:
    """perf.compute_weights=true where the trainer turns it off (training/compute_weights.py): precision
    resolved as the trainer resolves it on `env`, more than one process, or optim.step_in_backward."""
    precision = cfg.train.precision
    if precision == "auto":
        precision = auto_precision(env.device, env.native_bf16)
    reason = compute_weights_off_reason(precision, env.world_size > 1, cfg.optim.step_in_backward)
    return [] if reason is None else [finding("compute_weights_off", reason=reason)]


def packed_rows_mask_findings(cfg: RunConfig, env: Environment) -> list[Finding]:
    """Packed rows at least 4x as wide as the longest text (a whole micro-batch in one row) attended
    through SDPA's block-diagonal mask on a CUDA device, where the variable-length kernel runs."""
    max_length = max_length_of(cfg)
    width = cfg.data.pack_length or max_length
    if not cfg.data.packing or env.device != "cuda" or cfg.model.attention == "varlen" or width < 4 * max_length:
        return []
    values = dict(width=width, attention=cfg.model.attention, times=width // max_length, max_length=max_length)
    return [finding("packed_rows_mask", **values)]


def few_shapes_findings(cfg: RunConfig) -> list[Finding]:
    """perf.cuda_graphs (a graph per shape) and perf.cudnn_attention (an execution plan per shape) on
    batches of many shapes: more than 4 text lengths, or packed rows without data.pack_rows;
    the fix proposes three length buckets between data.pad_to_multiple and the longest length."""
    if cfg.data.packing:  # its row counts: few with data.pack_rows (which cuda_graphs needs)
        return [finding("cudnn_attention_packing")] if cfg.perf.cudnn_attention and cfg.data.pack_rows is None else []
    pad, max_length = cfg.data.pad_to_multiple, max_length_of(cfg)
    shapes = len(padded_lengths(cfg.data, max_length))
    if shapes <= 4:
        return []
    buckets = sorted({max(pad, -(-max_length * k // 4 // pad) * pad) for k in (1, 2, 3)} - {max_length})
    values = dict(shapes=shapes, pad=pad, max_length=max_length, buckets=buckets)
    switches = [name for name in ("cuda_graphs", "cudnn_attention") if getattr(cfg.perf, name)]
    return [finding(f"{name}_shapes", {"data.length_buckets": buckets}, **values) for name in switches]


CHECKS = (
    check_timeout,
    check_nccl_environment,
    check_loader,
    check_busy_cpus,
    check_memory,
    check_unused_parameters,
    check_fused_optimizer,
    check_checkpoint_retention,
    check_feasibility,
    check_lr_schedule,
    check_resume_topology,
    check_slow_switches,
    check_compile_model_graphs,
    check_long_texts,
)


def audit(cfg: RunConfig, env: Environment) -> tuple[list[Finding], Estimate]:
    est = estimate(cfg, env)
    findings = [f for check in CHECKS for f in check(cfg, env, est)]
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity]), est


# --------------------------------------------------------------------------------------------------
# --fix


def apply_changes(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    raw = to_dict(cfg)
    for key, value in changes.items():
        node = raw
        *sections, name = key.split(".")
        for section in sections:
            node = node[section]
        node[name] = value
    fixed = from_dict(RunConfig, raw)
    fixed.check()
    return fixed


def fix_config(cfg: RunConfig, env: Environment, max_fixes: int = 20) -> tuple[RunConfig, list[Finding]]:
    """Apply the findings' config changes one at a time, most severe first, auditing again after each:
    one fix can settle another (a smaller micro-batch can make the global batch divisible) or expose
    one. Returns the corrected config and the findings whose changes were applied."""
    applied = []
    for _ in range(max_fixes):
        fixable = [f for f in audit(cfg, env)[0] if f.changes]
        if not fixable:
            break
        cfg = apply_changes(cfg, fixable[0].changes)
        applied.append(fixable[0])
    return cfg, applied


def config_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_diff(before: RunConfig, after: RunConfig, name_before: str, name_after: str) -> str:
    return "".join(
        difflib.unified_diff(
            config_yaml(before).splitlines(keepends=True),
            config_yaml(after).splitlines(keepends=True),
            name_before,
            name_after,
        )
    )


def format_finding(f: Finding) -> str:
    return f"{f.severity.upper():7s} [{f.rule}] {f.message}\n    why: {f.why}\n    fix: {f.fix}"


def describe(env: Environment, est: Estimate, cfg: RunConfig) -> str:
    where = "GPU" if env.device == "cuda" else "RAM"
    disk = "free disk not known" if math.isinf(env.free_disk_gib) else f"{env.free_disk_gib:.1f} GiB free disk"
    return (
        f"environment: {env.device}, {counted(env.cpus, 'CPU')} (load {env.load:.1f}), "
        f"{counted(env.nproc_per_node, 'process')} x {counted(env.nnodes, 'node')}, "
        f"{env.device_memory_gib:.1f} GiB {where} per process, {disk}\n"
        f"model: {est.num_params / 1e6:.2f}M parameters (vocab {est.vocab_size}); estimated "
        f"{est.memory_gib(micro_per_process(cfg, env)):.2f} GiB per process at micro-batch "
        f"{micro_per_process(cfg, env)} with activation checkpointing {est.checkpointing} ({est.seq_len:.1f} "
        f"text positions per sample: {est.seq_len_source}); "
        f"{est.checkpoint_gib:.3f} GiB per checkpoint"
    )
