"""`mmldlm sample --run RUN_DIR --mode l2t|t2l|joint ...`: text from latents, latents from text, or
both together, from a trained run (its newest checkpoint unless --checkpoint) or an exported model
folder (`mmldlm export`). The samplers are the Python API's (MMLDLM in mmldlm/export/pretrained.py):
the same seed gives the same samples here and there.

    mmldlm sample --run runs/default --mode l2t --text "a small dog"        # encode, then decode back
    mmldlm sample --run runs/default --mode l2t --latents z.npy --length 12
    mmldlm sample --run runs/default --mode l2t --num 8                     # the first 8 validation latents
    mmldlm sample --run exported --mode l2t --num 8 --data DIR              # an export has no dataset of its own
    mmldlm sample --run runs/default --mode t2l --text-file lines.txt --latents-out z.npy
    mmldlm sample --run runs/default --mode joint --num 4 --out pairs.jsonl --latents-out z.npy

Writes one JSON record per sample to --out (default: stdout). Text length (in tokens; the model has no
end-of-text token, see mmldlm/sampling/sampler.py): the source text's length when there is a source
text (l2t from --text or validation), else --length, else (l2t from --latents) the model's length
head's most likely length for each latent, else drawn from the validation split's lengths. A source
text longer than the model reads (the length training cut texts to) is cut to its start: stderr says
how many texts and tokens, each record carries "cut" and "num_tokens_cut", and l2t encodes the cut text,
so that its latent and its length describe the same words (its "source").
"""

from __future__ import annotations

import argparse
import sys
import typing
import warnings

from mmldlm.config import SamplingOptions
from mmldlm.wording import counted


def add_model_arguments(parser, what: str) -> None:
    """--run, --checkpoint, --no-ema: which trained weights (sample, eval and export)."""
    parser.add_argument("--run", required=True, metavar="RUN_DIR", help=what)
    parser.add_argument(
        "--checkpoint", metavar="PATH", help="a checkpoint directory (default: the run's newest that verifies)"
    )
    parser.add_argument(
        "--no-ema",
        action="store_true",
        help="the raw trained weights instead of their EMA (where the run kept one, train.ema_decay)",
    )


def ema_choice(args: argparse.Namespace) -> bool | None:
    """The `use_ema` of --no-ema: False (the raw weights), else None (the EMA where the checkpoint holds one)."""
    return False if args.no_ema else None


# The SamplingOptions fields that `sample`, `eval` and `compare` take, in the order of their --help.
SAMPLER_OPTIONS = (
    "num_steps",
    "latent_steps",
    "latent_shift",
    "temperature",
    "strategy",
    "repetition_penalty",
    "remask_rounds",
    "remask",
    "remask_cap",
    "remask_fraction",
    "best_of",
    "correction_rounds",
    "correction_proposals",
    "joint_order",
    "length_candidates",
)


def option_flag(name: str) -> str:
    """The command-line option of SamplingOptions field `name`: --NAME in dashes unless the field names one."""
    return SamplingOptions.__dataclass_fields__[name].metadata["flag"] or "--" + name.replace("_", "-")


def add_sampler_arguments(group, names: tuple[str, ...] = SAMPLER_OPTIONS) -> None:
    """SamplingOptions fields as command-line options (sample and eval), each with its field's help, type
    or choices, and default: the field's where the help shows it (%(default)s, or the "(default: X)"
    argparse adds to a text that does not say it), else None, which SamplingOptions.defaults fills with
    the run's or the field's (the text says which); a field on by default is a flag that turns it off."""
    hints = typing.get_type_hints(SamplingOptions)
    for name in names:
        field, flag, tp = SamplingOptions.__dataclass_fields__[name], option_flag(name), hints[name]
        if tp is bool:
            action = "store_false" if field.default else "store_true"
            group.add_argument(flag, action=action, dest=name, help=field.metadata["help"])
            continue
        if typing.get_origin(tp) is typing.Literal:
            kind = {"choices": typing.get_args(tp)}
        else:
            value_type = next(arg for arg in typing.get_args(tp) or (tp,) if arg is not type(None))
            kind = {"type": value_type, "metavar": flag[2:].upper().replace("-", "_")}
        text = field.metadata["help"]
        default = field.default if "%(default)" in text or "default" not in text else None
        group.add_argument(flag, dest=name, default=default, help=text, **kind)


