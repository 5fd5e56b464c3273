"""What `migrate` prints and writes beside the config. The output leads with one table, the older run as
it really trained on this cluster against what we write, then the ERRORs, then the WARNINGs, one line
each; the per-key lists, each finding's why and fix, the environment's review and what bash did besides
the torchrun call go to OUT.migrate.txt (printed too with --verbose)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from mmldlm.tools.check import describe, estimate, format_finding
from mmldlm.tools.migrate.audit import FIXED_BY_CONSTRUCTION
from mmldlm.tools.migrate.older_trainer import CHECKPOINTS_KEPT, HEADS

if TYPE_CHECKING:
    from mmldlm.tools.migrate.migration import Migration

# What bash did besides the torchrun call, by record kind, as the details file names it.
SHELL_RECORDS = {
    "cmd": "recorded, not run",
    "redirect": "output redirected to the scratch folder instead of",
    "refused": "refused (a pure tool asked to do more)",
    "skipped": "builtin skipped",
    "missing-source": "sourced file not here, skipped",
    "missing-cd": "folder not here, followed by name",
    "assumed-test": "file test of a path not here, answered as if it were",
    "missing-test": "[[ ]] file test answered by this machine",
    "read-prompt": "read -p answered with Enter",
    "python-failed": "python -c failed",
}


def _shown(path: Path) -> Path:
    """`path` relative to the current folder where it lies beneath it (the older repository's root)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def _n(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def table_rows(m: Migration) -> list[tuple[str, str, str]]:
    """(setting, the older run trained with, what we write) for the table the output leads with."""
    run, old, cfg, meant = m.run, m.run.values, m.written, m.meant
    t, s = cfg.train, cfg.schedule

    def older(key, text=None):
        value = text if text is not None else _n(old.get(key, "-"))
        return value + (f" (meant {meant[key]})" if key in meant else "")

    steps = (
        "not known (no training.num_epochs)"
        if run.steps is None
        else (f"{_n(run.steps)} ({run.epochs} x {_n(run.steps_per_epoch)} per epoch)")
    )
    accumulation = old.get("training.gradient_accumulation_steps", 1)
    lr = f"{run.lr:.3g}" if run.lr is not None else f"fails: optimizer.lr={old.get('optimizer.lr')!r}"
    lr += f" (meant {meant['optimizer.lr']})" if "optimizer.lr" in meant else ""
    schedule = f"{lr}, cosine over {_n(run.schedule_steps)}"
    heads = f"{HEADS}" + (f" (n_heads={old['model.n_heads']} never read)" if "model.n_heads" in old else "")
    weights = f"{old.get('loss.text_loss_weight', '-')} / {old.get('loss.latent_loss_weight', '-')}"
    checkpoints = f"every {_n(old.get('logging.save_freq', '-'))} steps into one latest (<= {CHECKPOINTS_KEPT})"
    ck = cfg.checkpoint
    return [
        ("steps (epochs)", older("training.num_epochs", steps), f"train.steps {t.steps}"),
        (
            "micro / global batch",
            f"{run.micro_batch} / {run.global_batch}",
            f"{t.micro_batch_size} / {t.global_batch_size}",
        ),
        (
            "accumulation",
            f"1 (gradient_accumulation_steps={accumulation} never applied)" if accumulation != 1 else "1",
            "1",
        ),
        ("LR, schedule length", schedule, f"{cfg.optim.lr:.3g}, {s.kind} over {t.steps}"),
        ("warmup", older("training.warmup_steps"), str(s.warmup_steps)),
        ("betas", f"{run.betas} (optimizer.betas)", str(cfg.optim.betas)),
        ("heads", heads, str(cfg.model.num_heads)),
        ("sequence length", older("model.max_seq_len"), str(cfg.model.max_seq_len)),
        ("latent width", older("model.latent_dim"), str(cfg.model.latent_dim)),
        ("mode", older("loss.loss_type"), cfg.objective.mode),
        (
            "loss weights text / latent",
            weights,
            f"{cfg.objective.text_loss_weight} / {cfg.objective.latent_loss_weight}",
        ),
        (
            "samples read",
            f"{_n(run.samples_read)} ({run.samples_why})",
            f"prepare --max-samples {m.translation.prepare.get('--max-samples', 'all')}",
        ),
        (
            "precision",
            f"{old.get('training.dtype', '-')} weights, no fp32 master copy",
            f"{t.precision} autocast, fp32 master",
        ),
        ("checkpoints", checkpoints, f"every {ck.every} steps or {ck.every_minutes:g} min, keep {ck.keep_last}"),
    ]


def format_table(rows: list[tuple[str, str, str]], heading: tuple[str, str, str]) -> list[str]:
    widths = [max(len(r[i]) for r in [heading, *rows]) for i in range(2)]
    return [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in [heading, *rows]]


def summary(m: Migration) -> str:
    """The command's output: fits a screen for a launcher with a dozen findings."""
    reading = m.reading
    lines = [f"migrate: {_shown(m.config.path)}" + (f" + {reading.path}" if reading else "")]
    lines[0] += f" for {m.cluster.words()}"
    if reading is not None:
        call = reading.call
        lines.append(
            f"torchrun call: {call.where} (--nnodes {call.nnodes} --nproc_per_node {call.nproc_per_node}; "
            f"scheduler variables: {reading.convention})"
        )
    lines.append("")
    lines += format_table(table_rows(m), ("", "the older run trained with", f"written to {m.out}"))
    lines.append("")
    for f in m.findings:
        if f.severity in ("error", "warning"):
            lines.append(f"{f.severity.upper():7s} [{f.rule}] {f.message}")
    serious = [f for f in m.remaining if f.severity in ("error", "warning")]
    verdict = "clean" if not serious else "; ".join(f"{f.severity} [{f.rule}]" for f in serious)
    lines.append(f"`mmldlm check` on {m.out} for this cluster: {verdict}")
    lines.append(f"details (every older key, why and fix of each finding, what bash did): {m.details_path}")
    lines.append("next:")
    lines += [f"  {line}" for line in next_commands(m)]
    return "\n".join(lines)


def header_lines(m: Migration) -> list[str]:
    reading = m.reading
    lines = []
    if m.why_not_ready is not None:
        lines.append(f"NOT READY: mmldlm migrate exited 1: {m.why_not_ready}")
    lines += [
        f"Imported by `mmldlm migrate` from {m.config.path}" + (f" and {reading.path}" if reading else ""),
        f"for {m.cluster.words()}; each key's comment names the older setting it comes from.",
        f"What the older run really trained with, and why each value was chosen: {m.details_path}",
    ]
    return lines


def details_text(m: Migration) -> str:
    t, reading = m.translation, m.reading
    env = m.cluster.environment()
    sections = [summary(m), "", describe(env, estimate(m.sized, env), m.sized)]
    sections += ["", "findings (why, fix):"] + [format_finding(f) for f in m.findings]
    sections += ["", f"`mmldlm check` on {m.out}:"] + [format_finding(f) for f in m.remaining if f.severity != "info"]
    sections += ["", "carried over (older key -> ours):"] + [f"  {line}" for line in t.carried]
    sections += ["", "not carried over:"] + [f"  {line}" for line in t.dropped]
    sections += ["", "not read:"] + [f"  {line}" for line in t.unread + m.notes]
    sections += ["", "the launcher's environment for the trainer, reviewed:"]
    sections += [
        f"  {r.name}={r.value}: {r.action}" + (f" to {r.new}" if r.new else "") + f" ({r.why})" for r in m.reviews
    ]
    if reading is not None:
        sections += ["", *_shell_lines(m)]
    sections += ["", "what the older training code got wrong, which our trainer does right by construction:"]
    sections += [f"  - {line}" for line in FIXED_BY_CONSTRUCTION]
    return "\n".join(sections) + "\n"


def _shell_lines(m: Migration) -> list[str]:
    reading = m.reading
    run = reading.run
    lines = [
        f"the launcher under bash ({run.write_guard}; bc: {run.bc_engine}; exit status {run.status}"
        + (f", stopped after {run.stopped}" if run.stopped else "")
        + "):",
        f"  torchrun call {reading.call.where}: {shlex.join(reading.call.record.words)}",
    ]
    for record in run.records:
        if record.kind in SHELL_RECORDS and record is not reading.call.record:
            lines.append(f"  {record.where}: {SHELL_RECORDS[record.kind]}: {shlex.join(record.words)[:200]}")
    for record in run.of("bc"):
        lines.append(f"  {record.where}: bc {record.words[0]!r} -> {record.words[1]!r} {record.words[2]!r}")
    lines.append("  its last output:")
    lines += [f"    {line}" for line in run.output]
    return lines


def next_commands(m: Migration) -> list[str]:
    prepare, cluster, out = m.translation.prepare, m.cluster, m.out
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
    words += ["--out", m.translation.values["data.path"][0]]
    check = (
        f"mmldlm check {out} --nnodes {cluster.nnodes} --nproc-per-node {cluster.gpus_per_node} "
        f"--device-memory-gib {cluster.gpu_memory_gib:.1f}"
    )
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in m.launch_environment.items())
    env = f"{env} " if env else ""
    if cluster.world_size == 1:
        train = f"{env}mmldlm train --config {out}"
    elif cluster.nnodes == 1:
        train = f"{env}NPROC_PER_NODE={cluster.gpus_per_node} scripts/launch.sh --config {out}"
    else:
        call = m.reading.call if m.reading else None
        addr = (call.master_addr if call and call.master_addr else None) or "NODE0_ADDRESS"
        port = (call.master_port if call and call.master_port else None) or 29500
        train = (
            f"{env}NNODES={cluster.nnodes} NPROC_PER_NODE={cluster.gpus_per_node} NODE_RANK=0 MASTER_ADDR={addr} "
            f"MASTER_PORT={port} scripts/launch.sh --config {out}"
        )
        others = "1" if cluster.nnodes == 2 else f"1..{cluster.nnodes - 1}"
        train += f"   # on node 0; NODE_RANK={others} on the other {'node' if cluster.nnodes == 2 else 'nodes'}"
    return [shlex.join(words), check, train]
