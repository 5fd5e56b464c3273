"""`mmldlm prepare`: a text corpus (or the bundled default, or a legacy .npz/.npy folder) -> a
prepared dataset directory of token and latent shards. Under `torchrun --nproc_per_node N` the
ranks share the work and write the same output as one process. `--like RUN_DIR` prepares text with
a trained run's (or an exported model's) tokenizer and sentence encoder, so that `mmldlm eval --data` can
evaluate it on the result."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_input_options(parser)
    _add_output_options(parser)
    _add_tokenizer_options(parser)
    _add_latent_options(parser)
    _add_legacy_options(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_input_options(parser: argparse.ArgumentParser) -> None:
    """Which corpus to read, and which of its texts become samples."""
    src = parser.add_argument_group("input")
    src.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        dest="inputs",
        help="corpus files: .txt, .jsonl, .parquet, or .gz of each; 'default' is the bundled corpus "
        "(154k WordNet glosses and examples)",
    )
    src.add_argument(
        "--format",
        choices=["auto", "txt", "jsonl", "parquet"],
        default="auto",
        help="input format (auto: from the file name)",
    )
    src.add_argument("--text-field", default="text", help="the jsonl field or parquet column holding the text")
    src.add_argument(
        "--paragraphs",
        action="store_true",
        help="txt: samples are blank-line separated passages (lines joined by a space), not lines",
    )
    src.add_argument("--min-chars", type=int, default=1, help="drop samples shorter than this")
    src.add_argument(
        "--max-chars",
        type=int,
        default=1000,
        help="drop samples longer than this many characters, before --long-texts (raise it to keep long "
        "texts and let --long-texts split them)",
    )
    src.add_argument(
        "--long-texts",
        choices=["cut", "split", "drop"],
        default="cut",
        help="a text longer than --max-tokens tokens or than the sentence encoder reads (256 wordpieces for "
        "all-MiniLM-L6-v2): cut to its start that fits, split into passages that fit (sentences where they "
        "fit; each its own sample with its own latent), or drop it. The latent is always computed from "
        "the stored text (default: cut)",
    )
    src.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="the longest text the model reads, model.max_seq_len (default: with --like, the run's; else "
        "no limit but the encoder's)",
    )
    src.add_argument(
        "--max-samples",
        type=int,
        metavar="N",
        help="keep a seeded random subset of N samples (after filtering), in corpus order (default: all)",
    )
    src.add_argument(
        "--keep-duplicates",
        action="store_true",
        help="keep exact repeats (by default only the first stays: a repeat could land in train and val)",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where the dataset goes and how it is split into val and shards."""
    out = parser.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to create")
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DIR when it is a prepared dataset (a folder holding other files is never replaced)",
    )
    out.add_argument("--val-fraction", type=float, default=0.01, help="share of samples in the val split (0: none)")
    out.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    out.add_argument("--shard-size", type=int, default=16384, help="samples per shard file")
    out.add_argument("--latent-dtype", choices=["float16", "float32"], default="float16")


def _add_tokenizer_options(parser: argparse.ArgumentParser) -> None:
    """The tokenizer: a run's (--like), a given one, or a new BPE."""
    tk = parser.add_argument_group("tokenizer")
    tk.add_argument(
        "--like",
        metavar="RUN_DIR",
        help="the tokenizer (reused as is: no new BPE) and the sentence encoder of this training run's "
        "dataset, or of this exported model (mmldlm export), to evaluate it on this text "
        "(mmldlm eval --data)",
    )
    # --vocab-size and --encoder default to None so that giving them beside --like can be refused.
    tk.add_argument(
        "--vocab-size", type=int, help="train a byte-level BPE of this size on the train split (default 8192)"
    )
    tk.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="use this tokenizer.json (or a Hugging Face tokenizer folder) instead of training one",
    )


