"""`mmldlm monitor`: follow a run's RUN/metrics.jsonl (the structured records the trainer writes,
never its console text), show a compact status, raise the alerts of mmldlm/tools/health.py (and its
notes: what happened to the run with nothing wrong in it, such as a slowdown of a busy machine), write a
health report (JSON) and a plot of the curves (PNG).

Resumes. A resumed run rewrites metrics.jsonl (metrics.truncate_lines keeps the lines up to its
checkpoint, in a new file that replaces the old) and then trains the dropped steps again. The reader
notices the rewrite (new inode, a shorter file, or changed bytes before its read position) and
re-reads from the start; a step that is not after the previous record also counts as a resume. In
both cases the records from that step on are replaced and the detectors replay the history, so the
alerts always describe the run as the file now holds it. The first re-trained step is compared with
the record it replaced: a resume that does not repeat the interrupted run raises `resume_mismatch`.
A run stopped by a signal checkpoints at its last record (`stop_requested`), so its resume rewrites
nothing: a record after a stop is the resume.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mmldlm.outputs import write_atomically
from mmldlm.runs.files import current_run_config, is_run_dir
from mmldlm.tools.health import REMEDIES, Alert, HealthConfig, HealthTracker, finite, memory_of, status_of
from mmldlm.wording import counted

EXIT_HEALTHY, EXIT_WARNING, EXIT_CRITICAL = 0, 1, 2
STAT_KEYS = (
    "text_loss",
    "latent_loss",
    "accuracy",
    "lr",
    "grad_norm",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "data_wait_share",
    "mfu",
)


def metrics_path(target: str | Path) -> Path:
    """RUN_DIR or a metrics.jsonl path -> the metrics file."""
    target = Path(target)
    return target / "metrics.jsonl" if target.is_dir() or target.suffix != ".jsonl" else target


def total_steps(run_dir: Path) -> int | None:
    """train.steps of the run's resolved config (RUN/config.yaml, or the one its latest resume
    wrote), or None while there is none."""
    try:
        steps = yaml.safe_load(current_run_config(run_dir).read_text())["train"]["steps"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) else None


class MetricsReader:
    """Hands out the complete new lines of metrics.jsonl as records; `poll()` says when the file was
    rewritten, in which case the records returned are the whole file again. A complete line that is
    not a record is skipped and kept in `unreadable` as (line number, its start); a last line without
    its newline is still being written and waits for the next poll."""

    def __init__(self, path: Path):
        self.path = path
        self.unreadable: list[tuple[int, str]] = []  # in the file as it is now
        self.mtime: float | None = None
        self._inode: int | None = None
        self._offset = 0
        self._num_lines = 0  # complete lines read so far
        self._last_line = b""  # the last complete line read, to recognise the bytes before _offset

    @property
    def num_unreadable(self) -> int:
        return len(self.unreadable)

    def poll(self) -> tuple[bool, list[dict]]:
        """(rewritten, new records)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return False, []
        with f:
            st = os.fstat(f.fileno())
            self.mtime = st.st_mtime
            rewritten = self._inode is not None and (
                st.st_ino != self._inode or st.st_size < self._offset or not self._same_prefix(f)
            )
            if rewritten:
                self._offset, self._num_lines, self._last_line, self.unreadable = 0, 0, b"", []
            self._inode = st.st_ino
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        lines = data[:end].splitlines()
        self._offset += end
        if lines:
            self._last_line = lines[-1]
        records = []
        for number, line in enumerate(lines, start=self._num_lines + 1):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            elif line.strip():
                self.unreadable.append((number, line[:60].decode("utf-8", "replace")))
        self._num_lines += len(lines)
        return rewritten, records

    def _same_prefix(self, f) -> bool:
        if not self._last_line:
            return True
        start = self._offset - len(self._last_line) - 1
        f.seek(start)
        return f.read(len(self._last_line) + 1) == self._last_line + b"\n"


def is_evaluation(record: dict) -> bool:
    """A record of the in-training evaluation (`eval.every`): written after the training record of
    the same step, with `eval_*` keys and no loss. It is not a training step (nor a resume)."""
    return "loss" not in record and any(key.startswith("eval_") for key in record)


