"""`mmldlm bench`: two training configs (default configs/baseline.yaml vs configs/optimized.yaml) on
the same model and data, measured in one run; with `ladder`, every step from the first to the
second adding one group of performance keys at a time; with `variants`, further rows set against
the baseline (e.g. the optimized config with checkpointing forced where `auto` chose none). The data
is data.path, or with `synthetic` random tokens of a stated shape (mmldlm/data/synthetic.py).

How it measures, and why:
1. Each config trains in its own worker process (spawned). Peak memory is a per-process quantity
   (on CPU the resident set never shrinks back cleanly inside one process after a larger config
   ran), so one process per config is the honest way to give each its own peak.
2. On a CPU the workers take turns: round after round each runs `round_steps` optimizer steps while
   the others wait, so a slow phase of a shared machine hits every config alike, and no two configs
   compete for the cores. On a GPU the configs run one after another, each alone in its own process
   (`rows`): a waiting config would hold its weights and optimizer state in the one GPU's memory
   (12-13 GiB each at 1B parameters, where the baseline at 2048 tokens needs over 50 GiB itself),
   and a GPU's step times do not drift as a shared CPU's do. Warm-up steps first (compile,
   allocator, loader workers), not measured.
3. Every config runs the same steps: same seed, data order, modes and noise; only speed differs.
4. Step time: median and spread (p10..p90) over the measured steps; samples/s = global batch /
   median step time; tokens/s = median over steps of real (non-pad) tokens / step time, and the
   real tokens of all measured steps over their summed time (steps of different lengths weighed by
   their work: bucketed and packed batches differ there).
5. Peak memory over the measured steps: CUDA max allocated; on CPU the peak resident set size minus
   the worker's RSS before it built anything (the Python runtime and torch), i.e. what training adds:
   weights, gradients, optimizer state, activations, temporaries. Loader worker processes are not
   counted (they hold batches, not the model). Reported also as the part above the training state
   (16 bytes per parameter: fp32 weights, gradients, AdamW moments), which no switch here changes in
   one process and which dominates small batches: that part is what checkpointing, attention and
   precision act on.
6. Largest micro-batch under a memory cap: in a fresh process per config, the auto micro-batch probe
   (mmldlm/training/batch_size.py: one joint-mode forward + backward of the heaviest batch of that
   size the data yield, plus AdamW state) at 1, 2, 4, ... until the cap is passed, then bisected. The probe runs eagerly
   (compile off: it would recompile at every probed size); checkpointing and attention as configured.
7. MFU from the model's FLOPs per sample and the device's peak (mmldlm.training.metrics), only where
   the peak is known: never on CPU.
8. With `processes` > 1 every config runs as that many ranks of one process group on this machine
   (gloo over loopback on CPU, NCCL with one GPU per rank), which is how DDP and FSDP2 differ in
   memory: the peak is per process (the largest over the ranks), the training-state split is per
   process (FSDP2 shards weights, gradients and AdamW state over the ranks, HSDP over a shard group
   of them; DDP holds them whole in each), samples/s counts the global batch. The largest-micro-batch
   search runs in one process and is skipped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import wait as wait_for_replies
from pathlib import Path

import torch
import yaml

from mmldlm.config import flat_keys, load_config, to_dict
from mmldlm.data.dataset import die_with_the_main_process
from mmldlm.data.prepare import default_prepare_options, prepare
from mmldlm.data.synthetic import SyntheticShape, write_synthetic
from mmldlm.device import describe_device, pick_device
from mmldlm.errors import UserError
from mmldlm.outputs import write_atomically
from mmldlm.tools.reference import build_reference_trainer
from mmldlm.training.batch_size import batch_shape, largest_fitting, probe_or_none, spaced_sizes
from mmldlm.training.distributed import init_distributed
from mmldlm.training.metrics import current_memory_bytes, peak_memory_bytes, release_free_memory, reset_peak_memory
from mmldlm.training.optim import STATE_BYTES
from mmldlm.training.run import build_trainer as build_run_trainer
from mmldlm.wording import counted

log = logging.getLogger(__name__)

# The ladder from baseline to optimized: each rung sets these keys to the optimized config's values
# (only the keys whose values differ; a rung with none is left out). Keys that differ but are in
# no rung form a last rung, so the ladder always ends exactly at the optimized config. The loader
# comes first: the baseline's 16 worker processes per config then exist in one config only.
LADDER = [
    (
        "loader: workers, prefetch, persistence",
        ["data.num_workers", "data.prefetch_factor", "data.persistent_workers", "data.pin_memory"],
    ),
    ("SDPA attention", ["model.attention"]),
    ("fused AdamW", ["optim.fused", "optim.foreach"]),
    ("bf16 autocast where native", ["train.precision"]),
    (
        "freeze once per mode, no unused-parameter search",
        ["perf.refreeze_every_step", "distributed.find_unused_parameters", "distributed.static_graph"],
    ),
    ("MSE latent loss", ["latent_diffusion.loss"]),
    ("text head fused with its loss", ["perf.fused_text_loss"]),
    ("activation checkpointing", ["perf.activation_checkpointing", "perf.checkpoint_every_k"]),
    ("compile, padding to 64", ["perf.compile", "data.pad_to_multiple"]),
]
IGNORED = {"train.run_dir"}  # differs between presets without changing what is measured
REFERENCE = "reference: plain transformer"  # the row of BenchOptions.reference


@dataclasses.dataclass
class BenchOptions:
    baseline: str = "baseline"
    optimized: str = "optimized"
    overrides: list[str] = dataclasses.field(default_factory=list)  # applied to every config
    steps: int = 10  # measured optimizer steps per config
    warmup: int = 3
    round_steps: int = 2  # steps per config per round
    ladder: bool = False
    # Further rows, each "NAME [section.key=value ...]" like baseline and optimized, measured with
    # them and set against the baseline: e.g. the optimized config with checkpointing forced.
    variants: list[str] = dataclasses.field(default_factory=list)
    # A last row: a plain transformer of the optimized config's text-stream dimensions, trained with its
    # switches on full rows of the data's longest text (mmldlm/tools/reference.py); every row's tokens/s
    # and MFU are then also given over the reference's.
    reference: bool = False
    # Random tokens and latents of this shape instead of data.path (mmldlm/data/synthetic.py).
    synthetic: SyntheticShape | None = None
    fit: bool = True
    memory_cap_gib: float = 8.0
    max_micro_batch: int = 512
    processes: int = 1  # ranks per config (one machine): per-process memory of DDP vs FSDP2
    rows: str = "auto"  # in-turns | one-at-a-time | auto: in turns on a CPU, one at a time on a GPU
    out: str = "runs/bench"


# -------------------------------------------------------------------------------- configs


def _override(key: str, value) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def split_config(text: str) -> tuple[str, list[str]]:
    """ "NAME [section.key=value ...]" -> (NAME, its own overrides): a config of one row, e.g.
    "optimized distributed.strategy=fsdp2"."""
    name, *overrides = shlex.split(text)
    return name, overrides


def _unique(names: list[str]) -> list[str]:
    """Row names, a repeated one numbered: two runs of one config are "NAME" and "NAME (2)"."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return unique


