"""The audit of the older run, in the shape `mmldlm check` prints (severity, rule, message, why, fix): the
launcher's own bugs as bash ran it (launcher.py), what the older trainer did that its config does not say
(older_trainer.py), its environment reviewed variable by variable against NCCL's documentation, and
`mmldlm check`'s rules on our config holding the older values. Each finding's `changes` are what the
written config does about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmldlm.config import RunConfig
from mmldlm.model.info import training_flops_per_sample
from mmldlm.model.mmdit import MultimodalMMDiT
from mmldlm.tools.check import Environment, Finding, apply_changes, audit
from mmldlm.tools.check.estimates import model_of, vocab_size_of
from mmldlm.tools.check.rules import TIMEOUT_WHY, Rule
from mmldlm.tools.migrate.cluster import Cluster
from mmldlm.tools.migrate.launcher import SCHEDULER_CONVENTIONS, LauncherReading
from mmldlm.tools.migrate.mapping import EVERY_MINUTES
from mmldlm.tools.migrate.older_trainer import CHECKPOINTS_KEPT, COLLECTIVE_TIMEOUT_MINUTES, HEADS, OlderRun
from mmldlm.training.metrics import PEAK_FLOPS_BF16

NCCL_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
# The older save interval in hours is given between two MFUs: the baseline recipe's (the older code's
# choices) measured on an H100 (docs/benchmarks-gpu.md, base preset), and a bound no dense step beats.
BASELINE_MFU, BEST_MFU = 0.037, 0.5
# Variables of the launcher's environment that the training processes read: reviewed and, where kept,
# put in front of our launch line.
TRAINER_PREFIXES = (
    "NCCL_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "HF_",
    "TRANSFORMERS_",
    "WANDB_",
    "TOKENIZERS_",
    "UCX_",
    "FI_",
    "GLOO_",
    "NVIDIA_",
)

AUTO_CHECKPOINTING = (
    "written: perf.activation_checkpointing=auto (the least of none, selective, full under which the micro-batch "
    "fits, probed at start-up)"
)

RULES = {
    "lost_overrides": Rule(
        "launcher_continuation",
        "error",
        "{where}: a comment after a line continuation ends the torchrun call there; bash runs the next "
        "line(s) as commands of their own, not found, so {count} override(s) never reach the trainer: {lost}",
        "`x=1 \\  # note` escapes the space, not the newline: torchrun gets a stray ' ' argument{stray} and the "
        "call ends; the older run trained with the config's values for these keys",
        "written: the older run's values (the config's), each with the launcher's meant value in its comment; "
        "put the comment on a line of its own, or drop it",
    ),
    "bc_failed": Rule(
        "launcher_bc",
        "error",
        "the older launcher fails on this cluster: bc cannot read `{expression}` ({where}: {error}), so the "
        "trainer is handed {empty}: it fails at its first step",
        "bc has no scientific notation (5e-5 is 5, the variable e, then -5: a syntax error); it prints the "
        "error, exits 0 and the launcher's $(... | bc) is empty",
        "written: {meant} (what the launcher meant, computed with 5e-5 read as 0.00005)",
    ),
    "memory_branch": Rule(
        "launcher_gpu_memory",
        "warning",
        "the launcher's branch depends on the GPU memory nvidia-smi reports: at {mib} MiB (this {gpu}) it passes "
        "{ours}; at the card's nominal {nominal} MiB ({gib} GiB) it would pass {theirs}",
        "nvidia-smi reports less than the card's nominal size ({mib} MiB, not {nominal}): a threshold at the "
        "nominal {gib} GB, compared after bash's integer division by 1024 ({floor}), sends the card down a smaller "
        "card's branch",
        "written: the values of the branch taken ({ours}); compare against what the launcher's author meant",
    ),
    "read_prompt": Rule(
        "launcher_prompt",
        "warning",
        "{where}: read -p {prompt!r} waits for a person at a terminal",
        "under a scheduler there is no terminal: read gets end-of-file and fails (with set -e the launcher "
        "ends there, before torchrun); migrate answered it with Enter",
        "remove the prompt from the launcher",
    ),
    "cluster_test": Rule(
        "launcher_file_test",
        "warning",
        "{where}: {test} is answered by this machine, where {path} is missing",
        "bash's [[ ]] cannot be shadowed, so the branch taken here is the one for a missing path; on the "
        "cluster, where the path exists, the launcher may take the other",
        "run migrate where {path} exists, or check that branch of the launcher by hand",
    ),
    "call_mismatch": Rule(
        "launcher_cluster",
        "error",
        "{where}: the torchrun call runs --nnodes {nnodes} --nproc_per_node {nproc}, not this cluster's {want}",
        "bash took the launcher's branch for this cluster (scheduler variables tried: {conventions}); the call "
        "it reaches does not ask for the cluster's nodes and GPUs",
        "give the scheduler's variables with --env NAME=VALUE (WORLD_SIZE, SLURM_NNODES, ...), or fix the "
        "launcher's branch",
    ),
    "hydra_refused": Rule(
        "launcher_override",
        "error",
        "{where}: the older trainer refuses the override {override!r}: {why}",
        "Hydra composes the trainer's config from its command line and stops at an override it cannot apply: "
        "the older run did not start",
        "written: the config without it",
    ),
    "several_calls": Rule(
        "launcher_calls",
        "warning",
        "the launcher runs {count} different torchrun calls on this cluster ({wheres}): migrated the first",
        "a sweep or a sequence of stages: each call is its own run",
        "--call N migrates the N-th",
    ),
    "stopped": Rule(
        "launcher_stopped",
        "warning",
        "bash was stopped after {why}, with {count:identical torchrun call} recorded",
        "the launcher calls torchrun again after each run (a restart loop), or waits for something that does "
        "not come here",
        "nothing to change if it is a restart loop: our launcher restarts with --resume auto",
    ),
    "bc_model": Rule(
        "launcher_bc",
        "warning",
        "bc is not installed here: the launcher's {count:bc call} ran on migrate's model of GNU bc",
        "the model (mmldlm/tools/migrate/bc.py) reads what launchers pipe into bc as GNU bc 1.07 does, "
        "its syntax errors included; bc itself is the reference",
        "install bc (apt-get install bc) and run migrate again",
    ),
    "steps": Rule(
        "older_length",
        "warning",
        "the older trainer ran {epochs:pass} over its data (training.num_epochs): {steps} steps of {batch} samples; "
        "training.num_train_steps={schedule} set only its cosine's length{end}",
        "its loop ends after the epochs, whatever num_train_steps says: the LR schedule did not end where "
        "the run ended",
        "written: train.steps={steps} (our warmup_cosine ends with the run); train.steps={schedule} would "
        "train as long as the schedule",
    ),
    "no_accumulation": Rule(
        "older_accumulation",
        "warning",
        "training.gradient_accumulation_steps={accumulation} was never applied: the older optimizer stepped "
        "every micro-batch, a global batch of {batch} ({micro} x {world} GPUs), not {meant}",
        "no step of the older trainer reads the key; only its launcher does",
        "written: train.global_batch_size={batch}; {meant} would be the batch the launcher's author meant",
    ),
    "betas": Rule(
        "older_betas",
        "warning",
        "optimizer.beta1/beta2 = {beta1}/{beta2} were never read: the older run's Adam betas were "
        "optimizer.betas {betas}",
        "the older optimizer is built from the optimizer group's betas list",
        "written: optim.betas={betas}",
    ),
    "heads": Rule(
        "older_heads",
        "warning",
        "model.n_heads={heads} was never read: the older block ran {older} heads",
        "the older block is built without a head count",
        "written: model.num_heads={written}",
    ),
    "samples": Rule(
        "older_samples",
        "warning",
        "the older loader read only {samples} files ({why})",
        "with data.max_samples null it stops at its scan limit, however many samples the data holds",
        "written: prepare --max-samples {samples} (the same samples); without it prepare imports them all, "
        "and train.steps would need raising to cover them",
    ),
    "retention": Rule(
        "checkpoint_retention",
        "warning",
        "logging.save_freq={every}: a failure lost up to {every} steps{cost}; each save overwrote the older "
        "trainer's one `latest` folder (at most {kept} kept) in place",
        "a crash during that write leaves no complete checkpoint to resume from",
        "written: checkpoint.every={every}, checkpoint.every_minutes={minutes:g} (a failure loses at most about "
        "{minutes:g} minutes), keep_last {kept}; each save is a new folder and `latest` moves only after it "
        "is complete",
    ),
    "nccl_timeout": Rule(
        "timeout",
        "warning",
        "NCCL_TIMEOUT={value} in {source} is read by neither torch nor NCCL: the older trainer's collective "
        "timeout was its hard-coded {minutes} minutes",
        TIMEOUT_WHY,
        "written: distributed.timeout_minutes={minutes}; NCCL_TIMEOUT left out of the launch line",
    ),
    "env_reviewed": Rule("nccl_env", "warning", "{name}={value} in {source}: {what}", "{why}", "written: {what}"),
    "fused": Rule(
        "fused_optimizer",
        "info",
        "optimizer.use_fused={value}",
        "the older trainer stepped AdamW one parameter at a time; optim.fused=true fails on a device without "
        "the fused kernel",
        "written: optim.fused=auto (the fused kernel where the device has it, else foreach)",
    ),
}


def older_finding(rule_name: str, /, changes: dict[str, Any] | None = None, **values) -> Finding:
    return RULES[rule_name].filled(changes, **values)


# --------------------------------------------------------------------------------------------------
# The launcher.


def launcher_findings(reading: LauncherReading, cluster: Cluster, refused: list[tuple[str, str]]) -> list[Finding]:
    run, call, found = reading.run, reading.call, []
    if reading.lost:
        stray = " (which Hydra refuses too)" if reading.stray else ""
        lost = ", ".join(reading.lost_overrides)
        found.append(
            older_finding("lost_overrides", where=call.where, count=len(reading.lost_overrides), lost=lost, stray=stray)
        )
    empty = [w.split("=", 1)[0] for w in call.overrides if w.endswith("=")]
    for record in reading.bc_failures[:1]:
        meant = ", ".join(f"{k}={reading.meant[k]}" for k in empty if k in reading.meant) or "nothing (not computed)"
        error = record.words[2].strip().splitlines()[0]
        expression = record.words[0].strip()
        found.append(
            older_finding(
                "bc_failed",
                where=record.where,
                expression=expression,
                error=error,
                empty=", ".join(f"{k}=" for k in empty) or "an empty value",
                meant=meant,
            )
        )
    if reading.memory_branch:
        found.append(_memory_finding(reading, cluster))
    for record in run.of("read-prompt"):
        found.append(older_finding("read_prompt", where=record.where, prompt=record.words[0]))
    for record in run.of("missing-test"):
        found.append(older_finding("cluster_test", where=record.where, test=record.words[2], path=record.words[1]))
    if not call.asks_for(cluster):
        want = f"--nnodes {cluster.nnodes} --nproc_per_node {cluster.gpus_per_node}"
        found.append(
            older_finding(
                "call_mismatch",
                where=call.where,
                nnodes=call.nnodes,
                nproc=call.nproc_per_node,
                want=want,
                conventions=", ".join(SCHEDULER_CONVENTIONS),
            )
        )
    for override, why in refused:
        if override.strip():  # the stray " " is the continuation finding's
            found.append(older_finding("hydra_refused", where=call.where, override=override, why=why))
    distinct = {tuple(c.record.words) for c in reading.calls}
    if len(distinct) > 1:
        wheres = ", ".join(dict.fromkeys(c.where.rsplit("/", 1)[-1] for c in reading.calls))
        found.append(older_finding("several_calls", count=len(distinct), wheres=wheres))
    if run.stopped:
        found.append(older_finding("stopped", why=run.stopped, count=len(reading.calls)))
    models = [r for r in run.of("bc") if r.words[3] == "model"]
    if models:
        found.append(older_finding("bc_model", count=len(models)))
    return found


def _memory_finding(reading: LauncherReading, cluster: Cluster) -> Finding:
    ours = ", ".join(f"{k}={a}" for k, (a, b) in sorted(reading.memory_branch.items()))
    theirs = ", ".join(f"{k}={b}" for k, (a, b) in sorted(reading.memory_branch.items()))
    gib = reading.nominal_mib // 1024
    return older_finding(
        "memory_branch",
        mib=cluster.gpu_memory_mib,
        gpu=cluster.gpu_name,
        ours=ours,
        nominal=reading.nominal_mib,
        gib=gib,
        theirs=theirs,
        floor=cluster.gpu_memory_mib // 1024,
    )


# --------------------------------------------------------------------------------------------------
# The environment the launcher gives the trainer, reviewed against NCCL's documentation.


@dataclass
class EnvReview:
    name: str
    value: str
    action: str  # kept, dropped, changed
    new: str | None
    why: str


HANDLED_BY_US = {
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "the trainer sets it to the collective timeout + 60 s",
    "TORCH_NCCL_ENABLE_MONITORING": "the heartbeat monitor stays on (torch's default)",
    "TORCH_NCCL_BLOCKING_WAIT": "asynchronous error handling tears a hung collective down without it",
    "NCCL_BLOCKING_WAIT": "asynchronous error handling tears a hung collective down without it",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "scripts/launch.sh sets it to 1",
    "NCCL_ASYNC_ERROR_HANDLING": "scripts/launch.sh sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1, its current name",
    "OMP_NUM_THREADS": "scripts/launch.sh sets it to the node's cores / processes",
    "NCCL_TIMEOUT": "read by neither torch nor NCCL: distributed.timeout_minutes sets the collective timeout",
}
NETWORK = {
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_SL",
    "NCCL_IB_TC",
    "NCCL_TOPO_FILE",
    "NCCL_CROSS_NIC",
    "NCCL_SOCKET_FAMILY",
    "NCCL_NET",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_NET_PLUGIN",
}
TRANSPORT_OFF = {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET_GDR_DISABLE"}


def review(name: str, value: str) -> EnvReview:
    """What goes into our launch line for one variable of the older launcher's environment, and why."""

    def out(action, why, new=None):
        return EnvReview(name, value, action, new, why)

    if name in HANDLED_BY_US:
        return out("dropped", HANDLED_BY_US[name])
    if name == "NCCL_IB_TIMEOUT":
        if value.isdigit() and 1 <= int(value) <= 31:
            return out("kept", f"in NCCL's range 1-31: an InfiniBand ACK timeout of 4.096 us x 2^{value}")
        return out(
            "dropped",
            "outside NCCL's range 1-31 (the InfiniBand ACK timeout is 4.096 us x 2^value, a 5-bit "
            "field); NCCL's default applies (20 in current releases: about 4.3 s)",
        )
    if name == "NCCL_IB_RETRY_CNT":
        if value.isdigit() and int(value) <= 7:
            return out("kept", "in NCCL's range 0-7 (a 3-bit InfiniBand field)")
        return out("dropped", "outside NCCL's range 0-7 (a 3-bit InfiniBand field); NCCL's default 7 applies")
    if name == "NCCL_DEBUG":
        if value.upper() in ("INFO", "TRACE"):
            return out(
                "changed",
                f"{value} logs every rank's set-up and topology (TRACE: every call) on every run; "
                "WARN prints what fails; set INFO again to debug a hang",
                "WARN",
            )
        if value.upper() in ("VERSION", "WARN"):
            return out("kept", "one of NCCL's levels (VERSION, WARN, INFO, TRACE)")
        return out("dropped", "not one of NCCL's levels (VERSION, WARN, INFO, TRACE)")
    if name in ("NCCL_ALGO", "NCCL_PROTO"):
        return out(
            "dropped",
            "listed under Debugging in NCCL's documentation, not for production: NCCL picks the "
            "algorithm and protocol for each size itself",
        )
    if name in ("CUDA_LAUNCH_BLOCKING", "TORCH_DISTRIBUTED_DEBUG", "TORCH_SHOW_CPP_STACKTRACES") and value not in (
        "0",
        "OFF",
    ):
        return out("dropped", "a debugging switch: every kernel launch or collective is checked or serialised")
    if name in TRANSPORT_OFF and value == "1":
        return out(
            "kept",
            "turns a transport off: a workaround for a broken link, with slower collectives "
            "(NCCL_IB_DISABLE: IP sockets between nodes); remove it once the link works",
        )
    if name in NETWORK:
        return out("kept", "the cluster's network configuration (NCCL's System configuration variables)")
    if name.startswith("NCCL_"):
        return out("kept", f"not among the variables migrate reviews: look it up in {NCCL_DOCS}")
    return out("kept", "not an NCCL variable; passed on as the launcher set it")


