"""`migrate`: the whole command, from the older files to our config, its audit and the exit status. The
steps, each a module of this package: read the launcher as bash does (launcher.py), compose the config
it names as the older trainer does (older_config.py), model what the older trainer did with it
(older_trainer.py), map that to our config (mapping.py), audit both (audit.py). This module owns the
`Migration`; report.py reads it, prints it and writes its files."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmldlm.config import RunConfig
from mmldlm.data.tokenizer import load_tokenizer, vocab_size
from mmldlm.errors import UserError
from mmldlm.tools.check import SEVERITY_ORDER, Finding, apply_changes, audit
from mmldlm.tools.migrate.audit import (
    EnvReview,
    config_findings,
    environment_findings,
    launcher_findings,
    name_findings,
    older_finding,
    trainer_environment,
    trainer_findings,
)
from mmldlm.tools.migrate.cluster import Cluster
from mmldlm.tools.migrate.launcher import LauncherReading, config_of, read_launcher
from mmldlm.tools.migrate.mapping import Translation, our_config, translate
from mmldlm.tools.migrate.older_config import Composed, OlderConfig, compose_older
from mmldlm.tools.migrate.older_trainer import OlderRun, older_run
from mmldlm.wording import counted

HEADER = "Imported by `mmldlm migrate` from"  # the first line of a written config's own comment


@dataclass
class Migration:
    """What `migrate` read and found, and what it writes."""

    config: OlderConfig
    reading: LauncherReading | None
    cluster: Cluster
    out: Path
    composed: Composed  # the older config as the older trainer composed it
    meant: dict[str, Any]  # older key -> value the launcher meant, where bash emptied it
    run: OlderRun  # the older run; for one that never started, the run the launcher meant
    translation: Translation
    findings: list[Finding]  # the audit of the older run, most severe first
    reviews: list[EnvReview]  # the launcher's environment, variable by variable
    written: RunConfig
    sized: RunConfig  # the written config with the older tokenizer's vocabulary, for the estimates
    remaining: list[Finding] = field(default_factory=list)  # `mmldlm check` on the written config for the cluster
    never_started: str | None = None  # why the older run never started (Hydra refused its command line)
    notes: list[str] = field(default_factory=list)
    why_not_ready: str | None = None  # None: the exit status is 0

    @property
    def details_path(self) -> Path:
        return self.out.with_name(self.out.name + ".migrate.txt")

    @property
    def run_name(self) -> str:
        return self.written.train.run_dir.removeprefix("runs/")

    @property
    def owner(self) -> str:
        """Whose run `run_name` is: the launcher at this node count, or the config."""
        if self.reading is None:
            return str(self.config.path)
        return f"{self.reading.path} at {counted(self.cluster.nnodes, 'node')}"

    @property
    def errors(self) -> list[Finding]:
        return [f for f in [*self.findings, *self.remaining] if f.severity == "error"]

    @property
    def launch_environment(self) -> dict[str, str]:
        """The launcher's variables for the trainer that go in front of our launch line, as reviewed."""
        kept = {r.name: r.value for r in self.reviews if r.action == "kept"}
        kept.update({r.name: r.new for r in self.reviews if r.action == "changed"})
        return kept


def migrate(
    config_path: Path | None,
    launcher_path: Path | None,
    cluster: Cluster,
    out: Path,
    launcher_args: list[str] | None = None,
    config_dir: Path | None = None,
    taken: dict[str, str] | None = None,
) -> Migration:
    """The migration of one older run; `config_dir`: where the call's --config-name is (default: beside the
    trainer script); `taken`: run names already written (name -> whose), which this run does not share."""
    reading = read_launcher(launcher_path, launcher_args or [], cluster) if launcher_path else None
    if config_path is not None:
        config = OlderConfig.at(config_path)
    elif reading is not None:
        path = config_of(reading.call, config_dir)
        config = OlderConfig(path.parent, path.stem)
    else:
        raise UserError("give the older run's config (CONFIG) or its launcher (--launcher SCRIPT)")
    composed = compose_older(config, reading.call.overrides if reading else [])
    never_started = _never_started(composed)
    if never_started is None:
        meant = _meant_values(config, reading, composed)
        run = older_run(composed.values, cluster)
    else:  # nothing trained: the run is the one the launcher meant
        meant = {}
        run = older_run(compose_older(config, _meant_words(reading, composed)).values, cluster)
    findings, name = _shared_run(run, reading, cluster, taken or {})
    translation = translate(run, meant, name)
    cfg = our_config(translation)
    sized = _with_vocab_of(cfg, translation.prepare.get("--tokenizer"))
    exports = trainer_environment(reading.exports) if reading else {}
    source = f"{reading.path} (exported)" if reading else "the environment"
    env_found, reviews = environment_findings(exports, source)
    findings += [*(launcher_findings(reading, cluster, composed.refused) if reading else []), *env_found]
    if reading is not None:
        findings += name_findings(reading.path, run.values, run.mode)
    if never_started is None:  # what the older trainer did: nothing, where it never started
        findings += trainer_findings(run, sized, cluster)
    remaining = audit(sized, cluster.environment())[0]
    findings += config_findings(sized, run.values, cluster.environment(exports, source), remaining)
    for f in findings:
        if f.severity == "error" and not f.rule.startswith("launcher_"):
            # An ERROR is what makes the exit status 1: an error of the older run that the written
            # config does not carry asks nothing more of the user.
            f.severity = "warning"
    findings.sort(key=lambda f: SEVERITY_ORDER[f.severity])
    notes = run.notes + (
        ["the older trainer's behaviour is not audited: the run never started"] if never_started else []
    )
    m = Migration(config, reading, cluster, out, composed, meant, run, translation, findings, reviews, cfg, sized)
    m.remaining, m.never_started, m.notes = remaining, never_started, notes
    m.why_not_ready = _why_not_ready(m)
    return m


