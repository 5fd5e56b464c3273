"""`mmldlm migrate`: take a run of the older research codebase over. It reads the run's Hydra-composed
run config (its `defaults:` list composed from the group files beside it, `${a.b}` interpolations
resolved, both by hydra-core and OmegaConf) and, optionally, the bash launcher that started it, and:

1. writes our run config: every older setting with a counterpart (OLDER_KEYS says where each goes), with
   batch, learning rate, warmup, steps and frequencies as the older launcher computes them for the
   cluster given (`launcher_values`); one line for each setting not carried over and why;
2. audits the older files for the critical issues (timeouts, NCCL variables, loader, memory, retention),
   each as a `mmldlm check` finding (the rules are in mmldlm/tools/check/rules.py; the older run is audited as
   our config with the older values, plus the rules only an older file can break), and says what the
   written config does;
3. prints the `mmldlm prepare --legacy-*` and `mmldlm train` / `scripts/launch.sh` lines to run next.

Nothing is dropped silently: an older key without an entry in OLDER_KEYS, a value without a counterpart
and a launcher line that is not evaluated are named. The launcher is read, never run: assignments,
exports and the torchrun line are evaluated (`${VAR:-default}`, `$VAR`); control flow, command
substitution and arithmetic are not, and are named with their line numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmldlm.config import ConfigError, RunConfig, flat_keys, from_dict, load_config, to_dict
from mmldlm.data.tokenizer import load_tokenizer, vocab_size
from mmldlm.errors import UserError
from mmldlm.tools.check import (
    SEVERITY_ORDER,
    Environment,
    Estimate,
    Finding,
    apply_changes,
    audit,
    describe,
    estimate,
    finding,
    format_finding,
)

# --------------------------------------------------------------------------------------------------
# Every older key and where it goes: our config key, a `prepare` option, or "not carried over: why".
# One home for the mapping: the translation below reads it, docs/migrating.md's table is checked
# against it (tests/test_migrate.py).

NOT_CARRIED = "not carried over: "
OLDER_KEYS = {
    "data.token_dir": "prepare --legacy-tokens",
    "data.latent_dir": "prepare --legacy-latents",
    "data.tokenizer_path": "prepare --tokenizer",
    "data.tokenizer_name": "prepare --tokenizer (a local tokenizer folder or tokenizer.json: prepare runs offline)",
    "data.max_samples": "prepare --max-samples",
    "data.val_ratio": "prepare --val-fraction",
    "data.max_val_samples": NOT_CARRIED + "the validation split is the whole disjoint val split prepare writes "
    "(--val-fraction); evaluation reads eval.num_elbo_batches x eval.batch_size of it",
    "data.num_workers": "data.num_workers, written null (min(8, CPUs // GPUs per node); see the audit)",
    "data.max_length": "data.max_length",
    "model.hidden_size": "model.hidden_size",
    "model.n_blocks": "model.num_blocks",
    "model.n_heads": "model.num_heads, rounded to a divisor of the width (see the audit)",
    "model.cond_dim": "model.hidden_size (the conditioning vector is as wide as the blocks)",
    "model.max_seq_len": "model.max_seq_len",
    "model.dropout": "model.dropout",
    "model.num_residual_streams": NOT_CARRIED + "hyper-connections (several residual streams per block); our "
    "blocks have one residual stream",
    "model.qk_rmsnorm": "model.qk_norm",
    "model.latent_dim": "model.latent_dim",
    "model.latent_timesteps": NOT_CARRIED + "a discrete chain of latent timesteps; our latent diffusion is "
    "continuous-time (t ~ U(0, 1)) and samples with latent_diffusion.num_sampling_steps steps",
    "model.latent_beta_schedule": "latent_diffusion.schedule",
    "model.latent_parameterization": "latent_diffusion.prediction",
    "model.p_uniform": NOT_CARRIED + "uniform-token noise mixed into the masking; our text diffusion is "
    "absorbing-state (masking) only",
    "model.t_eps": NOT_CARRIED + "the older lower bound of the sampled t; ours samples t over [0, 1] and "
    "keeps the ELBO weight finite with text_diffusion.eps",
    "model.cluster_size": NOT_CARRIED + "latent clustering of the older code (0: off); none here",
    "training.seed": "train.seed",
    "training.train_batch_size": "train.micro_batch_size",
    "training.eval_batch_size": "eval.batch_size",
    "training.num_train_steps": "train.steps",
    "training.dtype": "train.precision",
    "training.compile_model": "perf.compile",
    "training.lr_schedule": "schedule.kind",
    "training.warmup_steps": "schedule.warmup_steps",
    "training.gradient_accumulation_steps": "train.global_batch_size (micro-batch x accumulation x GPUs)",
    "loss.loss_type": "objective.mode",
    "loss.latent_loss_weight": "objective.latent_loss_weight",
    "loss.text_loss_weight": "objective.text_loss_weight",
    "loss.use_cross_entropy": "text_diffusion.loss (true: masked_ce, the unweighted masked cross-entropy)",
    "loss.reduction": "the text loss is always the mean over the masked non-pad tokens (tokenmean)",
    "optimizer.name": "AdamW, the one optimizer (adamw)",
    "optimizer.lr": "optim.lr",
    "optimizer.weight_decay": "optim.weight_decay",
    "optimizer.beta1": "optim.betas",
    "optimizer.beta2": "optim.betas",
    "optimizer.eps": "optim.eps",
    "optimizer.grad_clip_norm": "optim.grad_clip",
    "optimizer.use_fused": "optim.fused, written auto (see the audit)",
    "logging.run_name": "train.run_dir (runs/RUN_NAME) and data.path (data/prepared/RUN_NAME)",
    "logging.save_dir": NOT_CARRIED + "it holds the older checkpoints, which our trainer does not read; "
    "checkpoints go to train.run_dir/checkpoints",
    "logging.log_freq": "train.log_every",
    "logging.eval_freq": "eval.every",
    "logging.save_freq": "checkpoint.every, with checkpoint.keep_last 3 (see the audit)",
    "logging.wandb_project": "logging.wandb_project (logging.wandb=true after `pip install wandb`: offline "
    "into RUN/wandb/)",
}

# Values with a counterpart of another name; anything else is named as unreadable.
PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}
SCHEDULES = {"cosine": "warmup_cosine", "constant": "constant"}
PREDICTIONS = {"epsilon": "eps", "eps": "eps", "x0": "x0", "sample": "x0", "v": "v", "v_prediction": "v"}
MODES = ("l2t", "t2l", "joint")

# What the older training code got wrong and our trainer does right by construction (no key to set).
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
    "NaN guards replaced the loss by a constant with no gradient: a non-finite step is skipped and counted "
    "(train.max_consecutive_skips)",
    "only 10k of 2M samples read, train and validation overlapping: every sample is read, the splits are disjoint",
    "checkpoints without config, broken resume, log truncated at start, no grad norm logged: each run dir holds "
    "its config, --resume auto restores everything, metrics.jsonl is appended, grad norm is logged",
    "the t2l sampler gave NaN at t = 1 and mixed up eps and x0: alpha(1) is floored (latent_diffusion.min_alpha)",
    "the monitor parsed lines the trainer never printed: `mmldlm monitor` reads metrics.jsonl",
)

# The older launcher's rules (scripts that train MM-LDLM with the older codebase): the per-GPU batch
# from the GPU's memory, accumulation until the effective batch reaches this, the LR scaled by the
# square root of effective batch / this above it, warmup a share of the steps within bounds.
LAUNCHER_BATCH_BY_MEMORY = ((80, 4), (40, 3), (24, 2), (16, 2))  # (at least GB, per-GPU batch); else 1
LAUNCHER_TARGET_BATCH = 32
LAUNCHER_WARMUP_SHARE, LAUNCHER_WARMUP_BOUNDS = 0.02, (1000, 5000)
# Launcher overrides whose values the older launcher computes with the rules above.
LAUNCHER_RULE_KEYS = (
    "training.train_batch_size",
    "training.gradient_accumulation_steps",
    "optimizer.lr",
    "training.warmup_steps",
    "training.num_train_steps",
    "logging.log_freq",
    "logging.eval_freq",
    "logging.save_freq",
)
CLUSTER_VARIABLES = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# The older launcher's exports our launcher sets itself (scripts/launch.sh) or the audit flags.
EXPORTS_HANDLED = {
    "NCCL_ASYNC_ERROR_HANDLING": "scripts/launch.sh sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (its current name)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "scripts/launch.sh sets it to 1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "see the audit; the trainer sets it to the collective timeout + 60 s",
    "TORCH_NCCL_ENABLE_MONITORING": "see the audit",
    "NCCL_BLOCKING_WAIT": "see the audit",
    "TORCH_NCCL_BLOCKING_WAIT": "see the audit",
    "NCCL_TIMEOUT": "see the audit; distributed.timeout_minutes sets the collective timeout",
    "OMP_NUM_THREADS": "scripts/launch.sh sets it to the node's cores / processes",
}
LONG_TEXTS = 1024  # tokens from which activations, not weights, decide the micro-batch of a 1024-wide model


class MigrateError(UserError):
    """An older config or launcher that cannot be read; the message names the file and what was expected."""


@dataclass
class Cluster:
    nnodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    cpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node


# --------------------------------------------------------------------------------------------------
# The launcher, read without running it.


@dataclass
class Launcher:
    path: Path
    variables: dict[str, str]  # shell variables whose values were evaluated
    exports: dict[str, str]  # exported variables (evaluated), other than the cluster's
    config_name: str | None  # --config-name of the training command
    overrides: dict[str, str]  # key -> value of the training command's evaluated key=value arguments
    computed: list[str]  # override keys whose value the launcher computes (not evaluated here)
    unread: list[str]  # what was not evaluated, with line numbers


_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")
_ASSIGNMENT = re.compile(r"^(\w+)=(.*)$", re.S)
_ASSIGNED = re.compile(r"(?:^|[\s;&|(])(\w+)=")  # names assigned anywhere in a line
_OPENERS, _CLOSERS = {"if", "for", "while", "until", "case", "{"}, {"fi", "done", "esac", "}"}
_RECOGNISED = {"set", "cd", "echo", "mkdir", "exit", "wait"}  # no effect on the settings


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash-newline continuations joined."""
    lines, start, pending = [], 1, ""
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def _evaluate(value: str, variables: dict[str, str]) -> str | None:
    """`value` with `${VAR:-default}`, `${VAR}` and `$VAR` replaced; None where something stays unevaluated
    (command substitution, arithmetic, an unknown variable)."""
    if "$(" in value or "`" in value:
        return None

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        default = None if match.group(2) is None else _evaluate(match.group(2), variables)
        if default is None:
            raise KeyError(name)
        return default

    try:
        result = _VARIABLE.sub(substitute, value)
    except KeyError:
        return None
    return None if "$" in result else result