def environment_findings(environ: dict[str, str], source: str) -> tuple[list[Finding], list[EnvReview]]:
    """One finding per variable dropped or changed beyond what `mmldlm check`'s rules already say (those
    handled by the trainer are its [nccl_env] findings; NCCL_TIMEOUT its own); every review."""
    reviews = [review(name, value) for name, value in sorted(environ.items())]
    found = []
    for r in reviews:
        if r.name == "NCCL_TIMEOUT":
            found.append(
                older_finding("nccl_timeout", value=r.value, source=source, minutes=COLLECTIVE_TIMEOUT_MINUTES)
            )
        elif r.name in HANDLED_BY_US:
            continue
        elif r.action in ("dropped", "changed"):
            what = "dropped from the launch line" if r.action == "dropped" else f"{r.name}={r.new} in the launch line"
            why = f"{r.why} ({NCCL_DOCS})" if r.name.startswith("NCCL_") else r.why
            found.append(older_finding("env_reviewed", name=r.name, value=r.value, source=source, what=what, why=why))
    return found, reviews


def trainer_environment(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(TRAINER_PREFIXES)}


# --------------------------------------------------------------------------------------------------
# The older trainer's behaviour and our config holding the older values.


def trainer_findings(run: OlderRun, cfg: RunConfig, cluster: Cluster) -> list[Finding]:
    old, found = run.values, []
    if run.steps is not None and run.schedule_steps is not None and run.steps != run.schedule_steps:
        factor = run.lr_at_end
        end = f": the LR was at {factor:.2f}x its peak when the run ended" if factor is not None else ""
        found.append(
            older_finding(
                "steps",
                epochs=run.epochs,
                steps=run.steps,
                batch=run.global_batch,
                schedule=run.schedule_steps,
                end=end,
            )
        )
    accumulation = old.get("training.gradient_accumulation_steps")
    if isinstance(accumulation, int) and accumulation > 1 and run.micro_batch:
        found.append(
            older_finding(
                "no_accumulation",
                accumulation=accumulation,
                batch=run.global_batch,
                micro=run.micro_batch,
                world=run.world_size,
                meant=run.global_batch * accumulation,
            )
        )
    beta1, beta2 = old.get("optimizer.beta1"), old.get("optimizer.beta2")
    if (beta1 is not None or beta2 is not None) and [beta1, beta2] != run.betas:
        found.append(older_finding("betas", beta1=beta1, beta2=beta2, betas=run.betas))
    if old.get("model.n_heads") not in (None, HEADS):
        found.append(older_finding("heads", heads=old["model.n_heads"], older=HEADS, written=cfg.model.num_heads))
    if old.get("data.max_samples") is None and run.samples_read is not None:
        found.append(older_finding("samples", samples=run.samples_read, why=run.samples_why))
    if "logging.save_freq" in old:
        hours = _interval_hours(cfg, run, cluster)
        f = older_finding(
            "retention",
            every=old["logging.save_freq"],
            cost=_interval_cost(cfg, hours, run.world_size),
            kept=CHECKPOINTS_KEPT,
            minutes=EVERY_MINUTES,
        )
        if hours is not None and hours[0] * 60 <= EVERY_MINUTES:
            f.severity = "info"  # a failure lost less than the written every_minutes bounds: nothing to ask
        found.append(f)
    if old.get("optimizer.use_fused") is True:
        found.append(older_finding("fused", value="true"))
    return found


