"""`mmldlm monitor` on synthetic metrics files shaped like the trainer's records: each alert fires
at the right step and nothing else does, a healthy run raises none, resumes and partial lines are
read correctly, a stalled file raises the stall alert, the report, the plot and the exit codes."""

import json
import math
import os
import random
import re

import pytest

from mmldlm import cli
from mmldlm.errors import OptionError
from mmldlm.tools import faults
from mmldlm.tools.health import Alert, HealthConfig
from mmldlm.tools.monitor import PANELS, Monitor, RunHistory, follow, plot

MODE_SCALE = {"l2t": 5.0, "t2l": 1.0, "joint": 6.0}  # each mode its own loss scale, as in a real run
MODE_SPEED = {"l2t": 80.0, "t2l": 120.0, "joint": 70.0}


def make_records(n=240, modes=("l2t",), seed=0) -> list[dict]:
    """A healthy run: power-law loss decay with 1% noise, steady grad norm, throughput and data wait,
    memory that steps up once (a one-off jump is not a creep)."""
    rng = random.Random(seed)
    records = []
    for step in range(1, n + 1):
        mode = modes[step % len(modes)]
        loss = MODE_SCALE[mode] * (step + 10) ** -0.3 * (1 + 0.01 * rng.gauss(0, 1))
        text = loss if mode == "l2t" else 0.8 * loss if mode == "joint" else None
        latent = loss if mode == "t2l" else 0.2 * loss if mode == "joint" else None
        speed = MODE_SPEED[mode] * (1 + 0.03 * rng.gauss(0, 1))
        records.append(
            {
                "step": step,
                "mode": mode,
                "loss": loss,
                "text_loss": text,
                "latent_loss": latent,
                "accuracy": 0.5,
                "lr": 1e-3,
                "grad_norm": 0.2 * MODE_SCALE[mode] * (1 + 0.05 * rng.gauss(0, 1)),
                "micro_batch_size": 16,
                "global_batch_size": 32,
                "accumulation_steps": 2,
                "samples_per_s": speed,
                "tokens_per_s": 30 * speed,
                "step_time_s": 32 / speed,
                "data_wait_share": 0.02 * (1 + 0.1 * rng.gauss(0, 1)),
                "skipped": False,
                "num_skipped": 0,
                "stop_requested": False,
                "mem_rss_gib": (1.0 if step < 100 else 1.2) + 0.001 * rng.gauss(0, 1),
            }
        )
    return records


