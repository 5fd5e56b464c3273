"""Where a run's l2t loss lies: cross-entropy and accuracy of the masked tokens of validation texts,
given their clean latents, at fixed shares of the text masked (1.0: the latent alone, where a sampler
writes its first token; 0.1: nearly the whole text known). One row per share, one column pair per run.

    python scripts/loss_by_mask_rate.py runs/default runs/wide256 --num-samples 512

Also the same with the latent replaced by another text's (the rows shifted by one): what the latent
itself is worth at each share.
"""

from __future__ import annotations

import argparse

import torch

from mmldlm.export.pretrained import load_trained

SHARES = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)


@torch.no_grad()
def masked_loss(run, tokens, pad_mask, latents, share: float, generator) -> tuple[float, float]:
    """(nats per masked token, argmax accuracy) with `share` of each text's tokens masked."""
    t = torch.full((tokens.shape[0],), share)
    noised = run.text.add_noise(tokens, t, pad_mask, generator)
    logits = run.model(noised, latents, t, torch.zeros_like(t), pad_mask, text_head=True, latent_head=False)
    masked = run.text.loss_positions(noised, pad_mask)
    scores = logits.text_logits[masked].float()
    scores[:, run.text.mask_token_id] = float("-inf")  # never the answer (SUBS)
    targets = tokens[masked]
    ce = torch.nn.functional.cross_entropy(scores, targets)
    return ce.item(), (scores.argmax(-1) == targets).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    columns = []
    for path in args.runs:
        run = load_trained(path)
        run.model.eval()
        items = [run.val[i] for i in range(min(args.num_samples, len(run.val)))]
        tokens, pad_mask = run.batch_of([ids[: run.max_length] for _, ids, _ in items])
        latents = run.latent.standardize(run.latents_of([z for _, _, z in items], path))
        column = {}
        for share in SHARES:
            own = masked_loss(run, tokens, pad_mask, latents, share, torch.Generator().manual_seed(args.seed))
            other = masked_loss(
                run, tokens, pad_mask, latents.roll(1, 0), share, torch.Generator().manual_seed(args.seed)
            )
            column[share] = (*own, other[0])
        columns.append((f"{path} (step {run.step})", column))
    print(
        f"{args.num_samples} validation texts; nats per masked token (accuracy) with the text's own latent, "
        "and nats with another text's latent\n"
    )
    print("| share masked | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for share in SHARES:
        cells = [f"{c[share][0]:.2f} ({c[share][1]:.1%}); other latent {c[share][2]:.2f}" for _, c in columns]
        print(f"| {share:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