def _interval_hours(cfg: RunConfig, run: OlderRun, cluster: Cluster) -> tuple[float, float] | None:
    """Hours of one older save interval on the cluster: its FLOPs at model.max_seq_len positions per
    sample, at the baseline recipe's measured MFU and at the best any dense step reaches; None where the
    GPU's peak is not known."""
    peak = next((p for key, p in PEAK_FLOPS_BF16.items() if key in cluster.gpu_name), None)
    every = run.values.get("logging.save_freq")
    if peak is None or not isinstance(every, int) or run.global_batch is None:
        return None
    with torch.device("meta"):
        model = MultimodalMMDiT(model_of(cfg), vocab_size=vocab_size_of(cfg))
    flops = training_flops_per_sample(model, cfg.model.max_seq_len) * run.global_batch * every
    low, high = (flops / (run.world_size * peak * mfu) / 3600 for mfu in (BASELINE_MFU, BEST_MFU))
    return low, high


def _interval_cost(cfg: RunConfig, hours: tuple[float, float] | None, world_size: int) -> str:
    if hours is None:
        return ""
    return (
        f": {_duration(hours[0])} of {world_size} GPUs at the {BASELINE_MFU:.1%} MFU the baseline recipe measured "
        f"on an H100 (docs/benchmarks-gpu.md), {_duration(hours[1])} even at {BEST_MFU:.0%}, at "
        f"{cfg.model.max_seq_len} tokens per sample"
    )


