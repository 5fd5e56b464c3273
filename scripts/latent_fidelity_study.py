"""Does the latent sampler collapse towards the mean? Its fidelity by step count, shift and sampler
(DDIM or DDPM), first on Gaussian data with the exact denoiser, then on a trained run's t2l and joint
generation (mmldlm/evaluation/latent_fidelity.py). Markdown tables for docs/log/quality.md (its dated studies).

    python scripts/latent_fidelity_study.py gaussian
    python scripts/latent_fidelity_study.py run /tmp/fidelity/run --num-samples 256 --t2l-steps 2 8 --joint-steps 8
    python scripts/latent_fidelity_study.py run runs/default --t2l-steps 8 32 --joint-steps 8 --samplers ddim \
        --latent-shifts none 1 2 4

gaussian: the per-dimension std of the samples over the data's, for data N(0, diag(0.5^2, 1^2)) in the
model's x0 parameterisation (20000 samples), on equal steps of t and, for shift 8, on the grids of
sampling shifts 1, 2 and 4 (GaussianDiffusion.time_grid). run: the fidelity figures of t2l (the first N validation
texts; then the posterior mean's cosine and retrieval@1 among all validation latents) and of joint
generation (N samples at lengths drawn from the validation split, one candidate each), each against N
real validation latents.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from mmldlm.config import LatentDiffusionConfig
from mmldlm.diffusion import GaussianDiffusion
from mmldlm.evaluation.evaluate import _first_val, _generator, latent_fidelity, t2l_latents, t2l_retrieval
from mmldlm.evaluation.latent_fidelity import exact_gaussian_samples
from mmldlm.export.pretrained import load_trained
from mmldlm.sampling import SamplingOptions

STEPS = (1, 2, 4, 8, 16, 32, 64, 128)


def gaussian() -> None:
    data_std = torch.tensor([0.5, 1.0], dtype=torch.float64)
    print("| shift | time grid | sampler | " + " | ".join(f"{n} steps" for n in STEPS) + " |")
    print("|---|---|---|" + "---|" * len(STEPS))
    for shift, grid in ((1.0, None), (8.0, None), (8.0, 4.0), (8.0, 2.0), (8.0, 1.0)):
        diffusion = GaussianDiffusion(LatentDiffusionConfig(prediction="x0", shift=shift))
        for sampler in ("ddim", "ddpm"):
            cells = []
            for n in STEPS:
                generator = torch.Generator().manual_seed(0)
                x = exact_gaussian_samples(diffusion, data_std, n, 20000, sampler, generator, sampling_shift=grid)
                ratio = x.std(dim=0) / data_std
                cells.append(f"{ratio[0]:.2f} / {ratio[1]:.2f}")
            name = "equal steps of t" if grid is None else f"sampling shift {grid:g}"
            print(f"| {shift:g} | {name} | {sampler} | " + " | ".join(cells) + " |")


def row(name: str, f: dict) -> str:
    return (
        f"| {name} | {f['frechet_distance']:.1f} ({f['frechet_distance_real_vs_real']:.1f}) | "
        f"{f['precision']:.2f} / {f['recall']:.2f} ({f['precision_real_vs_real']:.2f} / {f['recall_real_vs_real']:.2f})"
        f" | {f['std_ratio_median']:.2f} [{f['std_ratio_min']:.2f}, {f['std_ratio_max']:.2f}] | "
        f"{f['spread']:.1f} ({f['spread_real']:.1f}) |"
    )


def trained(
    run_dir: str,
    num_samples: int,
    batch_size: int,
    steps: dict[str, list],
    guidance: list[float],
    samplers: list[str],
    shifts: list[float | None],
    orders: tuple[str, ...] = ("together",),
) -> None:
    run = load_trained(run_dir, device="cpu")
    run.model.eval()
    base = SamplingOptions.defaults(run.cfg.text_diffusion, run.cfg.latent_diffusion)
    base = dataclasses.replace(base, best_of=1, correction_rounds=0)
    shifts = [base.latent_shift if shift == "run" else shift for shift in shifts]
    header = "| Fréchet distance (real vs real) | precision / recall (real vs real) | std ratio median [min, max] | "
    header += "spread (real) |"
    ids = _first_val(run, num_samples)[0]
    print(f"t2l, n = {num_samples}\n\n| latent steps, sampler {header}\n|---|---|---|---|---|")
    for num, sampler, scale, shift in itertools.product(steps["t2l"], samplers, guidance, shifts):
        options = dataclasses.replace(
            base, latent_steps=num, latent_sampler=sampler, guidance_scale=scale, latent_shift=shift
        )
        name = f"{num} {sampler}" + (f", guidance {scale:g}" if scale else "") + grid_name(shift)
        print(row(name, latent_fidelity(run, t2l_latents(run, options, ids, batch_size, 0)[0])))
    r = t2l_retrieval(run, base, num_samples, batch_size, pool_size=len(run.val))
    mean = f"cosine {r['cosine_mean']:.3f}, retrieval@1 among {r['pool_size']} {r['retrieval_at_1']:.1%}"
    print(f"\nthe posterior mean: {mean}")
    print(f"\njoint generation, n = {num_samples}\n\n| steps, sampler {header}\n|---|---|---|---|---|")
    lengths = run.sample_lengths(num_samples, _generator(0, 3))
    for num, sampler, shift, order in itertools.product(steps["joint"], samplers, shifts, orders):
        options = dataclasses.replace(
            base, num_steps=num, latent_sampler=sampler, latent_shift=shift, joint_order=order
        )
        sampler_ = run.sampler(options)
        latents = torch.cat(
            [
                run.joint_batch(sampler_, lengths[b : b + batch_size], _generator(0, 4, b))[1]
                for b in range(0, num_samples, batch_size)
            ]
        )
        order_name = "" if order == "together" else f", {order}"
        print(row(f"{num} {sampler}{grid_name(shift)}{order_name}", latent_fidelity(run, latents)))


def grid_name(shift: float | None) -> str:
    return "" if shift is None else f", sampling shift {shift:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["gaussian", "run"])
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--t2l-steps", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    parser.add_argument("--joint-steps", type=int, nargs="*", default=[8, 32, 64], help="none: no joint rows")
    parser.add_argument("--t2l-guidance", type=float, nargs="+", default=[0.0], help="t2l guidance scales")
    parser.add_argument("--samplers", nargs="+", choices=["ddim", "ddpm"], default=["ddim", "ddpm"])
    parser.add_argument("--joint-orders", nargs="+", choices=["together", "latent_first"], default=["together"])
    parser.add_argument(
        "--latent-shifts",
        nargs="+",
        default=["run"],
        help="latent time grids: 'run' (the run's latent_diffusion.sampling_shift), 'none' (equal steps of t) "
        "or a sampling shift",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "gaussian":
        gaussian()
    else:
        steps = {"t2l": args.t2l_steps, "joint": args.joint_steps}
        shifts = [parse_shift(value) for value in args.latent_shifts]
        trained(
            args.run_dir,
            args.num_samples,
            args.batch_size,
            steps,
            args.t2l_guidance,
            args.samplers,
            shifts,
            tuple(args.joint_orders),
        )


def parse_shift(value: str):
    return "run" if value == "run" else None if value == "none" else float(value)


if __name__ == "__main__":
    main()
