"""Quality of decoding against its cost, one row per set of sampler options, on one trained run. l2t (the
same validation latents for every row): word F1, exact match, BLEU, repetition, word 3-gram perplexity
(fitted on the run's training texts), re-encoded cosine, model calls, encoder calls and seconds per
sample. `--mode joint` (the same lengths, drawn from the validation split): consistency of each text
with its own latent, repetition, n-gram perplexity, distinct-2, seconds per sample.

Each figure has its 95% bootstrap interval over the texts, and every row after the first its difference
from the first row with the 95% interval of a paired bootstrap (every row decodes the same latents with
the same seed, so the texts pair up): "0.395 [0.37, 0.42]; +0.036 [+0.010, +0.062]" says the row beats
the first by 0.036, and the difference is real where its interval excludes 0. The re-encoded cosine (and
the joint consistency) is what best_of and correction rounds select on, so in their rows it is a
maximum over candidates: compare such rows by word F1, exact match, BLEU and the perplexity. Each row
names its options as SamplingOptions fields; `default` is the run's own sampler.

    python scripts/decoding_table.py --run runs/default --num-samples 128 \\
        default "best_of=4" "best_of=4 correction_rounds=4" "remask_rounds=2 repetition_penalty=1"
    python scripts/decoding_table.py --run runs/default --mode joint default "num_steps=8 best_of=8"

Timings are one measurement each on whatever else the machine runs: compare rows of one table only.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import yaml

from mmldlm.device import keep_freed_memory
from mmldlm.evaluation.evaluate import fluency_reference, joint_generation, l2t_reconstruction
from mmldlm.evaluation.figures import recipes
from mmldlm.evaluation.report import figure_text
from mmldlm.export.pretrained import load_trained
from mmldlm.sampling import SamplingOptions

COLUMNS = {
    "l2t": (
        ("word F1", "word_f1", "{:.3f}"),
        ("exact", "exact_match", "{:.1%}"),
        ("BLEU", "bleu", "{:.1f}"),
        ("repetition", "repetition", "{:.3f}"),
        ("n-gram perplexity", "ngram_perplexity", "{:.0f}"),
        ("cosine (selected on, where best_of > 1 or correction_rounds > 0)", "cosine_mean", "{:.3f}"),
        ("model calls / batch", "model_calls_per_batch", "{:.0f}"),
        ("encoded / sample", "encoded_per_sample", "{:.0f}"),
    ),
    "joint": (
        ("consistency (selected on, where best_of > 1 or correction_rounds > 0)", "consistency", "{:.3f}"),
        ("repetition", "repetition", "{:.3f}"),
        ("n-gram perplexity", "ngram_perplexity", "{:.0f}"),
        ("distinct-2", "distinct_2", "{:.3f}"),
    ),
}
DECODE = {"l2t": l2t_reconstruction, "joint": joint_generation}
FIGURES = {"l2t": recipes("l2t"), "joint": recipes("joint")}


def options_of(run, row: str) -> SamplingOptions:
    """The run's sampler defaults with the `field=value` pairs of one table row ("default": none)."""
    given = {} if row == "default" else dict(pair.split("=", 1) for pair in row.split())
    options = SamplingOptions.defaults(run.cfg.text_diffusion, run.cfg.latent_diffusion)
    options = dataclasses.replace(options, **{key: yaml.safe_load(value) for key, value in given.items()})
    options.check()
    return options


def cell(result: dict, first: dict | None, recipes: dict, key: str, fmt: str) -> str:
    """A figure with its interval and, for rows after the first, its paired difference from the first row."""
    if key not in result:
        return "-"
    text = figure_text(result, key, fmt.strip("{:}"))
    if first is None or key not in recipes:
        return text
    difference = recipes[key].difference(result["per_text"], first["per_text"])
    if difference is None:  # no interval for this figure (intervals.CorpusStatistic.resampled)
        return text
    signed = "{:+" + fmt.strip("{:}") + "}"
    bounds = f"[{signed.format(difference.low)}, {signed.format(difference.high)}]"
    return f"{text}; {signed.format(difference.difference)} {bounds}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", choices=sorted(DECODE), default="l2t")
    parser.add_argument("rows", nargs="+", help='one per table row: "default" or "field=value field=value ..."')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    run = load_trained(args.run)
    run.model.eval()
    run.encode_latents(["warm the encoder up"])
    fluency = fluency_reference(run)  # the word 3-gram model of the run's training texts (about 11 s)
    columns = COLUMNS[args.mode]
    head = [name for name, *_ in columns] + ["s / sample"]
    what = "validation latents at their source lengths" if args.mode == "l2t" else "joint samples"
    print(f"{args.run} step {run.step}, {args.num_samples} {what}; each figure with its 95% interval, and after the")
    print("first row its difference from the first row with the 95% interval of a paired bootstrap\n")
    print("| options | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(head))
    first = None
    for row in args.rows:
        options = options_of(run, row)
        start = time.perf_counter()
        result = DECODE[args.mode](run, options, args.num_samples, args.batch_size, args.seed, fluency=fluency)
        seconds = time.perf_counter() - start
        cells = [cell(result, first, FIGURES[args.mode], key, fmt) for _, key, fmt in columns]
        cells.append(f"{seconds / result['num_samples']:.3f}")
        print(f"| {row} | " + " | ".join(cells) + " |", flush=True)
        first = first or result


if __name__ == "__main__":
    main()