@dataclass
class RunHistory:
    """The records of a run in step order, with the detectors' view of them; evaluation records
    apart, in `evaluations`."""

    health: HealthConfig = field(default_factory=HealthConfig)
    records: list[dict] = field(default_factory=list)
    evaluations: list[dict] = field(default_factory=list)
    num_resumes: int = 0
    resume_alerts: list[Alert] = field(default_factory=list)

    def __post_init__(self):
        self.tracker = HealthTracker(self.health)
        self._replaced: dict[int, dict] = {}  # records dropped by the last resume, by step

    @property
    def alerts(self) -> list[Alert]:
        return sorted(self.tracker.alerts + self.resume_alerts, key=lambda a: a.step)

    @property
    def notes(self) -> list[Alert]:
        return self.tracker.notes

    def rewrite(self, records: list[dict]) -> None:
        """The file was rewritten: `records` is all of it."""
        self.evaluations = [r for r in records if is_evaluation(r)]
        records = [r for r in records if not is_evaluation(r)]
        old = self.records
        same = 0
        # Compared as JSON text: a NaN loss never equals itself as a float.
        while same < min(len(old), len(records)) and json.dumps(old[same]) == json.dumps(records[same]):
            same += 1
        self._restart(old[:same], old[same:])
        self.extend(records[same:])

    def extend(self, records: list[dict]) -> None:
        for record in records:
            if is_evaluation(record):
                # A resume evaluates a re-trained step again: the new figures replace the old ones.
                self.evaluations = [e for e in self.evaluations if e["step"] < record["step"]] + [record]
                self.tracker.evaluated()
                continue
            if self.records and record["step"] <= self.records[-1]["step"]:
                kept = [r for r in self.records if r["step"] < record["step"]]
                self._restart(kept, self.records[len(kept) :])
            elif self.records and self.records[-1].get("stop_requested"):
                self.num_resumes += 1  # stopped by a signal at its checkpoint, continued by a new process
            self._compare_with_replaced(record)
            self.records.append(record)
            self.tracker.observe(record)

    def _restart(self, kept: list[dict], dropped: list[dict]) -> None:
        if dropped:
            self.num_resumes += 1
            self._replaced = {r["step"]: r for r in dropped}
        self.records = []
        self.tracker = HealthTracker(self.health)
        evaluated = {e["step"] for e in self.evaluations}
        for record in kept:
            self.records.append(record)
            self.tracker.observe(record)
            if record["step"] in evaluated:  # written after the step's training record
                self.tracker.evaluated()
        if dropped:  # the records from here on come from the resumed process
            self.tracker.process_started()

    def _compare_with_replaced(self, record: dict) -> None:
        before = self._replaced.get(record["step"])
        if before is None:
            return
        self._replaced = {}  # only the first re-trained step: later ones may drift on non-deterministic kernels
        a, b = before.get("loss"), record.get("loss")
        if finite(a) and finite(b) and abs(a - b) > self.health.resume_tolerance * max(abs(a), 1e-12):
            self.resume_alerts.append(
                Alert(
                    "resume_mismatch",
                    "warning",
                    record["step"],
                    f"step {record['step']} trained again after a resume gave loss {b:.6g}, the interrupted run "
                    f"had {a:.6g} (relative difference {abs(a - b) / abs(a):.2g})",
                    REMEDIES["resume_mismatch"],
                )
            )

    def trailing(self, key: str, count: int = 20) -> float | None:
        values = [r[key] for r in self.records[-count:] if finite(r.get(key))]
        return statistics.median(values) if values else None


def exit_code(status: str, strict: bool) -> int:
    if status == "critical":
        return EXIT_CRITICAL
    return EXIT_WARNING if status == "warning" and strict else EXIT_HEALTHY


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def eta_seconds(history: RunHistory, total: int | None) -> float | None:
    step_time = history.trailing("step_time_s")
    if total is None or step_time is None or not history.records:
        return None
    return max(0, total - history.records[-1]["step"]) * step_time


