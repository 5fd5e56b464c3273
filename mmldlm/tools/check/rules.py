"""What each `mmldlm check` finding says, as data: RULES maps a case to its rule id, severity, message,
why and fix. `message`, `why` and `fix` are str.format templates filled with the values the deciding
function (the `check_*` functions of mmldlm/tools/check/__init__.py) passes, where a noun in place of the
format type counts ("{nproc:process}": "1 process", "2 processes"); `changes` is the fix as
config changes when it does not depend on the values. One rule id (the name printed in brackets) can
have several entries, one per case, each with its own severity and fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmldlm.wording import Wording

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    rule: str
    severity: str  # "error": the run fails or wastes its resources; "warning": slower or riskier; "info": a note
    message: str
    why: str
    fix: str
    changes: dict[str, Any] = field(default_factory=dict)  # config key -> corrected value; empty: not a config fix


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    message: str
    why: str
    fix: str
    changes: dict[str, Any] = field(default_factory=dict)

    def filled(self, changes: dict[str, Any] | None = None, severity: str | None = None, **values) -> Finding:
        """The finding of this rule with `values` in its templates. `changes`: the fix computed from the
        config (else the rule's own); `severity`: for a rule whose severity depends on how far off the
        values are (else the rule's)."""
        words = Wording()
        return Finding(
            self.id,
            severity or self.severity,
            words.format(self.message, **values),
            words.format(self.why, **values),
            words.format(self.fix, **values),
            dict(self.changes if changes is None else changes),
        )


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
    "micro-batch {micro}, activation checkpointing {checkpointing}) > {headroom:.0%} of {device_memory:.1f} GiB "
    "{device}"
)
MEMORY_WHY = "the first steps run out of memory (CUDA OOM, or the kernel's OOM killer on CPU)"
IDLE_HEAD_MESSAGE = "modes {modes}: the {heads} get no gradient on some steps"
IDLE_HEAD_WHY = (
    "plain DDP would need find_unused_parameters=True (a graph walk every step) or fail with "
    "'Expected to have finished reduction'; "
)
DISK_MESSAGE = (
    "checkpoints need up to {need:.1f} GiB ({kept} kept + 1 being written, {each:.2f} GiB each: "
    "checkpoint.keep_last={keep_last}, {milestones:milestone}) with {free:.1f} GiB free at {run_dir}"
)
DISK_WHY = "a checkpoint write that runs out of disk fails the run (and the disk of everything else on it)"
BATCH_MESSAGE = "{sizes} not a multiple of micro-batch x world size = {micro} x {world_size} = {per_step}"
BATCH_WHY = (
    "the global batch is split into micro-batches of train.micro_batch_size on each of {world_size:process}; "
    "the trainer refuses to start otherwise"
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
    "--resume {resume}: checkpoint {path} was written by {before:process} ({before_strategy}), this run "
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
    "heartbeat_moot": Rule(
        "nccl_env",
        "info",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={value} in {source} has no effect: TORCH_NCCL_ENABLE_MONITORING=0 "
        "turns the heartbeat monitor off",
        "the heartbeat timeout is the monitor's own; with the monitor off nothing reads it",
        HEARTBEAT_FIX + " with the monitor on",
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
        "data.num_workers={workers} with {cpus} CPUs for {nproc:process} per node ({per_rank} per process)",
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
        "{threads:torch thread} ({nproc:process} x {per_process})",
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
    "batch_share": Rule(
        "batch_divisible",
        "error",
        "{sizes} not a multiple of the world size {world_size}",
        "with train.micro_batch_size=auto each process takes an equal share of every global batch and the "
        "micro-batch is probed among the share's divisors; the trainer refuses to start otherwise",
        "{rounded}",
    ),
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
        "nothing to fix; resume on {before:process} with {before_strategy} to restore the RNG states too",
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
    "compute_weights_off": Rule(
        "compute_weights",
        "warning",
        "perf.compute_weights=true, but {reason}",
        "the trainer turns the switch off (its log says why), and autocast casts every weight at each use",
        "perf.compute_weights=false",
        {"perf.compute_weights": False},
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
        '(docs/log/benchmarks.md, "torch.compile on a CPU")',
        "data.pad_to_multiple=64",
        {"data.pad_to_multiple": 64},
    ),
    "cuda_graphs_shapes": Rule(
        "cuda_graphs_shapes",
        "warning",
        "perf.cuda_graphs=true with {shapes} text lengths a batch can have (each multiple of "
        "data.pad_to_multiple={pad} up to {max_length}) and no data.length_buckets",
        "every compiled block is compiled and its CUDA graphs recorded for each length, each with memory "
        "of its own; a few fixed lengths bound them (a batch pads to the shortest that holds it)",
        "data.length_buckets={buckets}",
    ),
    "cudnn_attention_shapes": Rule(
        "cudnn_attention_shapes",
        "warning",
        "perf.cudnn_attention=true with {shapes} text lengths a batch can have (each multiple of "
        "data.pad_to_multiple={pad} up to {max_length}) and no data.length_buckets",
        "cuDNN's attention builds an execution plan for a new batch shape; in training on batches of "
        "every length it cost about 2.7 ms of host time a call (base preset, H100), more than its kernel",
        "data.length_buckets={buckets}",
    ),
    "packed_rows_mask": Rule(
        "packed_rows_mask",
        "warning",
        "packed rows {width} wide (data.pack_length) on model.attention={attention}, {times}x the longest text "
        "({max_length})",
        "SDPA attends over packed rows through their block-diagonal mask, and its kernel computes every "
        "pair of a row's positions: {width} x {width} a row and head, where its texts need their own "
        "lengths squared, and the mask itself is that large; the variable-length kernel computes each "
        "text's positions alone",
        "model.attention=varlen",
        {"model.attention": "varlen"},
    ),
    "compile_model_graphs": Rule(
        "compile_model_graphs",
        "info",
        "perf.compile_model=true with static shapes: up to {graphs} graphs of the whole model "
        "({shapes:batch shape} x {per_shape} for the modes {modes}, a text mode at up to {rows} "
        "text-row counts: perf.text_row_buckets)",
        "each compiles when a batch first brings its shape, and the step waits for it: one took 50-64 s "
        "on a 2-core CPU at 4 to 12 blocks (docs/benchmarks.md, \"The blocks' code compiled once in "
        "the whole model's graph\"); the masked positions of a batch usually fall in one or two of the "
        "row counts, so fewer come in practice",
        "fewer shapes (data.length_buckets, a smaller perf.text_row_buckets), or perf.compile_model=false: "
        "each block compiled, a few graphs per shape whatever the modes' row counts",
    ),
    "compile_model_graphs_rows": Rule(
        "compile_model_graphs",
        "warning",
        "perf.compile_model=true with static shapes on packed rows without data.pack_rows",
        "the number of packed rows changes from batch to batch, and each count is a graph of the whole "
        "model, compiled while the step waits, until torch's limit of graphs; past it the model runs eagerly",
        "data.pack_rows=[...] (a few row counts), or perf.compile_dynamic=null",
    ),
    "cudnn_attention_packing": Rule(
        "cudnn_attention_packing",
        "warning",
        "perf.cudnn_attention=true with data.packing=true",
        "the number of packed rows changes from batch to batch, and cuDNN's attention builds an "
        "execution plan for a new batch shape (about 2.7 ms of host time a call in training on "
        "batches of every length, base preset, H100)",
        "data.pack_rows=[...] (a few row counts), or perf.cudnn_attention=false",
        {"perf.cudnn_attention": False},
    ),
}


def finding(name: str, /, changes: dict[str, Any] | None = None, severity: str | None = None, **values) -> Finding:
    """RULES[name] filled with `values` (Rule.filled)."""
    return RULES[name].filled(changes, severity, **values)


# --------------------------------------------------------------------------------------------------