def write_run(run_dir, records, total=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"train:\n  steps: {total or records[-1]['step']}\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def analyse(run_dir, **kwargs) -> Monitor:
    monitor = Monitor(run_dir, **kwargs)
    follow(monitor, once=True, out=lambda _line: None)
    return monitor


def kinds_and_steps(monitor):
    return [(a.kind, a.step) for a in monitor.alerts]


@pytest.mark.parametrize("modes", [("l2t",), ("l2t", "t2l", "joint")])
def test_healthy_run_raises_no_alert(tmp_path, modes):
    monitor = analyse(write_run(tmp_path, make_records(300, modes)))
    assert monitor.alerts == []
    report = monitor.report()
    assert report["status"] == "healthy" and report["complete"] and report["num_records"] == 300
    assert set(report["statistics"]["loss"]) == set(modes)


def _scale(key, factor, start, end=None):
    def edit(records):
        for r in records[start - 1 : end]:
            r[key] *= factor

    return edit


def _nonfinite(records):
    records[149].update(loss=math.nan, text_loss=math.nan, grad_norm=math.inf, skipped=True)
    for r in records[149:]:
        r["num_skipped"] = 1


def _unlogged_skips(records):
    for r in records[149:]:
        r["num_skipped"] = 2


def _divergence(records):  # from step 150 the loss grows 0.4% per record (1% noise): a trend, not a spike
    rng = random.Random(1)
    for i, r in enumerate(records[149:]):
        r["loss"] = records[148]["loss"] * 1.004 ** (i + 1) * (1 + 0.01 * rng.gauss(0, 1))


def _plateau(records):  # flat (1% noise) from step 100 while the LR stays at its peak
    rng = random.Random(1)
    for r in records[99:]:
        r["loss"] = records[98]["loss"] * (1 + 0.01 * rng.gauss(0, 1))


def _slowdown(records):  # a second busy process from step 150 on: samples/s halved
    records[:] = faults.slowdown(records, 150, 1000, drop=0.5)


def _loader_stall(records):  # from step 150 each step waits 0.2 s more for its batch
    records[:] = faults.loader_stall(records, 150, 1000, seconds=0.2)


def _memory_creep(records):
    for i, r in enumerate(records[149:]):
        r["mem_rss_gib"] += 0.01 * i


def _recompiles(records):  # compiled once at the start, then one more graph per record from step 150
    for i, r in enumerate(records):
        r["compiled_graphs"] = 4 + max(0, i - 148)


@pytest.mark.parametrize(
    "edit,kind,first,last",
    [
        pytest.param(*case, id=case[1])
        for case in [
            (_nonfinite, "nonfinite", 150, 150),
            (_unlogged_skips, "skipped_updates", 150, 150),
            (_scale("loss", 3.0, 150, 150), "loss_spike", 150, 150),
            (_divergence, "divergence", 151, 240),
            (_plateau, "plateau", 150, 165),
            (_scale("grad_norm", 50.0, 150, 150), "grad_explosion", 150, 150),
            (_scale("grad_norm", 1e10, 150, 150), "grad_spike", 150, 150),
            (_scale("grad_norm", 1e10, 1, 1), "grad_spike", 1, 1),  # judged once the 3rd record shows the level
            (_slowdown, "throughput_drop", 152, 152),  # the 3rd slow record tips the median of 5
            (_loader_stall, "data_wait", 152, 152),
            (_memory_creep, "memory_creep", 151, 180),
            (_recompiles, "recompiles", 158, 158),  # the 9th new graph
        ]
    ],
)
def test_each_alert_fires_at_its_step_and_nothing_else(tmp_path, edit, kind, first, last):
    records = make_records()
    edit(records)
    monitor = analyse(write_run(tmp_path, records))
    assert [a.kind for a in monitor.alerts] == [kind], kinds_and_steps(monitor)
    assert first <= monitor.alerts[0].step <= last, kinds_and_steps(monitor)
    severity = "critical" if kind in ("nonfinite", "skipped_updates") else "warning"
    assert monitor.alerts[0].severity == severity and monitor.report()["status"] == severity
    assert "." in monitor.alerts[0].remedy  # names a config switch such as optim.lr


def test_throughput_drop_names_busy_shared_cores_as_a_likely_cause(tmp_path):
    records = make_records()
    _slowdown(records)
    (alert,) = analyse(write_run(tmp_path, records)).alerts
    assert "a second busy process on the same cores makes torch's threads wait for each other" in alert.message
    assert "train.threads" in alert.message and "train.threads=1" in alert.remedy


def test_a_gradient_norm_ten_orders_above_the_next_on_a_modes_first_step_is_an_alert(tmp_path):
    # A 12-step random-mode run whose first l2t step had a gradient norm of 1.4e11 (the vocabulary
    # prior's cosine at a zero null latent), and about 200-450 on the l2t steps after it.
    modes = ["t2l", "t2l", "l2t", "t2l", "l2t", "joint", "t2l", "l2t", "t2l", "l2t", "t2l", "joint"]
    records = make_records(12, ("l2t", "t2l", "joint"))
    for record, mode in zip(records, modes):
        record["mode"] = mode
        record["grad_norm"] = {"t2l": 0.18, "joint": 30.0}.get(mode)
    for step, grad_norm in zip((3, 5, 8, 10), (1.36e11, 444.0, 202.0, 236.0)):
        records[step - 1]["grad_norm"] = grad_norm
    monitor = analyse(write_run(tmp_path, records))
    assert kinds_and_steps(monitor) == [("grad_spike", 3)]
    assert "1.36e+11 in mode l2t" in monitor.alerts[0].message
    assert "optim.grad_clip" in monitor.alerts[0].remedy and monitor.report()["status"] == "warning"


def test_spike_is_judged_within_its_mode(tmp_path):
    # In a random-mode run a t2l loss of 2.5 is far below the l2t and joint losses, yet 2.5x its own level.
    records = make_records(300, ("l2t", "t2l", "joint"))
    spike = next(r for r in records[150:] if r["mode"] == "t2l")
    spike["loss"] *= 2.5
    monitor = analyse(write_run(tmp_path, records))
    assert kinds_and_steps(monitor) == [("loss_spike", spike["step"])]
    assert "t2l" in monitor.alerts[0].message


def test_stalled_file_raises_the_stall_alert(tmp_path):
    run = write_run(tmp_path / "stalled", make_records(50), total=100)
    os.utime(run / "metrics.jsonl", (0, os.path.getmtime(run / "metrics.jsonl") - 3600))
    monitor = analyse(run, stall_seconds=600)
    assert kinds_and_steps(monitor) == [("stall", 50)] and monitor.alerts[0].severity == "critical"
    # A complete run is not stalled however old its file, and a fresh one not yet.
    done = write_run(tmp_path / "done", make_records(50))
    os.utime(done / "metrics.jsonl", (0, 0))
    assert analyse(done, stall_seconds=600).alerts == []
    assert analyse(write_run(tmp_path / "fresh", make_records(50), total=100), stall_seconds=600).alerts == []


def test_live_stall_counts_from_the_last_new_record(tmp_path):
    run = write_run(tmp_path, make_records(20), total=100)
    now = [1000.0]
    monitor = Monitor(run, stall_seconds=30, clock=lambda: now[0])
    assert monitor.poll()
    now[0] += 29
    assert monitor.check_stall(live=True) is None
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**make_records(21)[-1]}) + "\n")
    now[0] += 20
    assert monitor.poll() and monitor.check_stall(live=True) is None
    now[0] += 29  # 49 s since the first poll, 29 s since the new record
    assert monitor.check_stall(live=True) is None
    now[0] += 1
    assert monitor.check_stall(live=True).step == 21