def _add_latent_options(parser: argparse.ArgumentParser) -> None:
    """The sentence encoder that makes the latents, and where it runs."""
    enc = parser.add_argument_group("latents")
    enc.add_argument(
        "--encoder",
        help="a registered sentence encoder or a local sentence-transformers folder "
        "(with --legacy-*: the encoder that made the legacy latents, recorded only; "
        "default all-MiniLM-L6-v2)",
    )
    enc.add_argument(
        "--no-normalize",
        action="store_true",
        help="keep the encoder's raw pooled vectors (default: L2-normalised, unit length)",
    )
    enc.add_argument("--encode-batch-size", type=int, default=128)
    enc.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK when CUDA is available, else cpu")


def _add_legacy_options(parser: argparse.ArgumentParser) -> None:
    leg = parser.add_argument_group("legacy import (a per-sample .npz/.npy layout)")
    leg.add_argument("--legacy-tokens", metavar="DIR", help="folder of <stem>_tokens.npz (input_ids, attention_mask)")
    leg.add_argument("--legacy-latents", metavar="DIR", help="folder of <stem>.npy latents, float32 [D] or [1, D]")
    leg.add_argument(
        "--legacy-order",
        choices=("sorted", "scan"),
        default="sorted",
        help="sorted: every <stem>_tokens.npz in stem order (--max-samples: a seeded subset); scan: the older "
        "loader's walk, the folder's own order (os.scandir), each .npz with a latent, --max-samples the first N "
        "(the same files on the filesystem it read, others on a copy)",
    )


def tokenizer_and_encoder(args: argparse.Namespace) -> dict:
    """The tokenizer, vocab_size, encoder and normalize fields: the run's with --like, else the flags'."""
    from mmldlm.data.errors import DataError
    from mmldlm.data.prepare import PrepareOptions, options_like_run

    if args.like is None:
        return {
            "tokenizer": args.tokenizer,
            "normalize": not args.no_normalize,
            "vocab_size": PrepareOptions.vocab_size if args.vocab_size is None else args.vocab_size,
            "encoder": PrepareOptions.encoder if args.encoder is None else args.encoder,
        }
    decided = {
        "--tokenizer": args.tokenizer,
        "--vocab-size": args.vocab_size,
        "--encoder": args.encoder,
        "--no-normalize": args.no_normalize or None,
        "--legacy-tokens": args.legacy_tokens,
        "--legacy-latents": args.legacy_latents,
    }  # what --like takes from the run, or would contradict
    given = [flag for flag, value in decided.items() if value is not None]
    if given:
        raise DataError(
            f"--like {args.like} takes the tokenizer and the encoder from the run's dataset; drop "
            f"{', '.join(given)} (or drop --like)"
        )
    from pathlib import Path

    from mmldlm.export.pretrained import is_exported, options_like_exported
    from mmldlm.runs.trained import recorded_run_dataset

    if is_exported(Path(args.like)):
        return options_like_exported(args.like)
    return options_like_run(args.like, recorded_run_dataset(Path(args.like)))


def options_from_args(args: argparse.Namespace):
    from mmldlm.data.prepare import PrepareOptions

    like = tokenizer_and_encoder(args)
    like_max_tokens = like.pop("max_tokens", None)
    return PrepareOptions(
        inputs=args.inputs or [],
        out=args.out,
        format=args.format,
        text_field=args.text_field,
        paragraphs=args.paragraphs,
        min_chars=args.min_chars,
        max_chars=args.max_chars,
        dedup=not args.keep_duplicates,
        max_samples=args.max_samples,
        long_texts=args.long_texts,
        max_tokens=like_max_tokens if args.max_tokens is None else args.max_tokens,
        **like,
        latent_dtype=args.latent_dtype,
        val_fraction=args.val_fraction,
        seed=args.seed,
        shard_size=args.shard_size,
        legacy_tokens=args.legacy_tokens,
        legacy_latents=args.legacy_latents,
        legacy_order=args.legacy_order,
        encode_batch_size=args.encode_batch_size,
        device=args.device,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    import torch.distributed as dist

    from mmldlm.data.prepare import prepare

    opts = options_from_args(args)
    # Under torchrun the ranks share the work over a CPU (gloo) group.
    own_group = int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        prepare(opts)
    except BaseException:
        if own_group:
            dist.destroy_process_group()
        raise
    if own_group:
        # Leave together and skip gloo's teardown at exit, which sometimes aborted a finished rank
        # (see mmldlm.training.distributed.leave).
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