def _duration(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"


def config_findings(cfg: RunConfig, old: dict, env: Environment) -> list[Finding]:
    """`mmldlm check`'s rules on our config holding the older run's choices (its loader workers, no
    activation checkpointing, its fused flag), with what the written config does instead."""
    changes: dict[str, Any] = {"perf.activation_checkpointing": "none"}
    if "data.num_workers" in old:
        changes["data.num_workers"] = old["data.num_workers"]
    older = apply_changes(cfg, changes)
    found = [f for f in audit(older, env)[0] if f.severity != "info" and f.rule != "fused_optimizer"]
    for f in found:
        if f.rule == "activation_checkpointing":
            f.fix = AUTO_CHECKPOINTING
    return found


FIXED_BY_CONSTRUCTION = (
    "t2l trained only at t = 1 and l2t only on fully masked text: both train at t ~ U(0, 1), as the samplers query",
    "the conditioning modality's input encoder was frozen with the idle output head: only the idle head rests",
    "padding counted in loss and accuracy, no ELBO weight: the loss is over masked non-pad tokens, ELBO-weighted "
    "unless text_diffusion.loss=masked_ce",
    "normalized-MSE latent loss (~1/D in scale): latent_diffusion.loss=mse",
    "weights cast to bf16 with no fp32 master copy: bf16 autocast over fp32 weights and optimizer state",
    "gradient accumulation configured but never applied: train.global_batch_size / (micro-batch x GPUs) "
    "micro-steps, no_sync on all but the last",
    "qk_rmsnorm, the head count and flash attention ignored, no final text norm: all honoured, SDPA attention",
    "DDP with find_unused_parameters=True (a walk of the graph every step): false, the idle head anchored "
    "into the loss instead",
    "NaN guards replaced the loss by a constant with no gradient: a non-finite step is skipped and counted "
    "(train.max_consecutive_skips)",
    "only the first files read, train and validation overlapping: prepare imports what you ask, the splits "
    "are disjoint",
    "checkpoints without config, broken resume, log truncated at start, no grad norm logged: each run dir holds "
    "its config, --resume auto restores everything, metrics.jsonl is appended, grad norm is logged",
    "the t2l sampler gave NaN at t = 1 and mixed up eps and x0: alpha(1) is floored (latent_diffusion.min_alpha)",
    "the monitor parsed lines the trainer never printed: `mmldlm monitor` reads metrics.jsonl",
)