def test_resume_that_rewrites_the_file_replaces_the_dropped_steps(tmp_path):
    records = make_records(40)
    run = write_run(tmp_path, records[:8], total=40)
    monitor = Monitor(run)
    monitor.poll()
    # What a resume from the step-5 checkpoint does: truncate_lines writes the first 5 lines into a
    # new file that replaces the old one, then the steps from 6 on are trained (and logged) again.
    tmp = run / "metrics.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    tmp.replace(run / "metrics.jsonl")
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == [1, 2, 3, 4, 5]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records[5:]))
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == list(range(1, 41))
    assert monitor.history.num_resumes == 1 and monitor.alerts == [] and monitor.complete


def test_resume_detected_when_the_file_already_grew_past_the_old_end(tmp_path):
    records = make_records(40)
    run = write_run(tmp_path, records[:8], total=40)
    monitor = Monitor(run)
    monitor.poll()
    changed = [dict(r) for r in records[5:12]]
    changed[0]["loss"] *= 1.5  # step 6 trained again gives another loss: the resume is not exact
    with open(run / "metrics.jsonl", "r+") as f:  # rewritten in place, longer than before
        f.truncate(0)
        f.write("".join(json.dumps(r) + "\n" for r in records[:5] + changed))
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == list(range(1, 13))
    assert kinds_and_steps(monitor) == [("resume_mismatch", 6)]
    assert "train.deterministic" in monitor.alerts[0].remedy


def test_repeated_steps_appended_without_truncation_replace_the_old_ones(tmp_path):
    records = make_records(12)
    run = write_run(tmp_path, records[:8] + records[5:], total=12)
    monitor = analyse(run)
    assert [r["step"] for r in monitor.history.records] == list(range(1, 13))
    assert monitor.history.num_resumes == 1 and monitor.alerts == []


