"""`mmldlm train --config NAME [section.key=value ...] [--resume auto|PATH]`: train one run. The same
command runs under torchrun on many processes and nodes (see scripts/launch.sh)."""

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
        "unless it is missing or damaged), if there is one; PATH: a checkpoint directory",
    )


def run(args: argparse.Namespace) -> int:
    from mmldlm.config import load_config
    from mmldlm.training.run import train

    command = shlex.join(["mmldlm", "train", "--config", args.config, *args.overrides])
    return train(load_config(args.config, args.overrides), resume=args.resume, command=command)
