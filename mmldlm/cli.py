"""The `mmldlm` command. Each subcommand lives in `mmldlm/commands/<name>.py`, which defines
`add_arguments(parser)` and `run(args) -> int`, imports only argparse-level things at the top and
the library inside `run`, so `mmldlm --help` stays fast.

A UserError (a bad config key, option, file or dataset: mmldlm/errors.py) prints as one line
`mmldlm CMD: message` with exit status 2; `mmldlm --debug CMD ...` or MMLDLM_DEBUG=1 shows its
traceback too. SIGINT (Ctrl-C) and SIGTERM end a command with one line, what it kept and how to
continue, and exit status 128 + the signal's number (130, 143). Any other exception is a bug and keeps
its traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from mmldlm.errors import Interrupted, UserError, signals_raise

# subcommand -> (module under mmldlm.commands, one-line help)
COMMANDS = {
    "bench": ("bench", "baseline vs optimized training speed and memory in one run; --ladder: one switch at a time"),
    "model-info": ("model_info", "parameter counts per part and training FLOPs of a model preset"),
    "prepare": ("prepare", "corpus -> tokenizer, token shards, sentence-encoder latent shards and meta.json"),
    "train": ("train", "train a model (under torchrun for many processes/nodes); --resume auto continues a run"),
    "monitor": ("monitor", "follow a run's metrics.jsonl: status, alerts, health report (JSON), plot (PNG)"),
    "check": ("check", "audit a config and its environment for critical issues; --fix writes a corrected config"),
    "migrate": (
        "migrate",
        "take a run of the older codebase over: its Hydra config and launcher -> our run config, an audit, "
        "the next commands",
    ),
    "sample": ("sample", "text from latents (l2t), latents from text (t2l) or both (joint) from a trained run"),
    "eval": (
        "evaluate",
        "validation ELBO per mode, l2t reconstruction, t2l retrieval, joint generation and how the text reads",
    ),
    "compare": (
        "compare",
        "two runs on the same validation texts and seeds: each figure's difference and its paired 95% interval",
    ),
    "export": (
        "export",
        "a trained model as a self-contained folder (config.json, model.safetensors, tokenizer, "
        "model card) for MMLDLM.from_pretrained",
    ),
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help names its default: argparse's "(default: X)" is added where the text does
    not say it already. Flags (off unless given) and options whose default is worked out at run time
    (None; their text says how) are left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmldlm", description="MM-LDLM: multimodal latent diffusion language models")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an input error too (also MMLDLM_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"mmldlm.commands.{module_name}")
        # argparse %-formats the help of the command list, never a description: "95%" must read "95%%" there
        p = sub.add_parser(
            name, help=help_text.replace("%", "%%"), description=help_text, formatter_class=DefaultsHelpFormatter
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The top level (--debug, the command) as argparse reads it; then the command's own arguments with
    its options and positionals intermixed, so that an override may stand anywhere among the options
    (`mmldlm train --init-from runs/default train.steps=500`): argparse alone reads a command's
    positionals in one run and refuses the ones after an option."""
    argv = sys.argv[1:] if argv is None else list(argv)
    top, _ = build_parser().parse_known_args(argv)
    command_args = argv[argv.index(top.command) + 1 :]  # only --debug may stand before the command
    namespace = argparse.Namespace(debug=top.debug, command=top.command)
    return top._parser.parse_intermixed_args(command_args, namespace=namespace)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        with signals_raise(Interrupted):  # train takes them over in its loop, to checkpoint first
            return int(args._run(args) or 0)
    except UserError as err:
        if args.debug or os.environ.get("MMLDLM_DEBUG") == "1":
            traceback.print_exc()
        print(f"mmldlm {args.command}: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        kept = stop.kept or "nothing was written; the same command starts over"
        print(f"mmldlm {args.command}: stopped by {stop}; {kept}", file=sys.stderr, flush=True)
        return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main())