def losses_per_mode(history: RunHistory) -> str:
    """'loss joint 7.411 (-3.1%), l2t 6.2 (-0.8%), t2l 1.41': each mode's last loss, with the trend of its
    rolling median where there are records enough (each mode has its own scale)."""
    last = {}
    for record in history.records:
        last[record.get("mode", "all")] = record.get("loss")
    parts = []
    for mode, loss in sorted(last.items()):
        trend = history.tracker.trend(mode)
        value = f"{loss:.4g}" if finite(loss) else str(loss)
        parts.append(f"{mode} {value}" + (f" ({trend:+.1%})" if trend is not None else ""))
    return "loss " + ", ".join(parts)


def status_line(history: RunHistory, total: int | None) -> str:
    """One line: step, loss and its trend per mode, lr, grad norm, throughput, memory, skipped steps, ETA."""
    if not history.records:
        return "waiting for the first record"
    r = history.records[-1]
    parts = [f"step {r['step']}" + (f"/{total} ({r['step'] / total:.0%})" if total else "")]
    parts.append(losses_per_mode(history))
    for key, fmt in (
        ("lr", "lr {:.3g}"),
        ("grad_norm", "gnorm {:.3g}"),
        ("samples_per_s", "{:.4g} samples/s"),
        ("tokens_per_s", "{:.4g} tok/s"),
        ("data_wait_share", "data wait {:.0%}"),
    ):
        if finite(r.get(key)):
            parts.append(fmt.format(r[key]))
    memory = memory_of(r)
    if memory is not None:
        parts.append(f"mem {memory:.2f} GiB")
    parts.append(f"skipped {r.get('num_skipped', 0)}")
    eta = eta_seconds(history, total)
    if eta is not None:
        parts.append(f"ETA {_duration(eta)}")
    return " | ".join(parts)


def format_alert(alert: Alert) -> str:
    """Two lines: the alert (or note) and its fix (for a note, what it means)."""
    then = "means" if alert.severity == "note" else "fix"
    return f"[{alert.severity.upper()}] step {alert.step} {alert.kind}: {alert.message}\n    {then}: {alert.remedy}"


def _stats(values: list) -> dict | None:
    values = [v for v in values if finite(v)]
    if not values:
        return None
    return {"last": values[-1], "min": min(values), "median": statistics.median(values), "max": max(values)}


def statistics_of(records: list[dict]) -> dict:
    """last / min / median / max of each metric; the loss per mode (each mode has its own scale)."""
    modes = sorted({r.get("mode", "all") for r in records})
    out = {"loss": {m: _stats([r.get("loss") for r in records if r.get("mode", "all") == m]) for m in modes}}
    for key in STAT_KEYS:
        stats = _stats([r.get(key) for r in records])
        if stats is not None:
            out[key] = stats
    memory = _stats([memory_of(r) for r in records])
    if memory is not None:
        out["memory_gib"] = memory
    out["mode_counts"] = {m: sum(r.get("mode", "all") == m for r in records) for m in modes}
    return out


# --------------------------------------------------------------------------------------------------
# The monitor: one poll at a time, or a loop.


