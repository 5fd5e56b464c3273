"""`mmldlm check`: audit a run config, and the machine it would run on, for the problems that make a
run fail or waste its hardware (timeouts, loader, memory, batch splits, LR schedule, slow switches)
before any device hour is spent.

What each finding says is data: RULES maps a case to its rule id, severity, message, why and fix
(templates filled with the values that made it fire). When a rule fires is decided by small functions
`check_*(cfg, env, est) -> list[Finding]`, listed in CHECKS. When the fix is a config change a finding
also carries it as {"section.key": value}, which `fix_config` applies (`--fix OUT`). Fixes outside
the config (environment variables, free disk) are described but cannot be applied to a file.

The memory and checkpoint-size numbers are estimates from the parameter count (the model is built on
the meta device: no memory), documented in `estimate`; they are meant to catch a run that cannot fit
by a wide margin, not to replace a measurement (`mmldlm train` logs the real peak memory).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from mmldlm.config import MODES, ConfigError, ModelConfig, RunConfig, from_dict, to_dict
from mmldlm.data import DataError, long_texts
from mmldlm.data.dataset import default_num_workers, heaviest_batch, open_dataset
from mmldlm.data.encoders import ENCODER_WIDTHS
from mmldlm.data.prepare import default_prepare_options
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.runs.checkpoints import find_latest, is_full_state
from mmldlm.runs.files import CheckpointError, current_run_config
from mmldlm.training.batch_size import batch_shape, global_batch_sizes, per_process_micro_batch
from mmldlm.training.metrics import cpu_has_native_bf16
from mmldlm.training.optim import STATE_BYTES
from mmldlm.training.schedules import LRSchedule
from mmldlm.training.storage import free_bytes

GIB = 2**30
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    rule: str
    severity: str  # "error": the run fails or wastes its resources; "warning": slower or riskier; "info": a note
    message: str
    why: str
    fix: str
    changes: dict[str, Any] = field(default_factory=dict)  # config key -> corrected value; empty: not a config fix


@dataclass
class Environment:
    """Where the run would go: detected by `detect_environment`, or built by hand (tests, what-ifs)."""

    device: str = "cpu"  # "cuda" | "cpu"
    device_memory_gib: float = 16.0  # per process: the GPU's memory, or RAM / processes per node on CPU
    cpus: int = 1  # CPUs this node's processes share
    load: float = 0.0  # about how many of `cpus` other work keeps busy (a 1-minute load average)
    torch_threads: int = 1  # intra-op threads per process with train.threads=null (torch's default there)
    nproc_per_node: int = 1
    nnodes: int = 1
    free_disk_gib: float = 100.0  # at train.run_dir (or its nearest existing parent)
    fused_adamw: bool = True  # torch's fused AdamW kernel works on `device`
    native_bf16: bool = False  # bf16 matmuls in hardware (a CUDA GPU, or a CPU with AVX512-BF16/AMX)
    environ: dict[str, str] = field(default_factory=dict)  # the NCCL / torch variables that matter
    environ_source: str = "the environment"  # where `environ` was read, as findings name it
    resume: str | None = None  # what `mmldlm train --resume` would be given: "auto", a checkpoint path, or none

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


NCCL_VARIABLES = (
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_BLOCKING_WAIT",
)


def _fused_adamw_works(device: str) -> bool:
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def _load_on(cpus: int) -> float:
    """The machine's 1-minute load average (os.getloadavg), scaled to the share of its CPUs that this
    process may use (a container or taskset may allow fewer than the machine has)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not a Unix, or no /proc/loadavg: nothing known
        return 0.0
    return load * cpus / max(cpus, os.cpu_count() or 1)


def detect_environment(
    cfg: RunConfig,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    device_memory_gib: float | None = None,
    load: float | None = None,
) -> Environment:
    """This machine as the run would see it; process counts default to the torchrun/launcher variables,
    the load to the machine's 1-minute load average on this process's CPUs."""
    nproc = nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC_PER_NODE") or 1)
    nodes = nnodes or int(os.environ.get("NNODES") or 1)
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    if device_memory_gib is None:
        if cuda:
            device_memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        else:  # CPU: the node's RAM is shared by its processes
            device_memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB / nproc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # torchrun sets OMP_NUM_THREADS=1 for several processes per node unless it is set already.
    threads = torch.get_num_threads() if nproc == 1 or "OMP_NUM_THREADS" in os.environ else 1
    return Environment(
        device="cuda" if cuda else "cpu",
        device_memory_gib=device_memory_gib,
        cpus=cpus,
        load=_load_on(cpus) if load is None else load,
        torch_threads=threads,
        nproc_per_node=nproc,
        nnodes=nodes,
        free_disk_gib=free_bytes(cfg.train.run_dir) / GIB,
        fused_adamw=_fused_adamw_works("cuda" if cuda else "cpu"),
        native_bf16=torch.cuda.is_bf16_supported() if cuda else cpu_has_native_bf16(),
        environ={k: os.environ[k] for k in NCCL_VARIABLES if k in os.environ},
    )


# --------------------------------------------------------------------------------------------------
# Estimates.


@dataclass
class Estimate:
    num_params: int
    vocab_size: int
    seq_len: float  # text positions per sample: of the heaviest batch of the prepared data, else the longest
    seq_len_source: str  # where seq_len comes from, for the summary line
    static_gib: float  # weights, gradients, optimizer state, autocast copies and runtime overhead per process
    activations_gib_per_sample: float
    checkpoint_gib: float

    def memory_gib(self, micro_batch_size: int) -> float:
        return self.static_gib + micro_batch_size * self.activations_gib_per_sample