def _is_training_command(tokens: list[str]) -> bool:
    return any(t in ("torchrun", "torch.distributed.run", "torch.distributed.launch") for t in tokens)


def read_launcher(path: Path, cluster: Cluster) -> Launcher:
    """The launcher's evaluated variables, exports and training command; NNODES and NPROC_PER_NODE are
    the cluster's."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise MigrateError(f"launcher {path}: cannot be read ({err})") from None
    variables = {"NNODES": str(cluster.nnodes), "NPROC_PER_NODE": str(cluster.gpus_per_node)}
    launcher = Launcher(path, variables, {}, None, {}, [], [])
    skipped: list[tuple[int, str]] = []  # lines not evaluated, grouped into runs when named

    def skip(number: int, line: str) -> None:
        skipped.append((number, line))
        for name in _ASSIGNED.findall(line):  # a value set there is no longer known here
            if name not in ("NNODES", "NPROC_PER_NODE"):
                launcher.variables.pop(name, None)

    depth, found_command = 0, False
    for number, line in _logical_lines(text):
        try:
            tokens = [t.rstrip(";") for t in shlex.split(line, comments=True)]
        except ValueError:  # unbalanced quotes
            skip(number, line)
            continue
        tokens = [t for t in tokens if t]
        opened = sum(t in _OPENERS for t in tokens) - sum(t in _CLOSERS for t in tokens)
        if depth or opened or (tokens and tokens[0] in ("then", "else", "elif", "function")) or "()" in line:
            depth = max(0, depth + opened)
            skip(number, line)
            continue
        if not tokens or tokens[0] in _RECOGNISED:
            continue
        if _is_training_command(tokens):
            found_command = True
            _read_training_command(launcher, number, tokens)
        elif tokens[0] == "export" or all(_ASSIGNMENT.match(t) for t in tokens):
            _read_assignments(launcher, number, line, tokens)
        else:
            skip(number, line)
    if not found_command:
        raise MigrateError(
            f"launcher {path}: not a launcher of the older trainer: no torchrun (or python -m torch.distributed.run) "
            f"line found; expected a bash script that exports its settings and calls torchrun ... --config-name NAME"
        )
    launcher.unread += _name_runs(path, skipped)
    return launcher


def _read_assignments(launcher: Launcher, number: int, line: str, tokens: list[str]) -> None:
    exported = tokens[0] == "export"
    for token in tokens[1:] if exported else tokens:
        match = _ASSIGNMENT.match(token)
        if match is None:  # `export NAME` of a variable set before
            if token in launcher.variables and token not in CLUSTER_VARIABLES:
                launcher.exports[token] = launcher.variables[token]
            continue
        name, raw = match.groups()
        if name in ("NNODES", "NPROC_PER_NODE"):
            continue  # the cluster given on the command line wins over the launcher's defaults
        value = _evaluate(raw, launcher.variables)
        if value is None:
            launcher.variables.pop(name, None)
            launcher.unread.append(f"{launcher.path}:{number}: {name}={raw} not evaluated")
            continue
        launcher.variables[name] = value
        if exported and name not in CLUSTER_VARIABLES:
            launcher.exports[name] = value


def _read_training_command(launcher: Launcher, number: int, tokens: list[str]) -> None:
    args = iter(tokens)
    for token in args:
        if token.startswith("--config-name"):
            raw = token.split("=", 1)[1] if "=" in token else next(args, "")
            launcher.config_name = _evaluate(raw, launcher.variables)
            continue
        key, sep, raw = token.lstrip("+").partition("=")
        if not sep or token.startswith("-") or "." not in key:
            continue  # torchrun's options, the script, the interpreter
        value = _evaluate(raw, launcher.variables)
        if value is None and key in LAUNCHER_RULE_KEYS:
            launcher.computed.append(key)
        elif value is None:
            launcher.unread.append(f"{launcher.path}:{number}: override {token} not evaluated; not applied")
        else:
            launcher.overrides[key] = value


def _name_runs(path: Path, skipped: list[tuple[int, str]]) -> list[str]:
    """One entry per run of consecutive skipped lines: its line range and first line."""
    runs: list[list[tuple[int, str]]] = []
    for number, line in skipped:
        if runs and number == runs[-1][-1][0] + 1:
            runs[-1].append((number, line))
        else:
            runs.append([(number, line)])
    named = []
    for run in runs:
        first, last = run[0][0], run[-1][0]
        where = f"{path}:{first}" if first == last else f"{path}:{first}-{last}"
        named.append(f"{where}: `{run[0][1].strip()[:70]}` not evaluated (shell control flow or substitution)")
    return named


def launcher_values(base: dict[str, Any], cluster: Cluster, base_world_size: int) -> dict[str, Any]:
    """What the older launcher computes for `cluster` from the config's `base` values (older keys):
    per-GPU batch, accumulation, learning rate, steps, warmup and frequencies."""
    for key in ("optimizer.lr", "training.num_train_steps"):
        if not isinstance(base.get(key), (int, float)):
            raise MigrateError(f"older config: {key}={base.get(key)!r}; expected a number, which the launcher scales")
    batch = next((b for gb, b in LAUNCHER_BATCH_BY_MEMORY if cluster.gpu_memory_gib >= gb), 1)
    accumulation = 1
    while batch * cluster.world_size * accumulation < LAUNCHER_TARGET_BATCH:
        accumulation += 1
    effective = batch * cluster.world_size * accumulation
    lr = base["optimizer.lr"] * (
        math.sqrt(effective / LAUNCHER_TARGET_BATCH) if effective > LAUNCHER_TARGET_BATCH else 1
    )
    scale = base_world_size / cluster.world_size
    steps = int(base["training.num_train_steps"] * scale)
    low, high = LAUNCHER_WARMUP_BOUNDS
    values = {
        "training.train_batch_size": batch,
        "training.gradient_accumulation_steps": accumulation,
        "optimizer.lr": lr,
        "training.num_train_steps": steps,
        "training.warmup_steps": min(high, max(low, int(steps * LAUNCHER_WARMUP_SHARE))),
    }
    for key in ("logging.log_freq", "logging.eval_freq", "logging.save_freq"):
        if base.get(key) is not None:
            values[key] = max(1, int(base[key] * scale))
    return values


# --------------------------------------------------------------------------------------------------
# The older config, composed by Hydra.


def compose_older_config(path: Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config at `path` with its defaults list composed from the group folders beside it, `overrides`
    (older key -> value) applied and interpolations resolved, as a plain nested dict; and the overrides
    that Hydra's override grammar cannot read (named, not applied)."""
    if not path.is_file():
        raise MigrateError(f"older config {path}: no such file; expected the run's Hydra-composed run config (YAML)")
    parser, texts, unread = OverridesParser.create(), [], []
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            known = OmegaConf.to_container(compose(config_name=path.stem), resolve=False)
            for key, value in overrides.items():
                text = f"{'' if _has_key(known, key) else '+'}{key}={_override_text(value)}"
                try:
                    parser.parse_overrides([text])
                except HydraException as err:
                    unread.append(f"override {key}={value}: not read by Hydra's override grammar ({_one_line(err)})")
                    continue
                texts.append(text)
            cfg = compose(config_name=path.stem, overrides=texts)
            return OmegaConf.to_container(cfg, resolve=True), unread
    except yaml.YAMLError as err:
        raise MigrateError(f"older config {path}: not valid YAML ({_one_line(err)})") from None
    except (HydraException, OmegaConfBaseException) as err:
        message = _one_line(err).split(" Config search path:")[0]  # Hydra appends its search path
        raise MigrateError(f"older config {path}: {message}") from None


