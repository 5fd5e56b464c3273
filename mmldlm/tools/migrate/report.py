"""What `migrate` prints and writes beside the config, read from the `Migration` (migration.py owns it).
The output fits a console of 100 columns: it leads with one table, the older run as it really trained on
this cluster against what we write, then the ERRORs in full, then one line per kind of WARNING, the
verdict and the next command lines; each finding's why and fix, the per-key lists, the environment's
review and what bash did besides the torchrun call go to OUT.migrate.txt (printed instead with
--verbose). `folder_table` is the one table of a folder of launchers."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

from mmldlm.outputs import write_atomically
from mmldlm.tools.check import SEVERITY_ORDER, describe, estimate, format_finding
from mmldlm.tools.migrate.mapping import config_text, yaml_value
from mmldlm.tools.migrate.migration import HEADER, Migration
from mmldlm.tools.migrate.older_trainer import HEADS
from mmldlm.wording import counted

WIDTH = 100  # columns of the console the output fits
# Findings the table shows (its rows say what was never read or applied): in the details file only.
IN_THE_TABLE = ("older_length", "older_accumulation", "older_betas", "older_heads", "older_samples")
# What bash did besides the torchrun call, by record kind, as the details file names it.
SHELL_RECORDS = {
    "cmd": "recorded, not run",
    "redirect": "output redirected to the scratch folder instead of",
    "tty": "input from the terminal read from /dev/null instead:",
    "refused": "refused (a pure tool asked to do more)",
    "skipped": "builtin skipped",
    "missing-source": "sourced file not here, skipped",
    "missing-cd": "folder not here, followed by name",
    "assumed-test": "file test of a path not here, answered as if it were",
    "missing-test": "[[ ]] file test answered by this machine",
    "read-prompt": "read answered with Enter:",
    "python-failed": "python failed:",
}
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
    "DDP finding unused parameters (a walk of the graph every step): off, the idle head anchored into the loss instead",
    "NaN guards replaced the loss by a constant with no gradient: a non-finite step is skipped and counted "
    "(train.max_consecutive_skips)",
    "only the first files read, train and validation overlapping: prepare imports what you ask, the splits "
    "are disjoint",
    "checkpoints without config, broken resume, log truncated at start, no grad norm logged: each run dir holds "
    "its config, --resume auto restores everything, metrics.jsonl is appended, grad norm is logged",
    "the t2l sampler gave NaN at t = 1 and mixed up eps and x0: alpha(1) is floored (latent_diffusion.min_alpha)",
    "the monitor parsed lines the trainer never printed: `mmldlm monitor` reads metrics.jsonl",
)


def _shown(path: Path) -> Path:
    """`path` relative to the current folder where it lies beneath it (the older repository's root)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def _n(value) -> str:
    """A value as both columns of the table show it: integers with thousands separators, floats to 3
    significant digits, the rest as YAML writes it."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, list, dict)):
        return yaml_value(value) if value != "" else "empty"
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


def one_line(text: str, width: int = WIDTH) -> str:
    """`text` cut at a word to fit `width` columns, marked where it was cut."""
    return text if len(text) <= width else textwrap.shorten(text, width, placeholder=" ...")


# --------------------------------------------------------------------------------------------------
# The table.


def table_rows(m: Migration) -> list[tuple[str, str, str]]:
    """(setting, the older run, what we write) for the table the output leads with."""
    run, old, cfg, meant = m.run, m.run.values, m.written, m.meant
    t, s = cfg.train, cfg.schedule

    def older(key: str, text: str | None = None) -> str:
        value = text if text is not None else _n(old.get(key, "-"))
        return value + (f" (meant {_n(meant[key])})" if key in meant else "")

    if run.steps is None:
        steps = "not known (no training.num_epochs)"
    else:
        steps = f"{_n(run.steps)} ({counted(run.epochs, 'epoch')} of {_n(run.steps_per_epoch)})"
    given = old.get("training.gradient_accumulation_steps", 1)
    lr = _n(run.lr) if run.lr is not None else "fails: empty"
    heads = f"{HEADS}" + (f" (n_heads {old['model.n_heads']} never read)" if "model.n_heads" in old else "")
    weights = f"{_n(old.get('loss.text_loss_weight', '-'))} / {_n(old.get('loss.latent_loss_weight', '-'))}"
    o, ck = cfg.objective, cfg.checkpoint
    samples = "all" if run.samples_read is None else f"first {_n(run.samples_read)} in folder order"
    return [
        ("steps (epochs)", older("training.num_epochs", steps), _n(t.steps)),
        (
            "micro / global batch",
            f"{run.micro_batch} / {_n(run.global_batch)}",
            f"{t.micro_batch_size} / {_n(t.global_batch_size)}",
        ),
        ("accumulation", f"1 ({given} given, never applied)" if given != 1 else "1", str(_accumulation(m))),
        ("LR", older("optimizer.lr", lr), _n(cfg.optim.lr)),
        ("warmup", older("training.warmup_steps", _n(run.warmup)), _n(s.warmup_steps)),
        ("LR schedule", _older_schedule(m), _schedule_words(m)),
        ("betas", f"{_n(run.betas)} (optimizer.betas)", _n(cfg.optim.betas)),
        ("heads", heads, str(cfg.model.num_heads)),
        ("sequence length", older("model.max_seq_len"), _n(cfg.model.max_seq_len)),
        ("latent width", older("model.latent_dim"), _n(cfg.model.latent_dim)),
        ("mode", older("loss.loss_type"), o.mode),
        ("text / latent weight", weights, f"{_n(o.text_loss_weight)} / {_n(o.latent_loss_weight)}"),
        (
            "samples (pairs)",
            samples,
            f"the same {_n(m.translation.prepare.get('--max-samples', 'all'))} (prepare line)",
        ),
        ("validation", "overlapped training", "none held out, no evaluation"),
        (
            "precision",
            f"{old.get('training.dtype', '-')} weights, no fp32 master copy",
            f"{t.precision} autocast, fp32 master",
        ),
        (
            "checkpoints",
            f"every {_n(old.get('logging.save_freq', '-'))} steps, one latest folder",
            f"every {_n(ck.every)} steps or {ck.every_minutes:g} min, keep {ck.keep_last}",
        ),
    ]


def _accumulation(m: Migration) -> int:
    t = m.written.train
    return t.global_batch_size // (t.micro_batch_size * m.cluster.world_size)


def _older_schedule(m: Migration) -> str:
    run = m.run
    kind = run.values.get("training.lr_schedule", "cosine")
    if kind != "cosine" or run.schedule_steps is None:
        return str(kind)
    end = f": {run.lr_at_end:.2f}x at end" if run.lr_at_end is not None else ""
    return f"cosine to 0 over {_n(run.schedule_steps)}{end}"


def _schedule_words(m: Migration) -> str:
    s, steps = m.written.schedule, m.written.train.steps
    if s.kind == "constant":
        return "constant"
    floor = f"{s.min_lr_ratio:g}x" if s.min_lr_ratio else "0"
    return f"{s.kind.removeprefix('warmup_')} to {floor} over {_n(s.num_steps or steps)}"


def format_table(rows: list[tuple[str, str, str]], heading: tuple[str, str, str], width: int = WIDTH) -> list[str]:
    """Three columns in `width`: the labels whole, the two value columns wrapped where they must be."""
    label = max(len(r[0]) for r in [heading, *rows])
    room = width - label - 4
    longest = [max(len(r[i]) for r in [heading, *rows]) for i in (1, 2)]
    first = min(longest[0], max(room - longest[1], room // 2))
    lines = []
    for a, b, c in [heading, *rows]:
        left, right = textwrap.wrap(b, first) or [""], textwrap.wrap(c, room - first) or [""]
        for i in range(max(len(left), len(right))):
            cells = (a if i == 0 else "", left[i] if i < len(left) else "", right[i] if i < len(right) else "")
            lines.append(f"{cells[0]:<{label}}  {cells[1]:<{first}}  {cells[2]}".rstrip())
    return lines


def _table(m: Migration) -> list[str]:
    if m.never_started is None:
        return format_table(table_rows(m), ("", "the older run trained with", "written"))
    said = f"the older run never started: {m.never_started}; the table shows the run its launcher meant"
    return [*textwrap.wrap(said, WIDTH), *format_table(table_rows(m), ("", "the launcher meant", "written"))]


# --------------------------------------------------------------------------------------------------
# The console.


def _heading(m: Migration) -> list[str]:
    reading = m.reading
    source = f"{reading.call.where} ({_shown(m.config.path)})" if reading else str(_shown(m.config.path))
    text = f"migrate: {source} -> {_shown(m.out)}, for {m.cluster.words()}"
    lines = textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    if reading is not None and reading.convention != "none":
        text = f"the launcher's branch for this cluster, read with the scheduler's variables: {reading.convention}"
        lines += textwrap.wrap(text, WIDTH, subsequent_indent="  ")
    return lines


def _finding_lines(m: Migration) -> list[str]:
    """Each ERROR in full; one line per rule of the WARNINGs the table does not show (the first, and how
    many more)."""
    lines = []
    for f in m.findings:
        if f.severity == "error":
            lines += textwrap.wrap(f"ERROR   [{f.rule}] {f.message}", WIDTH, subsequent_indent=" " * 8)
    warnings: dict[str, list] = {}
    for f in m.findings:
        if f.severity == "warning" and f.rule not in IN_THE_TABLE:
            warnings.setdefault(f.rule, []).append(f)
    for rule, found in warnings.items():
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        text = f"WARNING [{rule}] {found[0].message}"
        lines.append(one_line(text, WIDTH - len(more)) + more)
    return lines


def _verdict_lines(m: Migration) -> list[str]:
    serious = [f for f in m.remaining if f.severity in ("error", "warning")]
    verdict = "clean" if not serious else "; ".join(f"{f.severity} [{f.rule}]" for f in serious)
    return [
        one_line(f"`mmldlm check` on {_shown(m.out)} for this cluster: {verdict}"),
        *textwrap.wrap(
            f"why and fix of each finding, every older key, what bash did: {_shown(m.details_path)}",
            WIDTH,
            subsequent_indent="  ",
            break_on_hyphens=False,
        ),
    ]


def summary(m: Migration) -> str:
    """The command's output: one screen of 100 columns."""
    lines = [*_heading(m), "", *_table(m), "", *_finding_lines(m), *_verdict_lines(m), "next:"]
    lines += [f"  {line}" for line in next_commands(m)]
    lines += [one_line(f"suggested, not written: {line}") for line in m.translation.suggestions]
    return "\n".join(lines)


def not_ready_line(m: Migration) -> str:
    """The one line on stderr of a migration that exits 1: which errors (printed above in full)."""
    rules = ", ".join(dict.fromkeys(f.rule for f in m.errors)) or "an override of the call not read"
    errors = counted(len(m.errors), "error") if m.errors else "not ready"
    return f"mmldlm migrate: {_shown(m.out)}: NOT READY, {errors} ({rules})"


def next_commands(m: Migration) -> list[str]:
    """The prepare line and what it takes, the check line and the launch line, wrapped as bash reads them."""
    prepare, cluster, out = m.translation.prepare, m.cluster, _shown(m.out)
    words = ["mmldlm", "prepare"]
    for option, placeholder in (
        ("--legacy-tokens", "TOKENS_DIR"),
        ("--legacy-latents", "LATENTS_DIR"),
        ("--tokenizer", "TOKENIZER"),
    ):
        words += [option, str(prepare.get(option, placeholder))]
    for option in ("--legacy-order", "--max-samples", "--val-fraction"):
        if option in prepare:
            words += [option, str(prepare[option])]
    words += ["--out", m.translation.values["data.path"][0]]
    lines = _wrapped(words)
    taken = "the pairs" if "--max-samples" not in prepare else f"the first {_n(prepare['--max-samples'])} pairs"
    lines += textwrap.wrap(
        f"{taken} in the folder's own order, as the older loader read them (others on a copy); all of "
        "them train: the older validation overlapped training, none is held out",
        WIDTH - 2,
        initial_indent="# ",
        subsequent_indent="# ",
    )
    check = ["mmldlm", "check", str(out), "--nnodes", str(cluster.nnodes), "--nproc-per-node"]
    check += [str(cluster.gpus_per_node), "--device-memory-gib", f"{cluster.gpu_memory_gib:.1f}"]
    return lines + _wrapped(check) + _launch_lines(m)


def _launch_lines(m: Migration) -> list[str]:
    cluster, out = m.cluster, str(_shown(m.out))
    env = [f"{name}={shlex.quote(value)}" for name, value in m.launch_environment.items()]
    if cluster.world_size == 1:
        return _wrapped([*env, "mmldlm", "train", "--config", out])
    if cluster.nnodes == 1:
        return _wrapped([*env, f"NPROC_PER_NODE={cluster.gpus_per_node}", "scripts/launch.sh", "--config", out])
    call = m.reading.call if m.reading else None
    addr = (call.master_addr if call and call.master_addr else None) or "NODE0_ADDRESS"
    port = (call.master_port if call and call.master_port else None) or 29500
    nodes = [f"NNODES={cluster.nnodes}", f"NPROC_PER_NODE={cluster.gpus_per_node}", "NODE_RANK=0"]
    words = [*env, *nodes, f"MASTER_ADDR={addr}", f"MASTER_PORT={port}", "scripts/launch.sh", "--config", out]
    others = "1" if cluster.nnodes == 2 else f"1..{cluster.nnodes - 1}"
    where = "node" if cluster.nnodes == 2 else "nodes"
    lines = _wrapped(words)
    comment = f"  # on node 0; NODE_RANK={others} on the other {where}"
    return lines[:-1] + [lines[-1] + comment] if len(lines[-1] + comment) <= WIDTH - 2 else [*lines, comment.strip()]


def _wrapped(words: list[str]) -> list[str]:
    """A command line in lines of the console's width, continued with a backslash as bash reads them."""
    lines, line = [], ""
    for word in (shlex.quote(w) if "=" not in w else w for w in words):
        if line and len(line) + len(word) + 3 > WIDTH - 2:
            lines.append(line + " \\")
            line = "    " + word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]