def vocab_size_of(cfg: RunConfig) -> int:
    """model.vocab_size, else the prepared dataset's (data.path/meta.json), else the default corpus's."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    if cfg.data.path is not None:
        meta = Path(cfg.data.path) / "meta.json"
        if meta.is_file():
            return int(json.loads(meta.read_text())["vocab_size"])
    return cfg.data.vocab_size


def model_of(cfg: RunConfig) -> ModelConfig:
    """cfg.model with a null latent_dim and num_latents set as training would set them: the prepared
    dataset's where it exists, else the sentence encoder's width (one latent per text)."""
    m = cfg.model
    if m.latent_dim is not None and m.num_latents is not None:
        return m
    path = prepared_data_path(cfg)
    if path is not None:
        meta = json.loads((path / "meta.json").read_text())
        shape = meta["num_latents"], meta["latent_dim"]
    elif cfg.data.encoder in ENCODER_WIDTHS:
        shape = 1, ENCODER_WIDTHS[cfg.data.encoder]
    else:
        raise ConfigError(
            f"config key 'model.latent_dim': null, and neither a prepared dataset at data.path nor a known "
            f"width of the encoder {cfg.data.encoder!r} gives it; set model.latent_dim (and model.num_latents)"
        )
    return dataclasses.replace(
        m,
        num_latents=shape[0] if m.num_latents is None else m.num_latents,
        latent_dim=shape[1] if m.latent_dim is None else m.latent_dim,
    )


def count_parameters(model: ModelConfig, vocab_size: int) -> int:
    with torch.device("meta"):  # shapes only
        network = MultimodalMMDiT(model, vocab_size=vocab_size)
    return sum(p.numel() for p in network.parameters())


def prepared_data_path(cfg: RunConfig) -> Path | None:
    """The prepared dataset a run of `cfg` would read, where it exists already: data.path, or for a
    null path the default corpus's cache entry."""
    path = Path(cfg.data.path) if cfg.data.path is not None else Path(default_prepare_options(cfg.data).out)
    return path if (path / "meta.json").is_file() else None


def text_positions_per_sample(cfg: RunConfig, env: Environment) -> tuple[float, str]:
    """Text positions the model computes per sample in the heaviest micro-batch of the run's first
    epoch (mmldlm/data/dataset.py, `heaviest_batch_lengths`): from the prepared dataset's real lengths
    under data.bucket_batches, where the dataset is there to read (only its offsets are read), else
    every text at data.max_length (or model.max_seq_len); and where the figure comes from."""
    max_length = max_length_of(cfg)
    path = prepared_data_path(cfg)
    if path is None:
        return float(max_length), f"every text at the longest length, {max_length} (no prepared dataset to read)"
    dataset = open_dataset(path, "train")
    data = dataclasses.replace(cfg.data, max_length=max_length)
    micro = _micro_for_estimate(cfg, env)
    try:
        batch = heaviest_batch(dataset, data, micro, world_size=env.world_size)
    except DataError as err:  # not one batch of that size in the data: the loader refuses it too
        return float(max_length), f"every text at the longest length, {max_length} ({err})"
    rows, length = batch.get("pack_doc", batch["tokens"]).shape  # packed: the rows the blocks run on
    return rows * length / micro, f"the heaviest batch of {path}: {batch_shape(batch)}"


def estimate(cfg: RunConfig, env: Environment) -> Estimate:
    """Memory per process and checkpoint size from the parameter count P.

    Static: fp32 weights 4P + gradients 4P (none all at once with optim.step_in_backward) + AdamW
    moments 8P (about 2P in int8, 1P in int4: optim.state_dtype), divided by the world size under
    FSDP2, which shards all three (by the shard group size under HSDP); plus a 2P low-precision weight
    copy under bf16/fp16 autocast, plus runtime overhead (CUDA context and allocator slack 0.75 GiB;
    0.3 GiB of process on CPU).
    Activations per sample: a GPT block stores about S * H * (34 + 5 * nh * S / H) bytes with 16-bit
    activations (Korthikanti et al. 2022, sec. 4.1), over S = L + K tokens here. An MMDiT block also
    keeps its adaLN-modulated inputs and the QK-norm and RoPE outputs: 50 instead of 34 matches the
    tiny preset's measured RSS growth per sample in fp32 on CPU (twice the bytes of 16-bit). The
    5 * nh * S / H term (the attention matrix) counts only for the explicit-softmax attention; SDPA's
    fused kernels do not store it. The text head adds L * V * 12 bytes (logits, log-probabilities
    and their gradient in fp32). L is the text positions per sample of the heaviest batch the data
    yield (`text_positions_per_sample`).
    Checkpoint: model.safetensors 4P + optimizer.pt 8P (fp32 weights and the two AdamW moments; about
    2P or 1P for the moments in int8 or int4).
    """
    m = model_of(cfg)
    vocab = vocab_size_of(cfg)
    params = count_parameters(m, vocab)
    seq_len, seq_len_source = text_positions_per_sample(cfg, env)
    tokens = seq_len + m.num_latents
    low_precision = cfg.train.precision in ("bf16", "fp16") or (cfg.train.precision == "auto" and env.native_bf16)
    shards = cfg.distributed.num_shards(env.world_size, env.nproc_per_node)
    # fp32 weights 4, gradients 4 (none all at once with the step in backward), AdamW moments by state_dtype
    moments = STATE_BYTES[cfg.optim.state_dtype]
    state = 4 + (0 if cfg.optim.step_in_backward else 4) + moments
    static = state * params / shards + (2 * params if low_precision else 0)
    static += (0.75 if env.device == "cuda" else 0.3) * GIB
    attention = 5 * m.num_heads * tokens / m.hidden_size if m.attention == "explicit" else 0
    per_block = tokens * m.hidden_size * (50 + attention) * (1 if low_precision else 2)
    per_sample = m.num_blocks * per_block + seq_len * vocab * 12
    return Estimate(
        num_params=params,
        vocab_size=vocab,
        seq_len=seq_len,
        seq_len_source=seq_len_source,
        static_gib=static / GIB,
        activations_gib_per_sample=per_sample / GIB,
        checkpoint_gib=(4 + moments) * params / GIB,
    )