def _override_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, float) else str(value)


def _has_key(tree: Any, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of the older config; an empty mapping stays a value, so it is named too."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# --------------------------------------------------------------------------------------------------
# The translation.


@dataclass
class Translation:
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)  # our key -> (value, where it comes from)
    prepare: dict[str, Any] = field(default_factory=dict)  # prepare option -> value
    carried: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)  # older keys named in `unread`, not listed again

    def put(self, key: str, value: Any, source: str) -> None:
        self.values[key] = (value, source)

    def refuse(self, key: str, line: str) -> None:
        self.unread.append(line)
        self.refused.add(key)


def heads_dividing(width: int, heads: int) -> int:
    """The head count nearest `heads` that divides `width` into even head dims (RoPE); ties go to fewer
    heads (wider heads)."""
    candidates = [h for h in range(1, width + 1) if width % h == 0 and (width // h) % 2 == 0]
    return min(candidates, key=lambda h: (abs(h - heads), h))


def translate(old: dict[str, Any], cluster: Cluster, launcher_keys: set[str]) -> Translation:
    """Our run config's values from the older config's (flat keys); `launcher_keys`: the keys whose values
    the older launcher computed for this cluster."""
    out = Translation()

    def source(key: str) -> str:
        return f"{key}={old[key]!r}" + (" (the launcher's rule for this cluster)" if key in launcher_keys else "")

    def carry(key: str, ours: str, convert=lambda v: v, table: dict | None = None) -> None:
        if key not in old:
            return
        value = old[key]
        if table is not None:
            if value not in table:
                known = ", ".join(map(str, table))
                out.refuse(key, f"{key}={value!r}: no counterpart (known: {known}); not carried, our default kept")
                return
            value = table[value]
        out.put(ours, convert(value), source(key))

    _translate_model(old, out, source, carry)
    carry("training.seed", "train.seed")
    carry("training.eval_batch_size", "eval.batch_size")
    carry("training.num_train_steps", "train.steps")
    carry("training.dtype", "train.precision", table=PRECISIONS)
    carry("training.compile_model", "perf.compile")
    carry("training.lr_schedule", "schedule.kind", table=SCHEDULES)
    carry("training.warmup_steps", "schedule.warmup_steps")
    _translate_batch(old, out, cluster, source)
    carry("loss.loss_type", "objective.mode", table={m: m for m in MODES})
    carry("loss.latent_loss_weight", "objective.latent_loss_weight", float)
    carry("loss.text_loss_weight", "objective.text_loss_weight", float)
    carry("loss.use_cross_entropy", "text_diffusion.loss", table={True: "masked_ce", False: "elbo"})
    carry("optimizer.lr", "optim.lr", float)
    carry("optimizer.weight_decay", "optim.weight_decay", float)
    carry("optimizer.eps", "optim.eps", float)
    carry("optimizer.grad_clip_norm", "optim.grad_clip", float)
    if "optimizer.beta1" in old or "optimizer.beta2" in old:
        betas = [float(old.get("optimizer.beta1", 0.9)), float(old.get("optimizer.beta2", 0.95))]
        out.put("optim.betas", betas, "optimizer.beta1, optimizer.beta2")
    if "optimizer.use_fused" in old:  # auto: fused where the GPU has the kernel (true fails where it has not)
        out.put("optim.fused", "auto", source("optimizer.use_fused"))
    _translate_run(old, out, source, carry)
    _name_the_rest(old, out)
    return out


def _translate_model(old: dict, out: Translation, source, carry) -> None:
    carry("model.hidden_size", "model.hidden_size")
    carry("model.n_blocks", "model.num_blocks")
    carry("model.max_seq_len", "model.max_seq_len")
    carry("model.dropout", "model.dropout", float)
    carry("model.qk_rmsnorm", "model.qk_norm")
    carry("model.latent_dim", "model.latent_dim")
    carry("model.latent_beta_schedule", "latent_diffusion.schedule", table={"cosine": "cosine"})
    carry("model.latent_parameterization", "latent_diffusion.prediction", table=PREDICTIONS)
    width, heads = old.get("model.hidden_size", 256), old.get("model.n_heads")
    if heads is not None:
        fitted = heads_dividing(width, heads)
        why = (
            ""
            if fitted == heads
            else (
                f"; {heads} does not divide {width} (the older block ignored the head count): the nearest head "
                f"count that does, with an even head dim ({width // fitted}) for RoPE"
            )
        )
        out.put("model.num_heads", fitted, source("model.n_heads") + why)
    if "model.cond_dim" in old and old["model.cond_dim"] != width:
        line = f"model.cond_dim={old['model.cond_dim']!r}: our conditioning vector is model.hidden_size={width} wide"
        out.refuse("model.cond_dim", line + "; not carried")
    for key, off in (("model.p_uniform", 0.0), ("model.cluster_size", 0)):
        if key in old and old[key] != off:  # on in the older run: a change of recipe, not only a dropped key
            out.refuse(key, f"{key}={old[key]!r} (on in the older run): {OLDER_KEYS[key][len(NOT_CARRIED) :]}")


def _translate_batch(old: dict, out: Translation, cluster: Cluster, source) -> None:
    micro = old.get("training.train_batch_size")
    if micro is None:
        return
    accumulation = old.get("training.gradient_accumulation_steps", 1)
    out.put("train.micro_batch_size", micro, source("training.train_batch_size"))
    out.put(
        "train.global_batch_size",
        micro * accumulation * cluster.world_size,
        f"{micro} per GPU x accumulation {accumulation} x {cluster.world_size} GPUs",
    )


def _translate_run(old: dict, out: Translation, source, carry) -> None:
    name = str(old.get("logging.run_name", "imported"))
    out.put("train.run_dir", f"runs/{name}", source("logging.run_name") if "logging.run_name" in old else "")
    out.put("data.path", f"data/prepared/{name}", "the output of the prepare line below")
    carry("logging.log_freq", "train.log_every")
    carry("logging.eval_freq", "eval.every")
    carry("logging.save_freq", "checkpoint.every")
    carry("logging.wandb_project", "logging.wandb_project", str)
    carry("data.max_length", "data.max_length")
    out.put("data.num_workers", None, "min(8, CPUs // GPUs per node); see the audit")
    out.put("perf.activation_checkpointing", "auto", "the least checkpointing under which the micro-batch fits")
    out.put("distributed.timeout_minutes", 30.0, "a hung collective fails the job in 30 minutes; see the audit")
    out.put("checkpoint.keep_last", 3, "older checkpoints are pruned; see the audit")
    if "data.token_dir" in old:  # imported latents: the encoder that made them is unknown to re-encode with
        out.put("eval.encoder", False, "the imported latents' sentence encoder is not known here")
    for key, option in (
        ("data.token_dir", "--legacy-tokens"),
        ("data.latent_dir", "--legacy-latents"),
        ("data.tokenizer_name", "--tokenizer"),
        ("data.tokenizer_path", "--tokenizer"),
        ("data.max_samples", "--max-samples"),
        ("data.val_ratio", "--val-fraction"),
    ):
        if old.get(key) is not None:
            out.prepare[option] = old[key]


def _name_the_rest(old: dict, out: Translation) -> None:
    for key, value in old.items():
        where = OLDER_KEYS.get(key)
        if key in out.refused:
            continue
        if where is None:
            out.unread.append(f"{key}={value!r}: unknown key; not read")
        elif where.startswith(NOT_CARRIED):
            out.dropped.append(f"{key}={value!r}: {where[len(NOT_CARRIED) :]}")
        else:
            out.carried.append(f"{key}={value!r} -> {where}")


# --------------------------------------------------------------------------------------------------
# Writing our config.


def _yaml_value(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    if isinstance(value, float) and re.fullmatch(r"[-+]?\d+e[-+]?\d+", text):
        text = text.replace("e", ".0e")  # YAML 1.1 reads 5e-05 (no dot) as a string
    return text


def config_text(translation: Translation, header: list[str]) -> str:
    sections: dict[str, list[str]] = {f.name: [] for f in dataclasses.fields(RunConfig)}  # in RunConfig's order
    for key, (value, source) in translation.values.items():
        section, name = key.split(".", 1)
        comment = f"  # {source}" if source else ""
        sections.setdefault(section, []).append(f"  {name}: {_yaml_value(value)}{comment}")
    lines = [f"# {line}" for line in header]
    for section, entries in sections.items():
        if entries:
            lines += [f"{section}:", *entries]
    return "\n".join(lines) + "\n"


def our_config(translation: Translation) -> RunConfig:
    raw: dict[str, Any] = {}
    for key, (value, _) in translation.values.items():
        section, name = key.split(".", 1)
        raw.setdefault(section, {})[name] = value
    try:
        cfg = from_dict(RunConfig, raw)
        cfg.check()
    except ConfigError as err:
        raise MigrateError(f"the older config's values give no valid run config: {err}") from None
    return cfg


# --------------------------------------------------------------------------------------------------
# The audit of the older files.


def older_as_ours(cfg: RunConfig, old: dict[str, Any]) -> RunConfig:
    """Our config with the older run's choices where ours differ: the run the older files describe."""
    changes: dict[str, Any] = {"perf.activation_checkpointing": "none"}
    if "data.num_workers" in old:
        changes["data.num_workers"] = old["data.num_workers"]
    if old.get("optimizer.use_fused") is not None:
        changes["optim.fused"] = bool(old["optimizer.use_fused"])
    return apply_changes(cfg, changes)


def older_findings(cfg: RunConfig, old: dict, raw_old: dict, launcher: Launcher | None, env: Environment) -> list:
    """The findings only the older files can give, as `mmldlm check` findings (rules in check/rules.py): of the
    launcher (its collective timeout, its LR and warmup rules), then of the config."""
    est = estimate(older_as_ours(cfg, old), env)
    return _launcher_findings(cfg, raw_old, launcher, env) + _config_findings(cfg, old, est, env)


def _launcher_findings(cfg: RunConfig, raw_old: dict, launcher: Launcher | None, env: Environment) -> list:
    if launcher is None:
        return []
    findings = []
    if "NCCL_TIMEOUT" in launcher.exports:
        value = launcher.exports["NCCL_TIMEOUT"]
        hours = float(value) / 3600 if value.isdigit() else float("nan")
        findings.append(finding("older_collective_timeout", value=value, hours=hours, source=env.environ_source))
    if launcher.computed:
        findings.append(
            finding(
                "older_lr_rules",
                {"optim.lr": cfg.optim.lr, "schedule.warmup_steps": cfg.schedule.warmup_steps},
                lr=cfg.optim.lr,
                base_lr=raw_old.get("optimizer.lr"),
                warmup=cfg.schedule.warmup_steps,
                config_warmup=raw_old.get("training.warmup_steps"),
                batch=cfg.train.global_batch_size,
                world=env.world_size,
                steps=cfg.train.steps,
            )
        )
    return findings


def _config_findings(cfg: RunConfig, old: dict, est: Estimate, env: Environment) -> list:
    findings = []
    if cfg.model.max_seq_len >= LONG_TEXTS:
        micro = cfg.train.micro_batch_size
        values = dict(length=cfg.model.max_seq_len, micro=micro, memory=env.device_memory_gib)
        activations = est.activations_gib_per_sample * 1024
        findings.append(
            finding("older_no_checkpointing", need=est.memory_gib(micro), activations=activations, **values)
        )
    if "logging.save_freq" in old:
        saved = math.ceil(cfg.train.steps / cfg.checkpoint.every)
        values = dict(every=old["logging.save_freq"], saved=saved, each=est.checkpoint_gib, steps=cfg.train.steps)
        findings.append(finding("older_retention", key="logging.save_freq", total=saved * est.checkpoint_gib, **values))
    if "optimizer.use_fused" in old:
        findings.append(finding("older_fused", value=str(old["optimizer.use_fused"]).lower()))
    heads, width, fitted = old.get("model.n_heads"), cfg.model.hidden_size, cfg.model.num_heads
    if heads is not None and heads != fitted:
        values = dict(heads=heads, width=width, fitted=fitted, head_dim=width // fitted)
        findings.append(finding("older_heads", {"model.num_heads": fitted}, **values))
    return findings


def what_the_written_config_does(f: Finding, cfg: RunConfig, out: Path) -> str:
    """The line under a finding of the older files: how the written config (or our launcher) settles it."""
    if f.rule == "nccl_env":
        return "not a config key: scripts/launch.sh does not export it; leave it out of the environment"
    if not f.changes:
        return f"{out} follows the fix"
    written = flat_keys(to_dict(cfg))
    applied = ", ".join(f"{key}={_yaml_value(written[key])}" for key in f.changes)
    return f"{out} has {applied}"


# --------------------------------------------------------------------------------------------------
# The whole command.


@dataclass
class Migration:
    """What `migrate` read, wrote and found; `report` is what the command prints."""

    config_path: Path
    launcher: Launcher | None
    cluster: Cluster
    out: Path
    translation: Translation
    notes: list[str]  # what was not read, besides the translation's and the launcher's own
    findings: list[Finding]  # the audit of the older run
    remaining: list[Finding]  # `mmldlm check` on the written config
    env: Environment
    sized: RunConfig  # the written config with the older tokenizer's vocabulary, for the estimates
    config: RunConfig  # the written config

    @property
    def report(self) -> str:
        launcher, out = self.launcher, self.out
        lines = [f"migrate: {self.config_path}" + (f" + {launcher.path}" if launcher else "")]
        lines[0] += f" for {_cluster_words(self.cluster)}"
        lines.append(describe(self.env, estimate(self.sized, self.env), self.sized))
        lines.append(f"\nwrote {out}; carried over (older key -> ours):")
        lines += [f"  {line}" for line in self.translation.carried]
        lines.append("\nnot carried over:")
        lines += [f"  {line}" for line in self.translation.dropped]
        unread = self.unread()
        lines.append("\nnot read or not evaluated (named, not applied):" if unread else "\nnothing left unread")
        lines += [f"  {line}" for line in unread]
        lines.append(f"\naudit of the older run ({len(self.findings)} finding(s)):")
        for f in self.findings:
            lines.append(format_finding(f) + f"\n    written: {what_the_written_config_does(f, self.sized, out)}")
        lines.append("\nwhat the older training code got wrong, which our trainer does right by construction:")
        lines += [f"  - {line}" for line in FIXED_BY_CONSTRUCTION]
        serious = [f for f in self.remaining if f.severity in ("error", "warning")]
        verdict = f"{len(serious)} to look at" if serious else "clean"
        lines.append(f"\n`mmldlm check` on {out} for this cluster: {verdict}")
        lines += [format_finding(f) for f in serious]
        lines.append("\nnext:")
        lines += [f"  {line}" for line in next_commands(self.translation, launcher, self.cluster, out)]
        return "\n".join(lines)

    def unread(self) -> list[str]:
        lines = self.translation.unread + self.notes
        if self.launcher is not None:
            lines += self.launcher.unread
            lines += [
                f"{self.launcher.path}: exports {name}={value}: not carried ({EXPORTS_HANDLED[name]})"
                for name, value in self.launcher.exports.items()
                if name in EXPORTS_HANDLED
            ]
        return lines


def migrate(config_path: Path, launcher_path: Path | None, cluster: Cluster, out: Path) -> Migration:
    launcher = read_launcher(launcher_path, cluster) if launcher_path is not None else None
    raw_old, old, notes = read_older_run(config_path, launcher, cluster)
    translation = translate(old, cluster, set(launcher.computed) if launcher is not None else set())
    cfg = our_config(translation)
    env = _environment(cluster, launcher)
    sized = _with_vocab_of(cfg, translation.prepare.get("--tokenizer"))  # for the memory estimates
    if sized.model.vocab_size is None:
        notes.append(
            f"tokenizer {translation.prepare.get('--tokenizer')}: not readable here; the memory estimates take a "
            f"vocabulary of {sized.data.vocab_size} (prepare reads the real one)"
        )
    generic = [f for f in audit(older_as_ours(sized, old), env)[0] if f.severity != "info"]
    findings = generic + older_findings(sized, old, raw_old, launcher, env)
    findings.sort(key=lambda f: SEVERITY_ORDER[f.severity])
    header = [
        f"Imported by `mmldlm migrate` from {config_path}" + (f" and {launcher_path}" if launcher_path else ""),
        f"for {_cluster_words(cluster)}; each key's comment names the older setting it comes from.",
        "The older settings not carried over, and why, are listed in the command's output and docs/migrating.md.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config_text(translation, header))
    written = load_config(out)
    remaining = audit(_with_vocab_of(written, translation.prepare.get("--tokenizer")), _environment(cluster, None))[0]
    return Migration(config_path, launcher, cluster, out, translation, notes, findings, remaining, env, sized, written)


def read_older_run(config_path: Path, launcher: Launcher | None, cluster: Cluster) -> tuple[dict, dict, list[str]]:
    """(the config as written, the config as the launcher runs it on `cluster`, notes on what was not read),
    both flat. The launcher's literal overrides apply as they are; those it computes follow its rules."""
    raw_old = flatten(compose_older_config(config_path, {})[0])
    if launcher is None:
        return raw_old, raw_old, []
    overrides, notes = dict(launcher.overrides), []
    if launcher.config_name not in (None, config_path.stem):
        notes.append(
            f"{launcher.path}: --config-name {launcher.config_name}, not {config_path.stem}: read {config_path}"
        )
    if launcher.computed:
        base = flatten(compose_older_config(config_path, overrides)[0])
        base_world = _base_world_size(launcher, cluster, notes)
        computed = launcher_values(base, cluster, base_world)
        notes.append(
            f"{launcher.path}: {', '.join(launcher.computed)} computed by the launcher: taken from the older "
            f"launcher's rules for this cluster (docs/migrating.md), BASE_WORLD_SIZE={base_world}"
        )
        overrides.update({key: computed[key] for key in launcher.computed if key in computed})
    composed, unread_overrides = compose_older_config(config_path, overrides)
    notes += [f"{launcher.path}: {line}" for line in unread_overrides]
    return raw_old, flatten(composed), notes


def _base_world_size(launcher: Launcher, cluster: Cluster, notes: list[str]) -> int:
    value = launcher.variables.get("BASE_WORLD_SIZE")
    if value is not None and value.isdigit() and int(value) > 0:
        return int(value)
    notes.append(
        f"{launcher.path}: no BASE_WORLD_SIZE evaluated: steps and frequencies are not scaled by the cluster's size"
    )
    return cluster.world_size


def _with_vocab_of(cfg: RunConfig, tokenizer: Any) -> RunConfig:
    """`cfg` with model.vocab_size of the older tokenizer where it can be read here (the written config leaves
    it null: taken from the prepared dataset); else as it is."""
    try:
        size = vocab_size(load_tokenizer(str(tokenizer)))
    except (UserError, OSError):
        return cfg
    return apply_changes(cfg, {"model.vocab_size": size})


def _environment(cluster: Cluster, launcher: Launcher | None) -> Environment:
    return Environment(
        device="cuda",
        device_memory_gib=cluster.gpu_memory_gib,
        cpus=cluster.cpus_per_node,
        nproc_per_node=cluster.gpus_per_node,
        nnodes=cluster.nnodes,
        free_disk_gib=math.inf,  # the cluster's disk is not known here; `mmldlm check` there measures it
        fused_adamw=True,
        native_bf16=True,
        environ=dict(launcher.exports) if launcher is not None else {},
        environ_source=f"{launcher.path} (exported)" if launcher is not None else "the environment",
    )


def _cluster_words(cluster: Cluster) -> str:
    return (
        f"{cluster.nnodes} node(s) x {cluster.gpus_per_node} GPU(s) of {cluster.gpu_memory_gib:g} GiB, "
        f"{cluster.cpus_per_node} CPUs per node"
    )


def next_commands(translation: Translation, launcher: Launcher | None, cluster: Cluster, out: Path) -> list[str]:
    prepare = translation.prepare
    data_path = translation.values["data.path"][0]
    words = ["mmldlm", "prepare"]
    for option, placeholder in (
        ("--legacy-tokens", "TOKENS_DIR"),
        ("--legacy-latents", "LATENTS_DIR"),
        ("--tokenizer", "TOKENIZER"),
    ):
        words += [option, str(prepare.get(option, placeholder))]
    for option in ("--max-samples", "--val-fraction"):
        if option in prepare:
            words += [option, str(prepare[option])]
    words += ["--out", data_path]
    check = (
        f"mmldlm check {out} --nnodes {cluster.nnodes} --nproc-per-node {cluster.gpus_per_node} "
        f"--device-memory-gib {cluster.gpu_memory_gib:g}"
    )
    kept = {} if launcher is None else {k: v for k, v in launcher.exports.items() if k not in EXPORTS_HANDLED}
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in kept.items())
    env = f"{env} " if env else ""
    if cluster.world_size == 1:
        train = f"{env}mmldlm train --config {out}"
    elif cluster.nnodes == 1:
        train = f"{env}NPROC_PER_NODE={cluster.gpus_per_node} scripts/launch.sh --config {out}"
    else:
        variables = launcher.variables if launcher is not None else {}
        addr = variables.get("MASTER_ADDR", "NODE0_ADDRESS")
        port = variables.get("MASTER_PORT", "29500")
        train = (
            f"{env}NNODES={cluster.nnodes} NPROC_PER_NODE={cluster.gpus_per_node} NODE_RANK=0 MASTER_ADDR={addr} "
            f"MASTER_PORT={port} scripts/launch.sh --config {out}"
        )
        others = "1" if cluster.nnodes == 2 else f"1..{cluster.nnodes - 1}"
        train += f"   # on node 0; NODE_RANK={others} on the other node(s)"
    return [shlex.join(words), check, train]
