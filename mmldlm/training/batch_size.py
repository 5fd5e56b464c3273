"""`train.micro_batch_size: auto`: the largest micro-batch that fits, with the accumulation that
keeps the effective batch.

The candidates are the divisors of every per-process batch the run will use (global batch / world
size, and each size in train.batch_schedule), so accumulation = per-process batch / micro-batch is
always exact: auto changes how the effective batch is split, never the effective batch.

A candidate fits when one forward + backward in the joint mode (both heads: the most memory), on
the heaviest batch of that many samples the run's data yields (the prepared dataset's real lengths
under the configured bucketing: `heaviest_batch` in mmldlm/data/dataset.py; every text at the
longest length when the data are not known), peaks under the cap:
- CUDA: an out-of-memory error means it does not fit (the allocator's cache is emptied and the search
  backs off to a smaller candidate); train.memory_cap_gib, when set, also bounds the peak allocation.
- CPU: the process's peak RSS (mmldlm.training.metrics.peak_memory_bytes) must stay under
  train.memory_cap_gib, by default 80% of the machine's memory shared by the local processes.
The probe takes no optimizer step, so the weights are untouched; AdamW's two state tensors per
parameter, allocated at the first real step, are added to the measured peak. It runs the model as
the trainer set it up (checkpointing and compile applied) and draws from its own RNG stream.
Memory grows with the batch, so a binary search over the sorted candidates finds the largest fit.

A fixed train.micro_batch_size larger than a process's share of the global batch (a config written
for one process, started on several) is lowered to that share: see `per_process_micro_batch`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from collections.abc import Callable

import torch
from torch import nn

from mmldlm.objective import Objective
from mmldlm.training.metrics import peak_memory_bytes, reset_peak_memory


def global_batch_sizes(global_batch_size: int, batch_schedule: list[list[int]]) -> list[int]:
    """Every global batch a run uses: train.global_batch_size and each size of train.batch_schedule."""
    return [global_batch_size] + [size for _, size in batch_schedule]


def fit_to_data(
    micro_batch: int | str, global_batches: list[int], num_samples: int, world_size: int
) -> tuple[int | str, list[int]]:
    """(micro-batch, global batches) for a training split of `num_samples` that holds fewer samples than a
    global batch (a small corpus under a config written for a large one): each such global batch lowered
    to the most samples the split fills in whole micro-batches on every process, and the micro-batch to
    that size where it was larger. Sizes the split fills are returned as they are; a split smaller than
    the world size is left to the loader's refusal."""
    if max(global_batches) <= num_samples or num_samples < world_size:
        return micro_batch, global_batches
    unit = world_size  # "auto" or a micro-batch the split cannot fill: one micro-batch of the share
    if micro_batch != "auto" and micro_batch * world_size <= num_samples:
        unit = micro_batch * world_size
    most = num_samples // unit * unit
    if micro_batch != "auto" and micro_batch * world_size > most:
        micro_batch = most // world_size
    return micro_batch, [min(size, most) for size in global_batches]


def per_process_micro_batch(micro_batch: int, global_batches: list[int], world_size: int) -> int:
    """The micro-batch each process runs for a fixed train.micro_batch_size: that size, unless that many
    on every process is more than the smallest global batch (configs/default.yaml, a global batch of 64
    in micro-batches of 64, started on 2 processes). Then each process runs its share of the smallest
    global batch, smallest / world size (accumulation 1 there), provided every global batch splits
    evenly into such micro-batches on every process. Otherwise the configured size stays, and the
    trainer's accumulation check refuses it naming the keys."""
    smallest = min(global_batches)
    if micro_batch * world_size <= smallest or smallest % world_size:
        return micro_batch
    share = smallest // world_size
    if any(size % (share * world_size) for size in global_batches):
        return micro_batch
    return share