# --------------------------------------------------------------------------------------------------
# The rules, as data: what each finding says. `message`, `why` and `fix` are str.format templates
# filled with the values the deciding function (the `check_*` functions below) passes; `changes` is
# the fix as config changes when it does not depend on the values. One rule id (the name printed in
# brackets) can have several entries, one per case, each with its own severity and fix.


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    message: str
    why: str
    fix: str
    changes: dict[str, Any] = field(default_factory=dict)


TIMEOUT_WHY = (
    "a rank that dies or hangs leaves the others waiting in a collective for this long, holding every "
    "device of the job, before the job fails and the launcher can restart it from the last checkpoint"
)
TIMEOUT_FIX = "distributed.timeout_minutes=30", {"distributed.timeout_minutes": 30.0}
HEARTBEAT_WHY = (
    "the NCCL heartbeat monitor kills a rank whose watchdog is stuck; days let a wedged rank hold the "
    "job, and less than the collective timeout kills ranks before the timeout can say which "
    "collective hung"
)
HEARTBEAT_FIX = (
    "unset TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: the trainer sets it to the collective timeout + 60 s ({heartbeat:.0f})"
)
MEMORY_MESSAGE = (
    "estimated {need:.1f} GiB per process ({static:.1f} GiB weights, gradients, optimizer state and "
    "overhead for {params_m:.1f}M parameters + {micro} x {activations_mib:.0f} MiB of activations at "
    "micro-batch {micro}) > {headroom:.0%} of {device_memory:.1f} GiB {device}"
)
MEMORY_WHY = "the first steps run out of memory (CUDA OOM, or the kernel's OOM killer on CPU)"
IDLE_HEAD_MESSAGE = "modes {modes}: the {heads} get no gradient on some steps"
IDLE_HEAD_WHY = (
    "plain DDP would need find_unused_parameters=True (a graph walk every step) or fail with "
    "'Expected to have finished reduction'; "
)
DISK_MESSAGE = (
    "checkpoints need up to {need:.1f} GiB ({kept} kept + 1 being written, {each:.2f} GiB each: "
    "checkpoint.keep_last={keep_last}, {milestones} milestone(s)) with {free:.1f} GiB free at {run_dir}"
)
DISK_WHY = "a checkpoint write that runs out of disk fails the run (and the disk of everything else on it)"
BATCH_MESSAGE = "{sizes} not a multiple of micro-batch x world size = {micro} x {world_size} = {per_step}"
BATCH_WHY = (
    "the global batch is split into micro-batches of train.micro_batch_size on each of {world_size} "
    "process(es); the trainer refuses to start otherwise"
)
STEP_IN_BACKWARD_WHY = (
    "each parameter is updated as soon as its gradient of one micro-batch on one process is ready, "
    "before accumulation or the data-parallel reduction: the trainer refuses to start"
)
STEP_IN_BACKWARD_FIX = (
    ("optim.step_in_backward=false (or one process with train.micro_batch_size = train.global_batch_size)"),
    {"optim.step_in_backward": False},
)
WARMUP_FIX = "schedule.warmup_steps={tenth}"
RESUME_MESSAGE = (
    "{run_dir} holds a checkpoint at step {step} of a run planned for train.steps={before}; this "
    "config has train.steps={steps}"
)
RESUME_WHY = "the schedule spans train.steps: resuming makes the LR jump from {old:.3g} to {new:.3g} at step {step}"
RESUME_FIX = "keep train.steps={before}, or accept the jump (schedule.warmup_steps does not apply again)"

TOPOLOGY_MESSAGE = (
    "--resume {resume}: checkpoint {path} was written by {before} process(es) ({before_strategy}), this run "
    "has {now} ({strategy})"
)
TOPOLOGY_WHY = (
    "the checkpoint is resharded to this run (model, optimizer and EMA); the LR schedule goes on by step, the "
    "data at the samples seen (none repeated or skipped, accumulation from the global batch); each rank's RNG "
    "is seeded from (train.seed, step, rank) instead of restored"
)

