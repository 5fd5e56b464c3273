"""The audit of the older run, in the shape `mmldlm check` prints (severity, rule, message, why, fix): the
launcher's own bugs as bash ran it (launcher.py), what the older trainer did that its config does not say
(older_trainer.py), its environment reviewed variable by variable against NCCL's documentation, and
`mmldlm check`'s rules on our config holding the older values. Each finding's `changes` are what the
written config does about it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
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
from mmldlm.tools.migrate.shell import Record
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

RULES = {
    "lost_overrides": Rule(
        "launcher_continuation",
        "error",
        "{where}: a comment after a line continuation ends the torchrun call: torchrun gets a lone ' ' argument, "
        "which Hydra refuses, so the older run never started{lost}",
        "`x=1 \\  # note` escapes the space, not the newline: the ' ' is an argument of its own and the comment "
        "ends the command; Hydra's override parser refuses ' ' before the trainer starts",
        "written: what the launcher meant, every override of the call with those of the lines after the comment; "
        "put the comment on a line of its own, or drop it",
    ),
    "hydra_refused": Rule(
        "launcher_override",
        "error",
        "{where}: Hydra refuses the override {override}, so the older run never started: {why}",
        "Hydra composes the trainer's config from its command line and stops at an override it cannot apply",
        "written: the config the launcher meant, without it",
    ),
    "bc_failed": Rule(
        "launcher_bc",
        "error",
        "bc cannot read `{expression}` ({where}: {error}): the trainer is handed {empty} and fails at its first "
        "step, so the older launcher fails on this cluster",
        "bc has no scientific notation (5e-5 is 5, the variable e, then -5: a syntax error); it prints the "
        "error, exits 0 and the launcher's $(... | bc) is empty",
        "written: {meant} (what the launcher meant, computed with 5e-5 read as 0.00005)",
    ),
    "bc_missing": Rule(
        "launcher_bc",
        "error",
        "bc is not installed here: the launcher's {count:bc call} ({where} first) cannot be computed",
        "migrate runs the launcher's bc calls with this machine's bc, a standard package of every distribution",
        "install it (apt-get install bc; dnf install bc) and run migrate again",
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
        "{where}: {command} waits for a person at a terminal: {batch}",
        "migrate never reads your terminal or stdin: it answered as if Enter were pressed",
        "remove the prompt from the launcher (ours asks nothing)",
    ),
    "python_failed": Rule(
        "launcher_python",
        "warning",
        "{where}: a python call failed here: {error}",
        "migrate's stand-in for torch answers the common facts only (versions, device count, names, memory, "
        "capability): this call fails here as on a machine without them; on the cluster it may print or decide more",
        "check that nothing the torchrun call is given depends on that call",
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
    "several_calls": Rule(
        "launcher_calls",
        "warning",
        "the launcher runs {count} different torchrun calls on this cluster ({wheres}): migrated the first",
        "a sweep or a sequence of stages: each call is its own run",
        "give each call a launcher of its own to migrate the others",
    ),
    "stopped": Rule(
        "launcher_stopped",
        "warning",
        "bash was stopped after {why}, with {count:identical torchrun call} recorded",
        "the launcher calls torchrun again after each run (a restart loop), or waits for something that does "
        "not come here",
        "nothing to change if it is a restart loop: our launcher restarts with --resume auto",
    ),
    "mode_name": Rule(
        "launcher_mode",
        "warning",
        "{launcher} is named for {named} but passes loss.loss_type={loss_type}: the older run trained {mode}",
        "the launcher's name is what its users go by: a run they took for {named} trained another direction",
        "written: objective.mode={mode}, what it trained; rename the launcher or mend its override",
    ),
    "shared_run": Rule(
        "launcher_shared",
        "warning",
        "logging.run_name={name} is also the run of {other}: the older runs wrote the same folders{save_dir}",
        "two runs under one name overwrite each other's checkpoints and logs, and resume from each other's",
        "written: train.run_dir=runs/{new} and data.path=data/prepared/{new}",
    ),
    "steps": Rule(
        "older_length",
        "warning",
        "the older trainer trains {epochs:pass} over its data (training.num_epochs): {steps:,} steps of {batch} "
        "samples, while its cosine spans {schedule:,} (training.num_train_steps){end}",
        "its loop ends after the epochs, whatever num_train_steps says: the LR schedule does not end where "
        "the run ends",
        "written: train.steps={steps}, schedule.num_steps={schedule}, the same LR curve; a cosine that ends with "
        "the run is suggested, not written",
    ),
    "no_accumulation": Rule(
        "older_accumulation",
        "warning",
        "training.gradient_accumulation_steps={accumulation} is never applied: the older optimizer steps every "
        "micro-batch, a global batch of {batch} ({micro} x {world} GPUs), not {meant}",
        "no step of the older trainer reads the key; only its launcher does",
        "written: train.global_batch_size={batch}; {meant} would be the batch the launcher's author meant",
    ),
    "betas": Rule(
        "older_betas",
        "warning",
        "optimizer.beta1/beta2 = {beta1}/{beta2} are never read: the older run's Adam betas are "
        "optimizer.betas {betas}",
        "the older optimizer is built from the optimizer group's betas list",
        "written: optim.betas={betas}",
    ),
    "heads": Rule(
        "older_heads",
        "warning",
        "model.n_heads={heads} is never read: the older block runs {older} heads",
        "the older block is built without a head count",
        "written: model.num_heads={written}",
    ),
    "samples": Rule(
        "older_samples",
        "warning",
        "the older loader reads only the first {samples:,} pairs of the token folder, in the folder's own order "
        "({why}), and trains on all of them",
        "it walks the folder with os.scandir and stops at its limit, however many pairs the folder holds; its "
        "validation split overlaps training",
        "written: prepare --legacy-order scan --max-samples {samples} --val-fraction 0: the same pairs on the "
        "filesystem it read (other pairs on a copy elsewhere), none held out; without --max-samples prepare "
        "imports them all, and train.steps would need raising to cover them",
    ),
    "eval_never": Rule(
        "older_eval",
        "warning",
        "logging.eval_freq={every} is longer than the run's {steps:,} steps: the older run never evaluates",
        "the older trainer evaluates every logging.eval_freq steps, and the run ends first",
        "written: eval.every=0 (no validation split is held out); evaluate the finished run with mmldlm eval",
    ),
    "retention": Rule(
        "checkpoint_retention",
        "warning",
        "logging.save_freq={every}: a failure loses up to {every:,} steps{cost}; each save overwrites the older "
        "trainer's one `latest` folder (at most {kept} kept) in place",
        "a crash during that write leaves no complete checkpoint to resume from",
        "written: checkpoint.every={every}, checkpoint.every_minutes={minutes:g} (a failure loses at most about "
        "{minutes:g} minutes), keep_last {kept}; each save is a new folder and `latest` moves only after it "
        "is complete",
    ),
    "retention_none": Rule(
        "checkpoint_retention",
        "warning",
        "logging.save_freq={every} is longer than the run's {steps:,} steps: the older run saves nothing before "
        "its end, and a failure loses the whole run{cost}",
        "its first save comes at step {every}",
        "written: checkpoint.every={every}, checkpoint.every_minutes={minutes:g} (a failure loses at most about "
        "{minutes:g} minutes), keep_last {kept}",
    ),
    "nccl_timeout": Rule(
        "timeout",
        "warning",
        "NCCL_TIMEOUT={value} in {source} is read by neither torch nor NCCL: the older trainer's collective "
        "timeout is its hard-coded {minutes} minutes",
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
# Words of a launcher's name that say which direction it trains, as our objective.mode.
NAMED_MODES = {"l2t": "l2t", "t2l": "t2l", "joint": "joint", "unconditional": "joint", "uncond": "joint"}


def older_finding(rule_name: str, /, changes: dict[str, Any] | None = None, **values) -> Finding:
    return RULES[rule_name].filled(changes, **values)


# --------------------------------------------------------------------------------------------------
# The launcher.


def launcher_findings(reading: LauncherReading, cluster: Cluster, refused: list[tuple[str, str]]) -> list[Finding]:
    run, call, found = reading.run, reading.call, []
    if reading.stray or reading.lost:
        lost = reading.lost_overrides
        after = f"; the lines after it ran as commands, not found: {', '.join(lost)}" if lost else ""
        found.append(older_finding("lost_overrides", where=reading.comment_line, lost=after))
    found += _bc_findings(reading)
    if reading.memory_branch:
        found.append(_memory_finding(reading, cluster))
    found += [_prompt_finding(record) for record in run.of("read-prompt")]
    for record in run.of("python-failed"):
        found.append(older_finding("python_failed", where=record.where, error=record.words[1]))
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
        if override.strip():  # the lone " " is the continuation finding's
            found.append(older_finding("hydra_refused", where=call.where, override=override, why=why))
    distinct = {tuple(c.record.words) for c in reading.calls}
    if len(distinct) > 1:
        wheres = ", ".join(dict.fromkeys(c.where.rsplit("/", 1)[-1] for c in reading.calls))
        found.append(older_finding("several_calls", count=len(distinct), wheres=wheres))
    if run.stopped:
        found.append(older_finding("stopped", why=run.stopped, count=len(reading.calls)))
    return found


def _bc_findings(reading: LauncherReading) -> list[Finding]:
    found = []
    empty = [w.split("=", 1)[0] for w in reading.call.overrides if w.endswith("=")]
    for record in reading.bc_failures[:1]:
        meant = ", ".join(f"{k}={reading.meant[k]}" for k in empty if k in reading.meant) or "nothing (not computed)"
        values = dict(where=record.where, expression=record.words[0].strip(), meant=meant)
        values.update(error=record.words[2].strip().splitlines()[0], empty=" ".join(f"{k}=" for k in empty))
        found.append(older_finding("bc_failed", **values))
    missing = [r for r in reading.run.of("bc") if r.words[3] == "missing"]
    if missing:
        found.append(older_finding("bc_missing", count=len(missing), where=missing[0].where))
    return found


def _prompt_finding(record: Record) -> Finding:
    prompt, tty = record.words[0], record.words[1:2] == ["1"]
    command = (f'read -p "{prompt}"' if prompt else "read") + (" < /dev/tty" if tty else "")
    if tty:
        batch = "under a batch scheduler there is none, the redirect fails and the launcher stops here, before torchrun"
    else:
        batch = "under a batch scheduler read gets end of file and fails (with set -e the launcher stops there)"
    return older_finding("read_prompt", where=record.where, command=command, batch=batch)


def name_findings(launcher: Path, values: dict[str, Any], mode: str | None) -> list[Finding]:
    """A launcher named for one direction (train_t2l.sh) whose run trains another."""
    named = {NAMED_MODES[w] for w in re.split(r"[^a-z0-9]+", launcher.stem.lower()) if w in NAMED_MODES}
    if len(named) != 1 or mode is None or mode in named:
        return []
    word = next(w for w in re.split(r"[^a-z0-9]+", launcher.stem.lower()) if w in NAMED_MODES)
    return [
        older_finding("mode_name", launcher=launcher, named=word, loss_type=values.get("loss.loss_type"), mode=mode)
    ]


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
    if name == "NCCL_DEBUG_FILE" and not ("%h" in value and "%p" in value):
        path = Path(value)
        return out(
            "changed",
            "one file for every process of every node: they write over each other (on a shared folder, across "
            "nodes too); NCCL expands %h to the host name and %p to the process id",
            str(path.with_name(f"{path.stem}.%h.%p{path.suffix}")),
        )
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
    cosine = old.get("training.lr_schedule", "cosine") == "cosine"
    if cosine and run.steps is not None and run.schedule_steps is not None and run.steps != run.schedule_steps:
        factor = run.lr_at_end
        end = f": its LR is at {factor:.2f}x its peak when the run ends" if factor is not None else ""
        values = dict(epochs=run.epochs, steps=run.steps, batch=run.global_batch, schedule=run.schedule_steps)
        found.append(older_finding("steps", end=end, **values))
    accumulation = old.get("training.gradient_accumulation_steps")
    if isinstance(accumulation, int) and accumulation > 1 and run.micro_batch:
        values = dict(batch=run.global_batch, micro=run.micro_batch, world=run.world_size)
        found.append(
            older_finding("no_accumulation", accumulation=accumulation, meant=run.global_batch * accumulation, **values)
        )
    beta1, beta2 = old.get("optimizer.beta1"), old.get("optimizer.beta2")
    if (beta1 is not None or beta2 is not None) and [beta1, beta2] != run.betas:
        found.append(older_finding("betas", beta1=beta1, beta2=beta2, betas=run.betas))
    if old.get("model.n_heads") not in (None, HEADS):
        found.append(older_finding("heads", heads=old["model.n_heads"], older=HEADS, written=cfg.model.num_heads))
    if old.get("data.max_samples") is None and run.samples_read is not None:
        found.append(older_finding("samples", samples=run.samples_read, why=run.samples_why))
    if not run.evaluates:
        found.append(older_finding("eval_never", every=old["logging.eval_freq"], steps=run.steps))
    if "logging.save_freq" in old:
        found.append(_retention_finding(run, cfg, cluster))
    if old.get("optimizer.use_fused") is True:
        found.append(older_finding("fused", value="true"))
    return found


def _retention_finding(run: OlderRun, cfg: RunConfig, cluster: Cluster) -> Finding:
    """What a failure costs the older run: a save interval, or the whole run where it saves nothing before
    its end; bounded by the run's length."""
    every = run.values["logging.save_freq"]
    whole = isinstance(every, int) and run.steps is not None and every >= run.steps
    lost = run.steps if whole else every
    hours = _interval_hours(cfg, run, cluster, lost)
    values = dict(every=every, cost=_interval_cost(cfg, hours, run.world_size), kept=CHECKPOINTS_KEPT)
    f = older_finding("retention_none" if whole else "retention", minutes=EVERY_MINUTES, steps=run.steps, **values)
    if hours is not None and hours[0] * 60 <= EVERY_MINUTES:
        f.severity = "info"  # a failure loses less than the written every_minutes bounds: nothing to ask
    return f