def bench_configs(opts: BenchOptions) -> list[dict]:
    """[{name, role, config, changes, overrides}] to run: baseline and optimized, or with opts.ladder
    every rung between them; then each of opts.variants. The shared overrides come first, then the
    row's own (see split_config); `changes` are the keys where the row differs from the baseline."""
    first_name, first_own = split_config(opts.baseline)
    base = [*opts.overrides]
    first = flat_keys(to_dict(load_config(first_name, [*base, *first_own])))

    def row(role: str, text: str) -> dict:
        name, own = split_config(text)
        keys = flat_keys(to_dict(load_config(name, [*base, *own])))
        differ = [key for key in first if first[key] != keys[key] and key not in IGNORED]
        return {"name": text, "role": role, "config": name, "changes": differ, "overrides": [*base, *own]}

    variants = [row("variant", text) for text in opts.variants]
    if opts.reference:
        variants.append({**row("reference", opts.optimized), "name": REFERENCE, "changes": []})
    if not opts.ladder:
        rows = [row("baseline", opts.baseline), row("optimized", opts.optimized), *variants]
        for r, name in zip(rows, _unique([r["name"] for r in rows])):
            r["name"] = name
        return rows
    last = row("optimized", opts.optimized)
    last_keys = flat_keys(to_dict(load_config(last["config"], last["overrides"])))
    rungs, covered, applied = [], set(), [*base, *first_own]
    rungs.append(
        {"name": "baseline", "role": "baseline", "config": first_name, "changes": [], "overrides": list(applied)}
    )
    groups = LADDER + [("other differences", [k for k in last["changes"] if not any(k in keys for _, keys in LADDER)])]
    for label, keys in groups:
        changes = [k for k in keys if k in last["changes"] and k not in covered]
        if not changes:
            continue
        covered.update(changes)
        applied += [_override(k, last_keys[k]) for k in changes]
        rungs.append(
            {"name": f"+ {label}", "role": "rung", "config": first_name, "changes": changes, "overrides": list(applied)}
        )
    if len(rungs) > 1:
        rungs[-1]["name"] += " (= optimized)"
        rungs[-1]["role"] = "optimized"
    return [*rungs, *variants]


# -------------------------------------------------------------------------------- workers


def _setup_worker_logging(name: str) -> None:
    """A worker says what its config does (optimizer, checkpointing) under its name. The notes on the
    data, the same for every config, are the parent's to give once (main_job_data); torch's advice to
    run fewer loader workers is the baseline recipe's 16 workers, which is what is measured."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[bench {name}] %(message)s"))
    root = logging.getLogger("mmldlm")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False
    logging.getLogger("mmldlm.training.run").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)


def build_trainer(config: str, overrides: list[str], run_dir: str, extra: list[str] = ()):
    cfg = load_config(config, [*overrides, f"train.run_dir={run_dir}", "logging.progress_bar=false", *extra])
    info = init_distributed(cfg.distributed, cfg.train.device)
    trainer = build_run_trainer(cfg, info)
    return cfg, info, trainer, trainer.heaviest_batch


def build_reference(config: str, overrides: list[str], run_dir: str):
    """build_trainer's result for the reference row (mmldlm/tools/reference.py)."""
    cfg = load_config(config, [*overrides, f"train.run_dir={run_dir}", "logging.progress_bar=false"])
    info = init_distributed(cfg.distributed, cfg.train.device)
    return cfg, info, build_reference_trainer(cfg, info), None


def _join_ranks(job: dict) -> None:
    """Make this worker rank `job["rank"]` of its config's `job["world_size"]` ranks on this machine:
    init_distributed reads torchrun's variables. On CPU the cores are shared out among the ranks
    (unless OMP_NUM_THREADS says otherwise): two ranks of two threads each on two cores would wait
    for each other's threads."""
    world = job["world_size"]
    os.environ.update(
        RANK=str(job["rank"]),
        LOCAL_RANK=str(job["rank"]),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))