def add_device_arguments(group) -> None:
    """--device, --threads, --quiet (sample and eval)."""
    group.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N",
        help="auto: the GPU when there is one, else the CPU; cuda:N the N-th visible GPU",
    )
    group.add_argument(
        "--threads",
        default="0",
        metavar="auto|0|N",
        help="CPU threads for torch: auto (the CPUs other processes leave free), 0 (torch's default: one "
        "per core) or N; on a CPU other jobs share, more threads than free cores run far slower",
    )
    group.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars or stage lines on stderr (they are shown only when stderr is a terminal)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "a training run directory or an exported model folder (mmldlm export)")
    parser.add_argument("--mode", required=True, choices=["l2t", "t2l", "joint"])
    src = parser.add_argument_group("source")
    src.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="a source text (repeatable): l2t encodes it with the run's sentence encoder first",
    )
    src.add_argument(
        "--text-file",
        metavar="FILE",
        help="source texts, one per line; blank lines are skipped and keep their number: a record's index "
        "is its line's (0-based, after any --text)",
    )
    src.add_argument("--latents", metavar="FILE.npy", help="l2t: latents (N, K, D) or (N, D) in the encoder's space")
    src.add_argument(
        "--data",
        metavar="DIR",
        help="l2t without --text/--latents: the prepared dataset whose validation latents are decoded "
        "(default: the run's own; an exported model has none)",
    )
    src.add_argument(
        "--num",
        type=int,
        default=8,
        help="joint: pairs to generate; l2t without --text/--latents: validation samples (default 8)",
    )
    src.add_argument(
        "--length",
        type=int,
        help="text length in tokens where no source text gives one (default: l2t asks the model's "
        "length head, joint draws from the validation split)",
    )
    opt = parser.add_argument_group("sampling")
    add_sampler_arguments(opt, (*SAMPLER_OPTIONS, "guidance_scale", "latent_sampler", "reuse_output"))
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--batch-size", type=int, default=64)
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="FILE.jsonl", help="JSON lines, one per sample (default: stdout)")
    out.add_argument("--latents-out", metavar="FILE.npy", help="t2l/joint: the latents (N, K, D), encoder space")
    add_device_arguments(out)


def sampling_options(args: argparse.Namespace, run, **options) -> SamplingOptions:
    """The run's sampler defaults with the SamplingOptions fields the command line gives and `options`,
    checked: OptionError naming the option of a value that cannot be used."""
    given = {name: value for name, value in vars(args).items() if name in SamplingOptions.__dataclass_fields__}
    flags = {name: option_flag(name) for name in given}
    given.update(options)
    text, latent = run.cfg.text_diffusion, run.cfg.latent_diffusion
    sampling = SamplingOptions.defaults(text, latent, given.pop("num_steps"), **given)  # --steps: both samplers'
    sampling.check(flags)
    return sampling


def _read_texts(args) -> tuple[list[str], list[int]]:
    """The source texts of --text and --text-file (its non-blank lines), and the index of each in that
    input: the --text in order, then the file's lines, a skipped blank line keeping its number (line L
    of the file is index len(--text) + L - 1). OptionError for a blank --text, DataError for a file that
    cannot be read or holds no text."""
    from mmldlm.data.errors import DataError
    from mmldlm.errors import OptionError

    for text in args.text or []:
        if not text.strip():
            raise OptionError("--text", text, "a text with at least one character that is not a space")
    texts = list(args.text or [])
    index = list(range(len(texts)))
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8-sig") as f:  # -sig: a byte order mark is not text
                lines = [(i, line.rstrip("\n")) for i, line in enumerate(f, start=len(texts)) if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(
                f"--text-file {args.text_file}: cannot be read ({err}); expected a UTF-8 text file, "
                f"one source text per line"
            ) from None
        if not lines:
            raise DataError(f"--text-file {args.text_file}: no line with text; expected one source text per line")
        index += [i for i, _ in lines]
        texts += [line for _, line in lines]
    return texts, index


def _read_latents(path: str, num_latents: int, latent_dim: int) -> torch.Tensor:  # noqa: F821
    """Latents (N, K, D) from a .npy file of (N, K, D), or (N, D) when K = 1; DataError for a file
    that is not such an array, holds no latent, or holds NaN or inf."""
    import numpy as np
    import torch

    from mmldlm.data.errors import DataError

    K, D = num_latents, latent_dim
    expected = f"(N, {K}, {D})" + (f" or (N, {D})" if K == 1 else "")
    try:
        array = np.load(path)  # never unpickles: allow_pickle is off by default
    except (OSError, ValueError, EOFError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else "not a .npy file"
        raise DataError(f"--latents {path}: {reason}; expected a .npy array {expected} (numpy.save)") from None
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.number):
        raise DataError(f"--latents {path}: not an array of numbers; expected a .npy array {expected} (numpy.save)")
    if array.ndim == 2 and K == 1:
        array = array[:, None, :]
    if array.ndim != 3 or array.shape[1:] != (K, D):
        raise DataError(f"--latents {path}: latents of shape {array.shape}; expected {expected} for this run")
    if len(array) == 0:
        raise DataError(f"--latents {path}: holds no latent; expected {expected} with N >= 1")
    bad = np.flatnonzero(~np.isfinite(array).all(axis=(1, 2)))
    if len(bad):
        raise DataError(
            f"--latents {path}: {len(bad)} of {len(array)} latents hold NaN or inf (rows "
            f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''}); expected finite numbers"
        )
    return torch.from_numpy(array.astype(np.float32))


