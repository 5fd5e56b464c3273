"""`mmldlm export --run RUN_DIR [--checkpoint PATH] --out DIR`: a trained model as a self-contained
folder that `MMLDLM.from_pretrained(DIR)`, `mmldlm sample --run DIR` and `mmldlm eval --run DIR --data
PATH` load with no run directory or dataset (layout: mmldlm/export/pretrained.py; model card:
mmldlm/export/card.py). The folder is written beside DIR under a temporary name and renamed into
place when complete, so DIR never holds half an export; an existing export is replaced only with --force,
and a folder holding anything mmldlm did not write never is (mmldlm/outputs.py)."""

from __future__ import annotations

import argparse

from mmldlm.commands.sample import add_model_arguments, ema_choice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "a training run directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument(
        "--force", action="store_true", help="replace DIR when it is an exported model (nothing else is replaced)"
    )


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile
    from pathlib import Path

    from mmldlm.data.errors import DataError
    from mmldlm.export.pretrained import EXPORTED, MMLDLM
    from mmldlm.outputs import as_umask_allows, publish, refuse_foreign

    out = Path(args.out)
    source = Path(args.run).resolve()
    if out.resolve() == source or out.resolve() in source.parents:
        raise DataError(
            f"--out {out}: is the model's own folder {args.run}, or holds it; replacing it would delete "
            f"what is being exported: choose another --out"
        )
    refuse_foreign(out, EXPORTED)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise DataError(f"--out {out}: holds an exported model; choose another --out or pass --force to replace it")
    model = MMLDLM.from_pretrained(args.run, checkpoint=args.checkpoint, device="cpu", use_ema=ema_choice(args))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    as_umask_allows(partial)
    try:
        model.save_pretrained(partial)
    except BaseException:
        shutil.rmtree(partial)
        raise
    publish(partial, out, EXPORTED)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"mmldlm export: wrote {out} ({files}; {model.run.weights} weights of step {model.run.step})")
    return 0
