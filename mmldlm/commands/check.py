"""`mmldlm check CONFIG [section.key=value ...] [--fix OUT] [--resume PATH]`: audit a run config and the machine it
would run on for the problems that make a run fail or waste its hardware; each finding says why it
matters and how to fix it.
`--fix OUT` writes the corrected config (and OUT.diff); exit status 2 with errors, 1 with warnings
under --strict, else 0."""

from __future__ import annotations

import argparse

from mmldlm.wording import counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config: a YAML path or a preset name in configs/")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for train")
    parser.add_argument("--fix", metavar="OUT", help="write the corrected config to OUT and the change to OUT.diff")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="processes per node the run will use (default: $LOCAL_WORLD_SIZE, $NPROC_PER_NODE or 1)",
    )
    parser.add_argument("--nnodes", type=int, default=None, metavar="N", help="nodes (default: $NNODES or 1)")
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="memory per process of the target device (default: this machine's GPU, or RAM / processes)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        metavar="L",
        help="CPUs other work keeps busy (default: this machine's 1-minute load average)",
    )
    parser.add_argument(
        "--resume",
        metavar="PATH",
        help="the --resume the run will be started with (auto or a checkpoint): says what resuming it on "
        "another number of processes or strategy does",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mmldlm.config import load_config, save_config
    from mmldlm.tools.check import audit, config_diff, describe, detect_environment, fix_config, format_finding

    cfg = load_config(args.config, args.overrides)
    env = detect_environment(cfg, args.nproc_per_node, args.nnodes, args.device_memory_gib, args.load)
    env.resume = args.resume
    findings, est = audit(cfg, env)
    print(describe(env, est, cfg))
    for finding in findings:
        print(format_finding(finding))
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    print(
        ", ".join(
            counted(counts[s], noun) for s, noun in (("error", "error"), ("warning", "warning"), ("info", "note"))
        )
    )
    if args.fix:
        fixed, applied = fix_config(cfg, env)
        out = Path(args.fix)
        save_config(fixed, out)
        diff = config_diff(cfg, fixed, str(args.config), str(out))
        Path(f"{out}.diff").write_text(diff)
        remaining, _ = audit(fixed, env)
        left = [f for f in remaining if f.severity == "error"]
        print(f"\n--fix: applied {counted(len(applied), 'fix')}; wrote {out} and {out}.diff")
        print(diff or "(no config change)")
        for finding in left:  # only fixes outside the config (environment, disk) can be left
            print(f"still to fix outside the config: {finding.message}: {finding.fix}")
    if counts["error"]:
        return 2
    return 1 if counts["warning"] and args.strict else 0
