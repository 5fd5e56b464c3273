"""`mmldlm migrate OLD_CONFIG [--launcher SCRIPT] [--nnodes N --gpus-per-node G --gpu-memory-gib M] --out FILE`:
take a run of the older research codebase over. Reads its Hydra-composed run config (and the bash launcher
that started it), writes our run config for the cluster given, audits the older files in the shape of
`mmldlm check` and prints the prepare and train lines to run next (mmldlm/tools/migrate.py)."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the older run's config (YAML; its defaults groups in folders beside it)")
    parser.add_argument(
        "--launcher",
        metavar="SCRIPT",
        help="the older bash launcher (torchrun ... --config-name NAME key=value ...): its exports are audited and "
        "its batch, LR, warmup and step rules applied for the cluster (default: none, the config's values as they are)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the cluster the run will use")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node")
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, as the launcher reads it"
    )
    parser.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help="CPUs per node, for the loader workers (default: this machine's)",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write our run config")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mmldlm.errors import OptionError, require_positive
    from mmldlm.tools.migrate import Cluster, migrate

    require_positive(
        {"--nnodes": args.nnodes, "--gpus-per-node": args.gpus_per_node, "--cpus-per-node": args.cpus_per_node}
    )
    if not args.gpu_memory_gib > 0:
        raise OptionError("--gpu-memory-gib", args.gpu_memory_gib, "a number of GiB > 0")
    cpus = args.cpus_per_node or os.cpu_count() or 1
    cluster = Cluster(args.nnodes, args.gpus_per_node, args.gpu_memory_gib, cpus)
    launcher = Path(args.launcher) if args.launcher else None
    print(migrate(Path(args.config), launcher, cluster, Path(args.out)).report)
    return 0