RULES = {
    # Timeouts and the NCCL watchdog: a hung rank must fail the job, soon but not too soon.
    "timeout_days": Rule(
        "timeout", "error", "distributed.timeout_minutes={minutes:g} ({days:.1f} days)", TIMEOUT_WHY, *TIMEOUT_FIX
    ),
    "timeout_hours": Rule(
        "timeout", "warning", "distributed.timeout_minutes={minutes:g} is over 2 hours", TIMEOUT_WHY, *TIMEOUT_FIX
    ),
    "timeout_short": Rule(
        "timeout",
        "warning",
        "distributed.timeout_minutes={minutes:g} is under 5 minutes",
        "a slow but healthy collective (the checkpoint gather of a large model, the first step "
        "compiling) would be taken for a hang and kill the job",
        *TIMEOUT_FIX,
    ),
    "heartbeat_absurd": Rule(
        "nccl_env", "error", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={value} in {source}", HEARTBEAT_WHY, HEARTBEAT_FIX
    ),
    "heartbeat_short": Rule(
        "nccl_env",
        "warning",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={value} in {source} is below distributed.timeout_minutes ({timeout_s:g} s)",
        HEARTBEAT_WHY,
        HEARTBEAT_FIX,
    ),
    "async_errors_off": Rule(
        "nccl_env",
        "error",
        "{name}=0 in {source}",
        "a collective that times out then leaves the process hanging instead of tearing it "
        "down, so torchrun never sees a failure and never restarts",
        "unset {name} (the trainer and scripts/launch.sh set it to 1)",
    ),
    "monitoring_off": Rule(
        "nccl_env",
        "warning",
        "TORCH_NCCL_ENABLE_MONITORING=0 in {source}",
        "without the heartbeat monitor a rank whose NCCL watchdog is stuck is never killed",
        "unset TORCH_NCCL_ENABLE_MONITORING",
    ),
    "blocking_wait": Rule(
        "nccl_env",
        "warning",
        "{name}=1 in {source}",
        "the training thread then blocks on every collective until it finishes, so the CPU no longer "
        "queues the next kernels while gradients are reduced; a hung collective is already torn down by "
        "asynchronous error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING=1) within the collective timeout",
        "unset {name} (or set it to 0)",
    ),
    # The data loader.
    "too_many_workers": Rule(
        "loader_workers",
        "warning",
        "data.num_workers={workers} with {cpus} CPUs for {nproc} process(es) per node ({per_rank} per process)",
        "more worker processes than CPUs fight each other and the training threads for cores; "
        "16 workers per rank on a few cores slow data loading down",
        "data.num_workers=null (min(8, cpus // local ranks) = {auto} here)",
        {"data.num_workers": None},
    ),
    "no_workers": Rule(
        "loader_workers",
        "warning",
        "data.num_workers=0 on CUDA",
        "the training process reads and pads every batch itself while the GPU waits",
        "data.num_workers=null ({auto} here)",
        {"data.num_workers": None},
    ),
    "short_prefetch": Rule(
        "loader_prefetch",
        "warning",
        "data.prefetch_factor=null (torch's default: 2)",
        "each worker keeps only 2 batches ready, so a slow batch stalls the step",
        "data.prefetch_factor=4",
        {"data.prefetch_factor": 4},
    ),
    "workers_restart": Rule(
        "loader_persistence",
        "warning",
        "data.persistent_workers=false",
        "the worker processes are started again every epoch (fork, dataset reopen), and the "
        "first batches of each epoch wait for them",
        "data.persistent_workers=true",
        {"data.persistent_workers": True},
    ),
    "pageable_memory": Rule(
        "loader_pin_memory",
        "warning",
        "data.pin_memory=false on CUDA",
        "copies from pageable memory cannot overlap with compute",
        "data.pin_memory=null (on with CUDA)",
        {"data.pin_memory": None},
    ),
    # Other work on the CPUs of a CPU run.
    "busy_cpus": Rule(
        "busy_cpus",
        "warning",
        "load average {load:.1f} on {cpus} CPUs leaves about {free} free for "
        "{threads} torch thread(s) ({nproc} process(es) x {per_process})",
        "a second busy process on the same cores makes torch's threads wait for each other at every "
        "operation: a training step took 25x as long (3.3 s instead of 0.13 s) with one other busy "
        "process on 2 cores and torch's default 2 threads",
        "set train.threads={fit} or stop the other job",
    ),
    # Memory, parameters and the optimizer.
    "memory_smaller_micro": Rule(
        "memory",
        "error",
        MEMORY_MESSAGE,
        MEMORY_WHY,
        "train.micro_batch_size={smaller} (more accumulation steps, the same global batch)",
    ),
    "memory_shard": Rule(
        "memory",
        "error",
        MEMORY_MESSAGE,
        MEMORY_WHY,
        "distributed.strategy=fsdp2 (shards weights, gradients and optimizer state over "
        "{world_size} processes), train.micro_batch_size={fits}",
    ),
    "memory_no_fit": Rule(
        "memory",
        "error",
        MEMORY_MESSAGE,
        MEMORY_WHY,
        "even micro-batch 1 does not fit: a smaller model preset, more devices with "
        "distributed.strategy=fsdp2, or a device with more memory",
    ),
    "idle_heads_ddp": Rule(
        "unused_parameters",
        "info",
        IDLE_HEAD_MESSAGE,
        IDLE_HEAD_WHY + "the trainer anchors the idle head into the loss (an exact zero gradient, then .grad=None "
        "before AdamW), so DDP runs with find_unused_parameters=False and static_graph is valid",
        "nothing to do",
    ),
    "idle_heads_fsdp2": Rule(
        "unused_parameters",
        "info",
        IDLE_HEAD_MESSAGE,
        IDLE_HEAD_WHY + "FSDP2 reduce-scatters only the gradients that exist; the idle head keeps a None "
        "gradient on every rank (all ranks train the same mode at a step)",
        "nothing to do",
    ),
    "fused_unavailable": Rule(
        "fused_optimizer",
        "error",
        "optim.fused=true but fused AdamW is unavailable on {device}",
        "building the optimizer fails before the first step",
        "optim.fused=auto (fused where available, else the foreach kernel)",
        {"optim.fused": "auto"},
    ),
    "fused_off": Rule(
        "fused_optimizer",
        "warning",
        "optim.fused=false although fused AdamW works on {device}",
        "the foreach kernel launches several kernels per parameter group step; the fused one, one",
        "optim.fused=auto",
        {"optim.fused": "auto"},
    ),
    # Checkpoints vs the disk (a warning when they fill half of it, an error when they do not fit).
    "disk_keep_fewer": Rule("checkpoint_retention", "warning", DISK_MESSAGE, DISK_WHY, "checkpoint.keep_last={keep}"),
    "disk_no_milestones": Rule(
        "checkpoint_retention",
        "warning",
        DISK_MESSAGE,
        DISK_WHY,
        "checkpoint.milestone_every=0, checkpoint.keep_last={keep}",
    ),
    "disk_too_small": Rule(
        "checkpoint_retention",
        "warning",
        DISK_MESSAGE,
        DISK_WHY,
        "free disk space or put train.run_dir on a larger filesystem",
    ),
    # Batch sizes.
    "batch_smaller_micro": Rule(
        "batch_divisible",
        "error",
        BATCH_MESSAGE,
        BATCH_WHY,
        "train.micro_batch_size={micro_fix} (the global batch stays)",
    ),
    "batch_round_up": Rule("batch_divisible", "error", BATCH_MESSAGE, BATCH_WHY, "{rounded}"),
    "batch_micro_per_process": Rule(
        "batch_divisible",
        "info",
        "train.micro_batch_size={configured} x {world_size} processes is more than the global batch of {smallest}",
        "the trainer runs micro-batches of {micro} on each process instead (accumulation {accumulation} for "
        "train.global_batch_size={global_batch}): the same global batch",
        "nothing to do (train.micro_batch_size={micro} says the same)",
    ),
    "step_in_backward_ranks": Rule(
        "step_in_backward",
        "error",
        "optim.step_in_backward=true with {world_size} processes",
        STEP_IN_BACKWARD_WHY,
        *STEP_IN_BACKWARD_FIX,
    ),
    "step_in_backward_accumulation": Rule(
        "step_in_backward",
        "error",
        "optim.step_in_backward=true with gradient accumulation "
        "(train.micro_batch_size={micro}, global batch {global_batch})",
        STEP_IN_BACKWARD_WHY,
        *STEP_IN_BACKWARD_FIX,
    ),
    # The LR schedule.
    "warmup_whole_run": Rule(
        "lr_schedule",
        "error",
        "schedule.warmup_steps={warmup} >= train.steps={steps}",
        "the run ends during warmup: the LR never reaches optim.lr and never decays",
        WARMUP_FIX,
    ),
    "warmup_long": Rule(
        "lr_schedule",
        "warning",
        "schedule.warmup_steps={warmup} is over half of train.steps={steps}",
        "most of the run trains below the peak LR; the decay is squeezed into the rest",
        WARMUP_FIX,
    ),
    "restart_late": Rule(
        "lr_schedule",
        "warning",
        "schedule.restart_period={period} ends the run early in a cosine cycle ({after} steps after warmup)",
        "the last steps train at a high LR just after a restart, so the final weights are not annealed",
        "schedule.restart_period={fitted}",
    ),
    "plateau_floor": Rule(
        "lr_schedule",
        "warning",
        "schedule.plateau.min_lr={min_lr:g} >= optim.lr={lr:g}",
        "reduce-on-plateau can never lower the LR",
        "schedule.plateau.min_lr={floor:g}",
    ),
    "batch_growth_late": Rule(
        "lr_schedule",
        "warning",
        "train.batch_schedule entries {late} start at or after train.steps={steps}",
        "they are never reached: the batch growth planned with the LR schedule never happens",
        "train.batch_schedule={kept}",
    ),
    "resume_other_length": Rule("lr_schedule", "warning", RESUME_MESSAGE, RESUME_WHY, RESUME_FIX),
    "resume_after_end": Rule(
        "lr_schedule", "warning", RESUME_MESSAGE, RESUME_WHY + " and the old schedule had already ended", RESUME_FIX
    ),
    "resume_other_topology": Rule(
        "resume_topology",
        "info",
        TOPOLOGY_MESSAGE,
        TOPOLOGY_WHY,
        "nothing to fix; resume on {before} process(es) with {before_strategy} to restore the RNG states too",
    ),
    "resume_full_state": Rule(
        "resume_topology",
        "error",
        "--resume {resume}: checkpoint {path} is of the earlier full-state format (model.safetensors)",
        "training resumes only from sharded checkpoints; that one can still be sampled, evaluated or exported",
        "resume it with the mmldlm that wrote it, or start a new run (another train.run_dir)",
    ),
    # The baseline preset's performance choices (configs/baseline.yaml), each slower with no gain.
    "find_unused_parameters": Rule(
        "find_unused_parameters",
        "warning",
        "distributed.find_unused_parameters=true",
        "DDP then walks the autograd graph after every forward; the idle head is already "
        "handled once per mode (parallelize.py), so every parameter takes part in every "
        "step",
        "distributed.find_unused_parameters=false",
        {"distributed.find_unused_parameters": False},
    ),
    "optimizer_loop": Rule(
        "optimizer_loop",
        "warning",
        "optim.foreach=false: AdamW steps one parameter at a time",
        "a Python loop over every parameter tensor each step; foreach and fused kernels batch them",
        "optim.foreach=true",
        {"optim.foreach": True},
    ),
    "refreeze": Rule(
        "refreeze",
        "warning",
        "perf.refreeze_every_step=true",
        "a loop over every parameter toggling requires_grad each step; freezing belongs to mode changes",
        "perf.refreeze_every_step=false",
        {"perf.refreeze_every_step": False},
    ),
    "attention": Rule(
        "attention",
        "warning",
        "model.attention=explicit materialises the (S, S) score matrix per head",
        "scaled_dot_product_attention uses flash / memory-efficient kernels on GPU: less memory, faster",
        "model.attention=sdpa",
        {"model.attention": "sdpa"},
    ),
    "precision_fp32": Rule(
        "precision",
        "warning",
        "train.precision=fp32 on a {device} with native bf16 matmuls",
        "bf16 autocast (fp32 master weights and optimizer state) runs the model's matmuls at "
        "about twice the speed and stores activations in half the bytes",
        "train.precision=auto",
        {"train.precision": "auto"},
    ),
    "precision_emulated": Rule(
        "precision",
        "warning",
        "train.precision=bf16 on a {device} without native bf16 matmuls",
        "bf16 is emulated there: slower than fp32, with less precision",
        "train.precision=auto (bf16 where native, else fp32)",
        {"train.precision": "auto"},
    ),
    "packing_bucketed": Rule(
        "packing_gaps",
        "warning",
        "data.packing=true with data.bucket_batches={bucket_batches}",
        "bucketed batches hold texts of similar length, which leave gaps at the ends of the packed rows: "
        "on the default corpus at micro-batch 64, 84% of the packed positions are real tokens "
        "bucketed against 96% unbucketed (docs/benchmarks.md)",
        "data.bucket_batches=1",
        {"data.bucket_batches": 1},
    ),
    "async_save_cpu": Rule(
        "async_save",
        "warning",
        "checkpoint.async_save=true on a CPU run",
        "the background copy and write take their CPU time from the training steps: with the small "
        "preset under FSDP2 on 2 processes, the step beside a save took 2.2-2.5x its time, more than "
        "a blocking save adds (docs/benchmarks.md). Saving in the background pays where the model "
        "computes on GPUs",
        "checkpoint.async_save=false",
        {"checkpoint.async_save": False},
    ),
    "long_texts": Rule(
        "long_texts",
        "warning",
        "{num_over} of {num_texts} training texts ({text_share:.1%}) are longer than data.max_length={max_length} "
        "tokens: {token_share:.1%} of all training tokens are never trained on",
        "the loader cuts every sample of {path} at data.max_length and the model never sees the rest; 99% of "
        "the texts are at most {p99} tokens",
        "model.max_seq_len={proposed}{data_max_length} (covers 99% of the texts; attention costs grow with "
        "the square of the length: the estimate goes from {memory_now:.2f} to {memory_then:.2f} GiB per "
        "process at micro-batch {micro}, and a run cannot resume with another max_seq_len), or prepare "
        "the data again with `mmldlm prepare --long-texts split --max-tokens {max_length}`: passages the "
        "model reads whole",
    ),
    "long_texts_tail": Rule(
        "long_texts",
        "info",
        "{num_over} of {num_texts} training texts ({text_share:.1%}) are longer than data.max_length={max_length} "
        "tokens: {token_share:.1%} of all training tokens are never trained on",
        "the loader cuts every sample of {path} at data.max_length; 99% of the texts fit, or under 0.1% of the "
        "tokens are lost",
        "to train on the rest too, prepare the data again with `mmldlm prepare --long-texts split "
        "--max-tokens {max_length}`",
    ),
    "long_texts_prepared": Rule(
        "long_texts",
        "info",
        "{num_long} of the {num_texts} texts read were {what} when {path} was prepared (--long-texts "
        "{long_texts}): longer than {limits}",
        "their ends are not in the data, so neither text nor latent describes them (prepare reported "
        'it; meta.json "lengths")',
        "to keep every word, prepare the data again with `mmldlm prepare --long-texts split{max_tokens}`",
    ),
    "compile_shapes": Rule(
        "compile_shapes",
        "warning",
        "perf.compile=true with data.pad_to_multiple={pad}",
        "a new padded length recompiles the blocks; after the first recompile torch falls back to "
        "a dynamic-length graph, whose kernels can be slower and which still recompiles now and "
        "then. Padding to 64 bounds the shapes, but on short texts it costs tokens: measure both "
        "(docs/benchmarks.md)",
        "data.pad_to_multiple=64",
        {"data.pad_to_multiple": 64},
    ),
    # A run of the older codebase, as `mmldlm migrate` reads its config and launcher (mmldlm/tools/migrate.py):
    # settings that only the older files can hold.
    "older_collective_timeout": Rule(
        "timeout",
        "warning",
        "NCCL_TIMEOUT={value} in {source}: the older trainer's collective timeout, {hours:.1f} hours",
        TIMEOUT_WHY + "; neither torch nor NCCL reads NCCL_TIMEOUT itself",
        *TIMEOUT_FIX,
    ),
    "older_no_checkpointing": Rule(
        "activation_checkpointing",
        "warning",
        "model.max_seq_len={length} with no activation checkpointing: estimated {need:.1f} GiB per GPU at "
        "micro-batch {micro} ({activations:.0f} MiB of activations per sample) of {memory:g} GiB",
        "every block keeps its activations for backward, so at this length activations, not weights, decide "
        "the micro-batch; checkpointing recomputes them in backward and frees room for a larger micro-batch "
        "(fewer accumulation steps for the same global batch)",
        "perf.activation_checkpointing=auto (the least of none, selective, full under which the micro-batch "
        "fits, probed at start-up)",
        {"perf.activation_checkpointing": "auto"},
    ),
    "older_lr_rules": Rule(
        "lr_schedule",
        "info",
        "the launcher computes optimizer.lr={lr:.3g} (from {base_lr}) and training.warmup_steps={warmup} "
        "(config: {config_warmup}) for an effective batch of {batch} on {world} GPUs and {steps} steps",
        "the LR follows the square root of effective batch / 32 and warmup 2% of the steps within "
        "[1000, 5000], both from the cluster's size: the same config is another recipe on another cluster",
        "optim.lr={lr:.3g}, schedule.warmup_steps={warmup} fixed, with train.global_batch_size={batch}; "
        "our trainer derives accumulation from the global batch on any cluster, so the recipe stays",
    ),
    "older_retention": Rule(
        "checkpoint_retention",
        "warning",
        "{key}={every}: the older trainer keeps every checkpoint, {saved} of about {each:.1f} GiB "
        "({total:.0f} GiB) over {steps} steps",
        "the disk fills while the run goes on; a checkpoint write that runs out of space fails the run",
        "checkpoint.keep_last=3 (and checkpoint.milestone_every=N for checkpoints to keep for good)",
        {"checkpoint.keep_last": 3},
    ),
    "older_fused": Rule(
        "fused_optimizer",
        "info",
        "optimizer.use_fused={value}",
        "the older trainer stepped AdamW one parameter at a time (the comparison recipe's optim.foreach=false); "
        "optim.fused=true would fail on a device without the fused kernel",
        "optim.fused=auto (the fused kernel where the device has it, else foreach)",
        {"optim.fused": "auto"},
    ),
    "older_heads": Rule(
        "num_heads",
        "warning",
        "model.n_heads={heads} does not divide model.hidden_size={width}",
        "the older block ignored the head count; ours honours it and needs whole heads of an even dim (RoPE)",
        "model.num_heads={fitted} (head dim {head_dim}: the nearest such head count, ties to fewer heads)",
    ),
}