def _sources(args, run) -> tuple[list[str] | None, torch.Tensor | None, list[int] | None]:  # noqa: F821
    """(source texts or None, latents or None, the input index of each source text or None) from the
    arguments."""
    from mmldlm.data.errors import DataError

    texts, index = _read_texts(args)
    if args.latents:
        if args.mode != "l2t":
            raise DataError("--latents is a source for --mode l2t only")
        if texts:
            raise DataError("--latents and --text/--text-file are two sources of l2t; give one")
        return None, _read_latents(args.latents, run.cfg.model.num_latents, run.cfg.model.latent_dim), None
    if texts:
        return texts, None, index
    if args.mode == "t2l":
        raise DataError("--mode t2l needs --text or --text-file")
    return None, None, None


def _note_cuts(run, cuts: list[int]) -> list[int]:
    """`cuts`, the tokens of each source text the model cannot read (past its max_length), said on
    stderr once where there are any."""
    note = run.cut_note(cuts)
    if note is not None:
        print(f"mmldlm sample: {note}", file=sys.stderr)
    return cuts


def _cut(cuts: list[int] | None, i: int) -> dict:
    """The record fields of source text i's cut: {"cut", "num_tokens_cut"} (none without source texts)."""
    return {} if cuts is None else {"cut": cuts[i] > 0, "num_tokens_cut": cuts[i]}


def run(args: argparse.Namespace) -> int:
    from mmldlm.progress import note, reporting  # light (tqdm): the first line comes before torch loads

    with reporting(False if args.quiet else "auto"):
        note(f"mmldlm sample: loading {args.run}")
        return _sample(args)


def _sample(args: argparse.Namespace) -> int:
    import dataclasses

    from mmldlm.device import keep_freed_memory, pick_device
    from mmldlm.errors import OptionError
    from mmldlm.export.pretrained import MMLDLM
    from mmldlm.threads import set_threads

    _check_arguments(args)
    set_threads(args.threads)
    keep_freed_memory()  # the samplers' vocabulary-wide tensors, reused instead of faulted in at every step
    device = str(pick_device(args.device, key="--device"))
    model = MMLDLM.from_pretrained(args.run, checkpoint=args.checkpoint, device=device, use_ema=ema_choice(args))
    run = model.run
    if args.length is not None and args.length > run.cfg.model.max_seq_len:
        raise OptionError(
            "--length", args.length, f"an integer in [1, {run.cfg.model.max_seq_len}] (model.max_seq_len of this run)"
        )
    # Checked here, before any sampling, so that a bad value is named by its option.
    sampling = sampling_options(args, run)
    options = dict(
        dataclasses.asdict(sampling),
        batch_size=args.batch_size,
        seed=args.seed,
        progress=False if args.quiet else "auto",
    )
    texts, latents, index = _sources(args, run)
    texts, latents, ids, cuts = _inputs(args, run, texts, latents)
    records, z = _records(args, model, options, texts, latents, ids, cuts)
    _write(args, records, z, index)
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """OptionError for a count that is not positive or an output path whose directory does not exist,
    before the model loads."""
    import os

    from mmldlm.errors import OptionError, require_positive
    from mmldlm.threads import parse_threads

    require_positive({"--num": args.num, "--length": args.length, "--batch-size": args.batch_size})
    args.threads = parse_threads(args.threads)
    for option, path in (("--out", args.out), ("--latents-out", args.latents_out)):
        # Checked before sampling: a run of many samples must not be lost to a typo in the path.
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise OptionError(option, path, "a file in an existing directory")


