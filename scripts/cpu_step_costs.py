"""What a training step costs on a CPU, three ways, for side-by-side comparisons (docs/benchmarks.md,
"A CPU step"):

    python scripts/cpu_step_costs.py steps data.path=DIR              # the main job's step, in-process
    python scripts/cpu_step_costs.py steps data.path=DIR --as-on-a-gpu  # bf16 attention without the fp32 detour
    python scripts/cpu_step_costs.py parts data.path=DIR model.hidden_size=16 ...  # the step's host time by part
    python scripts/cpu_step_costs.py attention                          # the attention kernel, bf16 and fp32
    python scripts/cpu_step_costs.py loss                               # the SUBS cross-entropy, fused and chained

`steps` times `--steps` training steps of a config (default configs/default.yaml) one by one and prints
the sum and median of all but the first 20 (`--each`: also each step's time and the process's resident
memory, now and at its peak, as it ends: what a compile costs); alternate two variants in separate processes, e.g. with
and without `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647` (what `keep_freed_memory` sets).

`parts` runs `--steps` steps the same way and prints, per step, the time spent in each part of the
step outside the model's forward and backward (`PARTS`: the batch, the objective's draws and its
losses, the gradient norm, the update and within it the optimizer's own pieces), and the whole step.
At a width where the arithmetic is negligible (say `model.hidden_size=16`) that is the host's work a
GPU step pays beside its kernels; but torch's foreach and fused optimizer operations loop over the
tensors on a CPU, where a GPU launches a few kernels for them all, so their figures here are the
CPU's arithmetic, not a GPU's host time. On a GPU (`scripts/gpu_session.sh`, part 2b) the figures
are the host's own time, as nothing in a step that does not log waits for the device, so long as
the device keeps up with what the host queues.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F


def timed(fn, *args, repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of fn(*args) over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memory() -> str:
    """This process's resident memory now and at its peak so far (Linux)."""
    import resource

    with open("/proc/self/statm") as statm:
        now = int(statm.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return f"RSS {now / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB"


def steps(args) -> None:
    from mmldlm.model.attention import dispatch_as_on_a_gpu
    from mmldlm.tools.bench import build_trainer

    variant = dispatch_as_on_a_gpu() if args.as_on_a_gpu else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as run_dir, variant:
        _, _, trainer, _ = build_trainer(args.config, args.overrides, run_dir)
        if args.each:
            print(f"built: {memory()}", flush=True)
        times = []
        for step in range(args.steps):
            started = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - started)
            if args.each:
                print(f"step {step}: {times[-1]:.2f} s, {memory()}", flush=True)
    times = times[20:]
    if times:  # none past the first 20 with --steps 20 or fewer (--each has printed them)
        print(f"{len(times)} steps: sum {sum(times):.2f} s, median {statistics.median(times) * 1e3:.1f} ms")


# (object, attribute, label) of what `parts` times: the trainer's, objective's and optimizer's methods
# (on the instances: torch.compile, once used in the process, puts a wrapped `_init_group` on each
# optimizer class), and the torch functions AdamW calls by name.
PARTS = (
    ("trainer", "_next_batch", "the batch (loader, copy to the device)"),
    ("objective", "_noised_inputs", "the objective's draws and noised inputs"),
    ("objective", "_loss_and_metrics", "the objective's losses and metrics"),
    ("trainer", "_gradient_norm", "the gradient norm and the clipping factor"),
    ("trainer", "_update", "the update (optimizer step, skip flag, zero_grad)"),
    ("optimizer", "_init_group", "of it: AdamW's parameter lists (Python, per group)"),
    ("torch", "_foreach_add_", "of it: foreach add (AdamW's step counts; any other caller too)"),
    ("torch._C", "_group_tensors_by_device_and_dtype", "of it: the tensors grouped by device and dtype"),
    ("torch", "_fused_adamw_", "of it: fused AdamW (on a CPU: the arithmetic)"),
    ("optimizer", "zero_grad", "of it: zero_grad"),
)