def finding(name: str, /, changes: dict[str, Any] | None = None, severity: str | None = None, **values) -> Finding:
    """RULES[name] filled with `values`. `changes`: the fix computed from the config (else the rule's own);
    `severity`: for a rule whose severity depends on how far off the values are (else the rule's)."""
    rule = RULES[name]
    return Finding(
        rule.id,
        severity or rule.severity,
        rule.message.format(**values),
        rule.why.format(**values),
        rule.fix.format(**values),
        dict(rule.changes if changes is None else changes),
    )


# --------------------------------------------------------------------------------------------------
# When each rule fires.

MEMORY_HEADROOM = 0.9  # share of the device the estimate may fill (fragmentation, temporaries)


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
        if seconds is None or seconds > 86400:
            findings.append(finding("heartbeat_absurd", value=heartbeat, heartbeat=timeout_s + 60, source=source))
        elif seconds < timeout_s:
            findings.append(
                finding(
                    "heartbeat_short", value=heartbeat, timeout_s=timeout_s, heartbeat=timeout_s + 60, source=source
                )
            )
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
        findings.append(
            finding(
                "too_many_workers",
                workers=d.num_workers,
                cpus=env.cpus,
                nproc=env.nproc_per_node,
                per_rank=per_rank,
                auto=auto,
            )
        )
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
    leaves free. A CPU counts as taken from a load of 0.5 (the load average is over a minute)."""
    if env.device != "cpu":
        return []
    free = max(0, env.cpus - math.floor(env.load + 0.5))
    per_process = cfg.train.threads or env.torch_threads
    threads = per_process * env.nproc_per_node
    # One thread has no other to wait for; with no other work, more threads than CPUs is the config's choice.
    if per_process == 1 or threads <= free or free == env.cpus:
        return []
    fit = max(1, free // env.nproc_per_node)
    return [
        finding(
            "busy_cpus",
            {"train.threads": fit},
            fit=fit,
            load=env.load,
            cpus=env.cpus,
            free=free,
            threads=threads,
            nproc=env.nproc_per_node,
            per_process=per_process,
        )
    ]


def _micro_per_process(cfg: RunConfig, env: Environment) -> int:
    """The micro-batch the trainer runs on each process for a fixed train.micro_batch_size: the
    configured one, or each process's share of the global batch (see per_process_micro_batch)."""
    sizes = global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)
    return per_process_micro_batch(cfg.train.micro_batch_size, sizes, env.world_size)


