"""The positions the blocks compute for micro-batches of texts of random lengths, laid out each way the
loader lays them (mmldlm.data.dataset.PadCollate): padded to one length, packed in rows of
the longest text padded to a few row counts (data.pack_rows), and packed in one row as wide as the
shortest length bucket that holds it (data.length_buckets with data.packing). Counted, not timed.

    python scripts/packed_positions.py                      # the older codebase's shape: 8 texts of 600-2048 tokens
    python scripts/packed_positions.py --micro 64 --lengths 4:40 --widths 1024,1536
"""

from __future__ import annotations

import argparse

import numpy as np

from mmldlm.data.dataset import PadCollate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", type=int, default=8, help="texts a micro-batch (default %(default)s)")
    parser.add_argument("--lengths", default="600:2048", help="text lengths drawn uniformly, LOW:HIGH (%(default)s)")
    parser.add_argument("--rows", default="6", help="data.pack_rows for rows of the longest text (%(default)s)")
    parser.add_argument("--widths", default="12288", help="data.length_buckets of the one row (%(default)s)")
    parser.add_argument("--draws", type=int, default=5000, help="micro-batches drawn (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="numpy.random.default_rng's seed (%(default)s)")
    args = parser.parse_args(argv)
    low, high = (int(n) for n in args.lengths.split(":"))
    rows = [int(n) for n in args.rows.split(",")]
    widths = [int(n) for n in args.widths.split(",")]
    layouts = {
        f"padded to {high}": PadCollate(0, 1, high, buckets=[high]),
        f"rows of {high}, data.pack_rows={rows}": PadCollate(0, 1, high, high, pack_rows=rows),
        f"one row, data.length_buckets={widths}": PadCollate(0, 1, high, args.micro * high, widths, [1]),
    }
    rng = np.random.default_rng(args.seed)
    draws = [rng.integers(low, high + 1, args.micro) for _ in range(args.draws)]
    real = float(np.mean([lengths.sum() for lengths in draws]))
    print(
        f"{args.draws} micro-batches of {args.micro} texts of {low}-{high} tokens: {real:,.0f} real tokens on average"
    )
    print("| layout | positions a micro-batch, mean | real share | positions: share of micro-batches |")
    print("|---|---|---|---|")
    for name, collate in layouts.items():
        counts = np.array([text_positions(collate, lengths) for lengths in draws])
        sizes, times = np.unique(counts, return_counts=True)
        shares = ", ".join(f"{size:,}: {n / len(draws):.0%}" for size, n in zip(sizes, times))
        print(f"| {name} | {counts.mean():,.0f} | {real / counts.mean():.0%} | {shares} |")
    return 0


def text_positions(collate: PadCollate, lengths: np.ndarray) -> int:
    """The text positions the blocks compute for a batch of texts of these lengths: its padded (B, L)
    tokens, or packed, its (R, P) rows (the latent groups beside them are the latent stream's)."""
    samples = [(i, np.zeros(n, dtype=np.int64), np.zeros((1, 1), dtype=np.float32)) for i, n in enumerate(lengths)]
    batch = collate(samples)
    return batch["pack_doc"].numel() if "pack_doc" in batch else batch["tokens"].numel()


if __name__ == "__main__":
    raise SystemExit(main())
