"""`mmldlm eval --run RUN_DIR [--num-samples N] [--out PATH]`: validation ELBO and latent loss per
mode, l2t reconstruction and t2l retrieval of a trained run (mmldlm/sampling/evaluate.py). Writes
a JSON report (default RUN/eval/step-NNNNNNN.json) and its markdown summary beside it (.md), and
prints the summary."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_DIR", help="a training run directory")
    parser.add_argument("--checkpoint", metavar="PATH", help="a checkpoint directory (default: RUN/checkpoints/latest)")
    parser.add_argument("--num-samples", type=int, default=256,
                        help="validation samples decoded (l2t) and encoded (t2l), and scored for the ELBO")
    parser.add_argument("--num-t-draws", type=int, default=2, help="draws of t and noise per ELBO batch")
    parser.add_argument("--steps", type=int, help="sampling steps (default: the run's latent_diffusion.num_sampling_steps)")
    parser.add_argument("--strategy", choices=["ancestral", "confidence"], default="ancestral")
    parser.add_argument("--guidance-scale", type=float, default=0.0)
    parser.add_argument("--retrieval-pool", type=int, default=1000, help="validation sentences for t2l retrieval@1")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-encoder", action="store_true", help="skip re-encoding the l2t text (no cosine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="PATH.json", help="the JSON report (default RUN/eval/step-NNNNNNN.json)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the GPU when there is one, else the CPU")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (0: torch's default); 1 is fastest on a CPU other jobs share")


def run(args: argparse.Namespace) -> int:
    import json
    import math
    from pathlib import Path

    import torch

    from mmldlm.config import EvalConfig
    from mmldlm.sampling import SamplingOptions, load_run
    from mmldlm.sampling.evaluate import evaluate, markdown
    from mmldlm.training.checkpoint import step_dir_name

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    run = load_run(args.run, args.checkpoint, args.device)
    steps = args.steps or run.cfg.latent_diffusion.num_sampling_steps
    cfg = EvalConfig(num_samples=args.num_samples, num_steps=steps, batch_size=args.batch_size,
                     num_elbo_batches=math.ceil(args.num_samples / args.batch_size),
                     retrieval_pool=args.retrieval_pool, encoder=not args.no_encoder)
    cfg.check()
    options = SamplingOptions(num_steps=steps, strategy=args.strategy, guidance_scale=args.guidance_scale,
                              latent_sampler=run.cfg.latent_diffusion.sampler)
    report = evaluate(run, cfg, options, num_t_draws=args.num_t_draws, seed=args.seed)
    out = Path(args.out) if args.out else Path(args.run) / "eval" / f"{step_dir_name(run.step or 0)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    summary = markdown(report)
    out.with_suffix(".md").write_text(summary, encoding="utf-8")
    print(summary, end="")
    print(f"mmldlm eval: wrote {out} and {out.with_suffix('.md')}")
    return 0