def parts(args) -> None:
    import collections
    from unittest import mock

    from mmldlm.tools.bench import build_trainer

    spent, calls = collections.defaultdict(float), collections.Counter()

    def timed_call(fn, label):
        def call(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - started
                calls[label] += 1

        return call

    with tempfile.TemporaryDirectory() as run_dir:
        _, _, trainer, _ = build_trainer(args.config, args.overrides, run_dir)
        owners = {"trainer": trainer, "objective": trainer.objective, "optimizer": trainer.optimizer}
        owners.update({"torch": torch, "torch._C": torch._C})
        for _ in range(min(20, args.steps)):  # warm-up, untimed
            trainer.run_step()
        whole = []
        with contextlib.ExitStack() as stack:
            for owner, name, label in PARTS:
                target = owners[owner]
                stack.enter_context(mock.patch.object(target, name, timed_call(getattr(target, name), label)))
            for _ in range(args.steps - 20):
                started = time.perf_counter()
                trainer.run_step()
                whole.append(time.perf_counter() - started)
    if not whole:
        print("no step past the first 20 was timed: give --steps above 20")
        return
    n = len(whole)
    print(f"| part of the step, {n} steps after 20 | ms per step (mean) | calls per step |")
    print("|---|---|---|")
    for _, _, label in PARTS:
        print(f"| {label} | {spent[label] / n * 1e3:.3f} | {calls[label] / n:g} |")
    print(f"| the whole step | {sum(whole) / n * 1e3:.3f} (median {statistics.median(whole) * 1e3:.3f}) | 1 |")


def attend(q, k, v, mask) -> None:
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()


def attention(args) -> None:
    """SDPA forward + backward of (64, 2, S, 64), the main job's shape, in bf16 and fp32."""
    for S in (14, 33, 66):
        for masked in (False, True):
            row = []
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = (torch.randn(64, 2, S, 64, dtype=dtype, requires_grad=True) for _ in range(3))
                mask = torch.ones(64, 1, S, S, dtype=torch.bool) if masked else None
                if masked:
                    mask[..., S - 3 :] = False
                ms = timed(attend, q, k, v, mask)
                row.append(f"{str(dtype)[6:]} {ms * 1e3:.2f} ms")
            print(f"S {S}, {'mask' if masked else 'no mask'}: " + ", ".join(row))


def loss(args) -> None:
    """The SUBS cross-entropy forward + backward, V = 8192: fused against autograd's chain, alternated."""
    from mmldlm.device import keep_freed_memory
    from mmldlm.diffusion.masked import subs_cross_entropy

    keep_freed_memory()  # as training on a CPU runs it

    def chain(logits, targets, excluded):
        z = logits.float().index_fill(-1, torch.full((1,), excluded), float("-inf"))
        return F.cross_entropy(z, targets, reduction="none"), z.argmax(-1)

    for dtype in (torch.float32, torch.bfloat16):
        for N in (300, 615, 1206):
            generator = torch.Generator().manual_seed(0)
            base = torch.randn(N, 8192, generator=generator).to(dtype)
            targets = torch.randint(0, 8000, (N,), generator=generator)
            times = {chain: [], subs_cross_entropy: []}
            for _ in range(30):
                for fn in times:
                    x = base.clone().requires_grad_()
                    started = time.perf_counter()
                    (fn(x, targets, 8191)[0].sum() / N).backward()
                    times[fn].append(time.perf_counter() - started)
            c, f = (statistics.median(t[5:]) for t in times.values())
            print(f"{str(dtype)[6:]} N {N}: chain {c * 1e3:.2f} ms, fused {f * 1e3:.2f} ms, ratio {f / c:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["steps", "parts", "attention", "loss"])
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="steps, parts: config overrides")
    parser.add_argument("--config", default="configs/default.yaml", help="steps, parts: config name or file")
    parser.add_argument("--steps", type=int, default=120, help="steps, parts: how many (the first 20 are not counted)")
    parser.add_argument("--as-on-a-gpu", action="store_true", help="steps: no fp32 detour for bf16 attention")
    parser.add_argument("--each", action="store_true", help="steps: each step's time, RSS and peak RSS as it ends")
    parser.add_argument("--threads", type=int, default=2, help="torch's threads (default 2)")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the options alike
    torch.set_num_threads(args.threads)
    if args.what in ("steps", "parts"):
        args.overrides = [f"train.threads={args.threads}", *args.overrides]
    {"steps": steps, "parts": parts, "attention": attention, "loss": loss}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
