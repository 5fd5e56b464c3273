"""`migrate`: the whole command, from the older files to our config, its audit and the exit status. The
steps, each a module of this package: read the launcher as bash does (launcher.py), compose the config
it names as the older trainer does (older_config.py), model what the older trainer did with it
(older_trainer.py), map that to our config (mapping.py), audit both (audit.py), report (report.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmldlm.config import RunConfig, load_config
from mmldlm.data.tokenizer import load_tokenizer, vocab_size
from mmldlm.errors import UserError
from mmldlm.outputs import write_atomically
from mmldlm.tools.check import SEVERITY_ORDER, Finding, apply_changes, audit
from mmldlm.tools.migrate.audit import (
    EnvReview,
    config_findings,
    environment_findings,
    launcher_findings,
    trainer_environment,
    trainer_findings,
)
from mmldlm.tools.migrate.cluster import Cluster
from mmldlm.tools.migrate.launcher import LauncherReading, config_of, read_launcher
from mmldlm.tools.migrate.mapping import Translation, config_text, our_config, translate
from mmldlm.tools.migrate.older_config import Composed, OlderConfig, compose_older
from mmldlm.tools.migrate.older_trainer import OlderRun, older_run
from mmldlm.tools.migrate.report import details_text, header_lines


@dataclass
class Migration:
    """What `migrate` read, wrote and found; report.py prints it."""

    config: OlderConfig
    reading: LauncherReading | None
    cluster: Cluster
    out: Path
    composed: Composed  # the older config as the older trainer composed it
    meant: dict[str, Any]  # older key -> value the launcher meant, where bash lost or emptied it
    run: OlderRun
    translation: Translation
    findings: list[Finding]  # the audit of the older run, most severe first
    reviews: list[EnvReview]  # the launcher's environment, variable by variable
    written: RunConfig
    sized: RunConfig  # the written config with the older tokenizer's vocabulary, for the estimates
    remaining: list[Finding]  # `mmldlm check` on the written config for the cluster
    notes: list[str] = field(default_factory=list)
    why_not_ready: str | None = None  # None: the exit status is 0

    @property
    def details_path(self) -> Path:
        return self.out.with_name(self.out.name + ".migrate.txt")

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
    bc: str = "auto",
) -> Migration:
    reading = read_launcher(launcher_path, launcher_args or [], cluster, bc=bc) if launcher_path else None
    if config_path is not None:
        config = OlderConfig.at(config_path)
    elif reading is not None:
        path = config_of(reading.call)
        config = OlderConfig(path.parent, path.stem)
    else:
        raise UserError("give the older run's config (CONFIG) or its launcher (--launcher SCRIPT)")
    overrides = reading.call.overrides if reading else []
    composed = compose_older(config, overrides)
    meant = _meant_values(config, reading, composed)
    run = older_run(composed.values, cluster)
    translation = translate(run, meant)
    cfg = our_config(translation)
    sized = _with_vocab_of(cfg, translation.prepare.get("--tokenizer"))
    exports = trainer_environment(reading.exports) if reading else {}
    source = f"{reading.path} (exported)" if reading else "the environment"
    env = cluster.environment(exports, source)
    env_found, reviews = environment_findings(exports, source)
    findings = [
        *(launcher_findings(reading, cluster, composed.refused) if reading else []),
        *env_found,
        *trainer_findings(run, sized, cluster),
        *config_findings(sized, run.values, env),
    ]
    findings.sort(key=lambda f: SEVERITY_ORDER[f.severity])
    m = Migration(config, reading, cluster, out, composed, meant, run, translation, findings, reviews, cfg, sized, [])
    m.notes += run.notes
    return _write(m)


def _meant_values(config: OlderConfig, reading: LauncherReading | None, composed: Composed) -> dict[str, Any]:
    """Older key -> value the launcher meant where it differs from what the older run read: its overrides
    lost to a continuation, and values bc left empty."""
    if reading is None or not (reading.lost or reading.meant):
        return {}
    words = [w for w in reading.call.overrides if w.strip()]
    words = [
        f"{w.split('=', 1)[0]}={reading.meant[w.split('=', 1)[0]]}" if w.split("=", 1)[0] in reading.meant else w
        for w in words
    ]
    meant = compose_older(config, words + reading.lost_overrides).values
    return {k: v for k, v in meant.items() if composed.values.get(k) != v}


def _write(m: Migration) -> Migration:
    """The config (marked where the exit status will not be 0), the details file, and `mmldlm check` on
    the config as written; each file whole or not at all."""
    m.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(m.out, config_text(m.translation, header_lines(m)))
    written = load_config(m.out)
    m.remaining = audit(_with_vocab_of(written, m.translation.prepare.get("--tokenizer")), m.cluster.environment())[0]
    m.why_not_ready = _why_not_ready(m)
    if m.why_not_ready is not None:
        write_atomically(m.out, config_text(m.translation, header_lines(m)))
    write_atomically(m.details_path, details_text(m))
    return m


def _why_not_ready(m: Migration) -> str | None:
    # The older launcher's own errors: the run it describes is not the run it meant (the written config
    # had to choose). Errors of the older environment or config that the written config fixes do not count.
    errors = [f for f in m.findings if f.severity == "error" and f.rule.startswith("launcher_")]
    if errors:
        more = f" (and {len(errors) - 1} more error(s) of the launcher)" if len(errors) > 1 else ""
        return errors[0].message + more
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
