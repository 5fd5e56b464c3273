"""How the text bound's estimate behaves with uniform and with importance-sampled times of t
(mmldlm/evaluation/evaluate.py `importance_times`), on simulated evaluations: markdown on stdout.

    python scripts/elbo_times_study.py [--evaluations 300] [--texts 128] [--draws 2]

Each evaluation draws `--texts` texts of 8 to 24 tokens whose tokens cost lognormal nats (median 4.1,
mean 5.6) and, one token in 50, 15 nats (a token the model is sure of and wrong about); each text is
scored `--draws` times as the evaluation does: a time t, each token masked with probability t, the
masked tokens' nats weighted 1/t (t below eps = 1e-3 noised at eps), and with importance-sampled times
the weight 2u of t = u^2. Per scheme: the upper over the lower half-width of the 95% interval of nats
per token (`intervals.bootstrap`), and the largest share of the total held by one text-draw.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from mmldlm.evaluation.evaluate import importance_times, largest_share
from mmldlm.evaluation.intervals import bootstrap

EPS, MAX_TOKENS = 1e-3, 24


def evaluation(rng: np.random.Generator, g: torch.Generator, num_texts: int, num_draws: int, importance: bool):
    """(upper / lower half-width, largest share) of one simulated evaluation."""
    tokens = rng.integers(8, MAX_TOKENS + 1, size=num_texts)
    nats = rng.lognormal(mean=1.4, sigma=0.8, size=(num_texts, MAX_TOKENS))
    nats = np.where(rng.random(nats.shape) < 0.02, 15.0, nats) * (np.arange(MAX_TOKENS) < tokens[:, None])
    draws = []
    for d in range(num_draws):
        if importance:
            t, weight = (x.double().numpy() for x in importance_times(num_texts, d, num_draws, g))
        else:
            t, weight = torch.rand(num_texts, generator=g, dtype=torch.float64).numpy(), np.ones(num_texts)
        t = np.maximum(t, EPS)
        masked = rng.random(nats.shape) < t[:, None]
        draws.append((nats * masked).sum(axis=1) / t * weight)
    per_text = np.stack(draws, axis=1)  # (texts, draws) nats per text
    est = bootstrap(per_text / tokens[:, None], weights=tokens, seed=int(rng.integers(2**31)))
    return (est.high - est.value) / (est.value - est.low), largest_share(per_text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evaluations", type=int, default=300)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--draws", type=int, default=2)
    args = parser.parse_args(argv)
    print(
        f"| times of t ({args.evaluations} evaluations of {args.texts} texts x {args.draws} draws) | upper / lower "
        "half-width: median, 90th percentile | evaluations above 1.5x | largest text-draw share: median, 90th "
        "percentile, max |"
    )
    print("|---|---|---|---|")
    for name, importance in (("uniform", False), ("importance-sampled, stratified by draw", True)):
        rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
        ratio, share = np.array(
            [evaluation(rng, g, args.texts, args.draws, importance) for _ in range(args.evaluations)]
        ).T
        print(
            f"| {name} | {np.median(ratio):.2f}, {np.percentile(ratio, 90):.2f} | {(ratio > 1.5).mean():.1%} | "
            f"{np.median(share):.1%}, {np.percentile(share, 90):.1%}, {share.max():.1%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