class Monitor:
    def __init__(
        self,
        target: str | Path,
        health: HealthConfig | None = None,
        stall_seconds: float = 600.0,
        clock=time.monotonic,
        wall_clock=time.time,
    ):
        self.path = metrics_path(target)
        self.run_dir = self.path.parent
        self.reader = MetricsReader(self.path)
        self.history = RunHistory(health or HealthConfig())
        self.stall_seconds = stall_seconds
        self.total: int | None = None
        self.stall: Alert | None = None
        self._clock, self._wall_clock = clock, wall_clock
        self._last_change = clock()
        self._shown: set[tuple] = set()
        self._warned: set[tuple[int, str]] = set()

    @property
    def alerts(self) -> list[Alert]:
        return self.history.alerts + ([self.stall] if self.stall else [])

    @property
    def complete(self) -> bool:
        records = self.history.records
        return bool(records) and self.total is not None and records[-1]["step"] >= self.total

    @property
    def stopped_by_signal(self) -> bool:
        return bool(self.history.records) and bool(self.history.records[-1].get("stop_requested"))

    def poll(self) -> bool:
        """Read what is new; returns whether anything changed."""
        if self.total is None:
            self.total = total_steps(self.run_dir)
        rewritten, records = self.reader.poll()
        if rewritten:
            self.history.rewrite(records)
        else:
            self.history.extend(records)
        if rewritten or records:
            self._last_change = self._clock()
            self.stall = None
        return rewritten or bool(records)

    def check_stall(self, live: bool) -> Alert | None:
        """A run that is neither complete nor stopped by a signal and has written nothing for
        stall_seconds (live: since the last change seen; once: since the file's modification time)."""
        if self.complete or self.stopped_by_signal or self.stall is not None:
            return self.stall
        if live:
            idle = self._clock() - self._last_change
        elif self.reader.mtime is not None:
            idle = self._wall_clock() - self.reader.mtime
        else:
            return None
        if idle >= self.stall_seconds:
            last = self.history.records[-1]["step"] if self.history.records else 0
            where = f"after step {last}" + (f" of {self.total}" if self.total else "")
            self.stall = Alert(
                "stall",
                "critical",
                last,
                f"no new record in {self.path} for {idle:.0f} s {where} (--stall-seconds {self.stall_seconds:g})",
                REMEDIES["stall"],
            )
        return self.stall

    def new_alerts(self) -> list[Alert]:
        """Alerts and notes not handed out before (a replay after a resume does not repeat them)."""
        both = sorted(self.alerts + self.history.notes, key=lambda a: a.step)
        fresh = [a for a in both if (a.kind, a.step, a.message) not in self._shown]
        self._shown.update((a.kind, a.step, a.message) for a in fresh)
        return fresh

    def new_warnings(self) -> list[str]:
        """A warning for each unreadable line not warned about before (a re-read after a resume does
        not repeat them)."""
        fresh = [line for line in self.reader.unreadable if line not in self._warned]
        self._warned.update(fresh)
        return [
            f"{self.path}:{number}: skipped a line that is not a metrics record ({start!r}); expected a JSON "
            f"object with an integer 'step'"
            for number, start in fresh
        ]

    def report(self) -> dict:
        records = self.history.records
        alerts = self.alerts
        return {
            "status": status_of(alerts),
            "metrics_file": str(self.path),
            "first_step": records[0]["step"] if records else None,
            "last_step": records[-1]["step"] if records else None,
            "total_steps": self.total,
            "complete": self.complete,
            "stopped_by_signal": self.stopped_by_signal,
            "eta_s": eta_seconds(self.history, self.total),
            "num_records": len(records),
            "num_resumes": self.history.num_resumes,
            "num_evaluations": len(self.history.evaluations),
            "last_evaluation": self.history.evaluations[-1] if self.history.evaluations else None,
            "num_unreadable_lines": self.reader.num_unreadable,
            "num_skipped": records[-1].get("num_skipped", 0) if records else 0,
            "statistics": statistics_of(records),
            "alerts": [a.to_dict() for a in alerts],
            "notes": [a.to_dict() for a in self.history.notes],
            "alert_counts": {kind: sum(a.kind == kind for a in alerts) for kind in sorted({a.kind for a in alerts})},
        }


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def may_become_run(path: Path) -> bool:
    """A directory `mmldlm train` writes in (runs.files.is_run_dir), or an empty one: the trainer creates the
    run directory first, and a job script may make it before the trainer starts."""
    return is_run_dir(path) or (path.is_dir() and not any(path.iterdir()))


