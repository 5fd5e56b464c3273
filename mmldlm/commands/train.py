"""`mmldlm train --config NAME [section.key=value ...] [--resume auto|PATH] [--init-from SOURCE]`: train
one run, or (--init-from) start a new one from another run's weights. The same command runs under
torchrun on many processes and nodes (see scripts/launch.sh)."""

from __future__ import annotations

import argparse
import shlex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="default", help="run config: a YAML path or a preset name in configs/ (default: default)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.steps=100 model=small"
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="auto: continue from the newest checkpoint in RUN/checkpoints that verifies (latest, "
        "unless it is missing or damaged), if there is one; PATH: a checkpoint directory (default: none, a "
        "new run; one whose run directory holds checkpoints is refused)",
    )

    parser.add_argument(
        "--init-from",
        metavar="SOURCE",
        help="start a NEW run from the weights of SOURCE: a run directory (its newest checkpoint), a "
        "checkpoint directory or an exported model folder; optimizer, LR schedule, data position and step "
        "start afresh (train.init_from; default: none, random initial weights). New data must be prepared "
        "with `mmldlm prepare --like SOURCE`",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar (logging.progress_bar=false); the log lines stay"
    )
    parser.add_argument(
        "--init-weights",
        choices=["ema", "raw"],
        help="with --init-from: the source's EMA of the weights where it kept one, or its raw trained "
        "weights (train.init_weights; default: ema)",
    )


def run(args: argparse.Namespace) -> int:
    from mmldlm.config import load_config
    from mmldlm.training.run import train

    overrides = list(args.overrides)
    if args.init_from is not None:
        overrides.append(f"train.init_from={args.init_from}")
    if args.init_weights is not None:
        overrides.append(f"train.init_weights={args.init_weights}")
    if args.quiet:
        overrides.append("logging.progress_bar=false")
    command = shlex.join(["mmldlm", "train", "--config", args.config, *overrides])
    return train(load_config(args.config, overrides), resume=args.resume, command=command)