def _interval_hours(cfg: RunConfig, run: OlderRun, cluster: Cluster, steps: Any) -> tuple[float, float] | None:
    """Hours of `steps` older steps on the cluster: their FLOPs at model.max_seq_len positions per sample, at
    the baseline recipe's measured MFU and at the best any dense step reaches; None where the GPU's peak
    is not known."""
    peak = next((p for key, p in PEAK_FLOPS_BF16.items() if key in cluster.gpu_name), None)
    if peak is None or not isinstance(steps, int) or run.global_batch is None:
        return None
    with torch.device("meta"):
        model = MultimodalMMDiT(model_of(cfg), vocab_size=vocab_size_of(cfg))
    flops = training_flops_per_sample(model, cfg.model.max_seq_len) * run.global_batch * steps
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


def config_findings(cfg: RunConfig, old: dict, env: Environment, written: list[Finding]) -> list[Finding]:
    """`mmldlm check`'s findings on our config holding the older run's loader workers, in the older
    launcher's environment, that `written` (check's on the written config for the cluster) does not
    hold. Memory is judged on the written config alone: our estimate of our model is no measure of the
    older code's memory."""
    if "data.num_workers" in old:
        cfg = apply_changes(cfg, {"data.num_workers": old["data.num_workers"]})
    ours = {(f.rule, f.message) for f in written}
    return [f for f in audit(cfg, env)[0] if f.rule != "fused_optimizer" and (f.rule, f.message) not in ours]
