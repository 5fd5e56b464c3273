"""A per-sample layout of the shape that MM-LDLM runs of an older codebase keep (one padded .npz of
token ids and one .npy latent per text), written from random numbers, and the time and memory of
importing it with `mmldlm prepare --legacy-*` on one and on several processes.

    PYTHONPATH=. python scripts/legacy_layout.py write --out /tmp/layout --num-files 100000
    PYTHONPATH=. python scripts/legacy_layout.py measure --layout /tmp/layout --counts 25000 50000 100000 --nproc 1 2

`write` makes LAYOUT/tokens/<stem>_tokens.npz (input_ids and attention_mask, int64 [1, padded length],
real lengths uniform in [--min-tokens, --max-tokens]), LAYOUT/latents/<stem>.npy (float32 [D]) and
LAYOUT/tokenizer.json, a WordPiece tokenizer of --vocab-size entries laid out as bert-base-uncased's
([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103). Files are written by --workers processes.
`measure` imports the first N files of the layout (hard links in LAYOUT/subset-N) for each N and each
process count, and prints one JSON line per import: seconds, files per second, and the peak resident
memory of the largest process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SPECIAL = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"[unused{i}]": i for i in range(vocab_size)}
    for token, index in SPECIAL.items():
        vocab.pop(f"[unused{index}]")
        vocab[token] = index
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.save(str(path))


def _write_files(job: tuple) -> None:
    root, first, last, args = job
    rng = np.random.default_rng(first)
    for i in range(first, last):
        stem = f"sample_{i:08d}"
        length = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        ids = np.zeros((1, args.padded_length), dtype=np.int64)  # (1, L) as a tokenizer's return_tensors="np"
        ids[0, 0], ids[0, length - 1] = SPECIAL["[CLS]"], SPECIAL["[SEP]"]
        ids[0, 1 : length - 1] = rng.integers(999, args.vocab_size, length - 2)
        mask = (np.arange(args.padded_length) < length)[None].astype(np.int64)
        np.savez(root / "tokens" / f"{stem}_tokens.npz", input_ids=ids, attention_mask=mask)
        np.save(root / "latents" / f"{stem}.npy", rng.standard_normal(args.latent_dim).astype(np.float32))


def write(args) -> None:
    root = Path(args.out)
    (root / "tokens").mkdir(parents=True, exist_ok=True)
    (root / "latents").mkdir(parents=True, exist_ok=True)
    write_tokenizer(root / "tokenizer.json", args.vocab_size)
    step = 1000
    jobs = [(root, s, min(s + step, args.num_files), args) for s in range(0, args.num_files, step)]
    start = time.perf_counter()
    with multiprocessing.Pool(args.workers) as pool:
        pool.map(_write_files, jobs)
    print(json.dumps({"wrote": args.num_files, "seconds": round(time.perf_counter() - start, 1), "layout": str(root)}))


def subset(root: Path, count: int) -> Path:
    """LAYOUT/subset-N: hard links to the first N samples (sorted by name, as the import reads them)."""
    target = root / f"subset-{count}"
    if (target / "tokens").is_dir():
        return target
    stems = sorted(p.name[: -len("_tokens.npz")] for p in (root / "tokens").glob("*_tokens.npz"))[:count]
    for kind in ("tokens", "latents"):
        (target / kind).mkdir(parents=True, exist_ok=True)
    for stem in stems:
        os.link(root / "tokens" / f"{stem}_tokens.npz", target / "tokens" / f"{stem}_tokens.npz")
        os.link(root / "latents" / f"{stem}.npy", target / "latents" / f"{stem}.npy")
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_once(root: Path, layout: Path, nproc: int, shard_size: int) -> dict:
    out = root / f"imported-{layout.name}-{nproc}"
    args = ["prepare", "--legacy-tokens", str(layout / "tokens"), "--legacy-latents", str(layout / "latents")]
    args += ["--tokenizer", str(root / "tokenizer.json"), "--out", str(out), "--overwrite", "--quiet"]
    args += ["--val-fraction", "0.05", "--shard-size", str(shard_size)]
    if nproc == 1:
        command = [sys.executable, "-m", "mmldlm.cli", *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "mmldlm.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    # The largest resident set of any process waited for so far (Linux: KiB); imports run largest last.
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    files = len(list((layout / "tokens").iterdir()))
    return {
        "files": files,
        "processes": nproc,
        "seconds": round(seconds, 1),
        "files_per_s": round(files / seconds),
        "seconds_per_100k_files": round(seconds * 100_000 / files, 1),
        "peak_rss_mib_largest_process_so_far": round(peak_mib),
    }


def measure(args) -> None:
    root = Path(args.layout)
    for count in sorted(args.counts):
        layout = subset(root, count)
        for nproc in args.nproc:
            print(json.dumps(import_once(root, layout, nproc, args.shard_size)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a layout of random samples")
    w.add_argument("--out", required=True)
    w.add_argument("--num-files", type=int, default=100_000)
    w.add_argument("--min-tokens", type=int, default=600)
    w.add_argument("--max-tokens", type=int, default=1900)
    w.add_argument("--padded-length", type=int, default=2048)
    w.add_argument("--vocab-size", type=int, default=30522)
    w.add_argument("--latent-dim", type=int, default=32)
    w.add_argument("--workers", type=int, default=2)
    m = sub.add_parser("measure", help="time the import of the first N files on 1 and more processes")
    m.add_argument("--layout", required=True)
    m.add_argument("--counts", type=int, nargs="+", default=[25_000, 50_000, 100_000])
    m.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    m.add_argument("--shard-size", type=int, default=16384)
    args = parser.parse_args(argv)
    write(args) if args.command == "write" else measure(args)


if __name__ == "__main__":
    main()