# The figures of a training step that the report reads.
RECORD_KEYS = (
    "step",
    "mode",
    "loss",
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "global_batch_size",
    "micro_batch_size",
    "accumulation_steps",
    "data_wait_share",
    "real_token_share",
    "record_steps",
    "mfu",
)


def _setup_reply(cfg, info, trainer) -> dict:
    """What the parent learns of a config once it is built: device, batch sizes, ranks, parameters."""
    return {
        "ok": True,
        "device": str(info.device),
        "micro_batch_size": trainer.micro_batch_size,
        "activation_checkpointing": trainer.activation_checkpointing,  # what runs: auto resolved
        "step_in_backward": trainer.step_in_backward,
        "state_dtype": cfg.optim.state_dtype,
        "global_batch_size": cfg.train.global_batch_size,
        "world_size": info.world_size,
        "strategy": cfg.distributed.strategy,
        "num_shards": cfg.distributed.num_shards(info.world_size, info.local_world_size),
        "parameters": sum(p.numel() for p in trainer.raw_model.parameters()),
        "bytes_per_parameter": trainer.bytes_per_parameter(),
    }


def _train_steps(trainer, device: torch.device, num_steps: int, release_memory: bool) -> list[dict]:
    """`num_steps` optimizer steps, their records cut to RECORD_KEYS; then the config hands back
    what a waiting config need not hold. On a GPU the steps are read back once, at the end, as
    training reads them once per record: a read after every step would make the host wait for the
    device each step, which training does not (training/tally.py); the record is then their mean."""
    if device.type == "cuda":
        pending = [trainer.run_step() for _ in range(num_steps)]
        records = [trainer.read_record(pending[-1])]
    else:
        records = [trainer.train_step() for _ in range(num_steps)]
    records = [{k: record.get(k) for k in RECORD_KEYS} for record in records]
    if release_memory and device.type == "cpu":
        # Ladder: waiting configs give back what the step freed, so N configs fit in
        # memory at once (the next step then faults its pages in again, a cost every rung
        # pays per byte it uses). The peak already recorded stays.
        release_free_memory()
    if device.type == "cuda":
        # The configs share one GPU and take turns: a waiting config's cached blocks
        # would otherwise stay reserved and starve the running one.
        torch.cuda.empty_cache()
    return records


def _train_worker(conn, job: dict, run_dir: str) -> None:
    """Serve ("steps", n) / ("reset_memory",) / ("memory",) / ("stop",) for one config (one rank of
    it when job["world_size"] > 1)."""
    _setup_worker_logging(job["name"] if job["world_size"] == 1 else f"{job['name']} rank {job['rank']}")
    os.setpgrp()  # its own process group: the parent can end it with its loader workers (_Worker.close)
    die_with_the_main_process(job["parent_pid"])
    try:
        if job["world_size"] > 1:
            _join_ranks(job)

        runtime = current_memory_bytes(torch.device("cpu"))  # before anything is built
        build = build_reference if job["role"] == "reference" else build_trainer
        cfg, info, trainer, _ = build(job["config"], job["overrides"], run_dir)
        if info.device.type == "cuda":
            runtime = 0  # CUDA's allocated counter starts at zero for this process
            torch.cuda.empty_cache()  # what set-up probed is not held while the other configs run
        conn.send(_setup_reply(cfg, info, trainer))
        while True:
            command = conn.recv()
            if command[0] == "steps":
                records = _train_steps(trainer, info.device, command[1], job["release_memory"])
                conn.send({"ok": True, "records": records})
            elif command[0] == "reset_memory":
                reset_peak_memory(info.device)
                conn.send({"ok": True})
            elif command[0] == "memory":
                peak = peak_memory_bytes(info.device)
                conn.send({"ok": True, "peak_bytes": peak, "runtime_bytes": runtime})
            else:
                conn.send({"ok": True})
                return
    except torch.OutOfMemoryError as err:  # the row is reported as such; exiting frees its memory for the others
        conn.send({"ok": False, "out_of_memory": True, "error": str(err).splitlines()[0]})
    except UserError as err:  # a bad config or dataset: one line from the parent, which names the config
        conn.send({"ok": False, "user_error": True, "error": str(err)})
    except Exception as err:  # reported to the parent, which names the config
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})


def _fit_worker(conn, job: dict, run_dir: str, cap_bytes: float, max_size: int) -> None:
    """The largest micro-batch under `cap_bytes`, to within 1/8 (batch_size.largest_fitting over spaced_sizes)."""
    _setup_worker_logging(job["name"] + " fit")
    os.setpgrp()
    die_with_the_main_process(job["parent_pid"])
    try:
        extra = ["perf.compile=false", "train.micro_batch_size=1", "train.global_batch_size=1", "data.num_workers=0"]
        if load_config(job["config"], job["overrides"]).perf.activation_checkpointing == "auto":
            # auto checkpoints as much as a micro-batch needs; the largest it can fit is under full.
            extra.append("perf.activation_checkpointing=full")
        _, info, trainer, heaviest = build_trainer(job["config"], job["overrides"], run_dir, extra)
        peaks = {}

        def fits(size: int) -> bool:
            peaks[size] = probe_or_none(
                trainer.model, trainer.objective, size, heaviest, info.device, trainer._autocast
            )
            return peaks[size] is not None and peaks[size] <= cap_bytes

        sizes = spaced_sizes(max_size)
        largest = largest_fitting(sizes, fits) or 0
        conn.send(
            {
                "ok": True,
                "largest": largest,
                "capped_by_max": largest == sizes[-1],
                "heaviest_batch_at_largest": batch_shape(heaviest(max(largest, 1))),
                "peaks_gib": {
                    str(k): round(v / 2**30, 3) if v is not None else None  # None: out of memory
                    for k, v in sorted(peaks.items())
                },
            }
        )
    except UserError as err:
        conn.send({"ok": False, "user_error": True, "error": str(err)})
    except Exception as err:
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})


