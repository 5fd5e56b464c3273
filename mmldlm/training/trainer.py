"""The training loop: one code path for 1 process, N processes and N nodes.

One optimizer step (`train_step`):
1. The global batch of this step (progressive schedule) fixes the accumulation: global batch =
   micro batch x world size x accumulation steps.
2. Each micro-step draws its noise from a generator seeded by (seed, step, global micro index),
   global micro index = accumulation index x world size + rank. A run on 1 process with 2
   accumulation steps and a run on 2 processes with 1 see the same micro-batches with the same noise
   in the same positions, and a resumed run needs no generator state: noise is a function of the step.
3. Forward/backward under autocast; the gradient all-reduce runs only on the last micro-step
   (`no_sync` before it); the idle output head is anchored into the loss (see parallelize.py).
4. One all-reduce carries every rank's loss, a non-finite flag and a stop request: if any rank saw
   a non-finite loss or the gradient norm is non-finite, every rank skips the update (decided on the
   device); a signal makes every rank checkpoint and exit with status 128 + the signal's number, at
   the end of this step (one process) or of the next (several: the flag is read a step late).
5. Clip, step, log, checkpoint (with optim.step_in_backward each parameter is stepped inside
   backward instead). An asynchronous checkpoint copies the state during the next step's forward
   and backward; the update waits for that copy.

A step reads nothing back from the device unless its record is written (train.log_every; tally.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mmldlm import baseline
from mmldlm.config import ConfigError, PerfConfig, RunConfig, batch_split, infeasible
from mmldlm.data.dataset import batch_shape_count
from mmldlm.data.errors import DataError
from mmldlm.device import auto_precision
from mmldlm.diffusion import rng
from mmldlm.model.info import training_flops_per_sample
from mmldlm.model.mmdit import grouped_mm, padded_row_count
from mmldlm.runs.files import CheckpointError
from mmldlm.threads import AutoThreads
from mmldlm.training.batch_size import (
    batch_shape,
    default_memory_cap,
    find_micro_batch,
    full_length_batch,
    global_batch_sizes,
    per_process_micro_batch,
    probe_or_none,
)
from mmldlm.training.checkpoint import CheckpointManager
from mmldlm.training.compute_weights import ComputeWeights, compute_weights_off_reason
from mmldlm.training.distributed import DistInfo, collective_guard
from mmldlm.training.ema import WeightEMA
from mmldlm.training.evaluation import evaluate_during_training
from mmldlm.training.init_from import init_weights
from mmldlm.training.metrics import MachineLoad, MetricsLogger, cpu_has_native_bf16, memory_stats, peak_flops
from mmldlm.training.optim import STATE_BYTES, build_optimizer, gradient_norm
from mmldlm.training.parallelize import (
    anchor,
    apply_activation_checkpointing,
    apply_fsdp,
    checkpointed_blocks,
    eager_blocks,
    no_grad_sync,
    parallelize,
    uses_anchor,
)
from mmldlm.training.profiler import profiler_window
from mmldlm.training.schedules import LRSchedule
from mmldlm.training.storage import WriteError
from mmldlm.training.tally import AgreedStop, SkipCounter, StepTotals, Window
from mmldlm.training.traffic import bytes_per_parameter
from mmldlm.wording import counted

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingStep:
    """A step whose work is queued on the device; its record is built when read (`Trainer.read_record`)."""

    step: int  # optimizer steps done after it
    mode: str
    lr: float
    grad_norm: torch.Tensor  # () on the device
    totals: StepTotals
    global_batch: int
    num_accum: int
    stop: bool  # every rank checkpoints and exits after this step (a signal)
    record: dict | None = None


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite updates in a row); checkpoints are untouched."""


def resolve_precision(name: str, device: torch.device) -> str:
    """ "auto": bf16 autocast (fp32 master weights and optimizer) where the hardware multiplies bf16
    natively, a CUDA GPU with bf16 (fp16 with loss scaling on older GPUs) or a CPU with AVX512-BF16/AMX;
    fp32 elsewhere, also on a device without autocast (meta) whatever the host CPU. Tests and debugging
    that compare numbers across machines pin `fp32`."""
    if name != "auto":
        if name == "fp16" and device.type != "cuda":
            raise ConfigError(
                "config key 'train.precision': got 'fp16'; fp16 with loss scaling needs CUDA; use bf16 or fp32 on CPU"
            )
        return name
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and cpu_has_native_bf16()
    return auto_precision(device.type, native)


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int, key: str) -> int:
    problem = batch_split(key, global_batch, micro_batch, world_size)
    if problem is not None:
        raise problem.error()
    return global_batch // (micro_batch * world_size)