def test_evaluation_records_are_neither_steps_nor_resumes(tmp_path):
    """eval.every appends a record with the step of the training record before it: the monitor
    must not read that as a resume (which restarted its detectors) nor show its missing loss."""
    records = make_records(300, ("l2t", "t2l", "joint"))
    evaluation = lambda step: {"step": step, "eval_l2t_cosine_mean": 0.1 * step / 100}  # noqa: E731
    lines = records[:100] + [evaluation(100)] + records[100:200] + [evaluation(200)] + records[200:]
    monitor = analyse(write_run(tmp_path, lines))
    report = monitor.report()
    assert report["num_resumes"] == 0 and report["num_records"] == 300 and monitor.alerts == []
    assert report["num_evaluations"] == 2 and report["last_evaluation"]["eval_l2t_cosine_mean"] == 0.2
    # The same file read in two polls, the second after a rewrite (a resume from step 150).
    run = write_run(tmp_path / "resumed", lines[:151], total=300)
    monitor = Monitor(run)
    monitor.poll()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:101] + records[100:150]))
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == list(range(1, 151))
    assert [e["step"] for e in monitor.history.evaluations] == [100]
    lines_out = []
    follow(monitor, once=True, out=lines_out.append)
    assert "loss None" not in lines_out[0]


def test_a_partial_last_line_waits_and_bad_lines_are_counted(tmp_path):
    records = make_records(3)
    run = write_run(tmp_path, records[:1], total=3)
    line = json.dumps(records[1])
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n" + line[:20])
    monitor = Monitor(run)
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == [1]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line[20:] + "\n")
    monitor.poll()
    assert [r["step"] for r in monitor.history.records] == [1, 2]
    assert monitor.reader.num_unreadable == 1


def test_each_unreadable_line_is_warned_once_with_its_line_number(tmp_path):
    records = make_records(6)
    run = write_run(tmp_path, records[:2], total=6)
    path = run / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": "three"}\n' + json.dumps(records[2]) + "\n" + '{"step": 4, "lo')  # line 5: still written
    monitor, warnings = Monitor(run), []
    for _ in range(2):  # a second poll of the same file repeats nothing
        follow(monitor, once=True, out=lambda _line: None, warn=warnings.append)
    assert warnings == [
        f'{path}:3: skipped a line that is not a metrics record (\'{{"step": "three"}}\'); '
        f"expected a JSON object with an integer 'step'"
    ]
    with open(path, "a") as f:  # the partial line ends broken: now it is bad, and only it is new
        f.write("\n" + json.dumps(records[4]) + "\n")
    follow(monitor, once=True, out=lambda _line: None, warn=warnings.append)
    assert [w.split(": skipped")[0] for w in warnings] == [f"{path}:3", f"{path}:5"]
    assert [r["step"] for r in monitor.history.records] == [1, 2, 3, 5]
    # A resume rewrites the file from its checkpoint: the bad line it keeps is not warned again.
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    follow(monitor, once=True, out=lambda _line: None, warn=warnings.append)
    assert len(warnings) == 2 and monitor.reader.num_unreadable == 1


def test_cli_warns_about_bad_lines_on_stderr_and_refuses_bad_seconds(tmp_path, capsys):
    run = write_run(tmp_path, make_records(20))
    with open(run / "metrics.jsonl", "a") as f:
        f.write("garbage\n")
    assert cli.main(["monitor", str(run), "--once"]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"warning: {run / 'metrics.jsonl'}:21: skipped a line that is not a metrics record ('garbage'); "
        f"expected a JSON object with an integer 'step'\n"
    )
    for option in ("--interval", "--stall-seconds"):
        assert cli.main(["monitor", str(run), option, "0"]) == 2
        assert capsys.readouterr().err == f"mmldlm monitor: {option}: got 0.0; expected a number of seconds > 0\n"


