"""Health of a training run from its metrics records: alerts, each with a severity, the step it fired
at, and a remedy that names the config switch.

The input is the records of RUN/metrics.jsonl exactly as the trainer writes them (Trainer.train_step
plus metrics.memory_stats): step, mode, loss, text_loss, latent_loss, lr, grad_norm, samples_per_s,
tokens_per_s, train_flops, num_shapes, step_time_s, data_wait_share, cpu_s_per_s, load_1m, num_cpus,
skipped, num_skipped, and mem_allocated_gib (CUDA) or mem_rss_gib (CPU); records written before
train_flops, num_shapes or the machine's load (cpu_s_per_s, load_1m, num_cpus) existed are read too.
`HealthTracker.observe(record)` feeds one record to every detector, so a live run is analysed as it
grows at a constant cost per record.

Like is compared with like: the modes l2t / t2l / joint have their own loss scales, gradient norms
and step costs (a `random` run jumps between them every step), so losses, gradient norms and
throughput are compared only with earlier records of the same mode. Throughput is also judged
against the step's own work: with length-bucketed batches one step computes on 8 tokens a sample and
the next on 64, so samples/s swings by 25-40% on a quiet machine; a step is slow only when it took
longer than its mode's step-cost line predicts for its FLOPs. A drop the machine explains (the
process got less CPU time than in its typical records, and per CPU second its steps were as fast; or
other processes kept the load average above the CPU count) is a note, not an alert: the machine was
busy, the run was not slow. Memory growth while the run still meets new input shapes (allocator and
oneDNN caches filling) is warm-up, not a leak.
Thresholds are robust (medians, the median absolute deviation, Theil-Sen lines) so a single outlier
neither hides nor fakes a trend.
Each episode raises one alert (or note): a detector fires when its condition becomes true and re-arms
only once the condition has cleared.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field

from mmldlm.errors import OptionError
from mmldlm.wording import counted

MEMORY_KEYS = ("mem_allocated_gib", "mem_rss_gib")  # CUDA peak allocated, else process RSS


@dataclass
class Alert:
    kind: str
    severity: str  # "warning" | "critical"; "note": what happened to the run, nothing wrong with it
    step: int
    message: str
    remedy: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HealthConfig:
    """Detector thresholds. Windows count records (one per train.log_every steps), per mode where noted."""

    window: int = 50  # records per mode behind the loss-spike and grad-norm statistics
    min_history: int = 10  # records of a mode before spikes and explosions are judged
    spike_z: float = 6.0  # robust z-score of a loss's jump above its local level that makes it a spike
    trend_window: int = 10  # records per mode in the rolling median that trend, divergence and plateau follow
    divergence_ratio: float = 0.3  # rolling median this far above its best: sustained divergence
    plateau_window: int = 50  # records per mode without a new best (by plateau_min_improvement): a plateau
    plateau_min_improvement: float = 0.01
    plateau_lr_fraction: float = 0.5  # judge plateaus only while lr >= this share of the peak lr seen
    grad_explosion_factor: float = 10.0  # grad norm above this multiple of its running median
    grad_spike_factor: float = 1000.0  # ...above this multiple, from a mode's third record on: a spike
    throughput_window: int = 5  # records (all modes) whose median slowdown is judged: a drop needs 3 slow of 5
    throughput_drop: float = 0.3  # compute throughput this share below what the step's work predicts
    throughput_history: int = 50  # typical records per mode behind the step-cost line
    throughput_min_history: int = 5  # records of a mode before its line judges its steps
    data_wait_share: float = 0.2  # median data-wait share of step time over throughput_window records
    # A drop's slow records with a 1-minute load average above the CPU count and this many runnable tasks
    # above what the run's typical records saw beside their own threads: other processes crowded the CPUs.
    busy_load_rise: float = 0.5
    memory_window: int = 30  # records over which memory must rise steadily
    memory_creep_fraction: float = 0.1  # rise above this share of the window's starting memory...
    memory_creep_min_gib: float = 0.05  # ...and above this many GiB...
    memory_acceleration: float = 2.0  # ...and, in records without num_shapes, this many times the run's pace before
    warmup_records: int = 2  # first records of each process start left out of throughput and memory
    resume_tolerance: float = 1e-3  # relative loss difference of a re-trained step after a resume
    recompile_growth: int = 8  # graphs compiled after the first min_history records: a recompilation storm

    def check(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise OptionError(f"monitor threshold '{name}'", value, "a number > 0")
        if not self.throughput_drop < 1:
            raise OptionError("monitor threshold 'throughput_drop'", self.throughput_drop, "a share of samples/s < 1")
        if self.memory_window < 3:  # the window is judged by its thirds
            raise OptionError("monitor threshold 'memory_window'", self.memory_window, "a number of records >= 3")


REMEDIES = {
    "nonfinite": "lower optim.lr, keep optim.grad_clip > 0 (1.0), prefer train.precision=bf16 over fp16; "
    "the trainer skips such updates and stops after train.max_consecutive_skips in a row; "
    "continue with --resume auto (or --resume PATH of an earlier checkpoint)",
    "skipped_updates": "updates with a non-finite loss or gradient norm were skipped between logged records: "
    "lower optim.lr, keep optim.grad_clip > 0, check the data; "
    "train.log_every=1 shows each one",
    "loss_spike": "optim.grad_clip=1.0, lower optim.lr or a longer schedule.warmup_steps; a spike that does "
    "not recover becomes a divergence",
    "divergence": "lower optim.lr (halve it) and resume from a checkpoint before the rise (--resume PATH); "
    "schedule.warmup_steps longer, optim.grad_clip=1.0",
    "plateau": "schedule.plateau.enabled=true reduces the LR when the loss stops improving; if optim.lr is small "
    "raise it; check objective.mode_weights and that the data is not tiny (memorised)",
    "grad_explosion": "optim.grad_clip=1.0 (clipping bounds the update, the norm is still logged), lower optim.lr",
    "grad_spike": "a norm orders of magnitude above its mode's others on single steps is one operation's gradient "
    "at a singular point (x / ||x|| or a division at an all-zero input, such as a zero-initialised parameter), "
    "not the learning rate: optim.grad_clip bounds the update but hides the cause; rerun the first steps with "
    "train.log_every=1 and the parameters' gradient norms printed after backward to find it",
    "throughput_drop": "another process on the device or node (on shared CPUs train.threads=1 or stop the other "
    "job), thermal throttling, a slow filesystem, or the loader: data.num_workers, "
    "data.persistent_workers=true; `mmldlm check` audits the loader and the load",
    "busy_machine": "nothing in the run: other processes took the CPUs it runs on for a while; on a machine "
    "shared with other jobs train.threads=1 loses least to them",
    "data_wait": "the loader cannot keep up: data.num_workers (null = min(8, cpus // local ranks)), "
    "data.prefetch_factor=4, data.persistent_workers=true, data.pin_memory on GPU",
    "memory_creep": "tensors kept across steps (a metric not detached, a growing list) or allocator "
    "fragmentation from many shapes: data.pad_to_multiple=64 bounds the shapes, "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a lower train.micro_batch_size",
    "stall": "a rank or the loader is stuck: distributed.timeout_minutes bounds how long a collective waits "
    "(30 by default; `mmldlm check` flags absurd values), look at each rank's log "
    "(scripts/launch.sh writes logs/node-N.log), resume with --resume auto",
    "recompiles": "each new padded text length compiles the blocks again: data.length_buckets (a few fixed "
    "lengths) or data.pad_to_multiple=64 bounds the shapes, or perf.compile=false; the records' compiled_graphs "
    "counts the graphs",
    "resume_mismatch": "the resumed run does not repeat the interrupted one: resume with the same config, data "
    "and number of processes; train.deterministic=true makes resumed losses repeat exactly",
}


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def memory_of(record: dict) -> float | None:
    return next((record[k] for k in MEMORY_KEYS if finite(record.get(k))), None)


def work_of(record: dict) -> float | None:
    """The work a step computed on: its training FLOPs (which follow the padded length it drew and
    the positions its text head ran at), or in records written before those were logged its real
    tokens (tokens_per_s x step_time_s)."""
    if finite(record.get("train_flops")) and record["train_flops"] > 0:
        return float(record["train_flops"])
    tokens_per_s, step_time = record.get("tokens_per_s"), record.get("step_time_s")
    if finite(tokens_per_s) and finite(step_time) and tokens_per_s * step_time > 0:
        return tokens_per_s * step_time
    return None


@dataclass(frozen=True)
class MachineState:
    """A record's view of the machine (training/metrics.py MachineLoad writes it): the CPU seconds per
    second the process got since the record before, the 1-minute load average and the CPU count."""

    cpu_s_per_s: float
    load_1m: float
    num_cpus: int

    @property
    def others(self) -> float:
        """The load that the process's own CPU use does not account for: other processes (and its
        own threads while they waited for a CPU)."""
        return self.load_1m - self.cpu_s_per_s


def machine_state_of(record: dict) -> MachineState | None:
    keys = ("cpu_s_per_s", "load_1m", "num_cpus")
    if not all(finite(record.get(key)) for key in keys):
        return None
    return MachineState(*(record[key] for key in keys))


def compute_seconds(record: dict) -> float | None:
    """The step's time without its wait for the loader (a slow loader is data_wait's to report)."""
    step_time, wait = record.get("step_time_s"), record.get("data_wait_share")
    if not finite(step_time) or step_time <= 0:
        return None
    return step_time * (1 - min(max(wait, 0.0), 0.95)) if finite(wait) else step_time


def thirds(values) -> tuple[float, float, float]:
    """The medians of the first, middle and last third of `values`."""
    third = len(values) // 3
    return tuple(statistics.median(values[i * third : (i + 1) * third]) for i in range(3))


def robust_z(value: float, history, floor: float) -> float:
    """0.6745 * (value - median) / MAD (Iglewicz & Hoaglin 1993): about a z-score for normal data,
    unmoved by the outliers it is meant to find. The MAD is floored at `floor` so a near-constant
    history does not turn rounding noise into huge scores."""
    values = list(history)
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return 0.6745 * (value - median) / max(mad, floor, 1e-12)


class _Latch:
    """One alert per episode: `fire(cond)` is True when `cond` becomes true; re-armed when it is false."""

    def __init__(self):
        self.armed = True

    def fire(self, condition: bool) -> bool:
        if not condition:
            self.armed = True
            return False
        fired, self.armed = self.armed, False
        return fired


class StepCost:
    """What a mode's step costs for its work: log(seconds) = a + b * log(work), a Theil-Sen line
    (the median of the pairwise slopes, Sen 1968) through the mode's last `size` typical records.
    A step's slowdown is its seconds over the line's prediction: about 1 however long its batch."""

    def __init__(self, size: int):
        self.points: deque = deque(maxlen=size)  # (log work, log seconds)

    def __len__(self) -> int:
        return len(self.points)

    def add(self, work: float, seconds: float) -> None:
        self.points.append((math.log(work), math.log(seconds)))

    def slowdown(self, work: float, seconds: float) -> float:
        pairs = itertools.combinations(self.points, 2)
        slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in pairs if abs(x2 - x1) > 1e-3]
        slope = statistics.median(slopes) if slopes else 0.0  # one work size so far: a level, no line
        intercept = statistics.median(y - slope * x for x, y in self.points)
        return seconds / math.exp(intercept + slope * math.log(work))


@dataclass
class _ModeState:
    """What the detectors remember about one mode."""

    residuals: deque  # loss minus the rolling median before it: the loss's jumps off its local level
    grad_norms: deque
    cost: StepCost
    smoothed: deque  # the last trend_window losses, for the rolling median
    previous_medians: deque  # rolling medians of earlier records, for the trend
    best: float = math.inf  # lowest rolling median so far
    anchor: float = math.inf  # the rolling median when it last improved by plateau_min_improvement...
    anchor_at: int = 0  # ...and the count of this mode's records then
    count: int = 0
    latches: dict = field(default_factory=lambda: defaultdict(_Latch))
    first_grad_norms: list = field(default_factory=list)  # (step, grad norm, alerted) of its first min_history


class HealthTracker:
    """Streaming detectors over one run's records (in step order; the caller replays after a resume)."""

    def __init__(self, cfg: HealthConfig | None = None):
        self.cfg = cfg or HealthConfig()
        self.cfg.check()
        self.alerts: list[Alert] = []
        self.notes: list[Alert] = []  # episodes explained outside the run (severity "note")
        self.num_records = 0
        self.peak_lr = 0.0
        self._modes: dict[str, _ModeState] = {}
        self._latches = defaultdict(_Latch)
        self._data_wait = deque(maxlen=self.cfg.throughput_window)
        # (step, mode, slowdown, MachineState or None) of the last records, all modes
        self._slowdowns = deque(maxlen=self.cfg.throughput_window)
        self._typical_loads = deque(maxlen=self.cfg.throughput_history)  # MachineState of the records the lines took
        self.slowdowns: list[tuple[int, float]] = []  # (step, slowdown) of every judged record, for the plot
        self._memory = deque(maxlen=self.cfg.memory_window)  # (step, memory, num_shapes or None)
        self._memory_start: tuple[int, float] | None = None  # (step, memory) of the first judged record
        self._num_skipped = 0
        self._graphs_after_warmup = None
        self._warm_from = self.cfg.warmup_records + 1  # the first record past the process's start-up
        self._stopped = False  # the last record asked the trainer to stop: a later one is a new process

    def _mode(self, name: str) -> _ModeState:
        if name not in self._modes:
            w = self.cfg.window
            self._modes[name] = _ModeState(
                deque(maxlen=w),
                deque(maxlen=w),
                StepCost(self.cfg.throughput_history),
                deque(maxlen=self.cfg.trend_window),
                deque(maxlen=self.cfg.trend_window),
            )
        return self._modes[name]

    def _raise(self, kind: str, severity: str, step: int, message: str) -> Alert:
        alert = Alert(kind, severity, step, message, REMEDIES[kind])
        self.alerts.append(alert)
        return alert

    def observe(self, record: dict) -> list[Alert]:
        """Feed one record; returns the alerts it raised (notes apart: `notes`)."""
        before = len(self.alerts)
        if self._stopped:
            self.process_started()
        self._stopped = bool(record.get("stop_requested"))
        self.num_records += 1
        step = int(record["step"])
        mode = str(record.get("mode", "all"))
        self._check_finite(record, step, mode)
        state = self._mode(mode)
        loss, grad_norm = record.get("loss"), record.get("grad_norm")
        if finite(record.get("lr")):
            self.peak_lr = max(self.peak_lr, record["lr"])
        if finite(loss) and finite(grad_norm) and not record.get("skipped"):
            state.count += 1
            self._check_loss(state, loss, step, mode, record.get("lr"))
            self._check_grad_norm(state, grad_norm, step, mode)
        self._check_throughput(state, record, step, mode)
        self._check_memory(record, step)
        self._check_compiles(record, step)
        return self.alerts[before:]

    def process_started(self) -> None:
        """The trainer starts again (a resume): its first records pay for allocation and start-up
        again, and its memory starts from the fresh process's."""
        self._warm_from = self.num_records + 1 + self.cfg.warmup_records
        self.evaluated()

    def evaluated(self) -> None:
        """An evaluation ran after the last record: its buffers and the sentence encoder it loads
        raise the memory once (0.25 GiB in the default run), so memory is judged afresh from the
        next record."""
        self._memory.clear()
        self._memory_start = None

    # ---------------------------------------------------------------- detectors

    def _check_compiles(self, record: dict, step: int) -> None:
        """perf.compile: graphs compiled after the first min_history records (the padded lengths seen
        first) should stay few; growth beyond recompile_growth means the shapes keep changing."""
        graphs = record.get("compiled_graphs")
        if not finite(graphs):
            return
        if self.num_records <= self.cfg.min_history or self._graphs_after_warmup is None:
            self._graphs_after_warmup = graphs
            return
        grown = graphs - self._graphs_after_warmup
        if self._latches["recompiles"].fire(grown > self.cfg.recompile_growth):
            self._raise(
                "recompiles",
                "warning",
                step,
                f"{grown:.0f} graphs compiled after the first {self.cfg.min_history} records ({graphs:.0f} in "
                f"all; alert above {self.cfg.recompile_growth}): the input shapes keep changing",
            )

    def _check_finite(self, record: dict, step: int, mode: str) -> None:
        bad = {
            k: record.get(k)
            for k in ("loss", "grad_norm", "text_loss", "latent_loss")
            if record.get(k) is not None and not finite(record.get(k))
        }
        if self._latches["nonfinite"].fire(bool(bad)):
            values = ", ".join(f"{k}={v}" for k, v in bad.items())
            skipped = " (the update was skipped)" if record.get("skipped") else ""
            self._raise("nonfinite", "critical", step, f"non-finite {values} in mode {mode}{skipped}")
        num_skipped = record.get("num_skipped")
        if isinstance(num_skipped, int):
            unlogged = num_skipped - self._num_skipped - (1 if record.get("skipped") else 0)
            if unlogged > 0:
                self._raise(
                    "skipped_updates",
                    "critical",
                    step,
                    f"{counted(unlogged, 'update')} skipped for a non-finite loss or gradient norm before step "
                    f"{step} ({num_skipped} in the run so far)",
                )
            self._num_skipped = num_skipped

    def _check_loss(self, state: _ModeState, loss: float, step: int, mode: str, lr) -> None:
        # A spike is a jump off the local level (the rolling median of the records before it) that is
        # large against the usual jumps: a steady trend, even a rising one, moves the level with it
        # and is left to the divergence and plateau tests.
        cfg = self.cfg
        if len(state.smoothed) == cfg.trend_window:
            level = statistics.median(state.smoothed)
            residual = loss - level
            if len(state.residuals) >= cfg.min_history:
                z = robust_z(residual, state.residuals, floor=1e-3 * abs(level))
                if state.latches["spike"].fire(z > cfg.spike_z):
                    self._raise(
                        "loss_spike",
                        "warning",
                        step,
                        f"loss {loss:.4g} in mode {mode} jumped {z:.1f} robust standard deviations above "
                        f"its local level {level:.4g} (rolling median of {cfg.trend_window} records)",
                    )
            state.residuals.append(residual)
        state.smoothed.append(loss)
        if len(state.smoothed) < cfg.trend_window:
            return
        rolling = statistics.median(state.smoothed)
        state.previous_medians.append(rolling)
        if state.latches["divergence"].fire(rolling > state.best * (1 + cfg.divergence_ratio)):
            self._raise(
                "divergence",
                "warning",
                step,
                f"loss in mode {mode} has risen to a rolling median of {rolling:.4g}, "
                f"{rolling / state.best - 1:.0%} above its best {state.best:.4g}",
            )
        if rolling < state.anchor * (1 - cfg.plateau_min_improvement):
            state.anchor, state.anchor_at = rolling, state.count
        state.best = min(state.best, rolling)
        # Flat: no new best for plateau_window records, and not far above the best either (a rising
        # loss is a divergence, not a plateau).
        judged = finite(lr) and lr >= cfg.plateau_lr_fraction * self.peak_lr
        flat = state.count - state.anchor_at >= cfg.plateau_window and rolling <= state.best * (
            1 + cfg.divergence_ratio / 2
        )
        if state.latches["plateau"].fire(judged and flat):
            self._raise(
                "plateau",
                "warning",
                step,
                f"loss in mode {mode} has not improved by {cfg.plateau_min_improvement:.0%} over "
                f"{cfg.plateau_window} records (rolling median {rolling:.4g}, best {state.best:.4g}) "
                f"while lr={lr:.3g} is still at least {cfg.plateau_lr_fraction:.0%} of its peak",
            )

    def _check_grad_norm(self, state: _ModeState, grad_norm: float, step: int, mode: str) -> None:
        """A norm above its mode's running median: an explosion (grad_explosion_factor times), or a spike
        (grad_spike_factor times). A mode's first min_history records have no running median yet: they
        are judged for spikes against each other from the third on, so a spike on a mode's first step
        is found once the records after it show the mode's level."""
        cfg = self.cfg
        if len(state.grad_norms) < cfg.min_history:
            self._check_first_grad_norms(state, (step, grad_norm, False), mode)
        else:
            median = statistics.median(state.grad_norms)
            if state.latches["grad_spike"].fire(grad_norm > cfg.grad_spike_factor * median):
                self._raise_grad_spike(grad_norm, step, mode, median, f"its running median {median:.4g}")
            elif state.latches["grad"].fire(grad_norm > cfg.grad_explosion_factor * median):
                self._raise(
                    "grad_explosion",
                    "warning",
                    step,
                    f"grad norm {grad_norm:.4g} in mode {mode} is {grad_norm / median:.0f}x its running "
                    f"median {median:.4g}",
                )
        state.grad_norms.append(grad_norm)

    def _check_first_grad_norms(self, state: _ModeState, record: tuple[int, float, bool], mode: str) -> None:
        judged = state.first_grad_norms
        judged.append(record)
        if len(judged) < 3:
            return
        median = statistics.median(g for _, g, _ in judged)
        for i, (step, grad_norm, alerted) in enumerate(judged):
            if not alerted and grad_norm > self.cfg.grad_spike_factor * median:
                level = f"the median {median:.4g} of the mode's first {len(judged)} records"
                self._raise_grad_spike(grad_norm, step, mode, median, level)
                judged[i] = (step, grad_norm, True)

    def _raise_grad_spike(self, grad_norm: float, step: int, mode: str, median: float, level: str) -> None:
        self._raise(
            "grad_spike",
            "warning",
            step,
            f"grad norm {grad_norm:.4g} in mode {mode} is {grad_norm / median:.2g}x {level}",
        )

    def _check_throughput(self, state: _ModeState, record: dict, step: int, mode: str) -> None:
        if self.num_records < self._warm_from:  # first steps: allocation, compilation, worker start-up
            return
        self._check_data_wait(record, step)
        work, seconds = work_of(record), compute_seconds(record)
        if work is None or seconds is None:
            return
        cfg = self.cfg
        load = machine_state_of(record)
        slow = 1 / (1 - cfg.throughput_drop)  # slowdown at which samples/s is throughput_drop lower
        if len(state.cost) < cfg.throughput_min_history:
            state.cost.add(work, seconds)
            self._typical_loads.append(load)
            return
        slowdown = state.cost.slowdown(work, seconds)
        latch, halfway = self._latches["throughput"], 1 + (slow - 1) / 2
        if slowdown <= slow and latch.armed:  # slow steps, and all during a drop, stay out of the line,
            state.cost.add(work, seconds)  # so a long slowdown does not become the norm
            self._typical_loads.append(load)
        self._slowdowns.append((step, mode, slowdown, load))
        self.slowdowns.append((step, slowdown))
        median = statistics.median(s for _, _, s, _ in self._slowdowns)
        full = len(self._slowdowns) == cfg.throughput_window
        if full and median <= halfway:
            latch.fire(False)  # back near the line: a later drop is a new episode
        elif full and median > slow and latch.fire(True):
            self._report_drop([record for record in self._slowdowns if record[2] > slow], median, step, slow)

    def _report_drop(self, slow_records: list[tuple], median: float, step: int, slow: float) -> None:
        """A throughput drop at `step` made of `slow_records` (step, mode, slowdown, MachineState): a
        note where the machine explains it, else a warning."""
        cfg = self.cfg
        modes = ", ".join(sorted({mode for _, mode, _, _ in slow_records}))
        drop = (
            f"since step {slow_records[0][0]} the steps (mode {modes}) ran {1 - 1 / median:.0%} below the "
            f"samples/s that their FLOPs predict (median of the last {cfg.throughput_window} records against "
            f"each mode's step-cost line; alert above {cfg.throughput_drop:.0%})"
        )
        busy, machine = self._machine_during(slow_records, slow)
        if busy:
            message = f"the machine was busy: {drop}; {machine}"
            self.notes.append(Alert("throughput_drop", "note", step, message, REMEDIES["busy_machine"]))
        else:
            self._raise("throughput_drop", "warning", step, f"{drop}; {machine}")

    def _machine_during(self, slow_records: list[tuple], slow: float) -> tuple[bool, str]:
        """(whether the machine explains the slow records of a drop, what it did, in words). Explained: the
        process got less CPU time than in its typical records, and per CPU second it got the steps ran
        within the drop threshold of their line (`slow`); or the load average stood above the CPU count,
        at least busy_load_rise above what the typical records saw beside the process's own CPU use."""
        typical = [load for load in self._typical_loads if load is not None]
        loads = [load for _, _, _, load in slow_records]
        usual_cpu = statistics.median(load.cpu_s_per_s for load in typical) if typical else 0.0
        if len(typical) < self.cfg.throughput_min_history or None in loads or usual_cpu <= 0:  # records say nothing
            return False, (
                "a likely cause: a second busy process on the same cores makes torch's threads wait for each "
                "other; see train.threads"
            )
        usual_others = statistics.median(load.others for load in typical)
        cpu = statistics.median(load.cpu_s_per_s for load in loads)
        load_1m = statistics.median(load.load_1m for load in loads)
        num_cpus = loads[-1].num_cpus
        rise = statistics.median(load.others for load in loads) - usual_others
        per_cpu_second = statistics.median(s * load.cpu_s_per_s / usual_cpu for _, _, s, load in slow_records)
        starved = per_cpu_second <= slow
        crowded = load_1m > num_cpus and rise >= self.cfg.busy_load_rise
        machine = (
            f"this process got {cpu:.2f} CPU seconds per second ({usual_cpu:.2f} in its typical records); the "
            f"1-minute load average was {load_1m:.1f} on {num_cpus} CPUs, {abs(rise):.1f} "
            f"{'more' if rise >= 0 else 'fewer'} tasks of other processes than in its typical records"
        )
        if starved:
            return True, f"{machine}: per CPU second it got, the steps ran as fast as their line predicts"
        if crowded:
            return True, f"{machine}: other processes kept more tasks running than there are CPUs"
        return False, f"{machine}: the machine does not explain it, the run itself slowed"

    def _check_data_wait(self, record: dict, step: int) -> None:
        cfg = self.cfg
        if not finite(record.get("data_wait_share")):
            return
        self._data_wait.append(record["data_wait_share"])
        share = statistics.median(self._data_wait)
        full = len(self._data_wait) == cfg.throughput_window
        if self._latches["data_wait"].fire(full and share > cfg.data_wait_share):
            self._raise(
                "data_wait",
                "warning",
                step,
                f"the loader held up {share:.0%} of the step time (median of the last "
                f"{cfg.throughput_window} records; alert above {cfg.data_wait_share:.0%})",
            )

    def _check_memory(self, record: dict, step: int) -> None:
        cfg = self.cfg
        memory = memory_of(record)
        if memory is None or self.num_records < self._warm_from:
            return
        shapes = record.get("num_shapes")
        self._memory.append((step, memory, shapes if finite(shapes) else None))
        if self._memory_start is None:
            self._memory_start = (step, memory)
        if len(self._memory) < cfg.memory_window:
            return
        # Steady growth, not one jump (a mode using a bigger head for the first time): the medians of
        # the window's three thirds rise in order, and no single record adds half of the rise.
        steps, values, _ = zip(*self._memory)
        (s1, _, s3), (m1, m2, m3) = thirds(steps), thirds(values)
        rise = m3 - m1
        largest_jump = max(b - a for a, b in zip(values, values[1:]))
        steady = m1 < m2 < m3 and largest_jump < 0.5 * rise
        large = rise > max(cfg.memory_creep_fraction * m1, cfg.memory_creep_min_gib)
        latch = self._latches["memory"]
        if not (steady and large):
            latch.fire(False)  # the rise has stopped: a later one is a new episode
        elif not self._warming_up(s1, m1, s3, m3) and latch.fire(True):
            self._raise(
                "memory_creep",
                "warning",
                step,
                f"memory rose steadily from {m1:.3g} to {m3:.3g} GiB over the last {cfg.memory_window} "
                f"records (+{rise / m1:.0%}, {rise / (s3 - s1) * 1024:.2g} MiB per step) {self._after_what()}",
            )

    def _warming_up(self, s1: float, m1: float, s3: float, m3: float) -> bool:
        """Whether the window's growth is warm-up: caches filling as input shapes are met for the first
        time. With shape counts: less than half of the rise came between records with no new shape
        in between. Without (older records): the growth is no faster than memory_acceleration x the
        run's own pace before the window, since warm-up is fastest at the start and a leak that
        starts later runs ahead of it."""
        records = list(self._memory)
        if self._shapes_known():
            pairs = zip(records, records[1:])
            without_new_shapes = sum(b[1] - a[1] for a, b in pairs if b[2] == a[2])
            return without_new_shapes <= 0.5 * (m3 - m1)
        start_step, start_memory = self._memory_start
        if s1 <= start_step:
            return True  # no history before the window to compare with
        earlier_pace = max(m1 - start_memory, 0.0) / (s1 - start_step)
        return (m3 - m1) / (s3 - s1) <= self.cfg.memory_acceleration * earlier_pace

    def _shapes_known(self) -> bool:
        return all(shapes is not None for _, _, shapes in self._memory)

    def _after_what(self) -> str:
        if self._shapes_known():
            return "between records that met no new input shape: not a cache warming up"
        return f"at more than {self.cfg.memory_acceleration:g}x the run's pace before: not its warm-up"

    # ---------------------------------------------------------------- summaries

    def trend(self, mode: str) -> float | None:
        """Relative change of the rolling median loss of `mode` over the last trend_window records."""
        state = self._modes.get(mode)
        if state is None or len(state.previous_medians) < 2:
            return None
        first, last = state.previous_medians[0], state.previous_medians[-1]
        return last / first - 1 if first else None


def status_of(alerts: list[Alert]) -> str:
    """healthy, warning or critical: the worst severity among `alerts`."""
    severities = {a.severity for a in alerts}
    return "critical" if "critical" in severities else "warning" if severities else "healthy"
