"""What verifying a checkpoint costs before its weights load (`verify` in mmldlm/runs/checkpoints.py: every
load of sample, eval, export, from_pretrained, --init-from and --resume runs it). A synthetic checkpoint of
a model preset's size (by default `base`: fp32 weights, EMA and AdamW's two moments, 16 bytes per
parameter, in one shard per process as the trainer writes them, with the manifest of meta.json) is
verified with its checksums from a cold page cache, again from a warm one, then with the verdict
remembered beside it, and by sizes only.

    PYTHONPATH=. python scripts/verify_bench.py --dir DIR            # the base preset, 2 shards: 14.9 GB
    PYTHONPATH=. python scripts/verify_bench.py --dir DIR --gib 1    # any size
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mmldlm.config import load_model_preset  # noqa: E402
from mmldlm.data.encoders import DEFAULT_ENCODER, ENCODER_WIDTHS  # noqa: E402
from mmldlm.model import MultimodalMMDiT  # noqa: E402
from mmldlm.runs.checkpoints import VERDICT, file_sha256, verify  # noqa: E402

BYTES_PER_PARAM = 16  # fp32 weights, fp32 EMA, AdamW's two fp32 moments
BLOCK = 64 * 2**20  # random bytes written over and over: SHA-256 and the disk take the same time for any bytes


def preset_bytes(preset: str, vocab_size: int = 8192) -> tuple[int, int]:
    """(parameters, bytes of a checkpoint) of model preset `preset`, counted on the meta device."""
    cfg = load_model_preset(preset)
    cfg = dataclasses.replace(cfg, latent_dim=cfg.latent_dim or ENCODER_WIDTHS[DEFAULT_ENCODER], num_latents=1)
    with torch.device("meta"):
        params = sum(p.numel() for p in MultimodalMMDiT(cfg, vocab_size=cfg.vocab_size or vocab_size).parameters())
    return params, params * BYTES_PER_PARAM


def write_checkpoint(path: Path, num_bytes: int, num_shards: int) -> None:
    """A checkpoint directory whose shards hold `num_bytes` in all, with meta.json listing each file's size
    and SHA-256 (taken as the trainer takes them, by reading the file back)."""
    path.mkdir(parents=True)
    block = os.urandom(BLOCK)
    files = {}
    for rank in range(num_shards):
        shard = path / f"__{rank}_0.distcp"
        left = num_bytes // num_shards
        with open(shard, "wb") as f:
            while left:
                left -= f.write(block[: min(left, BLOCK)])
            os.fsync(f.fileno())
        files[shard.name] = {"bytes": shard.stat().st_size, "sha256": file_sha256(shard)}
    for name in (".metadata", "trainer.pt"):
        (path / name).write_bytes(os.urandom(4096))
        files[name] = {"bytes": 4096, "sha256": file_sha256(path / name)}
    (path / "meta.json").write_text(json.dumps({"step": 1, "world_size": num_shards, "files": files}))


def drop_from_page_cache(path: Path) -> None:
    for file in path.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(path: Path, checksums: bool, forget: bool) -> float:
    """Seconds of one `verify`; `forget`: the remembered verdict removed first."""
    if forget:
        (path / VERDICT).unlink(missing_ok=True)
    started = time.perf_counter()
    reason = verify(path, checksums=checksums)
    assert reason is None, reason
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where to write the synthetic checkpoint (removed after)")
    parser.add_argument("--preset", default="base", help="the model preset whose checkpoint size is written")
    parser.add_argument("--gib", type=float, help="write this many GiB instead of the preset's size")
    parser.add_argument("--shards", type=int, default=2, help="shard files (the processes that wrote it)")
    args = parser.parse_args(argv)
    if args.gib is None:
        params, num_bytes = preset_bytes(args.preset)
        what = f"the {args.preset} preset ({params / 1e9:.2f} B parameters x {BYTES_PER_PARAM} bytes)"
    else:
        num_bytes, what = int(args.gib * 2**30), f"{args.gib:g} GiB"
    path = Path(args.dir) / "step-0000001"
    if path.exists():
        shutil.rmtree(path)
    try:
        write_checkpoint(path, num_bytes, args.shards)
        drop_from_page_cache(path)
        seconds = {
            "checksums, cold page cache": timed(path, True, forget=True),
            "checksums, warm page cache": timed(path, True, forget=True),
            "verdict remembered": timed(path, True, forget=False),
            "sizes only": timed(path, False, forget=False),
        }
    finally:
        shutil.rmtree(path, ignore_errors=True)
    load = os.getloadavg()[0]
    print(
        f"verify of a checkpoint of {what}: {num_bytes / 1e9:.2f} GB in {args.shards} shards; load average {load:.1f}"
    )
    for label, s in seconds.items():
        rate = f" ({num_bytes / s / 1e9:.2f} GB/s)" if label.startswith("checksums") else ""
        print(f"  {label}: {s:.2f} s{rate}" if s >= 0.1 else f"  {label}: {s * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