def candidate_sizes(per_process_batches: list[int]) -> list[int]:
    """Micro-batch sizes that divide every per-process batch, ascending."""
    common = math.gcd(*per_process_batches)
    return [d for d in range(1, common + 1) if common % d == 0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of the ascending `candidates` for which `fits` holds (it must be monotone: what
    fits at some size fits at every smaller one); None when not even the smallest fits. Doubling the
    size from the smallest, then bisecting: O(log) probes, none above the first candidate of twice
    the largest size that fit (on a CPU a probe far too large can drive the machine into swap
    before it fails)."""
    best, lo, hi = None, 0, len(candidates)  # candidates[:lo] fit, candidates[hi:] do not
    i = 0
    while lo < hi:
        i = min(i, hi - 1)
        if not fits(candidates[i]):
            hi = i
            break
        best, lo = candidates[i], i + 1
        i = bisect.bisect_left(candidates, 2 * best, lo)  # the next probe: about twice the size that fit
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid
    return best


def spaced_sizes(largest: int, spacing: float = 1 / 8) -> list[int]:
    """1, 2, ... up to `largest`, each at most `spacing` above the one before (every size up to
    1 / spacing): the sizes among which a search is exact to within `spacing`."""
    sizes = [1]
    while sizes[-1] < largest:
        sizes.append(min(largest, sizes[-1] + max(1, int(sizes[-1] * spacing))))
    return sizes


def default_memory_cap(device: torch.device) -> float | None:
    """Bytes: None on CUDA (out-of-memory decides); on CPU 80% of MemTotal shared by the local processes."""
    if device.type == "cuda":
        return None
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return 0.8 * total_kib * 1024 / int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def optimizer_state_bytes(model: nn.Module) -> int:
    """AdamW's exp_avg and exp_avg_sq: two tensors like every trainable parameter."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def full_length_batch(
    batch_size: int, seq_len: int, vocab_size: int, num_latents: int, latent_dim: int, seed: int = 0
) -> dict:
    """A batch of the largest shape the loader can produce: every row a full-length text. What a probe
    runs when the data's lengths are not known (`heaviest_batch` in mmldlm/data/dataset.py, when they are)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(2, vocab_size, (batch_size, seq_len), generator=generator),  # (B, L)
        "pad_mask": torch.ones(batch_size, seq_len, dtype=torch.bool),  # (B, L)
        "latents": torch.randn(batch_size, num_latents, latent_dim, generator=generator),  # (B, K, D)
    }


def joint_objective(objective) -> Objective:
    """`objective` in joint mode: both heads, both noises, the mode whose step needs the most memory."""
    return Objective(
        dataclasses.replace(objective.cfg, mode="joint"),
        objective.text,
        objective.latent,
        objective.self_condition,
        objective.length_head,
        fused_text_loss=objective.fused_text_loss,
        text_row_buckets=objective.text_row_buckets,
    )


def probe_peak_bytes(
    model: nn.Module,
    objective,
    batch_size: int,
    make_batch: Callable[[int], dict],
    device: torch.device,
    autocast: Callable = None,
) -> int:
    """Peak memory of one joint-mode forward + backward of `make_batch(batch_size)` (a CPU batch as the
    loader yields it), plus the optimizer state; raises torch.OutOfMemoryError where CUDA runs out."""
    joint = joint_objective(objective)
    raw = getattr(model, "module", model)
    batch = {k: v.to(device) for k, v in make_batch(batch_size).items()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # dropout must not shift the run's RNG stream
        reset_peak_memory(device)
        try:
            with autocast() if autocast is not None else torch.autocast(device.type, enabled=False):
                loss, _ = joint(model, batch, step=0, generator=torch.Generator(device).manual_seed(0))
            loss.backward()
            peak = peak_memory_bytes(device)
        finally:
            del batch
            model.zero_grad(set_to_none=True)
    return peak + optimizer_state_bytes(raw)


def probe_or_none(
    model: nn.Module,
    objective,
    batch_size: int,
    make_batch: Callable[[int], dict],
    device: torch.device,
    autocast: Callable = None,
) -> int | None:
    """`probe_peak_bytes`, or None where CUDA ran out of memory (its cache is emptied then): every
    search over sizes or checkpointing modes reads an out-of-memory error as "does not fit"."""
    try:
        return probe_peak_bytes(model, objective, batch_size, make_batch, device, autocast)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def batch_shape(batch: dict) -> str:
    """How a probe batch reads in a log line: "16 x 80 tokens", or packed "3 rows x 128 tokens (16 texts)"."""
    if "pack_doc" in batch:
        rows, length = batch["pack_doc"].shape
        return f"{rows} rows x {length} tokens ({batch['tokens'].shape[0]} texts)"
    rows, length = batch["tokens"].shape
    return f"{rows} x {length} tokens"


def find_micro_batch(
    model: nn.Module,
    objective,
    per_process_batches: list[int],
    make_batch: Callable[[int], dict],
    device: torch.device,
    cap_bytes: float | None,
    autocast: Callable = None,
    agree: Callable[[bool], bool] = lambda fits: fits,
) -> tuple[int, dict]:
    """The largest candidate micro-batch whose probe (on `make_batch(size)`) fits under `cap_bytes`
    (see the module doc), and {size: peak bytes or None for out-of-memory} of the probes. `agree`
    makes every rank take the same decision (a MIN all-reduce of the flag) so all ranks probe in
    lockstep and end equal."""
    peaks: dict[int, int | None] = {}

    def fits(size: int) -> bool:
        peaks[size] = probe_or_none(model, objective, size, make_batch, device, autocast)
        return agree(peaks[size] is not None and (cap_bytes is None or peaks[size] <= cap_bytes))

    size = largest_fitting(candidate_sizes(per_process_batches), fits)
    if size is None:
        cap = f"{cap_bytes / 2**30:.2f} GiB" if cap_bytes is not None else "the device's memory"
        peak = f"peak {peaks[1] / 2**30:.2f} GiB" if peaks.get(1) is not None else "out of memory"
        raise RuntimeError(
            f"train.micro_batch_size=auto: not even a micro-batch of 1 fits in {cap} "
            f"({peak} on a batch of {batch_shape(make_batch(1))}); raise train.memory_cap_gib, or use a "
            f"smaller model or activation checkpointing"
        )
    return size, peaks