def _never_started(composed: Composed) -> str | None:
    """Why Hydra stopped the older trainer at start, where it did."""
    if not composed.refused:
        return None
    words = ", ".join(f"'{word}'" for word, _ in composed.refused)
    noun = "argument" if len(composed.refused) == 1 else "arguments"
    return f"Hydra refuses the {noun} {words}"


def _meant_words(reading: LauncherReading | None, composed: Composed) -> list[str]:
    """The override words the launcher meant: the call's that Hydra accepts, with the values bc left empty
    as the launcher meant them, and the overrides a comment after a continuation cut off."""
    if reading is None:
        return []
    refused = {word for word, _ in composed.refused}
    words = []
    for word in reading.call.overrides:
        key = word.split("=", 1)[0]
        if word not in refused:
            words.append(f"{key}={reading.meant[key]}" if key in reading.meant else word)
    return words + reading.lost_overrides


def _meant_values(config: OlderConfig, reading: LauncherReading | None, composed: Composed) -> dict[str, Any]:
    """Older key -> value the launcher meant where bc left it empty."""
    if reading is None or not reading.meant:
        return {}
    meant = compose_older(config, _meant_words(reading, composed)).values
    return {k: v for k, v in meant.items() if composed.values.get(k) != v}


def _shared_run(
    run: OlderRun, reading: LauncherReading | None, cluster: Cluster, taken: dict[str, str]
) -> tuple[list[Finding], str]:
    """Our run's name: the older run's, unless another migration wrote it (then one of its own), with a
    finding where another launcher's older run wrote the same folders."""
    name = str(run.values.get("logging.run_name", "imported"))
    if name not in taken:
        return [], name
    stem = reading.path.stem if reading else "config"
    same = reading is not None and taken[name].startswith(f"{reading.path} at ")
    candidates = [f"{name}-{cluster.nnodes}n"] if same else [f"{name}-{stem}", f"{name}-{stem}-{cluster.nnodes}n"]
    new = next((c for c in candidates if c not in taken), f"{candidates[-1]}-{len(taken)}")
    if same:  # the same launcher on another cluster: a run of its own, nothing the older one did wrong
        return [], new
    save_dir = run.values.get("logging.save_dir")
    values = dict(name=name, other=taken[name], new=new, save_dir=f" ({save_dir})" if save_dir else "")
    return [older_finding("shared_run", **values)], new


def names_taken_in(folder: Path, besides: Path) -> dict[str, str]:
    """Run names of the configs `migrate` wrote in `folder` (other than `besides`): name -> whose, as
    `Migration.owner` says it (read from the config's header: the launcher and the node count)."""
    taken = {}
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            text = path.read_text()
            header = re.search(rf"^# {re.escape(HEADER)} (\S+)(?: and (\S+))?\n# for (\d+) node", text, re.M)
            if path.resolve() == besides.resolve() or header is None:
                continue
            run_dir = yaml.safe_load(text)["train"]["run_dir"]
        except (OSError, KeyError, TypeError, yaml.YAMLError):
            continue
        config, launcher, nodes = header.groups()
        owner = f"{launcher} at {counted(int(nodes), 'node')}" if launcher else config
        taken[str(run_dir).removeprefix("runs/")] = owner
    return taken


def _why_not_ready(m: Migration) -> str | None:
    """The first error of the launcher or of `mmldlm check` on the written config, or an override of the
    call that was not read; None: ready (exit status 0)."""
    launcher = [f for f in m.findings if f.severity == "error"]
    if launcher:
        return launcher[0].message
    failing = [f for f in m.remaining if f.severity == "error"]
    if failing:
        return f"{m.out} does not pass `mmldlm check` for this cluster: [{failing[0].rule}] {failing[0].message}"
    if m.reading is not None:
        keys = {w.split("=", 1)[0].lstrip("+~") for w in m.reading.call.overrides if "=" in w}
        unread = [line for line in m.translation.unread if line.split("=", 1)[0] in keys]
        if unread:
            return f"an override of {m.reading.call.where} was not read: {unread[0]}"
    return None


def _with_vocab_of(cfg: RunConfig, tokenizer: Any) -> RunConfig:
    """`cfg` with model.vocab_size of the older tokenizer where it can be read here (the written config leaves
    it null: taken from the prepared dataset); else as it is."""
    try:
        size = vocab_size(load_tokenizer(str(tokenizer)))
    except (UserError, OSError):
        return cfg
    return apply_changes(cfg, {"model.vocab_size": size})