# --------------------------------------------------------------------------------------------------
# The files.


def header_lines(m: Migration) -> list[str]:
    reading = m.reading
    lines = []
    if m.why_not_ready is not None:
        lines.append(f"NOT READY: mmldlm migrate exited 1: {m.why_not_ready}")
    lines += [
        f"{HEADER} {_shown(m.config.path)}" + (f" and {reading.path}" if reading else ""),
        f"for {m.cluster.words()}; each key's comment names the older setting it comes from.",
        f"What the older run really trained with, and why each value was chosen: {_shown(m.details_path)}",
    ]
    return lines


def write_files(m: Migration) -> None:
    """The config (marked where the exit status is not 0) and the details file, each whole or not at all."""
    m.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(m.out, config_text(m.translation, header_lines(m)))
    write_atomically(m.details_path, details_text(m))


def details_text(m: Migration) -> str:
    t, env = m.translation, m.cluster.environment()
    sections = [*_heading(m), "", *_table(m), "", "findings (why, fix):"]
    sections += [format_finding(f) for f in m.findings]
    sections += ["", f"`mmldlm check` on {_shown(m.out)} for this cluster:"]
    sections += [format_finding(f) for f in m.remaining if f.severity != "info"] or ["  clean"]
    sections += [describe(env, estimate(m.sized, env), m.sized)]
    sections += ["", "next:", *(f"  {line}" for line in next_commands(m))]
    sections += ["", "suggested, not written:", *(f"  {line}" for line in t.suggestions or ["nothing"])]
    sections += ["", "carried over (older key -> ours):", *(f"  {line}" for line in t.carried)]
    sections += ["", "not carried over:", *(f"  {line}" for line in t.dropped)]
    sections += ["", "not read:", *(f"  {line}" for line in t.unread + m.notes)]
    sections += ["", "the launcher's environment for the trainer, reviewed:"]
    for r in m.reviews:
        sections.append(f"  {r.name}={r.value}: {r.action}" + (f" to {r.new}" if r.new else "") + f" ({r.why})")
    if m.reading is not None:
        sections += ["", *_shell_lines(m)]
    sections += ["", "what the older training code got wrong, which our trainer does right by construction:"]
    sections += [f"  - {line}" for line in FIXED_BY_CONSTRUCTION]
    return "\n".join(sections) + "\n"


