"""What the training steps add up on the device, read by the host only when a record is written.

A training step queues its work and returns. Reading a tensor back (`.item()`, `.cpu()`, `bool()`)
makes the host wait until the device has run everything queued, and then the device waits while the
host launches the next step's kernels: on a GPU an eager step of a deep model is thousands of
launches, so a read-back every step puts all of their host time on the step's time. So each step
adds its losses, token count and non-finite flag into one device tensor (the ranks add theirs in one
all-reduce), decides on the device whether its update is skipped (`SkipCounter`), and the host reads
them once per record (train.log_every), as torchtitan does. The record's throughput is that of the
steps since the previous record (`Window`), measured from the host's clock once the device is done.
"""

from __future__ import annotations

import dataclasses
import time

import torch

REDUCED = ("loss", "text_loss", "latent_loss", "accuracy", "tokens", "nonfinite", "stop")
_METRICS = ("text_loss", "latent_loss", "accuracy")  # of the objective, absent for an idle head


class StepTotals:
    """One step's sums over its micro-batches, on the device: the REDUCED entries (the mean loss and
    metrics over this rank's micro-batches, its real tokens, a non-finite flag, a stop request); on the
    host this rank's FLOPs (known from the batch's shape: adding them on the device would launch a
    kernel each) and its seconds waiting for data."""

    def __init__(self, device: torch.device):
        self.values = torch.zeros(len(REDUCED), dtype=torch.float64, device=device)
        self.flops = [0.0, 0.0]  # on real tokens, as computed (host)
        self.positions = 0  # text positions the blocks computed, padding included (host)
        self.real_positions = 0  # of them, real tokens (host)
        self.data_wait_s = 0.0

    def add(self, loss: torch.Tensor, metrics: dict, tokens: torch.Tensor | float, num_accum: int) -> None:
        """One micro-batch's loss, metrics (detached tensors) and real tokens."""
        zero = loss.new_zeros(())
        parts = torch.stack([loss.detach(), *(metrics.get(name, zero).to(loss.dtype) for name in _METRICS)])
        self.values[:4] += parts.to(torch.float64) / num_accum  # one cast, where each part took one
        self.values[4] += tokens

    def close(self, stop: bool) -> None:
        """After the last micro-batch: the non-finite flag of the loss, and this rank's stop request."""
        self.values[5] = (~torch.isfinite(self.values[0])).to(torch.float64)
        if stop:
            self.values[6] = 1.0

    def read(self) -> dict[str, float]:
        """The REDUCED entries on the host (a read-back: the device finishes what is queued first)."""
        return dict(zip(REDUCED, self.values.tolist()))


class SkipCounter:
    """Updates skipped for a non-finite loss or gradient norm, counted on the device: the total, the
    current run of consecutive skips, and the longest run since the last read (so that a run of
    skips between two records still stops training at train.max_consecutive_skips)."""

    def __init__(self, device: torch.device, total: int = 0, run: int = 0):
        self.counts = torch.tensor([total, run, run], dtype=torch.int64, device=device)

    def add(self, skipped: torch.Tensor) -> None:
        """One step; skipped: () bool on the device."""
        s = skipped.to(torch.int64)
        total, run, longest = self.counts.unbind()
        run = (run + 1) * s
        self.counts.copy_(torch.stack([total + s, run, torch.maximum(longest, run)]))

    def read(self) -> tuple[int, int, int]:
        """(total, current run, longest run since the last read); starts the next longest run."""
        total, run, longest = self.counts.tolist()
        self.counts[2] = run
        return total, run, longest


@dataclasses.dataclass
class Window:
    """The steps since the last record: their number, samples, seconds and seconds waiting for data on
    the host, and on the device the real tokens (all ranks') and this rank's FLOPs.

    The seconds are the steps' own: each step's host time from its start until it is queued, and at
    the record the wait for the device to finish what is queued. What runs between steps (a checkpoint,
    a log line, another config's turn in `bench`) is not a step's time."""

    device: torch.device
    seconds: float = 0.0
    steps: int = 0
    samples: int = 0
    positions: int = 0
    real_positions: int = 0
    data_wait_s: float = 0.0

    def __post_init__(self):
        self.tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.flops = [0.0, 0.0]  # on real tokens, as computed (host)

    def add(self, samples: int, totals: StepTotals, started: float) -> None:
        """A step queued, which began at `started` (time.perf_counter)."""
        self.seconds += time.perf_counter() - started
        self.steps += 1
        self.samples += samples
        self.positions += totals.positions
        self.real_positions += totals.real_positions
        self.data_wait_s += totals.data_wait_s
        self.tokens += totals.values[4]
        self.flops = [mine + step for mine, step in zip(self.flops, totals.flops)]

    def close(self) -> dict[str, float]:
        """The window's throughput (after a read-back, so the clock includes the device's work)."""
        waiting = time.perf_counter()
        tokens = self.tokens.item()  # the read-back that waits for the device
        real_flops, computed_flops = self.flops
        seconds = self.seconds + time.perf_counter() - waiting
        return {
            "record_steps": self.steps,
            "step_time_s": seconds / self.steps,
            "samples_per_s": self.samples / seconds,
            "tokens_per_s": tokens / seconds,
            "train_flops": computed_flops / self.steps,  # padding included: what the step's time follows
            "flops_per_s": real_flops / seconds,  # on real tokens: MFU's
            "data_wait_share": self.data_wait_s / seconds,
            "real_token_share": self.real_positions / max(self.positions, 1),
        }


class AgreedStop:
    """A stop request that every rank acts on at the same step, without waiting for the step in
    flight: each step's all-reduced stop flag is copied to the host behind its all-reduce (pinned
    memory, an event), and read during the next step, once that step's own work is queued."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.float64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._queued = False

    def previous(self) -> bool:
        """The flag last queued (waits for that step's all-reduce alone); False before the first."""
        if not self._queued:
            return False
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.numpy()[0] > 0)

    def queue(self, flag: torch.Tensor) -> None:
        """Copy the all-reduced flag () to the host once the device gets there."""
        self._host.copy_(flag.reshape(1), non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._queued = True
