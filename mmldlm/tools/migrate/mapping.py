"""Our run config from the older run: every older key and where it goes (OLDER_KEYS, the one home of the
mapping; docs/migrating.md's table is checked against it), with the values the older trainer really
trained with on the cluster (older_trainer.py), and what the launcher meant where bash lost or emptied
a value (launcher.py) in the comment beside it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from mmldlm.config import ConfigError, RunConfig, from_dict
from mmldlm.tools.migrate.cluster import MigrateError
from mmldlm.tools.migrate.older_trainer import CHECKPOINTS_KEPT, COLLECTIVE_TIMEOUT_MINUTES, HEADS, OlderRun, heads_for

NOT_CARRIED = "not carried over: "
OLDER_KEYS = {
    "data.token_dir": "prepare --legacy-tokens",
    "data.latent_dir": "prepare --legacy-latents",
    "data.tokenizer_path": "prepare --tokenizer",
    "data.tokenizer_name": "prepare --tokenizer (a local tokenizer folder or tokenizer.json: prepare runs offline)",
    "data.max_samples": "prepare --legacy-order scan --max-samples: the first pairs in the folder's own order, as "
    "the older loader read them (null: data.initial_scan_limit)",
    "data.initial_scan_limit": "prepare --max-samples where data.max_samples is null (the older loader read only "
    "that many pairs)",
    "data.val_ratio": NOT_CARRIED + "the older validation split overlapped training: prepare --val-fraction 0 "
    "trains on every pair the older run trained on",
    "data.max_val_samples": NOT_CARRIED + "the validation split is the whole disjoint val split prepare writes "
    "(--val-fraction); evaluation reads eval.num_elbo_batches x eval.batch_size of it",
    "data.num_workers": "data.num_workers, written null (min(8, CPUs // GPUs per node); see the audit)",
    "data.max_length": "data.max_length",
    "model.hidden_size": "model.hidden_size",
    "model.n_blocks": "model.num_blocks",
    "model.n_heads": f"never read by the older trainer (its block ran {HEADS} heads): model.num_heads {HEADS}",
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
    "training.train_batch_size": "train.micro_batch_size; train.global_batch_size = micro-batch x GPUs",
    "training.eval_batch_size": "eval.batch_size",
    "training.num_epochs": "train.steps = epochs x steps per epoch (the older run's length)",
    "training.num_train_steps": "schedule.num_steps: the length of the older cosine, apart from train.steps",
    "training.dtype": "train.precision",
    "training.compile_model": "perf.compile",
    "training.lr_schedule": "schedule.kind (cosine: warmup_cosine to 0 at schedule.num_steps, constant)",
    "training.warmup_steps": "schedule.warmup_steps",
    "training.gradient_accumulation_steps": "never applied by the older trainer: accumulation 1, global batch = "
    "micro-batch x GPUs",
    "loss.loss_type": "objective.mode (unconditional, multimodal_mdlm: joint)",
    "loss.latent_loss_weight": "objective.latent_loss_weight",
    "loss.text_loss_weight": "objective.text_loss_weight",
    "loss.use_cross_entropy": "text_diffusion.loss (true: masked_ce, the unweighted masked cross-entropy)",
    "loss.reduction": "the text loss is always the mean over the masked non-pad tokens (tokenmean)",
    "optimizer.name": "AdamW, the one optimizer (adamw)",
    "optimizer.lr": "optim.lr",
    "optimizer.weight_decay": "optim.weight_decay",
    "optimizer.betas": "optim.betas",
    "optimizer.beta1": "never read by the older trainer (its betas are optimizer.betas)",
    "optimizer.beta2": "never read by the older trainer (its betas are optimizer.betas)",
    "optimizer.eps": "optim.eps",
    "optimizer.grad_clip_norm": "optim.grad_clip",
    "optimizer.use_fused": "optim.fused, written auto (see the audit)",
    "logging.run_name": "train.run_dir (runs/RUN_NAME) and data.path (data/prepared/RUN_NAME)",
    "logging.save_dir": NOT_CARRIED + "it holds the older checkpoints, which our trainer does not read; "
    "checkpoints go to train.run_dir/checkpoints",
    "logging.log_freq": "train.log_every",
    "logging.eval_freq": "eval.every, written 0: no validation split is held out (see data.val_ratio)",
    "logging.save_freq": "checkpoint.every, with checkpoint.every_minutes 30 and keep_last 4 (see the audit)",
    "logging.wandb_project": "logging.wandb_project (logging.wandb=true after `pip install wandb`: offline "
    "into RUN/wandb/)",
}

SCHEDULES = {"cosine": "warmup_cosine", "constant": "constant"}
PREDICTIONS = {"epsilon": "eps", "eps": "eps", "x0": "x0", "sample": "x0", "v": "v", "v_prediction": "v"}
EVERY_MINUTES = 30.0  # checkpoint.every_minutes written: a failure loses at most about this much work


@dataclass
class Translation:
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)  # our key -> (value, where it comes from)
    prepare: dict[str, Any] = field(default_factory=dict)  # prepare option -> value
    carried: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)  # older keys named in `unread`, not listed again
    suggestions: list[str] = field(default_factory=list)  # what we recommend over the older run: not written

    def put(self, key: str, value: Any, source: str) -> None:
        self.values[key] = (value, source)

    def value(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, (default, ""))[0]

    def refuse(self, key: str, line: str) -> None:
        self.unread.append(line)
        self.refused.add(key)


def translate(run: OlderRun, meant: dict[str, Any], run_name: str | None = None) -> Translation:
    """Our values from the older run; `meant`: older key -> value the launcher meant where bash lost it or
    left it empty (the written value is the older run's, except an LR the older run never had);
    `run_name`: the name of our run and its data (default: logging.run_name)."""
    old, out = run.values, Translation()

    def source(key: str) -> str:
        text = setting(key, old[key])
        if key in meant and meant[key] != old[key]:
            text += f" (the launcher meant {yaml_value(meant[key])})"
        return text

    def carry(key: str, ours: str, convert=lambda v: v, table: dict | None = None) -> None:
        if key not in old:
            return
        value = old[key]
        if table is not None:
            if value not in table:
                known = ", ".join(map(str, table))
                out.refuse(key, f"{source(key)}: no counterpart (known: {known}); not carried, our default kept")
                return
            value = table[value]
        out.put(ours, convert(value), source(key))

    _translate_model(old, out, source, carry)
    _translate_training(run, meant, out, source, carry)
    carry("loss.latent_loss_weight", "objective.latent_loss_weight", float)
    carry("loss.text_loss_weight", "objective.text_loss_weight", float)
    carry("loss.use_cross_entropy", "text_diffusion.loss", table={True: "masked_ce", False: "elbo"})
    carry("optimizer.weight_decay", "optim.weight_decay", float)
    carry("optimizer.eps", "optim.eps", float)
    carry("optimizer.grad_clip_norm", "optim.grad_clip", float)
    betas_from = source("optimizer.betas") if "optimizer.betas" in old else "torch's AdamW default: no optimizer.betas"
    out.put("optim.betas", run.betas, betas_from)
    if "optimizer.use_fused" in old:  # auto: fused where the GPU has the kernel (true fails where it has not)
        out.put("optim.fused", "auto", source("optimizer.use_fused"))
    _translate_run(run, out, source, carry, run_name or str(old.get("logging.run_name", "imported")))
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
    width = old.get("model.hidden_size", 256)
    heads = heads_for(width)
    said = f"; {source('model.n_heads')} was never read" if "model.n_heads" in old else ""
    near = "" if heads == HEADS else f"; {HEADS} does not divide {width} into even head dims: the nearest that does"
    out.put("model.num_heads", heads, f"the older block ran {HEADS} heads{said}{near}")
    if "model.cond_dim" in old and old["model.cond_dim"] != width:
        line = f"{source('model.cond_dim')}: our conditioning vector is model.hidden_size={width} wide"
        out.refuse("model.cond_dim", line + "; not carried")
    for key, off in (("model.p_uniform", 0.0), ("model.cluster_size", 0)):
        if key in old and old[key] != off:  # on in the older run: a change of recipe, not only a dropped key
            out.refuse(key, f"{source(key)} (on in the older run): {OLDER_KEYS[key][len(NOT_CARRIED) :]}")


def _translate_training(run: OlderRun, meant: dict, out: Translation, source, carry) -> None:
    old = run.values
    carry("training.seed", "train.seed")
    carry("training.eval_batch_size", "eval.batch_size")
    carry("training.compile_model", "perf.compile")
    _translate_schedule(run, out, source, carry)
    if run.precision is not None:
        out.put("train.precision", run.precision, source("training.dtype"))
    elif "training.dtype" in old:
        out.refuse("training.dtype", f"{source('training.dtype')}: no counterpart; our default kept")
    if run.mode is not None:
        out.put("objective.mode", run.mode, source("loss.loss_type"))
    elif "loss.loss_type" in old:
        known = "l2t, t2l, joint, unconditional, multimodal_mdlm"
        out.refuse("loss.loss_type", f"{source('loss.loss_type')}: no counterpart (known: {known}); our default kept")
    if run.micro_batch is not None:
        out.put("train.micro_batch_size", run.micro_batch, source("training.train_batch_size"))
        out.put(
            "train.global_batch_size",
            run.global_batch,
            f"{run.micro_batch} per GPU x {run.world_size} GPUs; the older trainer never applied accumulation",
        )
    if run.steps is not None:
        out.put(
            "train.steps",
            run.steps,
            f"training.num_epochs={run.epochs} x {run.steps_per_epoch} steps per epoch of {run.samples_read} samples",
        )
    elif run.schedule_steps is not None:
        out.put("train.steps", run.schedule_steps, source("training.num_train_steps") + "; the epochs are not known")
    if run.lr is not None:
        out.put("optim.lr", run.lr, source("optimizer.lr"))
    elif isinstance(meant.get("optimizer.lr"), (int, float)):
        out.put(
            "optim.lr",
            float(meant["optimizer.lr"]),
            f"the LR the launcher meant; the older run had {source('optimizer.lr')} and failed",
        )


def _translate_schedule(run: OlderRun, out: Translation, source, carry) -> None:
    """The older LR curve as it was: its warmup, then its cosine to 0 over training.num_train_steps, however
    long the run (a run shorter than its cosine ends partway down); a schedule that ends with the run is
    a suggestion, not written."""
    carry("training.lr_schedule", "schedule.kind", table=SCHEDULES)
    carry("training.warmup_steps", "schedule.warmup_steps")
    if out.value("schedule.kind") != "warmup_cosine":
        return
    out.put("schedule.min_lr_ratio", 0.0, "the older cosine fell to 0")
    length = run.schedule_steps
    if length is not None and length != run.steps:
        out.put("schedule.num_steps", length, source("training.num_train_steps") + ": the older cosine's length")
        end = f", at {run.lr_at_end:.2f}x its peak when the run ended" if run.lr_at_end is not None else ""
        out.suggestions.append(
            f"schedule.num_steps: null, min_lr_ratio: 0.1 (a cosine that ends with the run; the older one spanned "
            f"{length:,} steps{end})"
        )


def _translate_run(run: OlderRun, out: Translation, source, carry, name: str) -> None:
    old = run.values
    given = "logging.run_name" in old and str(old["logging.run_name"]) == name
    out.put("train.run_dir", f"runs/{name}", source("logging.run_name") if given else "")
    out.put("data.path", f"data/prepared/{name}", "the output of the prepare line below")
    carry("logging.log_freq", "train.log_every")
    if "logging.eval_freq" in old:
        out.put("eval.every", 0, source("logging.eval_freq") + "; no validation split is held out (prepare line)")
    carry("logging.save_freq", "checkpoint.every")
    out.put("checkpoint.every_minutes", EVERY_MINUTES, "a failure loses at most about 30 minutes; see the audit")
    out.put("checkpoint.keep_last", CHECKPOINTS_KEPT, f"the older trainer kept at most {CHECKPOINTS_KEPT}")
    carry("logging.wandb_project", "logging.wandb_project", str)
    carry("data.max_length", "data.max_length")
    out.put("data.num_workers", None, "min(8, CPUs // GPUs per node); see the audit")
    out.put("data.bucket_batches", 32, "batches of similar lengths from pools of 32: less padding computed")
    out.put("perf.activation_checkpointing", "auto", "the least checkpointing under which the micro-batch fits")
    out.put(
        "distributed.timeout_minutes",
        float(COLLECTIVE_TIMEOUT_MINUTES),
        "the older trainer's collective timeout (hard-coded); see the audit",
    )
    if "data.token_dir" in old:  # imported latents: the encoder that made them is unknown to re-encode with
        out.put("eval.encoder", False, "the imported latents' sentence encoder is not known here")
    for key, option in (
        ("data.token_dir", "--legacy-tokens"),
        ("data.latent_dir", "--legacy-latents"),
        ("data.tokenizer_name", "--tokenizer"),
        ("data.tokenizer_path", "--tokenizer"),
    ):
        if old.get(key) is not None:
            out.prepare[option] = old[key]
    if run.samples_read is not None:
        out.prepare["--legacy-order"] = "scan"
        out.prepare["--max-samples"] = run.samples_read
    out.prepare["--val-fraction"] = 0


def _name_the_rest(old: dict, out: Translation) -> None:
    for key, value in old.items():
        where = OLDER_KEYS.get(key)
        if key in out.refused:
            continue
        if where is None:
            out.unread.append(f"{setting(key, value)}: unknown key; not read")
        elif where.startswith(NOT_CARRIED):
            out.dropped.append(f"{setting(key, value)}: {where[len(NOT_CARRIED) :]}")
        else:
            out.carried.append(f"{setting(key, value)} -> {where}")


# --------------------------------------------------------------------------------------------------
# Writing our config.


def setting(key: str, value: Any) -> str:
    """An older key and its value as a user reads them: `key=value` as YAML writes the value, or `key empty`."""
    return f"{key}={yaml_value(value)}" if value != "" else f"{key} empty"


def yaml_value(value: Any) -> str:
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
        sections.setdefault(section, []).append(f"  {name}: {yaml_value(value)}{comment}")
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