class OutOfMemory(Exception):
    """A row's worker ran out of device memory at its micro-batch (and exited, freeing what it held):
    the row is reported as out of memory and the others go on."""


class _Worker:
    def __init__(self, ctx, target, job: dict, *args):
        self.job = job
        self.conn, child = ctx.Pipe()
        job = {**job, "parent_pid": os.getpid()}  # the worker dies with this process
        # Not a daemon: a daemon process may not start the DataLoader's worker processes.
        self.process = ctx.Process(target=target, args=(child, job, *args), daemon=False)
        self.process.start()

    def call(self, *command) -> dict:
        if command:
            self.conn.send(command)
        return self.receive()

    def receive(self) -> dict:
        who = f"config '{self.job['name']}'"
        if self.job.get("world_size", 1) > 1:
            who += f" rank {self.job['rank']}"
        try:
            reply = self.conn.recv()
        except EOFError:  # the process died without a word: killed (out of memory?) or crashed
            self.process.join(timeout=5)
            raise RuntimeError(
                f"bench: {who} ({self.job['config']} {' '.join(self.job['overrides'])}) "
                f"exited with status {self.process.exitcode} without a reply"
            ) from None
        if not reply["ok"] and reply.get("out_of_memory"):
            raise OutOfMemory(reply["error"])
        if not reply["ok"] and reply.get("user_error"):
            raise UserError(f"config '{self.job['name']}': {reply['error']}")
        if not reply["ok"]:
            raise RuntimeError(
                f"bench: {who} ({self.job['config']} {' '.join(self.job['overrides'])}) failed: {reply['error']}"
            )
        return reply

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():  # stuck or interrupted: end it and its loader workers, by group
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.join()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Ranks:
    """The worker processes of one config, one per rank: a command goes to every rank (their steps
    hold collectives, so all must run together), and the first failing rank fails the call at once,
    while its peers may still wait in a collective for it (close() then ends them)."""

    def __init__(self, ctx, job: dict, run_dir: str, processes: int):
        self.job = job
        port = _free_port() if processes > 1 else 0
        self.workers = [
            _Worker(ctx, _train_worker, {**job, "rank": r, "world_size": processes, "port": port}, run_dir)
            for r in range(processes)
        ]

    def call(self, *command) -> list[dict]:
        """The replies of all ranks, by rank."""
        for worker in self.workers:
            if command:
                worker.conn.send(command)
        pending = {worker.conn: rank for rank, worker in enumerate(self.workers)}
        replies = {}
        while pending:
            for conn in wait_for_replies(list(pending)):
                rank = pending.pop(conn)
                replies[rank] = self.workers[rank].receive()
        return [replies[rank] for rank in range(len(self.workers))]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


# -------------------------------------------------------------------------------- the run


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)

    def quantile(q: float) -> float:
        pos = q * (len(ordered) - 1)
        low = math.floor(pos)
        return ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (pos - low)

    return {
        "median": statistics.median(ordered),
        "p10": quantile(0.1),
        "p90": quantile(0.9),
        "min": ordered[0],
        "max": ordered[-1],
    }