def micro_seed(seed: int, step: int, micro_index: int) -> int:
    """Seed of the noise of one micro-batch: distinct per (seed, step, global micro index)."""
    return (seed * 1_000_003 + step) * 65_537 + micro_index & (2**63 - 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": list(np.random.get_state()), "torch": torch.get_rng_state()}
    state["numpy"][1] = state["numpy"][1].tolist()  # plain lists: loadable with weights_only
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = list(state["numpy"])
    numpy[1] = np.array(numpy[1], dtype=np.uint32)
    np.random.set_state(tuple(numpy))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and exits. A second
    SIGINT interrupts at once."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum
        log.warning("received %s: checkpointing at the end of this step, then exiting", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Owns the wrapped model, optimizer, schedule, checkpoints and metrics of one run.

    `loader` is a loader (an iterable, not callable), or a callable of the micro-batch size that builds one: with
    train.micro_batch_size=auto the size is known only once the set-up model has been probed.
    `heaviest_batch(size)`: the heaviest batch of `size` samples the loader yields (a CPU batch), which
    the memory probes of `auto` checkpointing and micro-batch run; by default every text at
    `max_seq_len` (default model.max_seq_len)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: nn.Module,
        objective,
        loader,
        info: DistInfo,
        max_seq_len: int | None = None,
        heaviest_batch: Callable[[int], dict] | None = None,
    ):
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(cfg.train.run_dir)
        self.device = info.device
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self._set_up_model(model, objective, max_seq_len, heaviest_batch)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        # The parameters as they train (FSDP2's shards once wrapped), listed once for every step's
        # gradient norm: parameters() walks every module, about 0.6 ms a step at 24 blocks. Plain
        # parameters (not FSDP2's DTensors) of one device and dtype have plain gradients of one device
        # and dtype: they take `gradient_norm`'s shortest path unchecked.
        self._params = list(self.raw_model.parameters())
        self._plain_grads = all(type(p) is nn.Parameter for p in self._params) and (
            len({(p.device, p.dtype) for p in self._params}) == 1
        )
        self.schedule = LRSchedule(cfg.schedule, cfg.optim.lr, cfg.train.steps)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        self.loader = loader(self.micro_batch_size) if callable(loader) else loader
        self._batches = iter(self.loader)
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir, info)
        # On the host: the step's draws, and what it decides from them, never wait for the device.
        self.generator = torch.Generator()
        self.anchor_idle = uses_anchor(cfg.distributed, info)
        self.peak_flops = peak_flops(self.device)
        self.step = 0  # optimizer steps done
        # Skipped updates: counted on the device (tally.py); the host's numbers as of the last record.
        self.skips = SkipCounter(self.device)
        self.num_skipped = self.consecutive_skips = self.longest_skip_run = 0
        self.window = Window(self.device)  # the steps since the last record
        self.machine_load = MachineLoad()  # the CPU time this process got since the last record, and the load
        self.auto_threads: AutoThreads | None = None  # train.threads=auto: the loop follows the machine's load
        self.agreed_stop = AgreedStop(self.device)
        self._flops_of_mode: dict[str, tuple[float, float, float, float]] = {}  # _flops_polynomial's, by mode
        # (mode, micro-batch, padded length, text-head rows) met so far in this process. Caches grow
        # with each new one (oneDNN keeps its kernels per shape), so the monitor reads memory growth
        # while the count still rises as warm-up, and growth after it stopped as a leak.
        self._input_shapes: set[tuple] = set()
        # Wall-clock seconds of training (all starts of this run together; start-up not counted): the
        # compute a model card reports. fit() starts the clock.
        self.wall_seconds: float | None = 0.0
        self._clock_started = None
        self.metrics: MetricsLogger | None = None
        self._last_saved = -1
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded
        self.stopped_by: str | None = None  # the signal's name when a signal ended fit() early
        self._refuse_infeasible(self.micro_batch_size)
        self.step_in_backward = cfg.optim.step_in_backward
        if self.step_in_backward:
            self._setup_step_in_backward()
        # Clipping folded into the fused AdamW (`_gradient_norm`): its gradients are plain tensors (not
        # FSDP2's shards) and no loss scaler unscales them first.
        self.clip_in_optimizer = (
            bool(self.optimizer.defaults.get("fused"))
            and self.scaler is None
            and not (info.distributed and cfg.distributed.shards_model)
        )
        self.compute_weights: ComputeWeights | None = None
        if cfg.perf.compute_weights:
            off = compute_weights_off_reason(self.precision, info.distributed, self.step_in_backward)
            if off is None:
                self.compute_weights = ComputeWeights(self.raw_model, cfg.perf.fused_text_loss)
                log.info(
                    "perf.compute_weights: bf16 copies of %d weights (%.1f%% of the parameters; %.2f GiB kept "
                    "with their float32 gradients)",
                    len(self.compute_weights.copies),
                    100 * self.compute_weights.share(),
                    self.compute_weights.num_bytes() / 2**30,
                )
            else:
                log.info("perf.compute_weights: off: %s", off)

    def _group_linears(self, wanted: bool, compiled: bool) -> None:
        """perf.grouped_linears on every block of the trained model that has two streams to group
        (not the plain transformer's of `bench --reference`), where grouped_mm has kernels for it: a
        CUDA device's and the compiled one's (perf.compile, any device) take bf16 alone, in rows of a
        multiple of 16 bytes; a CPU runs any precision and size eagerly."""
        blocks = [block for block in getattr(self.raw_model, "blocks", []) if hasattr(block, "grouped_linears")]
        off = None
        if wanted and grouped_mm is None:
            off = f"torch {torch.__version__} has no grouped_mm"
        elif wanted and (self.device.type == "cuda" or compiled):
            where = "compiled" if compiled else f"on {self.device}"
            sizes = {n for block in blocks for m in block.modules() if isinstance(m, nn.Linear) for n in m.weight.shape}
            if self.precision != "bf16":
                off = f"grouped products {where} need bf16 precision, not {self.precision}"
            elif any(n % 8 for n in sizes):
                off = f"grouped products {where} need layer sizes of multiples of 8, not {sorted(sizes)}"
        if off is not None:
            log.info("perf.grouped_linears: off: %s", off)
        for block in blocks:
            block.grouped_linears = wanted and off is None

    def _set_up_model(self, model: nn.Module, objective, max_seq_len: int | None, heaviest_batch) -> None:
        """The model on the device with its EMA copy, activation checkpointing resolved, parallelized, and
        the micro-batch size (probed on the set-up model under "auto")."""
        cfg, info = self.cfg, self.info
        self.raw_model = model.to(self.device)
        # The EMA copy is taken from the plain model, before checkpointing, compile or wrapping.
        self.ema = WeightEMA(self.raw_model, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        if self.device.type == "cuda":
            # cuDNN's attention rebuilt its execution plan for every new padding mask: about 2.7 ms
            # of host time per call (base preset on an H100), more than the kernel itself. The
            # flash and memory-efficient kernels take masks without that; perf.cudnn_attention keeps
            # it for few shapes and CUDA graphs (docs/benchmarks-gpu.md). Set both ways: the switch
            # is the process's, and an earlier trainer may have turned it off.
            torch.backends.cuda.enable_cudnn_sdp(cfg.perf.cudnn_attention)
        self._group_linears(cfg.perf.grouped_linears, cfg.perf.compile)
        self.micro_batch_size = cfg.train.micro_batch_size  # "auto": probed once the model is set up
        if self.micro_batch_size != "auto":
            self.micro_batch_size = self._micro_batch_for_world_size(self.micro_batch_size)
        self.heaviest_batch = heaviest_batch or functools.partial(
            full_length_batch,
            seq_len=max_seq_len or self.raw_model.cfg.max_seq_len,
            vocab_size=self.raw_model.vocab_size,
            num_latents=self.raw_model.cfg.num_latents,
            latent_dim=self.raw_model.cfg.latent_dim,
        )
        perf = cfg.perf
        if perf.activation_checkpointing == "auto":
            perf = dataclasses.replace(perf, activation_checkpointing=self._choose_checkpointing(objective))
        self.activation_checkpointing = perf.activation_checkpointing  # what runs: auto resolved
        longest = cfg.data.max_length or max_seq_len or self.raw_model.cfg.max_seq_len
        self.model = parallelize(
            self.raw_model,
            perf,
            cfg.distributed,
            info,
            self._may_accumulate(cfg, info),
            num_shapes=batch_shape_count(cfg.data, longest),
        )
        # The compiled blocks' CUDA graphs: each micro-batch starts a new iteration of their tree
        # (the outputs of the previous one may then be overwritten: none is read after its backward).
        self.cuda_graphs = perf.cuda_graphs and self.device.type == "cuda"
        self._warned_cuda_graph_skips = False
        if perf.cuda_graphs and not self.cuda_graphs:
            log.info("perf.cuda_graphs: CUDA graphs need a CUDA device; on %s the blocks compile alone", self.device)
        if self.ema is not None and info.distributed and cfg.distributed.shards_model:
            apply_fsdp(self.ema.module, info.mesh)
        self.objective = objective
        if self.micro_batch_size == "auto":
            self.micro_batch_size = self._find_micro_batch()

    def _refuse_infeasible(self, micro_batch: int | None) -> None:
        """The first reason the config cannot run on this world size in micro-batches of `micro_batch`
        (None: auto, before the probe), before step 0: every scheduled batch size must split, and
        optim.step_in_backward needs one process without accumulation (mmldlm.config.infeasible)."""
        problems = infeasible(self.cfg, self.info.world_size, micro_batch)
        if problems:
            raise problems[0].error()

    def _may_accumulate(self, cfg: RunConfig, info: DistInfo) -> bool:
        """Whether a step may run several micro-batches: a scheduled global batch above micro-batch x
        world size, or a micro-batch still to be searched for at start-up ("auto")."""
        sizes = [cfg.train.global_batch_size] + [size for _, size in cfg.train.batch_schedule]
        return self.micro_batch_size == "auto" or any(size > self.micro_batch_size * info.world_size for size in sizes)

    def _backward_with_updates(self, loss: torch.Tensor, idle: list[nn.Parameter]) -> None:
        """optim.step_in_backward's backward: the hooks update each parameter as its gradient arrives
        (the idle head's excepted). A non-finite loss takes no backward at all (the step is then
        skipped, as in the ordinary step)."""
        if not torch.isfinite(loss):
            return
        self._idle = {id(p) for p in idle}
        self._in_step = True
        try:
            loss.backward()
        finally:
            self._in_step = False

    def _setup_step_in_backward(self) -> None:
        """optim.step_in_backward: a post-accumulate-grad hook on every parameter runs AdamW on that
        parameter alone and frees its gradient, as in PyTorch's tutorial on fusing the optimizer step
        into backward. The optimizer, its state dict and the LR schedule stay those of the ordinary
        step, so checkpoints are the same either way. One process without accumulation, which the hooks
        need, is checked before (`_refuse_infeasible`)."""
        self._in_step = False  # the hooks act only inside train_step's backward, never in a probe
        self._idle: set[int] = set()
        self._grad_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        self._bad_grads = 0

        def hook(param: nn.Parameter) -> None:
            if not self._in_step:
                return
            if id(param) in self._idle:  # the idle head never moves (see train_step)
                param.grad = None
                return
            # The norm in the gradient's own dtype: no copy of it; a non-finite element makes it non-finite.
            norm = torch.linalg.vector_norm(param.grad.detach())
            self._grad_sq += norm.double() ** 2
            if torch.isfinite(norm):
                # AdamW over this parameter alone: its group's current values (lr from the schedule)
                # with one parameter, so the step does not walk every parameter for each one.
                groups = self.optimizer.param_groups
                self.optimizer.param_groups = [{**self._group_of[param], "params": [param]}]
                try:
                    self.optimizer.step()
                finally:
                    self.optimizer.param_groups = groups
            else:  # this parameter keeps its value; the ones updated before it keep their update
                self._bad_grads += 1
            param.grad = None

        self._group_of = {param: group for group in self.optimizer.param_groups for param in group["params"]}
        for param in self.raw_model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(hook)

    def _agree(self, fits: bool) -> bool:
        """The same decision on every rank: a MIN all-reduce of the flag."""
        if not self.info.distributed:
            return fits
        flag = torch.tensor([float(fits)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _memory_cap(self) -> float | None:

        cap = self.cfg.train.memory_cap_gib
        return cap * 2**30 if cap is not None else default_memory_cap(self.device)

    def _choose_checkpointing(self, objective) -> str:
        """perf.activation_checkpointing=auto: the least checkpointing (none, selective, full) under
        which one joint-mode forward + backward of the heaviest micro-batch the data yield, plus
        AdamW's state, fits the memory cap (train.memory_cap_gib; by default 90% of the GPU, or on CPU 80% of
        the machine's memory). Recomputing costs time; checkpointing only what memory needs keeps a
        run that fits as fast as it can be."""

        micro = self.micro_batch_size
        if micro == "auto":
            log.info(
                "activation checkpointing: auto -> none (train.micro_batch_size=auto sizes the "
                "micro-batch to fit without it)"
            )
            return "none"
        cap = self._memory_cap()
        if cap is None:  # CUDA: leave headroom for the allocator's fragmentation
            cap = 0.9 * torch.cuda.get_device_properties(self.device).total_memory
        peaks = {}
        for mode in ("none", "selective", "full"):
            apply_activation_checkpointing(self.raw_model, PerfConfig(activation_checkpointing=mode))
            peaks[mode] = probe_or_none(
                self.raw_model, objective, micro, self.heaviest_batch, self.device, self._autocast
            )
            if self._agree(peaks[mode] is not None and peaks[mode] <= cap) or mode == "full":
                break
        apply_activation_checkpointing(self.raw_model, PerfConfig(activation_checkpointing="none"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the probes ran the heaviest batch: give their blocks back
        if self.info.is_main:
            probed = ", ".join(
                f"{m} {p / 2**30:.2f} GiB" if p is not None else f"{m} out of memory" for m, p in peaks.items()
            )
            log.info(
                "activation checkpointing: auto -> %s (the heaviest micro-batch of the data, %s; cap %.2f GiB; "
                "probed peak: %s)",
                mode,
                batch_shape(self.heaviest_batch(micro)),
                cap / 2**30,
                probed,
            )
        return mode

    def _micro_batch_for_world_size(self, configured: int) -> int:
        """train.micro_batch_size, or each process's share of the global batch where the configured
        size on every process would be more than the global batch (see per_process_micro_batch)."""
        cfg, world_size = self.cfg.train, self.info.world_size
        global_batches = global_batch_sizes(cfg.global_batch_size, cfg.batch_schedule)
        micro = per_process_micro_batch(configured, global_batches, world_size)
        if micro != configured and self.info.is_main:
            log.info(
                "micro-batch: train.micro_batch_size=%d x %d processes is more than the global batch of %d; "
                "each process runs micro-batches of %d (accumulation %d for train.global_batch_size=%d)",
                configured,
                world_size,
                min(global_batches),
                micro,
                cfg.global_batch_size // (micro * world_size),
                cfg.global_batch_size,
            )
        return micro

    def _find_micro_batch(self) -> int:
        """train.micro_batch_size=auto: the largest micro-batch that fits (see batch_size.py), the
        same on every rank."""

        cfg, info = self.cfg.train, self.info
        batches = global_batch_sizes(cfg.global_batch_size, cfg.batch_schedule)
        self._refuse_infeasible(None)
        cap = self._memory_cap()
        with eager_blocks(self.cfg.perf):
            size, peaks = find_micro_batch(
                self.model,
                self.objective,
                [b // info.world_size for b in batches],
                self.heaviest_batch,
                self.device,
                cap,
                self._autocast,
                self._agree,
            )
        if info.is_main:
            probed = ", ".join(
                f"{b}: {p / 2**30:.2f} GiB" if p is not None else f"{b}: out of memory"
                for b, p in sorted(peaks.items())
            )
            log.info(
                "micro-batch: auto -> %d (cap %s; probed peak on the heaviest batch of the data, %s: %s); "
                "accumulation %d for the global batch of %d",
                size,
                f"{cap / 2**30:.2f} GiB" if cap else "none",
                batch_shape(self.heaviest_batch(size)),
                probed,
                cfg.global_batch_size // (size * info.world_size),
                cfg.global_batch_size,
            )
        return size

    # ---------------------------------------------------------------- state

    def resume(self, resume: str | None) -> None:
        """Restore from a checkpoint ("auto": the newest that verifies, if any), set aside the
        checkpoints of an abandoned continuation, and open metrics.jsonl accordingly."""
        path = self.checkpoints.resolve(resume)  # a bad --resume fails here, before the run is touched
        self.checkpoints.claim()
        try:
            keep_lines = self._restore(path)
        except BaseException:  # refused (other data, another model) or interrupted: no empty run directory left
            self.checkpoints.unclaim()
            raise
        # fp32 weights, AdamW's moments, the EMA's fp32 copy: what a checkpoint of this run takes
        bytes_per_param = 4 + STATE_BYTES[self.cfg.optim.state_dtype] + (4 if self.ema is not None else 0)
        self.checkpoints.warn_if_retention_cannot_fit(
            int(bytes_per_param * sum(p.numel() for p in self.raw_model.parameters()))
        )
        self.metrics = MetricsLogger(self.run_dir, self.cfg.logging, self.info.is_main, keep_lines)

    def _restore(self, path: Path | None) -> int:
        """The state of checkpoint `path` (None: a new run, from train.init_from where set); returns the
        lines of metrics.jsonl that the checkpoint's run had written by then (0 for a new run)."""
        if path is None and self.checkpoints.steps():
            raise CheckpointError(
                f"{self.checkpoints.dir} already holds checkpoints; pass --resume auto to "
                f"continue that run, or choose another train.run_dir"
            )
        if path is None:
            if self.cfg.train.init_from:
                self._init_from(self.cfg.train.init_from)
            return 0
        meta, state, rank_state = self.checkpoints.load(path, self.model, self.optimizer, self.ema)
        self.step = state["step"]
        self.num_skipped = state["num_skipped"]
        self.consecutive_skips = state["consecutive_skips"]
        self.skips = SkipCounter(self.device, self.num_skipped, self.consecutive_skips)
        self.wall_seconds = state.get("wall_seconds")  # None (unknown) in checkpoints that predate it
        self.schedule.load_state_dict(state["schedule"])
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        try:
            self.loader.load_state_dict(state["data"])
        except DataError as err:
            raise DataError(
                f"--resume {path}: {err}; to train on other data from its weights, start a new run "
                f"with --init-from {path}"
            ) from None
        self._batches = iter(self.loader)
        self._restore_rng(rank_state, meta)
        self._last_saved = self.step
        self.checkpoints.continue_from(path, self.step)
        self.resumed_from = path
        if self.info.is_main:
            log.info("resumed from %s at step %d", path, self.step)
        return meta["metrics_lines"]

    def _init_from(self, source: str) -> None:
        """A new run from the weights of `source` (train.init_from; training/init_from.py); the config
        records the checkpoint or exported folder they came from."""
        run = init_weights(self, source, self.cfg.train.init_weights)
        self.cfg.train.init_from = str(run.checkpoint.resolve())
        if self.info.is_main:  # the source's trained weights where it kept no EMA (the default asks for the EMA)
            kept = "" if run.weights == self.cfg.train.init_weights else ": the source kept no EMA"
            log.info(
                "initialized from %s (step %s, %s weights%s); optimizer, schedule, data position and step start afresh",
                self.cfg.train.init_from,
                run.step,
                run.weights,
                kept,
            )

    def _restore_rng(self, rank_state: dict | None, meta: dict) -> None:
        """This rank's RNG states as saved; from a checkpoint of another number of processes (there is
        then no state of this rank), derived from the seed, the step and the rank."""
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
            return
        seed_everything(micro_seed(self.cfg.train.seed, self.step, self.info.rank))
        if self.info.is_main:
            log.info(
                "resumed on %s from a checkpoint of %d: each rank's RNG is seeded from (train.seed, step %d, "
                "rank), not restored",
                counted(self.info.world_size, "process"),
                meta["world_size"],
                self.step,
            )

    def save(self, blocking: bool = False) -> None:
        self.num_skipped, self.consecutive_skips, _ = self.skips.read()
        state = {
            "step": self.step,
            "num_skipped": self.num_skipped,
            "consecutive_skips": self.consecutive_skips,
            "wall_seconds": self.elapsed_seconds(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.loader.state_dict(),  # the same on every rank: samples seen, not batches
        }
        rank_state = {"rng": rng_state()}
        self.checkpoints.save(
            self.step,
            self.model,
            self.optimizer,
            state,
            rank_state,
            self.cfg,
            self.metrics.num_lines if self.metrics else 0,
            blocking=blocking,
            ema=self.ema,
            dataset=self._dataset_dir(),
        )
        self._last_saved = self.step

    def _dataset_dir(self) -> str | None:
        """The absolute directory of the prepared dataset the loader reads, None for another loader."""
        path = getattr(getattr(self.loader, "dataset", None), "path", None)
        return str(Path(path).resolve()) if path is not None else None

    def elapsed_seconds(self) -> float | None:
        """Wall-clock seconds this run has trained, over all its starts, up to now; None when a
        checkpoint it resumed from did not record its own (the total is then unknown)."""
        if self._clock_started is None or self.wall_seconds is None:
            return self.wall_seconds
        started, before = self._clock_started
        return before + time.perf_counter() - started

    # ---------------------------------------------------------------- one step

    def global_batch_at(self, step: int) -> int:
        size = self.cfg.train.global_batch_size
        for first_step, scheduled in self.cfg.train.batch_schedule:
            if step >= first_step:
                size = scheduled
        return size

    def bytes_per_parameter(self) -> float:
        """The bytes each parameter moves per optimizer step of the first scheduled batch size, as this
        trainer runs it (training/traffic.py): its precision, accumulation, checkpointed blocks,
        clipping, EMA, optimizer state, bf16 compute weights and grouped products."""
        num_accum = accumulation_steps(
            self.global_batch_at(0), self.micro_batch_size, self.info.world_size, "train.global_batch_size"
        )
        perf = dataclasses.replace(self.cfg.perf, activation_checkpointing=self.activation_checkpointing)
        # Grouped: every linear layer of a grouped block, as in joint mode (l2t's and t2l's last block
        # groups its qkv alone): the most a step stacks.
        blocks = self.raw_model.blocks
        recomputed = sum(p.numel() for i in checkpointed_blocks(len(blocks), perf) for p in blocks[i].parameters())
        stacked = sum(
            m.weight.numel()
            for block in blocks
            if getattr(block, "grouped_linears", False)
            for m in block.modules()
            if isinstance(m, nn.Linear)
        )
        total = sum(p.numel() for p in self.raw_model.parameters())
        if self.cfg.optim.grad_clip <= 0 or self.step_in_backward:
            clip = "none"
        else:
            clip = "in_optimizer" if self.clip_in_optimizer else "separate"
        return bytes_per_parameter(
            self.precision,
            num_accum,
            recomputed / total,
            recomputes_products=self.activation_checkpointing != "selective",
            clip=clip,
            ema=self.ema is not None,
            state_dtype=self.cfg.optim.state_dtype,
            covered_share=self.compute_weights.share() if self.compute_weights is not None else 0.0,
            stacked_share=stacked / total,
        )

    def idle_parameters(self, mode: str) -> list[nn.Parameter]:
        if mode == "l2t":
            return list(self.raw_model.latent_head_parameters())
        if mode == "t2l":
            return list(self.raw_model.text_head_parameters())
        return []

    def _next_batch(self) -> dict:
        try:
            batch = next(self._batches)
        except StopIteration:  # end of an epoch: the loader starts the next one
            self._batches = iter(self.loader)
            batch = next(self._batches)
        # The batch's tensors to the device in one copy that the host does not wait for.
        keys = [k for k, v in batch.items() if torch.is_tensor(v)]
        moved = {**batch, **dict(zip(keys, rng.to_device_together([batch[k] for k in keys], self.device)))}
        if "pad_mask" in batch:  # each text's real tokens, counted on the host's copy: no read-back
            moved["text_lengths"] = tuple(batch["pad_mask"].numpy().sum(axis=1).tolist())
        return moved

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        # No cast cache: cached low-precision weight copies (2 bytes per parameter) would live until
        # the forward ends, outside what activation checkpointing frees; each weight is used once per
        # forward, so the cache saves no cast. Small preset, micro-batch 48: 2.21 vs 2.46 GiB peak RSS.
        return torch.autocast(self.device.type, dtype=dtype, cache_enabled=False)

    def train_step(self, stop: StopRequest | None = None) -> dict:
        """One optimizer step and its record, read back at once (what bench and the scripts time
        step by step); `fit` reads a record only at the steps it logs (`run_step`, `read_record`)."""
        return self.read_record(self.run_step(stop))

    def run_step(self, stop: StopRequest | None = None) -> PendingStep:
        """One optimizer step, queued: forward + backward over the micro-batches, the gradient norm
        (and clipping), the ranks' totals in one all-reduce, the update (or a skip, decided on the
        device). Nothing is read back from the device (tally.py says why); `read_record` reads it."""
        started = time.perf_counter()
        step = self.step
        global_batch = self.global_batch_at(step)
        num_accum = accumulation_steps(
            global_batch, self.micro_batch_size, self.info.world_size, "train.global_batch_size"
        )
        mode = self.objective.mode_at(step)
        idle = self.idle_parameters(mode)
        if self.cfg.perf.refreeze_every_step:  # baseline recipe
            baseline.refreeze(self.raw_model.parameters(), idle)
        lr = self.schedule.apply(self.optimizer, step)

        totals = self._forward_backward(mode, idle, num_accum)
        stop_here = stop is not None and stop.requested
        totals.close(stop_here)
        for p in idle:  # AdamW must not move the idle head (its gradient is an anchored zero or None)
            p.grad = None
        grad_norm = self._gradient_norm()
        stop_here = self._sum_over_ranks(totals, stop_here)
        self.checkpoints.wait_for_snapshot()  # an asynchronous save copies the state it saves until here
        loss_nonfinite = totals.values[5] > 0
        self._update(loss_nonfinite, loss_nonfinite | ~torch.isfinite(grad_norm))
        self.step += 1
        self.window.add(global_batch, totals, started)
        pending = PendingStep(self.step, mode, lr, grad_norm, totals, global_batch, num_accum, stop_here)
        if self.schedule.cfg.plateau.enabled:  # reduce-on-plateau needs each step's loss on the host
            self.read_record(pending)
        return pending

    def read_record(self, pending: PendingStep) -> dict:
        """The record of a queued step (the read-back: waits for the device), with the throughput of
        the steps since the previous record. Reading it twice returns the same record."""
        if pending.record is None:
            pending.record = self._record(pending)
            if not pending.record["skipped"]:
                self.schedule.observe(pending.record["loss"])
        return pending.record

    def _forward_backward(self, mode: str, idle: list[nn.Parameter], num_accum: int) -> StepTotals:
        """Forward and backward of each micro-batch (gradients accumulate; the data-parallel
        reduction runs with the last one); this rank's totals, on the device. Under
        perf.compute_weights the forwards and backwards read the bf16 copies."""
        totals = StepTotals(self.device)
        if self.cuda_graphs and num_accum > 1:
            self._stable_gradients()
        with self.compute_weights.active() if self.compute_weights is not None else contextlib.nullcontext():
            for a in range(num_accum):
                self._micro_batch(totals, mode, idle, a, num_accum)
        return totals

    def _micro_batch(self, totals: StepTotals, mode: str, idle: list[nn.Parameter], a: int, num_accum: int) -> None:
        """Forward and backward of the step's micro-batch `a` of `num_accum`, into `totals`."""
        cfg, info, step = self.cfg, self.info, self.step
        t0 = time.perf_counter()
        batch = self._next_batch()
        totals.data_wait_s += time.perf_counter() - t0
        self.generator.manual_seed(micro_seed(cfg.train.seed, step, a * info.world_size + info.rank))
        with (
            no_grad_sync(self.model, sync=a == num_accum - 1),
            collective_guard(f"gradient all-reduce of step {step + 1}", info),
        ):
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self._autocast():
                loss, metrics = self.objective(self.model, batch, step, generator=self.generator)
                if self.anchor_idle:
                    loss = anchor(loss, idle)
            scaled = loss / num_accum
            if self.step_in_backward:
                self.checkpoints.wait_for_snapshot()  # the updates below change what a save copies
                self._backward_with_updates(loss, idle)
            else:
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                if self.compute_weights is not None:
                    self.compute_weights.accumulate(first=a == 0)
        lengths = batch.get("text_lengths")
        if lengths is not None:
            tokens = float(sum(lengths))
        else:
            tokens = batch["pad_mask"].sum() if "pad_mask" in batch else float(batch["tokens"].numel())
        totals.add(loss, metrics, tokens, num_accum)
        self._count_work(totals, batch, mode, metrics.get("num_masked"))

    def _stable_gradients(self) -> None:
        """A zeroed .grad for every trained parameter that has none, before a step that accumulates
        under CUDA graphs: a parameter without one takes the first micro-batch's gradient as it is,
        and that tensor lives in the graphs' memory, which the next micro-batch's replay overwrites
        (torch then refuses to accumulate into it). With a buffer of its own, each micro-batch adds
        into it. (The update clears every gradient: the buffers are made again each such step.)"""
        for p in self.raw_model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _count_work(self, totals: StepTotals, batch: dict, mode: str, num_masked: int | None) -> None:
        """The micro-batch's training FLOPs into `totals`: on its real tokens (each text at its own
        length: MFU's), and as computed (every row at its padded length: what the step's time follows,
        the monitor's); the text head at the masked positions it ran at (counted on the host). Also the
        text positions its blocks computed, of them the real ones, and its shape."""
        computed = batch.get("pack_doc", batch["tokens"])  # (rows, text positions) the blocks ran on
        rows, positions = computed.shape
        a, b, c, per_head_row = self._flops_polynomial(mode)
        lengths = batch.get("text_lengths")
        if lengths is None:  # lengths unknown on the host: every position counts
            lengths = [positions] * rows
        totals.flops[0] += sum(a + b * n + c * n * n for n in lengths)
        totals.flops[1] += rows * (a + b * positions + c * positions * positions)
        totals.positions += rows * positions
        totals.real_positions += sum(lengths)
        if num_masked is not None:
            totals.flops = [flops + num_masked * per_head_row for flops in totals.flops]
        self._input_shapes.add((mode, rows, positions, padded_row_count(num_masked or 0)))

    def _flops_polynomial(self, mode: str) -> tuple[float, float, float, float]:
        """One text's training FLOPs in `mode` as a + b * n + c * n^2 for n tokens (linear layers are
        linear in n, attention quadratic: model/info.py), and what each text-head row adds."""
        if mode in self._flops_of_mode:
            return self._flops_of_mode[mode]
        count = functools.partial(
            training_flops_per_sample, self.raw_model, text_head=mode != "t2l", latent_head=mode != "l2t"
        )
        f1, f2, f3 = (count(n, text_head_rows=0.0) for n in (1, 2, 3))
        c = (f3 - 2 * f2 + f1) / 2
        b = f2 - f1 - 3 * c
        self._flops_of_mode[mode] = (f1 - b - c, b, c, count(1, text_head_rows=1.0) - f1)
        return self._flops_of_mode[mode]

    def _gradient_norm(self) -> torch.Tensor:
        """The global gradient norm (a device scalar), clipped to optim.grad_clip (after unscaling under
        fp16); with optim.step_in_backward, the norm of the gradients the updates in backward used.

        Clipping divides every gradient by max(1, (norm + 1e-6) / grad_clip) (clip_grad_norm_'s factor,
        inverted). The fused AdamW of one process or DDP takes that divisor as its `grad_scale` and
        divides each gradient as it reads it: one pass over the gradients less. The other optimizers
        get the gradients divided by the same number, so every path takes the same update."""
        if self.step_in_backward:
            grad_norm = self._grad_sq.sqrt() if self._bad_grads == 0 else self._grad_sq.new_tensor(math.nan)
            self._grad_sq = torch.zeros_like(self._grad_sq)
            self._bad_grads = 0
            return grad_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grads = [p.grad for p in self._params if p.grad is not None]
        grad_norm = gradient_norm(grads, plain=self._plain_grads)
        if math.isfinite(max_norm):
            divisor = torch.clamp((grad_norm + 1e-6) / max_norm, min=1.0)
            if self.clip_in_optimizer:
                self.optimizer.grad_scale = divisor.to(torch.float32)
            else:
                torch._foreach_div_(grads, divisor)  # as torch's clipping multiplies (FSDP2's DTensor shards too)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 and HSDP: the norm is a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def _sum_over_ranks(self, totals: StepTotals, stop_here: bool) -> bool:
        """One all-reduce carries every rank's losses, token count, non-finite flag and stop request;
        returns whether every rank stops after this step: one process, its own request; several, the
        request of any rank at the previous step (read a step late, so nobody waits for this one)."""
        if not self.info.distributed:
            return stop_here
        agreed = self.agreed_stop.previous()
        with collective_guard(f"loss all-reduce of step {self.step + 1}", self.info):
            torch.distributed.all_reduce(totals.values)
        self.agreed_stop.queue(totals.values[6])
        return agreed

    def _update(self, loss_nonfinite: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """Apply the step's update, or skip it when a loss or the gradient norm was not finite on some
        rank (`nonfinite`, a device flag; `loss_nonfinite` for a loss); gradients are cleared either
        way. The fused AdamW skips on the device (its `found_inf`, as under GradScaler: parameters,
        moments and step count stay exactly as they were), and so does the EMA; the other optimizers
        are told on the host."""
        if self.step_in_backward:  # each parameter was updated in backward
            self._count_skip(nonfinite, apply=lambda: None)
        elif self.scaler is not None:
            self._update_fp16(loss_nonfinite)
        elif self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = nonfinite.to(torch.float32)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
                self.optimizer.__dict__.pop("grad_scale", None)
            self.skips.add(nonfinite)
            if self.ema is not None:
                self.ema.update(self.raw_model, skip=nonfinite)
        else:
            self._count_skip(nonfinite, apply=self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=True)

    def _count_skip(self, nonfinite: torch.Tensor, apply: Callable[[], None]) -> None:
        """A host decision (a read-back: the optimizers that cannot skip on the device)."""
        self.skips.add(nonfinite)
        if not bool(nonfinite):
            apply()
            if self.ema is not None:
                self.ema.update(self.raw_model)

    def _update_fp16(self, loss_nonfinite: torch.Tensor) -> None:
        """fp16 with loss scaling: an overflow of a finite loss is the scaler's to skip (and it lowers
        the scale); a non-finite loss skips the update as in every precision."""
        self.skips.add(loss_nonfinite)
        if bool(loss_nonfinite):
            self.scaler.update()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(self.raw_model)

    def _record(self, pending: PendingStep) -> dict:
        """The metrics record of a queued step (what metrics.jsonl, TensorBoard and the monitor read)."""
        world, mode = self.info.world_size, pending.mode
        totals = pending.totals.read()  # the read-back
        skipped_before = self.num_skipped
        self.num_skipped, self.consecutive_skips, self.longest_skip_run = self.skips.read()
        record = {
            "step": pending.step,
            "mode": mode,
            "loss": totals["loss"] / world,
            "text_loss": totals["text_loss"] / world if mode != "t2l" else None,
            "latent_loss": totals["latent_loss"] / world if mode != "l2t" else None,
            "accuracy": totals["accuracy"] / world if mode != "t2l" else None,
            "lr": pending.lr,
            "grad_norm": float(pending.grad_norm),
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": pending.global_batch,
            "accumulation_steps": pending.num_accum,
            **self._window_figures(),
            **self.machine_load.read(),  # a busy machine apart from a slow run (the monitor reads it)
            "num_shapes": len(self._input_shapes),
            # The update of this step was skipped; and how many were since the previous record.
            "skipped": totals["nonfinite"] > 0 or not math.isfinite(float(pending.grad_norm)),
            "skipped_since_last_record": self.num_skipped - skipped_before,
            "num_skipped": self.num_skipped,
            "stop_requested": pending.stop,
        }
        if self.cfg.perf.compile:
            # Graphs compiled so far in this process: flat after the first padded lengths were seen;
            # a count that keeps rising means recompiles (the monitor reads it).
            from torch._dynamo.utils import counters  # here: importing dynamo costs a second, eager runs skip it

            record["compiled_graphs"] = counters["stats"]["unique_graphs"]
            if self.cuda_graphs:
                # Graphs inductor runs without CUDA graphs (an input on the host, a mutated input, an op
                # a graph cannot hold: TORCH_LOGS=perf_hints says which); 0 when every graph replays.
                record["cuda_graph_skips"] = counters["inductor"]["cudagraph_skips"]
                if record["cuda_graph_skips"] and not self._warned_cuda_graph_skips:
                    self._warned_cuda_graph_skips = True
                    log.warning(
                        "perf.cuda_graphs: inductor ran %s without CUDA graphs; TORCH_LOGS=perf_hints names why",
                        counted(record["cuda_graph_skips"], "graph"),
                    )
        return record

    def _window_figures(self) -> dict:
        """Throughput of the steps since the previous record: the record's step time is their mean."""
        figures = self.window.close()
        self.window = Window(self.device)
        flops_per_s = figures.pop("flops_per_s")
        if self.peak_flops is not None:
            figures["mfu"] = flops_per_s / self.peak_flops  # this rank's share = the average
        return figures

    # ---------------------------------------------------------------- the loop

    def fit(self, stop: StopRequest | None = None) -> int:
        """Train to train.steps; returns the process exit status: 0, or 128 + the signal's number
        when a signal stopped the run early (its checkpoint written, `stopped_by` naming it). `stop`:
        a StopRequest the caller entered already (so no signal falls between start-up and the loop);
        by default fit enters its own."""
        cfg, info = self.cfg, self.info
        if self.metrics is None:
            self.resume(None)
        self._clock_started = (time.perf_counter(), self.wall_seconds)
        total = cfg.train.steps
        if self.nothing_to_train:
            self._say_nothing_to_train()
        bar = None
        if info.is_main and cfg.logging.progress_bar and self.step < total:
            bar = tqdm(total=total, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        try:
            with (
                contextlib.nullcontext(stop) if stop is not None else StopRequest() as stop,
                profiler_window(cfg.perf.profiler, self.run_dir, self.device, info.rank) as profiler,
            ):
                while self.step < total:
                    if self.auto_threads is not None:
                        self.auto_threads.follow()
                    pending = self.run_step(stop)
                    self.checkpoints.raise_background_error()
                    if profiler is not None:
                        profiler.step()
                    record = self._record_if_due(pending)
                    if bar is not None:
                        bar.update(1)
                        if record is not None:
                            bar.set_postfix(
                                loss=f"{record['loss']:.4f}",
                                mode=record["mode"],
                                samples_s=f"{record['samples_per_s']:.1f}",
                                refresh=False,
                            )
                        if self.step == total:  # done: the last checkpoint's and evaluation's lines come after it
                            bar.close()
                    if pending.stop and self.step < total:  # at the last step: the run is done
                        self.save(blocking=True)
                        # A rank that did not receive the signal itself stops as for the usual SIGTERM.
                        signum = stop.signum or signal.SIGTERM
                        self.stopped_by = signal.Signals(signum).name
                        return 128 + signum
                    if cfg.eval.every and self.step % cfg.eval.every == 0:
                        self._evaluate()
                    if self.checkpoints.due(self.step):
                        self.save()
                if self._last_saved != self.step:
                    self.save(blocking=True)
                self.checkpoints.wait()
        finally:
            if bar is not None:
                bar.close()
            self.metrics.close()
        return 0

    @property
    def nothing_to_train(self) -> bool:
        """Whether the run is at or past train.steps already (resumed from its last checkpoint, or with a
        smaller train.steps): `fit` then trains no step and says so."""
        return self.step >= self.cfg.train.steps

    def _say_nothing_to_train(self) -> None:
        if not self.info.is_main:
            return
        steps = self.cfg.train.steps
        if self.step == steps:
            log.info("%s is complete at step %d (train.steps=%d): nothing to train", self.run_dir, self.step, steps)
            return
        log.warning(
            "%s is at step %d, past train.steps=%d: nothing was trained; raise train.steps above %d to train it "
            "further",
            self.run_dir,
            self.step,
            steps,
            self.step,
        )

    def _record_if_due(self, pending: PendingStep) -> dict | None:
        """The step's record where it is due: a logged step (train.log_every, the first and the last),
        a stop request, a step whose record was read anyway; then the skip warnings and the stop after
        train.max_consecutive_skips consecutive skips. None elsewhere: nothing was read back."""
        cfg = self.cfg
        due = self.step % cfg.train.log_every == 0 or self.step in (1, cfg.train.steps)
        if not (due or pending.record is not None or pending.stop):
            return None
        record = self.read_record(pending)
        if record["skipped_since_last_record"] and self.info.is_main:
            log.warning(
                "step %d: non-finite loss or gradient norm on some rank; %s skipped since the last record, %d in a "
                "row now",
                record["step"],
                counted(record["skipped_since_last_record"], "update"),
                self.consecutive_skips,
            )
        if self.longest_skip_run >= cfg.train.max_consecutive_skips:
            self._log(self._with_memory(record))
            raise TrainingStopped(
                f"{self.longest_skip_run} consecutive updates were skipped because the loss or "
                f"gradient norm was not finite (train.max_consecutive_skips="
                f"{cfg.train.max_consecutive_skips}); stopping at step {self.step}. The checkpoints "
                f"in {self.checkpoints.dir} are untouched: lower optim.lr, check the data, or "
                f"resume from an earlier one with --resume PATH"
            )
        if due or record["stop_requested"]:
            self._log(self._with_memory(record))
        return record

    def _evaluate(self) -> None:
        """Evaluation with the small `eval` budget on rank 0, into metrics.jsonl (training/evaluation.py)."""

        record = evaluate_during_training(self)
        if record is not None:
            self._log(record)

    def _log(self, record: dict) -> None:
        try:
            self.metrics.log(record)
        except WriteError as err:
            raise WriteError(f"{err}; {self.checkpoints.last_good()}") from err

    def _with_memory(self, record: dict) -> dict:
        return {**record, **memory_stats(self.device)}
