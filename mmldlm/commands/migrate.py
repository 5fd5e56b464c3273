"""`mmldlm migrate [OLD_CONFIG] [--launcher SCRIPT] [--nnodes N --gpus-per-node G --gpu-memory-mib M] --out FILE`:
take a run of the older research codebase over, as it really trained. Runs its bash launcher under bash
with every outside command recorded, composes the config its torchrun call names, models what the older
trainer did with it on the cluster given, writes our run config, and prints one table (the older run
against what we write), then the ERRORs and WARNINGs (mmldlm/tools/migrate/). Exit status 0 only when the
written config passes `mmldlm check` for the cluster and the older run's every override was read; else 1
with one line why (the config is still written, marked); 2 for input that cannot be read."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="the older run's config (YAML; its defaults groups in folders beside it); default: the one the "
        "launcher's torchrun call names (--config-name, in configs/ beside the trainer script)",
    )
    parser.add_argument(
        "--launcher",
        metavar="SCRIPT",
        help="the older bash launcher: run under bash for the cluster, with every outside command recorded, "
        "not run; run migrate from the older repository's root, where the launcher was run",
    )
    parser.add_argument("--launcher-args", default="", metavar="'ARGS'", help="arguments the launcher is run with")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the cluster the run will use")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node")
    parser.add_argument(
        "--gpu-memory-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="memory of one GPU as nvidia-smi --query-gpu=memory.total reports it (default: an 80 GB H100's, 81559)",
    )
    parser.add_argument("--gpu-name", default=None, help="the GPU's name as nvidia-smi reports it (default: an H100's)")
    parser.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help="CPUs per node, for the loader workers (default: this machine's)",
    )
    parser.add_argument(
        "--env",
        action="append",
        metavar="NAME=VALUE",
        help="a variable the scheduler sets for the launcher (WORLD_SIZE, SLURM_NNODES, ...); default: the "
        "conventions tried in turn until the launcher's torchrun call asks for the cluster",
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write our run config")
    parser.add_argument("--verbose", action="store_true", help="print the details file too")


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys
    from pathlib import Path

    from mmldlm.errors import OptionError, require_positive
    from mmldlm.tools.migrate import Cluster, migrate
    from mmldlm.tools.migrate.cluster import H100_MIB, H100_NAME
    from mmldlm.tools.migrate.report import summary

    require_positive(
        {
            "--nnodes": args.nnodes,
            "--gpus-per-node": args.gpus_per_node,
            "--gpu-memory-mib": args.gpu_memory_mib,
            "--cpus-per-node": args.cpus_per_node,
        }
    )
    environ = {}
    for item in args.env or []:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise OptionError("--env", item, "NAME=VALUE")
        environ[name] = value
    cpus = args.cpus_per_node or os.cpu_count() or 1
    memory, name = args.gpu_memory_mib or H100_MIB, args.gpu_name or H100_NAME
    cluster = Cluster(args.nnodes, args.gpus_per_node, memory, cpus, name, environ)
    config = Path(args.config) if args.config else None
    launcher = Path(args.launcher) if args.launcher else None
    if config is None and launcher is None:
        raise OptionError("config", None, "the older config, or --launcher SCRIPT to find it from")
    m = migrate(config, launcher, cluster, Path(args.out), shlex.split(args.launcher_args))
    print(summary(m))
    if args.verbose:
        print("\n" + m.details_path.read_text())
    if m.why_not_ready is not None:
        print(f"mmldlm migrate: {m.why_not_ready} ({m.out} written, marked NOT READY)", file=sys.stderr)
        return 1
    return 0
