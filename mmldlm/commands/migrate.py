"""`mmldlm migrate [OLD_CONFIG] [--launcher SCRIPT] [--nnodes N --gpus-per-node G --gpu-memory-mib M] --out FILE`:
take a run of the older research codebase over, as it really trained. Runs its bash launcher under bash
with every outside command recorded, composes the config its torchrun call names, models what the older
trainer did with it on the cluster given, writes our run config, and prints one table (the older run
against what we write), then the ERRORs and WARNINGs (mmldlm/tools/migrate/). Exit status 0 only when the
written config passes `mmldlm check` for the cluster and the older run's every override was read; else 1
with one line why (the config is still written, marked); 2 for input that cannot be read.

`mmldlm migrate --launchers DIR [CONFIG_DIR] --nnodes 1,2 --out OUT/` migrates every launcher of a folder at
each node count into OUT/ and prints one table of them; exit 0 only when every one is ready."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="the older run's config (YAML; its defaults groups in folders beside it); default: the one the "
        "launcher's torchrun call names (--config-name, in configs/ beside the trainer script); with "
        "--launchers, the folder of the older configs (CONFIG_DIR) where each call's --config-name is",
    )
    launchers = parser.add_mutually_exclusive_group()
    launchers.add_argument(
        "--launcher",
        metavar="SCRIPT",
        help="the older bash launcher: run under bash for the cluster, with every outside command recorded, "
        "not run; run migrate from the older repository's root, where the launcher was run",
    )
    launchers.add_argument(
        "--launchers",
        metavar="DIR",
        help="every launcher (*.sh) of a folder, at each node count of --nnodes; --out is then a folder",
    )
    parser.add_argument("--launcher-args", default="", metavar="'ARGS'", help="arguments the launcher is run with")
    parser.add_argument(
        "--nnodes",
        default="1",
        metavar="N[,N...]",
        help="nodes of the cluster the run will use (a list with --launchers)",
    )
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
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="where to write our run config (with --launchers: a folder)"
    )
    parser.add_argument("--verbose", action="store_true", help="print the details file instead of the summary")


def run(args: argparse.Namespace) -> int:
    # Lazy: hydra and torch load only when migrate runs (the CLI's start-up stays fast).
    import shlex
    from pathlib import Path

    from mmldlm.errors import OptionError, require_positive
    from mmldlm.tools.migrate import Cluster
    from mmldlm.tools.migrate.cluster import H100_MIB, H100_NAME

    counts = args.nnodes.split(",")
    if not all(n.strip().lstrip("-").isdigit() for n in counts):
        raise OptionError("--nnodes", args.nnodes, "an integer >= 1, or a list such as 1,2 with --launchers")
    nodes = [int(n) for n in counts]
    if len(nodes) > 1 and args.launchers is None:
        raise OptionError("--nnodes", args.nnodes, "one node count; a list goes with --launchers DIR")
    require_positive(
        {
            "--nnodes": min(nodes),
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
    clusters = [Cluster(n, args.gpus_per_node, memory, cpus, name, environ) for n in nodes]
    launcher_args = shlex.split(args.launcher_args)
    if args.launchers is not None:
        config_dir = Path(args.config) if args.config else None
        return _run_folder(Path(args.launchers), config_dir, clusters, Path(args.out), launcher_args, args.verbose)
    config = Path(args.config) if args.config else None
    launcher = Path(args.launcher) if args.launcher else None
    if config is None and launcher is None:
        raise OptionError("config", None, "the older config, or --launcher SCRIPT to find it from")
    return _run_one(config, launcher, clusters[0], Path(args.out), launcher_args, args.verbose)


def _run_one(config, launcher, cluster, out, launcher_args, verbose) -> int:
    import sys

    from mmldlm.tools.migrate import migrate
    from mmldlm.tools.migrate.migration import names_taken_in
    from mmldlm.tools.migrate.report import details_text, not_ready_line, summary, write_files

    m = migrate(config, launcher, cluster, out, launcher_args, taken=names_taken_in(out.parent, out))
    write_files(m)
    print(details_text(m) if verbose else summary(m))
    if m.why_not_ready is not None:
        print(not_ready_line(m), file=sys.stderr)
        return 1
    return 0


def _run_folder(folder, config_dir, clusters, out, launcher_args, verbose) -> int:
    """Every launcher of `folder` at each cluster: one line each, and their configs and details in `out`."""
    from mmldlm.errors import OptionError, UserError
    from mmldlm.tools.migrate import migrate
    from mmldlm.tools.migrate.report import details_text, folder_table, write_files

    launchers = sorted(folder.glob("*.sh")) if folder.is_dir() else []
    if not launchers:
        raise OptionError("--launchers", str(folder), "a folder of bash launchers (*.sh)")
    if out.exists() and not out.is_dir():
        raise OptionError("--out", str(out), "a folder (with --launchers)")
    rows, taken = [], {}
    for launcher in launchers:
        for cluster in clusters:
            target = out / f"{launcher.stem}-{cluster.nnodes}n.yaml"
            try:
                m = migrate(None, launcher, cluster, target, launcher_args, config_dir, taken)
            except UserError as err:
                rows.append((str(launcher), cluster.nnodes, None, str(err)))
                continue
            taken[m.run_name] = m.owner
            write_files(m)
            if verbose:
                print(details_text(m))
            rows.append((str(launcher), cluster.nnodes, m, None))
    print("\n".join(folder_table(rows)))
    print(f"written: {out}/ (each config beside its .migrate.txt)")
    return 0 if all(m is not None and m.why_not_ready is None for _, _, m, _ in rows) else 1
