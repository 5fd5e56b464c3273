"""Save time and peak resident memory of rank 0 for one checkpoint, sharded (what the trainer writes:
every rank its own shard through torch.distributed.checkpoint), sharded-async (the same through
dcp.async_save: also the seconds the training loop is blocked, in save() and waiting for the
background copy before the next update, against the seconds of one training step of the same model,
and how much longer the step beside the save took) or full-state (the earlier way: the whole state
gathered to rank 0's CPU, which alone writes model.safetensors, ema.safetensors and optimizer.pt).
Run one method per launch: peak RSS only ever grows within a process.

    torchrun --nproc-per-node 2 scripts/checkpoint_bench.py --method sharded model=small
    torchrun --nproc-per-node 2 scripts/checkpoint_bench.py --method sharded-async model=small
    torchrun --nproc-per-node 2 scripts/checkpoint_bench.py --method full-state model=small
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from mmldlm.config import load_config  # noqa: E402
from mmldlm.data.encoders import DEFAULT_ENCODER, ENCODER_WIDTHS  # noqa: E402
from mmldlm.model import MultimodalMMDiT  # noqa: E402
from mmldlm.training.checkpoint import CheckpointManager, training_state_dict  # noqa: E402
from mmldlm.training.distributed import init_distributed  # noqa: E402
from mmldlm.training.ema import WeightEMA  # noqa: E402
from mmldlm.training.optim import build_optimizer  # noqa: E402
from mmldlm.training.parallelize import apply_fsdp, parallelize  # noqa: E402
from mmldlm.wording import counted  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def save_full_state(run_dir: Path, model, optimizer, ema, is_main: bool) -> None:
    """The earlier checkpoint write: gather everything to rank 0's CPU, rank 0 writes."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    ema_state = get_model_state_dict(ema.module, options=options)
    if is_main:
        out = run_dir / "full"
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(out / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in ema_state.items()}, str(out / "ema.safetensors"))
        torch.save(optim_state, out / "optimizer.pt")


def random_batch(cfg):
    """`cfg.train.micro_batch_size` random texts of 16 tokens (the default corpus's typical padded
    length), latents and noise levels."""
    B, K, D = cfg.train.micro_batch_size, cfg.model.num_latents, cfg.model.latent_dim
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, cfg.model.vocab_size or 8192, (B, 16), generator=generator)
    t = torch.rand(B, generator=generator)
    return tokens, torch.randn(B, K, D, generator=generator), t


def train_step(model, optimizer, batch, before_update=lambda: None) -> float:
    """Seconds of one training step: forward of both heads, backward, `before_update()` (what the
    trainer calls before it changes the state), AdamW."""
    tokens, latents, t = batch
    started = time.perf_counter()
    out = model(tokens, latents, t, t)
    (out.text_logits.float().mean() + out.latent.float().mean()).backward()
    before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def step_seconds(model, optimizer, batch, num_steps: int = 3) -> float:
    """Median seconds of a training step, after one warm-up."""
    seconds = [train_step(model, optimizer, batch) for _ in range(num_steps + 1)]
    return sorted(seconds[1:])[num_steps // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=["sharded", "sharded-async", "full-state"], required=True)
    parser.add_argument(
        "--dir", default=None, help="where to write and leave it (default: a temporary directory, removed at the end)"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    cfg = load_config(None, ["train.device=cpu", *args.overrides])
    # No dataset here: a null latent shape is the default encoder's one latent per text.
    width = cfg.model.latent_dim or ENCODER_WIDTHS[DEFAULT_ENCODER]
    model_cfg = dataclasses.replace(cfg.model, latent_dim=width, num_latents=cfg.model.num_latents or 1)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    info = init_distributed(cfg.distributed, "cpu")
    torch.manual_seed(0)
    model = MultimodalMMDiT(cfg.model, vocab_size=cfg.model.vocab_size or 8192)
    ema = WeightEMA(model, 0.999)
    wrapped = parallelize(model, cfg.perf, cfg.distributed, info)
    if info.distributed and cfg.distributed.strategy == "fsdp2":
        apply_fsdp(ema.module)
    optimizer = build_optimizer(wrapped, cfg.optim)
    batch = random_batch(cfg)
    step = step_seconds(wrapped, optimizer, batch) if args.method == "sharded-async" else None
    training_state_dict(wrapped, optimizer)  # gives AdamW its state, as after a first step
    chosen = [args.dir or (tempfile.mkdtemp(prefix="checkpoint-bench-") if info.is_main else None)]
    if info.distributed:  # one directory for every rank's shard, as in a run
        dist.broadcast_object_list(chosen, src=0)
    run_dir = Path(chosen[0])
    manager = CheckpointManager(cfg.checkpoint, run_dir, info)
    if info.distributed:
        dist.barrier()
    before, peak_before = rss_mib(), peak_rss_mib()
    started = time.perf_counter()
    blocked = None
    if args.method == "sharded":
        manager.save(1, wrapped, optimizer, {"step": 1}, {"rng": None}, cfg, 0, blocking=True, ema=ema)
    elif args.method == "sharded-async":
        manager.save(1, wrapped, optimizer, {"step": 1}, {"rng": None}, cfg, 0, ema=ema)
        blocked = time.perf_counter() - started  # the loop goes on from here while the state is copied
        waits = []

        def wait_for_snapshot():
            waited = time.perf_counter()
            manager.wait_for_snapshot()
            waits.append(time.perf_counter() - waited)

        overlapped = train_step(wrapped, optimizer, batch, wait_for_snapshot)  # the step beside the save
        blocked += waits[0]
        manager.wait()
    else:
        save_full_state(run_dir, wrapped, optimizer, ema, info.is_main)
    if info.distributed:
        dist.barrier()
    seconds = time.perf_counter() - started
    if info.is_main:
        num_params = sum(p.numel() for p in model.parameters())
        written = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
        print(
            f"{args.method} ({counted(info.world_size, 'process')}, {cfg.distributed.strategy}): "
            f"{num_params / 1e6:.1f} M parameters, {written / 2**20:.0f} MiB written in {seconds:.2f} s; "
            f"rank 0 RSS {before:.0f} MiB before the save (peak so far {peak_before:.0f} MiB), "
            f"peak after it {peak_rss_mib():.0f} MiB"
        )
        if blocked is not None:
            print(
                f"the training loop was blocked {blocked:.2f} s of that (in save() and waiting for the copy "
                f"before the next update): {blocked / step:.0%} of one training step ({step:.2f} s, "
                f"micro-batch {cfg.train.micro_batch_size} x 16 tokens); the step beside the save took "
                f"{overlapped:.2f} s, {overlapped / step - 1:+.0%}"
            )
    if info.distributed:
        dist.barrier()
        dist.destroy_process_group()
    if args.dir is None and info.is_main:  # the checkpoint was only measured: 1.7 GB at the small preset
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