def _largest_micro_batch(cfg: RunConfig, env: Environment, est: Estimate, limit: float) -> int | None:
    """The largest micro-batch below the one that runs that fits `limit` GiB and still divides every
    global batch size over the world size (the global batch, hence the training, stays the same)."""
    sizes = global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)
    for micro in range(_micro_per_process(cfg, env) - 1, 0, -1):
        if all(size % (micro * env.world_size) == 0 for size in sizes) and est.memory_gib(micro) <= limit:
            return micro
    return None


def check_memory(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    if cfg.train.micro_batch_size == "auto":
        # The trainer picks the largest micro-batch that fits; only micro-batch 1 must fit.
        if est.memory_gib(1) <= MEMORY_HEADROOM * env.device_memory_gib:
            return []
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
    micro = _micro_per_process(cfg, env)
    need, limit = est.memory_gib(micro), MEMORY_HEADROOM * env.device_memory_gib
    if need <= limit:
        return []
    values = dict(
        need=need,
        static=est.static_gib,
        params_m=est.num_params / 1e6,
        micro=micro,
        activations_mib=est.activations_gib_per_sample * 1024,
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
            return [
                finding(
                    "memory_shard",
                    {"distributed.strategy": "fsdp2", "train.micro_batch_size": fits},
                    world_size=env.world_size,
                    fits=fits,
                    **values,
                )
            ]
    return [finding("memory_no_fit", **values)]


def max_length_of(cfg: RunConfig) -> int:
    """data.max_length, else model.max_seq_len rounded down to data.pad_to_multiple (at least one multiple)."""
    pad = cfg.data.pad_to_multiple
    return cfg.data.max_length or max(pad, cfg.model.max_seq_len // pad * pad)


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
    micro = _micro_for_estimate(cfg, env)
    memory_then = estimate(apply_changes(cfg, changes), env).memory_gib(micro)
    data_max_length = f", data.max_length={proposed}" if cfg.data.max_length is not None else ""
    return [
        finding(
            "long_texts",
            changes,
            proposed=proposed,
            data_max_length=data_max_length,
            memory_now=est.memory_gib(micro),
            memory_then=memory_then,
            micro=micro,
            **values,
        )
    ]


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
        return [
            finding(
                "disk_no_milestones",
                {"checkpoint.milestone_every": 0, "checkpoint.keep_last": budget},
                severity,
                keep=budget,
                **values,
            )
        ]
    return [finding("disk_too_small", severity=severity, **values)]


def check_batch_divisible(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    if cfg.train.micro_batch_size == "auto":
        return []  # the auto micro-batch is chosen among the divisors of the per-process batch
    micro = _micro_per_process(cfg, env)
    if micro != cfg.train.micro_batch_size:
        return [_micro_batch_shared_out(cfg, env, micro)]
    per_step = micro * env.world_size
    sizes = {"train.global_batch_size": cfg.train.global_batch_size}
    sizes.update({f"train.batch_schedule[{i}]": size for i, (_, size) in enumerate(cfg.train.batch_schedule)})
    bad = {key: size for key, size in sizes.items() if size % per_step}
    if not bad:
        return []
    values = dict(
        sizes=", ".join(f"{key}={size}" for key, size in bad.items()),
        micro=cfg.train.micro_batch_size,
        world_size=env.world_size,
        per_step=per_step,
    )
    # A smaller micro-batch keeps the global batch (the recipe the LR was tuned for); only when none
    # divides it is the global batch rounded up.
    micro = _largest_micro_batch(cfg, env, est, limit=math.inf)
    if micro is not None:
        return [finding("batch_smaller_micro", {"train.micro_batch_size": micro}, micro_fix=micro, **values)]
    changes = {"train.global_batch_size": math.ceil(cfg.train.global_batch_size / per_step) * per_step}
    if cfg.train.batch_schedule:
        changes["train.batch_schedule"] = [
            [step, math.ceil(size / per_step) * per_step] for step, size in cfg.train.batch_schedule
        ]
    rounded = ", ".join(f"{key}={value}" for key, value in changes.items())
    return [finding("batch_round_up", changes, rounded=rounded, **values)]


def _micro_batch_shared_out(cfg: RunConfig, env: Environment, micro: int) -> Finding:
    return finding(
        "batch_micro_per_process",
        configured=cfg.train.micro_batch_size,
        world_size=env.world_size,
        smallest=min(global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)),
        micro=micro,
        accumulation=cfg.train.global_batch_size // (micro * env.world_size),
        global_batch=cfg.train.global_batch_size,
    )


def check_step_in_backward(cfg: RunConfig, env: Environment, est: Estimate) -> list[Finding]:
    if not cfg.optim.step_in_backward:
        return []
    if env.world_size > 1:
        return [finding("step_in_backward_ranks", world_size=env.world_size)]
    micro = cfg.train.micro_batch_size
    sizes = global_batch_sizes(cfg.train.global_batch_size, cfg.train.batch_schedule)
    if micro == "auto" or any(size != micro for size in sizes):  # one process: accumulation
        return [finding("step_in_backward_accumulation", micro=micro, global_batch=cfg.train.global_batch_size)]
    return []


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
        findings.append(
            finding(
                "restart_late", {"schedule.restart_period": period}, period=s.restart_period, after=after, fitted=period
            )
        )
    if s.plateau.enabled and s.plateau.min_lr >= cfg.optim.lr:
        findings.append(
            finding(
                "plateau_floor",
                {"schedule.plateau.min_lr": cfg.optim.lr / 100},
                min_lr=s.plateau.min_lr,
                lr=cfg.optim.lr,
                floor=cfg.optim.lr / 100,
            )
        )
    late = [entry for entry in cfg.train.batch_schedule if entry[0] >= steps]
    if late:
        kept = [entry for entry in cfg.train.batch_schedule if entry[0] < steps]
        findings.append(finding("batch_growth_late", {"train.batch_schedule": kept}, late=late, steps=steps, kept=kept))
    findings += _resume_with_other_length(cfg)
    return findings


def _resume_with_other_length(cfg: RunConfig) -> list[Finding]:
    """A run directory that already holds a checkpoint of a run planned with other train.steps: the
    schedule is a function of train.steps, so resuming with a new length makes the LR jump."""
    run_dir = Path(cfg.train.run_dir)
    pointer = run_dir / "checkpoints" / "latest"
    try:
        before = yaml.safe_load(current_run_config(run_dir).read_text())["train"]["steps"]
        step = int(pointer.read_text().strip().split("-")[1])
    except (OSError, yaml.YAMLError, KeyError, TypeError, IndexError, ValueError):
        return []
    if before == cfg.train.steps or cfg.schedule.kind == "constant" or not isinstance(before, int):
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
    return [
        finding(
            "resume_other_topology",
            **values,
            before=meta["world_size"],
            before_strategy=before_strategy,
            now=env.world_size,
            strategy=strategy,
        )
    ]


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
        "compile_shapes": cfg.perf.compile and cfg.data.pad_to_multiple < 64,
        "packing_bucketed": cfg.data.packing and cfg.data.bucket_batches > 1,
        "async_save_cpu": cfg.checkpoint.async_save and env.device == "cpu",
    }
    values = dict(device=env.device, pad=cfg.data.pad_to_multiple, bucket_batches=cfg.data.bucket_batches)
    return [finding(name, **values) for name, fired in fires.items() if fired]


CHECKS = (
    check_timeout,
    check_nccl_environment,
    check_loader,
    check_busy_cpus,
    check_memory,
    check_unused_parameters,
    check_fused_optimizer,
    check_checkpoint_retention,
    check_batch_divisible,
    check_step_in_backward,
    check_lr_schedule,
    check_resume_topology,
    check_slow_switches,
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
        f"environment: {env.device}, {env.cpus} CPU(s) (load {env.load:.1f}), {env.nproc_per_node} process(es) x "
        f"{env.nnodes} node(s), {env.device_memory_gib:.1f} GiB {where} per process, {disk}\n"
        f"model: {est.num_params / 1e6:.2f}M parameters (vocab {est.vocab_size}); estimated "
        f"{est.memory_gib(_micro_for_estimate(cfg, env)):.2f} GiB per process at micro-batch "
        f"{_micro_for_estimate(cfg, env)} ({est.seq_len:.1f} text positions per sample: {est.seq_len_source}); "
        f"{est.checkpoint_gib:.3f} GiB per checkpoint"
    )


def _micro_for_estimate(cfg: RunConfig, env: Environment) -> int:
    """The micro-batch that runs on each process, or 1 for `auto` (the least the trainer will try)."""
    return 1 if cfg.train.micro_batch_size == "auto" else _micro_per_process(cfg, env)