def test_following_a_path_that_is_not_a_run_fails_at_once(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    for path in (tmp_path / "typo", tmp_path / "notes"):
        assert cli.main(["monitor", str(path), "--interval", "0.01", "--stall-seconds", "0.05"]) == 2
        assert capsys.readouterr().err == (
            f"mmldlm monitor: {path / 'metrics.jsonl'}: no metrics file (is this a run directory of `mmldlm train`?)\n"
        )


@pytest.mark.parametrize("start", ["empty", "checkpoints"])
def test_a_run_directory_waiting_for_its_first_record_is_followed(tmp_path, start):
    # An empty directory (made by the trainer's first step, or by a job script), or a resume loading its
    # checkpoint: metrics.jsonl comes next.
    run = tmp_path / "run"
    (run / "checkpoints" if start == "checkpoints" else run).mkdir(parents=True)
    lines = []

    def sleep(_seconds):
        write_run(run, make_records(5))

    assert follow(Monitor(run), interval=0, out=lines.append, sleep=sleep) == "healthy"
    assert lines[-1] == "run complete; status: healthy (0 alerts, 0 resumes)"


def test_a_bad_threshold_is_named_with_its_value():
    with pytest.raises(OptionError, match=r"^monitor threshold 'spike_z': got -1.0; expected a number > 0$"):
        Monitor("unused", HealthConfig(spike_z=-1.0))
    with pytest.raises(OptionError, match=r"^monitor threshold 'throughput_drop': got 1.0; expected a share .* < 1$"):
        Monitor("unused", HealthConfig(throughput_drop=1.0))
    with pytest.raises(
        OptionError, match=r"^monitor threshold 'memory_window': got 2; expected a number of records >= 3$"
    ):
        Monitor("unused", HealthConfig(memory_window=2))


def test_plot_is_a_png_with_every_curve(tmp_path):
    records = make_records(60, ("l2t", "t2l", "joint"))
    titles = plot(records, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == [title for title, _ in PANELS]
    assert titles == [
        "loss",
        "text loss",
        "latent loss",
        "learning rate",
        "grad norm",
        "throughput (samples/s)",
        "memory (GiB)",
        "step time / what its work predicts",
    ]


def test_the_status_line_gives_the_loss_and_its_trend_of_every_mode(tmp_path, capsys):
    run = write_run(tmp_path, make_records(240, ("l2t", "t2l", "joint")))
    assert cli.main(["monitor", str(run), "--once"]) == 0
    (status,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 240/240")]
    losses = status.split(" | ")[1]
    assert re.fullmatch(r"loss joint [\d.]+ \(-\d+\.\d%\), l2t [\d.]+ \(-\d+\.\d%\), t2l [\d.]+ \(-\d+\.\d%\)", losses)


def test_the_plots_alert_lines_are_labelled_with_their_kind_and_severity(tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = {}

    def keep(fig, path, **_kwargs):
        loss = fig.axes[0]
        drawn["legend"] = loss.get_legend_handles_labels()[1]
        drawn["texts"] = [t.get_text() for t in loss.texts]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    alerts = [Alert("loss_spike", "warning", 150, "spike", "fix"), Alert("nonfinite", "critical", 200, "nan", "fix")]
    plot(make_records(240, ("l2t", "t2l")), tmp_path / "curves.png", alerts)
    assert drawn["legend"] == ["l2t", "t2l", "critical alert", "warning alert"]
    assert drawn["texts"] == ["loss_spike", "nonfinite"]


def test_cli_report_plot_and_exit_codes(tmp_path, capsys):
    healthy = write_run(tmp_path / "healthy", make_records())
    spiky_records = make_records()
    spiky_records[149]["loss"] *= 3
    spiky = write_run(tmp_path / "spiky", spiky_records)
    broken_records = make_records()
    _nonfinite(broken_records)
    broken = write_run(tmp_path / "broken", broken_records)

    assert cli.main(["monitor", str(healthy), "--once", "--strict"]) == 0
    assert cli.main(["monitor", str(spiky / "metrics.jsonl"), "--once"]) == 0
    report, png = tmp_path / "report.json", tmp_path / "plot.png"
    assert cli.main(["monitor", str(spiky), "--once", "--strict", "--report", str(report), "--plot", str(png)]) == 1
    data = json.loads(report.read_text())
    assert data["status"] == "warning" and data["last_step"] == 240 and data["total_steps"] == 240
    assert [(a["kind"], a["step"], a["severity"]) for a in data["alerts"]] == [("loss_spike", 150, "warning")]
    assert data["statistics"]["loss"]["l2t"]["max"] == pytest.approx(spiky_records[149]["loss"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["monitor", str(broken), "--once"]) == 2
    assert cli.main(["monitor", str(tmp_path / "missing"), "--once"]) == 2
    out = capsys.readouterr().out
    assert "[CRITICAL] step 150 nonfinite" in out and "fix: lower optim.lr" in out
    assert "step 240/240 (100%)" in out and "ETA 0m00s" in out


# --------------------------------------------------------------------------------------------------
# Judged against each step's work, on the real default run.

DEFAULT_RUN = os.path.join(os.path.dirname(__file__), "data", "default_run_metrics.jsonl")
QUIET_UNTIL = 620  # the default run's steps before another training job started on its 2 cores


def default_run(until=None) -> list[dict]:
    """Records of a real `make train` run (configs/default.yaml, bucketed batches, train.threads=1,
    4000 steps): see tests/data/README.md."""
    with open(DEFAULT_RUN) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if until is None or r["step"] <= until]


def training_steps(records):
    return [r["step"] for r in records if "loss" in r]


def test_the_default_run_raises_no_alert_while_it_had_the_machine_to_itself():
    assert faults.alerts_of(default_run(QUIET_UNTIL)) == []


def test_the_default_run_slowed_by_another_job_reads_as_throughput_drops_and_nothing_else():
    # From step 630 another training job shared the 2 cores: steps took 1.7-3.4x as long as their
    # FLOPs had at the start. Memory rose from 0.5 to 2.3 GiB over 2300 steps and through three
    # evaluations, then held: warm-up, not a creep.
    alerts = faults.alerts_of(default_run())
    assert {a.kind for a in alerts} == {"throughput_drop"}
    assert alerts[0].message.startswith("since step 630 ")


BUSY_RUN = os.path.join(os.path.dirname(__file__), "data", "busy_run_metrics.jsonl")


def busy_run() -> list[dict]:
    """Records of a real run that shared its 2 cores with other jobs now and then (each record with the
    CPU time the process got and the load average): see tests/data/README.md."""
    with open(BUSY_RUN) as f:
        return [json.loads(line) for line in f]


def test_drops_while_other_jobs_took_the_cpus_are_notes_and_the_run_stays_healthy(tmp_path, capsys):
    # Four stretches of this run lost 31-38% of their speed to other jobs on its 2 cores: the process got
    # 0.34-0.66 CPU seconds per second instead of 0.99, and per CPU second its steps were as fast as before.
    records = busy_run()
    run = write_run(tmp_path, records)
    report = tmp_path / "health.json"
    assert cli.main(["monitor", str(run), "--once", "--strict", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "run complete; status: healthy (0 alerts, 4 notes, 0 resumes)" in out
    assert "[NOTE] step 220 throughput_drop: the machine was busy: since step 200 the steps (mode t2l) ran 38%" in out
    assert "this process got 0.34 CPU seconds per second (0.99 in its typical records)" in out
    assert "per CPU second it got, the steps ran as fast as their line predicts" in out
    assert "means: nothing in the run: other processes took the CPUs it runs on" in out
    data = json.loads(report.read_text())
    assert data["status"] == "healthy" and data["alerts"] == []
    assert [(n["kind"], n["step"], n["severity"]) for n in data["notes"]] == [
        ("throughput_drop", step, "note") for step in (220, 470, 600, 1450)
    ]
    for note in data["notes"]:  # each slow stretch had a CPU share well below the run's usual 0.98-0.99
        stretch = [r for r in records if note["step"] - 30 <= r["step"] <= note["step"]]
        assert min(r["cpu_s_per_s"] for r in stretch) < 0.7


def test_a_drop_of_the_run_itself_on_a_machine_that_was_not_busy_stays_a_warning():
    # Steps 900-1000 of the same run had their 2 cores to themselves (0.99 CPU seconds per second): slowed
    # by 40% there, with the CPU time and the load as they were, the run itself slowed.
    records = faults.slowdown(busy_run(), 900, 100, drop=0.4)
    history = RunHistory()
    history.extend(records)
    (alert,) = history.alerts
    assert alert.kind == "throughput_drop" and alert.severity == "warning" and 900 <= alert.step < 1000
    assert "the machine does not explain it, the run itself slowed" in alert.message
    notes = [n.step for n in history.notes]  # the stretches other jobs slowed, as before
    assert len(notes) == 4 and notes[:3] == [220, 470, 600] and 1430 <= notes[3] <= 1500


def test_a_drop_while_other_processes_crowded_the_cpus_is_a_note_though_the_process_kept_its_cpu_time():
    # Cores shared through hyper-threads or a memory bus slow a process that keeps its CPU time: the same
    # slowdown as above, with 1.5 more runnable tasks of other processes in the load average (3.3-4.4 on 2).
    records = faults.slowdown(busy_run(), 900, 100, drop=0.4)
    for r in records:
        if 900 <= r["step"] < 1000:
            r["load_1m"] += 1.5
    history = RunHistory()
    history.extend(records)
    assert history.alerts == []
    (note,) = [n for n in history.notes if 900 <= n.step < 1000]
    assert "the machine was busy" in note.message and "other processes kept more tasks running" in note.message


def test_a_slowdown_of_40_percent_over_50_steps_is_one_throughput_drop_naming_when_it_began():
    records = default_run(QUIET_UNTIL)
    steps = training_steps(records)
    first = steps[len(steps) // 2]
    (alert,) = faults.alerts_of(faults.slowdown(records, first, 50, drop=0.4))
    assert alert.kind == "throughput_drop" and first <= alert.step < first + 50
    since = int(re.match(r"since step (\d+) ", alert.message).group(1))
    assert first <= since <= alert.step  # the first record that was itself 30% slow


@pytest.mark.parametrize(
    "inject,kind,first,within_records",
    [
        (lambda r, s: faults.loader_stall(r, s, 50, seconds=0.5), "data_wait", 310, 3),
        (lambda r, s: faults.nonfinite(r, s), "nonfinite", 310, 1),
        (lambda r, s: faults.leak(r, s, mib_per_step=3.0), "memory_creep", 2500, 30),  # after warm-up
    ],
    ids=["loader_stall", "nonfinite", "leak"],
)
def test_faults_replayed_into_the_default_run_are_named_within_a_few_records(inject, kind, first, within_records):
    quiet = first < QUIET_UNTIL
    records = default_run(QUIET_UNTIL if quiet else None)
    steps = training_steps(records)
    alerts = faults.alerts_of(inject(records, first))
    if not quiet:  # the real slowdowns of the run's shared stretch have alerts of their own
        alerts = [a for a in alerts if a.kind != "throughput_drop"]
    assert [a.kind for a in alerts] == [kind], [(a.kind, a.step) for a in alerts]
    assert first <= alerts[0].step <= steps[steps.index(first) + within_records - 1]


def bucketed_records(n=400, seed=0) -> list[dict]:
    """A healthy run of length-bucketed batches: each step draws a padded length of 16-40 tokens, its
    compute time follows its FLOPs (to the power 0.7, with 5% noise), so samples/s swings
    by about +-35% around its median without anything being wrong."""
    rng = random.Random(seed)
    records = make_records(n, ("l2t", "t2l", "joint"), seed)
    for r in records:
        length = rng.choice((16, 24, 32, 40))
        step_time = 0.002 * (64 * length) ** 0.7 * (1 + 0.05 * rng.gauss(0, 1)) / 0.98
        r.update(train_flops=6e6 * 64 * length, step_time_s=step_time, data_wait_share=0.02)
        r.update(samples_per_s=64 / step_time, tokens_per_s=0.8 * 64 * length / step_time)
    return records


def test_bucket_driven_swings_of_35_percent_raise_no_throughput_alert(tmp_path):
    records = bucketed_records()
    for mode in ("l2t", "t2l", "joint"):
        speeds = sorted(r["samples_per_s"] for r in records if r["mode"] == mode)
        median = speeds[len(speeds) // 2]
        assert speeds[0] < 0.75 * median and speeds[-1] > 1.3 * median  # the swings are really there
    assert analyse(write_run(tmp_path, records)).alerts == []


def shaped_memory(records, leak_from=None):
    """Warm-up as the trainer logs it: memory rises with each new input shape over the first 120
    records and then holds; from `leak_from` on, 10 MiB more every record with no new shape."""
    for i, r in enumerate(records):
        r["num_shapes"] = min(i // 3, 40) + 1
        r["mem_rss_gib"] = 0.5 + 0.015 * r["num_shapes"] + 0.001 * math.sin(i)
        if leak_from is not None and r["step"] >= leak_from:
            r["mem_rss_gib"] += (r["step"] - leak_from + 1) * 10 / 1024
    return records


def test_memory_growth_while_new_shapes_arrive_is_warm_up_and_later_growth_is_a_creep(tmp_path):
    assert analyse(write_run(tmp_path / "warm-up", shaped_memory(bucketed_records()))).alerts == []
    monitor = analyse(write_run(tmp_path / "leak", shaped_memory(bucketed_records(), leak_from=200)))
    assert [a.kind for a in monitor.alerts] == ["memory_creep"]
    assert 200 <= monitor.alerts[0].step < 230 and "no new input shape" in monitor.alerts[0].message


def test_without_shape_counts_growth_from_the_start_is_warm_up_and_a_later_faster_one_a_creep(tmp_path):
    # As in records written before num_shapes, one every 10 steps: a steady rise of 6 MiB per record
    # for 230 records, then flat (the default run's oneDNN caches before the text head's rows were
    # padded); then a leak of 3 MiB per step.
    records = bucketed_records()
    for i, r in enumerate(records):
        r["step"] = 10 * (i + 1)
        r["mem_rss_gib"] = 0.8 + min(i, 230) * 6 / 1024 + 0.001 * math.sin(i)
    assert analyse(write_run(tmp_path / "warm-up", records)).alerts == []
    monitor = analyse(write_run(tmp_path / "leak", faults.leak(records, 3000, mib_per_step=3.0)))
    assert [a.kind for a in monitor.alerts] == ["memory_creep"] and 3000 <= monitor.alerts[0].step < 3300


@pytest.mark.parametrize("how", ["stop", "resume"])
def test_a_restarted_trainers_start_up_is_neither_a_drop_nor_a_creep(tmp_path, how):
    # A run stopped by a signal at step 200 (or killed there and resumed from step 180) continues in a
    # new process: its first three records are 5x slower (allocation, start-up) and its memory
    # starts at 0.5 GiB and warms up to the old 1.2 GiB over 40 records.
    records = bucketed_records()
    records[199]["stop_requested"] = how == "stop"
    first = 201 if how == "stop" else 181
    later = faults.slowdown(records, first, 3, drop=0.8)[first - 1 :]
    for i, r in enumerate(later):
        r["mem_rss_gib"] = 0.5 + 0.7 * min(i, 40) / 40
    monitor = analyse(write_run(tmp_path, records[:200] + later))
    assert monitor.alerts == [] and monitor.history.num_resumes == 1