def _inputs(args, run, texts, latents) -> tuple:
    """The inputs of every sample: (texts, latents, token ids, cuts); token ids and cuts when there is a
    source text, latents for l2t (encoded from the source texts, or the first --num validation samples)."""
    import numpy as np
    import torch

    from mmldlm.progress import note

    ids = run.tokenize(texts) if texts is not None else None
    cuts = _note_cuts(run, run.tokens_cut(texts)) if texts is not None else None
    if args.mode == "l2t" and latents is None:
        if texts is not None:
            texts = run.decode(*run.batch_of(ids)) if any(cuts) else texts  # the words the length is of
            note(f"encoding {counted(len(texts), 'source text')} with the sentence encoder")
            latents = run.encode_latents(texts)
        else:  # the first --num validation samples
            if args.data:
                run.use_eval_data(args.data, "val")
            n = min(args.num, len(run.val))
            samples = [run.val[i] for i in range(n)]
            ids = [s[1][: run.max_length].tolist() for s in samples]
            cuts = _note_cuts(run, [max(len(s[1]) - run.max_length, 0) for s in samples])
            texts = run.decode(*run.batch_of(ids))
            latents = torch.stack([torch.from_numpy(s[2].astype(np.float32)) for s in samples])
    return texts, latents, ids, cuts


def _records(args, model, options: dict, texts, latents, ids, cuts) -> tuple[list[dict], torch.Tensor | None]:  # noqa: F821
    """The samples of --mode as JSON records, and the latents (t2l, joint; else None)."""
    num = len(ids) if ids is not None else (len(latents) if latents is not None else args.num)
    given = [max(len(x), 1) for x in ids] if ids is not None else args.length
    lengths = model.text_lengths(num, given, latents if args.mode == "l2t" else None, args.seed)

    z = None
    if args.mode == "l2t":
        out = model.decode(latents, lengths, **options)
        records = [
            {"index": i, **({"source": texts[i]} if texts else {}), "text": t, "length": lengths[i], **_cut(cuts, i)}
            for i, t in enumerate(out)
        ]
    elif args.mode == "t2l":
        with warnings.catch_warnings():  # _note_cuts said what was cut, in the command's words
            warnings.simplefilter("ignore")
            z = model.encode(texts, **options)
        records = [
            {"index": i, "text": t, "latent_norm": round(z[i].norm().item(), 4), **_cut(cuts, i)}
            for i, t in enumerate(texts)
        ]
    else:
        out, z = model.generate(num, lengths, **options)
        records = [
            {"index": i, "text": t, "length": lengths[i], "latent_norm": round(z[i].norm().item(), 4)}
            for i, t in enumerate(out)
        ]
    return records, z


def _write(args, records: list[dict], z, index: list[int] | None) -> None:
    """The records to --out (or stdout), each indexed by its source text's place in the input, and the
    latents to --latents-out."""
    import json
    from pathlib import Path

    import numpy as np

    from mmldlm.outputs import write_atomically

    for record in records if index else []:  # a record's index is its source text's place in the input
        record["index"] = index[record["index"]]
    written = []
    if args.latents_out and z is not None:  # whole or not at all, under the name np.save gives it
        latents_out = Path(args.latents_out if args.latents_out.endswith(".npy") else f"{args.latents_out}.npy")
        write_atomically(latents_out, lambda f: np.save(f, z.numpy()))
        written.append(f"latents {tuple(z.shape)} to {latents_out}")
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    if args.out:
        write_atomically(Path(args.out), lines)
        written.insert(0, f"{counted(len(records), 'record')} to {args.out}")
    else:
        sys.stdout.write(lines)
    if written:  # on stdout only where the records did not go there
        print(f"mmldlm sample: wrote {' and '.join(written)}", file=sys.stdout if args.out else sys.stderr)
    if args.mode in ("t2l", "joint") and not args.latents_out:
        print("mmldlm sample: latents not written (give --latents-out FILE.npy to keep them)", file=sys.stderr)