def _shell_lines(m: Migration) -> list[str]:
    reading = m.reading
    run = reading.run
    stopped = f", stopped after {run.stopped}" if run.stopped else ""
    lines = [
        f"the launcher under bash ({run.write_guard}; bc: {run.bc}; exit status {run.status}{stopped}):",
        f"  torchrun call {reading.call.where}: {shlex.join(reading.call.record.words)}",
    ]
    for record in run.records:
        if record.kind in SHELL_RECORDS and record is not reading.call.record:
            lines.append(f"  {record.where}: {SHELL_RECORDS[record.kind]} {shlex.join(record.words)[:200]}")
    for record in run.of("bc"):
        said = f"prints {record.words[1]}" if record.words[1] else "prints nothing"
        errors = f"; on stderr: {record.words[2]}" if record.words[2] else ""
        lines.append(f"  {record.where}: bc reads `{record.words[0]}`, {said}{errors}")
    lines.append("  the launcher's last output:")
    lines += [f"    {line}" for line in run.output] or ["    nothing"]
    return lines


# --------------------------------------------------------------------------------------------------
# A folder of launchers.


def folder_table(rows: list[tuple[str, int, Migration | None, str | None]]) -> list[str]:
    """One line per launcher and node count: (launcher, nodes, its migration or None, why it could not be
    read), in 100 columns."""
    heading = ("launcher", "nodes", "steps", "batch", "mode", "verdict", "worst finding")
    cells = []
    for path, nodes, m, _ in rows:
        launcher = Path(path).name
        if m is None:
            cells.append((launcher, str(nodes), "-", "-", "-", "unreadable", "(below)"))
            continue
        t = m.written.train
        verdict = "never started" if m.never_started else ("NOT READY" if m.why_not_ready else "ready")
        found = sorted([*m.findings, *m.remaining], key=lambda f: SEVERITY_ORDER[f.severity])
        # an error where the verdict is not ready, else a warning
        worst_text = found[0].rule if found and found[0].severity != "info" else "-"
        batch = f"{t.micro_batch_size}/{_n(t.global_batch_size)}"
        cells.append((launcher, str(nodes), _n(t.steps), batch, m.written.objective.mode, verdict, worst_text))
    widths = [max(len(c[i]) for c in [heading, *cells]) for i in range(6)]
    room = WIDTH - sum(widths) - 12
    lines = ["  ".join(f"{c[i]:<{widths[i]}}" for i in range(6)) + "  " + c[6][:room] for c in [heading, *cells]]
    for path, nodes, _, unreadable in rows:  # why, in the one line migrate of that launcher alone prints
        if unreadable is not None:
            said = f"{Path(path).name} at {counted(nodes, 'node')}: {unreadable}"
            lines += textwrap.wrap(said, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    return lines