def follow(monitor: Monitor, interval: float = 2.0, once: bool = False, out=print, warn=_warn, sleep=time.sleep) -> str:
    """Poll until the run is complete, stopped by a signal, or stalled (or once); print the status
    line and each new alert (`out`), and each unreadable line of the file (`warn`). Returns the
    final status. Without a metrics file, only a directory that may become a run is waited for
    (`may_become_run`); any other path is a FileNotFoundError at once."""
    while True:
        changed = monitor.poll()
        if monitor.reader.mtime is None and (once or not may_become_run(monitor.run_dir)):
            raise FileNotFoundError(f"{monitor.path}: no metrics file (is this a run directory of `mmldlm train`?)")
        for warning in monitor.new_warnings():
            warn(warning)
        monitor.check_stall(live=not once)
        if changed or once:
            out(status_line(monitor.history, monitor.total))
        for alert in monitor.new_alerts():
            out(format_alert(alert))
        if once or monitor.complete or monitor.stopped_by_signal or monitor.stall is not None:
            break
        sleep(interval)
    status = status_of(monitor.alerts)
    ending = (
        "complete"
        if monitor.complete
        else "stopped by a signal (continue with --resume auto)"
        if monitor.stopped_by_signal
        else "stalled"
        if monitor.stall
        else "in progress"
    )
    notes = monitor.history.notes
    counts = ", ".join(
        [counted(len(monitor.alerts), "alert")]
        + ([counted(len(notes), "note")] if notes else [])
        + [counted(monitor.history.num_resumes, "resume")]
    )
    out(f"run {ending}; status: {status} ({counts})")
    return status


# --------------------------------------------------------------------------------------------------
# The plot.

PANELS = (
    ("loss", "loss"),
    ("text loss", "text_loss"),
    ("latent loss", "latent_loss"),
    ("learning rate", "lr"),
    ("grad norm", "grad_norm"),
    ("throughput (samples/s)", "samples_per_s"),
    ("memory (GiB)", None),
    ("step time / what its work predicts", "slowdown"),
)


ALERT_COLOURS = {"critical": "red", "warning": "orange", "note": "grey"}


def plot(
    records: list[dict], path: str | Path, alerts: list[Alert] = (), slowdowns: list[tuple[int, float]] = ()
) -> list[str]:
    """Curves against step into a PNG, one panel per metric, losses per mode (each mode its own
    scale); the steps of alerts and notes as vertical lines on the loss panel; the monitor's slowdowns (each step's
    time over its mode's step-cost line) under the samples/s they explain. Returns the panel titles."""
    import matplotlib  # here: only --plot needs it (a second to import), and the backend precedes pyplot

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    modes = sorted({r.get("mode", "all") for r in records})
    fig, axes = plt.subplots(4, 2, figsize=(12, 13), sharex=True)
    titles = []
    for ax, (title, key) in zip(axes.flat, PANELS):
        titles.append(title)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "slowdown":
            if slowdowns:
                ax.plot(*zip(*slowdowns), linewidth=1, color="C0")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            continue
        per_mode = key in ("loss", "text_loss", "latent_loss", "grad_norm")
        for mode in modes if per_mode else [None]:
            points = [
                (r["step"], memory_of(r) if key is None else r.get(key))
                for r in records
                if mode is None or r.get("mode", "all") == mode
            ]
            points = [(s, v if finite(v) else math.nan) for s, v in points if v is not None]
            if points:
                steps, values = zip(*points)
                color = f"C{modes.index(mode)}" if mode is not None else "C0"  # a mode keeps its colour
                ax.plot(steps, values, marker="." if len(points) < 50 else None, linewidth=1, label=mode, color=color)
        if key == "loss":
            for alert in alerts:
                ax.axvline(alert.step, color=ALERT_COLOURS[alert.severity], alpha=0.5)
                ax.annotate(
                    alert.kind,
                    (alert.step, 1),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize=7,
                    va="top",
                    ha="right",
                    color=ALERT_COLOURS[alert.severity],
                )
            for severity in sorted({alert.severity for alert in alerts}):  # one legend entry per severity
                label = "note" if severity == "note" else f"{severity} alert"
                ax.plot([], [], color=ALERT_COLOURS[severity], alpha=0.5, label=label)
        if per_mode and ax.lines:
            ax.legend(fontsize=8)
    for ax in axes[3]:  # the lowest panel of each column
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return titles


def write_report(report: dict, path: str | Path) -> None:
    write_atomically(Path(path), json.dumps(report, indent=1) + "\n")
