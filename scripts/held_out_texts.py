"""Texts that none of the given runs trained on, to compare runs trained on different data.

Two runs on different datasets (the main job's 50k-text subset and the quality preset's whole corpus)
hold out different validation texts, and each trained on much of the other's: evaluating both on either
split measures one of them on its training texts. This writes the validation texts of the first run's
dataset without every text that any given run trained on (compared as decoded, so runs with different
tokenizers compare too), as JSON lines {"text": ...}:

    python scripts/held_out_texts.py runs/quality runs/default --out held.jsonl
    mmldlm prepare --like runs/quality --input held.jsonl --out data/held-quality --val-fraction 0
    mmldlm prepare --like runs/default --input held.jsonl --out data/held-default --val-fraction 0
    mmldlm eval --run runs/quality --data data/held-quality --num-samples 128 --out quality.json
    mmldlm eval --run runs/default --data data/held-default --num-samples 128 --out default.json
    mmldlm compare quality.json default.json

Each run reads the texts with its own tokenizer; the two reports scored the same texts when their
`texts_sha256` agree (the decoded texts and their latents), which `compare` checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmldlm.errors import UserError


def held_out(runs: list[str], limit: int | None = None) -> tuple[list[str], dict[str, int]]:
    """The first run's validation texts that no run in `runs` trained on (at most `limit`), and how many
    each run's training split removed."""
    from mmldlm.config import load_config
    from mmldlm.runs.trained import dataset_texts
    from mmldlm.tools.check import prepared_data_path

    dirs = []
    for path in runs:
        config = Path(path) / "config.yaml"
        if not config.is_file():
            raise UserError(f"{path}: no config.yaml; expected a training run directory (an export carries no texts)")
        data = prepared_data_path(load_config(config))
        if data is None:
            raise UserError(f"{path}: its prepared dataset is not on disk; prepare it again as the run did")
        dirs.append(str(data))
    candidates = dataset_texts(dirs[0], "val")
    removed, kept = {}, list(candidates)
    for path, data in zip(runs, dirs):
        trained = set(dataset_texts(data, "train"))
        before = len(kept)
        kept = [text for text in kept if text not in trained]
        removed[path] = before - len(kept)
    return kept[:limit] if limit else kept, removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="training run directories; texts come from the first's val split"
    )
    parser.add_argument("--out", required=True, metavar="FILE.jsonl", help="write the texts here")
    parser.add_argument("--limit", type=int, default=None, help="at most this many texts (default: all)")
    args = parser.parse_args(argv)
    try:
        texts, removed = held_out(args.runs, args.limit)
    except UserError as err:
        print(f"held_out_texts: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    dropped = ", ".join(f"{n} trained on by {path}" for path, n in removed.items())
    print(f"held_out_texts: wrote {len(texts)} texts to {out} ({dropped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