def _median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _summary(setup: dict, records: list[dict], memory: list[dict]) -> dict:
    """The figures of one config; `memory` holds every rank's peak, and the largest is the config's."""
    times = [r["step_time_s"] for r in records]
    per_rank_gib = [(m["peak_bytes"] - m["runtime_bytes"]) / 2**30 for m in memory]
    peak_gib = max(per_rank_gib)
    # The training state in one process: fp32 weights (4 bytes per parameter), gradients (4; none
    # held all at once with optim.step_in_backward) and AdamW's two moments (8 in fp32, about 2 in
    # int8, 1 in int4: optim.state_dtype), each divided over the ranks by FSDP2 (over a shard group by
    # HSDP) and whole in every DDP rank. The rest of the peak is activations, low-precision weight
    # copies, DDP's gradient buckets, FSDP2's gathered weights, and temporaries.
    world = setup.get("world_size", 1)
    params = setup["parameters"] / setup.get("num_shards", 1)
    split = {
        "weights_gib": 4 * params / 2**30,
        "gradients_gib": 0.0 if setup.get("step_in_backward") else 4 * params / 2**30,
        "optimizer_state_gib": STATE_BYTES[setup.get("state_dtype", "fp32")] * params / 2**30,
    }
    state_gib = sum(split.values())
    step_time = _spread(times)
    device_is_cuda = setup["device"].startswith("cuda")
    return {
        "micro_batch_size": setup["micro_batch_size"],
        "activation_checkpointing": setup.get("activation_checkpointing"),
        "global_batch_size": setup["global_batch_size"],
        "accumulation_steps": records[0]["accumulation_steps"],
        "measured_steps": sum(r.get("record_steps") or 1 for r in records),
        "step_time_s": step_time,
        "samples_per_s": setup["global_batch_size"] / step_time["median"],
        # From the fastest step: on a shared machine the least disturbed estimate of what the config can do.
        "best_samples_per_s": setup["global_batch_size"] / step_time["min"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        # Real tokens of all measured steps over their time: where steps differ in length (bucketed
        # batches draw a bucket of short or long texts, packed ones a mix), the throughput of the work.
        "total_tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in records) / sum(times),
        "data_wait_share": statistics.median(r["data_wait_share"] for r in records),
        "peak_memory_gib": peak_gib,  # per process: the largest over the ranks
        "peak_memory_per_rank_gib": per_rank_gib,
        "processes": world,
        "strategy": setup.get("strategy", "ddp"),
        "state_gib": state_gib,
        **split,
        "peak_above_state_gib": peak_gib - state_gib,
        # What each parameter moves through memory per step (training/traffic.py): weights, gradients, optimizer.
        "bytes_per_parameter": setup.get("bytes_per_parameter"),
        "peak_memory_kind": "cuda_max_allocated" if device_is_cuda else "cpu_peak_rss_above_runtime",
        "peak_rss_gib": None if device_is_cuda else max(m["peak_bytes"] for m in memory) / 2**30,
        "mfu": _median_of(records, "mfu"),  # on real tokens: padding is not counted
        "real_token_share": _median_of(records, "real_token_share"),
        "losses": [r["loss"] for r in records],
        "step_times_s": times,  # in order: a shared machine's disturbances show as outliers
        # Compiled rows: graphs compiled by the end (one that grew in the measured steps recompiled
        # there), and under CUDA graphs those inductor ran without them.
        "compiled_graphs": records[-1].get("compiled_graphs"),
        "cuda_graph_skips": records[-1].get("cuda_graph_skips"),
    }


def _drop(group: _Ranks, live: list[_Ranks], err: OutOfMemory) -> None:
    """Mark `group`'s row as out of memory, end its workers and take it out of `live`."""
    group.job["out_of_memory"] = str(err)
    group.close()
    live.remove(group)
    log.info("bench: %s ran out of memory: %s", group.job["name"], err)


def _turn(live: list[_Ranks], *command) -> dict:
    """{name: the replies of its ranks} of each live row in turn; a row out of memory is dropped."""
    replies = {}
    for group in list(live):
        try:
            replies[group.job["name"]] = group.call(*command)
        except OutOfMemory as err:
            _drop(group, live, err)
    return replies


def _follow_optimized(job: dict, jobs: list[dict]) -> bool:
    """Give the reference row the micro-batch and activation checkpointing the optimized row runs with
    (its `auto`s resolved); False where the optimized row did not start (out of memory)."""
    setup = next((j.get("setup") for j in jobs if j["role"] == "optimized"), None)
    if setup is None:
        job["not_measured"] = "not measured: the optimized row, whose micro-batch it takes, did not start"
        return False
    job["overrides"] = [
        *job["overrides"],
        f"train.micro_batch_size={setup['micro_batch_size']}",
        f"perf.activation_checkpointing={setup['activation_checkpointing']}",
    ]
    return True


def _start_configs(ctx, jobs: list[dict], scratch: str, processes: int, all_jobs: list[dict]) -> list[_Ranks]:
    """Build every config of `jobs` in its workers; each job gets its setup reply (a row that cannot
    even be built in memory is dropped). On any other failure the configs already started are ended.
    `all_jobs`: every row of the run (the reference row follows the optimized one's set-up)."""
    groups = []
    try:
        for i, job in enumerate(jobs):  # one at a time: setups do not compete for the cores
            if job["role"] == "reference" and not _follow_optimized(job, all_jobs):
                continue
            job["release_memory"] = len(jobs) > 2
            groups.append(_Ranks(ctx, job, os.path.join(scratch, f"run{i}"), processes))
            replies = _turn(groups[-1:])
            if not replies:
                groups.pop()
                continue
            job["setup"] = replies[job["name"]][0]
            log.info(
                "bench: %s ready (%s%s, micro-batch %d)",
                job["name"],
                job["setup"]["device"],
                f" x {processes} processes" if processes > 1 else "",
                job["setup"]["micro_batch_size"],
            )
    except BaseException:
        for group in groups:
            group.close()
        raise
    return groups


def _measure(groups: list[_Ranks], opts: BenchOptions) -> tuple[dict, dict]:
    """({name: step records}, {name: every rank's memory}) of the rows that ran to the end: warm-up
    rounds, then the measured rounds, the configs taking turns. `groups` keeps the rows still live."""
    records = {group.job["name"]: [] for group in groups}
    for _ in range(math.ceil(opts.warmup / opts.round_steps)):
        _turn(groups, "steps", opts.round_steps)
    _turn(groups, "reset_memory")
    for r in range(math.ceil(opts.steps / opts.round_steps)):
        # every rank records the same global step figures; rank 0's are kept
        for name, replies in _turn(groups, "steps", opts.round_steps).items():
            records[name] += replies[0]["records"]
        log.info("bench: round %d/%d done", r + 1, math.ceil(opts.steps / opts.round_steps))
    memory = _turn(groups, "memory")
    return {name: records[name] for name in memory}, memory


def _fitted_jobs(jobs: list[dict]) -> list[dict]:
    """The rows whose largest micro-batch is searched: all but a ladder's intermediate rungs."""
    return [job for job in jobs if job["role"] not in ("rung", "reference")]


def _largest_micro_batches(ctx, jobs: list[dict], scratch: str, opts: BenchOptions) -> dict:
    """{name: the fit worker's reply} of each of `jobs`, each in a fresh process."""
    fits = {}
    for job in jobs:
        worker = _Worker(
            ctx,
            _fit_worker,
            job,
            os.path.join(scratch, "fit"),
            opts.memory_cap_gib * 2**30,
            opts.max_micro_batch,
        )
        try:
            fits[job["name"]] = worker.call()
        finally:
            worker.close()
    return fits


def _ratios(results: dict, first: str, last: str, fitted: bool) -> dict | None:
    """The last config's figures over the first's; None where either ran out of memory."""
    if "out_of_memory" in results[first] or "out_of_memory" in results[last]:
        return None
    ratios = {
        key: results[last][key] / results[first][key]
        for key in (
            "samples_per_s",
            "best_samples_per_s",
            "tokens_per_s",
            "total_tokens_per_s",
            "peak_memory_gib",
            "peak_above_state_gib",
        )
    }
    if fitted:
        ratios["largest_micro_batch"] = (
            results[last]["largest_micro_batch"] / results[first]["largest_micro_batch"]
            if results[first]["largest_micro_batch"]
            else None
        )
    return ratios


def main_job_data(opts: BenchOptions) -> list[str]:
    """The override that gives every config the main job's data, where no config names data.path: the
    presets leave it null, which would prepare the whole bundled corpus (154k texts, minutes of encoding)
    in each worker. The main job's (configs/default.yaml: a seeded 50k subset) is what `make train`
    prepared into the cache; it is prepared here, once, where it is not there yet. The `data.` overrides
    given to every config apply to it too (`data.max_samples=400`: a 400-text subset)."""
    configs = [split_config(opts.baseline), split_config(opts.optimized)]
    if any(load_config(name, [*opts.overrides, *own]).data.path is not None for name, own in configs):
        return []
    main_job = load_config("default", [o for o in opts.overrides if o.startswith("data.")]).data
    prepare_options = dataclasses.replace(default_prepare_options(main_job), progress=sys.stderr.isatty())
    log.info(
        "bench: data: the main job's dataset (configs/default.yaml; no config names data.path): %s", prepare_options.out
    )
    path = prepare(prepare_options, log=lambda _line: None)["path"]
    return [f"data.path={path}"]


SYNTHETIC_DATA = "synthetic-data"  # under opts.out: the dataset of --synthetic-*, rewritten by each run


def with_synthetic_data(opts: BenchOptions) -> BenchOptions:
    """`opts` reading the dataset of opts.synthetic, written under opts.out: every row's data.path and
    model.latent_dim set ahead of the shared overrides. Without opts.synthetic, `opts` itself."""
    if opts.synthetic is None:
        return opts
    path = write_synthetic(opts.synthetic, Path(opts.out) / SYNTHETIC_DATA)
    own = [f"data.path={path}", f"model.latent_dim={opts.synthetic.latent_dim}"]
    return dataclasses.replace(opts, overrides=[*own, *opts.overrides])


def rows_one_at_a_time(opts: BenchOptions, jobs: list[dict]) -> bool:
    """Whether the rows run one after another (opts.rows; auto: where the first row trains on a GPU)."""
    if opts.rows != "auto":
        return opts.rows == "one-at-a-time"
    first = load_config(jobs[0]["config"], jobs[0]["overrides"])
    return pick_device(first.train.device).type == "cuda"


def _row_line(name: str, figures: dict) -> str:
    """One row's figures in one line, logged as soon as they are measured (a run cut off later keeps them)."""
    mfu = f", MFU {100 * figures['mfu']:.1f}%" if figures["mfu"] is not None else ""
    if figures.get("real_token_share") is not None:
        mfu += f" on {100 * figures['real_token_share']:.0f}% real tokens"
    return (
        f"bench: {name}: {figures['samples_per_s']:.2f} samples/s, {figures['tokens_per_s']:,.0f} tokens/s, "
        f"peak {figures['peak_memory_gib']:.2f} GiB{mfu} (micro-batch {figures['micro_batch_size']})"
    )


def _measure_all(ctx, jobs: list[dict], opts: BenchOptions, scratch: str, fitted: bool) -> dict:
    """{name: figures} of every row: the measured steps, then the largest micro-batches."""
    turns = [[job] for job in jobs] if rows_one_at_a_time(opts, jobs) else [jobs]
    results = {}
    for batch in turns:
        groups = _start_configs(ctx, batch, scratch, opts.processes, jobs)
        try:
            records, memory = _measure(groups, opts)
        finally:
            for group in groups:
                group.close()
        for job in batch:
            figures = (
                _summary(job["setup"], records[job["name"]], memory[job["name"]])
                if job["name"] in records
                else {key: job[key] for key in ("out_of_memory", "not_measured") if key in job}
            )
            if job["name"] in records:
                log.info("%s", _row_line(job["name"], figures))
            results[job["name"]] = {
                "config": job["config"],
                "changes": job["changes"],
                "overrides": job["overrides"],
                **figures,
            }
    if fitted:
        for name, fit in _largest_micro_batches(ctx, _fitted_jobs(jobs), scratch, opts).items():
            results[name]["largest_micro_batch"] = fit["largest"]
            results[name]["largest_micro_batch_probe"] = {k: v for k, v in fit.items() if k != "ok"}
    return results


def run_bench(opts: BenchOptions, command: str = "") -> dict:
    """Run the benchmark; write bench.json and bench.md into opts.out; return the report."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    opts = with_synthetic_data(opts)
    opts = dataclasses.replace(opts, overrides=[*main_job_data(opts), *opts.overrides])
    jobs = bench_configs(opts)
    fitted = opts.fit and opts.processes == 1
    with tempfile.TemporaryDirectory(prefix="bench-", dir=out) as scratch:
        results = _measure_all(mp.get_context("spawn"), jobs, opts, scratch, fitted)

    first = jobs[0]["name"]
    optimized = next((job["name"] for job in jobs if job["role"] == "optimized"), first)
    setup = next((job["setup"] for job in jobs if "out_of_memory" not in job and "setup" in job), None)
    if setup is None:
        raise UserError(
            f"bench: every config ran out of memory ({jobs[0]['out_of_memory']}); "
            "lower train.micro_batch_size or the text length"
        )
    report = {
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(setup["device"]),
        "model_parameters": setup["parameters"],
        "data": opts.synthetic.describe() if opts.synthetic else None,
        "options": dataclasses.asdict(opts),
        "wall_time_s": round(time.time() - started, 1),
        "baseline": first,
        "optimized": optimized,
        "configs": results,
        "ratios": _ratios(results, first, optimized, fitted),
        # Each further row's figures over the baseline's.
        "variant_ratios": {
            job["name"]: _ratios(results, first, job["name"], fitted) for job in jobs if job["role"] == "variant"
        },
        "order": [job["name"] for job in jobs],
    }
    write_atomically(out / "bench.md", markdown(report))
    write_atomically(out / "bench.json", json.dumps(report, indent=2) + "\n")
    return report


def _machine(device: str) -> dict:
    machine = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": describe_device(torch.device("cpu")),
    }
    if device.startswith("cuda"):
        machine["gpu"] = describe_device(torch.device(device))
    return machine


# -------------------------------------------------------------------------------- the report


def _table_header(report: dict) -> list[str]:
    """The columns of the configs' table: the memory column named by what was measured, the largest
    micro-batch where it was searched, the steps of a ladder."""
    configs, order = report["configs"], report["order"]
    memory_kind = next(configs[n]["peak_memory_kind"] for n in order if "peak_memory_kind" in configs[n])
    memory_label = "peak CUDA alloc GiB" if memory_kind == "cuda_max_allocated" else "peak RSS above runtime GiB"
    if report["options"].get("processes", 1) > 1:
        memory_label += " per process"
    header = [
        "config",
        "micro x accum",
        "samples/s",
        "tokens/s",
        "step s (median)",
        "step s (min, p10-p90)",
        memory_label,
        "weights / grads / AdamW / rest GiB",
        "bytes/param/step",
        "real tokens",
        "MFU (real tokens)",
    ]
    if "largest_micro_batch" in configs[order[0]]:
        header.append(f"largest micro-batch @ {report['options']['memory_cap_gib']:g} GiB")
    if _compared_rows(order) > 2:
        header += ["vs previous", "vs baseline"]
    if _reference(report) is not None:
        header += ["tokens/s ÷ reference", "MFU ÷ reference"]
    return header


def _compared_rows(order: list[str]) -> int:
    """The rows set against the baseline (every row but the reference)."""
    return sum(name != REFERENCE for name in order)


def _reference(report: dict) -> dict | None:
    """The reference row's figures, where it was asked for and measured."""
    reference = report["configs"].get(REFERENCE)
    return reference if reference is not None and "tokens_per_s" in reference else None


def _over_reference(c: dict, reference: dict) -> list[str]:
    """c's real tokens/s and MFU over the reference's (all steps' tokens over their time: texts of
    different lengths weighed by their work), blank where c has none."""
    if "tokens_per_s" not in c:
        return ["", ""]
    cells = [f"{c['total_tokens_per_s'] / reference['total_tokens_per_s']:.2f}"]
    both = c["mfu"] is not None and reference["mfu"]
    return cells + [f"{c['mfu'] / reference['mfu']:.2f}" if both else "n/a"]


def _speed_ratio(c: dict, other: dict | None) -> str:
    """c's samples/s over other's, blank where either has none (out of memory, or no other)."""
    if other is None or "samples_per_s" not in c or "samples_per_s" not in other:
        return ""
    return f"{c['samples_per_s'] / other['samples_per_s']:.2f}x"


def _table_row(
    name: str, c: dict, fit: bool, ladder: bool, first: dict, previous: dict | None, reference: dict | None
) -> list[str]:
    """One config's cells; on a ladder, its samples/s over the rung before and over the baseline; with
    a reference row, its tokens/s and MFU over the reference's. A row out of memory at the micro-batch
    says so (and shows the largest that fits, where searched)."""
    if "out_of_memory" in c or "not_measured" in c:
        row = [name, "out of memory" if "out_of_memory" in c else c["not_measured"], *[""] * 9]
    else:
        row = _measured_cells(name, c)
    if fit:
        row.append(str(c["largest_micro_batch"]) if "largest_micro_batch" in c else "")
    if ladder:
        row += [_speed_ratio(c, previous), _speed_ratio(c, first)]
    if reference is not None:
        row += _over_reference(c, reference)
    return row


def _measured_cells(name: str, c: dict) -> list[str]:
    return [
        name,
        f"{c['micro_batch_size']} x {c['accumulation_steps']}"
        # Absent from reports written before it was recorded (scripts/gpu_report.py reads old ones).
        + (f", AC {c['activation_checkpointing']}" if c.get("activation_checkpointing") else ""),
        f"{c['samples_per_s']:.2f}",
        f"{c['tokens_per_s']:.0f}",
        f"{c['step_time_s']['median']:.3f}",
        f"{c['step_time_s']['min']:.3f}, {c['step_time_s']['p10']:.3f}-{c['step_time_s']['p90']:.3f}",
        f"{c['peak_memory_gib']:.2f}",
        " / ".join(f"{c.get(k, 0.0):.2f}" for k in ("weights_gib", "gradients_gib", "optimizer_state_gib"))
        + f" / {c['peak_above_state_gib']:.2f}",
        # Absent from reports written before it was counted (scripts/gpu_report.py reads old ones).
        f"{c['bytes_per_parameter']:.0f}" if c.get("bytes_per_parameter") is not None else "",
        # Absent from reports written before it was measured (scripts/gpu_report.py reads old ones).
        f"{c['real_token_share']:.0%}" if c.get("real_token_share") is not None else "",
        f"{c['mfu']:.1%}" if c["mfu"] is not None else "n/a",
    ]


def _ratio_line(label: str, r: dict | None) -> str:
    """One config's figures over the baseline's, `label` naming both."""
    if r is None:
        return f"{label}: no ratios, one of them ran out of memory at this micro-batch."
    return (
        f"{label}: samples/s **{r['samples_per_s']:.2f}x** (from the fastest steps "
        f"{r['best_samples_per_s']:.2f}x), tokens/s {r['tokens_per_s']:.2f}x"
        # Absent from reports written before it was measured (scripts/gpu_report.py reads old ones).
        + (f" (all steps' tokens over their time {r['total_tokens_per_s']:.2f}x)" if "total_tokens_per_s" in r else "")
        + f", peak memory at equal batch **{r['peak_memory_gib']:.2f}x** "
        f"(the rest, above the training state: {r['peak_above_state_gib']:.2f}x)"
        + (f", largest micro-batch **{r['largest_micro_batch']:.2f}x**" if r.get("largest_micro_batch") else "")
        + "."
    )


def _ratio_lines(report: dict) -> list[str]:
    """What the training state is, and the optimized config's (and each further row's) figures over
    the baseline's."""
    options = report["options"]
    lines = [
        "",
        "Training state: fp32 weights 4 bytes per parameter, gradients 4 (none held all at once "
        "with optim.step_in_backward), AdamW moments 8 (about 2 with optim.state_dtype=int8, 1 with "
        "int4); rest = activations, low-precision copies, temporaries. AC: the activation checkpointing "
        "that ran (auto resolved). bytes/param/step: what each parameter moves through memory in a step "
        "(weight casts and reads, gradients, clipping, AdamW, EMA; mmldlm/training/traffic.py).",
        "",
        _ratio_line(f"{options['optimized']} / {options['baseline']}", report["ratios"]),
        "",
    ]
    for name, ratios in report.get("variant_ratios", {}).items():
        lines += [_ratio_line(f"{name} / {report['baseline']}", ratios), ""]
    compiled = [
        f"{name} {counted(c['compiled_graphs'], 'graph')}"
        + (f" ({c['cuda_graph_skips']} run without CUDA graphs)" if c.get("cuda_graph_skips") is not None else "")
        for name, c in report["configs"].items()
        if c.get("compiled_graphs") is not None
    ]
    if compiled:
        lines += [f"Compiled by the end of the measured steps: {'; '.join(compiled)}.", ""]
    return lines


# Below this many measured steps per config a step-time spread says nothing: the ratios are not read.
MIN_DECIDING_STEPS = 5


def _decision_lines(report: dict) -> list[str]:
    """A line where the measured steps cannot tell the baseline from the optimized config: too few of them,
    or times per sample whose spreads (p10..p90) overlap; none where they do not (or a row ran out of memory)."""
    steps = report["options"]["steps"]
    names = report.get("baseline", report["order"][0]), report.get("optimized", report["order"][-1])
    rows = [report["configs"][name] for name in names]
    if any("step_time_s" not in row for row in rows):
        return []
    (low_a, high_a), (low_b, high_b) = (
        [row["step_time_s"][q] / row["global_batch_size"] for q in ("p10", "p90")] for row in rows
    )
    apart = high_a < low_b or high_b < low_a
    if steps >= MIN_DECIDING_STEPS and apart:
        return []
    return [
        f"**Too few steps to decide**: {steps} measured steps per config, time per sample p10..p90 "
        f"{low_a * 1e3:.3g}..{high_a * 1e3:.3g} ms against {low_b * 1e3:.3g}..{high_b * 1e3:.3g} ms"
        + ("" if apart else " (overlapping)")
        + f": the ratios above may be noise. Measure again with --steps {max(30, 2 * steps)}, or the two do "
        "not differ in speed.",
        "",
    ]


def markdown(report: dict) -> str:
    """The report as markdown: the configs side by side, the ratios, and the ladder when there is one."""
    configs, order = report["configs"], report["order"]
    m = report["machine"]
    device = m.get("gpu", f"CPU ({m['cpus']} cores, {m['torch_threads']} torch threads)")
    processes = report["options"].get("processes", 1)
    lines = [
        f"# mmldlm bench ({report['date']})",
        "",
        f"`{report['command']}`" if report["command"] else "",
        "",
        f"{device}, torch {m['torch']}; model {report['model_parameters']:,} parameters; "
        + (f"each config as {processes} processes (ranks of one process group); " if processes > 1 else "")
        + f"{report['options']['steps']} measured steps per config after {report['options']['warmup']} "
        f"warm-up, {report['options']['round_steps']} per turn; wall time {report['wall_time_s']:.0f} s.",
        "",
    ]
    if report.get("data"):
        lines += [f"Data: {report['data']}.", ""]
    header = _table_header(report)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    fit, ladder = "largest_micro_batch" in configs[order[0]], _compared_rows(order) > 2
    variants = report.get("variant_ratios", {})
    first, previous, reference = configs[order[0]], None, _reference(report)
    for name in order:
        cells = _table_row(name, configs[name], fit, ladder, first, previous, reference)
        lines.append("| " + " | ".join(cells) + " |")
        previous = configs[name]
    lines += _ratio_lines(report)
    lines += _decision_lines(report)
    if report["options"].get("ladder"):
        lines += ["Ladder rungs (keys each one sets to the optimized value):", ""]
        lines += [f"- {name}: {', '.join(configs[name]['changes'])}" for name in order[1:] if name not in variants]
        lines.append("")
    return "\n".join(lines)
